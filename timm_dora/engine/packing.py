"""Packed ragged token batches and row deletion (attention on them: :mod:`~timm_dora.engine.attention`).

After the first deletion a batch of images no longer has one sequence length. DORA keeps it as
one ``[total_tokens, d]`` tensor plus ``cu_seqlens`` (the layout of FlashAttention's varlen API):
LayerNorm, MLP and projections run on packed rows, attention runs per sequence through a
variable-length kernel, and nothing is ever padded.

While every sequence still has the same length (before any pruning, or when every image removed
the same number of tokens) the packed tensor is also a dense ``[B, S, d]`` view, and attention uses
the dense fused SDPA path that timm itself uses, so the unpruned blocks cost what native blocks
cost.

Attention within the sequences: :mod:`timm_dora.engine.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .lazy import lazy
from .options import active

__all__ = [
    "Packed",
    "delete_rows",
    "merge_removed",
    "fold_removed",
    "fold_kernel_applies",
    "segment_and_position",
    "gather_survivors",
    "rows_where",
    "segment_ids",
    "lookup",
    "row_bucket",
    "bucket_rows",
]

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


def fold_kernel_applies(x: torch.Tensor, keys: torch.Tensor, num_heads: int) -> bool:
    """Whether :func:`fold_removed` runs these rows in the Triton kernels (CUDA,
    ``EngineOptions.fold_kernel``, no gradient carried, a head dim they take)."""
    if not (x.is_cuda and active().fold_kernel) or (torch.is_grad_enabled() and (x.requires_grad or keys.requires_grad)):
        return False
    from .fold_kernel import fold_kernel_reason

    return fold_kernel_reason(x, keys, num_heads) is None


def fold_removed(x: torch.Tensor, keys: torch.Tensor, remove: torch.Tensor, sizes: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_len: int, num_prefix: int, num_heads: int,
                 out: Optional[torch.Tensor] = None, sizes_out: Optional[torch.Tensor] = None,
                 scratch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 similarities: Optional[torch.Tensor] = None, finish: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_removed` in fixed shapes, with no host read (a CUDA graph can hold it): the rows
    ``x`` ``[T, d]`` with each row in ``remove`` folded into its best match (into ``out`` when
    given, which may be ``x``), and the new sizes ``[T]`` float32. ``keys`` ``[T, d]`` (any row
    stride), ``sizes`` ``[T]`` float32, ``cu_seqlens`` ``[B + 1]`` delimit the images (rows past
    ``cu_seqlens[-1]`` are padding: never folded nor folded into, whatever they hold), ``max_len``
    at least the longest image. Every image's similarities are one ``[S, S]`` product (``S =
    max_len``) over its padded metric rows, the non-survivors' columns at ``-inf``; the sums in
    float32. ``sizes_out``: where the new sizes go (may be ``sizes``). On CUDA
    (``EngineOptions.fold_kernel``) the same in the Triton kernels of
    :mod:`~timm_dora.engine.fold_kernel`, where they take the head dim and no gradient is carried
    (the kernels are forward-only); ``scratch`` is their zeroed accumulator and mass, kept by a
    graph (unused by the ops); ``similarities`` the kernels' precomputed products of these keys
    (:func:`~timm_dora.engine.fold_kernel.fold_similarities`; the ops compute their own).
    ``finish=False`` (only where :func:`fold_kernel_applies`): the kernels' fold without its last
    step, left in ``scratch`` for the deletion's gather (``EngineOptions.fold_in_gather``)."""
    if fold_kernel_applies(x, keys, num_heads):
        from .fold_kernel import fold_rows

        return fold_rows(x, keys, remove, sizes, cu_seqlens, max_len, num_prefix, num_heads, out=out,
                         sizes_out=sizes_out, scratch=scratch, similarities=similarities, finish=finish)
    if not finish:
        raise ValueError("fold_removed: finish=False needs the fold kernels (fold_kernel_applies)")
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
    return (folded.to(x.dtype) if out is None else out.copy_(folded)), (mass if sizes_out is None else sizes_out.copy_(mass))
