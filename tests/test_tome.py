"""ToMe (and the dense static schedules): hand-worked cases, native equivalence, an independent
per-image reference forward, and GFLOPs against hand counts and torch.utils.flop_counter (on its
stable ops, ``helpers.STABLE_COUNTER_OPS``)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.evaluate.baselines import (
    ToMe,
    bipartite_prune,
    bipartite_soft_matching,
    proportional_attention,
    static_forward,
    static_gflops,
    tome_forward,
    tome_gflops,
    tome_schedule,
)
from timm_dora.evaluate.baselines.static import parse_schedule, schedule_for_reduction
from timm_dora.engine.blocks import embed

from helpers import SMALL_FAMILIES, assert_counter_agrees, hand_vit_macs, images, make_model


def _five_tokens(v2_metric):
    """CLS + 4 visual tokens (features x, sizes s, 2-d matching keys m)."""
    x = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 1.0], [4.0, 4.0], [2.0, 0.0]])[None]
    s = torch.tensor([[1.0, 2.0, 1.0, 1.0, 3.0]])
    m = torch.tensor([[5.0, 5.0], [1.0, 0.0], [1.0, 0.1], v2_metric, [1.0, 1.0]])[None]
    return x, m, s


def test_bipartite_matching_hand_worked():
    # visual tokens v0..v3: A = {v0, v2}, B = {v1, v3}
    # cos(v0,v1) = 1/sqrt(1.01) = .995, cos(v0,v3) = .707  -> edge v0 -> v1 (.995)
    # cos(v2,v1) = .1/sqrt(1.01) = .0995, cos(v2,v3) = .707 -> edge v2 -> v3 (.707)
    x, m, s = _five_tokens([0.0, 1.0])
    y, sy = bipartite_soft_matching(x, m, s, 1, num_prefix=1)
    # r=1 merges v0 (size 2) into v1 (size 1): (2*[1,0] + 1*[0,1]) / 3; order: CLS, unmerged A, B
    assert torch.allclose(y[0], torch.tensor([[9.0, 9.0], [4.0, 4.0], [2 / 3, 1 / 3], [2.0, 0.0]]))
    assert sy[0].tolist() == [1.0, 1.0, 3.0, 3.0]
    y, sy = bipartite_soft_matching(x, m, s, 2, num_prefix=1)
    # r=2 also merges v2 (size 1) into v3 (size 3): (1*[4,4] + 3*[2,0]) / 4 = [2.5, 1]
    assert torch.allclose(y[0], torch.tensor([[9.0, 9.0], [2 / 3, 1 / 3], [2.5, 1.0]]))
    assert sy[0].tolist() == [1.0, 3.0, 4.0]
    assert sy.sum() == s.sum()  # sizes are conserved


def test_bipartite_two_sources_into_one_destination():
    # v2's key [1, .2]: cos(v2,v1) = 1.02/(sqrt(1.04) sqrt(1.01)) = .99523 > cos(v0,v1) = .99504
    x, m, s = _five_tokens([1.0, 0.2])
    y, sy = bipartite_soft_matching(x, m, s, 1, num_prefix=1)
    assert torch.allclose(y[0], torch.tensor([[9.0, 9.0], [1.0, 0.0], [2.0, 2.5], [2.0, 0.0]]))  # (x2 + x1)/2
    assert sy[0].tolist() == [1.0, 2.0, 2.0, 3.0]
    y, sy = bipartite_soft_matching(x, m, s, 2, num_prefix=1)
    # both A tokens into v1: (2*[1,0] + 1*[0,1] + 1*[4,4]) / 4 = [1.5, 1.25]
    assert torch.allclose(y[0], torch.tensor([[9.0, 9.0], [1.5, 1.25], [2.0, 0.0]]))
    assert sy[0].tolist() == [1.0, 4.0, 3.0]


def test_bipartite_prune_deletes_the_matched_tokens_hand_worked():
    # the same edges as test_bipartite_matching_hand_worked: v0 -> v1 (.995), v2 -> v3 (.707)
    x, m, _ = _five_tokens([0.0, 1.0])
    assert torch.equal(bipartite_prune(x, m, 1, num_prefix=1)[0], x[0, [0, 3, 2, 4]])  # v0 gone; v1 unchanged
    assert torch.equal(bipartite_prune(x, m, 2, num_prefix=1)[0], x[0, [0, 2, 4]])  # v0, v2 gone
    assert torch.equal(bipartite_prune(x, m, 0, num_prefix=1), x)


def test_cls_and_prefix_tokens_never_merge():
    # a CLS identical to every visual token still stays, and is never a destination
    x = torch.randn(1, 7, 4)
    m = torch.ones(1, 7, 3)
    y, sy = bipartite_soft_matching(x, m, torch.ones(1, 7), 3, num_prefix=2)
    assert torch.equal(y[:, :2], x[:, :2]) and sy[0, :2].tolist() == [1.0, 1.0]
    assert y.shape[1] == 4 and sy.sum() == 7


def test_proportional_attention_hand_worked():
    # one head, d_h = 1 (scale 1): q = 1, keys [0, 0, ln 2], sizes [1, 2, 1]
    # weights ∝ s * exp(q k) = [1, 2, 2] -> out = (1*1 + 2*2 + 2*4) / 5 = 2.6
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor([0.0, 0.0, math.log(2.0)]).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 2.0, 4.0]).view(1, 1, 3, 1)
    out = proportional_attention(q, k, v, torch.tensor([[1.0, 2.0, 1.0]]).log())
    assert abs(out.item() - 2.6) < 1e-6
    assert abs(proportional_attention(q, k, v).item() - (1 + 2 + 8) / 4) < 1e-6  # plain softmax


def test_proportional_attention_equals_duplicated_keys():
    # a token of size s attends like s copies of itself (ToMe's motivation for log s)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g) for _ in range(3))
    dup = [0, 1, 1, 1, 2, 3, 3]  # token 1 three times, token 3 twice
    ref = proportional_attention(q, k[:, :, dup], v[:, :, dup])
    out = proportional_attention(q, k, v, torch.tensor([1.0, 3.0, 1.0, 2.0]).log().expand(2, 4))
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers"])
def test_r0_equals_native(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        out = tome_forward(model, x, 0)
        assert (out - ref).abs().max() <= 1e-5
        assert (ToMe(model, [0] * len(model.blocks))(x) - ref).abs().max() <= 1e-5
        assert (static_forward(model, x, {}) - ref).abs().max() <= 1e-5


def _reference_tome(model, img, r_list, prune=False):
    """One image, python-loop matching and timm's own Attention with a float attn_mask; ``prune``:
    the matched A tokens are dropped and the B tokens left as they are."""
    p = model.num_prefix_tokens
    x = embed(model, img)
    size = [1.0] * x.shape[1]
    for blk, r in zip(model.blocks, r_list):
        y = blk.norm1(x)
        bias = torch.tensor(size).log().view(1, 1, 1, -1)
        x = x + blk.drop_path1(blk.ls1(blk.attn(y, attn_mask=bias)))
        if r:
            a = blk.attn
            k = a.qkv(y)[0, :, a.attn_dim:2 * a.attn_dim].view(-1, a.num_heads, a.head_dim).mean(1)
            vis = list(range(p, x.shape[1]))
            A, B = vis[0::2], vis[1::2]
            edges = []
            for i in A:
                sims = [torch.cosine_similarity(k[i], k[j], dim=0).item() for j in B]
                j = max(range(len(B)), key=lambda t: sims[t])
                edges.append((sims[j], i, B[j]))
            edges.sort(key=lambda e: -e[0])
            merged = {i: j for _, i, j in edges[:r]}
            rows, sizes = [], []
            for t in list(range(p)) + [i for i in A if i not in merged]:
                rows.append(x[0, t])
                sizes.append(size[t])
            for j in B:
                group = [j] + ([] if prune else [i for i, d in merged.items() if d == j])
                s = sum(size[t] for t in group)
                rows.append(sum(size[t] * x[0, t] for t in group) / s)
                sizes.append(s)
            x, size = torch.stack(rows)[None], sizes
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("family,r,prune", [("deit", 3, False), ("deit_distilled", [4, 0, 2, 1, 0, 3, 0, 0, 1, 0, 0, 0], False),
                                            ("dinov2_registers", 2, False), ("deit", 3, True),
                                            ("dinov2_registers", [2, 0, 3, 1, 0, 0, 2, 0, 0, 1, 0, 0], True)])
def test_tome_matches_per_image_reference(family, r, prune):
    """ToMe, and its prune form (the matched tokens deleted), against the per-image reference."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    eff, _ = tome_schedule(model, r)
    with torch.no_grad():
        out = ToMe(model, r, prune=prune)(x)
        if prune:
            assert not torch.allclose(out, tome_forward(model, x, r), atol=1e-3)  # not the merge
        for i in range(3):
            ref = _reference_tome(model, x[i:i + 1], eff, prune=prune)
            assert (out[i] - ref[0]).abs().max() < 1e-4, i
    assert ToMe(model, 3, prune=True).name == "tome-prune(r=3)"


def test_schedule_caps_at_half_the_visual_tokens():
    model = make_model("deit_tiny_patch16_224", img_size=64)  # 16 patches
    eff, entering = tome_schedule(model, 6)
    assert entering[:4] == [16, 10, 5, 3] and eff[:4] == [6, 5, 2, 1]
    assert tome_gflops(model, 6).tokens[-1] == 1
    with pytest.raises(ValueError):
        tome_schedule(model, [1, 2])


# small variants at 64 / 56 px (make_model: 10 classes); heads: classifier heads (2 with distillation)
TINY_DIMS = {
    "deit": dict(d=192, hidden=768, patch=16, patches=16, classes=10, heads=1, prefix=1, head_dim=64),
    "deit_distilled": dict(d=192, hidden=768, patch=16, patches=16, classes=10, heads=2, prefix=2, head_dim=64),
    "dinov2_registers": dict(d=384, hidden=1536, patch=14, patches=16, classes=10, heads=1, prefix=5, head_dim=64),
}


def _hand_tome_macs(dims, r_per_block):
    """ToMe by hand: per block, ``r = min(r_l, floor(N/2))`` merges after attention; the bipartite
    similarity is ``ceil(N/2) x floor(N/2)`` dot products of head-mean keys (``head_dim``)."""
    n, blocks, match = dims["patches"], [], 0
    for rl in r_per_block:
        r = min(rl, n // 2)
        blocks.append((dims["prefix"] + n, dims["prefix"] + n - r))
        if r:
            match += -(-n // 2) * (n // 2) * dims["head_dim"]
        n -= r
    products, attention = hand_vit_macs(dims, blocks)
    return products + match, attention


@pytest.mark.parametrize("family,r", [("deit", 2), ("deit_distilled", 3), ("dinov2_registers", [0, 4, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0])])
def test_tome_gflops_equal_hand_count_and_flop_counter(family, r):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    dims = TINY_DIMS[family]
    assert (model.embed_dim, model.num_prefix_tokens, model.blocks[0].attn.head_dim) == (dims["d"], dims["prefix"], dims["head_dim"])
    x = images(model, 2)
    r_list = r if isinstance(r, list) else [r] * 12
    products, attention = _hand_tome_macs(dims, r_list)
    cost = tome_gflops(model, r)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        tome_forward(model, x, r)
    assert_counter_agrees(fc, 2 * products, 2 * attention)  # two images
    assert cost.matching_gflops > 0
    assert cost.gflops < timm_dora.native_gflops(model)
    products, attention = _hand_tome_macs(dims, [0] * 12)
    assert int(round(timm_dora.native_gflops(model) * 1e9)) == 2 * (products + attention)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        tome_forward(model, x, 0)
    assert_counter_agrees(fc, 2 * products, 2 * attention)


# ---------------------------------------------------------------------------------- static schedules


def test_static_rules_and_gflops():
    model = make_model("deit_tiny_distilled_patch16_224", img_size=64)
    x = images(model, 2)
    sched = parse_schedule("2:4, 5:6")
    assert sched == {2: 4, 5: 6}
    dims = TINY_DIMS["deit_distilled"]  # CLS + distillation token, 16 patches
    visual = [16] * 3 + [12] * 3 + [6] * 6  # visual tokens entering each block
    blocks = [(2 + n, 2 + n - sched.get(l, 0)) for l, n in enumerate(visual)]
    products, attention = hand_vit_macs(dims, blocks)
    for rule, cosines in (("cls_sim", 16 * 192 + 12 * 192), ("slice", 0)):  # cls_sim: N_l keys . CLS key
        assert int(round(static_gflops(model, sched, rule) * 1e9)) == 2 * (products + attention + cosines), rule
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            static_forward(model, x, sched, rule)
        assert_counter_agrees(fc, 2 * (products + cosines), 2 * attention)  # two images
    assert static_gflops(model, sched, "cls_sim") > static_gflops(model, sched, "slice")
    with pytest.raises(ValueError):
        static_forward(model, x, {0: 16})


def test_static_cls_sim_keeps_tokens_most_similar_to_cls():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 2)
    with torch.no_grad():
        out = static_forward(model, x, {0: 5})
        for i in range(2):
            blk = model.blocks[0]
            h = embed(model, x[i:i + 1])
            y = blk.norm1(h)
            k = blk.attn.qkv(y)[0, :, blk.attn.attn_dim:2 * blk.attn.attn_dim]
            h = h + blk.ls1(blk.attn(y))
            sim = torch.cosine_similarity(k[1:], k[:1], dim=1)
            keep = sorted(sim.argsort(descending=True)[:11].tolist())
            h = h[:, [0] + [1 + j for j in keep]]
            for b in model.blocks:
                if b is not blk:
                    h = b(h)
                else:
                    h = h + b.ls2(b.mlp(b.norm2(h)))
            assert (model.forward_head(model.norm(h))[0] - out[i]).abs().max() < 1e-4


def test_schedule_for_reduction():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    s = schedule_for_reduction(model, 0.3, [3, 6, 9])
    red = 1 - static_gflops(model, s, "slice") / timm_dora.native_gflops(model)
    assert set(s) <= {3, 6, 9} and abs(red - 0.3) < 0.06


@torch.no_grad()
def test_baselines_with_skip_dead_give_the_same_logits_for_less_compute():
    from timm_dora.evaluate.baselines import StaticPrune, ToMe

    name, kw = SMALL_FAMILIES["deit_distilled"]
    model = make_model(name, **kw)
    x = images(model, 3)
    mlp = sum(m.in_features * m.out_features for m in model.blocks[-1].mlp.modules() if isinstance(m, torch.nn.Linear))
    # ToMe r=2 on 16 tokens, capped at half: 14, 12, ..., 2 after block 7, 1 after block 8, then 1
    for make, tokens_after_last in ((lambda s: ToMe(model, 2, skip_dead=s), 1),
                                    (lambda s: StaticPrune(model, {3: 4, 11: 2}, "cls_sim", skip_dead=s), 16 - 6)):
        full, lean = make(False), make(True)
        assert (lean(x) - full(x)).abs().max().item() <= 1e-5
        g_full = full.cost.gflops if hasattr(full, "cost") else full.gflops
        g_lean = lean.cost.gflops if hasattr(lean, "cost") else lean.gflops
        assert g_full - g_lean == pytest.approx(2 * mlp * tokens_after_last / 1e9, abs=1e-12)
