"""``wrap(..., merge=True)`` (ours): removed tokens folded into their most similar survivor, with ToMe's
proportional attention. A hand-worked fold, attention with sizes against duplicated keys, the whole
forward against an independent per-image reference (timm's own modules, Python loops), the GFLOPs
against a hand count, and the refusals."""
from __future__ import annotations

import math

import pytest
import torch

import timm_dora
from timm_dora import Actor
from timm_dora.engine.attention import varlen_attention
from timm_dora.engine.packing import Packed, delete_rows, merge_removed
from timm_dora.evaluate.baselines import proportional_attention
from timm_dora.policy import ReplayPolicy
from timm_dora.policy.actor import encoder_sizes

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import SMALL_FAMILIES, images, kind_actor, make_model, plan_for_image, random_plan


def test_merge_removed_hand_worked():
    # one image: CLS + 4 visual rows; keys (one head) v0 = [1, 0], v1 = [1, .1], v2 = [0, 1], v3 = [.1, 1]
    x = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 2.0], [4.0, 4.0], [2.0, 0.0]])
    keys = torch.tensor([[5.0, 5.0], [1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    packed = Packed.from_dense(x[None], num_prefix=1)
    remove = torch.tensor([False, True, False, True, False])  # v0 -> v1 (cos .995), v2 -> v3 (cos .995)
    merged = merge_removed(packed, keys, remove, num_heads=1)
    assert torch.allclose(merged.x[2], torch.tensor([0.5, 1.0])) and torch.allclose(merged.x[4], torch.tensor([3.0, 2.0]))
    assert merged.sizes.tolist() == [1.0, 1.0, 2.0, 1.0, 2.0] and torch.equal(merged.x[0], x[0])
    out = delete_rows(merged, remove, torch.tensor([2]))
    assert out.sizes.tolist() == [1.0, 2.0, 2.0] and out.lengths_host == [3]
    # a second fold weighs by size: v1 (size 2) into v3 (size 2): the plain mean of the two rows
    again = merge_removed(out, torch.tensor([[5.0, 5.0], [0.0, 1.0], [0.0, 1.0]]), torch.tensor([False, True, False]), 1)
    assert torch.allclose(again.x[2], torch.tensor([1.75, 1.5])) and again.sizes.tolist() == [1.0, 2.0, 4.0]


def test_merge_removed_matches_heads_averaged_and_stays_in_its_image():
    # two images of 1 + 3 rows, two heads: the metric is the mean over heads, and a row never
    # goes to another image's survivor however similar
    x = torch.arange(16.0).view(8, 2)
    k = torch.tensor([[0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0.1],
                      [0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [-1, 0, -1, 0]], dtype=torch.float)
    packed = Packed.from_dense(x.view(2, 4, 2), num_prefix=1)
    remove = torch.tensor([False, True, False, False, False, True, False, False])
    merged = merge_removed(packed, k, remove, num_heads=2)
    assert merged.sizes.tolist() == [1, 1, 1, 2, 1, 1, 2, 1]  # image 0: v0 -> v2; image 1: v0 -> v1 (v2 is opposite)
    assert torch.allclose(merged.x[3], (x[1] + x[3]) / 2) and torch.allclose(merged.x[6], (x[5] + x[6]) / 2)


def test_merge_removed_carries_gradients_by_hand():
    """The fold is a size-weighted mean, so it is differentiable: one image (CLS, v0, v1), v0
    folded into v1; the sum of the rows (the folded row kept until the deletion) is
    cls + v0 + (v0 + v1) / 2, whose gradient is 1, 1.5 and 0.5 per element."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    keys = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.1]])
    merged = merge_removed(Packed.from_dense(x[None], num_prefix=1), keys, torch.tensor([False, True, False]), 1)
    merged.x.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0], [1.5, 1.5], [0.5, 0.5]]


@pytest.mark.parametrize("backend", ["padded", "sdpa_loop"])
def test_attention_with_sizes_equals_duplicated_keys(backend):
    g = torch.Generator().manual_seed(0)
    lengths, sizes = [4, 3], [1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 4.0]
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    packed = Packed(torch.zeros(7, 16), torch.tensor(lengths), lengths, 1, sizes=torch.tensor(sizes))
    out = varlen_attention(q, k, v, packed, 8 ** -0.5, backend)
    start = 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
        dup = [j for j in range(n) for _ in range(int(sizes[start + j]))]  # each key `size` times
        ref = proportional_attention(qs, ks[:, :, dup], vs[:, :, dup])
        assert torch.allclose(out[start:start + n], ref[0].transpose(0, 1), atol=1e-5)
        start += n
    uniform = Packed(torch.zeros(8, 16), torch.tensor([4, 4]), [4, 4], 1, sizes=torch.tensor([1.0, 2, 1, 1, 1, 1, 3, 1]))
    q, k, v = (torch.randn(8, 2, 8, generator=g) for _ in range(3))
    ref = proportional_attention(*(t.view(2, 4, 2, 8).transpose(1, 2) for t in (q, k, v)), uniform.sizes.log().view(2, 4))
    assert torch.allclose(varlen_attention(q, k, v, uniform, 8 ** -0.5, backend), ref.transpose(1, 2).reshape(8, 2, 8), atol=1e-5)


@torch.no_grad()
def _reference_merge(model, img, deletions):
    """One image: timm's Attention with the log-size mask, removed columns folded by Python loops into
    their most cosine-similar surviving visual token (keys after k_norm, averaged over heads)."""
    p = model.num_prefix_tokens
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(img))))
    size = [1.0] * x.shape[1]
    for l, blk in enumerate(model.blocks):
        y = blk.norm1(x)
        x = x + blk.drop_path1(blk.ls1(blk.attn(y, attn_mask=torch.tensor(size).log().view(1, 1, 1, -1))))
        gone = {p + c for c in deletions.get(l, [])}
        if gone:
            a = blk.attn
            k = a.k_norm(a.qkv(y)[0, :, a.attn_dim:2 * a.attn_dim].view(-1, a.num_heads, a.head_dim)).mean(1)
            survivors = [j for j in range(p, x.shape[1]) if j not in gone]
            rows = {j: (x[0, j] * size[j], size[j]) for j in survivors}
            for i in sorted(gone):
                t = max(survivors, key=lambda j: torch.cosine_similarity(k[i], k[j], dim=0).item())
                rows[t] = (rows[t][0] + x[0, i] * size[i], rows[t][1] + size[i])
            keep = list(range(p)) + survivors
            x = torch.stack([x[0, j] if j < p else rows[j][0] / rows[j][1] for j in keep])[None]
            size = [size[j] if j < p else rows[j][1] for j in keep]
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_merged_forward_matches_per_image_reference(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 4)
    n0 = model.patch_embed.num_patches
    plan = random_plan(4, n0, len(model.blocks), [1, 4, 9], seed=2)
    timm_dora.wrap(model, policy=ReplayPolicy(plan), merge=True)
    with torch.no_grad():
        out = model(x)
        deleted = timm_dora.run(model, x, ReplayPolicy(plan))[0]
    timm_dora.unwrap(model)
    for i in range(4):
        ref = _reference_merge(model, x[i:i + 1], plan_for_image(plan, i))
        assert (out[i] - ref[0]).abs().max() < 1e-4, i
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    with torch.no_grad():
        assert (model(x) - out).abs().max() > 1e-3  # deletion is another forward
    timm_dora.unwrap(model)


def test_merge_gflops_add_the_matching_by_hand():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    n0, hd = model.patch_embed.num_patches, model.blocks[0].attn.head_dim
    plan = random_plan(3, n0, len(model.blocks), [2, 6], seed=5)
    stats = {}
    for merge in (False, True):
        timm_dora.wrap(model, policy=ReplayPolicy(plan), merge=merge)
        with torch.no_grad():
            stats[merge] = timm_dora.run(model, images(model, 3), ReplayPolicy(plan))[1]
        timm_dora.unwrap(model)
    assert torch.equal(stats[True].removed, stats[False].removed)
    for i in range(3):
        left, extra = n0, 0
        for l in sorted(plan):
            k = plan_for_image(plan, i)[l]
            left -= len(k)
            extra += len(k) * left * hd  # each folded token against every surviving visual token
        assert math.isclose(float(stats[True].gflops[i] - stats[False].gflops[i]), 2 * extra / 1e9, rel_tol=1e-9)


def test_merge_follows_the_actor(tmp_path):
    model = make_model("deit_tiny_patch16_224", img_size=64)
    actor = Actor.for_model(model, merge=True, **encoder_sizes(32))
    assert actor.config()["merge"] is True and "merge" not in Actor.for_model(model).config()
    actor.save_pretrained(tmp_path / "a", backbone=model)
    timm_dora.wrap(model, str(tmp_path / "a"))
    assert model._dora.merge and model.dora_actor.merge
    timm_dora.unwrap(model)
    timm_dora.wrap(model, str(tmp_path / "a"), merge=False)
    assert not model._dora.merge
    timm_dora.unwrap(model)
    import json
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["actor"]["merge"] = 1
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="actor.merge"):
        timm_dora.wrap(model, str(tmp_path / "a"))


def _forwards(model, batches, **wrap_kw):
    """Logits, stats, executor and its reason of consecutive forwards of one wrapped model."""
    timm_dora.wrap(model, **wrap_kw)
    try:
        out = []
        for x in batches:
            with torch.inference_mode():
                logits = model(x)
            info = timm_dora.engine_info(model)
            out.append((logits, model.dora_stats, info["executor"], info["reason"]))
        return out
    finally:
        timm_dora.unwrap(model)


@pytest.mark.parametrize("bucket", [1, 7])  # 7: the packed rows padded in every block
@pytest.mark.parametrize("kind", ["biased", "forced"])
@pytest.mark.parametrize("family", ["deit", "dinov2_registers", "vit_avgpool"])
def test_merging_graph_runner_equals_the_eager_forward(family, kind, bucket, monkeypatch, engine_options):
    """The graph runner folds in the controller's segment (fixed shapes, sizes in a fixed buffer,
    gathered with the survivors): off CUDA its segments run uncaptured, and every decision and
    GFLOPs count equals the eager merging forward's, over forwards that reuse its buffers; the
    logits up to float32 rounding (products over padded rows may sum in another order: bit-equal
    on 2 cores, not on a 16-core host's BLAS)."""
    from timm_dora.engine import graphs

    engine_options(rows_bucket=bucket)
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    batches = [images(model, 6, seed=s) for s in (1, 2, 1)]
    actor = kind_actor(model, kind)
    eager = _forwards(model, batches, actor=actor, merge=True)
    runner = _forwards(model, batches, actor=actor, merge=True, cuda_graphs=True)
    deleting = _forwards(model, batches[:1], actor=actor, cuda_graphs=True)
    for (a, sa, ea, _), (b, sb, eb, why) in zip(eager, runner):
        assert (ea, eb, why) == ("eager", "captured", None)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for name in ("gate", "removed", "gflops"):
            assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    assert eager[0][1].removed.sum() > 0 and (deleting[0][0] - runner[0][0]).abs().max() > 1e-3


def test_merging_runs_eagerly_where_the_graphs_cannot_fold():
    """A policy other than the actor decides on the host: merging then runs eagerly, and with
    ``cuda_graphs=True`` one warning says why."""
    import warnings

    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 3)
    plan = random_plan(3, model.patch_embed.num_patches, len(model.blocks), [2, 6], seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got, _, executor, why), = _forwards(model, [x], policy=ReplayPolicy(plan), merge=True, cuda_graphs=True)
    assert executor == "eager" and why == "merge=True is captured for a deterministic CLS actor in the model's dtype only"
    assert [str(w.message) for w in caught] == [f"timm_dora: cuda_graphs=True but this forward runs eagerly: {why}"]
    (ref, _, _, _), = _forwards(model, [x], policy=ReplayPolicy(plan), merge=True)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture itself)")
def test_merging_actor_is_captured_on_cuda():
    """On CUDA (bf16, the Triton backend) a merging actor runs captured by default: its graphs fold
    and attend with sizes. The captured controller runs on every image, masked, so in bf16 a
    near-tie may choose another token than the eager forward: the gates agree, and images whose
    removed tokens all agree get logits within bf16 rounding."""
    model = make_model("deit_tiny_patch16_224", img_size=64).cuda().to(torch.bfloat16)
    actor = kind_actor(model, "forced").cuda().to(torch.bfloat16)
    batches = [images(model, 6, seed=s).cuda().to(torch.bfloat16) for s in (1, 2, 1)]
    eager = _forwards(model, batches, actor=actor, merge=True, cuda_graphs=False)
    captured = _forwards(model, batches, actor=actor, merge=True)
    same = 0
    for (a, sa, _, _), (b, sb, executor, why) in zip(eager, captured):
        assert (executor, why) == ("captured", None) and torch.isfinite(b).all()
        assert torch.equal(sa.gate, sb.gate) and sa.removed.sum() > 0
        for i in range(6):
            agree = all(pa is None or torch.equal(pa[1][pa[0] == i], pb[1][pb[0] == i])
                        for pa, pb in zip(sa.removed_patches, sb.removed_patches))
            if agree:
                same += 1
                assert (a[i].float() - b[i].float()).abs().max() < 5e-2
    assert same >= 9  # of 18
