"""The actor's controller fused into Triton kernels (``timm_dora.policy.actor_kernels``).

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before they
are defined, so in a subprocess) and ``ActorPolicy.controller_fixed`` with them is compared with the
same method on the ``nn`` modules (fp32: the same removals, budgets and FLOPs); on CUDA the compiled
kernels are compared in bf16 with the module path and replayed from a CUDA graph.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import capture_graph, run_interpreted, triton_version
from timm_dora import Actor
from timm_dora.policy.actor_kernels import fused_controller, fused_controller_reason
from timm_dora.policy import ActorPolicy, encoder_sizes

pytest.importorskip("triton")

INTERPRETED = r"""
import json
import torch
import torch.nn.functional as F
from timm_dora import Actor
from timm_dora.policy import ActorPolicy

def perturbed(actor, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in actor.parameters():  # LayerNorm scales and every bias away from 1 / 0
            prm.add_(0.2 * torch.randn(prm.shape, generator=g))
    return actor

out = {}
for name, d, n0, p, lengths, gate in (
    # a ViT-Ti-sized actor (d=192, width 128) on ragged sequences of up to 197 tokens
    ("vit_ti", 192, 196, 1, [197, 120, 30, 197, 61], [True, True, False, True, True]),
    # five prefix tokens (registers): the controller reads CLS and the visual tokens only; d=48
    ("registers", 48, 16, 5, [21, 15, 9, 21], [True, False, True, True]),
):
    torch.manual_seed(0)
    actor = perturbed(Actor(d, 12, n0), 1).eval()
    g = torch.Generator().manual_seed(2)
    b = len(lengths)
    lengths_t = torch.tensor(lengths)
    cu = F.pad(lengths_t.cumsum(0), (1, 0)).to(torch.int32)
    t = int(lengths_t.sum())
    keys = torch.randn(t + 9, d, generator=g)  # 9 padded rows past the last sequence
    keys[t:] = float("nan")  # never read
    # image 0's visual keys in runs of three equal rows: equal scores, so ties at the k-th score
    # (k is even), which a stable descending sort breaks towards the lower index. (vit_ti only: in
    # the interpreter tl.dot is numpy's matmul, whose BLAS may round two equal rows differently by
    # their place in a row tile; with the registers case's 16-row tiles it breaks the ties)
    if p == 1:
        first = keys[p:lengths[0]]
        first.copy_(first[torch.arange(first.shape[0]) // 3 * 3])
    n_visual = lengths_t - p
    h = torch.stack([n_visual / n0, torch.rand(b, generator=g), torch.tensor([0.0, 1, 2, 3, 4][:b]) / 11], 1)
    gate = torch.tensor(gate)
    res = {}
    for fused in (False, True):  # the module path (sdpa_loop) on the real rows, the kernels on all
        policy = ActorPolicy(actor, fused_controller=fused)
        with torch.no_grad():
            remove, k, flops = policy.controller_fixed(keys if fused else keys[:t], cu, max(lengths), p, h,
                                                       n_visual, gate, 4, "sdpa_loop", lengths)
        res[fused] = (remove, k, flops)
    # into buffers that held other values (the graphs' fixed outputs): every flag of the layout
    # rewritten, nothing past it touched
    stale = (torch.ones(t + 9 + 3, dtype=torch.bool), torch.full((b,), 7), torch.full((b,), -1.0, dtype=torch.float64))
    with torch.no_grad():
        into = ActorPolicy(actor, fused_controller=True).controller_fixed(keys, cu, max(lengths), p, h, n_visual, gate,
                                                                          4, "sdpa_loop", lengths, out=stale)
    (r0, k0, f0), (r1, k1, f1) = res[False], res[True]
    tiled = None
    if p == 1:  # other rows per program for each row kernel (what a benchmark sweeps): the same results
        from timm_dora.policy.actor_kernels import fused_controller
        with torch.no_grad():
            tiled = fused_controller(actor, keys, cu, max(lengths), h, n_visual, gate, 4, cu, p, t + 9,
                                     tile={"embed": (32, 4), "out_ffn": (16, 4), "scores": (64, 4)},
                                     launch={"k_block": 128, "num_stages": 1, "ffn_chunk": 64})
            # (the default tiles here are 16 rows: the budget head runs in _out_ffn's programs; above
            # BUDGET_IN_FFN_ROWS it is its own kernel, _budget)
            wide = fused_controller(actor, keys, cu, max(lengths), h, n_visual, gate, 4, cu, p, t + 9,
                                    tile={"out_ffn": (64, 4)})
            tiled = [tiled, wide]
            # no rows at all (the unplanned whole graph where no gate opened: cu_seqlens zeros): into
            # stale buffers, nothing removed and the gate's FLOPs, with the head in _out_ffn or apart
            closed = torch.zeros_like(gate)
            empty = [fused_controller(actor, keys, torch.zeros_like(cu), max(lengths), h, n_visual, closed, 4, cu, p,
                                      t + 9, tile=tile, out=(torch.ones(t + 9, dtype=torch.bool), torch.full((b,), 7),
                                                             torch.full((b,), -1.0, dtype=torch.float64)))
                     for tile in ({"out_ffn": (16, 4)}, {"out_ffn": (64, 4)})]
            out["empty"] = {"equal": all(torch.equal(a, c) for a, c in zip(*empty)), "k": empty[0][1].tolist(),
                            "removed": int(empty[0][0].sum()), "flops": empty[0][2].tolist(),
                            "closed_flops": f1[2].item()}
    if p > 1:  # several prefix rows, a zeroed layout (the unplanned whole graph where no gate opened):
        # through controller_fixed, which drops the other prefix rows, nothing removed, the gate's FLOPs
        closed = torch.zeros_like(gate)
        zeroed = (torch.ones(t + 9 + 3, dtype=torch.bool), torch.full((b,), 7), torch.full((b,), -1.0, dtype=torch.float64))
        with torch.no_grad():
            ActorPolicy(actor, fused_controller=True).controller_fixed(keys, torch.zeros_like(cu), max(lengths), p, h,
                                                                       n_visual, closed, 4, "sdpa_loop", lengths,
                                                                       out=zeroed)
        out["empty_prefix"] = {"k": zeroed[1].tolist(), "removed": int(zeroed[0][:t + 9].sum()),
                               "flops": zeroed[2].tolist(), "closed_flops": f1[1].item()}
    out[name] = {
        "tiled_equal": None if tiled is None else bool(all(torch.equal(a, b) for run in tiled
                                                            for a, b in zip(run, (r1, k1, f1)))),
        "rows": [int(r0.shape[0]), int(r1.shape[0])],
        "remove_equal": bool(torch.equal(r0, r1[:t])), "k_equal": bool(torch.equal(k0, k1)),
        "flops_equal": bool(torch.equal(f0, f1)), "k": k1.tolist(), "removed_per_image":
        [int(r1[s:e].sum()) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())],
        "prefix_removed": int(sum(r1[s:s + p].sum() for s in cu[:-1].tolist())),
        "padding_removed": int(r1[t:].sum()),
        "out_equal": bool(torch.equal(into[0], r1) and torch.equal(into[1], k1) and torch.equal(into[2], f1)),
        "out_is_buffer": bool(into[0].data_ptr() == stale[0].data_ptr() and into[1] is stale[1] and into[2] is stale[2]),
        "out_tail": stale[0][t + 9:].tolist(),
    }
# the gate: one kernel against the modules' logit >= 0 and the feasibility rule
from timm_dora.policy.actor_kernels import fused_gate
torch.manual_seed(0)
actor = perturbed(Actor(192, 12, 196), 3)
with torch.no_grad():
    actor.gate_mlp[2].bias.zero_()  # logits around 0: some gates open, some closed
g = torch.Generator().manual_seed(4)
keys = torch.randn(40, 3, 9, 64, generator=g)  # [B, H, S, hd]; the CLS keys a strided view
cls = keys[:, :, 0]
n_visual = torch.randint(0, 197, (40,), generator=g)
n_visual[:4] = torch.tensor([5, 6, 4, 7])  # 5 and 4 leave no feasible budget
h = torch.stack([n_visual / 196, torch.rand(40, generator=g), torch.rand(40, generator=g)], 1)
with torch.no_grad():
    bias = actor.gate_bias(h, 5, torch.float32).contiguous()
    ref = (actor.gate_logit(cls.reshape(40, -1), h, 5) >= 0) & actor.has_feasible_budget(n_visual)
    got = fused_gate(actor, cls, bias, n_visual)
    got2 = fused_gate(actor, cls.reshape(40, -1).contiguous(), bias, n_visual)
out["gate"] = {"equal": bool(torch.equal(ref, got)), "equal_2d": bool(torch.equal(ref, got2)),
               "open": int(ref.sum()), "first4": got[:4].tolist(), "dtype": str(got.dtype)}
# the open images' keys copied for the controller (dense [B, H, S, hd] and packed [rows, H, hd]
# sources, strided views as attention gives them); the other rows keep what they held
from timm_dora.engine.varlen_kernel import copy_open_keys
g = torch.Generator().manual_seed(5)
keys4 = torch.randn(4, 7, 3, 64, generator=g).transpose(1, 2)  # [B, H, S, hd], S not the inner dim
gate4 = torch.tensor([True, False, True, False])
cu4 = torch.arange(0, 29, 7, dtype=torch.int32)
dst4 = torch.full((28, 192), -1.0)
copy_open_keys(keys4, cu4, 7, gate4, dst4)
ref4 = torch.full((28, 192), -1.0)
rows4 = keys4.transpose(1, 2).reshape(28, 192)
for i in (0, 2):
    ref4[7 * i:7 * i + 7] = rows4[7 * i:7 * i + 7]
lengths = [5, 9, 1, 7]
cu3 = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
qkv = torch.randn(26, 3, 12, 64, generator=g)  # 22 real rows, 4 padded; the keys a strided view
keys3 = qkv[:, 1]
gate3 = torch.tensor([False, True, True, False])
dst3 = torch.full((26, 768), -1.0)
copy_open_keys(keys3, cu3, 9, gate3, dst3)
ref3 = torch.full((26, 768), -1.0)
ref3[5:15] = keys3.reshape(26, 768)[5:15]
out["copy"] = {"dense": bool(torch.equal(dst4, ref4)), "packed": bool(torch.equal(dst3, ref3)),
               "dense_copied": int((dst4 != -1).all(1).sum()), "packed_copied": int((dst3 != -1).all(1).sum())}
print(json.dumps(out))
"""


@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run these kernels")
def test_interpreted_kernels_equal_the_module_path():
    res = run_interpreted(INTERPRETED, timeout=600)
    gate = res.pop("gate")
    copy = res.pop("copy")
    empty = res.pop("empty")
    prefix = res.pop("empty_prefix")
    assert prefix["k"] == [0] * 4 and prefix["removed"] == 0
    assert prefix["flops"] == [prefix["closed_flops"]] * 4  # (image 1's gate is closed in the run with rows)
    assert empty["equal"] and empty["removed"] == 0 and empty["k"] == [0] * 5
    assert empty["flops"] == [empty["closed_flops"]] * 5  # (image 2's gate is closed in the run with rows)
    assert copy == {"dense": True, "packed": True, "dense_copied": 14, "packed_copied": 10}
    assert gate["equal"] and gate["equal_2d"] and gate["dtype"] == "torch.bool"
    assert 5 <= gate["open"] <= 35 and gate["first4"][0] is False and gate["first4"][2] is False
    for name, case in res.items():
        assert case["remove_equal"] and case["k_equal"] and case["flops_equal"], (name, case)
        assert case["prefix_removed"] == 0 and case["padding_removed"] == 0
        # written into stale buffers: the same results, in those buffers, the entries past the layout kept
        assert case["out_equal"] and case["out_is_buffer"] and case["out_tail"] == [True] * 3, (name, case)
        assert case["removed_per_image"] == case["k"]
    assert res["vit_ti"]["tiled_equal"] is True
    # the cases are not degenerate: gate-active images remove tokens, in varied amounts
    assert res["vit_ti"]["rows"] == [605, 614] and res["vit_ti"]["k"][2] == 0
    assert all(k > 0 for i, k in enumerate(res["vit_ti"]["k"]) if i != 2)
    assert len(set(res["vit_ti"]["k"])) >= 3
    assert res["vit_ti"]["k"][0] % 3 != 0  # the k-th removal splits a run of tied scores
    assert res["registers"]["k"][1] == 0 and res["registers"]["rows"] == [66, 75]


def test_fused_controller_reasons_and_errors():
    assert fused_controller_reason(Actor(192, 12, 196), torch.bfloat16) is None
    for width in (32, 64, 256):  # the sizes of --actor-width
        assert fused_controller_reason(Actor(192, 12, 196, **encoder_sizes(width)), torch.bfloat16) is None
    assert "ffn_dim=96" in fused_controller_reason(Actor(192, 12, 196, ffn_dim=96), torch.bfloat16)
    assert "head dim 16" in fused_controller_reason(Actor(192, 12, 196, num_heads=8), torch.bfloat16)
    assert "dtype" in fused_controller_reason(Actor(192, 12, 196), torch.float64)
    with pytest.raises(ValueError, match="fused_controller must be None, True or False"):
        ActorPolicy(Actor(192, 12, 196), fused_controller="yes")
    policy = ActorPolicy(Actor(192, 12, 196, num_heads=8), fused_controller=True)
    with pytest.raises(ValueError, match="fused_controller=True: the encoder's head dim 16"):
        policy._use_fused("triton", torch.bfloat16)
    # default: only where the triton attention backend runs; False: never
    assert not ActorPolicy(Actor(192, 12, 196))._use_fused("torch_varlen", torch.bfloat16)
    assert ActorPolicy(Actor(192, 12, 196))._use_fused("triton", torch.bfloat16)
    assert not ActorPolicy(Actor(192, 12, 196), fused_controller=False)._use_fused("triton", torch.bfloat16)
    actor = Actor(48, 4, 16)
    cu = torch.tensor([0, 17], dtype=torch.int32)
    z = torch.zeros(17, dtype=torch.long)
    with pytest.raises(ValueError, match=r"keys must be \[rows, 48\]"):
        fused_controller(actor, torch.zeros(17, 40), cu, 17, torch.zeros(1, 3), torch.tensor([16]),
                         torch.tensor([True]), 0, cu, 1, 17)
    with pytest.raises(ValueError, match="keys are torch.bfloat16, the actor's weights torch.float32"):
        fused_controller(actor, torch.zeros(17, 48, dtype=torch.bfloat16), cu, 17, torch.zeros(1, 3),
                         torch.tensor([16]), torch.tensor([True]), 0, cu, 1, 17)
    with pytest.raises(ValueError, match=r"tile: unknown kernels \['ffn'\] \(known: \['embed', 'out_ffn', 'scores'\]\)"):
        fused_controller(actor, torch.zeros(17, 48), cu, 17, torch.zeros(1, 3), torch.tensor([16]),
                         torch.tensor([True]), 0, cu, 1, 17, tile={"ffn": (64, 8)})
    with pytest.raises(ValueError, match=r"launch: unknown entries \['stages'\] \(known: \['num_stages', 'k_block', 'ffn_chunk'\]\)"):
        fused_controller(actor, torch.zeros(17, 48), cu, 17, torch.zeros(1, 3), torch.tensor([16]),
                         torch.tensor([True]), 0, cu, 1, 17, launch={"stages": 1})
    with pytest.raises(ValueError, match=r"out must be \(remove \[>= 17\] bool, k \[1\] int64, flops \[1\] float64\)"):
        fused_controller(actor, torch.zeros(17, 48), cu, 17, torch.zeros(1, 3), torch.tensor([16]),
                         torch.tensor([True]), 0, cu, 1, 17,
                         out=(torch.zeros(16, dtype=torch.bool), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.float64)))


def test_few_rows_get_smaller_tiles():
    """A row kernel's tile halves until its grid has SMALL_GRID (64) programs, down to 16 rows at
    4 warps: one image's 197 rows run as 13 programs of 16 rows, sixteen images' 3,152 as 99 of
    32; at batch 320 (63,040 rows) the tuned tiles stay."""
    from timm_dora.policy.actor_kernels import SMALL_GRID, _rows_tile
    assert SMALL_GRID == 64
    assert _rows_tile((128, 8), 197) == (16, 4) and _rows_tile((64, 8), 197) == (16, 4)
    assert _rows_tile((128, 8), 3152) == (32, 4) and _rows_tile((64, 8), 3152) == (32, 4)
    assert _rows_tile((128, 8), 8192) == (128, 8) and _rows_tile((128, 8), 8064) == (64, 4)
    assert _rows_tile((128, 8), 320 * 197) == (128, 8) and _rows_tile((64, 8), 320 * 197) == (64, 8)
    assert _rows_tile((128, 8), 1) == (16, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [128, 64, 32])
def test_cuda_fused_controller_matches_modules_and_replays_from_a_graph(width):
    """bf16 on the GPU: the fused kernels against the module path (the same removals on all but
    near-tied tokens) and captured once, replayed after the lengths changed in place; for the
    paper's actor and the narrower ones of ``--actor-width``."""
    torch.manual_seed(0)
    dev, p, n0 = "cuda", 1, 196
    actor = Actor(192, 12, n0, **encoder_sizes(width)).to(dev, torch.bfloat16).eval()
    with torch.no_grad():
        for prm in actor.parameters():
            prm.add_(0.2 * torch.randn_like(prm))
    lengths = torch.tensor([197, 120, 30, 197, 61, 150, 5, 197] * 8)
    b, t = lengths.numel(), int(lengths.sum())
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(dev, torch.int32)
    keys = torch.randn(t + 100, 192, device=dev, dtype=torch.bfloat16)
    n_visual = (lengths - p).to(dev)
    h = torch.stack([n_visual / n0, torch.rand(b, device=dev), torch.zeros(b, device=dev)], 1)
    gate = torch.arange(b, device=dev) % 5 != 2
    results = {}
    with torch.inference_mode():
        for fused in (False, True):
            pol = ActorPolicy(actor, fused_controller=fused)
            results[fused] = pol.controller_fixed(keys, cu, 197, p, h, n_visual, gate, 4, "triton")
        (r0, k0, f0), (r1, k1, f1) = results[False], results[True]
        assert torch.equal(f0, f1)
        assert (k0 == k1).float().mean() >= 0.9 and k1[~gate].eq(0).all()
        same_k = (k0 == k1)[torch.repeat_interleave(torch.arange(b, device=dev), lengths.to(dev))]
        agree = (r0[:t] == r1[:t])[same_k]
        assert agree.float().mean() >= 0.97
        # (these 7,756 rows take _out_ffn tiles of 64 and _budget) with tiles of 16 rows the budget
        # head runs in _out_ffn: the same budgets but for near-ties, the FLOPs those budgets give
        from timm_dora.policy.actor_kernels import fused_controller
        r2, k2, f2 = fused_controller(actor, keys, cu, 197, h, n_visual, gate, 4, cu, p, t + 100,
                                      tile={"out_ffn": (16, 4)})
        assert (k2 == k1).float().mean() >= 0.97 and k2[~gate].eq(0).all()
        assert torch.equal(f2[k2 == k1], f1[k2 == k1])
        # captured, then replayed with the sequences reversed in the same buffers
        pol = ActorPolicy(actor, fused_controller=True)
        cu_buf, nv_buf, h_buf = cu.clone(), n_visual.clone(), h.clone()
        graph, captured = capture_graph(lambda: pol.controller_fixed(keys, cu_buf, 197, p, h_buf, nv_buf, gate, 4,
                                                                     "triton"))
        flipped = lengths.flip(0)
        cu_buf.copy_(F.pad(flipped.cumsum(0), (1, 0)).to(dev, torch.int32))
        nv_buf.copy_((flipped - p).to(dev))
        h_buf[:, 0].copy_(nv_buf / n0)
        graph.replay()
        eager = ActorPolicy(actor, fused_controller=True).controller_fixed(keys, cu_buf, 197, p, h_buf, nv_buf, gate, 4,
                                                                            "triton")
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_gate_matches_modules():
    from timm_dora.policy.actor_kernels import fused_gate

    torch.manual_seed(0)
    actor = Actor(768, 12, 196).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for prm in actor.parameters():
            prm.add_(0.2 * torch.randn_like(prm))
        actor.gate_mlp[2].bias.zero_()
    keys = torch.randn(320, 12, 197, 64, device="cuda", dtype=torch.bfloat16)
    n_visual = torch.randint(0, 197, (320,), device="cuda")
    h = torch.stack([n_visual / 196, torch.rand(320, device="cuda"), torch.zeros(320, device="cuda")], 1)
    with torch.inference_mode():
        bias = actor.gate_bias(h, 3, torch.bfloat16).contiguous()
        # the output bias at the logits' median: about half the gates open
        actor.gate_mlp[2].bias.sub_(actor.gate_logit(keys[:, :, 0].reshape(320, -1), h, 3).float().median())
        ref = (actor.gate_logit(keys[:, :, 0].reshape(320, -1), h, 3) >= 0) & actor.has_feasible_budget(n_visual)
        got = fused_gate(actor, keys[:, :, 0], bias, n_visual)
    assert 0.2 < ref.float().mean() < 0.8
    assert (got == ref).float().mean() >= 0.98  # bf16: near-ties of the logit at 0 may differ
    # the packed form: each image's CLS row read in place from [T, H, hd] rows
    rows = keys[:, :, :3].permute(0, 2, 1, 3).reshape(960, 12, 64)  # three rows an image
    starts = torch.arange(320, device="cuda", dtype=torch.int32) * 3
    assert torch.equal(fused_gate(actor, rows, bias, n_visual, rows=starts), got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_gate_context_matches_modules():
    from timm_dora.policy.actor_kernels import fused_gate_context

    torch.manual_seed(0)
    actor = Actor(768, 12, 196).cuda().eval()
    with torch.no_grad():
        for prm in (actor.gate_embed, actor.gate_mlp[0].weight, actor.gate_mlp[0].bias):
            prm.add_(0.3 * torch.randn_like(prm))
    actor = actor.to(torch.bfloat16)
    n_visual = torch.randint(0, 197, (300,), device="cuda")
    rho, interventions = torch.rand(300, device="cuda"), torch.randint(0, 12, (300,), device="cuda")
    with torch.inference_mode():
        h_ref = actor.history(n_visual, rho, interventions)
        ref = actor.gate_bias(h_ref, None, torch.bfloat16)
        h, got = fused_gate_context(actor, n_visual, rho, interventions, 196, torch.bfloat16)
    assert torch.equal(h, h_ref)
    diff = (got.float() - ref.float()).abs()
    # cuBLAS rounds each product once, as the kernel: equal but for the order of the fp32 sums
    assert (diff == 0).float().mean() >= 0.95
    assert bool((diff <= 2 * torch.finfo(torch.bfloat16).eps * ref.float().abs().max()).all())


GRAPH_PATH = r"""
import json, sys
sys.path.insert(0, "tests")
import torch
import timm_dora
import timm_dora.engine.patch as P
from helpers import images, make_model
from timm_dora import Actor, ActorPolicy

model = make_model("deit_tiny_patch16_224", img_size=64)  # 16 patches, budgets {2, ..., 12}
x = images(model, 3)
actor = Actor.for_model(model)
with torch.no_grad():  # the gate open at blocks 2, 5 and 8 only; a budget of 4 tokens
    actor.gate_mlp[0].weight.zero_(); actor.gate_mlp[0].bias.zero_()
    actor.gate_mlp[0].weight[0, actor.embed_dim] = 1.0
    actor.gate_embed.zero_(); actor.gate_embed[[2, 5, 8], 0] = 10.0
    actor.gate_mlp[2].weight.zero_(); actor.gate_mlp[2].weight[0, 0] = 10.0; actor.gate_mlp[2].bias.fill_(-5.0)
    actor.budget_head[3].bias[1] += 100.0
res = {}
with torch.inference_mode():
    timm_dora.wrap(model, policy=ActorPolicy(actor, fused_controller=False))
    ref, ref_stats = P.run(model, x, model._dora.policy)
    timm_dora.unwrap(model)
    # the graph path as on an H100: the triton backend, so the actor's Triton gate runs in line,
    # the open images' keys are copied by copy_open_keys and the controller is fused
    P.select_backend = lambda device_type, dtype, preference="auto": "triton"
    # fused_interventions: the controller in the attention's graph where the gate opened before
    timm_dora.wrap(model, policy=ActorPolicy(actor, fused_controller=True), cuda_graphs=True,
                   options=timm_dora.EngineOptions(fused_interventions=__FUSED__))
    ran = []
    for i in range(2):  # the second forward: the runner's state from the first one (history, opened)
        if i == 1:
            runner = next(iter(model._dora.graphs.values()))
            run_segment = runner.run_segment
            runner.run_segment = lambda key: (ran.append((key[0], key[1] if len(key) > 1 else None)), run_segment(key))[1]
            if __FUSED__:  # also guess wrong: blocks 1 (dense) and 3 (packed) open for no image
                runner.opened[1] = runner.opened[3] = True
        got, stats = P.run(model, x, model._dora.policy)
    runner = next(iter(model._dora.graphs.values()))
    res = {"inline": runner.triton_gate, "k_buffer": runner.k is not None, "opened": runner.opened, "ran": sorted(set(r for r in ran if r[1] is not None)), "max_diff": float((got - ref).abs().max()),
           "tokens": stats.tokens.tolist(), "ref_tokens": ref_stats.tokens.tolist(),
           "gate": stats.gate.tolist(), "ref_gate": ref_stats.gate.tolist()}
print(json.dumps(res))
"""


@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run these kernels")
@pytest.mark.parametrize("fused", [False, True], ids=["two_graphs", "fused_interventions"])
def test_interpreted_graph_path_with_the_actor_kernels_equals_the_default_forward(fused):
    """The CUDA-graph runner's actor path as it runs on an H100 (gate in line, only the open
    images' keys kept, fused controller, the prefix rows read out after a deletion, the next
    block's graph launched right behind the survivors' MLP), uncaptured on the CPU with the Triton
    kernels interpreted: the same logits, gates and token counts as the default forward; also with
    ``EngineOptions.fused_interventions`` (the controller in the attention's graph, reading the keys in
    place), including blocks guessed open where no gate opens."""
    res = run_interpreted(GRAPH_PATH.replace("__FUSED__", str(fused)), timeout=900)
    assert res["inline"] is True
    # fused: no kept-keys buffer (keys read in place; recomputed where a gate opened unexpectedly,
    # as in the first forward here)
    assert res["k_buffer"] is (not fused)
    # the gate opens at blocks 2, 5 and 8 only (blocks 1 and 3, guessed open, were corrected)
    assert [i for i, o in enumerate(res["opened"]) if o] == [2, 5, 8]
    controllers = sorted([kind, l] for kind, l in res["ran"] if "controller" in kind)
    if fused:  # every controller ran in its block's attention graph, also where guessed wrong
        assert controllers == [["attention_controller", 1], ["attention_controller", 2]] + [
            ["attention_packed_controller", l] for l in (3, 5, 8)]
    else:
        assert controllers == [["controller", l] for l in (2, 5, 8)]
    assert res["tokens"] == res["ref_tokens"] and res["gate"] == res["ref_gate"]
    assert res["tokens"][0] == [16, 16, 12, 12, 12, 8, 8, 8, 4, 4, 4, 4]
    assert res["max_diff"] < 1e-4


GATE_CONTEXT = r"""
import json
import torch
from timm_dora import Actor
from timm_dora.policy.actor_kernels import fused_gate_context

torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    actor = Actor(192, 12, 196).eval()
    with torch.no_grad():
        for prm in (actor.gate_embed, actor.gate_mlp[0].weight, actor.gate_mlp[0].bias):
            prm.add_(0.3 * torch.randn(prm.shape))
    actor = actor.to(dtype)
    b = 37  # three programs of 16 images, the last one part-full
    g = torch.Generator().manual_seed(1)
    n_visual = torch.randint(0, 197, (b,), generator=g)
    rho = torch.rand(b, generator=g)
    interventions = torch.randint(0, 12, (b,), generator=g)
    with torch.no_grad():
        h_ref = actor.history(n_visual, rho, interventions)
        ctx_ref = actor.gate_bias(h_ref, None, dtype)
        h, ctx = fused_gate_context(actor, n_visual, rho, interventions, 196, dtype)
        stale = (torch.full((b, 3), 7.0), torch.full((12, b, 64), 7.0, dtype=dtype))
        into = fused_gate_context(actor, n_visual, rho, interventions, 196, dtype, out=stale)
    diff = (ctx.float() - ctx_ref.float()).abs()
    # the order of the sums differs (and on the CPU, bf16's F.linear rounds before adding its bias,
    # where the kernel, as cuBLAS, rounds once): within a few units of the last place of the
    # largest value, for fp32 within 4, for bf16 within 2
    tol = (2 if dtype == torch.bfloat16 else 4) * torch.finfo(dtype).eps * float(ctx_ref.float().abs().max())
    # (h: the kernel divides as PyTorch does on CUDA, times the float32 reciprocal; on the CPU
    # PyTorch divides exactly: within a unit of the last place)
    out[str(dtype)] = {"h_equal": bool(torch.allclose(h, h_ref, rtol=2 ** -23, atol=0)), "shape": list(ctx.shape),
                       "dtype": str(ctx.dtype),
                       "within_ulp": bool((diff <= tol).all()), "equal_share": float((diff == 0).float().mean()),
                       "into": bool(into[0] is stale[0] and into[1] is stale[1] and torch.equal(stale[1], ctx)
                                    and torch.equal(stale[0], h))}
# the gate reading each image's CLS row of a packed layout in place equals it on the gathered rows
from timm_dora.policy.actor_kernels import fused_gate
actor = Actor(192, 12, 196).eval()
with torch.no_grad():
    actor.gate_mlp[2].bias.zero_()
g = torch.Generator().manual_seed(3)
packed = 3 * torch.randn(400, 3, 64, generator=g)  # [T, H, hd] rows of 24 sequences
starts = torch.arange(24, dtype=torch.int32) * 16 + torch.randint(0, 10, (24,), generator=g, dtype=torch.int32)
n_visual = torch.randint(5, 100, (24,), generator=g)
n_visual[2] = 0
with torch.no_grad():
    bias = actor.gate_bias(actor.history(n_visual, torch.zeros(24), torch.zeros(24)), 2, torch.float32).contiguous()
    ref = fused_gate(actor, packed[starts.long()], bias, n_visual)
    got = fused_gate(actor, packed, bias, n_visual, rows=starts)
    got2 = fused_gate(actor, packed.reshape(400, 192), bias, n_visual, rows=starts.long())
out["rows"] = {"equal": bool(torch.equal(ref, got) and torch.equal(ref, got2)), "gate": ref.tolist()}
print(json.dumps(out))
"""


@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run these kernels")
def test_interpreted_gate_context_equals_history_and_gate_bias():
    res = run_interpreted(GATE_CONTEXT, timeout=300)
    rows = res.pop("rows")
    assert rows["equal"] and rows["gate"][2] is False, rows  # (image 2 has no feasible budget)
    assert 3 <= sum(rows["gate"]) <= 20, rows  # some gates open, some closed
    for dtype, case in res.items():
        assert case["h_equal"] and case["into"], (dtype, case)
        assert case["shape"] == [12, 37, 64] and case["dtype"] == dtype, case
        assert case["within_ulp"] and case["equal_share"] >= 0.15, (dtype, case)


def test_fused_gate_context_refuses_bad_buffers():
    from timm_dora.policy.actor_kernels import fused_gate_context

    actor = Actor(192, 12, 196)
    z = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="must be a contiguous float32"):
        fused_gate_context(actor, z, z.float(), z, 196, torch.float32, out=(torch.zeros(4, 2), torch.zeros(12, 4, 64)))
    with pytest.raises(ValueError, match="activations' dtype"):
        fused_gate_context(actor, z, z.float(), z, 196, torch.bfloat16)
