"""GFLOPs accounting (App. E.4) against hand-computed values and torch.utils.flop_counter."""
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_dora
from timm_dora import Actor, ReplayPolicy
from timm_dora.policy import ActorPolicy

from helpers import images, make_model, plan_for_image, random_plan, reference_forward
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


def test_per_image_gflops_equal_flop_counter_on_the_reference():
    model = make_model("vit_small_patch14_reg4_dinov2", img_size=56)
    plan = random_plan(3, 16, 12, [0, 3, 7, 11], seed=2)
    x = images(model, 3)
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    with torch.no_grad():
        model(x)
    gflops = model.dora_stats.gflops
    for i in range(3):
        with FlopCounterMode(display=False) as fc:
            reference_forward(model, x[i : i + 1], plan_for_image(plan, i))
        assert fc.get_total_flops() == int(round(gflops[i].item() * 1e9)), i
    assert len(set(gflops.tolist())) == 3  # the trajectories differ, and so do the counts


@torch.no_grad()
def test_actor_flops_equal_flop_counter():
    torch.manual_seed(0)
    a = Actor(16, 4, 12)
    a.gate_mlp[2].bias.fill_(1e4)
    ctx = _ctx(torch.randn(13, 16), [13], 1, n0=12)
    with FlopCounterMode(display=False) as fc:
        dec = ActorPolicy(a)(ctx)
    assert dec.gate.item()
    # the gate's block-embedding part is made once per forward for all L = 4 blocks (shared by the
    # images, 2 * 16 * 64 FLOPs a block): the other 3 blocks' parts are counted here, not reported
    shared = 2 * 3 * 16 * 64
    assert fc.get_total_flops() == int(dec.flops.item()) + shared
    a.gate_mlp[2].bias.fill_(-1e4)  # gate closed: only the gate MLP is paid
    with FlopCounterMode(display=False) as fc:
        dec = ActorPolicy(a)(ctx)
    assert fc.get_total_flops() - shared == int(dec.flops) == 2 * ((16 + 19) * 64 + 64)
