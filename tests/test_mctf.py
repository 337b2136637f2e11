"""MCTF: hand-worked attraction and bidirectional matching, native equivalence, GFLOPs against a hand
count and torch.utils.flop_counter, batch independence, prefix protection and size conservation, the
token order of the authors' code (alternation over the whole sequence, kept B by best edge)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.evaluate.baselines.mctf import MCTF, mctf_attraction, mctf_forward, mctf_gflops, mctf_matching, mctf_schedule

from helpers import SMALL_FAMILIES, assert_batch_independent, counter_flops, images, make_model


def _four_tokens():
    # visual tokens v0..v3 (no prefix): A = {v0, v2}, B = {v1, v3}
    m = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])[None]
    info = torch.tensor([[0.1, 0.2, 0.4, 0.2]])  # attention received: 1/a normalised = [1, .5, .25, .5]
    size = torch.tensor([[1.0, 2.0, 1.0, 4.0]])  # 1/s normalised = [1, .5, 1, .25]
    return m, info, size


def test_attraction_hand_worked():
    m, info, size = _four_tokens()
    # (1 + cos)/2: (v0,v1) = .5, (v0,v3) = (1 + 1/sqrt2)/2, (v2,v1) = .5, (v2,v3) = (1 + 1/sqrt2)/2
    c = (1 + 1 / math.sqrt(2)) / 2
    w = mctf_attraction(m, info, size, 1.0, 1.0, 1.0)
    hand = torch.tensor([[[0.5 * (1 * 0.5) * (1 * 0.5), c * (1 * 0.5) * (1 * 0.25)],
                          [0.5 * (0.25 * 0.5) * (1 * 0.5), c * (0.25 * 0.5) * (1 * 0.25)]]])
    assert torch.allclose(w, hand, atol=1e-6)
    # the authors' temperatures: sim ** 1, info ** (1/20), size ** (1/40)
    w = mctf_attraction(m, info, size)
    hand = torch.tensor([[[0.5 * 0.5 ** (1 / 20) * 0.5 ** (1 / 40), c * 0.5 ** (1 / 20) * 0.25 ** (1 / 40)],
                          [0.5 * 0.125 ** (1 / 20) * 0.5 ** (1 / 40), c * 0.125 ** (1 / 20) * 0.25 ** (1 / 40)]]])
    assert torch.allclose(w, hand, atol=1e-6)
    # tau = 0 leaves a criterion out: similarity alone
    assert torch.allclose(mctf_attraction(m, info, size, 1.0, 0, 0), torch.tensor([[[0.5, c], [0.5, c]]]), atol=1e-6)
    # a common factor on a or s changes no ranking (the normalisation by the max)
    assert torch.allclose(mctf_attraction(m, 3 * info, 5 * size), mctf_attraction(m, info, size), atol=1e-6)


def test_attraction_alternates_over_the_whole_sequence():
    m, info, size = _four_tokens()
    # one CLS token in front: positions [CLS, v0, v1, v2, v3], A = {v1, v3} (even positions), B = {v0, v2}
    cls_m, cls_info, cls_size = torch.tensor([[[0.0, 1.0]]]), torch.tensor([[0.8]]), torch.tensor([[1.0]])
    w = mctf_attraction(torch.cat([cls_m, m], 1), torch.cat([cls_info, info], 1), torch.cat([cls_size, size], 1),
                        1.0, 1.0, 1.0, num_prefix=1)
    c = (1 + 1 / math.sqrt(2)) / 2
    # 1/a normalised over the whole sequence = [.125, 1, .5, .25, .5]; 1/s = [1, 1, .5, 1, .25]
    hand = torch.tensor([[[0.5 * (0.5 * 1) * (0.5 * 1), 0.5 * (0.5 * 0.25) * (0.5 * 1)],
                          [c * (0.5 * 1) * (0.25 * 1), c * (0.5 * 0.25) * (0.25 * 1)]]])
    assert torch.allclose(w, hand, atol=1e-6)
    # two prefix tokens: the visual tokens' parity is the one without a prefix again
    w2 = mctf_attraction(torch.cat([cls_m, cls_m, m], 1), torch.cat([cls_info, cls_info, info], 1),
                         torch.cat([cls_size, cls_size, size], 1), 1.0, 0, 0, num_prefix=2)
    assert torch.allclose(w2, mctf_attraction(m, info, size, 1.0, 0, 0), atol=1e-6)


def test_bidirectional_matching_hand_worked():
    # slots of ([A0, A1], [B0, B1]): kept A first (original order), then kept B (descending best edge)
    w = torch.tensor([[[0.9, 0.2], [0.5, 0.6]]])
    # r=1: r1 = 0, r2 = 1: B -> A only: B0 -> A0 (.9) beats B1 -> A1 (.6); kept A0, A1, B1
    a, b = mctf_matching(w, 1)
    assert a[0].tolist() == [0, 1] and b[0].tolist() == [0, 2]
    # r=2: A0 -> B0 (.9 beats A1's .6); then B -> the A left (A1): B1 (.6) beats B0 (.5)
    a, b = mctf_matching(w, 2)
    assert a[0].tolist() == [1, 0] and b[0].tolist() == [1, 0]
    # a chain: A0 -> B0 (.9), then B0 (carrying A0) -> A1 (.8 beats B1's .3): three tokens in one
    w = torch.tensor([[[0.9, 0.1], [0.8, 0.3]]])
    a, b = mctf_matching(w, 2)
    assert a[0].tolist() == [0, 0] and b[0].tolist() == [0, 1]
    a, b = mctf_matching(w, 0)
    assert a[0].tolist() == [0, 1] and b[0].tolist() == [2, 3]
    with pytest.raises(ValueError):
        mctf_matching(w, 4)


def test_kept_b_tokens_leave_by_descending_best_edge():
    w = torch.tensor([[[0.3, 0.9, 0.5, 0.7], [0.2, 0.1, 0.4, 0.6]]])
    # r=1: B1 (.9) -> A0; the kept B by best edge: B3 (.7), B2 (.5), B0 (.3) -> slots 2, 3, 4
    a, b = mctf_matching(w, 1)
    assert a[0].tolist() == [0, 1] and b[0].tolist() == [4, 0, 3, 2]
    # r=2: A0 -> B1 (.9 beats A1's .6); B -> A1 only: B3 (.6) -> A1; kept B2 (.4), B0 (.2), B1 (.1)
    a, b = mctf_matching(w, 2)
    assert a[0].tolist() == [3, 0] and b[0].tolist() == [2, 3, 1, 0]


def test_block_output_order_with_a_cls_token():
    import copy

    from timm_dora.evaluate.baselines.mctf import mctf_block

    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    blk = copy.deepcopy(model.blocks[0])
    with torch.no_grad():
        blk.attn.proj.weight.zero_(), blk.attn.proj.bias.zero_()  # the output is the fused rows themselves
    x = torch.randn(1, 1 + 8, model.embed_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y, s = mctf_block(blk, x, torch.ones(1, 9), 1, 1, taus=(1.0, 0, 0))  # similarity only
    # [CLS, v0..v7]: A = {v1, v3, v5, v7}, B = {v0, v2, v4, v6}; r = 1: the B with the best edge fuses
    v = torch.nn.functional.normalize(x[0, 1:], dim=-1)
    best = ((v[0::2] @ v[1::2].T + 1) / 2).max(dim=1).values  # B's best edges towards A
    order = best.argsort(descending=True)
    kept_b = (2 * order[1:]).tolist()
    assert torch.equal(y[0, 0], x[0, 0])
    assert torch.allclose(y[0, 5:], x[0, 1:][kept_b], atol=1e-6)
    assert s[0, 5:].tolist() == [1.0] * 3 and sorted(s[0, 1:5].tolist()) == [1.0, 1.0, 1.0, 2.0]


def test_schedule_int_skips_block_zero_and_caps_at_half():
    model = make_model("deit_tiny_patch16_224", img_size=64)  # 16 patches
    eff, entering = mctf_schedule(model, 6)
    assert eff[:4] == [0, 6, 5, 2] and entering[:4] == [16, 16, 10, 5]
    assert mctf_schedule(model, [3] + [0] * 11)[0][0] == 3


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers"])
def test_r0_equals_native(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        assert (mctf_forward(model, x, 0) - ref).abs().max() <= 1e-5
        assert (MCTF(model, [0] * len(model.blocks))(x) - ref).abs().max() <= 1e-5
        assert mctf_gflops(model, 0).gflops == pytest.approx(timm_dora.native_gflops(model), rel=1e-12)


def _hand_macs(d, hidden, prefix, patches, patch, classes, r_list, precise):
    """By hand for a plain ViT of width ``d`` (one head group, ``attn_dim = d``): ``(products
    outside SDPA, attention inside SDPA)`` MACs of one image."""
    products = patches * d * 3 * patch ** 2 + classes * d
    sdpa, n = 0, patches
    for rl in r_list:
        rl = min(rl, n // 2)
        t, m = prefix + n, prefix + n - rl
        if rl == 0:
            products += t * 4 * d * d + t * 2 * d * hidden
            sdpa += 2 * t * t * d
        else:
            products += t * 2 * d * d + t * t * d + (-(-n // 2)) * (n // 2) * d  # q, k; QK^T; similarity
            if precise:
                products += m * 4 * d * d + m * 2 * d * hidden
                sdpa += 2 * m * m * d
            else:
                products += m * d * d + m * m * d + m * d * d + m * 2 * d * hidden  # v; AV; proj; MLP
        n -= rl
    return products, sdpa


@pytest.mark.parametrize("family,r,precise", [("deit", 2, False), ("deit", [1, 3, 0, 2, 0, 0, 4, 0, 0, 1, 0, 0], False),
                                              ("deit", 3, True), ("dinov2_registers", 2, False)])
def test_gflops_equal_hand_count_and_flop_counter(family, r, precise):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    d, patch = model.embed_dim, model.patch_embed.patch_size[0]
    r_list = mctf_schedule(model, r)[0]
    products, sdpa = _hand_macs(d, 4 * d, model.num_prefix_tokens, 16, patch, 10, r_list, precise)
    cost = mctf_gflops(model, r, precise=precise)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + sdpa)
    assert cost.gflops < timm_dora.native_gflops(model) and cost.matching_gflops > 0
    assert cost.extra_gflops > cost.matching_gflops if precise else cost.extra_gflops == cost.matching_gflops
    x = images(model, 2)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        mctf_forward(model, x, r, precise=precise)
    stable, counted_sdpa = counter_flops(fc)
    assert stable == 2 * 2 * products  # two images
    assert counted_sdpa in (None, 2 * 2 * sdpa)


@pytest.mark.parametrize("family,precise", [("deit", False), ("dinov2_registers", False), ("deit_distilled", True)])
def test_batch_independence(family, precise):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    assert_batch_independent(lambda x: mctf_forward(model, x, 3, precise=precise), model, images(model, 4))


@pytest.mark.parametrize("family", ["deit_distilled", "dinov2_registers"])
def test_prefix_never_fused_and_sizes_sum_to_patches(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    p, n0 = model.num_prefix_tokens, model.patch_embed.num_patches
    x = images(model, 3)
    sizes = []
    with torch.no_grad():
        mctf_forward(model, x, [2, 3, 4, 1, 2, 0, 1, 0, 0, 1, 0, 0], sizes_out=sizes)
    eff, _ = mctf_schedule(model, [2, 3, 4, 1, 2, 0, 1, 0, 0, 1, 0, 0])
    tokens = mctf_gflops(model, eff).tokens
    assert len(sizes) == len(model.blocks)
    for l, s in enumerate(sizes):
        assert s.shape == (3, p + tokens[l])
        assert torch.equal(s[:, :p], torch.ones(3, p))  # a prefix token never absorbs nor is fused
        assert torch.allclose(s[:, p:].sum(1), torch.full((3,), float(n0)))
        assert (s[:, p:] >= 1).all()


def test_prefix_rows_keep_their_values_through_the_fusion():
    import copy

    from timm_dora.evaluate.baselines.mctf import mctf_block

    name, kw = SMALL_FAMILIES["dinov2_registers"]
    model = make_model(name, **kw)
    blk, p = copy.deepcopy(model.blocks[0]), model.num_prefix_tokens
    with torch.no_grad():
        blk.ls1.gamma.zero_()  # no attention residual: the block's output is the fused rows themselves
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, p + 16, model.embed_dim, generator=g)
    x[:, :p] = x[:, p:p + 1]  # prefix tokens identical to a visual token: the most similar pairs
    with torch.no_grad():
        for precise in (False, True):
            y, s = mctf_block(blk, x, torch.ones(2, p + 16), 6, p, precise=precise)
            assert y.shape == (2, p + 10, model.embed_dim)
            assert torch.equal(y[:, :p], x[:, :p]) and torch.equal(s[:, :p], torch.ones(2, p))
            assert s[:, p:].sum().item() == 2 * 16


def test_name_and_precise_variant():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    assert MCTF(model, 8).name == "mctf(r=8)"
    assert MCTF(model, 2, precise=True).name == "mctf(r=2, precise)"
    assert MCTF(model, 2, taus=(1, 0, 0)).name == "mctf(r=2, tau=1/0/0)"
    x = images(model, 2)
    with torch.no_grad():
        a, b = MCTF(model, 2)(x), MCTF(model, 2, precise=True)(x)
    assert not torch.allclose(a, b, atol=1e-4)
    with pytest.raises(ValueError):
        MCTF(make_model(*SMALL_FAMILIES["vit_avgpool"][:1], **SMALL_FAMILIES["vit_avgpool"][1]), 2, skip_dead=True)

