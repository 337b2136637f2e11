"""The whole forward as one graph (``timm_dora.engine.whole``), the captured executor of small batches.

On the CPU the same segments run uncaptured (``EngineOptions(whole=True)``): outputs and statistics must
equal the eager executor's. On CUDA: one graph replay per forward, no host synchronisation, the
same decisions as the per-block executor.
"""
import pytest
import torch

import timm_dora
from timm_dora import NoPrune
from timm_dora.engine import graphs as graphs_module
from timm_dora.engine import patch as patch_module
from timm_dora.engine import deletion_kernel, fold_kernel, segments, whole
from timm_dora.engine.flops import native_gflops
from timm_dora.engine.options import EngineOptions

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import SMALL_FAMILIES, assert_same_forwards, gate_forced_actor, images, kind_actor, make_model


@pytest.fixture
def whole_calls(monkeypatch, engine_options):
    """Counts the forwards run by the whole-forward executor."""
    calls = []
    real = patch_module.forward_whole

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(patch_module, "forward_whole", counted)
    engine_options(rows_bucket=1)
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


def _assert_same(got, ref):
    for (oa, sa), (ob, sb) in zip(got, ref, strict=True):
        # (the controller's products over every image, and padded rows: float32 sums in another
        # order; 2.03e-6 seen on a 16-core host)
        torch.testing.assert_close(oa, ob, rtol=0, atol=1e-5)
        for field in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        for pa, pb in zip(sa.removed_patches, sb.removed_patches, strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
@pytest.mark.parametrize("family", ["deit", "deit_distilled", "dinov2_registers"])
def test_whole_forward_equals_the_eager_executor(family, kind, merge, whole_calls, monkeypatch, engine_options):
    """Deleting or merging (the fold in the controller's segment, the sizes carried along)."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    actor = kind_actor(model, kind)
    xs = [images(model, 5, seed=s) for s in (1, 2, 1)]  # fixed buffers reused; a batch seen again
    ref = _forwards(model, xs, actor=actor, cuda_graphs=False, merge=merge)
    engine_options(whole=True)
    got = _forwards(model, xs, actor=actor, cuda_graphs=True, merge=merge)
    assert len(whole_calls) == len(xs)
    _assert_same(got, ref)
    removed = ref[0][1].removed
    if kind == "closed":
        assert removed.sum() == 0
    else:
        assert removed.sum() > 0 and got[0][1].gate.any()


@pytest.mark.parametrize("merge", [False, True])
def test_norm_in_gather_by_default_up_to_max_rows(merge, whole_calls, monkeypatch, engine_options):
    """``EngineOptions.norm_in_gather``'s default (``None``) asks the deletion for the survivors'
    LayerNorm up to ``deletion_kernel.MAX_ROWS`` rows (5 images of 17 tokens), not above (512
    images, 8,704 rows); ``True`` and ``False`` at any size. Uncaptured (the CPU) the deletion
    normalises after it, with the MLP's own operation: the same forwards, exactly."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = gate_forced_actor(model, [1])
    asked = []
    build = segments.Segments.build
    monkeypatch.setattr(segments.Segments, "build", lambda self, key: (
        asked.append(key[6]) if key[0] == "controller" else None, build(self, key))[1])
    runs = {}
    for n, option in ((5, None), (5, False), (512, None), (512, True)):
        asked.clear()
        engine_options(whole=True, norm_in_gather=option)
        xs = [images(model, n, seed=1)]
        assert (n * (model.patch_embed.num_patches + 1) > deletion_kernel.MAX_ROWS) == (n == 512)
        runs[n, option] = _forwards(model, xs, actor=actor, cuda_graphs=True, merge=merge)
        assert asked and set(asked) == {option if option is not None else n == 5}, (n, option, asked)
    assert len(whole_calls) == 4
    _assert_same(runs[5, None], runs[5, False])
    _assert_same(runs[512, None], runs[512, True])


def test_only_a_deciding_actor_with_the_class_token_head_runs_whole(whole_calls, monkeypatch, engine_options):
    engine_options(whole=True)
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


def test_whole_unplanned_runs_only_when_captured_and_at_most_max_batch(monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "biased")
    timm_dora.wrap(model, actor=actor)
    runner = graphs_module.GraphRunner(model, model._dora.policy, images(model, 3), "sdpa_loop", "model")
    assert whole.whole_reason(runner) is None
    assert not whole.runs_whole(runner)  # uncaptured (the CPU): only with WHOLE = True
    runner.capture = True
    assert not whole.runs_whole(runner)  # (MAX_BATCH = 0: planned instead)
    engine_options(whole_max_batch=3)
    assert whole.runs_whole(runner)
    engine_options(whole_max_batch=2)
    assert not whole.runs_whole(runner)
    engine_options(whole=False)
    runner.batch = 1
    assert not whole.runs_whole(runner)
    timm_dora.unwrap(model)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_planned_forward_equals_the_eager_executor(family, kind, merge, whole_calls, monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    actor = kind_actor(model, kind)
    xs = [images(model, 5, seed=s) for s in (1, 1, 2, 1)]
    ref = _forwards(model, xs, actor=actor, cuda_graphs=False, merge=merge)
    engine_options(planned=True)
    timm_dora.wrap(model, actor=actor, cuda_graphs=True, merge=merge)
    got = []
    with torch.inference_mode():
        for x in xs:
            got.append((model(x), model.dora_stats))
        runner = next(iter(model._dora.graphs.values()))
    timm_dora.unwrap(model)
    _assert_same(got, ref)
    # the first forward observes (eagerly), the second is the same images: its plan holds
    assert len(whole_calls) == 3 and runner.plan is not None
    assert runner.plan_misses <= 1  # (the other images may need more rows or another block)
    removed = ref[0][1].removed
    assert runner.plan.controls == tuple(bool(g) for g in ref[0][1].gate.any(0)) or runner.plan_misses
    if kind == "closed":
        assert removed.sum() == 0 and runner.plan.rows == (5 * runner.seq,) * (len(model.blocks) + 1)
    else:
        assert removed.sum() > 0


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
@pytest.mark.parametrize("form", ["planned", "whole"])
def test_last_block_controller_reads_out_the_prefix_rows(form, family, merge, whole_calls, monkeypatch,
                                                         engine_options):
    """``EngineOptions.last_block_prefix_only``: where the graph runs the controller at the last
    block, that block's MLP runs on the prefix rows before the deletion (the readout's rows) and the
    deletion keeps only its books; the logits and every statistic (the last block's removals and
    removed patches included) equal the eager executor's, as with the option off. A gate forced open
    at block 1 and at the last (where the budget allows it)."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    last = len(model.blocks) - 1
    actor = gate_forced_actor(model, [1, last])
    xs = [images(model, 5, seed=s) for s in (1, 1, 2)]
    ref = _forwards(model, xs, actor=actor, cuda_graphs=False, merge=merge)
    assert ref[0][1].gate[:, last].any() and ref[0][1].removed[:, last].sum() > 0
    built = []
    build = segments.Segments.build
    monkeypatch.setattr(segments.Segments, "build", lambda self, key: (built.append(key[0]), build(self, key))[1])
    runs = {}
    for option in (True, False):
        built.clear()
        engine_options(**{form: True, "last_block_prefix_only": option, "rows_bucket": 1})
        runs[option] = _forwards(model, xs, actor=actor, cuda_graphs=True, merge=merge)
        assert ("readout_prefix" in built) == option and ("readout_packed" in built) != option
        _assert_same(runs[option], ref)
    assert len(whole_calls) == (6 if form == "whole" else 4)  # (planned: each first forward observes eagerly)
    if form == "planned":  # the check comes before the last deletion: its rows bound nothing (no miss)
        for option in (True, False):
            engine_options(planned=True, last_block_prefix_only=option, rows_bucket=1)
            timm_dora.wrap(model, actor=actor, cuda_graphs=True, merge=merge)
            with torch.inference_mode():
                model(xs[0])
                runner = next(iter(model._dora.graphs.values()))
                runner.plan = whole.Plan(runner.plan.rows[:-1] + (1,), runner.plan.controls)
                got = [(model(xs[0]), model.dora_stats)]
            timm_dora.unwrap(model)
            _assert_same(got, ref[:1])
            assert runner.plan_misses == (0 if option else 1)


def test_a_plan_that_does_not_hold_runs_again_eagerly_and_grows(whole_calls, monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")  # forced open at blocks 1, 4 and 7
    x = images(model, 4, seed=1)
    ref = _forwards(model, [x], actor=actor, cuda_graphs=False)
    opened = tuple(bool(g) for g in ref[0][1].gate.any(0))
    assert opened[1] and opened[4] and sum(opened) >= 2
    rows_seen = 4 * 17 - ref[0][1].removed.sum(0).cumsum(0)  # [12] rows left after each block
    engine_options(planned=True)
    timm_dora.wrap(model, actor=actor, cuda_graphs=True)
    with torch.inference_mode():
        model(x)
        runner = next(iter(model._dora.graphs.values()))
        assert runner.plan.controls == opened
        assert all(b >= int(n) for b, n in zip(runner.plan.rows[1:], rows_seen))
        for tight in (whole.Plan(runner.plan.rows, (False,) * 12),  # the gate opens outside the plan
                      whole.Plan((68,) * 5 + (int(rows_seen[4]) - 1,) * 8, runner.plan.controls)):  # too few rows
            runner.plan = tight
            got = [(model(x), model.dora_stats)]
            _assert_same(got, ref)
            assert runner.plan.controls == opened
            assert runner.plan.rows[5] >= int(rows_seen[4])
        assert runner.plan_misses == 2
        got = [(model(x), model.dora_stats)]  # the grown plan holds
    timm_dora.unwrap(model)
    _assert_same(got, ref)
    assert runner.plan_misses == 2 and len(whole_calls) == 3


def test_a_new_plan_runs_the_controller_where_other_batch_sizes_plans_do(whole_calls, monkeypatch, engine_options):
    """A batch size's first plan also names the blocks where the model's other batch sizes run the
    controller: a gate seen opening (rarely) at one size is planned at the next without a miss."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")  # forced open at blocks 1, 4 and 7
    x4, x2 = images(model, 4, seed=1), images(model, 2, seed=2)
    ref = _forwards(model, [x2], actor=actor, cuda_graphs=False)
    opened = tuple(bool(g) for g in ref[0][1].gate.any(0))
    assert not opened[9]
    engine_options(planned=True)
    timm_dora.wrap(model, actor=actor, cuda_graphs=True)
    with torch.inference_mode():
        model(x4)
        four = next(iter(model._dora.graphs.values()))
        # as if a gate had once opened at block 9 at four images
        four.plan = whole.Plan(four.plan.rows, tuple(c or l == 9 for l, c in enumerate(four.plan.controls)))
        got = [(model(x2), model.dora_stats)]
        two = next(r for r in model._dora.graphs.values() if r is not four)
        assert two.plan.controls == tuple(c or l == 9 for l, c in enumerate(opened))
        got.append((model(x2), model.dora_stats))  # replayed from the plan, the controller at block 9 too
    timm_dora.unwrap(model)
    _assert_same(got, ref * 2)
    assert two.plan_misses == 0


def test_plan_bounds_the_rows_seen_by_a_margin_of_standard_deviations(monkeypatch, engine_options):
    engine_options(margin_sd=1.0)
    # three images of 10 rows; block 1 removes 2, 4 and 3: 21 rows left, lengths 8, 6 and 7 (sd
    # sqrt(2/3)): the bound is 21 + ceil(1 * sqrt(3) * sqrt(2/3)) = 21 + ceil(1.414) = 23
    removed = [[0, 2, 0], [0, 4, 0], [0, 3, 0]]
    plan = whole.plan_from([False, True, False], removed, seq=10, bucket=1)
    assert plan == whole.Plan((30, 30, 23, 23), (False, True, False))
    assert whole.plan_from([False, True, False], removed, seq=10, bucket=6).rows == (30, 30, 24, 24)
    grown = whole.plan_from([False, False, True], [[0, 0, 1]] * 3, seq=10, bucket=1, old=plan)
    assert grown == whole.Plan((30, 30, 30, 27), (False, True, True))  # larger bounds, both controls
    engine_options(margin_sd=8.0)  # 21 + ceil(11.3) = 33: never above the block before
    assert whole.plan_from([False, True, False], removed, seq=10, bucket=1).rows == (30,) * 4
    # one or two images: no spread to take a margin from, so no bound below their full rows (the
    # controls as seen), even where the two agree
    engine_options(margin_sd=1.0)
    assert whole.plan_from([False, True, True], [[0, 3, 2]], seq=10, bucket=1) == whole.Plan((10,) * 4, (False, True, True))
    assert whole.plan_from([False, True, False], [[0, 3, 0], [0, 3, 0]], seq=10, bucket=1).rows == (20,) * 4


def test_planned_runs_by_default_for_captured_batches_up_to_planned_max_batch_or_gflops(monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    timm_dora.wrap(model, actor=kind_actor(model, "biased"))
    runner = graphs_module.GraphRunner(model, model._dora.policy, images(model, 3), "sdpa_loop", "model")
    assert not whole.plans(runner)  # uncaptured (the CPU): only with planned=True
    runner.capture = True
    assert whole.plans(runner) and not whole.runs_whole(runner)
    engine_options(whole_max_batch=3)  # where the unplanned graph runs, not planned
    assert not whole.plans(runner) and whole.runs_whole(runner)
    engine_options(whole_max_batch=2)
    assert whole.plans(runner) and not whole.runs_whole(runner)
    engine_options(planned_max_batch=2, planned_max_gflops=0)  # large: the per-block executor
    assert not whole.plans(runner) and not whole.runs_whole(runner)
    engine_options(planned_max_batch=3, planned_max_gflops=0)
    assert whole.plans(runner)
    dense = 3 * native_gflops(model)  # above planned_max_batch, planned while its dense work is small
    engine_options(planned_max_batch=2, planned_max_gflops=dense)
    assert whole.plans(runner) and whole.dense_gflops(runner) == dense
    engine_options(planned_max_batch=2, planned_max_gflops=dense * 0.99)
    assert not whole.plans(runner)
    with pytest.raises(ValueError, match="planned_max_gflops, margin_sd and fold_aside_max_rows must be 0 or more"):
        EngineOptions(planned_max_gflops=-1)
    with pytest.raises(ValueError, match="fold_aside_max_rows must be 0 or more"):
        EngineOptions(fold_aside_max_rows=-1)
    engine_options(planned=False)
    assert not whole.plans(runner)
    timm_dora.unwrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
def test_whole_graph_on_cuda_is_one_replay_without_host_reads(kind, batch, monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, batch, seed=s).to("cuda", torch.bfloat16) for s in (1, 2)]
    engine_options(whole=False)
    engine_options(planned=False)  # the per-block executor
    ref = _forwards(model, xs, actor=actor)
    engine_options(whole=True)  # the unplanned whole graph
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["biased", "forced"])
def test_planned_graph_on_cuda_replays_one_graph_with_the_per_block_decisions(kind, merge, monkeypatch, engine_options):
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, 12, seed=s).to("cuda", torch.bfloat16) for s in (1, 1, 1)]
    engine_options(planned=False)
    ref = _forwards(model, xs, actor=actor, merge=merge)
    engine_options(planned=None)  # the default: planned up to planned_max_batch
    timm_dora.wrap(model, actor=actor, merge=merge)
    with torch.inference_mode():
        got = [(model(x), model.dora_stats) for x in xs]  # observed eagerly, captured, replayed
        runner = next(iter(model._dora.graphs.values()))
        keys = [k for k in runner.graphs if k[0] != "reserve"]
    timm_dora.unwrap(model)  # (releases the graphs)
    assert keys == [("whole", runner.triton_gate, runner.plan)] and runner.plan_misses == 0
    for (oa, sa), (ob, sb) in zip(got[1:], ref[1:]):
        same = (sa.removed == sb.removed).all(1) & (sa.gate == sb.gate).all(1)
        assert same.float().mean() >= 0.9  # (bf16 near-ties may decide differently)
        torch.testing.assert_close(oa[same].float(), ob[same].float(), rtol=0, atol=3e-2)
        assert torch.equal(sa.tokens, 16 - sa.removed.cumsum(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
def test_a_plan_with_too_few_rows_on_cuda_is_discarded_without_a_fault(monkeypatch, engine_options):
    """Captured, a block that leaves more rows than the plan's bound runs on inside the graph (the
    host learns it from the check at the end): its layout is clamped to the bound, so no kernel
    reads past its rows (a device-side assert would end the process), and the forward runs again
    eagerly with the same decisions as the eager executor."""
    engine_options(rows_bucket=1)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, "forced").to("cuda", torch.bfloat16)  # forced open at blocks 1, 4 and 7
    x = images(model, 4, seed=1).to("cuda", torch.bfloat16)
    ref = _forwards(model, [x], actor=actor, cuda_graphs=False)
    rows_seen = 4 * 17 - ref[0][1].removed.sum(0).cumsum(0)
    timm_dora.wrap(model, actor=actor)
    with torch.inference_mode():
        model(x)  # observed eagerly: the plan
        runner = next(iter(model._dora.graphs.values()))
        runner.plan = whole.Plan((68,) * 3 + (int(rows_seen[1]) - 3,) * 10, runner.plan.controls)
        got = model(x)
        stats = model.dora_stats
        torch.cuda.synchronize()
    timm_dora.unwrap(model)
    assert runner.plan_misses == 1 and runner.plan.rows[2] >= int(rows_seen[1])
    assert torch.equal(stats.removed, ref[0][1].removed)
    torch.testing.assert_close(got.float(), ref[0][0].float(), rtol=0, atol=3e-2)


def test_planned_forward_made_under_inference_mode_runs_again_under_no_grad(engine_options):
    """The record's buffers are made by the first forward; made under ``inference_mode`` they must
    still be writable by a later forward under ``no_grad`` (a new plan, uncaptured here)."""
    import warnings

    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    engine_options(planned=True)
    timm_dora.wrap(model, actor=kind_actor(model, "forced"), cuda_graphs=True)
    with torch.inference_mode():
        first = model(images(model, 3, seed=1))
        model(images(model, 3, seed=1))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        again = model(images(model, 3, seed=1))
    assert not [w for w in caught if "failed" in str(w.message)]
    assert timm_dora.engine_info(model)["failed"] is None
    assert torch.equal(first, again)
    timm_dora.unwrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["biased", "forced"])
def test_closed_gates_aside_give_the_in_line_graph_bit_for_bit(kind, merge, engine_options):
    """``EngineOptions.aside_gates``: the closed blocks' gates on a second stream (a branch of the
    planned graph) compute what the same graph computes with them in line, and the forward ends
    joined (nothing left forked)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, 8, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1, 3)]
    runs = {}
    for on in (False, True):
        engine_options(aside_gates=on, aside_controller=False, rows_bucket=1)  # (the gates alone)
        timm_dora.wrap(model, actor=actor, merge=merge)
        with torch.inference_mode():
            runs[on] = [(model(x).clone(), model.dora_stats) for x in xs]
            runner = next(iter(model._dora.graphs.values()))
            assert runner.plan is not None
            aside = getattr(runner, "aside", None)
            assert (aside is not None) == on and not (on and (aside.forked or aside.held))
        timm_dora.unwrap(model)
    assert_same_forwards(runs[True], runs[False])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["biased", "forced"])
def test_controller_decisions_aside_give_the_in_line_graph_bit_for_bit(kind, merge, engine_options, monkeypatch):
    """``EngineOptions.aside_controller``: the controller blocks' decisions on the second stream,
    beside their attention (forked by the keys hook when the graph is recorded), compute what the
    same graph computes with them in line (gates aside in both), and the forward ends joined."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, 8, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1, 3)]
    events = []  # the order in which the graph is recorded: forks, joins that wait, deletions
    fork, join = whole.Aside.fork, whole.Aside.join
    monkeypatch.setattr(whole.Aside, "fork", lambda self, fn, *hold: (events.append(fn.__name__), fork(self, fn, *hold))[1])
    monkeypatch.setattr(whole.Aside, "join", lambda self: (events.append("join") if self.forked else None, join(self))[1])
    build = segments.Segments._controller_segment

    def logged(self, key):
        controller = build(self, key)
        delete = controller.delete
        controller.delete = lambda: (events.append("delete"), delete())[1]
        return controller
    monkeypatch.setattr(segments.Segments, "_controller_segment", logged)
    runs = {}
    for on in (False, True):
        events.clear()
        engine_options(aside_controller=on, rows_bucket=1)
        timm_dora.wrap(model, actor=actor, merge=merge)
        with torch.inference_mode():
            runs[on] = [(model(x).clone(), model.dora_stats) for x in xs]
            runner = next(iter(model._dora.graphs.values()))
            assert runner.plan is not None and (any(runner.plan.controls) or kind != "forced")
            aside = getattr(runner, "aside", None)
            assert (aside is None or not (aside.forked or aside.held)) and runner.decide_aside is None
            assert runner.keys_in_place is None
            controls = any(runner.plan.controls)
        timm_dora.unwrap(model)
        # (recorded into the graph: forked at its capture) every forked decision joined before its deletion
        assert ("decide" in events) == (on and controls)
        for i, e in enumerate(events):
            if e == "decide":
                assert events[i + 1:i + 3] == ["join", "delete"], events[i:i + 3]
    assert_same_forwards(runs[True], runs[False])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("kind", ["biased", "forced"])
@pytest.mark.parametrize("option", ["fold_aside", "fold_in_gather", "compact_beside_fold", "norm_in_gather",
                                    "compact_in_pick"])
def test_fold_options_give_the_fold_they_replace(option, kind, engine_options, monkeypatch):
    """``EngineOptions.fold_aside``: with merging, the fold's similarities made beside the decision
    and the match picked from them after the join give the graph that matches after the join;
    ``fold_in_gather``: the fold finished in the deletion's gather gives the fold's own finish;
    ``compact_beside_fold`` (forced on): the deletion's compaction beside the fold gives the
    deletion after it; ``norm_in_gather``: the survivors' LayerNorm in the deletion's gather gives
    the MLP's own; ``compact_in_pick``: the fold's pick and the compaction by image in one kernel
    give the two apart (the others are measured with it off, so that their paths run). Each: the
    same decisions and sizes, the same logits up to the order of the fold's float32 atomics."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, kind).to("cuda", torch.bfloat16)
    xs = [images(model, 8, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1, 3)]
    runs, used, made, took = {}, {}, [], []
    similarities = segments.fold_similarities
    monkeypatch.setattr(segments, "fold_similarities", lambda *a, **k: (made.append(1), similarities(*a, **k))[1])
    if option == "fold_aside":  # the fold that reads them: _pick, not the match
        fold_rows = fold_kernel.fold_rows
        monkeypatch.setattr(fold_kernel, "fold_rows",
                            lambda *a, **k: (took.append(k.get("similarities") is not None), fold_rows(*a, **k))[1])
    elif option == "compact_beside_fold":  # the compaction forked beside the fold
        compaction = segments.compact_rows
        monkeypatch.setattr(segments, "compact_rows", lambda *a, **k: (took.append(True), compaction(*a, **k))[1])
    elif option == "compact_in_pick":  # the pick and the compaction in one kernel
        together = segments.pick_and_compact
        monkeypatch.setattr(segments, "pick_and_compact", lambda *a, **k: (took.append(True), together(*a, **k))[1])
    else:  # the deletion that finishes the fold (or normalises the survivors)
        deletion, asked = segments.delete_rows_fused, "received" if option == "fold_in_gather" else "norm"
        monkeypatch.setattr(segments, "delete_rows_fused",
                            lambda *a, **k: (took.append(k.get(asked) is not None), deletion(*a, **k))[1])
    for on in (False, True):
        made.clear()
        took.clear()
        engine_options(**{"compact_in_pick": False, option: on}, rows_bucket=1)
        timm_dora.wrap(model, actor=actor, merge=True)
        with torch.inference_mode():
            runs[on] = [(model(x).clone(), model.dora_stats) for x in xs]
            runner = next(iter(model._dora.graphs.values()))
            assert runner.plan is not None and runner.fold_sim is not None
            used[on] = bool(any(runner.plan.controls))
        timm_dora.unwrap(model)
        if option == "fold_aside":
            assert bool(made) == (on and used[on])  # (recorded into the graph where a controller runs)
        assert any(took) == (on and used[on])  # (and the option's path ran: not when off)
    assert used[True] == used[False] and (used[True] or kind != "forced")
    assert_same_forwards(runs[True], runs[False], atol=3e-2)
    if option == "fold_aside":  # on, but not above fold_aside_max_rows rows (8 images of 17: 136)
        made.clear()
        took.clear()
        engine_options(fold_aside=True, fold_aside_max_rows=8 * 17 - 1, rows_bucket=1)
        timm_dora.wrap(model, actor=actor, merge=True)
        with torch.inference_mode():
            bounded = [(model(x).clone(), model.dora_stats) for x in xs]
            assert next(iter(model._dora.graphs.values())).fold_sim is None
        timm_dora.unwrap(model)
        assert not made and not any(took)
        assert_same_forwards(bounded, runs[False], atol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
def test_compaction_beside_fold_by_default_above_max_rows(engine_options, monkeypatch):
    """``EngineOptions.compact_beside_fold``'s default (``None``) forks the compaction beside the
    fold above ``deletion_kernel.MAX_ROWS`` rows (here 512 images of 17 tokens, 8,704 rows: the
    compaction's multi-program form, its sizes straight into the aside buffer), not below; it gives
    the deletion after the fold. One controller block (1): the decisions come before any fold, so
    only the deletion's path differs between the two runs (the fold's float32 atomics may sum in
    another order in another run, and a later decision could then go the other way at a near-tie)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = gate_forced_actor(model, [1]).to("cuda", torch.bfloat16)
    xs = [images(model, 512, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1)]
    assert xs[0].shape[0] * (model.patch_embed.num_patches + 1) > deletion_kernel.MAX_ROWS
    took = []
    compaction = segments.compact_rows
    monkeypatch.setattr(segments, "compact_rows", lambda *a, **k: (took.append(True), compaction(*a, **k))[1])
    runs = {}
    for option in (False, None):
        took.clear()
        engine_options(compact_beside_fold=option, rows_bucket=1)
        timm_dora.wrap(model, actor=actor, merge=True)
        with torch.inference_mode():
            runs[option] = [(model(x).clone(), model.dora_stats) for x in xs]
            runner = next(iter(model._dora.graphs.values()))
            assert runner.plan is not None and any(runner.plan.controls)
        timm_dora.unwrap(model)
        assert any(took) == (option is None)
    assert_same_forwards(runs[None], runs[False], atol=3e-2)
    assert sum(int(stats.removed.sum()) for _, stats in runs[None]) > 0
    took.clear()  # and by default not below MAX_ROWS (8 images, 136 rows)
    engine_options(rows_bucket=1)
    timm_dora.wrap(model, actor=actor, merge=True)
    with torch.inference_mode():
        model(xs[0][:8])
    assert model.dora_stats.removed.sum() > 0 and not took
    timm_dora.unwrap(model)
