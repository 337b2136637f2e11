"""Packed ragged token batches, row deletion and variable-length attention.

After the first deletion a batch of images no longer has one sequence length. DORA keeps it as
one ``[total_tokens, d]`` tensor plus ``cu_seqlens`` (the layout of FlashAttention's varlen API):
LayerNorm, MLP and projections run on packed rows, attention runs per sequence through a
variable-length kernel, and nothing is ever padded.

While every sequence still has the same length (before any pruning, or when every image removed
the same number of tokens) the packed tensor is also a dense ``[B, S, d]`` view, and attention uses
the dense fused SDPA path that timm itself uses, so the unpruned blocks cost what native blocks
cost.

Attention backends, chosen once per (device type, dtype) by :func:`select_backend`:

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
import inspect
import itertools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .lazy import lazy
from .options import active

__all__ = [
    "Packed",
    "BACKENDS",
    "TRAINING_BACKENDS",
    "select_backend",
    "varlen_attention",
    "delete_rows",
    "merge_removed",
    "fold_removed",
    "segment_and_position",
    "gather_survivors",
    "rows_where",
    "segment_ids",
    "lookup",
    "row_bucket",
    "bucket_rows",
    "PackedTransformerBlock",
]

BACKENDS = ("triton", "flash", "torch_varlen", "sdpa_loop")  # inference backends, in "auto" order
TRAINING_BACKENDS = BACKENDS + ("padded",)


def segment_ids(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every packed row (``[total]`` int64), without a host sync."""
    idx = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(idx, lengths, output_size=total)


def segment_and_position(cu_seqlens: torch.Tensor, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequence and position of rows ``idx`` of a packed layout (``cu_seqlens``: ``[B+1]`` int64);
    rows past the last sequence count as the last one's (their positions run on past its end).
    No host read: what the actor's fixed-shape controller (``ActorPolicy.controller_fixed``) and
    :func:`fold_removed` capture."""
    seg = torch.searchsorted(cu_seqlens[1:], idx, right=True).clamp_max(cu_seqlens.numel() - 2)
    return seg, idx - cu_seqlens[:-1][seg]


@dataclass
class Packed:
    """A batch of variable-length token sequences stored back to back.

    Attributes:
        x: ``[T, d]`` rows of all sequences, sequence ``i`` occupying rows
            ``cu_seqlens[i]:cu_seqlens[i+1]``. Within a sequence the order is the model's token
            order: prefix tokens (CLS, registers, distillation token) first, then surviving
            patch tokens in their original order.
        lengths: ``[B]`` int64 tokens per sequence (prefix tokens included), on ``x.device``.
        lengths_host: the same lengths as a Python list (kernels need the maximum on the host).
        num_prefix: prefix tokens at the start of every sequence; they are never removed.
        ids: optional ``[T]`` int64 original position of each row in its image's unpruned
            sequence (carried through deletions; used to report which patches were removed).
        sizes: optional ``[T]`` float32 patches each row stands for, once rows have been merged
            (:func:`merge_removed`; ``None`` while every row is one token): the attention adds
            ``log(size)`` to each key's logits (ToMe's proportional attention).
    """

    x: torch.Tensor
    lengths: torch.Tensor
    lengths_host: List[int]
    num_prefix: int
    ids: Optional[torch.Tensor] = None
    sizes: Optional[torch.Tensor] = None

    @classmethod
    def from_dense(cls, x: torch.Tensor, num_prefix: int, track_ids: bool = False) -> "Packed":
        b, s, d = x.shape
        lengths = torch.full((b,), s, dtype=torch.long, device=x.device)
        ids = torch.arange(s, device=x.device).repeat(b) if track_ids else None
        return cls(x.reshape(b * s, d), lengths, [s] * b, num_prefix, ids)

    @property
    def batch_size(self) -> int:
        return len(self.lengths_host)

    @property
    def total(self) -> int:
        return self.x.shape[0]

    @lazy
    def max_len(self) -> int:
        return max(self.lengths_host)

    @lazy
    def min_len(self) -> int:
        return min(self.lengths_host)

    @property
    def uniform(self) -> bool:
        """True when all sequences have one length, so ``x`` is also a dense ``[B, S, d]``."""
        return self.min_len == self.max_len

    @lazy
    def cu_seqlens(self) -> torch.Tensor:
        """``[B+1]`` int32 cumulative lengths (the varlen kernels' layout)."""
        return F.pad(torch.cumsum(self.lengths, 0, dtype=torch.int32), (1, 0))

    @lazy
    def starts(self) -> torch.Tensor:
        """``[B]`` int64 row index where each sequence starts."""
        return self.cu_seqlens[:-1].long()

    @lazy
    def seg(self) -> torch.Tensor:
        """``[T]`` sequence index of each row."""
        return segment_ids(self.lengths, self.total)

    @lazy
    def pos(self) -> torch.Tensor:
        """``[T]`` position of each row inside its sequence (0 is CLS)."""
        return torch.arange(self.total, device=self.x.device) - self.starts[self.seg]

    def dense(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` (default ``self.x``) viewed as ``[B, S, ...]``; only valid when :attr:`uniform`."""
        x = self.x if x is None else x
        return x.view(self.batch_size, self.lengths_host[0], *x.shape[1:])

    def with_x(self, x: torch.Tensor) -> "Packed":
        """Same layout, new row values (cached layout values and index tensors are shared)."""
        new = Packed(x, self.lengths, self.lengths_host, self.num_prefix, self.ids, self.sizes)
        for name in _LAYOUT_CACHE:
            if name in self.__dict__:
                new.__dict__[name] = self.__dict__[name]
        return new

    def padded(self, width: int, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` (default ``self.x``) as a zero-padded ``[B, width, ...]``: sequence ``i`` in rows
        ``0..lengths[i]-1`` (``width >= max_len``)."""
        x = self.x if x is None else x
        out = x.new_zeros(self.batch_size, width, *x.shape[1:])
        out[self.seg, self.pos] = x
        return out

    def prefix_rows(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, num_prefix, ...]`` rows of the prefix tokens of every sequence."""
        x = self.x if x is None else x
        idx = self.starts[:, None] + torch.arange(self.num_prefix, device=x.device)
        return x[idx]


# cached properties that depend on the layout only (not on ``x``): shared by :meth:`Packed.with_x`
_LAYOUT_CACHE = ("max_len", "min_len", "cu_seqlens", "starts", "seg", "pos")


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 2-D ``table`` and a long tensor ``index`` that repeats rows many
    times (a block or type embedding per token, a per-sequence row per token), with a fast backward.

    The forward is the same gather. Advanced indexing's backward, ``index_put_(accumulate=True)``,
    runs on CUDA a kernel that adds repeated indices one after another: in a PPO update it took
    56 % of the H100's time (1.0 ms a call; ``benchmarks/results/train_speed/``).
    ``F.embedding``'s backward sums the rows of each index with a sorted segment reduction, in a
    fixed order (deterministic on CUDA too)."""
    return F.embedding(index, table)


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``2 ** (rows.bit_length() - 6)`` (at least 8): at most
    1/32 more rows, and 32 sizes per doubling."""
    step = max(8, 1 << max(rows.bit_length() - 6, 0))
    return -(-rows // step) * step


def bucket_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, enabled: Optional[bool] = None) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a linear layer, an MLP), with the rows of ``x`` (every
    dimension but the last) zero-padded up to :func:`row_bucket` for the call and sliced back.

    Only in no-grad forwards on CUDA outside a CUDA-graph capture, where it pays: cuBLAS chooses a
    GEMM's kernel by a heuristic query on the host for every shape it has not seen, 0.3-0.6 ms on
    the H100 (torch 2.11) against 0.03 ms for a known one, and a ragged batch (a deletion, a
    shadow batch, a QC shard) brings a new row count to every layer. In buckets the shapes
    repeat. Each row's output is computed from that row alone, so the rows kept are ``fn``'s.
    Not under ``torch.compile`` either: there the bucket size would be a Python int that Dynamo
    specialises on, one recompilation per row count; Inductor compiles for dynamic row counts.
    ``enabled``: force the padding on or off (default: the conditions above)."""
    if enabled is None:
        enabled = (x.device.type == "cuda" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                   and not torch.cuda.is_current_stream_capturing())
    if not enabled or x.dim() < 2:
        return fn(x)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = row_bucket(rows) if rows else 0
    if padded == rows:
        return fn(x)
    y = fn(F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows)))
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def rows_where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` True entries of ``mask`` (no host sync when ``count`` is known)."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(mask, size=count).squeeze(1)
    return torch.nonzero(mask).squeeze(1)  # pragma: no cover - torch < 2.1


def removal_mask(packed: Packed, image: torch.Tensor, col: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T]`` bool marking visual column ``col`` of image ``image`` (0 = first surviving patch;
    ``image`` broadcasts against ``col``).

    ``valid`` (same shape as ``col``) masks entries out without boolean indexing (no host sync):
    they mark a spare row past the end, which is cut off.
    """
    rows = packed.starts[image] + packed.num_prefix + col
    if valid is not None:
        rows = torch.where(valid, rows, packed.total)
    remove = torch.zeros(packed.total + (1 if valid is not None else 0), dtype=torch.bool, device=packed.x.device)
    remove.index_fill_(0, rows.reshape(-1), True)  # not ``remove[rows] = True``: that syncs on CUDA (H100 profile)
    return remove if valid is None else remove[: packed.total]


def gather_survivors(x: torch.Tensor, remove: torch.Tensor, out: torch.Tensor,
                     ids: Optional[torch.Tensor] = None, sizes: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The rows of ``x`` not in ``remove`` gathered, in order, into the first rows of ``out``, in
    fixed shapes: all ``T = len(x)`` rows of ``out`` are written (survivors first, then copies of
    row 0), so nothing here waits for the survivor count (a CUDA graph can hold it). ``ids``:
    ``[T]`` per-row ids gathered the same way (returned, ``[T]``; ``None`` without ids); ``sizes``:
    ``[T]`` merged rows' sizes, gathered the same way in place. The deletion step of
    :func:`delete_rows` and of the graph-replayed controller (:mod:`timm_dora.engine.graphs`)."""
    index = torch.nonzero_static(~remove, size=x.shape[0], fill_value=0).squeeze(1)
    torch.index_select(x, 0, index, out=out[: x.shape[0]])
    if sizes is not None:
        sizes.copy_(sizes.index_select(0, index))
    return None if ids is None else ids.index_select(0, index)


def delete_rows(packed: Packed, remove: torch.Tensor, removed: torch.Tensor,
                removed_host: Optional[List[int]] = None, out: Optional[torch.Tensor] = None) -> Packed:
    """Physically delete rows of a packed batch, keeping the order of the survivors.

    Args:
        packed: the batch.
        remove: ``[T]`` bool, True for rows to delete (never a prefix row).
        removed: ``[B]`` int64 number of rows deleted from each sequence (equals the per-sequence
            count of ``remove``).
        removed_host: the same counts as a list, when the caller knows them on the host.
        out: a ``[>= T', d]`` buffer to gather the survivors into (its first rows; it must not
            overlap ``packed.x``); the result's ``x`` is then a view of it.

    Returns:
        The compacted batch: one gather of the surviving rows, new lengths and ``cu_seqlens``.
        One host synchronisation (the new lengths, which the kernels need on the host), none when
        ``removed_host`` is given. With ``out`` and no ``removed_host`` the gather is enqueued
        before that synchronisation (survivors first, all ``T`` rows of ``out`` written), so the
        GPU works while the host waits.
    """
    lengths = packed.lengths - removed
    early = removed_host is None and out is not None and hasattr(torch, "nonzero_static") and packed.sizes is None
    if early:  # survivors first, then copies of row 0 (cut off below)
        ids = gather_survivors(packed.x, remove, out, packed.ids)
    if removed_host is None:
        lengths_host = lengths.tolist()
    else:
        lengths_host = [n - r for n, r in zip(packed.lengths_host, removed_host)]
    total = sum(lengths_host)
    if early:
        return Packed(out[:total], lengths, lengths_host, packed.num_prefix, None if ids is None else ids[:total])
    index = rows_where(~remove, total)
    ids = None if packed.ids is None else packed.ids.index_select(0, index)
    sizes = None if packed.sizes is None else packed.sizes.index_select(0, index)
    x = packed.x.index_select(0, index) if out is None else torch.index_select(packed.x, 0, index, out=out[:total])
    return Packed(x, lengths, lengths_host, packed.num_prefix, ids, sizes)


def merge_removed(packed: Packed, keys: torch.Tensor, remove: torch.Tensor, num_heads: int) -> Packed:
    """Fold every row marked in ``remove`` into the surviving visual row of its image whose key is most
    cosine-similar to its own (keys averaged over the ``num_heads`` heads, ToMe's metric), by
    size-weighted average; the sizes add up. The layout is unchanged: :func:`delete_rows` then
    deletes the folded rows (ours; ``wrap(..., merge=True)``: the removed tokens' content stays, as
    ToMe keeps it). ``keys``: ``[T, d]`` the block's keys (heads concatenated); ``remove``: ``[T]``
    bool, never a prefix row, with a surviving visual row in every image that removes one. The
    eager executor's step; the captured controller runs :func:`fold_removed` on its fixed buffers."""
    size = torch.ones(packed.total, device=packed.x.device) if packed.sizes is None else packed.sizes
    x, mass = fold_removed(packed.x, keys, remove, size, packed.cu_seqlens, packed.max_len, packed.num_prefix,
                           num_heads)
    new = packed.with_x(x)
    new.sizes = mass
    return new


def fold_removed(x: torch.Tensor, keys: torch.Tensor, remove: torch.Tensor, sizes: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_len: int, num_prefix: int, num_heads: int,
                 out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_removed` in fixed shapes, with no host read (a CUDA graph can hold it): the rows
    ``x`` ``[T, d]`` with each row in ``remove`` folded into its best match (into ``out`` when
    given, which may be ``x``), and the new sizes ``[T]`` float32. ``keys`` ``[T, d]`` (any row
    stride), ``sizes`` ``[T]`` float32, ``cu_seqlens`` ``[B + 1]`` delimit the images (rows past
    ``cu_seqlens[-1]`` are padding: never folded nor folded into, whatever they hold), ``max_len``
    at least the longest image. Every image's similarities are one ``[S, S]`` product (``S =
    max_len``) over its padded metric rows, the non-survivors' columns at ``-inf``; the sums in
    float32. On CUDA (``EngineOptions.fold_kernel``) the same in the Triton kernels of
    :mod:`~timm_dora.engine.fold_kernel`, where they take the head dim and no gradient is carried
    (the kernels are forward-only)."""
    if x.is_cuda and active().fold_kernel and not (torch.is_grad_enabled() and (x.requires_grad or keys.requires_grad)):
        from .fold_kernel import fold_kernel_reason, fold_rows

        if fold_kernel_reason(x, keys, num_heads) is None:
            return fold_rows(x, keys, remove, sizes, cu_seqlens, max_len, num_prefix, num_heads, out=out)
    t, dev = x.shape[0], x.device
    b = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    row = torch.arange(t, device=dev)
    image, pos = segment_and_position(cu, row)
    live = row < cu[-1]
    slot = torch.where(live, image * max_len + pos, b * max_len)  # in a padded [B, S] layout; a spare slot
    metric = keys.float().reshape(t, num_heads, -1).mean(1)
    metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    dense = metric.new_zeros(b * max_len + 1, metric.shape[1]).index_put_((slot,), metric)[:-1].view(b, max_len, -1)
    survivor = torch.zeros(b * max_len + 1, dtype=torch.bool, device=dev).index_put_(
        (slot,), ~remove & live & (pos >= num_prefix))[:-1].view(b, 1, max_len)
    columns = torch.zeros(survivor.shape, device=dev).masked_fill_(~survivor, float("-inf"))  # [B, 1, S]
    best = torch.baddbmm(columns, dense, dense.transpose(1, 2)).argmax(2).view(-1)  # [B*S] each slot's survivor
    target = (cu[image] + best[slot.clamp_max(b * max_len - 1)]).clamp_max(t - 1)
    fold = remove & live
    weight = torch.where(fold, sizes, 0.0)
    mass = sizes.index_add(0, target, weight)
    acc = torch.mul(x, sizes[:, None])  # float32
    acc.index_add_(0, target, torch.where(fold[:, None], acc, 0.0))  # (padding may hold anything)
    folded = acc / mass[:, None]
    return (folded.to(x.dtype) if out is None else out.copy_(folded)), mass


# --------------------------------------------------------------------------------------------
# attention backends


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
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
    usable = {
        "triton": cuda and half and _triton_kernel_available(),
        "flash": cuda and half and _flash_available(),
        "torch_varlen": cuda and half and _torch_varlen() is not None,
        "sdpa_loop": True,
        "padded": True,
    }
    if preference == "auto":
        for name in BACKENDS:
            if name == "triton" and not (usable[name] and torch.cuda.get_device_capability()[0] >= 9):
                continue  # measured faster than FlashAttention-2 on Hopper only
            if usable[name]:
                return name
    if preference not in usable:
        raise ValueError(f"unknown attention backend {preference!r}; choose 'auto' or one of {TRAINING_BACKENDS}")
    if not usable[preference]:
        raise ValueError(
            f"attention backend {preference!r} cannot run on device {device_type!r} with {dtype}: "
            "'triton' needs the triton package, CUDA and fp16/bf16; 'flash' needs flash-attn installed, CUDA and fp16/bf16; 'torch_varlen' needs "
            "torch>=2.10, CUDA and fp16/bf16; 'sdpa_loop' runs anywhere"
        )
    return preference


@functools.lru_cache(maxsize=None)
def _varlen_accepts_scale() -> bool:
    fn = _torch_varlen()
    return fn is not None and "scale" in inspect.signature(fn).parameters


_ATEN_FLASH = {"ok": None}  # None: not tried yet; False: this torch's op refused our call


def _aten_flash_varlen(q, k, v, cu, max_len, scale):
    """The FlashAttention varlen kernel that ``varlen_attn`` runs, called as the aten op directly.

    ``torch.nn.attention.varlen.varlen_attn`` is a ``torch.library`` custom op behind a
    ``torch._dynamo`` guard: about 150 us of Python per call on the host (measured with cProfile on
    the H100 machine), more than a ViT-Ti block's whole GPU time. The op underneath,
    ``aten::_flash_attention_forward`` with cumulative sequence lengths, costs one dispatcher
    call. Returns ``None`` (and ``varlen_attn`` is used from then on) if this torch's op does not
    accept the call; ``benchmarks/gpu_check.py`` compares the two on the GPU.
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
    if bias is not None and backend in ("flash", "torch_varlen"):
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


class PackedTransformerBlock(nn.Module):
    """Pre-LN Transformer block (attention + GELU FFN) on packed sequences, no padding.

    The actor's shared encoder (width 128, 4 heads, FFN 256) and the critic's token branch (width
    256, 4 heads, FFN 512) are made of it.
    """

    def __init__(self, width: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, width)

    def forward(self, x: torch.Tensor, packed: Packed, backend: str) -> torch.Tensor:
        t, w = x.shape
        hd = w // self.num_heads
        q, k, v = bucket_rows(self.qkv, self.norm1(x)).view(t, 3, self.num_heads, hd).unbind(1)
        x = x + bucket_rows(self.proj, varlen_attention(q, k, v, packed, hd ** -0.5, backend).reshape(t, w))
        return x + bucket_rows(self._ffn, self.norm2(x))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward_padded(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The same block on a padded batch ``x`` ``[S, N, w]``; ``valid`` ``[S, N]`` marks each
        sequence's real rows (a prefix of every row, at least one). Padded keys are masked out, so
        real rows get exactly the maths of :meth:`forward`; padded rows are computed and meaningless.
        Shapes do not depend on the lengths (PPO minibatches of fixed shape, no host reads)."""
        return self._padded(x, valid, x.shape[1])

    def forward_padded_first(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Row 0 of :meth:`forward_padded` (``[S, w]``) at the cost of row 0: keys and values come
        from every row, the query, attention output, projection and FFN only from row 0 (each row's
        output depends on the other rows through their keys and values alone). The critic's value
        token after its last block."""
        return self._padded(x, valid, 1)[:, 0]

    def _padded(self, x: torch.Tensor, valid: torch.Tensor, rows: int) -> torch.Tensor:
        """:meth:`forward_padded`'s output at the first ``rows`` rows."""
        s, n, w = x.shape
        hd = w // self.num_heads
        h = self.norm1(x)
        if rows == n:
            q, k, v = self.qkv(h).view(s, n, 3, self.num_heads, hd).permute(2, 0, 3, 1, 4)
        else:  # the query projection only where it is read
            q = F.linear(h[:, :rows], self.qkv.weight[:w], self.qkv.bias[:w]).view(s, rows, self.num_heads, hd).transpose(1, 2)
            k, v = F.linear(h, self.qkv.weight[w:], self.qkv.bias[w:]).view(s, n, 2, self.num_heads, hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=hd ** -0.5)
        x = x[:, :rows] + self.proj(o.transpose(1, 2).reshape(s, rows, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
