"""Faster kernels for three dense parts of the block program, on CUDA in fp16/bf16.

Measured on an H100 (ViT-Ti, batch 320, bf16; ``docs/performance.md``), two of timm's dense
operations cost far more than the bytes they move:

- **LayerNorm.** ATen's kernel takes about 85 us per call on ``[63040, 192]`` rows (1.4 of DORA's
  6.3 ms of kernel time per batch): :func:`layer_norm` is a Triton kernel that normalises several
  rows per program, in fp32, for any width up to 8,192.
- **The patch embedding.** cuDNN runs the 16x16/16 convolution with a generic implicit-GEMM
  kernel (about 1 ms per batch): :func:`patch_embed` computes the same product as one matrix
  multiplication over the image's non-overlapping patches (a copy that lays the patches out as
  rows, then ``addmm``).

- **The MLP residual of a narrow model** (``x + mlp(norm2(x))``, width up to 256: ViT-Ti's 192).
  Unfused, its hidden activations (4d per row) go to memory twice: written by ``fc1``, read and
  written again by GELU (0.55 of 4.1 ms of kernels per batch), read by ``fc2``.
  :func:`norm_mlp_residual` is one Triton kernel per row tile: LayerNorm, ``fc1`` + bias, GELU
  (erf, as ``nn.GELU``) and ``fc2`` over the hidden units in chunks that never leave the chip, plus
  bias and residual; each stage rounded to the activations' dtype where the modules' outputs are.

All give timm's values up to rounding (fp32 accumulation either way) and take the module's own
parameters (``norm.weight``, ``proj.weight``...): nothing of timm's forward is copied. Anywhere
else (the CPU, fp32, other norms, embeddings or MLPs, autograd) the modules themselves run.
:data:`ENABLED` switches all off (the A/B of ``benchmarks/default_speed.py``:
``dora_default_timm_kernels_ips``); :data:`FUSED_MLP` the MLP kernel alone.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["layer_norm", "layer_norm_triton", "patch_embed", "patch_embed_gemm", "norm_mlp_residual",
           "norm_mlp_residual_triton", "ENABLED", "FUSED_MLP", "MLP_LAUNCH"]

ENABLED = True
FUSED_MLP = True
# the MLP kernel's launch: rows per program, hidden units per step, warps, Triton stages (fixed, so
# that a call inside a CUDA-graph capture never autotunes; module constants for benchmarks to sweep)
MLP_LAUNCH = dict(rows=64, chunk=64, num_warps=8, num_stages=2)
MLP_MAX_WIDTH = 256  # the fused MLP keeps a [rows, width] fp32 accumulator in registers

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
    def _layer_norm_fwd(X, W, B, Y, rows, n, stride_x, stride_y, eps,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_N)
        mask = (row[:, None] < rows) & (col[None, :] < n)
        x = tl.load(X + row[:, None].to(tl.int64) * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / n
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n + eps)
        w = tl.load(W + col, mask=col < n, other=0.0).to(tl.float32)
        b = tl.load(B + col, mask=col < n, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(Y + row[:, None].to(tl.int64) * stride_y + col[None, :], y.to(Y.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """Rounded to the activations' dtype and back to fp32 (where an ``nn`` module's output is)."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _gelu(x):
        """GELU with the error function, as ``nn.GELU()`` (fp32)."""
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _norm_mlp_residual(X, G, BN, W1, B1, W2, B2, OUT, rows, stride_x, stride_o, eps,
                           D: tl.constexpr, BD: tl.constexpr, F: tl.constexpr, FCH: tl.constexpr,
                           BLOCK_R: tl.constexpr, PREC: tl.constexpr):
        """``OUT = X + fc2(gelu(fc1(LN(X))))`` for one tile of ``BLOCK_R`` rows; the width ``D``
        padded to ``BD`` (a power of two) with zeros, the ``F`` hidden units in chunks of ``FCH``.
        Each program reads all its rows before it writes any, so ``OUT`` may be ``X``."""
        DT = OUT.dtype.element_ty
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        r64 = r.to(tl.int64)
        cols = tl.arange(0, BD)
        inside = cols < D
        m2 = live[:, None] & inside[None, :]
        x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.sum(x, 1) / D
        xc = tl.where(inside[None, :], x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + eps)
        g = tl.load(G + cols, mask=inside, other=0.0).to(tl.float32)
        bn = tl.load(BN + cols, mask=inside, other=0.0).to(tl.float32)
        ln = (xc * rstd[:, None] * g[None, :] + bn[None, :]).to(DT)  # norm2's output
        acc = tl.zeros([BLOCK_R, BD], dtype=tl.float32)
        for f0 in range(0, F, FCH):
            fs = f0 + tl.arange(0, FCH)
            fin = fs < F
            w1 = tl.load(W1 + fs[:, None] * D + cols[None, :], mask=fin[:, None] & inside[None, :], other=0.0)
            h = tl.dot(ln, tl.trans(w1), input_precision=PREC) + tl.load(B1 + fs, mask=fin, other=0.0).to(tl.float32)[None, :]
            h = _round(_gelu(_round(h, DT)), DT).to(DT)  # fc1's output, then GELU's
            w2 = tl.load(W2 + cols[:, None] * F + fs[None, :], mask=inside[:, None] & fin[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w2), acc, input_precision=PREC)
        mlp = _round(acc + tl.load(B2 + cols, mask=inside, other=0.0).to(tl.float32)[None, :], DT)  # fc2's output
        tl.store(OUT + r64[:, None] * stride_o + cols[None, :], (x + mlp).to(DT), mask=m2)


def _mlp_modules(blk: nn.Module):
    """``(norm2, fc1, fc2)`` when ``blk``'s MLP residual is exactly ``x + fc2(gelu(fc1(norm2(x))))``
    in this mode (timm's ``Mlp`` with an erf GELU, no norm inside, dropout and drop path inactive,
    no layer scale; plain affine LayerNorm; biases on both layers), else ``None``."""
    try:
        from timm.layers import Mlp
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    mlp, norm = getattr(blk, "mlp", None), getattr(blk, "norm2", None)
    if type(mlp) is not Mlp or norm is None or type(norm).forward not in _PLAIN_LAYER_NORMS:
        return None
    act = mlp.act
    if not (type(act) is nn.GELU and act.approximate == "none" and type(mlp.norm) is nn.Identity):
        return None
    if any(type(m) is nn.Dropout and m.training and m.p > 0 for m in (mlp.drop1, mlp.drop2)):
        return None
    if type(getattr(blk, "ls2", None)) is not nn.Identity:
        return None
    dp = getattr(blk, "drop_path2", None)
    if dp is None or not (type(dp) is nn.Identity or not dp.training or getattr(dp, "drop_prob", 1.0) == 0.0):
        return None
    fc1, fc2 = mlp.fc1, mlp.fc2
    if not (type(fc1) is nn.Linear and type(fc2) is nn.Linear and fc1.bias is not None and fc2.bias is not None
            and norm.elementwise_affine and norm.bias is not None and len(norm.normalized_shape) == 1):
        return None
    return norm, fc1, fc2


def norm_mlp_residual(blk: nn.Module, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``x + mlp(norm2(x))`` by the fused kernel (into ``out`` when given; ``out`` may be ``x``) for
    ``[rows, d]`` half-precision CUDA rows of a block whose MLP residual it computes exactly
    (:func:`_mlp_modules`) at ``d <= 256``; ``None`` where it does not apply (the caller runs the
    modules)."""
    if not (FUSED_MLP and _fast(x) and x.dim() == 2 and x.shape[1] <= MLP_MAX_WIDTH and x.stride(1) == 1
            and not torch.compiler.is_compiling()):  # under torch.compile Inductor fuses the modules itself
        return None
    mods = _mlp_modules(blk)
    if mods is None:
        return None
    norm, fc1, fc2 = mods
    if not all(t.dtype == x.dtype and t.is_contiguous() for t in (norm.weight, fc1.weight, fc2.weight)):
        return None
    return norm_mlp_residual_triton(x, norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                                    out)


def norm_mlp_residual_triton(x, norm_weight, norm_bias, eps, w1, b1, w2, b2, out=None) -> torch.Tensor:
    """The fused kernel on ``[rows, d]`` rows ``x`` (any device Triton runs on: the CPU tests use
    its interpreter, with fp32 rows computed exactly)."""
    rows, d = x.shape
    hidden = w1.shape[0]
    if out is None:
        out = torch.empty_like(x)
    if rows:
        launch = MLP_LAUNCH
        _norm_mlp_residual[(triton.cdiv(rows, launch["rows"]),)](
            x, norm_weight, norm_bias, w1, b1, w2, b2, out, rows, x.stride(0), out.stride(0), eps,
            D=d, BD=triton.next_power_of_2(d), F=hidden, FCH=launch["chunk"], BLOCK_R=launch["rows"],
            PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"],
            num_stages=launch["num_stages"])
    return out


def _fast(x: torch.Tensor) -> bool:
    return (ENABLED and triton is not None and x.is_cuda and x.dtype in _HALF
            and not (torch.is_grad_enabled() and x.requires_grad))


def layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; for an affine ``nn.LayerNorm`` over the last dimension of a half-precision CUDA
    tensor (rows of unit stride), the Triton kernel."""
    if not (_fast(x) and type(norm).forward in _PLAIN_LAYER_NORMS and norm.elementwise_affine and norm.bias is not None
            and len(norm.normalized_shape) == 1 and x.shape[-1] <= 8192 and x.stride(-1) == 1
            and norm.weight.dtype == x.dtype):
        return norm(x)
    return layer_norm_triton(x, norm.weight, norm.bias, norm.eps)


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
    capture never autotunes. About 8K elements a program, 8 warps: on an H100, ``[63040, 192]`` bf16
    rows in 28 us (ATen's kernel: 84), ``[63040, 768]`` in 71 us (132), among 35 configurations."""
    per = max(1, min(32, 8192 // block_n))
    return per, 8 if per * block_n >= 8192 else 4


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
