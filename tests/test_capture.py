"""Which executor runs a wrapped forward (#30, :mod:`timm_dora.engine.capture`): captured by default
where it can be, batch buckets, the fallback to eager, ``engine_info`` and ``release_graphs``.

On CPU ``cuda_graphs=True`` runs the captured executor's segments uncaptured (as in
``test_graphs.py``), so its batch padding, fallback and bookkeeping are checked here against the
eager forward; the CUDA tests at the end check the default on a GPU."""
import warnings

import pytest
import torch

import timm_dora
from timm_dora.engine import capture as capture_module
from timm_dora.engine import graphs as graphs_module
from timm_dora.engine.capture import batch_bucket
from timm_dora.engine.graphs import GraphRunner
from timm_dora.engine.flops import native_gflops
from timm_dora.engine.whole import one_graph_reason

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import SMALL_FAMILIES, images, kind_actor, make_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    name, kw = SMALL_FAMILIES["deit"]
    return make_model(name, **kw)


def _forward(model, x, calls: int = 1, **wrap_kw):
    """The last of ``calls`` forwards of ``x`` (a planned graph is captured by the second: the first
    runs eagerly to plan it)."""
    timm_dora.wrap(model, **wrap_kw)
    try:
        with torch.inference_mode():
            for _ in range(calls - 1):
                model(x)
            return model(x), model.dora_stats, timm_dora.engine_info(model)
    finally:
        timm_dora.unwrap(model)


def test_batch_buckets_round_to_three_significant_bits():
    assert [batch_bucket(b) for b in (1, 2, 7, 8)] == [1, 2, 7, 8]  # small batches as they are
    assert [batch_bucket(b) for b in (9, 10, 11, 13, 15, 16, 17)] == [10, 10, 12, 14, 16, 16, 20]
    assert [batch_bucket(b) for b in (33, 64, 65, 257, 320, 321, 1000)] == [40, 64, 80, 320, 320, 384, 1024]
    for b in range(9, 2049):  # at most four sizes per octave, less than a quarter of padding
        assert b <= batch_bucket(b) < 1.25 * b


def test_by_default_a_cpu_forward_runs_eagerly_without_a_word():
    model = _model()
    x = images(model, 3)
    actor = kind_actor(model, "biased")
    ref = _forward(model, x, actor=actor, cuda_graphs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, stats, info = _forward(model, x, actor=actor)
    assert torch.equal(out, ref[0]) and torch.equal(stats.removed, ref[1].removed)
    assert info["cuda_graphs"] is None and info["executor"] == "eager"
    assert info["reason"] == "the model is on cpu, not CUDA" and info["batch_shapes"] == []
    assert ref[2]["reason"] == "cuda_graphs=False"


@pytest.mark.parametrize("batch", [9, 11, 13])
def test_a_captured_forward_pads_the_batch_to_its_bucket_and_drops_the_padding(batch):
    """The captured executor runs 10, 12 or 14 images; logits and every statistic are the real
    images' only, with the eager forward's decisions (the captured controller runs on every image,
    masked: products over more rows may round differently, so logits within 1e-5)."""
    model = _model()
    x = images(model, batch, seed=4)
    actor = kind_actor(model, "forced")
    ref, ref_stats, _ = _forward(model, x, actor=actor, cuda_graphs=False)
    out, stats, info = _forward(model, x, actor=actor, cuda_graphs=True)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
        assert torch.equal(getattr(stats, name), getattr(ref_stats, name)), name
    assert ref_stats.removed.sum() > 0
    for got, want in zip(stats.removed_patches, ref_stats.removed_patches, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert int(got[0].max()) < batch
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert info["executor"] == "captured" and info["reason"] is None
    assert [s["batch"] for s in info["batch_shapes"]] == [batch_bucket(batch)]


def test_a_failed_capture_falls_back_to_eager_for_good_with_one_warning(monkeypatch):
    model = _model()
    x = images(model, 4)
    actor = kind_actor(model, "biased")
    ref = _forward(model, x, actor=actor, cuda_graphs=False)[0]

    def broken(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")

    monkeypatch.setattr(GraphRunner, "start", broken)
    timm_dora.wrap(model, actor, cuda_graphs=True)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="capturing CUDA graphs failed, so this model runs eagerly from now on "
                                             r"\(RuntimeError: operation not permitted when stream is capturing\)") as caught:
            out = model(x)
        assert caught[0].filename == __file__
        assert torch.equal(out, ref)
        info = timm_dora.engine_info(model)
        assert info["executor"] == "eager" and info["batch_shapes"] == []
        assert info["failed"] == "RuntimeError: operation not permitted when stream is capturing"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only, and no second attempt
            monkeypatch.undo()
            assert torch.equal(model(x), ref)
        assert timm_dora.engine_info(model)["reason"].startswith("an earlier capture failed (RuntimeError")
        assert len(model._dora.graphs) == 0
    timm_dora.unwrap(model)


def test_an_input_the_eager_forward_refuses_too_raises_and_keeps_the_graphs_on():
    model = _model()
    timm_dora.wrap(model, kind_actor(model, "biased"), cuda_graphs=True)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="expected input.*to have 3 channels"):
            model(torch.randn(2, 4, 64, 64))
        assert timm_dora.engine_info(model)["failed"] is None
        model(images(model, 2))
    assert timm_dora.engine_info(model)["executor"] == "captured"
    timm_dora.unwrap(model)


def test_engine_info_reports_the_cached_buckets_and_release_graphs_frees_them(monkeypatch, engine_options):
    engine_options(max_cached=2, max_cached_small=2, planned_max_batch=8)
    model = _model()
    timm_dora.wrap(model, kind_actor(model, "forced"), cuda_graphs=True)
    with torch.inference_mode():
        # up to 8 images and above, each kept apart: 9 and 10 share bucket 10, and 20 does not
        # push out a small one; 2 is dropped when 4 comes, 10 when 24 comes
        for b in (2, 9, 10, 3, 20, 4, 24):
            model(images(model, b))
    info = timm_dora.engine_info(model)
    assert [s["batch"] for s in info["batch_shapes"]] == [3, 20, 4, 24]
    assert info["max_cached"] == 2 and info["max_cached_small"] == 2
    assert info["graphs"] == 0 and info["capture_s"] == 0.0  # off CUDA nothing is captured
    assert timm_dora.release_graphs(model) == 4
    assert timm_dora.engine_info(model)["batch_shapes"] == []
    with torch.inference_mode():
        model(images(model, 3))
    assert [s["batch"] for s in timm_dora.engine_info(model)["batch_shapes"]] == [3]
    timm_dora.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        timm_dora.engine_info(model)


def test_a_server_of_every_small_request_size_keeps_their_graphs_by_default():
    """By default a stream of requests of every size from 1 to 16 images (12 buckets) keeps all their
    runners (``max_cached_small``), while larger batches keep ``max_cached``; bad bounds are refused."""
    import pytest

    from timm_dora.engine.options import EngineOptions

    model = _model()
    timm_dora.wrap(model, kind_actor(model, "forced"), cuda_graphs=True)
    with torch.inference_mode():
        for b in list(range(1, 17)) + [20, 24, 28, 32, 40]:
            model(images(model, b))
        small = [r for r in model._dora.graphs.values() if r.batch <= 16]
        model(images(model, 1))  # a bucket seen before: its runner, no new one
        assert next(reversed(model._dora.graphs.values())) is small[0]
    info = timm_dora.engine_info(model)
    assert [r.batch for r in small] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert sorted(s["batch"] for s in info["batch_shapes"]) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 28, 32, 40]
    timm_dora.unwrap(model)
    with pytest.raises(ValueError, match="EngineOptions.max_cached_small must be at least 1, got 0"):
        EngineOptions(max_cached_small=0)


def test_engine_info_says_how_the_graphs_replayed_and_why_not_as_one(engine_options):
    """``graph``: one graph for the whole forward (planned, or unplanned with ``whole``) or a graph
    per block, and ``graph_reason`` why not one (on the CPU ``cuda_graphs=True`` runs the same
    segments uncaptured, where only ``planned=True`` or ``whole=True`` asks for one graph)."""
    model = _model()
    x = images(model, 3)
    info = _forward(model, x, actor=kind_actor(model, "biased"), cuda_graphs=True)[2]
    assert (info["executor"], info["graph"]) == ("captured", "per_block")
    assert info["graph_reason"] == "not captured (planned=None plans captured forwards only)"
    engine_options(planned=True)
    info = _forward(model, x, calls=2, actor=kind_actor(model, "biased"), cuda_graphs=True)[2]
    assert (info["graph"], info["graph_reason"]) == ("planned", None)
    engine_options(whole=True)
    assert _forward(model, x, actor=kind_actor(model, "biased"), cuda_graphs=True)[2]["graph"] == "whole"
    engine_options(whole=None, planned=False)
    assert _forward(model, x, actor=kind_actor(model, "biased"), cuda_graphs=True)[2]["graph_reason"] == \
        "EngineOptions(planned=False)"
    engine_options(planned=True)
    info = _forward(model, x, policy=timm_dora.NoPrune(), cuda_graphs=True)[2]
    assert info["graph"] == "per_block" and "decides on the host" in info["graph_reason"]
    info = _forward(model, x, actor=kind_actor(model, "biased"), cuda_graphs=False)[2]
    assert (info["executor"], info["graph"], info["graph_reason"]) == ("eager", None, None)
    # captured (CUDA), by default: one graph up to planned_max_batch
    # or of at most planned_max_gflops dense GFLOPs
    engine_options(planned=None, planned_max_batch=2, planned_max_gflops=0.01)
    timm_dora.wrap(model, kind_actor(model, "biased"))
    runner = GraphRunner(model, model._dora.policy, x, "sdpa_loop", "model")
    runner.capture = True
    dense = 3 * native_gflops(model)
    assert 0.01 < dense < 1
    assert one_graph_reason(runner) == (f"batch 3 above EngineOptions.planned_max_batch=2 and {dense:.0f} dense "
                                        "GFLOPs above planned_max_gflops=0.01")
    engine_options(planned_max_batch=3, planned_max_gflops=0.01)
    assert one_graph_reason(runner) is None
    engine_options(planned_max_batch=2, planned_max_gflops=1)
    assert one_graph_reason(runner) is None
    timm_dora.unwrap(model)


def test_the_graph_option_is_part_of_the_wrap_identity():
    model = _model()
    actor = kind_actor(model, "closed")
    timm_dora.wrap(model, actor)
    assert timm_dora.wrap(model, actor, cuda_graphs=None) is model
    for other in (True, False):
        with pytest.raises(ValueError, match="already wrapped"):
            timm_dora.wrap(model, actor, cuda_graphs=other)
    timm_dora.unwrap(model)
    timm_dora.wrap(model, actor, skip_dead=True)  # by default skip_dead is simply not captured
    timm_dora.unwrap(model)


def test_under_torch_compile_a_capturable_forward_is_one_opaque_call(monkeypatch):
    """Where the forward would be captured (here forced on the CPU, which runs the same segments
    uncaptured) ``torch.compile`` calls the captured executor as it is: Dynamo compiles no graph of
    the block program, and the output equals the captured executor's."""
    model = _model()
    x = images(model, 5)
    actor = kind_actor(model, "forced")
    ref, ref_stats, _ = _forward(model, x, actor=actor, cuda_graphs=True)
    monkeypatch.setattr("timm_dora.engine.patch.captures_under_compile", lambda m, images: True)
    timm_dora.wrap(model, actor, cuda_graphs=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        out = torch.compile(model)(x)
    assert torch.equal(out, ref) and torch.equal(model.dora_stats.removed, ref_stats.removed)
    assert timm_dora.engine_info(model)["executor"] == "captured"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    timm_dora.unwrap(model)


@cuda
def test_by_default_a_half_precision_cuda_forward_is_captured_and_bucketed():
    model = _model().to("cuda", torch.bfloat16)
    x = images(model, 9).to("cuda", torch.bfloat16)
    actor = kind_actor(model, "forced")
    ref, ref_stats, _ = _forward(model, x, actor=actor, cuda_graphs=False)
    out, stats, info = _forward(model, x, calls=2, actor=actor)
    assert info["executor"] == "captured" and [s["batch"] for s in info["batch_shapes"]] == [10]
    assert info["batch_shapes"][0]["plan_misses"] == 0
    assert info["graphs"] > 0 and info["capture_s"] > 0 and info["memory_mb"] > 0
    assert 0 < info["batch_shapes"][0]["buffers_mb"] <= info["batch_shapes"][0]["memory_mb"]
    same = (stats.removed == ref_stats.removed).all(1)
    assert same.float().mean() >= 0.75  # bf16 near-ties may decide otherwise
    torch.testing.assert_close(out[same].float(), ref[same].float(), rtol=0.05, atol=0.05)
    with torch.no_grad():
        timm_dora.wrap(model, actor)
        model.train()
        model(x)  # training mode: eagerly, without a word
        assert timm_dora.engine_info(model)["reason"] == "the model is in training mode"
        timm_dora.unwrap(model)
