"""Speculative gate read (``wrap(..., speculate=True)``, issue #8): the MLP of the unpruned batch is
enqueued before the host reads the gate and is kept only when nothing is removed. Everything a
forward returns must be identical to the default path."""
import pytest
import torch

import timm_dora
from benchmarks.common import gate_forced_actor
from timm_dora import ActorPolicy, NoPrune, ReplayPolicy
from timm_dora.policy import RolloutNoise
from timm_dora.policy.actor_policy import host_reader

from helpers import SMALL_FAMILIES, images, kind_actor, make_model, random_plan

FAMILIES = ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "vit_gap", "vit_reg4_gap", "siglip_map"]




def _forward(model, x, **wrap_kw):
    """Logits, stats and the number of MLP calls per block of one wrapped forward."""
    calls = [0] * len(model.blocks)

    def count(l):
        def hook(module, args):
            calls[l] += 1
        return hook

    hooks = [blk.mlp.register_forward_pre_hook(count(l)) for l, blk in enumerate(model.blocks)]
    timm_dora.wrap(model, **wrap_kw)
    try:
        with torch.no_grad():
            out = model(x)
        return out, model.dora_stats, calls
    finally:
        timm_dora.unwrap(model)
        for h in hooks:
            h.remove()


def _assert_same_stats(a, b):
    for name in ("tokens", "gate", "removed", "gflops", "policy_gflops"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.backend == b.backend
    assert len(a.removed_patches) == len(b.removed_patches)
    for pa, pb in zip(a.removed_patches, b.removed_patches):
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


@pytest.mark.parametrize("kind", ["closed", "biased", "forced"])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_is_bit_identical(family, kind):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 6)
    actor = kind_actor(model, kind)
    ref, ref_stats, ref_calls = _forward(model, x, actor=actor)
    out, stats, calls = _forward(model, x, actor=actor, speculate=True)
    assert torch.equal(out, ref)
    _assert_same_stats(stats, ref_stats)
    pruned = (ref_stats.removed.sum(0) > 0).tolist()
    opened = ref_stats.gate.any(0).tolist()
    assert pruned == opened  # an actor removes tokens exactly where a gate opens
    # one speculative MLP per block, plus the MLP on the survivors where some gate opened
    assert ref_calls == [1] * len(model.blocks)
    assert calls == [1 + p for p in pruned]
    per_block = ref_stats.gate.sum(0)
    if kind == "closed":
        assert not any(opened)
    elif kind == "forced":
        # opens at those blocks while a budget is feasible (16 patches run out quickly)
        assert opened[1] and all(l in (1, 4, 7) for l, o in enumerate(opened) if o)
    else:  # both outcomes occur, and gates open on a strict subset of the images somewhere
        assert any(opened) and not all(opened)
        assert ((per_block > 0) & (per_block < x.shape[0])).any()


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_speculation_with_sampled_recording_policy(family):
    """Training-style policy (sampled gate, budget and order from pre-drawn noise, records kept)."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 5)
    actor = kind_actor(model, "biased")
    noise = RolloutNoise.draw(len(model.blocks), x.shape[0], actor.num_budgets, actor.num_patches,
                              generator=torch.Generator().manual_seed(7))
    runs = []
    for speculate in (False, True):
        policy = ActorPolicy(actor, sample=True, record=True, noise=noise, speculate=speculate)
        out, stats, _ = _forward(model, x, policy=policy)
        runs.append((out, stats, policy.records))
    (ref, ref_stats, ref_rec), (out, stats, rec) = runs
    assert torch.equal(out, ref)
    _assert_same_stats(stats, ref_stats)
    assert ref_stats.gate.any()
    assert len(rec) == len(ref_rec) == len(model.blocks)
    for a, b in zip(rec, ref_rec):
        for f in ("gate_logit", "gate", "active", "budget", "order", "scores"):
            va, vb = getattr(a, f), getattr(b, f)
            assert (va is None and vb is None) or torch.equal(va, vb), f


def test_speculative_mlp_is_enqueued_before_the_gate_is_read():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = images(model, 3)
    events = []
    policy = ActorPolicy(gate_forced_actor(model, [2]), speculate=True)
    gate, decide = policy._gate, policy._decide
    policy._gate = lambda ctx: (events.append(("gate", ctx.block)), gate(ctx))[1]
    policy._decide = lambda step, host: (events.append(("read", step.ctx.block)), decide(step, host))[1]
    for l, blk in enumerate(model.blocks):
        blk.mlp.register_forward_pre_hook(lambda m, a, l=l: events.append(("mlp", l)))
    timm_dora.wrap(model, policy=policy)
    with torch.no_grad():
        model(x)
    want = []
    for l in range(len(model.blocks)):
        want += [("gate", l), ("mlp", l), ("read", l)] + ([("mlp", l)] if l == 2 else [])
    assert events == want


def test_host_reader_returns_the_values():
    t = torch.tensor([True, False, True])
    assert host_reader(t)() == [True, False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_reader_on_cuda_copies_asynchronously():
    t = torch.tensor([True, False, True], device="cuda")
    assert host_reader(t)() == [True, False, True]


def test_bad_speculation_requests_raise_clearly():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    actor = kind_actor(model, "closed")
    with pytest.raises(ValueError, match="construct it with speculate=True"):
        timm_dora.wrap(model, policy=NoPrune(), speculate=True)
    with pytest.raises(ValueError, match="construct it with speculate=True"):
        timm_dora.wrap(model, policy=ActorPolicy(actor), speculate=True)

    class NoBegin(NoPrune):
        speculate = True

    with pytest.raises(TypeError, match="does not support speculation"):
        timm_dora.wrap(model, policy=NoBegin())
    assert not timm_dora.is_wrapped(model)

    timm_dora.wrap(model, policy=ReplayPolicy(random_plan(2, 16, 12, [1])))
    with pytest.raises(TypeError, match="does not support speculation"):
        timm_dora.set_policy(model, NoBegin())
    timm_dora.unwrap(model)

    timm_dora.wrap(model, actor, speculate=True)
    assert timm_dora.wrap(model, actor, speculate=True) is model  # same options: a no-op
    with pytest.raises(ValueError, match="already wrapped"):
        timm_dora.wrap(model, actor)  # speculate differs
    model.train()
    with pytest.raises(RuntimeError, match="inference option"):
        model(images(model, 2))
    model.eval()
    model(images(model, 2))
    timm_dora.unwrap(model)
    # a speculating policy given directly speculates without wrap's flag
    timm_dora.wrap(model, policy=ActorPolicy(actor, speculate=True), speculate=True)
    timm_dora.unwrap(model)
