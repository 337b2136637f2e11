"""The actor of App. A: shapes, budgets, masking and the deterministic decision rule."""
import pytest
import torch


from timm_dora import Actor, BlockContext, Packed
from timm_dora.policy.actor import budget_grid, ordered_topk
from timm_dora.policy import ActorPolicy


def test_budget_grids_of_the_paper():
    g196 = budget_grid(196)
    assert g196.numel() == 96 and g196[0] == 2 and g196[-1] == 192
    assert torch.equal(g196, torch.arange(2, 193, 2))
    g256 = budget_grid(256)
    assert g256.numel() == 126 and g256[-1] == 252
    with pytest.raises(ValueError, match="no legal budget"):
        budget_grid(5)


def test_layer_shapes_follow_appendix_a():
    a = Actor(768, 12, 196)
    assert a.gate_mlp[0].in_features == 768 + 19 and a.gate_mlp[0].out_features == 64 and a.gate_mlp[2].out_features == 1
    assert tuple(a.gate_embed.shape) == (12, 16) and tuple(a.block_embed.shape) == (12, 128)
    assert (a.w_in.in_features, a.w_in.out_features) == (768, 128)
    assert (a.w_h.in_features, a.w_h.out_features) == (3, 128)
    enc = a.encoder
    assert enc.num_heads == 4 and enc.fc1.out_features == 256 and enc.fc2.out_features == 128
    assert isinstance(a.budget_head[0], torch.nn.LayerNorm) and a.budget_head[3].out_features == 96
    assert (a.w_k.in_features, a.w_k.out_features) == (1, 128)
    assert a.selector[0].out_features == 64 and a.selector[2].out_features == 1
    assert Actor(768, 12, 256).num_budgets == 126


def test_history_vector():
    a = Actor(32, 5, 20)
    h = a.history(torch.tensor([20, 10]), torch.tensor([0.0, 0.25]), torch.tensor([0, 2]))
    assert torch.allclose(h, torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.25, 0.5]]))


def test_infeasible_budgets_are_masked():
    a = Actor(32, 4, 20)  # grid {2,...,16}
    logits = a.budget_logits(torch.randn(3, 128), torch.tensor([20, 9, 6]))
    feasible = torch.isfinite(logits)
    assert feasible[0].all()  # N=20: every k <= 16
    assert feasible[1].tolist() == [True, True, False, False, False, False, False, False]  # k <= 5
    assert feasible[2].tolist() == [True] + [False] * 7  # k <= 2
    assert a.has_feasible_budget(torch.tensor([6, 5])).tolist() == [True, False]


def test_ordered_topk_is_the_deterministic_rule():
    s = torch.tensor([[0.1, 3.0, -1.0, 2.0, float("-inf")], [5.0, 4.0, 3.0, 2.0, 1.0]])
    order, valid = ordered_topk(s, torch.tensor([2, 1]))
    assert order.tolist()[0] == [1, 3] and order.tolist()[1][0] == 0
    assert valid.tolist() == [[True, True], [True, False]]


def _ctx(keys, lengths, num_prefix, block=0, depth=4, n0=None):
    packed = Packed(torch.zeros(keys.shape[0], 1), torch.tensor(lengths), list(lengths), num_prefix)
    nv = torch.tensor(lengths) - num_prefix
    n0 = n0 or int(nv.max())
    z = torch.zeros(len(lengths))
    return BlockContext(block, keys, packed, nv, z, z.long(), depth, n0, "sdpa_loop")


@torch.no_grad()
def test_actor_policy_deterministic_rule_cls_and_prefix_never_removed():
    torch.manual_seed(0)
    a = Actor(16, 4, 12)
    lengths = [14, 10, 8]  # 2 prefix tokens (CLS + register) + 12, 8, 6 visual
    keys = torch.randn(sum(lengths), 16)
    ctx = _ctx(keys, lengths, 2, n0=12)
    # force the gate open, make budget logits prefer the largest feasible budget
    a.gate_mlp[2].bias.fill_(1e4)
    a.budget_head[3].weight.zero_()
    a.budget_head[3].bias.copy_(torch.arange(a.num_budgets, dtype=torch.float))
    pol = ActorPolicy(a, record=True)
    dec = pol(ctx)
    rec = pol.records[0]
    assert dec.gate.tolist() == [True, True, True]
    # grid {2,...,8}; largest feasible k <= N - 4: 8, 4, 2
    assert dec.removed.tolist() == [8, 4, 2]
    packed = ctx.packed
    assert not dec.remove[packed.pos < 2].any()
    per_image = torch.zeros(3, dtype=torch.long).index_add_(0, packed.seg, dec.remove.long())
    assert per_image.tolist() == [8, 4, 2]
    # the removed tokens are exactly the k highest selector scores of each image
    for a_i, (start, n) in enumerate(zip([0, 14, 24], [12, 8, 6])):
        scores = rec.scores[a_i, :n]
        top = set(torch.topk(scores, dec.removed[a_i].item()).indices.tolist())
        removed_cols = set((dec.remove[start + 2 : start + 2 + n]).nonzero().squeeze(1).tolist())
        assert removed_cols == top


@torch.no_grad()
def test_gate_threshold_and_feasibility():
    a = Actor(16, 4, 12)
    lengths = [13, 6]  # 12 and 5 visual tokens: the second has no feasible budget (5 - 4 < 2)
    ctx = _ctx(torch.randn(19, 16), lengths, 1, n0=12)
    a.gate_mlp[2].weight.zero_()
    a.gate_mlp[2].bias.fill_(0.0)  # p = 0.5 exactly: opens (p >= 0.5)
    dec = ActorPolicy(a)(ctx)
    assert dec.gate.tolist() == [True, False] and dec.removed[1] == 0
    a.gate_mlp[2].bias.fill_(-1e-3)  # p just below 0.5: closed
    dec = ActorPolicy(a)(ctx)
    assert dec.gate.tolist() == [False, False] and dec.remove is None


@torch.no_grad()
def test_sampled_policy_respects_feasibility_and_records_log_prob_inputs():
    torch.manual_seed(1)
    a = Actor(16, 4, 12)
    a.gate_mlp[2].bias.fill_(3.0)
    lengths = [13, 9, 7]
    ctx = _ctx(torch.randn(29, 16), lengths, 1, n0=12)
    g = torch.Generator().manual_seed(0)
    pol = ActorPolicy(a, sample=True, generator=g, record=True)
    for _ in range(20):
        dec = pol(ctx)
        assert ((ctx.n_visual - dec.removed) >= 4).all()
        assert torch.equal(torch.zeros(3, dtype=torch.long).index_add_(0, ctx.packed.seg, dec.remove.long() if dec.remove is not None else torch.zeros(29, dtype=torch.long)), dec.removed)
    rec = pol.records[-1]
    assert rec.order.shape[0] == rec.active.numel()



def test_plackett_luce_ignores_padding_that_points_at_a_chosen_column():
    # regression: padded order entries pointing at column 0 must not un-mark a chosen column 0
    from timm_dora.policy.actor import plackett_luce_log_prob

    s = torch.tensor([[2.0, 0.5, -1.0, 0.0]])
    order = torch.tensor([[0, 0, 0]])
    valid = torch.tensor([[True, False, False]])
    expected = 2.0 - torch.logsumexp(s[0], 0)
    assert torch.allclose(plackett_luce_log_prob(s, order, valid), expected[None])


def test_padded_controller_evaluation_equals_the_packed_reference():
    """rollout.evaluate_controller (fixed shapes: keys padded to one width, the order to the largest
    budget, padding masked) gives the packed, per-sequence computation's budget and selector
    log-probs and entropies, and their gradients, on fp32 (1e-5)."""
    from timm_dora.policy.actor import masked_categorical, plackett_luce_log_prob, selector_entropy, to_padded
    from timm_dora.train.rollout import evaluate_controller

    g = torch.Generator().manual_seed(5)
    n_visual = [16, 9, 12, 6]
    lengths = torch.tensor(n_visual) + 1
    block = torch.tensor([0, 2, 1, 2])
    h = torch.rand(4, 3, generator=g)
    results = []
    for path in ("packed", "padded"):
        torch.manual_seed(0)
        actor = Actor(32, 3, 16)
        keys = torch.randn(int(lengths.sum()), 32, generator=torch.Generator().manual_seed(1))
        bi = torch.tensor([5, 2, 0, 0])  # k = 12, 6, 2, 2 (feasible: k <= n - 4)
        k = actor.budgets[bi]
        # a recorded order: k distinct visual columns of each sequence, then padding
        order = torch.stack([torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(i))[:int(k[i])],
                                        torch.zeros(12 - int(k[i]), dtype=torch.long)]) for i, n in enumerate(n_visual)])
        valid = torch.arange(12)[None] < k[:, None]
        packed = Packed(keys, lengths, lengths.tolist(), num_prefix=1)
        if path == "packed":
            z = actor.encode(keys, packed, h, block, "sdpa_loop")
            n = lengths - 1
            dist = masked_categorical(actor.budget_logits(z[packed.starts], n))
            vis = packed.pos >= 1
            s = actor.selector_scores(z[vis], k.float() / n.float(), packed.seg[vis])
            scores = to_padded(s, packed.seg[vis], packed.pos[vis] - 1, 4, 16, float("-inf"))
            out = dist.log_prob(bi), dist.entropy(), plackett_luce_log_prob(scores, order, valid), selector_entropy(scores)
        else:
            wide = int(actor.budgets[-1])  # the training buffers' order width: the largest budget
            order_p = torch.cat([order, order.new_zeros(4, wide - 12)], 1)
            valid_p = torch.cat([valid, valid.new_zeros(4, wide - 12)], 1)
            out = evaluate_controller(actor, packed.padded(20), lengths, h, block, bi, order_p, valid_p)
        sum(o.sum() for o in out).backward()
        results.append(([o.detach() for o in out], {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}))
    (ref, g_ref), (got, g_got) = results
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
    assert g_ref.keys() == g_got.keys() and {n.split(".")[0] for n in g_ref} >= {"w_in", "encoder", "budget_head", "selector", "w_k"}
    for n in g_ref:
        assert torch.allclose(g_got[n], g_ref[n], atol=1e-5, rtol=1e-4), n


def test_budget_grid_read_as_fractions_at_other_input_sizes_by_hand():
    a = Actor(16, 4, 16)  # N0 = 16: budgets {2, 4, ..., 12}
    assert a.grid().tolist() == a.grid(16).tolist() == [2, 4, 6, 8, 10, 12]
    # round(k * N0' / 16), at least 1: 36 patches (96 px) and 9 (48 px)
    assert a.grid(36).tolist() == [5, 9, 14, 18, 23, 27]
    assert a.grid(9).tolist() == [1, 2, 3, 5, 6, 7]
    assert (a.smallest_budget(36), a.smallest_budget(9), a.smallest_budget(16)) == (5, 1, 2)
    n = torch.tensor([9, 8, 5])
    assert a.feasible_budgets(n, 9).tolist() == [[True, True, True, True, False, False],
                                                 [True, True, True, False, False, False],
                                                 [True, False, False, False, False, False]]
    assert a.has_feasible_budget(torch.tensor([5, 4]), 9).tolist() == [True, False]
    h = a.history(torch.tensor([18]), torch.tensor([0.5]), torch.tensor([1]), num_patches=36)
    assert torch.equal(h, torch.tensor([[0.5, 0.5, 1 / 3]]))  # N_l / N0' (float32)


def test_summary_key_form_for_models_without_a_class_token():
    import timm

    no_cls = timm.create_model("vit_tiny_patch16_224", img_size=64, class_token=False, global_pool="avg")
    assert Actor.for_model(no_cls).summary == "mean"
    assert Actor.for_model(timm.create_model("vit_tiny_patch16_224", img_size=64)).summary == "cls"
    assert "summary" not in Actor(16, 4, 16).config() and Actor(16, 4, 16, summary="mean").config()["summary"] == "mean"
    with pytest.raises(ValueError, match="summary must be one of"):
        Actor(16, 4, 16, summary="register")
