"""GFLOPs accounting (App. E.4) against hand-computed values, and torch.utils.flop_counter on the ops
whose counting is stable across torch releases (``helpers.STABLE_COUNTER_OPS``)."""
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora import Actor, ReplayPolicy
from timm_dora.policy import ActorPolicy

from helpers import assert_counter_agrees, hand_vit_macs, images, make_model, plan_for_image, random_plan, reference_forward
from test_actor import _ctx


def test_native_deit_b16_and_dinov2_b14_match_table_1():
    # DeiT-B/16, 224: patch 196*768*768; 12 blocks of 197 tokens: QKV+proj 4*768^2, attention
    # matmuls 2*197*768 per token, MLP 2*768*3072; head 768*1000. MACs:
    # 115,605,504 + 12 * 1,453,954,560 + 768,000 = 17,563,828,224 -> 35.127656448 GFLOPs
    deit = timm.create_model("deit_base_patch16_224")
    assert abs(timm_dora.native_gflops(deit) - 35.127656448) < 1e-9
    # DINOv2-B/14, 224 (256 patches): 115,605,504 + 12 * 1,920,468,480 + 768,000 MACs
    dino = timm.create_model("vit_base_patch14_dinov2", img_size=224, num_classes=1000)
    assert abs(timm_dora.native_gflops(dino) - 46.323990528) < 1e-9
    assert round(timm_dora.native_gflops(deit), 1) == 35.1  # paper: 35.2 (its counter adds ~0.07)


# ViT-S/14 with 4 registers at 56 px (make_model: 10 classes): 16 patches of 3x14x14, CLS + 4 registers
VIT_S_REG = dict(d=384, hidden=1536, patch=14, patches=16, classes=10, heads=1)


def test_per_image_gflops_equal_hand_count_and_flop_counter_on_the_reference():
    model = make_model("vit_small_patch14_reg4_dinov2", img_size=56)
    assert (model.embed_dim, model.blocks[0].mlp.fc1.out_features, model.num_prefix_tokens) == (384, 1536, 5)
    plan = random_plan(3, 16, 12, [0, 3, 7, 11], seed=2)
    x = images(model, 3)
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    with torch.no_grad():
        model(x)
    gflops = model.dora_stats.gflops
    for i in range(3):
        deletions, n, blocks = plan_for_image(plan, i), 5 + 16, []
        for l in range(12):
            k = len(deletions.get(l, []))
            blocks.append((n, n - k))  # attention on the tokens entering the block, MLP on the survivors
            n -= k
        products, attention = hand_vit_macs(VIT_S_REG, blocks)
        assert int(round(gflops[i].item() * 1e9)) == 2 * (products + attention), i
        with FlopCounterMode(display=False) as fc:
            reference_forward(model, x[i : i + 1], deletions)
        assert_counter_agrees(fc, products, attention)
    assert len(set(gflops.tolist())) == 3  # the trajectories differ, and so do the counts


@torch.no_grad()
def test_actor_flops_equal_hand_count_and_flop_counter():
    torch.manual_seed(0)
    a = Actor(16, 4, 12)  # d = 16, L = 4, N0 = 12: budgets {2, 4, 6, 8} (M = 4)
    a.gate_mlp[2].bias.fill_(1e4)
    ctx = _ctx(torch.randn(13, 16), [13], 1, n0=12)  # CLS + 12 visual tokens: n = 13
    with FlopCounterMode(display=False) as fc:
        dec = ActorPolicy(a)(ctx)
    assert dec.gate.item()
    # App. A by hand (width 128, 4 heads, FFN 256, budget head 128, selector 64), MACs:
    gate = (16 + 16 + 3) * 64 + 64 * 1  # [K_CLS; e^G; h] -> 64 -> 1
    per_token = 16 * 128 + 128 * 3 * 128 + 128 * 128 + 128 * 256 + 256 * 128  # W_in, QKV, proj, FFN
    attention = 2 * 13 * 13 * 128  # the encoder's QK^T and AV
    fixed = 3 * 128 + (128 * 128 + 128 * 4) + 1 * 128  # W_h on CLS, budget head on Z_CLS, W_k
    selector = 12 * (128 * 64 + 64 * 1)  # on the 12 visual tokens
    assert int(dec.flops.item()) == 2 * (gate + 13 * per_token + attention + fixed + selector) == 3_785_216
    # the gate's block-embedding part is made once per forward for all L = 4 blocks (shared by the
    # images, 16 * 64 MACs a block): the other 3 blocks' parts are counted here, not reported
    shared = 3 * 16 * 64
    assert_counter_agrees(fc, gate + 13 * per_token + fixed + selector + shared, attention)
    a.gate_mlp[2].bias.fill_(-1e4)  # gate closed: only the gate MLP is paid
    with FlopCounterMode(display=False) as fc:
        dec = ActorPolicy(a)(ctx)
    assert int(dec.flops) == 2 * gate
    assert_counter_agrees(fc, gate + shared, 0)


def test_controller_terms_under_compile_do_not_touch_the_weak_cache():
    """The controller's MAC terms by hand (width 128, as above); eagerly they are cached per actor,
    under ``torch.compile`` read off the modules with the cache untouched (Dynamo guards on what it
    reads, and a weak dictionary's length changes whenever the garbage collector runs)."""
    from timm_dora.policy import actor_flops as flops

    a = Actor(16, 4, 12)
    by_hand = (16 * 128 + 128 * 3 * 128 + 128 * 128 + 128 * 256 + 256 * 128,
               3 * 128 + (128 * 128 + 128 * 4) + 1 * 128, 128 * 64 + 64 * 1, 128)
    before = len(flops._CONTROLLER_TERMS)
    terms = torch.compile(lambda: torch.tensor(flops.controller_macs_terms(a)), backend="eager", fullgraph=True)()
    assert tuple(terms.tolist()) == by_hand and len(flops._CONTROLLER_TERMS) == before and a not in flops._CONTROLLER_TERMS
    assert flops.controller_macs_terms(a) == by_hand and flops._CONTROLLER_TERMS[a] == by_hand


def test_map_head_and_other_input_sizes_by_hand():
    """A MAP (attention-pool) head: its latent query's projection, key/value projections of the
    tokens reaching it, attention, output projection and MLP; a dynamic_img_size model at 48 and
    96 px counted at 9 and 36 patches. Both against hand-computed MACs and the flop counter."""
    model = make_model("vit_base_patch16_siglip_224", img_size=64, embed_dim=192, num_heads=3, dynamic_img_size=True)
    model.requires_grad_(False)  # (torch's module tracker trips over the pool's latent parameter under the counter)
    assert model.num_prefix_tokens == 0 and model.attn_pool is not None
    d, hidden, classes = 192, 768, 10
    for size, n0 in ((48, 9), (64, 16), (96, 36)):
        plan = random_plan(2, n0, 12, [1, 6, 11], seed=n0)
        x = torch.randn(2, 3, size, size)
        timm_dora.wrap(model, policy=ReplayPolicy(plan))
        with torch.no_grad():
            model(x)
        gflops = model.dora_stats.gflops
        timm_dora.unwrap(model)
        for i in range(2):
            deletions, n, blocks = plan_for_image(plan, i), n0, []
            for l in range(12):
                k = len(deletions.get(l, []))
                blocks.append((n, n - k))
                n -= k
            products, attention = hand_vit_macs(dict(d=d, hidden=hidden, patch=16, patches=n0, classes=classes, heads=1), blocks)
            # the pool on the n survivors: kv (d -> 2d) per token, q and proj (d -> d) and MLP (d -> 4d -> d) on the one latent
            products += n * d * 2 * d + d * d + d * d + 2 * d * hidden
            attention += 2 * 1 * n * d
            assert int(round(gflops[i].item() * 1e9)) == 2 * (products + attention), (size, i)
            with FlopCounterMode(display=False) as fc:
                reference_forward(model, x[i : i + 1], deletions)
            assert_counter_agrees(fc, products, attention)
        native_products, native_attention = hand_vit_macs(dict(d=d, hidden=hidden, patch=16, patches=n0, classes=classes, heads=1),
                                                          [(n0, n0)] * 12)
        native = native_products + native_attention + n0 * d * 2 * d + 2 * d * d + 2 * d * hidden + 2 * n0 * d
        assert int(round(timm_dora.native_gflops(model, n0) * 1e9)) == 2 * native
