"""The forward replayed from CUDA graphs (``wrap(..., cuda_graphs=True)``, issue #8).

On CUDA the segments are captured as graphs; on CPU the same segments run uncaptured, so these
tests check the path's logic (fixed buffers reused across forwards, the gate probe and the
lazily recomputed keys, speculation, padded packed rows, the deletion into fixed buffers) against
the default forward: every output must be identical.
"""
import dataclasses
import warnings

import pytest
import torch

import timm_dora
from benchmarks.common import gate_forced_actor
from timm_dora import Actor, ActorPolicy, NoPrune, ReplayPolicy
from timm_dora.engine import graphs as graphs_module
from timm_dora.engine.graphs import GraphRunner
from timm_dora.engine.segments import Segments
from timm_dora.policy import Decision

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import SMALL_FAMILIES, images, kind_actor, make_model, random_plan

SMALL_CACHED = 4  # (EngineOptions.max_cached_small, set smaller than the 12 buckets of 1-16 images)

FAMILIES = ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "vit_gap", "vit_reg4_gap", "siglip_map"]




def _mlp_calls(model):
    calls = [0] * len(model.blocks)
    hooks = [blk.mlp.register_forward_pre_hook(lambda m, a, l=l: calls.__setitem__(l, calls[l] + 1))
             for l, blk in enumerate(model.blocks)]
    return calls, hooks


def _run(model, xs, **wrap_kw):
    """Logits, stats and MLP calls per block of consecutive forwards of one wrapped model."""
    timm_dora.wrap(model, **wrap_kw)
    outs = []
    try:
        for x in xs:
            calls, hooks = _mlp_calls(model)
            with torch.inference_mode():
                out = model(x)
            for h in hooks:
                h.remove()
            outs.append((out, model.dora_stats, calls))
        return outs
    finally:
        timm_dora.unwrap(model)


@pytest.fixture(autouse=True)
def _no_padding(monkeypatch, engine_options):
    """Packed rows unpadded unless a test says otherwise: a matrix product over more rows may round
    differently, so only unpadded runs can be compared bit for bit."""
    engine_options(rows_bucket=1)


def _assert_same(a, b, exact=True):
    (oa, sa, _), (ob, sb, _) = a, b
    if exact:
        assert torch.equal(oa, ob)
    else:
        torch.testing.assert_close(oa, ob, rtol=0, atol=1e-5)
    for name in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    assert sa.backend == sb.backend
    for pa, pb in zip(sa.removed_patches, sb.removed_patches, strict=True):
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bucket", [1, 7])  # 7: packed rows padded (by 0-6 rows) in every block
def test_graph_path_is_identical_to_the_default_forward(family, kind, bucket, monkeypatch, engine_options):
    """Identical without padding; with padded rows the same decisions, logits within rounding; with
    the dense blocks run ahead in one segment (the default) and one segment per block."""
    engine_options(rows_bucket=bucket)
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    xs = [images(model, 6, seed=s) for s in (1, 2, 1)]  # buffers reused; a batch seen again
    actor = kind_actor(model, kind)
    ref = _run(model, xs, actor=actor)
    # exact where no controller ran and nothing was padded; where a gate opened the graphs' controller
    # ran on every image (products over more rows may round differently): same decisions, close logits
    for a, b in zip(_run(model, xs, actor=actor, cuda_graphs=True), ref):
        _assert_same(a, b, exact=bucket == 1 and kind == "closed")
    engine_options(run_ahead=False)
    got = _run(model, xs, actor=actor, cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b, exact=bucket == 1 and kind == "closed")
    stats, calls = ref[0][1], got[0][2]
    opened = stats.gate.any(0).tolist()
    assert opened == (stats.removed.sum(0) > 0).tolist()
    if actor.summary != "cls":  # (a summary-key actor decides eagerly between the replays: one MLP a block)
        assert all(c == [1] * len(model.blocks) for _, _, c in got)
    else:
        # the actor's gate is read while the MLP of the unpruned rows runs (speculation, dense and
        # packed phase alike); where a gate opened that MLP is wasted and the survivors' MLP runs
        assert calls == [1 + o for o in opened]
        # later forwards speculate only at blocks whose gate stayed closed in the previous forward:
        # one MLP per block where it opened before, whatever it does now
        for (_, prev, _), (_, now, calls) in zip(ref, got[1:]):
            before, now = prev.gate.any(0).tolist(), now.gate.any(0).tolist()
            assert calls == [1 if b else 1 + n for b, n in zip(before, now)]
    if kind == "closed":
        assert not any(opened)
    elif kind == "biased":
        assert any(opened) and not all(stats.gate.all(0).tolist())


@pytest.mark.parametrize("kind", ["biased", "replay", "none"])
def test_mlp_in_row_chunks_gives_the_same_forward(kind, monkeypatch, engine_options):
    """``EngineOptions.mlp_chunks``: every graph segment's MLP in row chunks (in place without the actor, into
    the next buffer with it; chunk ends inside sequences and past the real rows) gives the same
    decisions and logits as the default forward, and the MLP runs once per chunk."""
    engine_options(rows_bucket=5)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    xs = [images(model, 6, seed=s) for s in (1, 2)]
    n0 = model.patch_embed.num_patches
    wrap_kw = {"biased": dict(actor=kind_actor(model, "biased")),
               "replay": dict(policy=ReplayPolicy(random_plan(6, n0, len(model.blocks), [2, 5]))),
               "none": dict(policy=NoPrune())}[kind]
    ref = _run(model, xs, **wrap_kw)
    one = _run(model, xs, **wrap_kw, cuda_graphs=True)
    engine_options(mlp_chunks=3)
    got = _run(model, xs, **wrap_kw, cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b, exact=False)
    for (_, _, c3), (_, _, c1) in zip(got, one):
        assert c3 == [3 * c for c in c1]


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_graph_path_with_host_policies(family, monkeypatch, engine_options):
    """Policies without a gate probe decide on the host between the attention and MLP segments."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    xs = [images(model, 5, seed=s) for s in (3, 4)]
    n0 = model.patch_embed.num_patches
    for bucket in (1, 5):
        engine_options(rows_bucket=bucket)
        for policy in (NoPrune(), ReplayPolicy(random_plan(5, n0, len(model.blocks), [2, 5]))):
            ref = _run(model, xs, policy=policy)
            got = _run(model, xs, policy=policy, cuda_graphs=True)
            for a, b in zip(got, ref):
                _assert_same(a, b, exact=bucket == 1)
        # no probe, no speculation: every MLP exactly once
            assert all(c == [1] * len(model.blocks) for _, _, c in got)


def test_blocks_a_policy_skips_run_as_chains(monkeypatch):
    """Where a policy says beforehand that it prunes nothing (``prunes_nothing_at``), each run of
    such blocks is one segment and the policy is not called there; outputs equal the default."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    depth, n0 = len(model.blocks), model.patch_embed.num_patches
    x = images(model, 3)
    segments, called = [], []
    run = GraphRunner.run_segment
    monkeypatch.setattr(GraphRunner, "run_segment", lambda self, key: (segments.append(key), run(self, key))[1])

    class Spy(ReplayPolicy):
        def __call__(self, ctx):
            called.append(ctx.block)
            return super().__call__(ctx)

    policy = Spy(random_plan(3, n0, depth, [2, 5]))
    ref = _run(model, [x], policy=policy)
    segments.clear()
    called.clear()
    got = _run(model, [x], policy=policy, cuda_graphs=True)
    _assert_same(got[0], ref[0])
    assert called == [2, 5]
    total = 3 * (n0 + 1)
    rows = [int(t) for t in got[0][1].tokens.sum(0) + 3]  # packed rows after each block (one CLS per image)
    assert [k[:2] for k in segments] == [("chain", 0), ("attention", 2), ("mlp_compacted", 2), ("chain", 3),
                                         ("attention_packed", 5), ("mlp_compacted", 5), ("chain", 6),
                                         ("readout_packed",)]  # the CLS head after a deletion: a graph too
    assert segments[0] == ("chain", 0, 1, total, True)
    assert segments[3] == ("chain", 3, 4, rows[2], False) and segments[6] == ("chain", 6, depth - 1, rows[5], False)
    segments.clear()
    got = _run(model, [x], policy=NoPrune(), cuda_graphs=True)
    assert segments == [("chain", 0, depth - 1, total, True), ("readout",)]
    assert got[0][2] == [1] * depth  # every MLP exactly once


def test_dense_blocks_run_ahead_in_one_segment_until_a_gate_opened(monkeypatch, engine_options):
    """With the actor (``EngineOptions.run_ahead``), the dense blocks from block 0 up to the first whose gate
    opened in the last forward run as one segment (the readout too when none opened), their gates
    read at once, after the next block's segment or before the logits are returned. Where a gate
    opened inside that run, the forward runs again block by block: outputs and statistics equal the
    default forward's."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    depth = len(model.blocks)
    xs = [images(model, 3, seed=s) for s in (1, 2)]
    segments, embeds = [], []
    run = GraphRunner.run_segment
    monkeypatch.setattr(GraphRunner, "run_segment", lambda self, key: (segments.append(key), run(self, key))[1])
    hook = model.patch_embed.register_forward_hook(lambda *a: embeds.append(1))

    closed = kind_actor(model, "closed")
    ref = _run(model, xs, actor=closed)
    segments.clear(), embeds.clear()
    got = _run(model, xs, actor=closed, cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b)
    assert segments == [("run_ahead", 0, depth, True)] * 2  # the whole forward, readout included
    assert [g[2] for g in got] == [[1] * depth] * 2  # every MLP once (speculatively, all kept)
    assert len(embeds) == 2 + 1  # one per forward (and one when the runner made its buffers)

    forced = kind_actor(model, "forced")  # opens at blocks 1, 4 and 7, on every image
    ref = _run(model, xs, actor=forced)
    opened = ref[0][1].gate.any(0).tolist()
    assert opened[:2] == [False, True]
    segments.clear(), embeds.clear()
    got = _run(model, xs, actor=forced, cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b, exact=False)  # (the graphs' controller runs on every image)
    # first forward: the run ahead over everything finds block 1 open when the logits are due, so
    # the forward runs again block by block (block 1 without speculation now)
    assert segments[:3] == [("run_ahead", 0, depth, True), ("attention", 0, True), ("attention", 1, False)]
    assert len(embeds) == 1 + 2 + 1
    # the second forward runs ahead over block 0 only; its gates are read after block 1's segment
    second = segments.index(("run_ahead", 0, 1, False))
    assert segments[second + 1] == ("attention", 1, False)
    # MLPs: the first forward ran every block's in the run ahead, then its own, block by block
    # (block 0's speculatively; after a deletion: speculative, plus the survivors' where a gate
    # opened); the second as the per-block path with the first forward's gates
    assert got[0][2] == [2, 2] + [2 + o for o in opened[2:]]
    before, now = (g.gate.any(0).tolist() for g in (got[0][1], got[1][1]))
    assert got[1][2] == [1 if b else 1 + n for b, n in zip(before, now)]
    hook.remove()

    # a run ahead that ends before the last block (block 2 opened in the last forward, as far as
    # the runner knows) while block 1 opens: found when block 2's segment has been enqueued
    timm_dora.wrap(model, actor=forced, cuda_graphs=True)
    try:
        with torch.inference_mode():
            model(xs[0])
            runner = next(iter(model._dora.graphs.values()))
            runner.opened[1:3] = [False, True]
            segments.clear()
            out = model(xs[0])
            stats = model.dora_stats
    finally:
        timm_dora.unwrap(model)
    assert segments[:4] == [("run_ahead", 0, 2, False), ("attention", 2, False), ("attention", 0, True),
                            ("attention", 1, False)]
    _assert_same((out, stats, None), ref[0], exact=False)

    engine_options(run_ahead=False)
    segments.clear()
    off = _run(model, xs, actor=forced, cuda_graphs=True)
    for a, b in zip(off, got):
        _assert_same(a, b)
    assert not any(k[0] == "run_ahead" for k in segments)


def test_keys_read_by_a_policy_are_recomputed_exactly():
    """A policy that reads ``ctx.keys`` in the dense phase sees the keys of the default path."""
    name, kw = SMALL_FAMILIES["dinov2_registers"]  # LayerScale, registers
    model = make_model(name, **kw)
    x = images(model, 4)

    class KeySpy:
        def __init__(self):
            self.keys = []

        def __call__(self, ctx):
            self.keys.append(ctx.keys.clone())
            return ctx.nothing()

    spies = []
    for graphs in (False, True):
        spy = KeySpy()
        _run(model, [x], policy=spy, cuda_graphs=graphs)
        spies.append(spy)
    assert len(spies[0].keys) == len(spies[1].keys) == len(model.blocks)
    for a, b in zip(*(s.keys for s in spies)):
        assert torch.equal(a, b)


def test_a_gate_without_removal_leaves_the_dense_phase():
    """A custom decision that opens a gate without removing changes the history the captured gate
    assumed: the forward must continue on the default path from there."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = images(model, 3)

    def policy(ctx):
        if ctx.block == 2:
            return Decision(ctx.constants.opened, ctx.constants.zeros)
        return ctx.nothing()

    ref = _run(model, [x], policy=policy)
    got = _run(model, [x], policy=policy, cuda_graphs=True)
    _assert_same(got[0], ref[0])
    assert ref[0][1].gate[:, 2].all()


def test_segments_are_cached_per_batch_shape_and_policy(engine_options):
    engine_options(max_cached_small=SMALL_CACHED)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "closed")
    timm_dora.wrap(model, actor, cuda_graphs=True)
    cache = model._dora.graphs
    with torch.inference_mode():
        model(images(model, 2))
        first = next(iter(cache.values()))
        model(images(model, 2, seed=5))
        assert len(cache) == 1 and next(iter(cache.values())) is first
        for b in range(3, 3 + SMALL_CACHED):
            model(images(model, b))
        assert len(cache) == SMALL_CACHED and first not in cache.values()  # least recent dropped
        assert all(isinstance(v, GraphRunner) for v in cache.values())
        timm_dora.set_policy(model, NoPrune())
        assert len(cache) == 0  # captured for the old policy
        model(images(model, 2))
        assert len(cache) == 1
    timm_dora.unwrap(model)


def test_autograd_or_training_falls_back_with_one_warning():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = images(model, 2)
    actor = kind_actor(model, "biased")
    timm_dora.wrap(model, actor)
    with torch.no_grad():
        ref = model(x)
    timm_dora.unwrap(model)
    timm_dora.wrap(model, actor, cuda_graphs=True)
    with pytest.warns(UserWarning, match="runs eagerly: autograd is enabled") as caught:
        out = model(x)
    assert caught[0].filename == __file__  # attributed to the caller's line
    assert torch.equal(out.detach(), ref) and len(model._dora.graphs) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        model(x)
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert len(model._dora.graphs) == 1
    timm_dora.unwrap(model)


def test_graph_option_is_part_of_the_wrap_identity_and_sizes_are_checked():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "closed")
    timm_dora.wrap(model, actor, cuda_graphs=True)
    assert timm_dora.wrap(model, actor, cuda_graphs=True) is model
    with pytest.raises(ValueError, match="already wrapped"):
        timm_dora.wrap(model, actor)
    with torch.inference_mode(), pytest.raises(AssertionError, match=r"Input height \(80\) doesn't match model \(64\)"):
        model(torch.randn(1, 3, 80, 80))  # another input size takes the default path: timm refuses it
    assert len(model._dora.graphs) == 0
    timm_dora.unwrap(model)


def test_sampled_actor_policy_has_no_graph_probe():
    """Sampling or recording policies draw noise or keep records: they decide on the host."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "biased")
    assert ActorPolicy(actor).graph_probe
    assert not ActorPolicy(actor, sample=True).graph_probe
    assert not ActorPolicy(actor, record=True).graph_probe
    x = images(model, 4)
    runs = []
    for graphs in (False, True):
        policy = ActorPolicy(actor, sample=True, record=True, generator=torch.Generator().manual_seed(0))
        runs.append(_run(model, [x], policy=policy, cuda_graphs=graphs)[0])
        assert len(policy.records) == len(model.blocks)
    _assert_same(runs[1], runs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture itself)")
@pytest.mark.parametrize("bucket", [1, 64])
@pytest.mark.parametrize("kind", ["closed", "biased", "forced", "replay"])
def test_captured_graphs_match_the_default_forward_on_cuda(kind, bucket, monkeypatch, engine_options):
    engine_options(rows_bucket=bucket)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    xs = [images(model, 6, seed=s).to("cuda", torch.bfloat16) for s in (1, 2, 1)]
    if kind == "replay":
        wrap_kw = dict(policy=ReplayPolicy({l: (i.cuda(), c.cuda()) for l, (i, c) in random_plan(6, 16, 12, [2, 5]).items()}))
    else:
        wrap_kw = dict(actor=kind_actor(model, kind).to("cuda", torch.bfloat16))
    ref = _run(model, xs, **wrap_kw)
    got = _run(model, xs, **wrap_kw, cuda_graphs=True)
    for a, b in zip(got, ref):
        (oa, sa, _), (ob, sb, _) = a, b
        if kind in ("closed", "replay"):
            if bucket == 1:
                _assert_same(a, b)
            else:  # padded rows: the same decisions, logits within bf16 rounding
                assert torch.equal(sa.removed, sb.removed) and torch.equal(sa.gate, sb.gate)
                torch.testing.assert_close(oa.float(), ob.float(), rtol=0, atol=3e-2)
            continue
        # with the controller: in bf16 its products over every image round differently from the
        # default path's over the gate-active ones, so a near-tie may flip (measured agreement in
        # benchmarks/gpu_check.py); here the graphs' own decisions must be valid and consistent
        assert torch.isfinite(oa).all()
        assert torch.equal(sa.removed > 0, sa.gate)
        if kind == "forced":  # the gate opens at blocks 1, 4, 7 only, whatever was removed before
            assert torch.equal(sa.gate.any(0), sb.gate.any(0))
        assert (sa.tokens[:, -1] >= 4).all() and torch.equal(sa.tokens, 16 - sa.removed.cumsum(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton gate and the capture)")
def test_no_reference_to_a_captured_qkv_output_outlives_its_graph(monkeypatch, engine_options):
    """A fused intervention graph's controller reads the keys as a view of the same graph's qkv
    output; after the capture no reference to it may remain (it would pin that output's memory in
    the graphs' pool, where later captures reuse freed memory). (The per-block executor: a batch
    this small would otherwise run as one planned graph.)"""
    engine_options(planned=False)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    timm_dora.wrap(model, actor=kind_actor(model, "forced").to("cuda", torch.bfloat16), cuda_graphs=True)
    try:
        with torch.inference_mode():
            for s in (1, 2):
                model(images(model, 6, seed=s).to("cuda", torch.bfloat16))
        runner = next(iter(model._dora.graphs.values()))
        assert runner.triton_gate and any(k[0] == "attention_controller" for k in runner.graphs)
        assert runner.keys_in_place is None
    finally:
        timm_dora.unwrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the graphs' memory pool)")
def test_captures_take_their_scratch_from_one_reserved_segment(monkeypatch, engine_options):
    """``EngineOptions.reserve_pool``: before the first capture one segment of the graphs' pool is reserved for
    the largest expected scratch (``_scratch_bytes``), and the captures carve their intermediates
    out of it: the pool holds less than when every intermediate size got its own segment, and the
    forward is the same."""
    model = make_model("deit_tiny_patch16_224").to("cuda", torch.bfloat16)  # 197 tokens: MiB-sized rows
    actor = kind_actor(model, "forced").to("cuda", torch.bfloat16)
    xs = [images(model, 64, seed=s).to("cuda", torch.bfloat16) for s in (1, 2)]
    got = {}
    for reserve in (False, True):
        engine_options(reserve_pool=reserve, planned_max_gflops=0)  # (the per-block executor's captures)
        timm_dora.wrap(model, actor=actor, cuda_graphs=True)
        try:
            with torch.inference_mode():
                outs = [model(x) for x in xs + xs]
            torch.cuda.synchronize()
            runner = next(iter(model._dora.graphs.values()))
            sizes = [seg["total_size"] for seg in torch.cuda.memory_snapshot()
                     if tuple(seg.get("segment_pool_id", ())) == tuple(runner.pool)]
            got[reserve] = (outs, sizes, runner._scratch_bytes(), ("reserve",) in runner.graphs)
        finally:
            timm_dora.unwrap(model)
    (outs_off, sizes_off, _, marker_off), (outs_on, sizes_on, scratch, marker_on) = got[False], got[True]
    assert marker_on and not marker_off
    assert max(sizes_on) >= scratch > 0
    assert sum(sizes_on) < sum(sizes_off), (sizes_on, sizes_off)
    for a, b in zip(outs_on, outs_off):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])  # one prefix token; five
def test_fixed_shape_controller_equals_the_controller(family):
    """``ActorPolicy.controller_fixed`` (every image, masked by the gate; what the graphs capture)
    against the controller of ``ActorPolicy.__call__`` on a ragged packed batch: same removals."""
    from timm_dora.engine.packing import Packed
    from timm_dora.policy import BlockContext, ForwardConstants

    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    actor = kind_actor(model, "biased")
    policy = ActorPolicy(actor)
    p, n0, d = model.num_prefix_tokens, model.patch_embed.num_patches, actor.embed_dim
    g = torch.Generator().manual_seed(0)
    lengths = [p + n for n in (n0, n0 - 6, 9, n0 - 2, 5)]
    b = len(lengths)
    packed = Packed(torch.zeros(sum(lengths), d), torch.tensor(lengths), lengths, p)
    keys = torch.randn(sum(lengths), d, generator=g)
    n_visual = packed.lengths - p
    rho, inter = torch.rand(b, generator=g), torch.tensor([0, 1, 2, 0, 1])
    ctx = BlockContext(3, keys, packed, n_visual, rho, inter, len(model.blocks), n0, "sdpa_loop", ForwardConstants(b, keys.device))
    with torch.no_grad():
        step = policy.probe(ctx)
        gate = torch.tensor([True, False, True, True, False])  # a mixed gate, whatever the actor said
        dec = policy._decide(dataclasses.replace(step, gate=gate), gate.tolist())
        remove, removed, flops = policy.controller_fixed(keys, packed.cu_seqlens, max(lengths), p, step.h, n_visual, gate,
                                                         3, "sdpa_loop", lengths)
    assert gate.sum() == 3 and torch.equal(removed, dec.removed) and removed[~gate].eq(0).all()
    assert torch.equal(remove, dec.remove) and torch.equal(flops, dec.flops)
    assert dec.removed[gate].gt(0).all()


def test_dropped_graph_runners_are_freed_without_a_garbage_collection(engine_options):
    """unwrap, set_policy and the cache's eviction release their runners at once (graphs destroyed,
    buffers freed by reference counting): with the collector off, nothing is left for a later
    collection, which could otherwise run inside another model's capture (see the CUDA test below)."""
    import gc
    import weakref

    engine_options(max_cached_small=SMALL_CACHED)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)

    def runner_of(batch):
        with torch.inference_mode():
            model(images(model, batch))
        return weakref.ref(model._dora.graphs[next(k for k in model._dora.graphs if k[0][0] == batch)])

    enabled = gc.isenabled()
    gc.disable()
    try:
        timm_dora.wrap(model, kind_actor(model, "forced"), cuda_graphs=True)
        first = runner_of(2)
        for b in range(3, 3 + SMALL_CACHED):  # the first runner is evicted
            runner_of(b)
        assert first() is None
        last = runner_of(2)
        timm_dora.set_policy(model, NoPrune())
        assert last() is None and not model._dora.graphs
        last = runner_of(2)
        timm_dora.unwrap(model)
        assert last() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture itself)")
def test_a_garbage_collection_inside_a_capture_destroys_no_graph(monkeypatch, engine_options):
    """A dropped wrapped model keeps its captured graphs until Python's cyclic collector frees them
    (model and runner reference each other); when that collection ran inside another capture, the
    graphs' destruction invalidated it (cudaErrorStreamCaptureInvalidated on an H100). Here the
    dropped graphs become young cyclic garbage inside the first capture and the collector's
    threshold is 1: the capture must still succeed (no collection while capturing) and give the
    default forward's result. (The per-block executor: a batch this small would otherwise run as
    one planned graph, observed eagerly first.)"""
    import gc

    engine_options(planned=False)
    name, kw = SMALL_FAMILIES["deit"]
    old = make_model(name, **kw).to("cuda", torch.bfloat16)
    x = images(old, 6).to("cuda", torch.bfloat16)
    timm_dora.wrap(old, kind_actor(old, "forced").to("cuda", torch.bfloat16), cuda_graphs=True)
    with torch.inference_mode():
        old(x)
    runner = next(iter(old._dora.graphs.values()))
    dropped = [list(runner.graphs.values())]  # captured graphs; soon referenced by garbage only
    assert dropped[0]
    runner.graphs.clear()
    del runner
    timm_dora.unwrap(old)
    segment = Segments.build

    def segment_dropping_graphs(self, key):
        fn = segment(self, key)

        def run():
            if dropped and torch.cuda.is_current_stream_capturing():
                cycle = {"graphs": dropped.pop()}
                cycle["self"] = cycle  # the only owner of the graphs: cyclic garbage once dropped
                del cycle
                threshold = gc.get_threshold()
                gc.set_threshold(1)  # the next allocations start an automatic collection...
                try:
                    _ = [[] for _ in range(8)]
                finally:
                    gc.set_threshold(*threshold)
            fn()
        return run

    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    wrap_kw = dict(actor=kind_actor(model, "closed").to("cuda", torch.bfloat16))
    ref = _run(model, [x], **wrap_kw)
    monkeypatch.setattr(Segments, "build", segment_dropping_graphs)
    got = _run(model, [x], **wrap_kw, cuda_graphs=True)
    assert not dropped  # the garbage was made inside a capture
    gc.collect()  # ...and is collected outside it
    _assert_same(got[0], ref[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (host syncs are a CUDA notion)")
@pytest.mark.parametrize("graphs", [False, True])
def test_a_replay_plan_forward_never_synchronises_on_cuda(graphs):
    """A fixed plan knows its lengths on the host: its forward must not wait for the device. (On
    CUDA ``mask[rows] = True`` synchronised, once per deletion, invisible to CPU op counting: the
    scalar goes through a device tensor and ``.item()`` in the indexing binding.)"""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    x = images(model, 6).to("cuda", torch.bfloat16)
    plan = {l: (i.cuda(), c.cuda()) for l, (i, c) in random_plan(6, 16, 12, [2, 5, 8]).items()}
    timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=graphs)
    with torch.inference_mode():
        model(x)  # captures (graphs) outside the checked forward
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert model.dora_stats.removed.sum() > 0
    timm_dora.unwrap(model)


@pytest.mark.parametrize("plan_blocks", [[], [2, 5]])  # dense to the end (eager pooled readout); pruned
def test_graph_path_with_the_lc1_readout(plan_blocks):
    name, kw = SMALL_FAMILIES["dinov2_registers"]
    model = make_model(name, **kw)
    model.head = torch.nn.Linear(2 * model.embed_dim, 10)
    xs = [images(model, 3, seed=s) for s in (1, 2)]
    plan = random_plan(3, model.patch_embed.num_patches, len(model.blocks), plan_blocks, seed=5)
    ref = _run(model, xs, policy=ReplayPolicy(plan), readout="lc1")
    got = _run(model, xs, policy=ReplayPolicy(plan), readout="lc1", cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b)


def test_graphs_made_under_inference_mode_serve_no_grad_forwards_too():
    """The fixed buffers are ordinary tensors: a runner made under ``inference_mode`` also serves
    forwards under ``no_grad`` (in-place writes into inference tensors would fail there)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")
    x = images(model, 3)
    ref = _run(model, [x], actor=actor)[0]
    timm_dora.wrap(model, actor, cuda_graphs=True)
    with torch.inference_mode():
        model(x)
    with torch.no_grad():
        out = model(x)
    assert len(model._dora.graphs) == 1
    torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-5)
    assert torch.equal(model.dora_stats.removed, ref[1].removed)
    timm_dora.unwrap(model)


def test_actor_policy_subclasses_and_other_dtypes_are_called_as_policies():
    """A subclass that changes the decision, an actor in another dtype than the activations, or a
    policy that says it reads no keys must not be replaced by the graphs' own gate and controller."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = gate_forced_actor(model, [1, 8])

    class NoPruneAfter5(ActorPolicy):
        def __call__(self, ctx):
            return ctx.nothing() if ctx.block > 5 else super().__call__(ctx)

    x = images(model, 4)
    keyless = ActorPolicy(actor)
    keyless.reads_keys = False  # the graphs would keep no keys for its packed gate
    for policy in (NoPruneAfter5(actor), ActorPolicy(Actor.for_model(model).double()), keyless):
        ref = _run(model, [x], policy=policy)[0]
        got = _run(model, [x], policy=policy, cuda_graphs=True)[0]
        _assert_same(got, ref)
        if isinstance(policy, NoPruneAfter5):  # the subclass's rule held: block 1 pruned, block 8 not
            assert got[1].removed[:, 1].gt(0).all() and got[1].removed[:, 8].eq(0).all()
        timm_dora.wrap(model, policy=policy, cuda_graphs=True)
        with torch.inference_mode():
            model(x)
        assert not next(iter(model._dora.graphs.values())).probing
        timm_dora.unwrap(model)
    assert ActorPolicy(actor).graph_probe and not NoPruneAfter5(actor).graph_probe


def test_graphs_captured_in_another_order_stay_correct():
    """Graphs are captured lazily, in the order their (block, rows) first occur, and share one
    memory pool: a forward whose gate first opens at a later block than before replays old graphs
    between new ones. Outputs that outlive their graph (gates, history, controller results) live
    in fixed buffers outside the pool; every statistic must still equal the default forward's.
    (A real check on CUDA; on the CPU the same sequence runs uncaptured.)"""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    model = model.to(dev, dtype)
    x = images(model, 6).to(dev, dtype)
    actor = gate_forced_actor(model, [1]).to(dev, dtype)
    runs = []
    for graphs in (False, True):
        timm_dora.wrap(model, actor, cuda_graphs=graphs)
        with torch.inference_mode():
            out = []
            for opens in ([1], [5], [1, 8], [5]):
                with torch.no_grad():
                    actor.gate_embed.zero_()
                    actor.gate_embed[opens, 0] = 10.0
                out.append((model(x), model.dora_stats))
        runs.append(out)
        timm_dora.unwrap(model)
    for (oa, sa), (ob, sb) in zip(*runs):
        assert torch.equal(sa.gate, sb.gate) and sa.gate.any()
        assert (sa.removed > 0).eq(sa.gate).all() and (sb.removed > 0).eq(sb.gate).all()
        for pa, pb in zip(sa.removed_patches, sb.removed_patches):
            assert (pa is None) == (pb is None)
        assert torch.isfinite(ob).all()


def test_rows_bucket_rule(monkeypatch, engine_options):
    engine_options(rows_bucket=None)
    assert graphs_module.rows_bucket(320 * 197) == 247  # ceil(63040 / 256)
    assert graphs_module.rows_bucket(8 * 197) == 16 and graphs_module.rows_bucket(197) == 16
    assert graphs_module.rows_bucket(1024 * 197) == 256
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    timm_dora.wrap(model, policy=NoPrune(), cuda_graphs=True)
    with torch.inference_mode():
        model(images(model, 3))  # 3 x 17 rows: bucket 16
    runner = next(iter(model._dora.graphs.values()))
    assert [runner._padded(t) for t in (1, 16, 17, 40, 51)] == [16, 16, 32, 48, 51]  # capped at B*S
    timm_dora.unwrap(model)


@pytest.mark.parametrize("graphs", [False, True])
def test_statistics_are_computed_when_read_and_stay_valid(graphs):
    """``model.dora_stats`` is computed on first access; read after later forwards (which reuse
    the graphs' buffers) it still describes its own forward."""
    import copy

    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "forced")
    xs = [images(model, 4, seed=s) for s in (1, 2)]
    eager = _run(model, xs, actor=actor)  # each read right after its forward
    timm_dora.wrap(model, actor, cuda_graphs=graphs)
    with torch.inference_mode():
        model(xs[0])
        first = model.dora_stats
        assert "_compute" in first.__dict__ and "gflops" not in first.__dict__  # nothing computed yet
        model(xs[1])
        second = model.dora_stats
    assert copy.copy(first) is not None and "_compute" in first.__dict__  # dunder lookups do not compute
    for lazy, (_, ref, _) in zip((first, second), eager):
        for f in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
            assert torch.equal(getattr(lazy, f), getattr(ref, f)), f
        assert lazy.backend == ref.backend and lazy.summary() == ref.summary()
        for pa, pb in zip(lazy.removed_patches, ref.removed_patches, strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])
    timm_dora.unwrap(model)


def test_graph_path_embeds_the_callers_images_in_any_layout():
    """The embedding runs on the caller's tensor (eagerly; the whole forward's graph from a
    contiguous copy): a channels-last or strided batch gives the default forward's result, and a
    new batch the new result."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "biased")
    x, y = images(model, 4, seed=1), images(model, 4, seed=2)
    ref = _run(model, [x, y], actor=actor)
    wide = torch.stack([y, y], -1)[..., 0]  # a strided view with y's values
    assert not wide.is_contiguous() and torch.equal(wide, y)
    got = _run(model, [x.contiguous(memory_format=torch.channels_last), wide], actor=actor, cuda_graphs=True)
    for a, b in zip(got, ref):
        _assert_same(a, b, exact=False)
    assert not torch.equal(got[0][0], got[1][0])
