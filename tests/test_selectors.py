"""App. F.1 selector substitutions: recorded gates and budgets kept exactly, rules checked against
per-image brute force, FLOPs against torch.utils.flop_counter."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora import Actor, ActorPolicy
from timm_dora.evaluate.baselines import SELECTORS, AttentionWPRSelector, RandomSelector, SimilaritySelector
from timm_dora.engine.blocks import embed

from helpers import SMALL_FAMILIES, Recorder, counter_flops, images, make_model


@functools.lru_cache(maxsize=None)
def _dora_run(family, batch=6, seed=0):
    """A wrapped model, images and one recorded deterministic DORA run (cached: policies are reset per test)."""
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    torch.manual_seed(seed)
    actor = Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(0.0)  # a random actor whose gate opens at some blocks
    timm_dora.wrap(model, actor)
    policy = ActorPolicy(actor, record=True)
    timm_dora.set_policy(model, policy)
    x = images(model, batch)
    with torch.no_grad():
        model(x)
    return model, x, model.dora_stats, policy.records


@pytest.mark.parametrize(
    "family,selector", [("deit", "random"), ("deit", "similarity"), ("deit", "attention-wpr"), ("dinov2_registers", "attention-wpr")]
)
def test_substitution_keeps_recorded_gates_and_budgets(family, selector):
    model, x, stats, records = _dora_run(family)
    assert stats.gate.any() and (stats.removed > 0).any()
    dora_patches = [None if rp is None else set(zip(*(t.tolist() for t in rp))) for rp in stats.removed_patches]
    for source in ("stats", "records"):
        cls = SELECTORS[selector]
        sel = cls.from_stats(stats, model=model) if source == "stats" else cls.from_records(records, model=model)
        timm_dora.set_policy(model, sel)
        with torch.no_grad():
            model(x)
        s = model.dora_stats
        assert torch.equal(s.removed, stats.removed), (selector, source)
        assert torch.equal(s.gate, stats.gate), (selector, source)
        assert torch.equal(s.tokens, stats.tokens)
        assert torch.isfinite(s.gflops).all()
        # the substitute chooses its own tokens: some block removes a different set than DORA
        mine = [None if rp is None else set(zip(*(t.tolist() for t in rp))) for rp in s.removed_patches]
        assert mine != dora_patches


def _block0_plan(b, depth, ks):
    removed = torch.zeros(b, depth, dtype=torch.long)
    removed[:, 0] = torch.tensor(ks)
    return removed


def _removed_at_block0(model, sel, x):
    timm_dora.set_policy(model, sel)
    with torch.no_grad():
        model(x)
    img, patch = model.dora_stats.removed_patches[0]
    return [sorted(patch[img == i].tolist()) for i in range(x.shape[0])]


def test_similarity_rule_by_brute_force():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 3)
    ks = [3, 0, 7]
    timm_dora.wrap(model, policy=timm_dora.NoPrune())
    got = _removed_at_block0(model, SimilaritySelector(_block0_plan(3, 12, ks), model=model), x)
    a = model.blocks[0].attn
    with torch.no_grad():
        for i, k in enumerate(ks):
            y = model.blocks[0].norm1(embed(model, x[i:i + 1]))
            keys = a.qkv(y)[0, 1:, a.attn_dim:2 * a.attn_dim].view(-1, a.num_heads, a.head_dim).mean(1)
            sim = torch.cosine_similarity(keys[:, None], keys[None], dim=-1)
            sim.fill_diagonal_(-2.0)
            want = sorted(sim.max(1).values.argsort(descending=True)[:k].tolist())
            assert got[i] == want, i


def test_attention_wpr_rule_by_brute_force():
    model = make_model("vit_small_patch14_reg4_dinov2", img_size=56)  # registers: prefix of 5 tokens
    x = images(model, 3)
    ks = [5, 2, 0]
    timm_dora.wrap(model, policy=timm_dora.NoPrune())
    got = _removed_at_block0(model, AttentionWPRSelector(_block0_plan(3, 12, ks), model=model, iters=30), x)
    blk, p = model.blocks[0], model.num_prefix_tokens
    a = blk.attn
    with torch.no_grad():
        for i, k in enumerate(ks):
            y = blk.norm1(embed(model, x[i:i + 1]))
            q, kk, _ = a.qkv(y)[0].view(-1, 3, a.num_heads, a.head_dim).unbind(1)
            q, kk = a.q_norm(q), a.k_norm(kk)
            att = torch.softmax(torch.einsum("ihd,jhd->hij", q, kk) * a.scale, dim=-1).mean(0)
            s = torch.full((att.shape[0],), 1.0 / att.shape[0])
            for _ in range(30):
                s = att.T @ s
            want = sorted(s[p:].argsort()[:k].tolist())
            assert got[i] == want, i


def test_random_selector_seeded():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 4)
    timm_dora.wrap(model, policy=timm_dora.NoPrune())
    plan = _block0_plan(4, 12, [4, 4, 4, 4])
    a = _removed_at_block0(model, RandomSelector(plan, generator=1), x)
    b = _removed_at_block0(model, RandomSelector(plan, generator=1), x)
    c = _removed_at_block0(model, RandomSelector(plan, generator=2), x)
    assert a == b and a != c and all(len(r) == 4 for r in a)


def test_selector_flops_equal_flop_counter():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 2)
    plan = torch.zeros(2, 12, dtype=torch.long)
    plan[1, 2] = 5  # one image prunes at block 2: no padding, so the counter sees exactly its FLOPs
    for cls in (SimilaritySelector, AttentionWPRSelector):
        rec = Recorder(cls(plan, model=model))
        timm_dora.wrap(model, policy=rec)
        with torch.no_grad():
            model(x)
        ctx = rec.contexts[2]
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            dec = rec.policy(ctx)
        products, attention = counter_flops(fc)  # matrix products only (no SDPA)
        assert dec.flops[0] == 0 and attention is None and products == int(dec.flops[1]), cls.name
        timm_dora.unwrap(model)


def test_recorded_run_is_checked():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    timm_dora.wrap(model, policy=SimilaritySelector(torch.zeros(3, 12, dtype=torch.long)))
    with pytest.raises(ValueError, match="images"):
        model(images(model, 2))
    bad = torch.zeros(2, 12, dtype=torch.long)
    bad[0, 1] = 2
    with pytest.raises(ValueError, match="gate is closed"):
        SimilaritySelector(bad, torch.zeros(2, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="model="):
        AttentionWPRSelector(bad)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_selector_substitution_runs_dora_on_the_executor_asked_for(cuda_graphs):
    """``build_method(..., cuda_graphs=...)`` reaches the substitution's DORA run as it reaches the
    ``dora`` method's, so their DORA rows come from the same executor (on the CPU ``True`` runs the
    captured executor's segments uncaptured): a table never mixes the two."""
    from timm_dora.evaluate import build_method

    from helpers import kind_actor

    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    x = images(model, 3)
    actor = kind_actor(model, "forced")
    rows, executors = {}, {}
    for method in ("dora", "random"):
        m = build_method(model, method, actor=actor, cuda_graphs=cuda_graphs)
        try:
            with torch.inference_mode():
                rows[method] = m.outputs(x)["dora"]
            executors[method] = timm_dora.engine_info(model)["executor"]
        finally:
            m.close()
    expected = "captured" if cuda_graphs else "eager"
    assert executors == {"dora": expected, "random": expected}
    assert torch.equal(rows["dora"].logits, rows["random"].logits)
    assert torch.equal(rows["dora"].removed, rows["random"].removed)
