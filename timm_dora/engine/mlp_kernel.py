"""The MLP's first layer and its GELU in one Triton kernel (``EngineOptions.fused_gelu``).

timm's ``Mlp`` runs ``fc1`` (a cuBLAS GEMM that writes ``[rows, hidden]``), then ``nn.GELU`` as an
ATen elementwise kernel that reads that output back and writes it again. Here the product's tile
stays in registers: ``gelu(x @ W^T + b)`` with the linear layer's output rounded to the dtype first,
as ``F.linear`` returns it, then the exact (erf) GELU in float32, rounded as ``nn.GELU``'s output
is. So the values are timm's up to the order of the products' float32 sums.

It pays where a request is short: at 1-16 images of a Tiny backbone the kernel is as fast as the
two it replaces or faster, and each block's graph has one node fewer, which a host launching the
graph feels (one H200: merging DeiT-Ti requests 10 % faster at one image). At large batches and at
Base widths cuBLAS's GEMM is the faster product, so the engine fuses only up to :data:`MAX_ROWS`
rows and :data:`MAX_IN_FEATURES` columns in (the measurements by the constants below).

:func:`mlp_forward` composes the rest from timm's own submodules (``drop1``, ``norm``, ``fc2``,
``drop2``), where :func:`fused_gelu_applies`; anywhere else it calls the module. Off CUDA the kernel
runs in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU tests check it.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .options import active

__all__ = ["fused_gelu_applies", "linear_gelu", "mlp_forward", "tile_for", "TILES", "MAX_IN_FEATURES", "MAX_ROWS"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

# (most rows, tile) in order, a tile being (rows, columns, reduction block, warps, stages, row tiles
# grouped for the L2) per program: the first entry whose bound holds; fixed, so that a call inside a
# CUDA-graph capture never autotunes. Chosen on one H200 at 192 -> 768 (``small_kernels --gelu``,
# benchmarks/results/gelu_tiles_h200.json.gz, us a call in a CUDA graph): 3.3 against ATen's 4.6 at
# one image (197 rows), 3.6 / 4.7 / 5.9 against 5.5 / 5.5 / 6.6 at 2 / 4 / 8, 9.3 against 8.8 at 16
TILES = ((256, (32, 32, 64, 2, 3, 8)), (1 << 62, (64, 64, 64, 4, 3, 8)))
# the engine fuses up to this many rows (16 images of 197, where the kernel is 0.5 us slower than
# ATen's two but saves a graph node). Above it cuBLAS's GEMM and ATen's GELU win: 14.9 against 14.5
# us at 32 images, 121 against 112 at 320; the fused kernel everywhere added 260 us to a 3.76 ms
# forward of 320 DeiT-Ti images (benchmarks/results/planned_large_gelu_h200.json)
MAX_ROWS = 4096
# and only as wide as measured: at 768 -> 3072 (DeiT-B) the kernel was slower at every row count,
# 7.5 against 7.0 us at one image, 48.6 against 36.8 at 16
MAX_IN_FEATURES = 192
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
    :func:`tile_for`'s fields instead, for benchmarks."""
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
        bm, bn, bk, warps, stages, group = tile or tile_for(m)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _linear_gelu[grid](x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0),
                           y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                           num_warps=warps, num_stages=stages)
    return y


def tile_for(rows: int) -> tuple:
    """The tile of :data:`TILES` for ``rows`` rows."""
    return next(tile for most, tile in TILES if rows <= most)


def fused_gelu_applies(mlp: nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`mlp_forward` runs ``mlp``'s first layer and GELU as :func:`linear_gelu`:
    ``EngineOptions.fused_gelu``, a timm ``Mlp`` whose activation is an exact ``nn.GELU`` and whose
    ``fc1`` is a plain ``nn.Linear`` of ``x``'s dtype at most :data:`MAX_IN_FEATURES` wide, on a
    half-precision CUDA batch of at most :data:`MAX_ROWS` rows (unit column stride) that carries no
    gradient."""
    fc1, act = getattr(mlp, "fc1", None), getattr(mlp, "act", None)
    return (active().fused_gelu and triton is not None and x.is_cuda and x.dtype in _HALF and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and not (torch.is_grad_enabled() and x.requires_grad)
            and type(mlp).forward is _TIMM_MLP_FORWARD and type(fc1) is nn.Linear
            and fc1.in_features <= MAX_IN_FEATURES and type(act) is nn.GELU and act.approximate == "none"
            and fc1.weight.dtype == x.dtype and fc1.weight.is_contiguous())


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)``; where :func:`fused_gelu_applies`, its ``fc1`` and GELU as one kernel, then its own
    ``drop1``, ``norm``, ``fc2`` and ``drop2`` (timm's ``Mlp.forward`` in that order)."""
    if not fused_gelu_applies(mlp, x):
        return mlp(x)
    hidden = linear_gelu(x, mlp.fc1.weight, mlp.fc1.bias)
    return mlp.drop2(mlp.fc2(mlp.norm(mlp.drop1(hidden))))
