"""Zero-TPrune: hand-worked WPR, EIR/VHF and S-stage, native equivalence, an independent per-image
reference forward, GFLOPs against a hand count and torch.utils.flop_counter, batch independence and
prefix protection."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.engine.blocks import embed
from timm_dora.evaluate.baselines.tome import attention_with_keys
from timm_dora.evaluate.baselines.zerotprune import (
    MIN_KEEP,
    ZeroTPrune,
    aggregate_heads,
    s_stage,
    weighted_pagerank,
    wpr_iterations,
    zerotprune_block,
    zerotprune_forward,
    zerotprune_gflops,
    zerotprune_schedule,
)

from helpers import SMALL_FAMILIES, assert_batch_independent, counter_flops, images, make_model, reference_forward


def test_weighted_pagerank_hand_worked():
    # token 0 attends half to itself, half to 1; token 1 entirely to 2; token 2 entirely to 1
    a = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    s0 = torch.full((3,), 1 / 3)
    # s_j <- sum_i A_ij s_i: [.5/3, (.5 + 1)/3, 1/3]
    assert torch.allclose(weighted_pagerank(a, s0, 1), torch.tensor([1 / 6, 1 / 2, 1 / 3]))
    # again: [.5/6, .5/6 + 1/3, 1/2]
    assert torch.allclose(weighted_pagerank(a, s0, 2), torch.tensor([1 / 12, 5 / 12, 1 / 2]))
    assert torch.equal(weighted_pagerank(a, s0, 0), s0)
    # batched over leading dims, and the mass is conserved on a row-stochastic graph
    s = weighted_pagerank(a.expand(2, 4, 3, 3), s0.expand(2, 4, 3), 7)
    assert s.shape == (2, 4, 3) and torch.allclose(s.sum(-1), torch.ones(2, 4))


def test_eir_and_variance_head_filter_hand_worked():
    # one prefix token, two visual tokens, two heads
    s = torch.tensor([[[0.6, 0.2, 0.2], [0.6, 0.1, 0.3]]])
    # head 0: visual scores / mean = [1, 1], variance 0 < 0.01: filtered; head 1: [.5, 1.5], variance .25: kept
    assert torch.allclose(aggregate_heads(s, 1), s[0, 1][None])
    # no filter: the root mean square over heads
    assert torch.allclose(aggregate_heads(s, 1, None), ((s[0, 0] ** 2 + s[0, 1] ** 2) / 2).sqrt()[None])
    # no head passes (range excludes both): every head counts
    assert torch.allclose(aggregate_heads(s, 1, (0.5, 0.7)), aggregate_heads(s, 1, None))
    # EIR emphasises a token important in one head over one middling in both (mean would tie them)
    t = torch.tensor([[[0.0, 0.9, 0.5], [0.0, 0.1, 0.5]]])
    agg = aggregate_heads(t, 1, None)[0]
    assert agg[1] > agg[2] and math.isclose(float(t[0, :, 1].mean()), float(t[0, :, 2].mean()))


def test_s_stage_hand_worked():
    # importance ascending: v1 (.1), v3 (.2), v2 (.3), v0 (.4) -> A = {v1, v3}, B = {v2, v0}
    imp = torch.tensor([[0.4, 0.1, 0.3, 0.2]])
    k = torch.tensor([[[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, 1.0]]])
    # edges: v1 -> v0 (cos 1/sqrt(1.01) = .995), v3 -> v0 or v2 (.707): v1 goes first
    assert s_stage(k, imp, 1).tolist() == [[1]]
    assert s_stage(k, imp, 2).tolist() == [[1, 3]]
    assert s_stage(k, imp, 0).shape == (1, 0)
    # the most important half is never deleted, however similar: v0 and v3 identical, v0 in B
    k2 = torch.tensor([[[1.0, 1.0], [0.0, 1.0], [1.0, -1.0], [1.0, 1.0]]])
    assert s_stage(k2, imp, 1).tolist() == [[3]]
    with pytest.raises(ValueError):
        s_stage(k, imp, 3)


def test_schedule_caps_and_iterations():
    model = make_model("deit_tiny_patch16_224", img_size=64)  # 16 patches
    eff, entering = zerotprune_schedule(model, 5)
    assert eff[:4] == [5, 5, 2, 0] and entering[:4] == [16, 11, 6, 4]
    assert min(zerotprune_gflops(model, 100).tokens) == MIN_KEEP
    assert wpr_iterations(12) == [30, 30, 30, 5, 5, 5, 5, 5, 5, 1, 1, 1]
    assert wpr_iterations(4, 2) == [2] * 4
    with pytest.raises(ValueError):
        wpr_iterations(4, [1, 2])


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "vit_gap"])
def test_r0_equals_native(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        assert (zerotprune_forward(model, x, 0) - ref).abs().max() <= 1e-5
        assert (ZeroTPrune(model, [0] * len(model.blocks))(x) - ref).abs().max() <= 1e-5
    assert zerotprune_gflops(model, 0).gflops == pytest.approx(timm_dora.native_gflops(model), rel=1e-12)
    assert zerotprune_gflops(model, 0).extra_gflops == 0


@pytest.mark.parametrize("family,r,s_frac", [("deit", 3, 0.5), ("deit_distilled", [4, 0, 2, 0, 0, 3, 0, 0, 0, 1, 0, 0], 0.5),
                                             ("dinov2_registers", 2, 0.0), ("vit_gap", 3, 1.0)])
def test_reference_forward_with_the_same_deletions(family, r, s_frac):
    """Each image alone through timm's own modules, deleting the visual tokens Zero-TPrune deleted:
    the same logits (Zero-TPrune only chooses; it deletes and changes no kept row)."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    eff, entering = zerotprune_schedule(model, r)
    keeps = []
    with torch.no_grad():
        out = zerotprune_forward(model, x, r, s_frac=s_frac, keep_out=keeps)
    pruning = [l for l, rl in enumerate(eff) if rl > 0]
    assert len(keeps) == len(pruning)
    for i in range(3):
        dels = {l: sorted(set(range(entering[l])) - set(keep[i].tolist())) for l, keep in zip(pruning, keeps)}
        assert all(len(dels[l]) == eff[l] for l in pruning)
        ref = reference_forward(model, x[i:i + 1], dels)
        assert (out[i] - ref[0]).abs().max() < 1e-4, i


def _hand_extra(heads, attn_dim, prefix, patches, r_list, iters, s_frac):
    extra, n = 0, patches
    for l, rl in enumerate(r_list):
        rl = max(0, min(rl, n - MIN_KEEP))
        t, rs = prefix + n, min(math.floor(s_frac * rl), -(-n // 2))
        if rs:
            extra += heads * t * t + (-(-n // 2)) * (n // 2) * attn_dim
        if rl - rs:
            extra += iters[l] * heads * (t - rs) ** 2
        n -= rl
    return extra


@pytest.mark.parametrize("family,r,s_frac", [("deit", 2, 0.5), ("deit", [4, 1, 0, 3, 0, 0, 0, 0, 0, 2, 0, 0], 0.5),
                                             ("deit_distilled", 3, 1.0), ("dinov2_registers", 2, 0.0)])
def test_gflops_equal_hand_count_and_flop_counter(family, r, s_frac):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    p, h, d = model.num_prefix_tokens, model.blocks[0].attn.num_heads, model.embed_dim
    cost = zerotprune_gflops(model, r, s_frac=s_frac)
    eff, entering = zerotprune_schedule(model, r)
    extra = _hand_extra(h, d, p, 16, eff if isinstance(r, list) else [r] * 12, wpr_iterations(12), s_frac)
    assert int(round(cost.extra_gflops * 1e9)) == 2 * extra
    # the backbone part: ToMe-like token counts (attention on T, MLP on T - r_l), no bias
    dense = zerotprune_gflops(model, 0)
    assert cost.gflops < dense.gflops and cost.extra_gflops > 0
    # what SDPA does (non-pruning blocks) may be invisible to the counter; the rest is plain matmuls
    sdpa = sum(2 * (n + p) ** 2 * d for rl, n in zip(eff, entering) if rl == 0)
    total = int(round(cost.gflops * 1e9 / 2))
    x = images(model, 2)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        zerotprune_forward(model, x, r, s_frac=s_frac)
    stable, counted_sdpa = counter_flops(fc)
    assert stable == 2 * 2 * (total - sdpa)  # two images
    assert counted_sdpa in (None, 2 * 2 * sdpa)


@pytest.mark.parametrize("family", ["deit", "dinov2_registers", "vit_gap"])
def test_batch_independence(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    assert_batch_independent(lambda x: zerotprune_forward(model, x, 3), model, images(model, 4))


@pytest.mark.parametrize("family", ["deit_distilled", "dinov2_registers"])
def test_prefix_tokens_never_pruned(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    p = model.num_prefix_tokens
    blk = model.blocks[0]
    with torch.no_grad():
        x = embed(model, images(model, 2))
        x[:, 1:p] = x[:, p:p + 1]  # prefix tokens identical to a visual token (the most similar pairs)
        ref, _ = attention_with_keys(blk, x)
        for s_frac in (0.0, 0.5, 1.0):
            keeps = []
            y = zerotprune_block(blk, x, 10, p, 5, s_frac=s_frac, n_boost=1, keep_out=keeps)
            assert y.shape == (2, p + 6, model.embed_dim)
            assert (y[:, :p] - ref[:, :p]).abs().max() < 1e-5  # every prefix row kept, first
            keep = keeps[0]
            assert bool((keep[:, 1:] > keep[:, :-1]).all())  # visual tokens in their order
            kept = ref[:, p:].gather(1, keep[..., None].expand(-1, -1, ref.shape[-1]))
            assert (y[:, p:] - kept).abs().max() < 1e-5  # deletion only: kept rows unchanged


def test_name_and_options():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    assert ZeroTPrune(model, 8).name == "zerotprune(r=8)"
    assert ZeroTPrune(model, [2] * 12, s_frac=0.0, vhf=None, cls_boost=False).name == \
        "zerotprune(r=" + ",".join(["2"] * 12) + ", s=0, no vhf, uni)"
    assert ZeroTPrune(model, 2, iters=3).name == "zerotprune(r=2, iters=3)"
    x = images(model, 2)
    with torch.no_grad():
        a, b = ZeroTPrune(model, 3)(x), ZeroTPrune(model, 3, s_frac=0.0)(x)
    assert a.shape == (2, 10) and not torch.allclose(a, b, atol=1e-4)
    assert ZeroTPrune(model, 3, skip_dead=True).cost.gflops < ZeroTPrune(model, 3).cost.gflops
    with pytest.raises(ValueError):
        ZeroTPrune(model, 2, s_frac=1.5)
    avg = make_model(*SMALL_FAMILIES["vit_avgpool"][:1], **SMALL_FAMILIES["vit_avgpool"][1])
    with pytest.raises(ValueError):
        ZeroTPrune(avg, 2, skip_dead=True)
