"""PiToMe: a hand-worked energy and choice of tokens (protecting and energy-ordered bipartite blocks),
the authors' ratio knob by hand, native equivalence at r = 0, an independent per-image reference
forward (so also batch independence), GFLOPs against hand counts and torch.utils.flop_counter, and
selection through build_method and ``timm-dora eval`` / ``bench`` (``--r`` and ``--ratio``)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.cli import main
from timm_dora.engine.blocks import embed
from timm_dora.evaluate import PiToMeMethod, build_method
from timm_dora.evaluate.baselines import (PiToMe, energy_scores, pitome_forward, pitome_gflops, pitome_merge, tome_forward,
                                          tome_schedule)
from timm_dora.evaluate.baselines.pitome import pitome_bsm_blocks, pitome_edges, pitome_margins, pitome_ratio_schedule

from helpers import SMALL_FAMILIES, assert_counter_agrees, hand_vit_macs, images, make_model


def _f(x, m=0.5):  # f_m with alpha = 1
    return x - m if x >= m else math.exp(x - m) - 1


def _six_tokens():
    """CLS + 6 visual tokens: v0..v3 one cluster ([1, 0]), v4 = [0, 1], v5 = [-1, 0]."""
    m = torch.tensor([[0.0, 5.0], [1, 0], [1, 0], [1, 0], [1, 0], [0, 1], [-1, 0]])[None]
    x = torch.arange(14.0).view(1, 7, 2)
    s = torch.tensor([[1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 1.0]])
    return x, m, s


def test_energy_and_choice_hand_worked():
    x, m, s = _six_tokens()
    e, sim = energy_scores(m[:, 1:], 0.5)
    # cos: cluster members 1 with each other (self included), 0 with v4, -1 with v5
    e0 = (4 * _f(1) + _f(0) + _f(-1)) / 6  # (2 - .3935 - .7769) / 6 = .1383
    e4 = (4 * _f(0) + _f(1) + _f(0)) / 6  # -.2446
    e5 = (4 * _f(-1) + _f(0) + _f(1)) / 6  # -.5002
    assert torch.allclose(e[0], torch.tensor([e0] * 4 + [e4, e5]), atol=1e-6)
    assert torch.allclose(sim[0, 0], torch.tensor([1.0, 1, 1, 1, 0, -1]))
    # r = 2: candidates = the 4 cluster tokens (energy order, ties to the lower index): A = {v0, v2},
    # B = {v1, v3}; the isolated v4, v5 are protected; both A tokens go to v1 (ties: the first B)
    protected, a, b, dst = pitome_edges(m, 2, num_prefix=1, margin=0.5)
    assert protected[0].tolist() == [4, 5] and a[0].tolist() == [0, 2] and b[0].tolist() == [1, 3]
    assert dst[0].tolist() == [0, 0]
    y, sy = pitome_merge(x, m, s, 2, num_prefix=1, margin=0.5)
    # v1 <- (2*x_v0 + 1*x_v1 + 3*x_v2) / 6 = (2*[2,3] + [4,5] + 3*[6,7]) / 6; v3 unchanged
    assert torch.allclose(y[0], torch.tensor([[0.0, 1], [10, 11], [12, 13], [26 / 6, 32 / 6], [8, 9]]))
    assert sy[0].tolist() == [1.0, 1.0, 1.0, 6.0, 1.0] and sy.sum() == s.sum()
    # r = 1: only v0 -> v1; v2, v3, v4, v5 protected
    y, sy = pitome_merge(x, m, s, 1, num_prefix=1, margin=0.5)
    assert torch.allclose(y[0], torch.tensor([[0.0, 1], [6, 7], [8, 9], [10, 11], [12, 13], [(4 + 4) / 3, (6 + 5) / 3]]))
    assert sy[0].tolist() == [1.0, 3.0, 1.0, 1.0, 1.0, 3.0]
    with pytest.raises(ValueError):
        pitome_edges(m, 4, num_prefix=1, margin=0.5)


def test_energy_ordered_bipartite_block_hand_worked():
    """The authors' early blocks: all 6 visual tokens in energy order [v0..v5] (ties to the lower
    index), A = {v0, v2, v4}, B = {v1, v3, v5}; edges v0 -> v1 (cos 1), v2 -> v1 (1), v4 -> v1 (0,
    the first maximum); r = 1 merges v0 into v1, v2 and v4 stay (nothing is protected)."""
    x, m, s = _six_tokens()
    kept, src, b, dst = pitome_edges(m, 1, num_prefix=1, margin=0.5, bsm=True)
    assert kept[0].tolist() == [2, 4] and src[0].tolist() == [0] and b[0].tolist() == [1, 3, 5] and dst[0].tolist() == [0]
    y, sy = pitome_merge(x, m, s, 1, num_prefix=1, margin=0.5, bsm=True)
    # v1 <- (2*[2,3] + 1*[4,5]) / 3
    assert torch.allclose(y[0], torch.tensor([[0.0, 1], [6, 7], [10, 11], [8 / 3, 11 / 3], [8, 9], [12, 13]]))
    assert sy[0].tolist() == [1.0, 3.0, 1.0, 3.0, 1.0, 1.0]
    # r = 2: v0 and v2 both into v1; r = 3 = |A|: v4 too; r = 4 > |A| refused
    y, sy = pitome_merge(x, m, s, 3, num_prefix=1, margin=0.5, bsm=True)
    assert sy[0].tolist() == [1.0, 7.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        pitome_edges(m, 4, num_prefix=1, margin=0.5, bsm=True)


def test_ratio_knob_by_hand():
    """``ratio``: every block keeps that fraction of its visual tokens, r = floor(N - N * ratio)."""
    model = make_model("deit_tiny_patch16_224")
    # 196 patches at 0.9: 196 - 176.4 -> 19; 177 - 159.3 -> 17; 160 - 144 -> 16; 144 -> 14; 130 -> 13;
    # 117 -> 11; 106 -> 10; 96 -> 9; 87 -> 8; 79 -> 7; 72 -> 7; 65 -> 6 (59 left)
    assert pitome_ratio_schedule(model, 0.9) == [19, 17, 16, 14, 13, 11, 10, 9, 8, 7, 7, 6]
    assert pitome_ratio_schedule(model, 0.5) == [98, 49, 24, 12, 6, 3, 2, 1, 0, 0, 0, 0]
    assert pitome_ratio_schedule(model, 1.0) == [0] * 12
    f = PiToMe(model, ratio=0.9)
    assert f.r == f.cost.r == [19, 17, 16, 14, 13, 11, 10, 9, 8, 7, 7, 6] and f.cost.tokens[-1] == 59
    assert f.name == "pitome(ratio=0.9)" and pitome_bsm_blocks(12) == 6 and pitome_bsm_blocks(3) == 2
    for bad in (0.4, 1.2):
        with pytest.raises(ValueError, match="ratio must be in"):
            PiToMe(model, ratio=bad)
    with pytest.raises(ValueError, match="exactly one of r"):
        PiToMe(model, 2, ratio=0.9)
    with pytest.raises(ValueError, match="exactly one of r"):
        PiToMe(model)


def test_isolated_pair_has_the_lowest_energy_and_margin_schedule():
    # v0..v2 a tight cluster (neighbours at cos .98), v3, v4 a loose pair (cos .6 with each other):
    # the pair has the lowest energies, so with r = 1 or 2 on these 5 tokens it is protected
    ang = torch.tensor([0.0, 0.2, 0.4, 1.5, 1.5 + math.acos(0.6)])
    m = torch.stack([ang.cos(), ang.sin()], -1)[None]
    e_hi, _ = energy_scores(m, 0.9)
    assert set(e_hi[0].argsort()[:2].tolist()) == {3, 4}
    assert set(pitome_edges(m, 2, num_prefix=0, margin=0.9)[0][0].tolist()) == {4}
    assert pitome_margins(4) == [0.75, 0.5625, 0.375, 0.1875]


def test_prefix_tokens_never_merge():
    # prefix tokens identical to every visual token stay first, unchanged, and absorb nothing
    x = torch.randn(1, 7, 4)
    m = torch.ones(1, 7, 3)
    y, sy = pitome_merge(x, m, torch.ones(1, 7), 2, num_prefix=2, margin=0.5)
    assert torch.equal(y[:, :2], x[:, :2]) and sy[0, :2].tolist() == [1.0, 1.0]
    assert y.shape[1] == 5 and sy.sum() == 7


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "dinov2_registers"])
def test_r0_equals_native(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        assert (pitome_forward(model, x, 0) - ref).abs().max() <= 1e-5
        assert (PiToMe(model, [0] * len(model.blocks))(x) - ref).abs().max() <= 1e-5


def _reference_pitome(model, img, r_list, margin=0.75, bsm_blocks=None, prop_attn=False):
    """One image: Python loops for the energy and the matching, timm's own Attention (with a float
    attn_mask for proportional attention). The first ``bsm_blocks`` blocks (default ceil(L/2)) merge
    by energy-ordered bipartite matching over all tokens, the later ones protect."""
    nb = math.ceil(len(r_list) / 2) if bsm_blocks is None else bsm_blocks
    p = model.num_prefix_tokens
    x = embed(model, img)
    size = [1.0] * x.shape[1]
    margins = [margin * (1 - l / len(r_list)) for l in range(len(r_list))]
    for l, (blk, r) in enumerate(zip(model.blocks, r_list)):
        y = blk.norm1(x)
        mask = torch.tensor(size).log().view(1, 1, 1, -1) if prop_attn else None
        x = x + blk.drop_path1(blk.ls1(blk.attn(y, attn_mask=mask)))
        if r:
            a = blk.attn
            k = a.qkv(y)[0, :, a.attn_dim:2 * a.attn_dim].view(-1, a.num_heads, a.head_dim).mean(1)
            vis = list(range(p, x.shape[1]))
            cos = {(i, j): torch.cosine_similarity(k[i], k[j], dim=0).item() for i in vis for j in vis}
            energy = {i: sum(_f(cos[i, j], margins[l]) for j in vis) / len(vis) for i in vis}
            ranked = sorted(vis, key=lambda i: -energy[i])
            if l < nb:  # all tokens alternate; the r A tokens with the best edges merge
                A, B = ranked[0::2], ranked[1::2]
                best = sorted(A, key=lambda i: -max(cos[i, j] for j in B))
                A, protected = best[:r], sorted(best[r:])
            else:
                A, B, protected = ranked[0:2 * r:2], ranked[1:2 * r:2], sorted(ranked[2 * r:])
            into = {i: max(B, key=lambda j: cos[i, j]) for i in A}
            rows, sizes = [x[0, t] for t in list(range(p)) + protected], [size[t] for t in list(range(p)) + protected]
            for j in B:
                group = [j] + [i for i in A if into[i] == j]
                s = sum(size[t] for t in group)
                rows.append(sum(size[t] * x[0, t] for t in group) / s)
                sizes.append(s)
            x, size = torch.stack(rows)[None], sizes
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("family,r,bsm,prop", [("deit", 3, None, False), ("deit", 3, 0, True),
                                               ("dinov2_registers", [2, 0, 3, 1, 0, 0, 2, 0, 0, 1, 0, 0], None, True)])
def test_pitome_matches_per_image_reference(family, r, bsm, prop):
    """Each image of a batch of 3 against the single-image reference: the result of an image does not
    depend on the others in the batch."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    eff, _ = tome_schedule(model, r)
    with torch.no_grad():
        out = PiToMe(model, r, prop_attn=prop, bsm_blocks=bsm)(x)
        assert not torch.allclose(out, tome_forward(model, x, r), atol=1e-3)  # not ToMe
        for i in range(3):
            ref = _reference_pitome(model, x[i:i + 1], eff, bsm_blocks=bsm, prop_attn=prop)
            assert (out[i] - ref[0]).abs().max() < 1e-4, i


def test_batch_independence():
    name, kw = SMALL_FAMILIES["deit_distilled"]
    model = make_model(name, **kw)
    x = images(model, 4)
    with torch.no_grad():
        full = pitome_forward(model, x, 4)
        alone = torch.cat([pitome_forward(model, x[i:i + 1], 4) for i in range(4)])
        swapped = pitome_forward(model, torch.cat([x[2:], torch.flip(x[:2], [0])]), 4)
    assert (full - alone).abs().max() < 1e-5
    assert (full[[2, 3, 1, 0]] - swapped).abs().max() < 1e-5


TINY_DIMS = {
    "deit": dict(d=192, hidden=768, patch=16, patches=16, classes=10, heads=1, prefix=1, head_dim=64),
    "deit_distilled": dict(d=192, hidden=768, patch=16, patches=16, classes=10, heads=2, prefix=2, head_dim=64),
    "dinov2_registers": dict(d=384, hidden=1536, patch=14, patches=16, classes=10, heads=1, prefix=5, head_dim=64),
}


def _hand_pitome_macs(dims, r_per_block):
    """PiToMe by hand: per block ``r = min(r_l, floor(N/2))`` merges after attention; the energy's
    similarity is ``N x N`` dot products of head-mean keys (``head_dim``); the matching reuses it."""
    n, blocks, match = dims["patches"], [], 0
    for rl in r_per_block:
        r = min(rl, n // 2)
        blocks.append((dims["prefix"] + n, dims["prefix"] + n - r))
        if r:
            match += n * n * dims["head_dim"]
        n -= r
    products, attention = hand_vit_macs(dims, blocks)
    return products + match, attention, match


@pytest.mark.parametrize("family,r", [("deit", 2), ("deit_distilled", 3), ("dinov2_registers", [0, 4, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0])])
def test_pitome_gflops_equal_hand_count_and_flop_counter(family, r):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    dims = TINY_DIMS[family]
    x = images(model, 2)
    products, attention, match = _hand_pitome_macs(dims, r if isinstance(r, list) else [r] * 12)
    cost = pitome_gflops(model, r)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention)
    assert int(round(cost.matching_gflops * 1e9)) == 2 * match and match > 0
    assert cost.r == tome_schedule(model, r)[0] and cost.tokens[-1] == 16 - sum(cost.r)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        pitome_forward(model, x, r)
    assert_counter_agrees(fc, 2 * products, 2 * attention)  # two images
    assert cost.gflops < timm_dora.native_gflops(model)


@torch.no_grad()
def test_skip_dead_gives_the_same_logits_for_less_compute():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = images(model, 2)
    full, lean = PiToMe(model, 2), PiToMe(model, 2, skip_dead=True)
    assert (lean(x) - full(x)).abs().max() <= 1e-5 and lean.cost.gflops < full.cost.gflops


def test_build_method_and_names():
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    m = build_method(model, "pitome", r=[2])
    assert isinstance(m, PiToMeMethod) and m.name == "pitome(r=2)"
    assert m.config["r_effective"][:3] == [2, 2, 2] and m.config["margin"] == 0.75
    x = images(model, 2)
    out = m.outputs(x)["pitome(r=2)"]
    assert out.logits.shape == (2, 10) and out.gflops.tolist() == [m.fn.cost.gflops] * 2
    assert out.tokens[0, :2].tolist() == [14, 12]
    assert torch.equal(m.timing_fn()(x), out.logits)
    assert m.config["prop_attn"] is False and "ratio" not in m.config
    assert PiToMe(model, [1] * 12, margin=0.5, prop_attn=True).name == "pitome(r=1,1,1,1,1,1,1,1,1,1,1,1, m=0.5, prop-attn)"
    assert PiToMe(model, 1, bsm_blocks=0).name == "pitome(r=1, bsm=0)"
    with pytest.raises(ValueError, match="--method pitome needs --r .* or --ratio"):
        build_method(model, "pitome")
    # the authors' knob: 16 patches at 0.75 keep 12, 9, 7, 6, 5, 4, 3, 3, 3, 3, 3, 3
    m = build_method(model, "pitome", ratio=0.75)
    assert m.name == "pitome(ratio=0.75)" and m.config["ratio"] == 0.75 and m.config["r"] is None
    assert m.config["r_effective"] == [4, 3, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert m.outputs(x)["pitome(ratio=0.75)"].tokens[0, :4].tolist() == [12, 9, 7, 6]
    assert build_method(model, "pitome", r=[2], prop_attn=True).fn.prop_attn is True
    with pytest.raises(ValueError, match="--r or --ratio, not both"):
        build_method(model, "pitome", r=[2], ratio=0.9)
    with pytest.raises(ValueError, match="--ratio applies to pitome only"):
        build_method(model, "tome", r=[2], ratio=0.9)


def test_ratio_gflops_equal_hand_count():
    """GFLOPs of the ratio form: the hand count on the schedule r_l = floor(N_l - 0.75 N_l)."""
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    products, attention, match = _hand_pitome_macs(TINY_DIMS["deit"], [4, 3, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    cost = PiToMe(model, ratio=0.75).cost
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention)
    # similarity N^2 d_h at the 7 merging blocks, N = 16, 12, 9, 7, 6, 5, 4
    assert match == 64 * (256 + 144 + 81 + 49 + 36 + 25 + 16)
    assert int(round(cost.matching_gflops * 1e9)) == 2 * match


def test_eval_and_bench_cli_with_pitome(tmp_path):
    from test_evaluate import CLASSES, IMG, MODEL, make_dataset, save_weights

    csv_path = make_dataset(tmp_path, n_test=4, n_dev=1)
    weights = save_weights(make_model(MODEL, img_size=IMG, num_classes=CLASSES), tmp_path / "w.safetensors")
    out = tmp_path / "res.json"
    rc = main(["eval", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--data", str(csv_path), "--split", "test", "--device", "cpu", "--batch", "4", "--workers", "0",
               "--quiet", "--out", str(out), "--method", "pitome", "--r", "2"])
    assert rc == 0
    out_ratio = tmp_path / "ratio.json"
    rc = main(["eval", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--data", str(csv_path), "--split", "test", "--device", "cpu", "--batch", "4", "--workers", "0",
               "--quiet", "--out", str(out_ratio), "--method", "pitome", "--ratio", "0.9", "--prop-attn"])
    assert rc == 0
    row = json.loads(out_ratio.read_text())["rows"][1]
    assert row["method"] == "pitome(ratio=0.9, prop-attn)" and row["config"]["ratio"] == 0.9
    native, pitome = json.loads(out.read_text())["rows"]
    assert native["method"] == "native" and pitome["method"] == "pitome(r=2)" and pitome["images"] == 4
    assert pitome["gflops"] < native["gflops"] and pitome["config"]["margin"] == 0.75
    bench = tmp_path / "bench.json"
    rc = main(["bench", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--device", "cpu", "--method", "pitome", "--ratio", "0.9", "--data", str(csv_path), "--batch", "4", "--batches", "1",
               "--warmup", "0", "--iters", "1", "--repeats", "1", "--workers", "0", "--out", str(bench)])
    assert rc == 0
    assert [row["method"] for row in json.loads(bench.read_text())["rows"]] == ["native", "pitome(ratio=0.9)"]
