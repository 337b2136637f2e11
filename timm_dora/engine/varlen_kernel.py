"""A variable-length attention kernel for short sequences, in Triton (the ``triton`` backend).

Pruned ViT blocks attend within sequences of at most a few hundred tokens (197 for a /16 model at
224 px). The FlashAttention-2 varlen kernel that ``torch_varlen`` calls is written for Ampere's
tensor-core instructions and works in 128-row query tiles; on an H100 it takes about 1.4x the time
of the dense cuDNN kernel that timm's unpruned blocks use on the same rows (measured on an H100).
This kernel is the textbook online-softmax attention (one program per
query tile, head and sequence; keys and values streamed in tiles, running max and sum in fp32),
compiled by Triton for whatever GPU runs it (on Hopper its dot products become wgmma
instructions), with tiles sized for short sequences.

Layout as FlashAttention's varlen API: ``q, k, v`` are ``[T, H, hd]`` (any strides over ``T`` and
``H``, unit stride over ``hd``: the views of a fused ``qkv`` projection are used as they are) and
``cu_seqlens`` (``[B + 1]`` int32, on the device) delimits the sequences; rows past ``cu_seqlens[-1]``
are neither read nor written. No shape depends on ``cu_seqlens``' values, and no value is read on
the host, so a call can be captured in a CUDA graph and replayed with new sequence lengths (up to
the ``max_len`` it was captured with). Merged rows (``wrap(..., merge=True)``) pass their sizes, read
on the device the same way: each key's weight is multiplied by its size (ToMe's proportional
attention, ``log(size)`` added to its logits, taken after the exponential: the running maximum
does not wait for them, and each key tile's sizes are loaded during the tile before). Adding the
logarithms before the maximum, as first written, made the kernel 2.1x slower at DeiT-Ti's shape
(8.5 against 4.0 us at one image, 113 against 45 at 320, one H200); this form 4.4 and 55
(``benchmarks/results/attention_sizes_h200.json.gz``).

Off CUDA the same kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` set before this module
is imported), which is how the CPU tests check it against a reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["varlen_attention_triton", "varlen_attention_op", "copy_open_keys", "TILE"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None


# (BLOCK_M query rows, BLOCK_N key rows, warps, pipeline stages) per head dimension, fixed so that
# a call inside a CUDA-graph capture never autotunes. Head dim 64 chosen on an H100 among 12
# configurations (benchmarks/results/attention_kernels_h100.json, its script in git history: the
# best on 6 of 12 shapes, within 9 % of the best on the others); 32 (the actor's encoder) takes the same tiles;
# 128 two stages instead of three (shared memory of smaller GPUs), not measured
TILE = {32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 2)}


if triton is not None:

    @triton.jit
    def _varlen_fwd(Q, K, V, O, CU, SIZES, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SIZES: tl.constexpr):
        tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(CU + seq)
        length = tl.load(CU + seq + 1) - start
        if tile * BLOCK_M < length:
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_DIM)
            rows_m = (start + offs_m).to(tl.int64)
            q = tl.load(Q + rows_m[:, None] * sq_t + head * sq_h + offs_d[None, :],
                        mask=offs_m[:, None] < length, other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            if HAS_SIZES:  # the first key tile's sizes (each tile's are loaded one tile ahead)
                ahead = tl.arange(0, BLOCK_N)
                next_sizes = tl.load(SIZES + start + ahead, mask=ahead < length, other=0.0)
            for n0 in range(0, length, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                rows_n = (start + offs_n).to(tl.int64)
                valid = offs_n < length
                k = tl.load(K + rows_n[None, :] * sk_t + head * sk_h + offs_d[:, None],
                            mask=valid[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
                s = tl.dot(q, k) * qk_scale  # log2 domain: qk_scale = scale / ln 2
                if HAS_SIZES:  # (the next tile's sizes on their way during this tile's products)
                    sizes = next_sizes
                    ahead = offs_n + BLOCK_N
                    next_sizes = tl.load(SIZES + start + ahead, mask=ahead < length, other=0.0)
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                if HAS_SIZES:  # merged keys: exp(s + log(size)) = exp(s) * size (the max without them)
                    p = p * sizes[None, :]
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + rows_n[:, None] * sv_t + head * sv_h + offs_d[None, :],
                            mask=valid[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            acc = acc / l_i[:, None]
            tl.store(O + rows_m[:, None] * so_t + head * so_h + offs_d[None, :], acc.to(O.dtype.element_ty),
                     mask=offs_m[:, None] < length)

    @triton.jit
    def _copy_open(SRC, stride_b, stride_c, stride_s, stride_h, HD, CU, GATE, OUT,
                   D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        seq, chunk = tl.program_id(0), tl.program_id(1)
        start = tl.load(CU + seq)
        n = tl.load(CU + seq + 1) - start
        if (tl.load(GATE + seq) != 0) & (chunk * BLOCK_R < n):
            pos = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
            live = pos < n
            # row (seq, pos) of the source: seq * stride_b + (start + pos) * stride_c + pos * stride_s
            src = seq.to(tl.int64) * stride_b + start.to(tl.int64) * stride_c + pos.to(tl.int64) * stride_s
            dst = (start + pos).to(tl.int64) * D
            for c0 in tl.static_range(0, D, BLOCK_D):
                cs = c0 + tl.arange(0, BLOCK_D)
                inside = cs < D
                col = (cs // HD) * stride_h + cs % HD  # column c: head c // hd, channel c % hd
                v = tl.load(SRC + src[:, None] + col[None, :], mask=live[:, None] & inside[None, :])
                tl.store(OUT + dst[:, None] + cs[None, :], v, mask=live[:, None] & inside[None, :])


def _strides(t: torch.Tensor) -> Tuple[int, int]:
    if t.dim() != 3 or t.stride(2) != 1:
        raise ValueError(f"expected [T, H, hd] with unit stride over hd, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0), t.stride(1)


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float, tile: Optional[Tuple[int, int, int, int]] = None,
                            sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention within each sequence: ``[T, H, hd]`` in, ``[T, H, hd]`` out (contiguous).

    ``max_len`` must be at least the longest sequence (it sets the number of query tiles; a larger
    value only launches programs that return at once). ``tile`` overrides :data:`TILE` (benchmarks).
    ``sizes``: optional ``[>= T]`` float32, the patches each key row stands for (merged rows,
    ``wrap(..., merge=True)``): ``log(size)`` is added to that key's logits (ToMe's proportional
    attention), read on the device like ``cu_seqlens``. Rows past ``cu_seqlens[-1]`` of the output
    are left uninitialised.
    """
    if triton is None:
        raise RuntimeError("the 'triton' attention backend needs the triton package")
    t, h, d = q.shape
    if d not in TILE and tile is None:
        raise ValueError(f"the 'triton' attention backend supports head dims {sorted(TILE)}, got {d}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    if sizes is not None and (sizes.dtype != torch.float32 or sizes.dim() != 1 or sizes.shape[0] < t
                              or sizes.stride(0) != 1):
        raise ValueError(f"sizes must be a contiguous float32 [>= {t}] vector, got {sizes.dtype} {tuple(sizes.shape)}")
    block_m, block_n, warps, stages = tile or TILE[d]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    batch = cu_seqlens.numel() - 1
    grid = (-(-max_len // block_m), h, batch)
    _varlen_fwd[grid](q, k, v, out, cu_seqlens, cu_seqlens if sizes is None else sizes, *_strides(q), *_strides(k),
                      *_strides(v), *_strides(out), scale * 1.4426950408889634, HEAD_DIM=d, BLOCK_M=block_m,
                      BLOCK_N=block_n, HAS_SIZES=sizes is not None, num_warps=warps, num_stages=stages)
    return out


@torch.library.custom_op("timm_dora::varlen_attention", mutates_args=())
def varlen_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_len: int, scale: float, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`varlen_attention_triton` as the custom op ``torch.ops.timm_dora.varlen_attention``, for
    ``torch.compile``: Dynamo and Inductor see one opaque op with a fake implementation (the output
    is a new contiguous ``[T, H, hd]`` like ``q``) instead of tracing into the Triton launch. Eager
    code calls :func:`varlen_attention_triton` directly (a custom op's dispatch costs host time)."""
    return varlen_attention_triton(q, k, v, cu_seqlens, max_len, scale, sizes=sizes)


@varlen_attention_op.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens, max_len, scale, sizes=None):
    return q.new_empty(q.shape)


def copy_open_keys(keys: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, gate: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """Copy the keys of the images whose ``gate`` is open into ``out`` (``[rows, d]``, heads
    concatenated, the rows of ``cu_seqlens``' layout); the other images' rows keep what they held.
    One Triton kernel, no host read: what the CUDA graphs capture instead of copying every image's
    keys for a controller that reads only the gate-active ones.

    ``keys``: ``[B, H, S, hd]`` (a dense batch, e.g. attention's key tensor) or ``[rows, H, hd]``
    (packed rows), any strides with unit channel stride; ``cu_seqlens``: ``[B+1]`` int32 (a dense
    batch: ``0, S, 2S, ...``); ``max_len``: an upper bound of the lengths; ``gate``: ``[B]`` bool."""
    if triton is None:
        raise ValueError("copy_open_keys: the triton package is not installed")
    b = gate.shape[0]
    if keys.dim() == 4:
        if keys.shape[0] != b:
            raise ValueError(f"keys [B, H, S, hd] must have B={b}, got {tuple(keys.shape)}")
        strides = (keys.stride(0), 0, keys.stride(2), keys.stride(1))
        hd, width = keys.shape[3], keys.shape[1] * keys.shape[3]
    elif keys.dim() == 3:
        strides = (0, keys.stride(0), keys.stride(0), keys.stride(1))
        hd, width = keys.shape[2], keys.shape[1] * keys.shape[2]
    else:
        raise ValueError(f"keys must be [B, H, S, hd] or [rows, H, hd], got {tuple(keys.shape)}")
    if keys.stride(-1) != 1 or out.dim() != 2 or out.shape[1] != width or not out.is_contiguous():
        raise ValueError(f"keys {tuple(keys.shape)} (unit channel stride) and out {tuple(out.shape)} (contiguous "
                         f"[rows, {width}]) do not match")
    if out.dtype != keys.dtype or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape != (b + 1,):
        raise ValueError("copy_open_keys: out must have the keys' dtype and cu_seqlens be [B+1] int32")
    block_r = 32
    grid = (b, -(-max_len // block_r))
    _copy_open[grid](keys, *strides, hd, cu_seqlens, gate, out, D=width, BLOCK_R=block_r,
                     BLOCK_D=min(256, triton.next_power_of_2(width)), num_warps=4)
    return out
