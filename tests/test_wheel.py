"""The built wheel ships the published actors: installed alone (no dependencies: torch and timm come
from the environment), with ``HF_HUB_OFFLINE=1`` and the repository out of the path,
``timm_dora.wrap(model)`` finds the registered ViT-Ti actor in the installed package data."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"

SCRIPT = r"""
import hashlib, json, os, sys
site, repo = sys.argv[1], sys.argv[2]
sys.path.insert(0, site)
assert not any(os.path.abspath(p or ".") == repo for p in sys.path[1:]), "the repository is on the path"
import timm, torch
import timm_dora
from timm_dora.hub import ACTORS_DIR

torch.manual_seed(0)
model = timm.create_model(sys.argv[3], pretrained=False).eval()  # random weights, the model's pretrained_cfg
timm_dora.wrap(model)  # no actor: the registered one
with torch.no_grad():
    logits = model(torch.randn(2, 3, 224, 224))
weights = ACTORS_DIR / sys.argv[3] / "model.safetensors"
print(json.dumps({
    "package": timm_dora.__file__, "actors": str(ACTORS_DIR), "logits": list(logits.shape),
    "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    "actor_params": sum(p.numel() for p in model.dora_actor.parameters()),
    "offline": os.environ.get("HF_HUB_OFFLINE"),
}))
"""


def test_installed_wheel_wraps_the_registered_actor_offline(tmp_path):
    dist, site, src = tmp_path / "dist", tmp_path / "site", tmp_path / "src"
    # built from a copy of the sources: no stale build/ or egg-info of the checkout decides what ships
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs", "dist"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dist),
                    str(src)], check=True, cwd=tmp_path)
    wheel = next(dist.glob("timm_dora-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(site), str(REPO), NAME], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["package"] == str(site / "timm_dora" / "__init__.py")
    assert res["actors"] == str(site / "timm_dora" / "hub" / "actors")
    published = REPO / "timm_dora" / "hub" / "actors" / NAME / "model.safetensors"
    assert res["sha256"] == hashlib.sha256(published.read_bytes()).hexdigest()
    assert res["logits"] == [2, 1000] and res["actor_params"] > 0 and res["offline"] == "1"
