"""Faster kernels for two dense parts of the block program, on CUDA in fp16/bf16.

Measured on an H100 (ViT-Ti, batch 320, bf16; ``docs/performance.md``), two of timm's dense
operations cost far more than the bytes they move:

- **LayerNorm.** ATen's kernel takes about 85 us per call on ``[63040, 192]`` rows (1.4 of DORA's
  6.3 ms of kernel time per batch): :func:`layer_norm` is a Triton kernel that normalises several
  rows per program, in fp32, for any width up to 8,192.
- **The patch embedding.** cuDNN runs the 16x16/16 convolution with a generic implicit-GEMM
  kernel (about 1 ms per batch): :func:`patch_embed` computes the same product as one matrix
  multiplication over the image's non-overlapping patches (a Triton copy that lays the patches
  out as rows, :func:`patch_rows_triton`, then ``addmm``); :func:`position_tokens` then writes the
  prefix tokens and the patches plus their position embedding into the first block's input in one
  kernel, where timm's concatenation, sum and the copy took three.

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

__all__ = ["layer_norm", "layer_norm_triton", "add_layer_norm", "add_layer_norm_triton", "patch_embed",
           "patch_embed_gemm", "patch_rows", "patch_rows_triton", "position_tokens", "position_tokens_triton"]

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


    @triton.jit
    def _patch_rows(IMG, OUT, s_b, s_c, s_h, s_w, gh, gw, W, PH: tl.constexpr, PW: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
        """One channel of one strip of patches (``PH`` image rows) of one image, read row by row
        and written into the strip's ``gw`` patch rows at the channel's ``PH * PW`` columns."""
        pid, c = tl.program_id(0), tl.program_id(1)
        b, g = pid // gh, pid % gh
        i = tl.arange(0, BLOCK_H)[:, None]  # the pixel's row in its patch
        x = tl.arange(0, BLOCK_W)[None, :]  # its column in the image
        mask = (i < PH) & (x < W)
        src = IMG + b.to(tl.int64) * s_b + c.to(tl.int64) * s_c + (g * PH + i).to(tl.int64) * s_h + x * s_w
        v = tl.load(src, mask=mask)
        n_cols = tl.num_programs(1) * PH * PW
        row = (b.to(tl.int64) * gh + g) * gw + x // PW
        tl.store(OUT + row * n_cols + c * PH * PW + i * PW + x % PW, v, mask=mask)


    @triton.jit
    def _tokens(X, CLS, REG, POS, OUT, n, d, n_reg, HAS_CLS: tl.constexpr, HAS_POS: tl.constexpr,
                POS_PREFIX: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """``ROWS`` tokens of one image: the prefix (class, then register tokens) and the patches,
        each plus its position embedding (``POS_PREFIX``: the prefix has rows of it too), summed in
        fp32 and rounded once, as torch's half-precision add rounds."""
        b = tl.program_id(0)
        t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
        col = tl.arange(0, BLOCK_D)[None, :]
        p = HAS_CLS + n_reg
        m = (t < n + p) & (col < d)
        patch = t >= p
        # (each token chosen, not summed from masked loads: a -0.0 stays -0.0, as in torch.cat)
        v = tl.load(X + (b.to(tl.int64) * n + t - p) * d + col, mask=m & patch, other=0.0).to(tl.float32)
        r = tl.load(REG + (t - HAS_CLS) * d + col, mask=m & (t >= HAS_CLS) & (t < p), other=0.0).to(tl.float32)
        v = tl.where(patch, v, r)
        if HAS_CLS:
            v = tl.where(t == 0, tl.load(CLS + col + t * 0, mask=m & (t == 0), other=0.0).to(tl.float32), v)
        if HAS_POS:
            if POS_PREFIX:
                v += tl.load(POS + t * d + col, mask=m, other=0.0).to(tl.float32)
            else:
                v = tl.where(patch, v + tl.load(POS + (t - p) * d + col, mask=m & patch, other=0.0).to(tl.float32), v)
        tl.store(OUT + (b.to(tl.int64) * (n + p) + t) * d + col, v.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=m)


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
    b, _, h, w = images.shape
    ph, pw = proj.kernel_size
    rows = patch_rows_triton(images, ph, pw) if images.is_cuda and triton is not None else patch_rows(images, ph, pw)
    out = F.linear(rows, proj.weight.reshape(proj.out_channels, -1), proj.bias)
    return out.view(b, (h // ph) * (w // pw), proj.out_channels)


def patch_rows(images: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """``[B, C, H, W]`` images as ``[B * N, C * ph * pw]`` rows, one per non-overlapping ``ph x pw``
    patch (patches in row-major order; each row in a convolution weight's ``(C, ph, pw)`` order)."""
    b, c, h, w = images.shape
    gh, gw = h // ph, w // pw
    # [B, C, gh, ph, gw, pw] -> [B, gh, gw, C, ph, pw]
    return images.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * ph * pw)


def patch_rows_triton(images: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """:func:`patch_rows` by one Triton kernel (any device Triton runs on: the CPU tests use its
    interpreter). PyTorch's copy of the six-dimensional permutation took 96 us per batch of 320
    images on an H200, where this kernel moves the same bytes at about memory speed."""
    b, c, h, w = images.shape
    gh, gw = h // ph, w // pw
    out = torch.empty((b * gh * gw, c * ph * pw), dtype=images.dtype, device=images.device)
    if out.numel():
        _patch_rows[(b * gh, c)](images, out, *images.stride(), gh, gw, gw * pw, PH=ph, PW=pw,
                                 BLOCK_H=triton.next_power_of_2(ph), BLOCK_W=triton.next_power_of_2(gw * pw))
    return out


def position_tokens(model: nn.Module, patches: torch.Tensor, out: torch.Tensor) -> bool:
    """``out = norm_pre(patch_drop(_pos_embed(patches)))`` of a timm ``VisionTransformer`` by one
    kernel (the prefix tokens and the patch rows, each plus its position embedding) where that is
    what timm's forward computes: its own ``_pos_embed`` with a fixed-size position embedding (or
    none), no patch dropout or position dropout in effect, no ``norm_pre``, one dtype, a
    half-precision CUDA batch. Returns whether it ran; else ``out`` is untouched and the caller
    runs timm's modules. The three operations it replaces (the concatenation, the sum, the copy
    into the block input) each read and write the batch's tokens."""
    from timm.models.vision_transformer import VisionTransformer
    pos, cls, reg = (getattr(model, k, None) for k in ("pos_embed", "cls_token", "reg_token"))
    params = [t for t in (pos, cls, reg) if t is not None]
    drops = (model.patch_drop, model.pos_drop)
    if not (_fast(patches) and type(model)._pos_embed is VisionTransformer._pos_embed and patches.dim() == 3
            and "_pos_embed" not in vars(model) and not model.dynamic_img_size and isinstance(model.norm_pre, nn.Identity)
            and all(isinstance(m, nn.Identity) or not m.training or getattr(m, "p", None) == 0 for m in drops)
            and all(t.dtype == patches.dtype and t.device == patches.device and t.is_contiguous() for t in params)
            and out.is_contiguous() and out.dtype == patches.dtype):
        return False
    b, n, d = patches.shape
    p = (cls is not None) + (0 if reg is None else reg.shape[1])
    if out.numel() != b * (n + p) * d or (pos is not None and pos.shape[1] != n + (0 if model.no_embed_class else p)):
        return False
    position_tokens_triton(patches, cls, reg, pos, not model.no_embed_class, out)
    return True


def position_tokens_triton(patches: torch.Tensor, cls, reg, pos, pos_prefix: bool, out: torch.Tensor) -> None:
    """:func:`position_tokens`' kernel: ``out`` (``[B, P + N, d]`` elements, contiguous) the class
    token ``cls``, the register tokens ``reg`` and the ``[B, N, d]`` ``patches`` in a row, plus
    ``pos`` (``None``: none) from the first (``pos_prefix``) or from the first patch row on (any
    device Triton runs on: the CPU tests use its interpreter)."""
    b, n, d = patches.shape
    n_reg = 0 if reg is None else reg.shape[1]
    seq = n + n_reg + (cls is not None)
    patches = patches.contiguous()
    any_param = next(t for t in (cls, reg, pos, patches) if t is not None)
    block_d = triton.next_power_of_2(d)
    rows = max(1, 1024 // block_d)
    if out.numel():
        _tokens[(b, triton.cdiv(seq, rows))](patches, any_param if cls is None else cls, any_param if reg is None else reg,
                                             any_param if pos is None else pos, out, n, d, n_reg,
                                             HAS_CLS=cls is not None, HAS_POS=pos is not None, POS_PREFIX=pos_prefix,
                                             ROWS=rows, BLOCK_D=block_d, num_warps=4)
