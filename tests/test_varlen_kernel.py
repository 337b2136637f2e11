"""The Triton varlen attention kernel (``timm_dora.engine.varlen_kernel``, the ``triton`` backend).

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the
kernel is defined, so in a subprocess) and is compared with one SDPA call per sequence; on CUDA
the compiled kernel is compared in bf16 with the same reference, also replayed from a CUDA graph
after the sequence lengths changed in place.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import capture_graph, run_interpreted, triton_version
from timm_dora.engine.attention import select_backend, varlen_attention
from timm_dora.engine.packing import Packed

pytest.importorskip("triton")  # a dependency of torch's CUDA wheels (the CI's PyPI torch)

INTERPRETED = r"""
import json, sys
import torch
import torch.nn.functional as F
from timm_dora.engine.varlen_kernel import varlen_attention_triton

def reference(q, k, v, cu, scale, sizes=None):
    b = cu.tolist()
    mask = [None if sizes is None else sizes[s:e].log() for s, e in zip(b[:-1], b[1:])]
    return torch.cat([F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), attn_mask=m,
                                                     scale=scale).transpose(0, 1)
                      for s, e, m in zip(b[:-1], b[1:], mask)])

out = {}
torch.manual_seed(0)
for name, heads, hd, lengths, tile in (
    ("default_tiles", 3, 64, [5, 70, 1, 130, 64], None),
    ("small_tiles", 2, 32, [33, 1, 17, 64, 65], (16, 16, 1, 1)),  # several query and key tiles
):
    lengths = torch.tensor(lengths)
    t = int(lengths.sum())
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    qkv = torch.randn(t + 7, 3, heads, hd)  # views of one fused projection, 7 padded rows
    qkv[t:] = float("nan")  # the kernel must never read past cu_seqlens[-1]
    q, k, v = qkv.unbind(1)
    scale = 0.3
    got = varlen_attention_triton(q, k, v, cu, 197, scale, tile=tile)[:t]
    ref = reference(q[:t], k[:t], v[:t], cu, scale)
    out[name] = {"max_abs_diff": float((got - ref).abs().max()), "finite": bool(torch.isfinite(got).all()),
                 "shape": list(got.shape)}
    # new lengths written into the same cu_seqlens tensor (as a replayed CUDA graph sees them)
    flipped = F.pad(lengths.flip(0).cumsum(0), (1, 0)).to(torch.int32)
    cu.copy_(flipped)
    got2 = varlen_attention_triton(q, k, v, cu, 197, scale, tile=tile)[:t]
    out[name]["new_lengths_max_abs_diff"] = float((got2 - reference(q[:t], k[:t], v[:t], cu, scale)).abs().max())
    # merged keys: log(size) added to their logits (sizes past the rows hold NaN: never read)
    sizes = torch.cat([torch.randint(1, 6, (t,)).float(), torch.full((7,), float("nan"))])
    got3 = varlen_attention_triton(q, k, v, cu, 197, scale, tile=tile, sizes=sizes)[:t]
    out[name]["sizes_max_abs_diff"] = float((got3 - reference(q[:t], k[:t], v[:t], cu, scale, sizes[:t])).abs().max())
    out[name]["sizes_change_it"] = float((got3 - got2).abs().max())
print(json.dumps(out))
"""


# Triton 3.6's interpreter keeps a scalar loaded from memory as a one-element array and cannot use
# it as a loop bound (the compiled kernel can: the CUDA test below); 3.9 (the CI's) can
@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run this kernel")
def test_interpreted_kernel_matches_per_sequence_sdpa():
    res = run_interpreted(INTERPRETED, timeout=300)
    assert res["default_tiles"]["shape"] == [270, 3, 64]
    assert res["small_tiles"]["shape"] == [180, 2, 32]
    for case in res.values():
        assert case["finite"]  # the NaN rows past the last sequence were never read
        assert case["max_abs_diff"] < 1e-5
        assert case["new_lengths_max_abs_diff"] < 1e-5
        assert case["sizes_max_abs_diff"] < 1e-5 and case["sizes_change_it"] > 1e-2


COMPILED_OP = r"""
import json
import torch
import torch.nn.functional as F
from timm_dora.engine.varlen_kernel import varlen_attention_op, varlen_attention_triton

torch.manual_seed(0)
lengths = torch.tensor([5, 70, 1, 33])
t = int(lengths.sum())
cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
q, k, v = torch.randn(3, t, 2, 64).unbind(0)
sizes = torch.arange(t).remainder(3).float() + 1
direct = varlen_attention_triton(q, k, v, cu, 70, 0.3)
merged = varlen_attention_triton(q, k, v, cu, 70, 0.3, sizes=sizes)
# fullgraph: Dynamo must take the op whole (a graph break or a trace into the Triton launch fails)
compiled = torch.compile(lambda q, k, v, cu: torch.ops.timm_dora.varlen_attention(q, k, v, cu, 70, 0.3) * 2,
                         backend="aot_eager", fullgraph=True)(q, k, v, cu)
compiled_sizes = torch.compile(lambda q, k, v, cu, s: torch.ops.timm_dora.varlen_attention(q, k, v, cu, 70, 0.3, s),
                               backend="aot_eager", fullgraph=True)(q, k, v, cu, sizes)
for args in ((q, k, v, cu, 70, 0.3), (q, k, v, cu, 70, 0.3, sizes)):
    torch.library.opcheck(varlen_attention_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
print(json.dumps({"max_abs_diff": float((compiled - 2 * direct).abs().max()), "shape": list(compiled.shape),
                  "sizes_max_abs_diff": float((compiled_sizes - merged).abs().max())}))
"""


@pytest.mark.skipif(triton_version() < (3, 8), reason="Triton's interpreter before 3.8 cannot run this kernel here")
def test_custom_op_compiles_as_one_opaque_op():
    """``torch.ops.timm_dora.varlen_attention`` (what a compiled wrapped model calls): traced by
    ``torch.compile(fullgraph=True)`` without a graph break, equal to the kernel called directly,
    and its schema and fake implementation pass ``torch.library.opcheck``."""
    res = run_interpreted(COMPILED_OP, timeout=300)
    assert res["shape"] == [109, 2, 64]
    assert res["max_abs_diff"] == 0.0 and res["sizes_max_abs_diff"] == 0.0


def test_kernel_input_errors():
    from timm_dora.engine.varlen_kernel import varlen_attention_triton

    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dims"):
        varlen_attention_triton(*(torch.zeros(4, 2, 48) for _ in range(3)), cu, 4, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        varlen_attention_triton(torch.zeros(4, 2, 64), torch.zeros(4, 2, 64), torch.zeros(5, 2, 64), cu, 4, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        varlen_attention_triton(*(torch.zeros(4, 64, 2).transpose(1, 2) for _ in range(3)), cu, 4, 1.0)
    with pytest.raises(ValueError, match="sizes must be a contiguous float32"):
        varlen_attention_triton(*(torch.zeros(4, 2, 64) for _ in range(3)), cu, 4, 1.0, sizes=torch.ones(3))


def test_triton_backend_refused_off_cuda():
    with pytest.raises(ValueError, match=r"^attention backend 'triton' cannot run on device 'cpu' with torch.bfloat16: "
                                         r"it needs the triton package, CUDA and fp16/bf16$"):
        select_backend("cpu", torch.bfloat16, "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_reference_and_replays_from_a_graph():
    from timm_dora.engine.varlen_kernel import varlen_attention_triton

    torch.manual_seed(0)
    dev = "cuda"
    lengths = torch.tensor([197, 1, 90, 142, 64, 65, 128, 129])
    t = int(lengths.sum())
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(dev, torch.int32)
    for heads, hd in ((3, 64), (4, 32), (2, 128)):
        qkv = torch.randn(t + 40, 3, heads, hd, device=dev, dtype=torch.bfloat16)
        q, k, v = qkv.unbind(1)
        packed = Packed(torch.zeros(t, 1, device=dev), lengths.to(dev), lengths.tolist(), num_prefix=1)
        ref = varlen_attention(q[:t].float(), k[:t].float(), v[:t].float(), packed, hd ** -0.5, "sdpa_loop")
        got = varlen_attention(q, k, v, packed, hd ** -0.5, "triton")[:t]
        assert (got.float() - ref).abs().max() < 2e-2
        # captured once, replayed with the lengths reversed in the same cu_seqlens buffer
        cu_buf = cu.clone()
        g, captured = capture_graph(lambda: varlen_attention_triton(q, k, v, cu_buf, 197, hd ** -0.5))
        flipped = lengths.flip(0)
        cu_buf.copy_(F.pad(flipped.cumsum(0), (1, 0)).to(dev, torch.int32))
        g.replay()
        packed2 = Packed(torch.zeros(t, 1, device=dev), flipped.to(dev), flipped.tolist(), num_prefix=1)
        ref2 = varlen_attention(q[:t].float(), k[:t].float(), v[:t].float(), packed2, hd ** -0.5, "sdpa_loop")
        assert (captured[:t].float() - ref2).abs().max() < 2e-2
        # merged keys (sizes on the device, read in the kernel) against the padded SDPA with a log-size mask
        sizes = torch.randint(1, 6, (t + 40,), device=dev).float()
        packed3 = Packed(torch.zeros(t, 1, device=dev), lengths.to(dev), lengths.tolist(), num_prefix=1, sizes=sizes[:t])
        ref3 = varlen_attention(q[:t].float(), k[:t].float(), v[:t].float(), packed3, hd ** -0.5, "padded")
        got3 = varlen_attention(q[:t], k[:t], v[:t], packed3, hd ** -0.5, "triton")
        assert (got3.float() - ref3).abs().max() < 2e-2 and (ref3 - ref).abs().max() > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_backend_keeps_gradients():
    """The kernel is forward-only: inputs that need a gradient take the FlashAttention-2 kernel,
    whose backward gives the reference's gradients (nothing silently detached)."""
    torch.manual_seed(0)
    lengths = torch.tensor([5, 70, 33])
    t = int(lengths.sum())
    packed = Packed(torch.zeros(t, 1, device="cuda"), lengths.cuda(), lengths.tolist(), num_prefix=1)
    q, k, v = (torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, packed, 0.125, "triton")
    assert out.requires_grad
    out.float().square().sum().backward()
    grads = [x.grad.float() for x in (q, k, v)]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    varlen_attention(*ref_in, packed, 0.125, "sdpa_loop").square().sum().backward()
    for g, r in zip(grads, ref_in):
        assert (g - r.grad).abs().max() < 5e-2 * r.grad.abs().max()
