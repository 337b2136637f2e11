"""Attention within the sequences of a packed batch (:class:`~timm_dora.engine.packing.Packed`): the
backends and what each allows, in one table (:data:`BACKEND_INFO`).

The backends, chosen once per (device type, dtype) by :func:`select_backend`:

``triton``
    this package's Triton kernel (:mod:`timm_dora.engine.varlen_kernel`; CUDA, fp16/bf16, head dims 32,
    64, 128, forward only: other head dims, and inputs that need a gradient, fall back to
    ``torch_varlen``'s kernel). ``"auto"`` picks it on GPUs
    of compute capability 9 or higher (Hopper), where it was measured: on an H100 it takes 0.5-0.8x
    the time of the FlashAttention-2 varlen kernel on pruned-block shapes
    (``benchmarks/results/attention_kernels_h100.json``). Elsewhere it is opt-in.
``flash``
    ``flash_attn.flash_attn_varlen_func`` (optional dependency, CUDA, fp16/bf16).
``torch_varlen``
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA, fp16/bf16).
``sdpa_loop``
    exact reference path for any device and dtype: one ``scaled_dot_product_attention`` call per
    sequence. Used on CPU and for fp32 on CUDA.

Training-only backend (never chosen by ``"auto"``, refused by :func:`timm_dora.wrap`):

``padded``
    scatters the sequences into a zero-padded ``[B, S_max]`` batch and runs one masked SDPA call
    (padded keys masked out, padded query rows dropped). Same maths, one kernel instead of one per
    sequence; the actor and critic use it for their many small fp32 PPO minibatches, where the
    per-sequence loop is launch-bound.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import itertools
from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F

from .packing import Packed

__all__ = ["Backend", "BACKEND_INFO", "BACKENDS", "TRAINING_BACKENDS", "aten_flash_used", "select_backend",
           "varlen_attention"]


@dataclass(frozen=True)
class Backend:
    """What an attention backend needs and allows (one row of :data:`BACKEND_INFO`)."""

    needs: str  # what it needs to run (the error message of an explicit choice that cannot)
    cuda_half: bool  # runs only on CUDA in fp16/bf16
    captured: bool  # reads no sequence lengths on the host, so the captured executor can record it
    key_bias: bool  # adds merged rows' log(size) to their keys' logits itself (else: padded)
    folds_in_graphs: bool  # merging captured with it (its kernel reads the sizes; the fold in a graph)
    actor_kernels: bool  # the actor's Triton kernels run beside it (Hopper, fp16/bf16)
    auto: bool  # "auto" may pick it (else training-only, refused by timm_dora.wrap)
    # the whole forward's graph (1-16 images) runs its dense blocks through it too, as packed rows of
    # equal lengths: measured faster there than cuDNN's attention and its memset (3.2-6.6 against
    # 5.5-13.6 us on an H200, torch-profiler traces of one request; docs/performance.md)
    small_dense: bool


# in "auto" order; triton only where measured faster than FlashAttention-2 (compute capability >= 9)
BACKEND_INFO: Dict[str, Backend] = {
    "triton": Backend("the triton package, CUDA and fp16/bf16", True, True, True, True, True, True, True),
    "flash": Backend("flash-attn installed, CUDA and fp16/bf16", True, True, False, False, False, True, False),
    "torch_varlen": Backend("torch>=2.10, CUDA and fp16/bf16", True, True, False, False, False, True, False),
    "sdpa_loop": Backend("nothing: it runs anywhere", False, False, True, False, False, True, False),
    "padded": Backend("nothing: it runs anywhere", False, False, True, False, False, False, False),
}
BACKENDS = tuple(name for name, b in BACKEND_INFO.items() if b.auto)  # inference backends, in "auto" order
TRAINING_BACKENDS = tuple(BACKEND_INFO)


def _flash_available() -> bool:
    try:
        importlib.import_module("flash_attn")
    except Exception:
        return False
    return True


def _triton_kernel_available() -> bool:
    from . import varlen_kernel  # imports triton: only asked for on CUDA

    return varlen_kernel.triton is not None


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def select_backend(device_type: str, dtype: torch.dtype, preference: str = "auto") -> str:
    """Pick the variable-length attention backend once per (device type, dtype).

    ``preference`` is ``"auto"`` or one of :data:`BACKENDS`; an explicit backend that cannot run
    on this device or dtype raises ``ValueError`` instead of silently falling back.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    cuda = device_type == "cuda"
    present = {"triton": _triton_kernel_available, "flash": _flash_available,
               "torch_varlen": lambda: _torch_varlen() is not None}
    usable = {name: not b.cuda_half or (cuda and half and present[name]()) for name, b in BACKEND_INFO.items()}
    if preference == "auto":
        for name in BACKENDS:
            if name == "triton" and not (usable[name] and torch.cuda.get_device_capability()[0] >= 9):
                continue  # measured faster than FlashAttention-2 on Hopper only
            if usable[name]:
                return name
    if preference not in usable:
        raise ValueError(f"unknown attention backend {preference!r}; choose 'auto' or one of {TRAINING_BACKENDS}")
    if not usable[preference]:
        raise ValueError(f"attention backend {preference!r} cannot run on device {device_type!r} with {dtype}: it needs "
                         f"{BACKEND_INFO[preference].needs}")
    return preference


@functools.lru_cache(maxsize=None)
def _varlen_accepts_scale() -> bool:
    fn = _torch_varlen()
    return fn is not None and "scale" in inspect.signature(fn).parameters


_ATEN_FLASH = {"ok": None}  # None: not tried yet; False: this torch's op refused our call


def aten_flash_used() -> bool:
    """Whether the ``torch_varlen`` backend runs FlashAttention through the direct
    ``aten::_flash_attention_forward`` call: ``True`` once a call went through it; ``False`` before
    its first call, or once this torch's op refused the call (``varlen_attn`` from then on)."""
    return bool(_ATEN_FLASH["ok"])


def _aten_flash_varlen(q, k, v, cu, max_len, scale):
    """The FlashAttention varlen kernel that ``varlen_attn`` runs, called as the aten op directly.

    ``torch.nn.attention.varlen.varlen_attn`` is a ``torch.library`` custom op behind a
    ``torch._dynamo`` guard: about 150 us of Python per call on the host (measured with cProfile on
    the H100 machine), more than a ViT-Ti block's whole GPU time. The op underneath,
    ``aten::_flash_attention_forward`` with cumulative sequence lengths, costs one dispatcher
    call. Returns ``None`` (and ``varlen_attn`` is used from then on) if this torch's op does not
    accept the call (:func:`aten_flash_used`); ``benchmarks/gpu_check.py`` compares the two on the GPU.
    """
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        _ATEN_FLASH["ok"] = False
        return None
    try:
        out = op(q, k, v, cu, cu, max_len, max_len, 0.0, False, False, scale=scale)[0]
    except (RuntimeError, TypeError) as e:
        oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
        if _ATEN_FLASH["ok"] or isinstance(e, oom):  # a real error, not an unsupported signature
            raise
        _ATEN_FLASH["ok"] = False
        return None
    _ATEN_FLASH["ok"] = True
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: Packed,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Softmax attention within each sequence of a packed batch.

    ``q, k, v``: ``[T, H, hd]``. Returns ``[T, H, hd]``. Sequences never attend to each other.
    A uniform batch takes the dense fused SDPA path regardless of ``backend``. Merged rows
    (``packed.sizes``) add ``log(size)`` to their keys' logits; ``triton`` reads the sizes in its
    kernel, the kernels without a key bias (``flash``, ``torch_varlen``) give way to ``padded``.
    """
    sizes = getattr(packed, "sizes", None)  # (other layouts, e.g. the captured controller's, have none)
    in_kernel = backend == "triton" and not packed.uniform  # (the kernel reads the sizes itself)
    bias = None if sizes is None or in_kernel else sizes.log().to(q.dtype)  # ToMe's proportional attention, per key
    if packed.uniform:
        qd, kd, vd = (packed.dense(t).transpose(1, 2) for t in (q, k, v))  # [B, H, S, hd]
        mask = None if bias is None else bias.view(packed.batch_size, 1, 1, packed.max_len)
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(q.shape)
    if bias is not None and not BACKEND_INFO[backend].key_bias:
        backend = "padded"  # (kernels without a key bias)
    cu, n = packed.cu_seqlens, packed.max_len
    if backend == "triton":
        from .varlen_kernel import TILE, varlen_attention_triton

        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if q.shape[-1] in TILE and not grad:
            if torch.compiler.is_compiling():  # one opaque op for Dynamo and Inductor
                return torch.ops.timm_dora.varlen_attention(q, k, v, cu, n, scale, sizes)
            return varlen_attention_triton(q, k, v, cu, n, scale, sizes=sizes)
        # a head dim without tuned tiles, or a gradient to carry (the kernel is forward-only):
        # the FlashAttention-2 kernel, which has a backward (padded where keys carry sizes)
        backend = "torch_varlen" if sizes is None else "padded"
        bias = None if sizes is None else sizes.log().to(q.dtype)
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu, cu, n, n, softmax_scale=scale)
    if backend == "torch_varlen":
        if _ATEN_FLASH["ok"] is not False:
            out = _aten_flash_varlen(q, k, v, cu, n, scale)
            if out is not None:
                return out
        varlen_attn = _torch_varlen()
        if _varlen_accepts_scale():
            return varlen_attn(q, k, v, cu, cu, n, n, scale=scale)
        # older signature: fold the scale into q (default scale is hd ** -0.5)
        return varlen_attn(q * (scale * q.shape[-1] ** 0.5), k, v, cu, cu, n, n)
    if backend == "padded":
        b, n = packed.batch_size, packed.max_len
        seg, pos = packed.seg, packed.pos
        qp, kp, vp = (t.new_zeros(b, n, *t.shape[1:]).index_put_((seg, pos), t) for t in (q, k, v))
        if bias is None:
            mask = torch.arange(n, device=q.device)[None, :] < packed.lengths[:, None]  # [B, S] keys
        else:  # the bias on real keys, -inf on the padding
            mask = bias.new_full((b, n), float("-inf")).index_put_((seg, pos), bias)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
        )
        return out.transpose(1, 2)[seg, pos]
    if backend != "sdpa_loop":
        raise ValueError(f"unknown attention backend {backend!r}")
    # one [1, H, T, hd] view per tensor, split into the sequences' [1, H, n, hd] views
    masks = itertools.repeat(None) if bias is None else [m.view(1, 1, 1, -1) for m in bias.split(packed.lengths_host)]
    outs = [F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mi, scale=scale)
            for qi, ki, vi, mi in zip(*(t.transpose(0, 1)[None].split(packed.lengths_host, 2) for t in (q, k, v)), masks)]
    return torch.cat(outs, 2)[0].transpose(0, 1)
