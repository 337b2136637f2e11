"""DiffRate: hand-worked merging and ranking, native equivalence, an independent per-image reference
forward, GFLOPs against a hand count and torch.utils.flop_counter, batch independence, the rate
learning on a tiny model, the committed schedules, and one-line errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora.evaluate import DiffRateMethod, build_method
from timm_dora.evaluate.baselines.diffrate import (
    DiffRate,
    DiffRateSchedule,
    LearnConfig,
    diffrate_forward,
    diffrate_gflops,
    diffrate_plan,
    diffrate_reduce,
    learn_schedule,
    main,
    merge_into_important,
    ramp_for,
)

from helpers import SMALL_FAMILIES, assert_batch_independent, counter_flops, images, make_model

SCHEDULES = Path(__file__).resolve().parents[1] / "benchmarks" / "baselines" / "diffrate"
# 16 patches, 12 blocks: prunes and merges in several blocks, with counts above what is left
# (block 2, 7, 10) and a block that only prunes (block 5)
PRUNE = [16, 14, 16, 12, 12, 9, 9, 9, 6, 6, 5, 3]
MERGE = [16, 12, 16, 11, 10, 9, 7, 9, 6, 4, 5, 2]


def _model(family="deit"):
    name, kw = SMALL_FAMILIES[family]
    return make_model(name, **kw)


def test_merge_into_important_hand_worked():
    # kept (most important first): k0 = [1, 0], k1 = [0, 1]; the others: u2 = [2, .1] -> k0
    # (cos 2/sqrt(4.01)), u3 = [.1, 3] -> k1 (cos 3/sqrt(9.01)), u4 = [-1, -1]: cos -.707 with both,
    # the first maximum (k0), its size adds max(cos, 0) = 0
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.1], [0.1, 3.0], [-1.0, -1.0]])[None]
    s = torch.tensor([[1.0, 2.0, 1.0, 3.0, 5.0]])
    y, sy = merge_into_important(x, s, 2)
    c2, c3 = 2 / math.sqrt(4.01), 3 / math.sqrt(9.01)
    # plain means (the authors' rule), not size-weighted: k0 = (k0 + u2 + u4) / 3, k1 = (k1 + u3) / 2
    assert torch.allclose(y[0], torch.tensor([[(1 + 2 - 1) / 3, (0 + 0.1 - 1) / 3], [0.05, 2.0]]))
    assert torch.allclose(sy[0], torch.tensor([1 + c2, 2 + 3 * c3]))
    with pytest.raises(ValueError, match="keeps 1 to 4 of 5 tokens"):
        merge_into_important(x, s, 5)


def test_reduce_ranks_prunes_then_merges_hand_worked():
    # CLS + 5 visual tokens; importance v3 > v0 > v4 > v1 > v2
    x = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [0.0, 2.0], [1.0, 0.2]])[None]
    imp = torch.tensor([[0.3, 0.1, 0.05, 0.4, 0.15]])
    # prune to 4 (v2 dropped), no merge: prefix, then v3, v0, v4, v1; sizes stay None
    y, s = diffrate_reduce(x, None, imp, 4, 4, 1)
    assert torch.equal(y[0], x[0, [0, 4, 1, 5, 2]]) and s is None
    # then merge to 2: kept v3 = [0, 2], v0 = [1, 0]; v4 = [1, .2] -> v0 (cos 1/sqrt(1.04)), v1 = [0, 1]
    # -> v3 (cos 1); sizes start at 1 (the first merge)
    y, s = diffrate_reduce(x, None, imp, 4, 2, 1)
    assert torch.allclose(y[0], torch.tensor([[9.0, 9.0], [0.0, 1.5], [1.0, 0.1]]))
    assert torch.allclose(s[0], torch.tensor([1.0, 2.0, 1 + 1 / math.sqrt(1.04)]))
    # sizes given: the prefix's stay, the merged ones weighted by their similarity
    y, s = diffrate_reduce(x, torch.tensor([[1.0, 2.0, 3.0, 1.0, 1.0, 4.0]]), imp, 4, 2, 1)
    assert torch.allclose(s[0], torch.tensor([1.0, 1 + 3.0, 2 + 4 / math.sqrt(1.04)]))


def test_plan_takes_the_min_with_the_tokens_left():
    model = _model()
    plan = diffrate_plan(model, DiffRateSchedule(PRUNE, MERGE))
    assert [p for _, p, _ in plan] == [16, 14, 12, 12, 11, 9, 9, 7, 6, 6, 4, 3]
    assert [m for _, _, m in plan] == [16, 12, 12, 11, 10, 9, 7, 7, 6, 4, 4, 2]
    assert diffrate_plan(model, DiffRateSchedule(PRUNE, MERGE), skip_dead=True)[-1] == (4, 4, 4)


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_avgpool", "dinov2_registers"])
def test_native_schedule_equals_native(family):
    model = _model(family)
    x = images(model, 3)
    native = DiffRateSchedule.native(model)
    with torch.no_grad():
        assert (diffrate_forward(model, x, native) - model(x)).abs().max() <= 1e-5
    cost = diffrate_gflops(model, native)
    assert cost.gflops == pytest.approx(timm_dora.native_gflops(model), rel=1e-12) and cost.extra_gflops == 0


@torch.no_grad()
def _reference(model, img, prune, merge):
    """One image, Python loops: explicit softmax attention with log(size), the CLS row averaged over
    heads, ``sorted`` ranking, each merged token into its most cosine-similar kept one."""
    p = model.num_prefix_tokens
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(img))))[0]
    n, size = model.patch_embed.num_patches, [1.0] * x.shape[0]
    for l, blk in enumerate(model.blocks):
        a, t = blk.attn, x.shape[0]
        qkv = a.qkv(blk.norm1(x)).view(t, 3, a.num_heads, a.head_dim).permute(1, 2, 0, 3)
        q, k, v = a.q_norm(qkv[0]), a.k_norm(qkv[1]), qkv[2]
        att = ((q @ k.transpose(-1, -2)) * a.head_dim ** -0.5 + torch.tensor(size).log()).softmax(-1)
        x = x + blk.ls1(a.proj(a.norm((att @ v).transpose(0, 1).reshape(t, -1))))
        kp = min(n, prune[l])
        km = min(kp, merge[l])
        if km < n:
            imp = att[:, 0, p:].mean(0)
            kept = sorted(range(n), key=lambda j: -float(imp[j]))[:kp]
            dst, groups = kept[:km], {j: [j] for j in kept[:km]}
            grown = {j: size[p + j] for j in dst}
            for i in kept[km:]:
                cos = [float(F.cosine_similarity(x[p + i], x[p + j], dim=0)) for j in dst]
                best = max(range(km), key=lambda b: cos[b])
                groups[dst[best]].append(i)
                grown[dst[best]] += size[p + i] * max(cos[best], 0.0)
            x = torch.cat([x[:p], torch.stack([x[[p + i for i in groups[j]]].mean(0) for j in dst])])
            size, n = size[:p] + [grown[j] for j in dst], km
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return model.forward_head(model.norm(x[None]))[0]


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_forward_equals_the_per_image_reference(family):
    model = _model(family)
    x = images(model, 3)
    with torch.no_grad():
        out = diffrate_forward(model, x, DiffRateSchedule(PRUNE, MERGE))
    assert out.shape == (3, 10)
    for i in range(3):
        assert (out[i] - _reference(model, x[i:i + 1], PRUNE, MERGE)).abs().max() < 1e-4, i


@pytest.mark.parametrize("family,skip_dead", [("deit", False), ("deit_distilled", False), ("deit", True)])
def test_gflops_equal_hand_count_and_flop_counter(family, skip_dead):
    model = _model(family)
    d, patch, p = model.embed_dim, model.patch_embed.patch_size[0], model.num_prefix_tokens
    heads = 2 if family == "deit_distilled" else 1
    products = 16 * d * 3 * patch ** 2 + heads * d * 10
    attention = ranking = matching = 0
    n = 16
    for l, (kp, km) in enumerate(zip(PRUNE, MERGE)):
        kp, km = min(n, kp), min(min(n, kp), km)
        if skip_dead and l == 11:
            kp = km = n
        t, m = p + n, (p if skip_dead and l == 11 else p + km)
        products += t * 4 * d * d + m * 2 * d * 4 * d
        attention += 2 * t * t * d
        if km < n:
            ranking += t * d  # the CLS query against every key, all heads
            matching += (kp - km) * km * d  # merged tokens against the kept ones, block features
        n = km
    cost = diffrate_gflops(model, DiffRateSchedule(PRUNE, MERGE), skip_dead)
    assert int(round(cost.gflops * 1e9)) == 2 * (products + attention + ranking + matching)
    assert int(round(cost.extra_gflops * 1e9)) == 2 * (ranking + matching)
    assert int(round(cost.matching_gflops * 1e9)) == 2 * matching
    x = images(model, 2)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        diffrate_forward(model, x, DiffRateSchedule(PRUNE, MERGE), skip_dead)
    stable, sdpa = counter_flops(fc)
    assert stable == 2 * 2 * (products + ranking + matching)
    assert sdpa in (None, 2 * 2 * attention)


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_batch_independence(family):
    model = _model(family)
    assert_batch_independent(lambda x: diffrate_forward(model, x, DiffRateSchedule(PRUNE, MERGE)), model, images(model, 4))


def test_learning_moves_the_gflops_to_the_target_and_leaves_the_model_alone():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = images(model, 12)
    native = timm_dora.native_gflops(model)
    # the authors' start (uniform distributions): the expected kept count in every block from 1 on
    start = diffrate_gflops(model, DiffRateSchedule([16] + [9] * 11, [16] + [9] * 11)).gflops
    for target in (0.45 * native, 0.85 * native):
        log = []
        sched = learn_schedule(model, x, target, LearnConfig(epochs=3, batch=2, granularity=1, init="uniform"), log=log)
        got = diffrate_gflops(model, sched).gflops
        assert abs(got - target) < 0.75 * abs(start - target), (start, got, target)
        assert len(log) == 3 and log[-1]["gflops"] == got and sched.prune[0] == sched.merge[0] == 16
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_ramp_start_meets_the_target_and_stays_near_it():
    model = _model()
    native = timm_dora.native_gflops(model)
    for frac in (0.5, 0.8):
        ramp = ramp_for(model, frac * native)
        assert ramp[0] == 16 and ramp == sorted(ramp, reverse=True)
        got = diffrate_gflops(model, DiffRateSchedule(ramp, ramp)).gflops
        assert frac * native <= got < frac * native + 0.05 * native
    sched = learn_schedule(model, images(model, 4), 0.6 * native, LearnConfig(epochs=1, batch=2, granularity=1))
    assert abs(diffrate_gflops(model, sched).gflops - 0.6 * native) < 0.1 * native


def test_learning_refuses_what_it_cannot_do():
    model = _model()
    x = images(model, 2)
    with pytest.raises(ValueError, match="between 0 and native"):
        learn_schedule(model, x, 10.0)
    with pytest.raises(ValueError, match="eval mode"):
        learn_schedule(model.train(), x, 0.1)
    with pytest.raises(ValueError, match="class-token readout"):
        learn_schedule(_model("vit_avgpool"), x, 0.1)
    with pytest.raises(ValueError, match="init must be 'ramp' or 'uniform'"):
        learn_schedule(model.eval(), x, 0.1, LearnConfig(init="linear"))
    with pytest.raises(SystemExit, match="test split is for evaluation only"):
        main(["learn", "--model", "deit_tiny_patch16_224", "--data", "x.csv", "--split", "test", "--targets", "1", "--out", "o"])


def test_bad_schedules_give_one_line_errors(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="schedule has 3 blocks but the model has 12"):
        DiffRate(model, DiffRateSchedule([4, 4, 4], [4, 4, 4]))
    with pytest.raises(ValueError, match="kept counts must be >= 1"):
        DiffRateSchedule([16] * 12, [0] * 12)
    with pytest.raises(ValueError, match="12 prune counts but 11 merge counts"):
        DiffRateSchedule([16] * 12, [16] * 11)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prune": [16] * 12}))
    with pytest.raises(ValueError, match="bad.json: not a DiffRate schedule JSON"):
        DiffRate(model, str(bad))
    with pytest.raises(ValueError, match="no class token"):
        DiffRate(make_model("vit_tiny_patch16_224", img_size=64, class_token=False, global_pool="avg"), DiffRateSchedule(PRUNE, MERGE))
    for e in (ValueError, TypeError):
        try:
            DiffRate(model, 3 if e is TypeError else DiffRateSchedule([1] * 2, [1] * 2))
        except e as err:
            assert "\n" not in str(err)


def test_method_by_name_with_a_schedule_file(tmp_path):
    model = _model()
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"prune": PRUNE, "merge": MERGE, "target_gflops": 0.1}))
    m = build_method(model, "diffrate", schedule=str(path))
    fn = DiffRate(model, DiffRateSchedule(PRUNE, MERGE))
    assert isinstance(m, DiffRateMethod) and m.name == fn.name == f"diffrate({fn.cost.gflops:.3f}G)"
    assert m.config["prune"] == PRUNE and m.config["schedule"] == str(path) and m.config["r_effective"] == fn.cost.r
    x = images(model, 2)
    out = m.outputs(x)[m.name]
    assert torch.equal(out.logits, fn(x)) and out.gflops.tolist() == [fn.cost.gflops] * 2
    assert out.tokens[0].tolist() == fn.cost.tokens
    with pytest.raises(ValueError, match="--method diffrate needs --schedule FILE.json"):
        build_method(model, "diffrate")
    with pytest.raises(ValueError, match="--r applies to .* not diffrate"):
        build_method(model, "diffrate", schedule=str(path), r=[2])
    with pytest.raises(ValueError, match="--no-prop-attn applies to tome and pitome, not diffrate"):
        build_method(model, "diffrate", schedule=str(path), prop_attn=False)


def test_committed_schedules_are_consistent():
    """Every learned schedule in ``benchmarks/baselines/diffrate``: its recorded GFLOPs are this
    module's count of its schedule, it was learned on ``rollout`` and spans 20-50 % fewer GFLOPs."""
    files = sorted(SCHEDULES.glob("*.json"))
    assert len(files) >= 10
    for arch in ("vit_tiny_patch16_224", "deit_tiny_patch16_224"):
        mine = [json.loads(f.read_text()) for f in files if f.name.startswith(arch + "_")]
        assert len(mine) >= 5
        model = timm.create_model(arch, pretrained=False)
        native = timm_dora.native_gflops(model)
        for spec in mine:
            assert spec["data"]["split"] == "rollout" and spec["model"] == arch
            assert diffrate_gflops(model, DiffRateSchedule(spec["prune"], spec["merge"])).gflops == pytest.approx(spec["gflops"], rel=1e-12)
        saved = sorted(1 - s["gflops"] / native for s in mine)
        assert saved[0] < 0.25 and saved[-1] > 0.45
