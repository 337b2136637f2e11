"""Lanes (``timm_dora.engine.lanes``, ``EngineOptions.lanes``): a large batch as independent planned
forwards. On the CPU the lanes run one after another (uncaptured planned segments); on CUDA side by
side, each lane's graphs captured on a stream of its own."""
from types import SimpleNamespace

import pytest
import torch

import timm_dora
from timm_dora.engine import lanes, whole
from timm_dora.engine import patch as patch_module
from timm_dora.engine.flops import native_gflops
from timm_dora.engine.options import EngineOptions, using

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import SMALL_FAMILIES, assert_same_forwards, gate_forced_actor, images, kind_actor, make_model


def _run(model, xs, **wrap_kw):
    timm_dora.wrap(model, **wrap_kw)
    try:
        with torch.inference_mode():
            return [(model(x), model.dora_stats) for x in xs], timm_dora.engine_info(model)
    finally:
        timm_dora.unwrap(model)


def _assert_same(got, ref):
    """Logits within float32 rounding, the decisions, FLOPs and removed patches equal."""
    for (oa, sa), (ob, sb) in zip(got, ref, strict=True):
        torch.testing.assert_close(oa, ob, rtol=0, atol=1e-5)
        for field in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        for pa, pb in zip(sa.removed_patches, sb.removed_patches, strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


def test_lane_sizes_split_a_large_batch_whose_share_plans():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = lambda b: torch.empty(b, 3, *model.patch_embed.img_size)  # (only the shape is read)
    with using(EngineOptions()):  # defaults: 2 lanes from 256 images
        assert lanes.lane_sizes(model, x(320)) == [160, 160]
        assert lanes.lane_sizes(model, x(257)) == [129, 128]
        assert lanes.lane_sizes(model, x(255)) is None
    with using(EngineOptions(lanes=3, lanes_min_batch=8)):
        assert lanes.lane_sizes(model, x(320)) == [107, 107, 106]
        assert lanes.lane_sizes(model, x(8)) == [3, 3, 2]
    with using(EngineOptions(lanes=1)):
        assert lanes.lane_sizes(model, x(320)) is None
    with using(EngineOptions(planned=False)):
        assert lanes.lane_sizes(model, x(320)) is None
    share = 160 * native_gflops(model)  # a share of 160 images planned by its GFLOPs, not above them
    with using(EngineOptions(planned_max_gflops=share)):
        assert lanes.lane_sizes(model, x(320)) == [160, 160]
    with using(EngineOptions(planned_max_gflops=share * 0.99)):
        assert lanes.lane_sizes(model, x(320)) is None
    with using(EngineOptions(planned_max_gflops=0, planned_max_batch=160)):
        assert lanes.lane_sizes(model, x(320)) == [160, 160]
    with using(EngineOptions(planned_max_gflops=0, planned=True)):
        assert lanes.lane_sizes(model, x(320)) == [160, 160]


def test_concat_statistics_puts_the_lanes_images_in_order():
    def part(tokens, patches):
        t = torch.tensor(tokens)
        return SimpleNamespace(tokens=t, gate=t > 0, removed=t * 2, gflops=t.double(), policy_gflops=t.double() / 2,
                               backend="b", removed_patches=patches)
    a = part([[3, 2], [4, 4]], [None, (torch.tensor([1]), torch.tensor([7]))])
    b = part([[1, 1]], [(torch.tensor([0, 0]), torch.tensor([2, 5])), (torch.tensor([0]), torch.tensor([3]))])
    c = part([[5, 0], [6, 6], [0, 1]], [None, None])
    got = lanes.concat_statistics([a, b, c], [2, 1, 3])()
    assert got["tokens"].tolist() == [[3, 2], [4, 4], [1, 1], [5, 0], [6, 6], [0, 1]]
    assert got["removed"].tolist() == [[6, 4], [8, 8], [2, 2], [10, 0], [12, 12], [0, 2]]
    assert got["gate"].tolist() == [[True, True], [True, True], [True, True], [True, False], [True, True],
                                    [False, True]]
    assert got["policy_gflops"].tolist() == [[1.5, 1.0], [2.0, 2.0], [0.5, 0.5], [2.5, 0.0], [3.0, 3.0], [0.0, 0.5]]
    assert got["backend"] == "b"
    first, second = got["removed_patches"]
    assert first[0].tolist() == [2, 2] and first[1].tolist() == [2, 5]  # (lane b's image 0 is image 2)
    assert second[0].tolist() == [1, 2] and second[1].tolist() == [7, 3]
    assert lanes.concat_statistics([c], [3])()["removed_patches"] == [None, None]


@pytest.mark.parametrize("merge", [False, True])
def test_lanes_equal_the_eager_executor(merge, engine_options):
    """Uncaptured on the CPU: 9 images padded to 10, two lanes of 5 (the second holds one padding
    image); the same images again (the plans hold), then others (a plan may miss: that lane runs
    again eagerly)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")  # forced open at blocks 1, 4 and 7
    xs = [images(model, 9, seed=s) for s in (1, 1, 2, 1)]
    ref, _ = _run(model, xs, actor=actor, cuda_graphs=False, merge=merge)
    engine_options(planned=True, rows_bucket=1, lanes=2, lanes_min_batch=9)
    got, info = _run(model, xs, actor=actor, cuda_graphs=True, merge=merge)
    _assert_same(got, ref)
    assert info["lanes"] == 2 and info["graph"] == "planned"
    assert sorted((s["batch"], s["lane"]) for s in info["batch_shapes"]) == [(5, 0), (5, 1)]
    assert ref[0][1].removed.sum() > 0 and got[0][1].removed_patches[1] is not None


def test_a_lane_whose_plan_does_not_hold_runs_again_eagerly(engine_options, monkeypatch):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")
    x = images(model, 8, seed=1)
    ref, _ = _run(model, [x], actor=actor, cuda_graphs=False)
    engine_options(planned=True, rows_bucket=1, lanes=2, lanes_min_batch=8)
    timm_dora.wrap(model, actor=actor, cuda_graphs=True)
    with torch.inference_mode():
        model(x)  # (observes: each lane's plan)
        first, second = model._dora.graphs.values()
        assert (first.lane, second.lane) == (0, 1) and first.plan is not None
        second.plan = whole.Plan(second.plan.rows, (False,) * 12)  # a gate opens outside the plan
        got = [(model(x), model.dora_stats)]
        assert (first.plan_misses, second.plan_misses) == (0, 1)
        assert any(second.plan.controls)  # (grown again from that forward)
        got.append((model(x), model.dora_stats))
    timm_dora.unwrap(model)
    _assert_same(got, ref * 2)
    assert (first.plan_misses, second.plan_misses) == (0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
def test_cuda_lanes_in_one_graph_equal_the_lanes_one_after_another(engine_options, monkeypatch):
    """Captured, merging, 2 x 160 images as one graph of two branches against each lane's own graph
    replayed one after the other: the same logits, bit for bit (each branch's GEMMs use their own
    cuBLAS workspace; graphs that shared one, replayed side by side, wrote over each other's sums:
    out-of-range indices on one H200). Then against the eager executor at 320 (the same decisions
    and logits up to bf16 rounding for most images: near-tied decisions and the fold's matches may
    go the other way at another batch shape)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = gate_forced_actor(model, [1]).to("cuda", torch.bfloat16)
    xs = [images(model, 320, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1, 2)]
    engine_options(rows_bucket=1)
    ref, _ = _run(model, xs, actor=actor, merge=True, cuda_graphs=False)
    side, info = _run(model, xs, actor=actor, merge=True)  # (observed eagerly, captured, replayed)
    assert info["lanes"] == 2 and info["graph"] == "planned"
    assert sorted((s["batch"], s["lane"]) for s in info["batch_shapes"]) == [(160, 0), (160, 1)]
    assert [s["graphs"] > 1 for s in sorted(info["batch_shapes"], key=lambda s: s["lane"])] == [True, False]
    assert all(s["plan_misses"] <= 1 for s in info["batch_shapes"])  # (the last two forwards replayed)
    monkeypatch.setattr(patch_module, "forward_lanes", lambda runners, chunks, fused: [
        whole.forward_whole(r, x, fused, r.plan) for r, x in zip(runners, chunks)])  # (a graph a lane)
    serial, _ = _run(model, xs, actor=actor, merge=True)
    assert_same_forwards(side, serial)
    for (oa, sa), (ob, sb) in zip(side, ref):
        same = (sa.removed == sb.removed).all(1) & (sa.gate == sb.gate).all(1)
        close = same & ((oa.float() - ob.float()).abs().amax(1) <= 3e-2)
        assert close.float().mean() >= 0.9, close.float().mean()
    assert sum(int(stats.removed.sum()) for _, stats in side) > 0
