"""The controller graph's deletion step in two Triton kernels (``EngineOptions.fused_deletion``).

After the actor's controller decides which rows go, the captured graph compacts the packed rows:
the survivors' index (``nonzero_static``, four kernels), the gather of the rows and of their ids,
the ids copied back, the new lengths and their cumulative sum, about 13 small kernels in all. At
batches 1-16 (a few thousand rows) each costs launch latency, not bandwidth, so here they are two:

1. :func:`_compact` (one program over all rows, up to :data:`MAX_ROWS`): the survivors' new positions (an exclusive
   cumulative sum of ``~remove``) scattered into the gather index (survivors first, in order, then
   row 0, exactly ``nonzero_static(~remove, size=rows, fill_value=0)``), the ids scattered the same
   way, and the new ``lengths`` and ``cu_seqlens[1:]`` from the old ``cu_seqlens`` and ``removed``;
2. :func:`_gather_rows`: the rows of ``x`` gathered by that index (all ``rows`` rows written).

The first also gathers the merged rows' sizes (``merge``) and, for the whole forward's graph,
keeps its books (:class:`Books`: the history the next gates read, the block's record, the rows
left for the plan's check), about ten more small kernels before. :func:`delete_rows_fused` runs
both; :func:`compact_rows` and :func:`gather_rows` are the two halves, so that the first, which
reads no row, can run beside the merging fold (``EngineOptions.compact_beside_fold``: its new
``cu_seqlens`` and sizes left aside, where the fold does not read them, and copied back by the second).

With ``per_image``, :func:`compact_rows` gives each image a program of its own (and one more for
the rows past the last image and the layout), its survivors placed from its sequence's new start:
no program waits for another, so :func:`pick_and_compact` runs those programs in the launch of the
merging fold's pick (``EngineOptions.compact_in_pick``), one kernel fewer on a request's chain; its
ids, ``cu_seqlens`` and sizes go to buffers of their own, which :func:`gather_rows` copies back.

One program holds every row up to :data:`MAX_ROWS` (a planned whole graph of 16 images has
16 * 197 = 3152), so the index needs no cross-program scan; above it (a planned graph of 320 Tiny
images has 63,040 rows) programs of :data:`BLOCK_ROWS` rows each add the survivors of the
programs before them, counted by a kernel before. Shapes are fixed and nothing is read on the host: a CUDA graph can hold both
kernels and replay them with new ``remove`` patterns.

:func:`delete_rows_reference` is the same step in today's PyTorch ops (the fallback, and what the
tests compare against). Off CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported), which is how the CPU tests check them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .fold_kernel import PICK_ROWS, _check_similarities, similarity_columns

__all__ = ["MAX_ROWS", "BLOCK_ROWS", "PER_IMAGE_ROWS", "GATHER_BLOCK_D", "Books", "fused_deletion_reason",
           "delete_rows_fused", "compact_rows", "pick_and_compact", "gather_rows", "delete_rows_reference",
           "keep_books_reference"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

if triton is not None:
    from .dense_kernels import _normalized
    from .fold_kernel import _pick, _received_mean

# one program holds all rows (the index is one in-register scan) up to this many, far above the
# planned whole graph's 3152 rows at 16 images; more rows (a planned graph of 320 Tiny images has
# 63,040) take programs of BLOCK_ROWS rows each after a kernel that counts their survivors: on one
# H200 at 320 images 3.55 -> 3.31 ms a ViT-Ti forward and 4.61 -> 4.19 a DeiT-Ti one, against the
# PyTorch ops (benchmarks/results/planned_large_multi_deletion_h200.json)
MAX_ROWS = 8192
BLOCK_ROWS = 4096
# the compaction by image (compact_rows' per_image, pick_and_compact): a program's rows at a time
# (one pass for an image of up to this many rows)
PER_IMAGE_ROWS = 256
# the gather's chunk of a row: its columns in one pass up to this many, the LayerNorm after the
# deletion inside it (gather_rows' norm) only for rows of at most this many channels
GATHER_BLOCK_D = 256
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Books(NamedTuple):
    """What the whole forward's graph (:mod:`~timm_dora.engine.whole`) keeps of a deletion besides
    the new layout, written by :func:`_compact` in the same kernel (about ten small kernels
    before, :func:`keep_books_reference`):

    - the history the next blocks' gates read: ``n_visual`` ``[B]`` long (``N_l``, becomes
      ``N_l - k_l``), ``rho`` ``[B]`` float32 (becomes ``k_l / N_l``), ``interventions`` ``[B]``
      long (``E``, plus the block's ``gate`` ``[B]`` bool); ``first``: 0, or ``N_0`` where this is
      the forward's first deletion (``N_l = N_0`` and ``E = 0``: the three buffers are only
      written, so nothing needs resetting before the forward);
    - the block's record (its gates: the graph copies every block's at once): the rows removed
      and the actor's ``flops`` ``[B]`` float64 into ``rec_removed`` (``[B]`` long) and
      ``rec_flops`` (``[B]`` float64); the
      rows' ids and removal flags before the deletion into the first rows of ``rec_ids`` (long)
      and ``rec_remove`` (bool); the rows left (the sum of the new lengths) into ``left`` ``[1]``
      long;
    - ``bound``: where the rows left exceed it (a planned forward's miss: its output is discarded)
      every ``cu_out`` entry is clamped to ``bound - 1``, so the later blocks' kernels stay inside
      their rows; 0: no clamp."""
    gate: torch.Tensor
    flops: torch.Tensor
    n_visual: torch.Tensor
    rho: torch.Tensor
    interventions: torch.Tensor
    first: int
    rec_removed: torch.Tensor
    rec_flops: torch.Tensor
    rec_ids: torch.Tensor
    rec_remove: torch.Tensor
    left: torch.Tensor
    bound: int


if triton is not None:

    @triton.jit
    def _block_counts(REMOVE, COUNTS, rows, BLOCK_T: tl.constexpr):
        """The survivors among each program's ``BLOCK_T`` rows (:func:`_compact`'s ``MULTI`` form)."""
        offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = offs < rows
        keep = (tl.load(REMOVE + offs, mask=inside, other=1) == 0) & inside
        tl.store(COUNTS + tl.program_id(0), tl.sum(keep.to(tl.int32), 0))

    @triton.jit
    def _new_layout(CU, REMOVED, batch, BLOCK_B: tl.constexpr):
        """Every sequence (``seq``, ``live``): its removed rows, its new length and the new
        ``cu_seqlens[1:]`` (reads only)."""
        seq = tl.arange(0, BLOCK_B)
        live = seq < batch
        start = tl.load(CU + seq, mask=live, other=0).to(tl.int64)
        end = tl.load(CU + seq + 1, mask=live, other=0).to(tl.int64)
        removed = tl.load(REMOVED + seq, mask=live, other=0).to(tl.int64)
        lengths = (end - start) - removed
        return seq, live, removed, lengths, tl.cumsum(lengths, 0)

    @triton.jit
    def _read_books(GATE, FLOPS, NVIS, INTERV, seq, live, removed, FIRST: tl.constexpr):
        """The books' ``N_l`` before the deletion, ``E`` after it, ``rho`` and the FLOPs to record
        (reads only)."""
        gate = tl.load(GATE + seq, mask=live, other=0).to(tl.int64)
        if FIRST > 0:  # the forward's first deletion: N_l = N_0, no intervention before
            n_visual = tl.zeros_like(removed) + FIRST
            interventions = gate
        else:
            n_visual = tl.load(NVIS + seq, mask=live, other=1).to(tl.int64)
            interventions = tl.load(INTERV + seq, mask=live, other=0).to(tl.int64) + gate
        rho = tl.math.div_rn(removed.to(tl.float32), n_visual.to(tl.float32))  # (IEEE, as torch.div)
        return n_visual, interventions, rho, tl.load(FLOPS + seq, mask=live, other=0.0)

    @triton.jit
    def _write_layout(LENGTHS, CU_OUT, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, LEFT, seq, mine, lengths, cu, left,
                      n_visual, removed, rho, interventions, flops, BOOKS: tl.constexpr):
        """The new lengths and ``cu_seqlens[1:]`` of the sequences ``mine``, and their books."""
        tl.store(LENGTHS + seq, lengths.to(LENGTHS.dtype.element_ty), mask=mine)
        tl.store(CU_OUT + 1 + seq, cu.to(CU_OUT.dtype.element_ty), mask=mine)
        if BOOKS:
            tl.store(NVIS + seq, n_visual - removed, mask=mine)
            tl.store(RHO + seq, rho, mask=mine)
            tl.store(INTERV + seq, interventions, mask=mine)
            tl.store(REC_REMOVED + seq, removed, mask=mine)
            tl.store(REC_FLOPS + seq, flops, mask=mine)
            tl.store(LEFT + seq * 0, left + seq * 0, mask=(seq == 0) & mine)

    @triton.jit
    def _compact(REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch, SIZES, SIZES_OUT,
                 GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS, REC_REMOVE,
                 LEFT, bound, COUNTS, n_blocks, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
                 HAS_SIZES: tl.constexpr, BOOKS: tl.constexpr, FIRST: tl.constexpr, MULTI: tl.constexpr,
                 BLOCK_NB: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = offs < rows
        keep = (tl.load(REMOVE + offs, mask=inside, other=1) == 0) & inside
        keep_i = keep.to(tl.int32)
        if MULTI:  # the survivors of the programs before this one (_block_counts), and of all
            nb = tl.arange(0, BLOCK_NB)
            counts = tl.load(COUNTS + nb, mask=nb < n_blocks, other=0)
            base = tl.sum(tl.where(nb < pid, counts, 0), 0)
            total = tl.sum(counts, 0)
        else:
            base = 0
            total = tl.sum(keep_i, 0)
        dest = base + tl.cumsum(keep_i, 0) - keep_i  # a survivor's new row: the survivors before it
        fill = inside & (offs >= total)  # past the survivors: copies of row 0 (nonzero_static's fill)
        ids = tl.load(IDS + offs, mask=inside, other=0)
        first_id = tl.load(IDS + offs * 0, mask=fill, other=0)  # ids[0] where it is filled in
        if HAS_SIZES:  # (merge) the rows' sizes, gathered the same way (in place: one program only)
            sizes = tl.load(SIZES + offs, mask=inside, other=0.0)
            first_size = tl.load(SIZES + offs * 0, mask=fill, other=0.0)
        seq, live, removed, lengths, cu = _new_layout(CU, REMOVED, batch, BLOCK_B)
        head = (seq * 0 + pid) == 0  # (MULTI: the first program alone writes the layout and books)
        left = tl.sum(lengths, 0)
        n_visual, interventions, rho, flops = removed, removed, removed.to(tl.float32), removed.to(tl.float64)
        if BOOKS:
            n_visual, interventions, rho, flops = _read_books(GATE, FLOPS, NVIS, INTERV, seq, live, removed, FIRST)
            if bound > 0:  # more rows than the plan's bound: every entry clamped below it
                cu = tl.where(left > bound, tl.minimum(cu, bound - 1), cu)
        # everything read before anything is written: IDS_OUT may be IDS and CU_OUT may be CU (the
        # graph compacts its fixed buffers in place), and threads of one program do not run in step
        tl.debug_barrier()
        tl.store(INDEX + dest, offs, mask=keep)
        tl.store(INDEX + offs, tl.zeros_like(offs), mask=fill)
        tl.store(IDS_OUT + dest, ids, mask=keep)
        tl.store(IDS_OUT + offs, first_id, mask=fill)
        if HAS_SIZES:
            tl.store(SIZES_OUT + dest, sizes, mask=keep)
            tl.store(SIZES_OUT + offs, first_size, mask=fill)
        _write_layout(LENGTHS, CU_OUT, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, LEFT, seq, live & head, lengths, cu,
                      left, n_visual, removed, rho, interventions, flops, BOOKS)
        if BOOKS:
            tl.store(REC_IDS + offs, ids, mask=inside)
            tl.store(REC_REMOVE + offs, ~keep & inside, mask=inside)

    @triton.jit
    def _compact_span(REMOVE, IDS, IDS_OUT, INDEX, SIZES, SIZES_OUT, REC_IDS, REC_REMOVE, start, end, base,
                      BLOCK_S: tl.constexpr, HAS_SIZES: tl.constexpr, BOOKS: tl.constexpr):
        """Rows ``[start, end)``' survivors, in order, to rows ``base`` onwards of the index, the
        ids and the sizes (``BLOCK_S`` rows at a time); returns ``base`` plus their number."""
        for c0 in range(start, end, BLOCK_S):
            offs = c0 + tl.arange(0, BLOCK_S)
            inside = offs < end
            keep = (tl.load(REMOVE + offs, mask=inside, other=1) == 0) & inside
            k = keep.to(tl.int32)
            dest = base + tl.cumsum(k, 0) - k
            ids = tl.load(IDS + offs, mask=inside, other=0)
            tl.store(INDEX + dest, offs, mask=keep)
            tl.store(IDS_OUT + dest, ids, mask=keep)
            if HAS_SIZES:
                tl.store(SIZES_OUT + dest, tl.load(SIZES + offs, mask=keep, other=0.0), mask=keep)
            if BOOKS:
                tl.store(REC_IDS + offs, ids, mask=inside)
                tl.store(REC_REMOVE + offs, ~keep & inside, mask=inside)
            base += tl.sum(k, 0)
        return base

    @triton.jit
    def _compact_program(i, REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch, SIZES, SIZES_OUT,
                         GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS, REC_REMOVE, LEFT, bound,
                         BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, HAS_SIZES: tl.constexpr, BOOKS: tl.constexpr,
                         FIRST: tl.constexpr):
        """Program ``i`` of the compaction by image (:func:`compact_rows`' ``per_image``): image
        ``i``'s rows to the new start of its sequence (``i < batch``); the last (``i == batch``),
        the rows past the last sequence, the fill (copies of row 0), the new layout and the books.
        Nothing is written where another program reads (IDS_OUT, CU_OUT and SIZES_OUT are not the
        inputs), and a sequence's new start is taken from ``removed``, which its flags agree with."""
        seq, live, removed, lengths, cu = _new_layout(CU, REMOVED, batch, BLOCK_B)
        if i < batch:
            start = tl.load(CU + i)
            _compact_span(REMOVE, IDS, IDS_OUT, INDEX, SIZES, SIZES_OUT, REC_IDS, REC_REMOVE, start,
                          tl.load(CU + i + 1), tl.sum(tl.where(seq < i, lengths, 0), 0).to(start.dtype),
                          BLOCK_S, HAS_SIZES, BOOKS)
        else:
            real = tl.load(CU + batch)
            left = tl.sum(lengths, 0)
            kept = _compact_span(REMOVE, IDS, IDS_OUT, INDEX, SIZES, SIZES_OUT, REC_IDS, REC_REMOVE, real, rows,
                                 left.to(real.dtype), BLOCK_S, HAS_SIZES, BOOKS)
            for c0 in range(kept, rows, BLOCK_S):  # past the survivors: copies of row 0 (nonzero_static's fill)
                offs = c0 + tl.arange(0, BLOCK_S)
                fill = offs < rows
                tl.store(INDEX + offs, tl.zeros_like(offs), mask=fill)
                tl.store(IDS_OUT + offs, tl.load(IDS + offs * 0, mask=fill, other=0), mask=fill)
                if HAS_SIZES:
                    tl.store(SIZES_OUT + offs, tl.load(SIZES + offs * 0, mask=fill, other=0.0), mask=fill)
            n_visual, interventions, rho, flops = removed, removed, removed.to(tl.float32), removed.to(tl.float64)
            if BOOKS:
                n_visual, interventions, rho, flops = _read_books(GATE, FLOPS, NVIS, INTERV, seq, live, removed, FIRST)
                if bound > 0:  # more rows than the plan's bound: every entry clamped below it
                    cu = tl.where(left > bound, tl.minimum(cu, bound - 1), cu)
            tl.debug_barrier()  # (the history read before it is rewritten in place)
            _write_layout(LENGTHS, CU_OUT, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, LEFT, seq, live, lengths, cu,
                          left, n_visual, removed, rho, interventions, flops, BOOKS)

    @triton.jit
    def _compact_images(REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch, SIZES, SIZES_OUT,
                        GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS, REC_REMOVE, LEFT, bound,
                        BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, HAS_SIZES: tl.constexpr, BOOKS: tl.constexpr,
                        FIRST: tl.constexpr):
        _compact_program(tl.program_id(0), REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch,
                         SIZES, SIZES_OUT, GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS, REC_REMOVE,
                         LEFT, bound, BLOCK_S, BLOCK_B, HAS_SIZES, BOOKS, FIRST)

    @triton.jit
    def _pick_compact(SIM, X, SIZES, REMOVE, CU_PICK, ACC, MASS, sx_t, n_tiles,
                      IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch, SIZES_OUT,
                      GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS, REC_REMOVE, LEFT, bound,
                      NUM_PREFIX: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, BOOKS: tl.constexpr,
                      FIRST: tl.constexpr):
        """:func:`~timm_dora.engine.fold_kernel._pick`'s programs (the first ``n_tiles`` of each
        image's column) and :func:`_compact_program`'s (the last of each column, and a column past
        the images for the last one): the two read the same flags and write nothing the other reads."""
        if tl.program_id(0) < n_tiles:
            if tl.program_id(1) < batch:
                _pick(SIM, X, SIZES, REMOVE, CU_PICK, ACC, MASS, sx_t, NUM_PREFIX, NP, D, BLOCK_M, BLOCK_D)
        else:
            _compact_program(tl.program_id(1), REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch,
                             SIZES, SIZES_OUT, GATE, FLOPS, NVIS, RHO, INTERV, REC_REMOVED, REC_FLOPS, REC_IDS,
                             REC_REMOVE, LEFT, bound, BLOCK_S, BLOCK_B, True, BOOKS, FIRST)

    @triton.jit
    def _gather_rows(X, INDEX, OUT, rows, stride_x, stride_o, SIZES, SIZES_FROM, ACC, MASS, CU_FROM, CU_TO, n_cu,
                     IDS_FROM, IDS_TO, W, B, NORMED, stride_n, eps,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FOLD: tl.constexpr,
                     COPY_SIZES: tl.constexpr, COPY_CU: tl.constexpr, BLOCK_CU: tl.constexpr, NORM: tl.constexpr,
                     COPY_IDS: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        src_row = tl.load(INDEX + r, mask=live, other=0).to(tl.int64)
        src = src_row * stride_x
        dst = r.to(tl.int64) * stride_o
        if FOLD or COPY_SIZES:  # (_compact gathered the sizes already: into SIZES, or aside into SIZES_FROM)
            size = tl.load(SIZES_FROM + r, mask=live, other=1.0)
        if FOLD:  # the fold's finish (fold_kernel._finish) on the way: the rows that received
            extra = tl.load(MASS + src_row, mask=live, other=0.0)
            got = live & (extra > 0)
        for c0 in tl.static_range(0, D, BLOCK_D):
            cs = c0 + tl.arange(0, BLOCK_D)
            m = live[:, None] & (cs < D)[None, :]
            v = tl.load(X + src[:, None] + cs[None, :], mask=m)
            if FOLD:
                fm = got[:, None] & (cs < D)[None, :]
                acc = tl.load(ACC + src_row[:, None] * D + cs[None, :], mask=fm, other=0.0)
                v = _received_mean(v, size, extra, acc, got)  # (the fold's own finish, fold_kernel._finish)
                # (every warp's loads of the sums done before any is zeroed: the store's layout
                # may not be the load's, as in fold_kernel._finish)
                tl.debug_barrier()
                tl.store(ACC + src_row[:, None] * D + cs[None, :], tl.zeros_like(acc), mask=fm)  # (back to zeros)
            tl.store(OUT + dst[:, None] + cs[None, :], v, mask=m)
            if NORM:  # (the row is this one chunk) the LayerNorm after the deletion, as dense_kernels' kernel
                y = _normalized(v.to(tl.float32), m, cs, W, B, D, eps)
                tl.store(NORMED + r.to(tl.int64)[:, None] * stride_n + cs[None, :], y.to(v.dtype), mask=m)
        if FOLD:  # (every warp's reads of the sizes and the mass done before any is rewritten)
            tl.debug_barrier()
            tl.store(SIZES + r, size + extra, mask=live)
            tl.store(MASS + src_row, tl.zeros_like(extra), mask=got)
        elif COPY_SIZES:
            tl.store(SIZES + r, size, mask=live)
        if COPY_IDS:  # the compacted ids from where the compaction by image left them
            tl.store(IDS_TO + r, tl.load(IDS_FROM + r, mask=live, other=0), mask=live)
        if COPY_CU:  # the new cu_seqlens[1:] from where _compact left them, by the first program
            c = 1 + tl.arange(0, BLOCK_CU)
            mine = (c < n_cu) & ((c * 0 + tl.program_id(0)) == 0)
            tl.store(CU_TO + c, tl.load(CU_FROM + c, mask=mine, other=0), mask=mine)


# gather_rows' norm: (weight, bias, eps, normed): a LayerNorm of the gathered rows into normed
Norm = Tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]


def fused_deletion_reason(x: torch.Tensor, remove: torch.Tensor) -> Optional[str]:
    """Why :func:`delete_rows_fused` cannot take these rows (``None``: it can)."""
    if triton is None:
        return "the triton package is not installed"
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPES:
        return f"x must be [rows, d] float32/float16/bfloat16 with unit column stride, got {x.dtype} {tuple(x.shape)}"
    if remove.shape != (x.shape[0],) or remove.dtype != torch.bool or remove.stride(0) != 1:
        return f"remove must be a contiguous [{x.shape[0]}] bool vector, got {remove.dtype} {tuple(remove.shape)}"
    return None


def _check_layout(rows: int, ids: torch.Tensor, ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                  lengths_out: torch.Tensor, cu_out: torch.Tensor) -> None:
    b = removed.shape[0]
    if ids.shape != (rows,) or ids_out.shape != (rows,) or cu.shape != (b + 1,) or lengths_out.shape != (b,) \
            or cu_out.shape != (b + 1,):
        raise ValueError(f"ids/ids_out [{rows}], cu/cu_out [{b + 1}], lengths_out [{b}] expected, got "
                         f"{tuple(ids.shape)}, {tuple(ids_out.shape)}, {tuple(cu.shape)}, {tuple(cu_out.shape)}, "
                         f"{tuple(lengths_out.shape)}")


def _check_books(books: Books, rows: int, b: int) -> None:
    k = books
    vectors = {"gate": (k.gate, torch.bool), "flops": (k.flops, torch.float64), "n_visual": (k.n_visual, torch.long),
               "rho": (k.rho, torch.float32), "interventions": (k.interventions, torch.long),
               "rec_removed": (k.rec_removed, torch.long),
               "rec_flops": (k.rec_flops, torch.float64)}
    for name, (t, dtype) in vectors.items():
        if t.shape != (b,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"delete_rows_fused: books.{name} must be a contiguous [{b}] {dtype} vector, got "
                             f"{t.dtype} {tuple(t.shape)}")
    for name, t, dtype, n in (("rec_ids", k.rec_ids, torch.long, rows), ("rec_remove", k.rec_remove, torch.bool, rows),
                              ("left", k.left, torch.long, 1)):
        if t.dim() != 1 or t.shape[0] < n or t.dtype != dtype or t.stride(0) != 1:
            raise ValueError(f"delete_rows_fused: books.{name} must be a [>= {n}] {dtype} vector, got {t.dtype} "
                             f"{tuple(t.shape)}")


def delete_rows_reference(x: torch.Tensor, remove: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                          ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                          lengths_out: torch.Tensor, cu_out: torch.Tensor, sizes: Optional[torch.Tensor] = None,
                          books: Optional[Books] = None) -> torch.Tensor:
    """The deletion step in PyTorch ops (the captured controller's code before this module), into
    the given buffers; returns the gather index ``[rows]``.

    ``x`` ``[rows, d]``: the rows (padded past ``cu[-1]``: those are never removed); ``remove``
    ``[rows]`` bool; ``out`` ``[>= rows, d]``, not overlapping ``x``: its first ``rows`` rows get the
    survivors in order, then copies of row 0; ``ids`` ``[rows]``: per-row ids gathered the same way
    into ``ids_out`` (may be ``ids``); ``cu`` ``[B + 1]``: the layout before; ``removed`` ``[B]``:
    the rows removed per sequence (the per-sequence count of ``remove``); ``lengths_out`` ``[B]``
    and ``cu_out`` ``[B + 1]`` (may be ``cu``; ``cu_out[0]`` is left as it is, 0): the layout after.
    ``sizes`` (merge): ``[rows]`` float32, the rows' sizes, gathered the same way in place.
    ``books``: also keep the whole forward's books (:class:`Books`, :func:`keep_books_reference`)."""
    rows = x.shape[0]
    _check_layout(rows, ids, ids_out, cu, removed, lengths_out, cu_out)
    if books is not None:
        books.rec_ids[:rows].copy_(ids)  # (before ids_out, which may be ids, is rewritten)
    # packing.gather_survivors' ops (survivors first, then row 0), then the layout's
    index = torch.nonzero_static(~remove, size=rows, fill_value=0).squeeze(1)
    torch.index_select(x, 0, index, out=out[:rows])
    ids_out.copy_(ids.index_select(0, index))
    if sizes is not None:
        sizes.copy_(sizes.index_select(0, index))
    lengths_out.copy_((cu[1:] - cu[:-1]) - removed)
    torch.cumsum(lengths_out, 0, dtype=cu_out.dtype, out=cu_out[1:])
    if books is not None:
        keep_books_reference(books, remove[:rows], removed, cu_out)
    return index


def keep_books_reference(books: Books, remove: torch.Tensor, removed: torch.Tensor, cu_out: torch.Tensor) -> None:
    """The books of a deletion (:class:`Books`, all but the ids before it) in PyTorch ops, from its
    ``remove`` flags ``[rows]``, ``removed`` ``[B]`` and new ``cu_out`` ``[B + 1]`` (clamped here
    where the rows left exceed ``books.bound``): what the whole graph ran before the kernel."""
    b = books
    b.rec_removed.copy_(removed)
    b.rec_flops.copy_(b.flops)
    b.rec_remove[:remove.shape[0]].copy_(remove)
    if b.first:
        b.n_visual.fill_(b.first)
        b.interventions.zero_()
    torch.div(removed, b.n_visual, out=b.rho)  # rho_{l+1} = k_l / N_l, then N_{l+1} = N_l - k_l
    b.n_visual.sub_(removed)
    b.interventions.add_(b.gate)
    b.left.copy_(cu_out[-1:] - cu_out[:1])
    if b.bound:
        cu_out.copy_(torch.where(cu_out[-1] > b.bound, cu_out.clamp(max=b.bound - 1), cu_out))


def delete_rows_fused(x: torch.Tensor, remove: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                      ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                      lengths_out: torch.Tensor, cu_out: torch.Tensor, sizes: Optional[torch.Tensor] = None,
                      books: Optional[Books] = None, block_rows: Optional[int] = None,
                      received: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                      norm: Optional[Norm] = None) -> torch.Tensor:
    """:func:`delete_rows_reference` in two Triton kernels (the same arguments and results, the
    index as int32; the sizes and the books in the first): :func:`compact_rows`, then
    :func:`gather_rows`. Raises ``ValueError`` where :func:`fused_deletion_reason` says why not.

    Above :data:`MAX_ROWS` rows (or with ``block_rows``: the tests' small blocks) the index is
    made by programs of ``block_rows`` (default :data:`BLOCK_ROWS`) rows each, after a kernel that
    counts each one's survivors; the ids and sizes are then gathered into scratch and copied back
    (a program's survivors land in rows other programs may not have read yet): five kernels,
    where the PyTorch ops of a batch of 320 Tiny images are about 25.

    ``received`` (merge, ``EngineOptions.fold_in_gather``): the float32 accumulator ``[>= rows, d]``
    and mass ``[>= rows]`` of a fold left unfinished (:func:`~timm_dora.engine.fold_kernel.fold_rows`
    with ``finish=False``): the gather finishes it on the way, as the fold's own last kernel would
    have before the deletion (each row that received: ``(x * size + received) / (size + mass)``,
    its size plus its mass; both back to zeros). ``x`` is then the rows before the finish and
    ``sizes`` (required) their sizes. Row 0, which the rows past the survivors copy, must not have
    received (a prefix row: the fold never folds into one). ``norm``: as for :func:`gather_rows`."""
    why = fused_deletion_reason(x, remove)
    if why is not None:
        raise ValueError(f"delete_rows_fused: {why}")
    _check_gather(x, out, sizes, received, None, None, None, norm)
    index = compact_rows(remove, ids, ids_out, cu, removed, lengths_out, cu_out, sizes, books=books,
                         block_rows=block_rows)
    gather_rows(x, index, out, sizes, received=received, norm=norm)
    return index


def _check_sizes(rows: int, **vectors: Optional[torch.Tensor]) -> None:
    """Each given vector of sizes: a contiguous ``[rows]`` float32 vector."""
    for name, t in vectors.items():
        if t is not None and (t.shape != (rows,) or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"delete_rows_fused: {name} must be a contiguous [{rows}] float32 vector")


def _check_gather(x: torch.Tensor, out: torch.Tensor, sizes: Optional[torch.Tensor],
                  received: Optional[Tuple[torch.Tensor, torch.Tensor]], sizes_from: Optional[torch.Tensor],
                  cu_from: Optional[torch.Tensor], cu_out: Optional[torch.Tensor], norm: Optional[Norm] = None) -> None:
    """:func:`gather_rows`'s arguments, checked before anything is written."""
    rows, d = x.shape
    if norm is not None:
        weight, bias, _, normed = norm
        if d > GATHER_BLOCK_D or weight.shape != (d,) or bias.shape != (d,) or normed.dim() != 2 \
                or normed.shape[0] < rows or normed.shape[1] != d or normed.stride(1) != 1 or normed.dtype != x.dtype:
            raise ValueError(f"gather_rows: norm takes rows of at most {GATHER_BLOCK_D} channels, a weight and a bias "
                             f"[{d}] and normed [>= {rows}, {d}] {x.dtype} with unit column stride")
    if out.dim() != 2 or out.shape[0] < rows or out.shape[1] != d or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [>= {rows}, {d}] {x.dtype} with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if received is not None:
        acc, mass = received
        if sizes is None or acc.dim() != 2 or acc.shape[0] < rows or acc.shape[1] != d or not acc.is_contiguous() \
                or acc.dtype != torch.float32 or mass.dim() != 1 or mass.shape[0] < rows \
                or mass.dtype != torch.float32 or not mass.is_contiguous():
            raise ValueError(f"delete_rows_fused: received must be a contiguous float32 [>= {rows}, {d}] accumulator "
                             f"and [>= {rows}] mass, with the sizes")
    _check_sizes(rows, sizes=sizes, sizes_from=sizes_from)
    if sizes_from is not None and sizes is None:
        raise ValueError("gather_rows: sizes_from is copied into sizes, which must be given")
    if (cu_from is None) != (cu_out is None) or (cu_from is not None and (
            cu_from.shape != cu_out.shape or cu_from.dim() != 1 or cu_from.dtype != cu_out.dtype
            or not (cu_from.is_contiguous() and cu_out.is_contiguous()))):
        raise ValueError("gather_rows: cu_from and cu_out come together, contiguous vectors of one shape and dtype")


def compact_rows(remove: torch.Tensor, ids: torch.Tensor, ids_out: torch.Tensor, cu: torch.Tensor,
                 removed: torch.Tensor, lengths_out: torch.Tensor, cu_out: torch.Tensor,
                 sizes: Optional[torch.Tensor] = None, sizes_out: Optional[torch.Tensor] = None,
                 books: Optional[Books] = None, block_rows: Optional[int] = None,
                 index: Optional[torch.Tensor] = None, per_image: bool = False) -> torch.Tensor:
    """:func:`delete_rows_fused`'s first kernel (or, above :data:`MAX_ROWS` rows, three): the
    gather index ``[rows]`` int32 (into ``index`` when given), the ids, the new lengths and
    ``cu_out``, the sizes gathered into ``sizes_out`` (default: ``sizes``, in place) and the books.
    It reads no row of ``x``: with ``cu_out`` and ``sizes_out`` other than what a fold reads (``cu``,
    ``sizes``), it can run beside the fold, and :func:`gather_rows` copies them back
    (``EngineOptions.compact_beside_fold``).

    ``per_image``: a program per image and one for the rows past the last (:func:`_compact_program`),
    none of them waiting on another: each image's survivors go to its sequence's new start, taken
    from ``removed``, ``block_rows`` (default :data:`PER_IMAGE_ROWS`) rows at a time. Nothing is
    compacted in place then: ``ids_out``, ``cu_out`` and ``sizes_out`` must be buffers other than
    ``ids``, ``cu`` and ``sizes`` (what :func:`pick_and_compact` runs beside the fold's pick)."""
    rows, b, sizes_out, index, k = _compaction_args(remove, ids, ids_out, cu, removed, lengths_out, cu_out, sizes,
                                                    sizes_out, books, index, per_image, "compact_rows")
    if per_image:
        _compact_images[(b + 1,)](remove, ids, ids_out, index, cu, removed, lengths_out, cu_out, rows, b,
                                  *_sizes_pointers(remove, sizes, sizes_out), *_books_pointers(k),
                                  BLOCK_S=triton.next_power_of_2(block_rows or PER_IMAGE_ROWS),
                                  BLOCK_B=triton.next_power_of_2(max(b, 1)),
                                  HAS_SIZES=sizes is not None, BOOKS=books is not None, FIRST=k.first, num_warps=4)
        return index
    multi = block_rows is not None or rows > MAX_ROWS
    if multi:
        block_t = triton.next_power_of_2(block_rows or BLOCK_ROWS)
        n_blocks = max(1, triton.cdiv(rows, block_t))  # (no rows: one program still writes the layout)
        counts = torch.empty(n_blocks, dtype=torch.int32, device=remove.device)
        _block_counts[(n_blocks,)](remove, counts, rows, BLOCK_T=block_t, num_warps=8 if block_t > 1024 else 4)
        ids_into = torch.empty_like(ids_out)
        sizes_into = None if sizes is None else (torch.empty_like(sizes) if sizes_out is sizes else sizes_out)
    else:
        block_t, n_blocks, counts = triton.next_power_of_2(max(rows, 1)), 1, remove
        ids_into, sizes_into = ids_out, sizes_out
    _compact[(n_blocks,)](remove, ids, ids_into, index, cu, removed, lengths_out, cu_out, rows, b,
                          *_sizes_pointers(remove, sizes, sizes_into), *_books_pointers(k), counts, n_blocks,
                          BLOCK_T=block_t, BLOCK_B=triton.next_power_of_2(max(b, 1)), HAS_SIZES=sizes is not None,
                          BOOKS=books is not None, FIRST=k.first, MULTI=multi,
                          BLOCK_NB=triton.next_power_of_2(n_blocks), num_warps=8 if block_t > 1024 else 4)
    if multi:
        ids_out.copy_(ids_into)
        if sizes is not None and sizes_into is not sizes_out:
            sizes_out.copy_(sizes_into)
    return index


def _compaction_args(remove, ids, ids_out, cu, removed, lengths_out, cu_out, sizes, sizes_out, books, index,
                     per_image: bool, caller: str):
    """The compaction's arguments checked: ``(rows, images, sizes_out, index, books or unused
    pointers)``."""
    rows = remove.shape[0]
    _check_layout(rows, ids, ids_out, cu, removed, lengths_out, cu_out)
    if not (ids.is_contiguous() and ids_out.is_contiguous() and cu.is_contiguous() and cu_out.is_contiguous()
            and removed.is_contiguous() and lengths_out.is_contiguous()):
        raise ValueError("delete_rows_fused: ids, cu, removed and the outputs must be contiguous")
    b = removed.shape[0]
    sizes_out = sizes if sizes_out is None else sizes_out
    _check_sizes(rows, sizes=sizes, sizes_out=sizes_out)
    if per_image and (_shares(ids, ids_out) or _shares(cu, cu_out) or (sizes is not None and _shares(sizes, sizes_out))):
        raise ValueError(f"{caller}: the compaction by image writes ids_out, cu_out and sizes_out while other programs "
                         "still read ids, cu and sizes: give other buffers")
    if books is not None:
        _check_books(books, rows, b)
    if index is None:
        index = torch.empty(rows, dtype=torch.int32, device=remove.device)
    elif index.shape != (rows,) or index.dtype != torch.int32 or not index.is_contiguous():
        raise ValueError(f"{caller}: index must be a contiguous [{rows}] int32 vector")
    k = books if books is not None else Books(*([remove] * 5), 0, *([remove] * 5), 0)  # (unused pointers)
    return rows, b, sizes_out, index, k


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _sizes_pointers(remove: torch.Tensor, sizes: Optional[torch.Tensor], sizes_out: Optional[torch.Tensor]):
    return (sizes, sizes_out) if sizes is not None else (remove, remove)  # (unused pointers without sizes)


def _books_pointers(k: Books):
    """The kernels' book arguments, from ``gate`` to ``bound``."""
    return (k.gate, k.flops, k.n_visual, k.rho, k.interventions, k.rec_removed, k.rec_flops, k.rec_ids, k.rec_remove,
            k.left, k.bound)


def pick_and_compact(similarities: torch.Tensor, x: torch.Tensor, sizes: torch.Tensor, remove: torch.Tensor,
                     cu_pick: torch.Tensor, max_len: int, num_prefix: int,
                     scratch: Tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, ids_out: torch.Tensor,
                     cu: torch.Tensor, removed: torch.Tensor, lengths_out: torch.Tensor, cu_out: torch.Tensor,
                     sizes_out: torch.Tensor, books: Optional[Books] = None,
                     index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The merging fold's pick and the deletion's compaction in one launch: what
    :func:`~timm_dora.engine.fold_kernel.fold_rows` does with ``similarities`` and ``finish=False``
    (each removed row's best survivor read from its row of products, its size-weighted values and
    size added to ``scratch``, the accumulator and the mass) and what :func:`compact_rows` does with
    ``per_image`` (the index, returned, the ids, the layout, the sizes and the books), side by side:
    both read only the decision's flags, the layout and the sizes. ``cu_pick``: the layout the fold
    reads (the controller's ``cu_seqlens``), ``cu``: the one compacted (the same rows). Arguments
    as for those two; ``ids_out``, ``cu_out`` and ``sizes_out`` are other buffers than ``ids``,
    ``cu`` and ``sizes``, which :func:`gather_rows` copies back (``ids_from``, ``cu_from``,
    ``sizes_from``) when it finishes the fold (``received=scratch``). One kernel where the two were
    two on the chain a request waits for (``EngineOptions.compact_in_pick``)."""
    rows, d = x.shape
    if remove.shape != (rows,) or sizes.shape != (rows,) or x.stride(1) != 1:
        raise ValueError(f"pick_and_compact: x [{rows}, d] with unit column stride, remove and sizes [{rows}] expected, "
                         f"got {tuple(x.shape)}, {tuple(remove.shape)}, {tuple(sizes.shape)}")
    columns = similarity_columns(max_len)
    _check_similarities(similarities, rows, columns, "pick_and_compact: similarities (fold_similarities')")
    acc, mass = scratch[0][:rows], scratch[1][:rows]
    if acc.shape != (rows, d) or not acc.is_contiguous() or mass.shape != (rows,) or cu_pick.shape != cu.shape:
        raise ValueError(f"pick_and_compact: scratch must hold [{rows}, {d}] and [{rows}] rows and cu_pick be "
                         f"[{cu.shape[0]}], got {tuple(scratch[0].shape)}, {tuple(scratch[1].shape)}, "
                         f"{tuple(cu_pick.shape)}")
    rows, b, sizes_out, index, k = _compaction_args(remove, ids, ids_out, cu, removed, lengths_out, cu_out, sizes,
                                                    sizes_out, books, index, True, "pick_and_compact")
    tiles = -(-max_len // PICK_ROWS)
    _pick_compact[(tiles + 1, b + 1)](similarities, x, sizes, remove, cu_pick.to(torch.int32), acc, mass, x.stride(0),
                                      tiles, ids, ids_out, index, cu, removed, lengths_out, cu_out, rows, b, sizes_out,
                                      *_books_pointers(k), NUM_PREFIX=num_prefix, NP=columns, D=d, BLOCK_M=PICK_ROWS,
                                      BLOCK_D=min(256, triton.next_power_of_2(d)), BLOCK_S=PER_IMAGE_ROWS,
                                      BLOCK_B=triton.next_power_of_2(max(b, 1)), BOOKS=books is not None,
                                      FIRST=k.first, num_warps=4)
    return index


def gather_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor, sizes: Optional[torch.Tensor] = None,
                received: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                sizes_from: Optional[torch.Tensor] = None, cu_from: Optional[torch.Tensor] = None,
                cu_out: Optional[torch.Tensor] = None, norm: Optional[Norm] = None,
                ids_from: Optional[torch.Tensor] = None, ids_out: Optional[torch.Tensor] = None) -> None:
    """:func:`delete_rows_fused`'s second kernel: the rows of ``x`` ``[rows, d]`` by ``index``
    (:func:`compact_rows`'s) into ``out``'s first ``rows`` rows; with ``received``, the fold's
    finish on the way (``sizes`` required, see :func:`delete_rows_fused`). Where
    :func:`compact_rows` left the compacted sizes in ``sizes_from``, the new cu_seqlens in
    ``cu_from`` (beside a fold) and the ids in ``ids_from`` (by image), they are copied into
    ``sizes``, ``cu_out[1:]`` and ``ids_out`` on the way.
    ``norm``: ``(weight, bias, eps, normed)``: also the LayerNorm of each gathered row into
    ``normed``'s first ``rows`` rows (the block's ``norm2``, which its MLP then does not compute),
    with :func:`~timm_dora.engine.dense_kernels.layer_norm_triton`'s arithmetic; rows of at most
    :data:`GATHER_BLOCK_D` channels."""
    _check_gather(x, out, sizes, received, sizes_from, cu_from, cu_out, norm)
    rows, d = x.shape
    if index.shape != (rows,) or index.dtype != torch.int32:
        raise ValueError(f"gather_rows: index must be [{rows}] int32, got {index.dtype} {tuple(index.shape)}")
    if (ids_from is None) != (ids_out is None) or (ids_from is not None and (
            ids_from.shape != (rows,) or ids_out.shape != (rows,) or ids_from.dtype != ids_out.dtype
            or not (ids_from.is_contiguous() and ids_out.is_contiguous()))):
        raise ValueError(f"gather_rows: ids_from and ids_out come together, contiguous [{rows}] vectors of one dtype")
    fold, n_cu = received is not None, 0 if cu_out is None else cu_out.shape[0]
    grid = max(triton.cdiv(rows, 16), 1 if n_cu else 0)  # (no rows: one program still copies cu)
    if grid:
        _gather_rows[(grid,)](x, index, out, rows, x.stride(0), out.stride(0),
                              sizes if sizes is not None else x, sizes_from if sizes_from is not None else
                              (sizes if sizes is not None else x), received[0] if fold else x,
                              received[1] if fold else x, cu_from if n_cu else index, cu_out if n_cu else index,
                              n_cu, *((ids_from, ids_out) if ids_from is not None else (index, index)),
                              *((norm[0], norm[1], norm[3], norm[3].stride(0), norm[2]) if norm is not None
                                else (x, x, x, 0, 0.0)),
                              D=d, BLOCK_R=16, BLOCK_D=min(GATHER_BLOCK_D, triton.next_power_of_2(d)), FOLD=fold,
                              COPY_SIZES=sizes_from is not None, COPY_CU=n_cu > 0,
                              BLOCK_CU=triton.next_power_of_2(max(n_cu, 1)), NORM=norm is not None,
                              COPY_IDS=ids_from is not None, num_warps=4)
