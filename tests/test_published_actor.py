"""The published actors on the real backbones (issue #7).

For every ``tests/data/actor_reference_*.json`` (written by ``benchmarks/record_actor_reference.py``
when an actor is published): the real backbone from ``../shared/weights`` is wrapped with **no
actor argument**, so the actor comes through the registry from the package exactly as a user's
would (``HF_HUB_OFFLINE=1``: no Hub involved), and its decisions (gate and removed tokens per
block), predictions, GFLOPs and top-1 on the recorded slice of the test split must equal the
recorded ones.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import timm_dora
from timm_dora.data import eval_transform, open_split
from timm_dora.backbone import create_backbone

from helpers import SHARED, needs_shared, offline  # noqa: F401 (offline: fixture)

REPO = Path(__file__).resolve().parents[1]
REFERENCES = sorted((REPO / "tests" / "data").glob("actor_reference_*.json"))


def test_every_published_actor_has_a_reference():
    published = sorted(p.parent.name for p in (REPO / "timm_dora" / "hub" / "actors").glob("*/model.safetensors"))
    recorded = sorted(json.loads(p.read_text())["model"] for p in REFERENCES)
    assert published == recorded


@needs_shared
@pytest.mark.parametrize("ref_path", REFERENCES, ids=[p.stem for p in REFERENCES])
def test_published_actor_reproduces_recorded_decisions(ref_path, offline):
    ref = json.loads(ref_path.read_text())
    name = ref["model"]
    folder = timm_dora.hub.packaged_actor(name)
    assert folder == REPO / "timm_dora" / "hub" / "actors" / name
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == ref["actor_sha256"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference was recorded single-threaded
    try:
        _check(ref, name)
    finally:
        torch.set_num_threads(threads)


def _check(ref: dict, name: str) -> None:
    """Wrap the real backbone with the registered actor and compare with the recorded run."""
    model = create_backbone(name, str(SHARED / "weights" / ref["weights"]))
    ds = open_split(str(SHARED / "data" / "imagenet-mini" / "labels.csv"), "test", eval_transform(model))
    n = len(ref["images"])
    assert [Path(p).name for p in ds.paths[:n]] == ref["images"]
    x = torch.stack([ds[i][0] for i in range(n)])
    y = torch.tensor([ds[i][1] for i in range(n)])
    with torch.no_grad():
        native = model(x).argmax(1)
        timm_dora.wrap(model)  # no actor: the registered one, shipped in the package
        pred = model(x).argmax(1)
    stats = model.dora_stats

    assert y.tolist() == ref["labels"]
    assert native.tolist() == ref["native_pred"]
    assert stats.gate.long().tolist() == ref["gate"]
    assert stats.removed.tolist() == ref["removed"]
    assert pred.tolist() == ref["dora_pred"]
    assert torch.allclose(stats.gflops, torch.tensor(ref["gflops"], dtype=stats.gflops.dtype), rtol=0, atol=1e-9)
    assert int((pred == y).sum()) == ref["dora_correct"] and int((native == y).sum()) == ref["native_correct"]
