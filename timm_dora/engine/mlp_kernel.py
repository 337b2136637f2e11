"""The MLP's first layer and its GELU in one Triton kernel (``EngineOptions.fused_gelu``).

timm's ``Mlp`` runs ``fc1`` (a cuBLAS GEMM that writes ``[rows, hidden]``), then ``nn.GELU`` as an
ATen elementwise kernel that reads that output back and writes it again. In a DeiT-Ti forward of
320 images on an H200 the GELU alone took 498 us of 3.74 ms of kernels, 66 us a dense block, about
a third of the memory's bandwidth (``benchmarks/results/kernel_timeline_deit_tiny_h200.json.gz``);
the compiled native model runs it as an Inductor kernel. Here the product's tile stays in registers:
``gelu(x @ W^T + b)`` with the linear layer's output rounded to the dtype first, as ``F.linear``
returns it, then the exact (erf) GELU in float32, rounded as ``nn.GELU``'s output is. So the values
are timm's up to the order of the products' float32 sums.

:func:`mlp_forward` composes the rest from timm's own submodules (``drop1``, ``norm``, ``fc2``,
``drop2``), where the module is a timm ``Mlp`` with an exact ``nn.GELU`` on a half-precision CUDA
batch without autograd; anywhere else it calls the module. Off by default until measured on a GPU
(``benchmarks/small_kernels.py --gelu``): the tiles below are a first guess. Off CUDA the kernel
runs in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU tests check it.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .options import active

__all__ = ["fused_gelu_applies", "linear_gelu", "mlp_forward", "TILE"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

# (rows, columns, reduction block, warps, stages, row tiles grouped for the L2) per program; fixed
# so that a call inside a CUDA-graph capture never autotunes (not yet chosen by a sweep)
TILE = (128, 128, 64, 8, 3, 8)
_HALF = (torch.float16, torch.bfloat16)
try:
    from timm.layers import Mlp as _TimmMlp
    _TIMM_MLP_FORWARD = _TimmMlp.forward
except ImportError:  # pragma: no cover - timm is a dependency
    _TIMM_MLP_FORWARD = None


if triton is not None:

    @triton.jit
    def _linear_gelu(X, W, B, Y, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        # GROUP_M row tiles walk the columns together, so that their rows stay in the L2
        group = GROUP_M * tiles_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(X + rm[:, None].to(tl.int64) * stride_x + ks[None, :],
                        mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :].to(tl.int64) * stride_w + ks[:, None],
                        mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]: W's rows as columns
            acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        h = acc.to(Y.dtype.element_ty).to(tl.float32)  # the linear layer's output, rounded as F.linear's
        g = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
        tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], g.to(Y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: "torch.Tensor | None" = None,
                tile: "tuple | None" = None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias))`` (exact GELU) in one kernel: ``x`` ``[rows, in]`` with unit
    column stride, ``weight`` ``[out, in]`` contiguous, ``bias`` ``[out]``, one dtype; returns
    ``[rows, out]`` (any device Triton runs on: the CPU tests use its interpreter). ``tile``:
    :data:`TILE`'s fields instead, for benchmarks."""
    if triton is None:
        raise RuntimeError("linear_gelu needs the triton package")
    if x.dim() != 2 or x.stride(1) != 1 or weight.dim() != 2 or not weight.is_contiguous() \
            or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype \
            or (bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype)):
        raise ValueError(f"linear_gelu: x [rows, in] (unit column stride), weight [out, in] contiguous and bias "
                         f"[out] of one dtype expected, got {x.dtype} {tuple(x.shape)}, {weight.dtype} "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages, group = tile or TILE
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _linear_gelu[grid](x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0),
                           y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                           num_warps=warps, num_stages=stages)
    return y


def fused_gelu_applies(mlp: nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`mlp_forward` runs ``mlp``'s first layer and GELU as :func:`linear_gelu`:
    ``EngineOptions.fused_gelu``, a timm ``Mlp`` whose activation is an exact ``nn.GELU`` and whose
    ``fc1`` is a plain ``nn.Linear`` of ``x``'s dtype, on a half-precision CUDA batch of rows (unit
    column stride) that carries no gradient."""
    fc1, act = getattr(mlp, "fc1", None), getattr(mlp, "act", None)
    return (active().fused_gelu and triton is not None and x.is_cuda and x.dtype in _HALF and x.dim() == 2
            and x.stride(1) == 1 and not (torch.is_grad_enabled() and x.requires_grad)
            and type(mlp).forward is _TIMM_MLP_FORWARD and type(fc1) is nn.Linear and type(act) is nn.GELU
            and act.approximate == "none" and fc1.weight.dtype == x.dtype and fc1.weight.is_contiguous())


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)``; where :func:`fused_gelu_applies`, its ``fc1`` and GELU as one kernel, then its own
    ``drop1``, ``norm``, ``fc2`` and ``drop2`` (timm's ``Mlp.forward`` in that order)."""
    if not fused_gelu_applies(mlp, x):
        return mlp(x)
    hidden = linear_gelu(x, mlp.fc1.weight, mlp.fc1.bias)
    return mlp.drop2(mlp.fc2(mlp.norm(mlp.drop1(hidden))))
