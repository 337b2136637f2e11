"""V-Pruner: the masked forward against timm's own blocks on sliced tokens, masked patches that cannot
matter, native equivalence with every position kept, GFLOPs against a hand count and
torch.utils.flop_counter, batch independence, fused attention, the Plackett-Luce policy and the Fisher
prior by hand, the search (exactly K positions, deterministic under a seed), the mask files and the
errors for bad input."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.engine.blocks import embed
from timm_dora.evaluate import build_method, load_model
from timm_dora.evaluate.baselines.vpruner import (SearchConfig, VPruner, VPrunerMask, architecture, build_pool,
                                                  fisher_prior, kept_from_drops, keep_for_ratio, main, pl_log_prob,
                                                  pl_sample, search_mask, vpruner_forward, vpruner_gflops)

from helpers import SMALL_FAMILIES, assert_batch_independent, counter_flops, hand_vit_macs, images, make_model, spy_sdpa

MASKS = Path(__file__).resolve().parents[1] / "benchmarks" / "baselines" / "vpruner"
KEPT = [0, 3, 5, 6, 9, 10, 15]  # of the 16 patches of a 64 px /16 model (4 x 4 grid)


def small(family):
    name, kw = SMALL_FAMILIES[family]
    return make_model(name, **kw)


def _reference(model, x, kept):
    """timm's own modules on tokens sliced by Python indexing: embedding, the kept visual rows after
    the prefix rows, every ``Block.forward``, the final norm and ``forward_head``."""
    p = model.num_prefix_tokens
    t = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    t = torch.cat([t[:, :p], t[:, p:][:, kept]], dim=1)
    for blk in model.blocks:
        t = blk(t)
    return model.forward_head(model.norm(t))


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "vit_gap", "siglip_map"])
def test_forward_equals_timm_on_the_kept_tokens(family):
    model = small(family)
    n = model.patch_embed.num_patches
    kept = sorted(torch.randperm(n, generator=torch.Generator().manual_seed(0))[: n // 2].tolist())
    x = images(model, 2)
    with torch.no_grad():
        ours = vpruner_forward(model, x, kept)
        assert (ours - _reference(model, x, kept)).abs().max() < 1e-5
        assert not torch.allclose(ours, model(x), atol=1e-3)  # something was pruned


def test_masked_patches_do_not_matter_by_hand():
    """Changing the pixels of a masked patch leaves the logits as they were; of a kept one, not."""
    model = small("deit")  # 4 x 4 patches of 16 px
    x = images(model, 1)
    masked = 1  # patch (row 0, column 1) is not in KEPT
    y = x.clone()
    y[..., 0:16, 16:32] += 3.0
    z = x.clone()
    z[..., 0:16, 0:16] += 3.0  # patch 0, kept
    with torch.no_grad():
        ref = vpruner_forward(model, x, KEPT)
        assert masked not in KEPT and torch.equal(vpruner_forward(model, y, KEPT), ref)
        assert not torch.allclose(vpruner_forward(model, z, KEPT), ref, atol=1e-4)


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers", "vit_gap", "siglip_map"])
def test_all_kept_equals_native(family):
    model = small(family)
    x = images(model, 3)
    n = model.patch_embed.num_patches
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(vpruner_forward(model, x, range(n)), ref)
        assert torch.equal(VPruner(model, list(range(n)))(x), ref)
    assert vpruner_gflops(model, n).gflops == pytest.approx(timm_dora.native_gflops(model), rel=1e-12)


@pytest.mark.parametrize("family,skip_dead", [("deit", False), ("deit_distilled", True), ("dinov2_registers", False),
                                              ("dinov2_registers", True)])
def test_gflops_equal_hand_count_and_flop_counter(family, skip_dead):
    model = small(family)
    p, d, n = model.num_prefix_tokens, model.embed_dim, model.patch_embed.num_patches
    k = n // 2 + 1
    depth = len(model.blocks)
    blocks = [(p + k, p if skip_dead and l == depth - 1 else p + k) for l in range(depth)]
    dims = dict(d=d, hidden=model.blocks[0].mlp.fc1.out_features, patch=model.patch_embed.patch_size[0], patches=n,
                classes=10, heads=2 if family == "deit_distilled" else 1)
    products, attention = hand_vit_macs(dims, blocks)  # the patch embedding counted on all n patches
    cost = vpruner_gflops(model, k, skip_dead)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention)
    assert cost.keep == k and cost.r == [n - k] + [0] * (depth - 1) and cost.tokens == [k] * depth
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        vpruner_forward(model, images(model, 2), list(range(1, k + 1)), skip_dead)
    stable, sdpa = counter_flops(fc)  # the mask is a gather: nothing counted
    assert stable == 2 * 2 * products and sdpa in (None, 2 * 2 * attention)


@pytest.mark.parametrize("family", ["deit", "dinov2_registers", "vit_gap"])
def test_batch_independence(family):
    model = small(family)
    assert_batch_independent(lambda x: vpruner_forward(model, x, KEPT), model, images(model, 4))


def test_skip_dead_and_fused_attention(monkeypatch):
    model = small("deit")
    x = images(model, 2)
    with torch.no_grad():
        assert (VPruner(model, KEPT)(x) - VPruner(model, KEPT, skip_dead=True)(x)).abs().max() < 1e-5
    calls = spy_sdpa(monkeypatch)
    with torch.no_grad():
        vpruner_forward(model, x, KEPT)
    assert [c[0] for c in calls] == [1 + len(KEPT)] * len(model.blocks)  # every block: timm's maskless SDPA
    assert all(mask is None and not any(kw.values()) for _, mask, kw in calls)  # (timm passes dropout_p=0)


def test_plackett_luce_by_hand():
    theta = torch.tensor([0.5, -1.0, 2.0, 0.0])
    u = torch.softmax(-theta, 0)
    # deleting 2 then 0: u_2 / 1, then u_0 over what is left (positions 0, 1, 3)
    want = torch.log(u[2] * u[0] / (1 - u[2]))
    assert pl_log_prob(theta, torch.tensor([[2, 0]])) == pytest.approx(float(want), abs=1e-6)
    orders = torch.tensor(list(itertools.permutations(range(4), 2)))
    assert float(pl_log_prob(theta, orders).exp().sum()) == pytest.approx(1.0, abs=1e-6)  # a distribution
    g = torch.Generator().manual_seed(0)
    draws = pl_sample(theta, 2, 4000, g)
    assert draws.shape == (4000, 2) and all(len(set(d.tolist())) == 2 for d in draws[:50])
    assert (draws[:, 0] == 1).float().mean() == pytest.approx(float(u[1]), abs=0.03)  # the first draw ~ softmax(-theta)
    assert kept_from_drops(4, torch.tensor([[2, 0], [3, 1]])).tolist() == [[1, 3], [0, 2]]


def test_fisher_prior_by_hand():
    """``E[(dL/dm_i)^2]`` with a mask variable per position, one image at a time through autograd."""
    model = small("deit").requires_grad_(False)
    p = model.num_prefix_tokens
    with torch.no_grad():
        tokens = embed(model, images(model, 3))
    target = torch.tensor([1, 4, 7])
    want = torch.zeros(tokens.shape[1] - p)
    for t, y in zip(tokens, target):
        m = torch.ones(tokens.shape[1] - p, requires_grad=True)
        x = torch.cat([t[None, :p], t[None, p:] * m[None, :, None]], dim=1)
        loss = F.cross_entropy(model.forward_head(model.norm(model.blocks(x))), y[None])
        (g,) = torch.autograd.grad(loss, m)
        want += g.square() / 3
    assert torch.allclose(fisher_prior(model, tokens, target, "mask", chunk=2), want, rtol=1e-4, atol=1e-10)
    emb = fisher_prior(model, tokens, target, "embedding")
    assert emb.shape == want.shape and (emb > 0).all()


def test_search_returns_k_positions_deterministically():
    model = small("deit").requires_grad_(False)
    x = images(model, 24)
    cfg = SearchConfig(fisher_images=8, eval_images=8, iterations=3, masks=4, images=4, chunk=32, seed=5)
    pool = build_pool(model, x, cfg)
    assert pool.held.numel() == 8 and pool.train.numel() == 16 and set(pool.held.tolist()).isdisjoint(pool.train.tolist())
    a = search_mask(model, pool, 7, cfg)
    b = search_mask(model, x, 7, cfg)  # the pool rebuilt from the images: the same
    assert len(a.kept) == 7 and len(set(a.kept)) == 7 and a.kept == sorted(a.kept) and all(0 <= i < 16 for i in a.kept)
    assert a.kept == b.kept and a.curve == b.curve and a.scores == b.scores and len(a.curve) == 3
    assert a.scores[a.chose]["reward"] >= a.scores["prior"]["reward"]  # never worse than the prior mask
    assert a.forwards == 3 * 4 * 4 + (8 if a.moved == 0 else 16)
    assert search_mask(model, pool, 16, cfg).kept == list(range(16))  # everything kept: nothing to search


def test_bad_input_one_line_errors(tmp_path):
    model = small("deit")
    for k in (0, 17, 2.5):
        with pytest.raises(ValueError, match=r"K must be 1\.\.16"):
            vpruner_gflops(model, k)
    with pytest.raises(ValueError, match="distinct patch positions"):
        VPruner(model, [1, 1, 2])
    with pytest.raises(ValueError, match="distinct patch positions"):
        vpruner_forward(model, images(model, 1), [3, 16])
    mask = VPrunerMask(architecture(model), [4, 4], 1, 3, [0, 5, 9])
    mask.save(tmp_path / "m.json")
    assert VPruner(model, tmp_path / "m.json").kept.tolist() == [0, 5, 9]
    other_arch = make_model("vit_tiny_patch16_224", img_size=64)
    other_size = make_model("deit_tiny_patch16_224", img_size=96)
    for other in (other_arch, other_size):
        with pytest.raises(ValueError, match="searched for deit_tiny_patch16_224") as e:
            VPruner(other, tmp_path / "m.json")
        assert "\n" not in str(e.value)
    (tmp_path / "x.json").write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="not a V-Pruner mask file"):
        VPruner(model, tmp_path / "x.json")
    with pytest.raises(ValueError, match="needs --mask"):
        build_method(model, "vpruner")
    with pytest.raises(ValueError, match="--r does not apply to vpruner"):
        build_method(model, "vpruner", mask=str(tmp_path / "m.json"), r=[4])
    with pytest.raises(ValueError, match="--mask applies to vpruner, not tome"):
        build_method(model, "tome", r=[4], mask=str(tmp_path / "m.json"))
    with pytest.raises(ValueError):
        keep_for_ratio(model, 0.0)


def test_cli_refuses_test_split_in_one_line(capsys):
    assert main(["search", "--model", "deit_tiny_patch16_224", "--random-weights", "--data", "labels.csv",
                 "--split", "test", "--keep-ratios", "0.5", "--out", "unused"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "never runs on the test split" in err


def test_method_outputs(tmp_path):
    model = small("deit")
    VPrunerMask(architecture(model), [4, 4], 1, len(KEPT), KEPT, search_cost={"wall_s": 1.0, "device": "cpu"}).save(
        tmp_path / "m.json")
    method = build_method(model, "vpruner", mask=str(tmp_path / "m.json"))
    x = images(model, 2)
    (out,) = method.outputs(x).values()
    assert method.name == f"vpruner(K={len(KEPT)})" and method.config["keep"] == len(KEPT)
    assert method.config["search_cost"] == {"wall_s": 1.0, "device": "cpu"}
    with torch.no_grad():
        assert torch.equal(out.logits, vpruner_forward(model, x, KEPT))
    assert out.gflops.tolist() == [vpruner_gflops(model, len(KEPT)).gflops] * 2
    assert out.tokens[0].tolist() == [len(KEPT)] * len(model.blocks) and out.removed[0, 0] == 16 - len(KEPT)


@pytest.mark.skipif(not MASKS.is_dir(), reason="no committed masks")
def test_committed_masks_fit_their_backbones():
    files = sorted(MASKS.glob("*.json"))
    by_model, models = {}, {}
    for f in files:
        m = VPrunerMask.load(f)
        if m.model not in models:
            models[m.model] = timm.create_model(m.model, pretrained=False)
        model = models[m.model]
        kept = m.check(model)
        assert f.name == f"{m.model}_keep{m.keep}.json" and kept.numel() == m.keep
        assert m.gflops == pytest.approx(vpruner_gflops(model, m.keep).gflops, rel=1e-9)
        assert m.search["split"] == "rollout" and m.search_cost["wall_s"] > 0 and m.search_cost["forward_passes"] > 0
        by_model.setdefault(m.model, []).append(1 - m.gflops / m.native_gflops)
    assert set(by_model) == {"vit_tiny_patch16_224", "deit_tiny_patch16_224"}
    for reductions in by_model.values():  # at least five budgets from about 20 % to 50 % fewer GFLOPs
        assert len(reductions) >= 5 and min(reductions) < 0.25 and max(reductions) > 0.45


def test_search_command_writes_masks_that_compare_picks_up(tmp_path, capsys):
    from PIL import Image

    from benchmarks.compare import vpruner_masks

    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i in range(110):
        Image.fromarray((torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{i % 5},n{i % 5:08d},x,{'rollout' if i < 106 else 'test'}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "masks"
    assert main(["search", "--model", "deit_tiny_patch16_224", "--random-weights", "--img-size", "64", "--data",
                 str(tmp_path / "labels.csv"), "--keep-ratios", "0.75", "0.5", "--iterations", "2", "--masks", "3",
                 "--images-per-iteration", "2", "--workers", "0", "--out", str(out)]) == 0
    assert "K=  12" in capsys.readouterr().out
    model = load_model("deit_tiny_patch16_224", random_weights=True, img_size=64)
    found = vpruner_masks([str(out)], model)
    assert [f.name for f in found] == ["deit_tiny_patch16_224_keep12.json", "deit_tiny_patch16_224_keep8.json"]
    mask = VPrunerMask.load(found[0])
    assert mask.search["images"] == 106 and mask.search["held_out"] == 96 and mask.search["config"]["masks"] == 3
    assert mask.search_cost["forward_passes"] == 2 * 3 * 2 + 96 * (1 if mask.result["policy_moved"] == 0 else 2)
    assert len(mask.kept) == 12 and mask.result["chose"] in ("prior", "policy")
    assert vpruner_masks([str(out)], make_model("vit_tiny_patch16_224", img_size=64)) == []
