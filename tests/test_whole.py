"""The whole forward as one graph (``timm_dora.engine.whole``), the captured executor of small batches.

On the CPU the same segments run uncaptured (``whole.WHOLE = True``): outputs and statistics must
equal the eager executor's. On CUDA: one graph replay per forward, no host synchronisation, the
same decisions as the per-block executor.
"""
import pytest
import torch

import timm_dora
from timm_dora import NoPrune
from timm_dora.engine import graphs as graphs_module
from timm_dora.engine import patch as patch_module
from timm_dora.engine import whole

from helpers import SMALL_FAMILIES, images, kind_actor, make_model


@pytest.fixture
def whole_calls(monkeypatch):
    """Counts the forwards run by the whole-forward executor."""
    calls = []
    real = patch_module.forward_whole

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(patch_module, "forward_whole", counted)
    monkeypatch.setattr(graphs_module, "ROWS_BUCKET", 1)
    return calls


def _forwards(model, xs, **wrap_kw):
    timm_dora.wrap(model, **wrap_kw)
    try:
        outs = []
        with torch.inference_mode():
            for x in xs:
                outs.append((model(x), model.dora_stats))
        return outs
    finally:
        timm_dora.unwrap(model)


@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
@pytest.mark.parametrize("family", ["deit", "deit_distilled", "dinov2_registers"])
def test_whole_forward_equals_the_eager_executor(family, kind, whole_calls, monkeypatch):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    actor = kind_actor(model, kind)
    xs = [images(model, 5, seed=s) for s in (1, 2, 1)]  # fixed buffers reused; a batch seen again
    ref = _forwards(model, xs, actor=actor, cuda_graphs=False)
    monkeypatch.setattr(whole, "WHOLE", True)
    got = _forwards(model, xs, actor=actor, cuda_graphs=True)
    assert len(whole_calls) == len(xs)
    for (oa, sa), (ob, sb) in zip(got, ref):
        torch.testing.assert_close(oa, ob, rtol=0, atol=2e-6)  # (the controller's products over every image)
        for field in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        for pa, pb in zip(sa.removed_patches, sb.removed_patches, strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])
    removed = ref[0][1].removed
    if kind == "closed":
        assert removed.sum() == 0
    else:
        assert removed.sum() > 0 and got[0][1].gate.any()


def test_only_a_deciding_actor_with_the_class_token_head_runs_whole(whole_calls, monkeypatch):
    monkeypatch.setattr(whole, "WHOLE", True)
    name, kw = SMALL_FAMILIES["vit_avgpool"]  # a pooled readout: the per-block executor
    model = make_model(name, **kw)
    x = images(model, 3)
    _forwards(model, [x], actor=kind_actor(model, "biased"), cuda_graphs=True)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    _forwards(model, [x], policy=NoPrune(), cuda_graphs=True)  # a policy that decides on the host
    assert whole_calls == []
    runner = graphs_module.GraphRunner(model, NoPrune(), x, "sdpa_loop", "model")
    assert "decides on the host" in whole.whole_reason(runner)


def test_whole_runs_by_default_only_when_captured_and_small(monkeypatch):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "biased")
    timm_dora.wrap(model, actor=actor)
    runner = graphs_module.GraphRunner(model, model._dora.policy, images(model, 3), "sdpa_loop", "model")
    assert whole.whole_reason(runner) is None
    assert not whole.runs_whole(runner)  # uncaptured (the CPU): only with WHOLE = True
    runner.capture = True
    assert whole.runs_whole(runner)
    monkeypatch.setattr(whole, "MAX_BATCH", 2)
    assert not whole.runs_whole(runner)
    monkeypatch.setattr(whole, "WHOLE", False)
    runner.batch = 1
    assert not whole.runs_whole(runner)
    timm_dora.unwrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
def test_whole_graph_on_cuda_is_one_replay_without_host_reads(kind, batch, monkeypatch):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, batch, seed=s).to("cuda", torch.bfloat16) for s in (1, 2)]
    monkeypatch.setattr(whole, "WHOLE", False)
    ref = _forwards(model, xs, actor=actor)
    monkeypatch.setattr(whole, "WHOLE", None)  # the default: whole at these sizes
    timm_dora.wrap(model, actor=actor)
    with torch.inference_mode():
        model(xs[0])  # captures
        runner = next(iter(model._dora.graphs.values()))
        assert [k for k in runner.graphs if k[0] != "reserve"] == [("whole", runner.triton_gate)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = [(model(x), model.dora_stats) for x in xs]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    info = timm_dora.engine_info(model)
    assert info["executor"] == "captured" and info["batch_shapes"][0]["graphs"] >= 1
    timm_dora.unwrap(model)
    for (oa, sa), (ob, sb) in zip(got, ref):
        # both run the controller on every image at padded rows, so the same products: same decisions
        assert torch.equal(sa.removed, sb.removed) and torch.equal(sa.gate, sb.gate)
        torch.testing.assert_close(oa.float(), ob.float(), rtol=0, atol=3e-2)
        assert torch.equal(sa.tokens, 16 - sa.removed.cumsum(1))
        assert torch.allclose(sa.gflops, sb.gflops)
