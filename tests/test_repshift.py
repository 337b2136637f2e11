"""Representation Shift: the shift score and the pruning by hand, agreement with a reference built on
timm's own Block forward, native equivalence at r=0, GFLOPs against a hand count and
torch.utils.flop_counter, batch independence and prefix protection."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.evaluate.baselines.repshift import (RepShift, repshift_forward, repshift_gflops, repshift_prune,
                                                   repshift_ratio_schedule, repshift_schedule, representation_shift)

from timm_dora.evaluate.baselines.tome import attention_with_keys

from helpers import SMALL_FAMILIES, assert_batch_independent, counter_flops, hand_vit_macs, images, make_model, spy_sdpa


def test_shift_and_pruning_by_hand():
    # one prefix token, four visual tokens of width 2
    before = torch.tensor([[[9.0, 9.0], [0.0, 0.0], [1.0, 1.0], [2.0, 0.0], [5.0, 5.0]]])
    after = torch.tensor([[[9.0, 9.0], [3.0, 4.0], [1.0, 2.0], [2.0, 0.0], [7.0, 5.0]]])
    shift = representation_shift(before[:, 1:], after[:, 1:])
    assert shift.tolist() == [[5.0, 1.0, 0.0, 2.0]]  # ||(3,4)||, ||(0,1)||, 0, ||(2,0)||
    # r=2 removes the two least-shifted visual tokens (v2: 0, v1: 1); the rest keep their order
    assert repshift_prune(after, shift, 2, 1).tolist() == [[[9.0, 9.0], [3.0, 4.0], [7.0, 5.0]]]
    assert repshift_prune(after, shift, 1, 1).tolist() == [[[9.0, 9.0], [3.0, 4.0], [1.0, 2.0], [7.0, 5.0]]]
    assert torch.equal(repshift_prune(after, shift, 0, 1), after)
    # the prefix token did not move at all (shift 0) and is never a candidate
    assert repshift_prune(after, shift, 3, 1).tolist() == [[[9.0, 9.0], [3.0, 4.0]]]
    # ties go to the lower index: kept first
    assert repshift_prune(after, torch.tensor([[1.0, 1.0, 1.0, 1.0]]), 2, 1)[0, 1:].tolist() == [[3.0, 4.0], [1.0, 2.0]]
    with pytest.raises(ValueError):
        repshift_prune(after, shift, 4, 1)  # at least one visual token stays


def test_schedule_caps_and_ratios():
    model = make_model("deit_tiny_patch16_224", img_size=64)  # 16 patches, 12 blocks
    eff, entering = repshift_schedule(model, 6)
    assert eff[:4] == [6, 6, 3, 0] and entering[:4] == [16, 10, 4, 1]
    assert repshift_schedule(model, 6, skip_dead=True)[0][-1] == 0
    assert repshift_ratio_schedule(model, [0.2, 0, 0, 0.2, 0, 0, 0.2, 0, 0, 0, 0, 0]) == [3, 0, 0, 2, 0, 0, 2] + [0] * 5
    with pytest.raises(ValueError):
        repshift_schedule(model, [1, 2])


def _reference(model, x, r, where):
    """Built on timm's own ``Block.forward`` (and the attention sub-layer spelled out), one image at a
    time: the shift is ``||out - in||`` across the chosen sub-layer, the least-shifted visual tokens go."""
    p = model.num_prefix_tokens
    eff, _ = repshift_schedule(model, r)
    out = []
    for img in x:
        t = model.norm_pre(model._pos_embed(model.patch_embed(img[None])))
        for blk, rl in zip(model.blocks, eff):
            mid = t + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(t))))
            if where == "attn":
                before, after = t, mid
                t = mid
            else:
                before, after = mid, blk(t)
                t = after
            if rl > 0:
                shift = (after[0, p:] - before[0, p:]).norm(dim=-1)
                keep = shift.argsort(descending=True, stable=True)[: shift.numel() - rl].sort().values
                t = torch.cat([t[:, :p], t[:, p:][:, keep]], dim=1)
            if where == "attn":
                t = t + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(t))))
        out.append(model.forward_head(model.norm(t)))
    return torch.cat(out)


@pytest.mark.parametrize("family,where", [("deit", "mlp"), ("deit", "attn"), ("dinov2_registers", "mlp"),
                                          ("vit_avgpool", "attn")])
def test_forward_matches_timm_block_reference(family, where):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 2)
    r = [2, 3, 0, 1, 4, 0, 1, 0, 0, 1, 0, 2]
    with torch.no_grad():
        ours = repshift_forward(model, x, r, where=where)
        assert (ours - _reference(model, x, r, where)).abs().max() < 1e-4
        assert not torch.allclose(ours, model(x), atol=1e-3)  # something was pruned


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "siglip_map"])
def test_r0_equals_native(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        for where in ("mlp", "attn"):
            assert torch.equal(repshift_forward(model, x, 0, where=where), ref)
        assert torch.equal(RepShift(model, [0] * len(model.blocks))(x), ref)
    assert repshift_gflops(model, 0).gflops == pytest.approx(timm_dora.native_gflops(model), rel=1e-12)


@pytest.mark.parametrize("family,r,where,skip_dead", [
    ("deit", 2, "mlp", False), ("deit", [1, 3, 0, 2, 0, 0, 4, 0, 0, 1, 0, 0], "attn", False),
    ("deit_distilled", 3, "mlp", True), ("dinov2_registers", 2, "attn", True)])
def test_gflops_equal_hand_count_and_flop_counter(family, r, where, skip_dead):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    p, d = model.num_prefix_tokens, model.embed_dim
    eff, entering = repshift_schedule(model, r, skip_dead)
    blocks = []
    for l, (rl, n) in enumerate(zip(eff, entering)):
        n_mlp = p + n - (rl if where == "attn" else 0)
        blocks.append((p + n, p if skip_dead and l == len(eff) - 1 else n_mlp))
    dims = dict(d=d, hidden=model.blocks[0].mlp.fc1.out_features, patch=model.patch_embed.patch_size[0],
                patches=model.patch_embed.num_patches, classes=10, heads=2 if family == "deit_distilled" else 1)
    products, attention = hand_vit_macs(dims, blocks)
    cost = repshift_gflops(model, r, skip_dead, where)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention)
    assert cost.gflops < timm_dora.native_gflops(model, skip_dead=skip_dead)
    assert cost.r == eff and cost.tokens == [n - rl for rl, n in zip(eff, entering)]
    x = images(model, 2)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        repshift_forward(model, x, r, where=where, skip_dead=skip_dead)
    stable, counted_sdpa = counter_flops(fc)  # the shift (a norm) and the sort are not counted
    assert stable == 2 * 2 * products  # two images
    assert counted_sdpa in (None, 2 * 2 * attention)


@pytest.mark.parametrize("family,where", [("deit", "mlp"), ("dinov2_registers", "attn"), ("vit_gap", "mlp")])
def test_batch_independence(family, where):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    assert_batch_independent(lambda x: repshift_forward(model, x, 3, where=where), model, images(model, 4))


@pytest.mark.parametrize("family", ["deit_distilled", "dinov2_registers"])
@pytest.mark.parametrize("where", ["mlp", "attn"])
def test_prefix_tokens_never_removed(family, where):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    p, n0 = model.num_prefix_tokens, model.patch_embed.num_patches
    x = images(model, 2)
    seen = []  # the rows entering every block, and the rows the head reads
    hooks = [blk.norm1.register_forward_hook(lambda m, a, o: seen.append(a[0])) for blk in model.blocks]
    hooks.append(model.norm.register_forward_hook(lambda m, a, o: seen.append(a[0])))
    try:
        with torch.no_grad():
            repshift_forward(model, x, 100, where=where)  # capped: one visual token left after block 0
    finally:
        for h in hooks:
            h.remove()
    assert [t.shape[1] for t in seen] == [p + n0] + [p + 1] * len(model.blocks)
    # the prefix rows of every block's input are the previous block's prefix rows carried through:
    # recompute them by running the prefix rows alone (attention aside, rows are independent)
    for l, blk in enumerate(model.blocks):
        with torch.no_grad():
            t = seen[l]
            mid, _ = attention_with_keys(blk, t)
            nxt = mid + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(mid))))
        assert (nxt[:, :p] - seen[l + 1][:, :p]).abs().max() < 1e-5, l


def test_name_and_skip_dead():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    assert RepShift(model, 8).name == "repshift(r=8)"
    assert RepShift(model, 2, where="attn").name == "repshift(r=2, attn)"
    assert RepShift(model, [1] * 12).name == "repshift(r=" + ",".join(["1"] * 12) + ")"
    x = images(model, 2)
    with torch.no_grad():
        a = RepShift(model, 2)(x)
        b = RepShift(model, 2, skip_dead=True)(x)
    assert (a - b).abs().max() < 1e-5  # a CLS readout never reads the last block's visual rows
    assert RepShift(model, 2, skip_dead=True).cost.gflops < RepShift(model, 2).cost.gflops
    with pytest.raises(ValueError):
        RepShift(model, 2, where="block")
    avg = make_model(*SMALL_FAMILIES["vit_avgpool"][:1], **SMALL_FAMILIES["vit_avgpool"][1])
    with pytest.raises(ValueError):
        RepShift(avg, 2, skip_dead=True)


@pytest.mark.parametrize("where", ["mlp", "attn"])
def test_attention_is_plain_fused_sdpa(monkeypatch, where):
    """Every attention call is SDPA without a mask (FlashAttention-eligible): no attention map, no bias."""
    calls = spy_sdpa(monkeypatch)
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    with torch.no_grad():
        repshift_forward(model, images(model, 2), 3, where=where)
    assert len(calls) == len(model.blocks)
    assert all(mask is None and not extra for _, mask, extra in calls)
    assert [n for n, _, _ in calls] == [1 + n for n in repshift_schedule(model, 3)[1]]
