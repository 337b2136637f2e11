"""Smoke test of benchmarks/compare.py on the CPU: random tiny backbone, tiny timing settings."""
from __future__ import annotations

import json

import torch

from benchmarks import compare
from timm_dora import Actor
from timm_dora.evaluate import load_model

from test_evaluate import make_dataset


def save_half_open_actor(folder, **actor_kw):
    """A random actor for a random 64-px ViT-Ti whose gates open about half the time, saved in
    ``folder``; returns the folder."""
    model = load_model("vit_tiny_patch16_224", random_weights=True, img_size=64)
    torch.manual_seed(0)
    actor = Actor.for_model(model, **actor_kw)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(0.0)
    actor.save_pretrained(folder, backbone=model)
    return folder


def test_compare_smoke(tmp_path):
    csv_path = make_dataset(tmp_path, n_test=6, n_dev=1)
    save_half_open_actor(tmp_path / "actor")
    out = tmp_path / "out"
    results = compare.main([
        "--models", "vit_tiny_patch16_224", "--random-weights", "--img-size", "64", "--device", "cpu",
        "--data", str(csv_path), "--r", "1", "3", "--static-reductions", "0.3", "--static-blocks", "2", "5",
        "--batch", "4", "--warmup", "1", "--iters", "1", "--repeats", "1", "--workers", "0",
        "--actor", str(tmp_path / "actor"), "--out", str(out), "--cuda-graphs",
    ])
    res = json.loads((out / "compare_vit_tiny_patch16_224.json").read_text())
    assert res["model"] == results[0]["model"] and res["data"]["images"] == 6
    assert res["protocol"]["batches"] == 1 and res["protocol"]["iters"] == 1
    names = [r["method"] for r in res["rows"]]
    assert names[0] == "native" and names[1:3] == ["tome(r=1)", "tome(r=3)"] and names[-2:] == ["dora", "dora-cuda-graphs"]
    dora, graphs = res["rows"][-2:]  # the graph-replayed forward (uncaptured on the CPU) decides the same
    assert graphs["per_block"] == dora["per_block"] and graphs["gflops"] == dora["gflops"]
    assert abs(graphs["top1"] - dora["top1"]) < 1e-9 and graphs["agreement"] == dora["agreement"]
    assert any(n.startswith("static-cls_sim(") for n in names) and any(n.startswith("static-slice(") for n in names)
    for r in res["rows"]:
        assert r["images"] == 6 and r["images_per_s"] > 0 and r["gflops"] > 0 and r["attention_ops"]
    assert res["command"].startswith("python -m benchmarks.compare --models ") and res["torch"] == torch.__version__
    assert "| Backbone | Method |" in res["matched"]["table"]
    assert [r["method"] for r in res["matched"]["rows"]][-2:] == ["Average of baselines", "DORA"]
    # App. F.1: every substitution keeps DORA's gates and budgets: identical per-block statistics
    dora = next(r for r in res["rows"] if r["method"] == "dora")
    subs = {r["method"]: r for r in res["selector_substitution"]}
    assert sorted(subs) == ["attention-wpr", "random", "similarity"]
    for r in subs.values():
        assert r["images"] == 6 and r["per_block"] == dora["per_block"]


def test_compare_graph_row_of_a_merging_actor(tmp_path):
    """A merging actor runs from the graph runner too: with ``--cuda-graphs`` its graph row (off
    CUDA the same segments, uncaptured) folds as the ``dora`` row does, with the same decisions."""
    csv_path = make_dataset(tmp_path, n_test=4, n_dev=1)
    save_half_open_actor(tmp_path / "actor", merge=True)
    (res,) = compare.main([
        "--models", "vit_tiny_patch16_224", "--random-weights", "--img-size", "64", "--device", "cpu",
        "--data", str(csv_path), "--r", "1", "--static-reductions", "0.3", "--static-blocks", "2", "--selectors",
        "--batch", "4", "--warmup", "1", "--iters", "1", "--repeats", "1", "--workers", "0",
        "--actor", str(tmp_path / "actor"), "--out", str(tmp_path / "out"), "--cuda-graphs",
    ])
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows)[-2:] == ["dora", "dora-cuda-graphs"] and "dora_cuda_graphs" not in res
    dora, graphs = rows["dora"], rows["dora-cuda-graphs"]
    assert graphs["per_block"] == dora["per_block"] and graphs["gflops"] == dora["gflops"] and graphs["top1"] == dora["top1"]
    assert any(b["gate_rate"] for b in dora["per_block"])
