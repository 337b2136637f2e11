"""Faster kernels for two dense parts of the block program, on CUDA in fp16/bf16.

Measured on an H100 (ViT-Ti, batch 320, bf16; ``docs/performance.md``), two of timm's dense
operations cost far more than the bytes they move:

- **LayerNorm.** ATen's kernel takes about 85 us per call on ``[63040, 192]`` rows (1.4 of DORA's
  6.3 ms of kernel time per batch): :func:`layer_norm` is a Triton kernel that normalises several
  rows per program, in fp32, for any width up to 8,192.
- **The patch embedding.** cuDNN runs the 16x16/16 convolution with a generic implicit-GEMM
  kernel (about 1 ms per batch): :func:`patch_embed` computes the same product as one matrix
  multiplication over the image's non-overlapping patches (a copy that lays the patches out as
  rows, then ``addmm``).

Both give timm's values up to rounding (fp32 accumulation either way) and take the module's own
parameters (``norm.weight``, ``proj.weight``...): nothing of timm's forward is copied. Anywhere
else (the CPU, fp32, other norms or embeddings, autograd) the module itself runs. ``EngineOptions(dense_kernels=False)``
switches both off (the A/B of ``benchmarks/default_speed.py``: ``dora_default_timm_kernels_ips``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .options import active

__all__ = ["layer_norm", "layer_norm_triton", "add_layer_norm", "add_layer_norm_triton", "patch_embed", "patch_embed_gemm"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

_HALF = (torch.float16, torch.bfloat16)


def _plain_layer_norms() -> tuple:
    """The forwards that compute exactly ``F.layer_norm`` with the module's parameters: torch's and
    timm's ``LayerNorm`` (whose optional "fast norm" is the same function by another kernel)."""
    forwards = [nn.LayerNorm.forward]
    try:
        from timm.layers import LayerNorm
        forwards.append(LayerNorm.forward)
    except ImportError:  # pragma: no cover - timm is a dependency
        pass
    return tuple(forwards)


_PLAIN_LAYER_NORMS = _plain_layer_norms()


if triton is not None:

    @triton.jit
    def _normalized(x, mask, col, W, B, n, eps):
        """LayerNorm of fp32 rows ``x`` (``[ROWS, BLOCK_N]``, ``mask`` the real entries): the
        arithmetic both kernels share."""
        mean = tl.sum(x, axis=1) / n
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n + eps)
        w = tl.load(W + col, mask=col < n, other=0.0).to(tl.float32)
        b = tl.load(B + col, mask=col < n, other=0.0).to(tl.float32)
        return xc * rstd[:, None] * w[None, :] + b[None, :]

    @triton.jit
    def _layer_norm_fwd(X, W, B, Y, rows, n, stride_x, stride_y, eps,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_N)
        mask = (row[:, None] < rows) & (col[None, :] < n)
        x = tl.load(X + row[:, None].to(tl.int64) * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _normalized(x, mask, col, W, B, n, eps)
        tl.store(Y + row[:, None].to(tl.int64) * stride_y + col[None, :], y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layer_norm_fwd(X, D, S, W, B, Y, rows, n, stride_x, stride_d, stride_s, stride_y, eps,
                            BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_N)
        mask = (row[:, None] < rows) & (col[None, :] < n)
        r64 = row[:, None].to(tl.int64)
        x = tl.load(X + r64 * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(D + r64 * stride_d + col[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(S.dtype.element_ty, fp_downcast_rounding="rtne")  # the residual sum, rounded as torch.add rounds it
        tl.store(S + r64 * stride_s + col[None, :], s, mask=mask)
        y = _normalized(s.to(tl.float32), mask, col, W, B, n, eps)
        tl.store(Y + r64 * stride_y + col[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _fast(x: torch.Tensor) -> bool:
    return (active().dense_kernels and triton is not None and x.is_cuda and x.dtype in _HALF
            and not (torch.is_grad_enabled() and x.requires_grad))


def _plain(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether the Triton kernels compute ``norm(x)``: an affine ``nn.LayerNorm`` over the last
    dimension of a half-precision CUDA tensor (rows of unit stride)."""
    return (_fast(x) and type(norm).forward in _PLAIN_LAYER_NORMS and norm.elementwise_affine and norm.bias is not None
            and len(norm.normalized_shape) == 1 and x.shape[-1] <= 8192 and x.stride(-1) == 1
            and norm.weight.dtype == x.dtype)


def layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; for an affine ``nn.LayerNorm`` over the last dimension of a half-precision CUDA
    tensor (rows of unit stride), the Triton kernel."""
    if not _plain(norm, x):
        return norm(x)
    return layer_norm_triton(x, norm.weight, norm.bias, norm.eps)


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor, norm: nn.Module, out: torch.Tensor,
                   normed: torch.Tensor) -> None:
    """A residual sum and the next LayerNorm of it: ``out = x + branch``, ``normed = norm(out)``
    (``[rows, d]`` each; ``out`` may be ``x``). Where :func:`layer_norm` runs the Triton kernel,
    one kernel (the sum rounded to the dtype before it is normalised, as the two operations
    round); else the two operations."""
    if not (_plain(norm, x) and x.dim() == 2 and branch.shape == x.shape == out.shape == normed.shape
            and branch.stride(-1) == out.stride(-1) == normed.stride(-1) == 1 and branch.dtype == x.dtype == out.dtype):
        torch.add(x, branch, out=out)
        normed.copy_(layer_norm(norm, out))
        return
    add_layer_norm_triton(x, branch, norm.weight, norm.bias, norm.eps, out, normed)


def add_layer_norm_triton(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          out: torch.Tensor, normed: torch.Tensor) -> None:
    """:func:`add_layer_norm`'s kernel on ``[rows, d]`` tensors of unit column stride (any device
    Triton runs on: the CPU tests use its interpreter)."""
    rows, n = x.shape
    if rows:
        block_n = triton.next_power_of_2(n)
        per, warps = _ln_config(block_n)
        _add_layer_norm_fwd[(triton.cdiv(rows, per),)](x, branch, out, weight, bias, normed, rows, n, x.stride(0),
                                                        branch.stride(0), out.stride(0), normed.stride(0), eps,
                                                        BLOCK_N=block_n, ROWS=per, num_warps=warps)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension by the Triton kernel (any device Triton runs on: the CPU
    tests use its interpreter)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block_n = triton.next_power_of_2(n)
        per, warps = _ln_config(block_n)
        _layer_norm_fwd[(triton.cdiv(rows, per),)](x2, weight, bias, y, rows, n, x2.stride(0), n, eps,
                                                    BLOCK_N=block_n, ROWS=per, num_warps=warps)
    return y.view(x.shape)


def _ln_config(block_n: int) -> tuple:
    """(rows per program, warps) for a padded width: fixed, so that a call inside a CUDA-graph
    capture never autotunes. About 1K elements a program, 4 warps (8 from a width of 2,048): on an
    H200, inside a CUDA graph, the fastest or within 3 % of it among 24 configurations at every
    row count measured, 197 to 63,040 rows of widths 192 and 768 (``benchmarks/small_kernels.py``,
    ``benchmarks/results/small_kernels_h200.json``: one image's ``[197, 192]`` residual sum and
    norm in 1.65 us, where 32 rows a program took 2.47; ``[63040, 768]`` in 92.9 us, against 95.4)."""
    return max(1, 1024 // block_n), 4 if block_n <= 1024 else 8


def patch_embed(embed: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """``embed(images)`` for timm's ``PatchEmbed``; for a non-overlapping convolution (kernel =
    stride, no padding) with flattened ``[B, N, d]`` output, on a half-precision CUDA batch whose
    size divides into patches, one matrix product over the patches laid out as rows."""
    proj = getattr(embed, "proj", None)
    if not (_fast(images) and type(proj) is nn.Conv2d and images.dim() == 4 and getattr(embed, "flatten", False)
            and proj.kernel_size == proj.stride and proj.padding == (0, 0) and proj.dilation == (1, 1)
            and proj.groups == 1 and type(getattr(embed, "norm", None)) is nn.Identity
            and not getattr(embed, "dynamic_img_pad", False) and proj.weight.dtype == images.dtype):
        return embed(images)
    h, w = images.shape[-2:]
    ph, pw = proj.kernel_size
    img = getattr(embed, "img_size", None)
    if h % ph or w % pw or (getattr(embed, "strict_img_size", False) and img is not None and (h, w) != tuple(img)):
        return embed(images)  # timm's own check and message
    return patch_embed_gemm(proj, images)


def patch_embed_gemm(proj: nn.Conv2d, images: torch.Tensor) -> torch.Tensor:
    """A non-overlapping ``proj`` convolution of ``images`` as ``[B, N, d]`` rows (``N`` patches in
    row-major order, as ``flatten(2).transpose(1, 2)`` gives them) by one matrix product."""
    b, c, h, w = images.shape
    ph, pw = proj.kernel_size
    gh, gw = h // ph, w // pw
    # [B, C, gh, ph, gw, pw] -> [B, gh, gw, C, ph, pw]: one row per patch, in the weight's (C, ph, pw) order
    rows = images.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * ph * pw)
    out = F.linear(rows, proj.weight.reshape(proj.out_channels, -1), proj.bias)
    return out.view(b, gh * gw, proj.out_channels)
