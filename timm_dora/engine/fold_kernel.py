"""Merging's fold in Triton kernels (``wrap(..., merge=True)`` on CUDA, half precision).

:func:`~timm_dora.engine.packing.fold_removed` written in PyTorch ops makes about twenty passes
over ``[T, d]`` and ``[B, S, S]`` float32 tensors: 0.63 ms per block for DeiT-Ti at batch 320 on an
H100, replayed from a CUDA graph (``benchmarks/results/merge_modes/fold_profile_h100.json``), half
the published merging actor's forward. Here:

- :func:`_match`, one program per chunk of an image's removed rows (:func:`_listed` reads the
  image's flags and lists its removed rows by rank, so kept rows are never compared): each removed
  row's metric (its key averaged over the heads, normalised, in float32) against every surviving
  visual row of its image, tile by tile (``tl.dot`` in ``tf32x3``: float32 accuracy on tensor
  cores), a running arg-max (the first of equal maxima, as ``torch.argmax``), the best row's index
  stored for the removed rows only;
- :func:`_scatter`, each removed row's size-weighted values added (float32 atomics) to its target's
  accumulator and its size to the target's received mass;
- :func:`_finish`: for every row that received something, ``(x * size + received) / (size +
  mass)`` into ``out``, the new sizes for all rows (rows that received nothing keep their values:
  what the float32 round trip of the ops gives after rounding to half precision); then the
  accumulator and the mass back to zeros where the scatter wrote, so that a caller's ``scratch``
  serves the next fold without a memset (the sizes may be updated in place: each row's size is read
  and written by one program, after the scatter read the removed rows', and written only after a
  barrier, since every warp of the program reads it).

With precomputed similarities (:func:`fold_similarities`, ``EngineOptions.fold_aside``: the captured
graph makes them beside the actor's decision, since they need none) :func:`_pick` replaces the match
and the scatter: each removed row's best survivor read from its row of products, scattered at once.

No shape or launch depends on the values (the grid is fixed by the rows, the batch and
``max_len``), so the kernels are captured in the controller's graph like the rest; rows past
``cu_seqlens[-1]`` are neither read nor written. Off CUDA the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the CPU tests check them against the PyTorch ops.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["fold_rows", "fold_similarities", "similarity_columns",
           "SIMILARITY_MAX_COLUMNS", "fold_kernel_reason", "match_tile_for"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

# (removed rows, key rows, warps) per program of the match. Chosen on an H200 among 27 tiles at 320
# DeiT-Ti images (benchmarks/results/fold_match_h200.json.gz, `small_kernels --fold`): the fold
# 118 -> 93 us with a third of the rows removed, 100 -> 73 with a tenth, 70 -> 68 with a hundredth,
# against the earlier match of every 64-row query tile; at 64 images about 2 us slower (29 -> 31)
MATCH_TILE = (64, 32, 4)
# few images: below SMALL_MATCH_GRID programs of MATCH_TILE (up to 16 images of 197 rows),
# SMALL_MATCH_TILE, more programs, each a shorter chain: the fold 17.4 -> 16.0 us at 1-8 images,
# 22.7 -> 18.4 at 16, the fastest of the 27 there (the same JSON; the engine's default at so few
# rows is EngineOptions.fold_aside's pick, which takes no match)
SMALL_MATCH_GRID = 128
SMALL_MATCH_TILE = (16, 128, 8)
# the match reads an image's removal flags this many rows at a time to list its removed rows
FLAGS = 256
BLOCK_R = 8
# the captured graph precomputes the similarities (EngineOptions.fold_aside, up to its
# fold_aside_max_rows rows) for images of up to this many rows (a program of _pick holds 16 rows of
# that many float32 columns in registers)
SIMILARITY_MAX_COLUMNS = 256
# rows per program of _pick (the match from precomputed similarities, with the scatter)
PICK_ROWS = 16
PRECISION = "tf32x3"


if triton is not None:

    @triton.jit
    def _metric(K, rows, inside, sk_t, HEADS: tl.constexpr, HD: tl.constexpr):
        """The rows' keys averaged over the heads and normalised (float32, ``[rows, HD]``)."""
        d = tl.arange(0, HD)
        m = tl.zeros([rows.shape[0], HD], dtype=tl.float32)
        for h in tl.static_range(HEADS):
            m += tl.load(K + rows[:, None] * sk_t + h * HD + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        m = m / HEADS
        return m / tl.maximum(tl.sqrt(tl.sum(m * m, 1)), 1e-12)[:, None]

    @triton.jit
    def _removed_rows(REMOVE, CU, BLOCK_M: tl.constexpr):
        """The program's query tile (program ids: the tile, the image): the image's first row and
        length, the tile's rows and which of them are removed (none past the image)."""
        tile, seq = tl.program_id(0), tl.program_id(1)
        start = tl.load(CU + seq)
        length = tl.load(CU + seq + 1) - start
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_m = (start + offs_m).to(tl.int64)
        removed = (offs_m < length) & (tl.load(REMOVE + rows_m, mask=offs_m < length, other=0) != 0)
        return start, length, rows_m, removed

    @triton.jit
    def _survivors(REMOVE, start, offs_n, length, NUM_PREFIX: tl.constexpr):
        """Which of the image's rows ``offs_n`` a removed row may fold into: real, visual, kept."""
        inside = offs_n < length
        gone = tl.load(REMOVE + (start + offs_n).to(tl.int64), mask=inside, other=1) != 0
        return inside & (offs_n >= NUM_PREFIX) & ~gone

    @triton.jit
    def _add_rows(X, rows, fold, target, size, ACC, MASS, sx_t, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """The ``rows`` in ``fold`` times their ``size`` added (float32 atomics) to their targets'
        accumulator rows, their sizes to the targets' mass."""
        tl.atomic_add(MASS + target, size, mask=fold)
        for c0 in tl.static_range(0, D, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            both = fold[:, None] & (c < D)[None, :]
            v = tl.load(X + rows[:, None] * sx_t + c[None, :], mask=both, other=0.0).to(tl.float32)
            tl.atomic_add(ACC + target[:, None] * D + c[None, :], v * size[:, None], mask=both)

    @triton.jit
    def _listed(REMOVE, start, length, BLOCK_M: tl.constexpr, FLAGS: tl.constexpr):
        """The image's removed rows of ranks ``program_id(0) * BLOCK_M + [0, BLOCK_M)`` in row order
        (absolute rows, int64) and which of those ranks exist: the flags read ``FLAGS`` rows at a
        time, each removed row's rank the removed rows before it."""
        slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.zeros([BLOCK_M], dtype=tl.int32)
        seen = tl.sum(tl.zeros([FLAGS], dtype=tl.int32), 0)  # removed rows before the chunk
        for n0 in range(0, length, FLAGS):
            offs = n0 + tl.arange(0, FLAGS)
            flag = (tl.load(REMOVE + (start + offs).to(tl.int64), mask=offs < length, other=0) != 0).to(tl.int32)
            rank = seen + tl.cumsum(flag, 0) - flag
            hit = (flag[None, :] != 0) & (rank[None, :] == slots[:, None])
            row += tl.sum(tl.where(hit, offs[None, :], 0), 1)
            seen += tl.sum(flag, 0)
        return (start + row).to(tl.int64), slots < seen

    @triton.jit
    def _match(K, REMOVE, CU, TARGET, sk_t, HEADS: tl.constexpr, HD: tl.constexpr, NUM_PREFIX: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAGS: tl.constexpr, PRECISION: tl.constexpr):
        """Each removed row's best surviving row among its image's (the first of equal maxima) into
        ``TARGET``; one program per ``BLOCK_M`` removed rows of an image (program ids: the chunk of
        their ranks, the image), so only removed rows are compared."""
        seq = tl.program_id(1)
        start = tl.load(CU + seq)
        length = tl.load(CU + seq + 1) - start
        rows_m, listed = _listed(REMOVE, start, length, BLOCK_M, FLAGS)
        if tl.max(listed.to(tl.int32), 0) > 0:
            q = _metric(K, rows_m, listed, sk_t, HEADS, HD)
            best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            at = tl.zeros([BLOCK_M], dtype=tl.int32)
            for n0 in range(0, length, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                survivor = _survivors(REMOVE, start, offs_n, length, NUM_PREFIX)
                k = _metric(K, (start + offs_n).to(tl.int64), survivor, sk_t, HEADS, HD)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                s = tl.where(survivor[None, :], s, float("-inf"))
                tile_best = tl.max(s, 1)
                tile_at = tl.argmax(s, 1)
                better = tile_best > best  # (strict: the first tile keeps a tie, as torch.argmax)
                at = tl.where(better, n0 + tile_at, at)
                best = tl.where(better, tile_best, best)
            tl.store(TARGET + rows_m, start + at.to(tl.int64), mask=listed)

    @triton.jit
    def _similarity(K, CU, SIM, sk_t, HEADS: tl.constexpr, HD: tl.constexpr, NP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Every row's metric against every row of its image (no decision read): ``SIM[row, j]``
        for the image's rows ``j``, the product of :func:`_match` (the same metric and precision),
        one (query tile, key tile) a program: no program loops, so few images still fill the GPU."""
        tile, key_tile, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(CU + seq)
        length = tl.load(CU + seq + 1) - start
        if (tile * BLOCK_M < length) & (key_tile * BLOCK_N < length):
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            rows_m = (start + offs_m).to(tl.int64)
            live_m = offs_m < length
            q = _metric(K, rows_m, live_m, sk_t, HEADS, HD)
            offs_n = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = offs_n < length
            k = _metric(K, (start + offs_n).to(tl.int64), inside, sk_t, HEADS, HD)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            tl.store(SIM + rows_m[:, None] * NP + offs_n[None, :], s, mask=live_m[:, None] & inside[None, :])

    @triton.jit
    def _pick(SIM, X, SIZES, REMOVE, CU, ACC, MASS, sx_t, NUM_PREFIX: tl.constexpr, NP: tl.constexpr,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """:func:`_match` and :func:`_scatter` from :func:`_similarity`'s products: each removed
        row's best surviving row (the first of equal maxima), its size-weighted values and size
        added to that row's accumulator and mass."""
        start, length, rows_m, removed = _removed_rows(REMOVE, CU, BLOCK_M)
        # every load that needs only the layout issued before any waits on the flags (few images:
        # the kernel is a chain of dependent loads, each a round trip to the L2)
        offs_n = tl.arange(0, NP)
        survivor = _survivors(REMOVE, start, offs_n, length, NUM_PREFIX)
        live = (rows_m - start) < length
        s = tl.load(SIM + rows_m[:, None] * NP + offs_n[None, :], mask=live[:, None] & (offs_n < length)[None, :],
                    other=float("-inf"))
        size = tl.load(SIZES + rows_m, mask=live, other=0.0)
        if tl.max(removed.to(tl.int32), 0) > 0:
            s = tl.where(survivor[None, :], s, float("-inf"))
            target = start + tl.argmax(s, 1, tie_break_left=True).to(tl.int64)
            _add_rows(X, rows_m, removed, target, size, ACC, MASS, sx_t, D, BLOCK_D)

    @triton.jit
    def _scatter(X, SIZES, REMOVE, TARGET, CU, ACC, MASS, sx_t, batch, D: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        real = r < tl.load(CU + batch)
        fold = real & (tl.load(REMOVE + r, mask=real, other=0) != 0)
        target = tl.load(TARGET + r, mask=fold, other=0)
        size = tl.load(SIZES + r, mask=fold, other=0.0)
        _add_rows(X, r, fold, target, size, ACC, MASS, sx_t, D, BLOCK_D)

    @triton.jit
    def _received_mean(x, size, extra, acc, got):
        """The finish of rows ``x`` (``[R, C]``, their dtype) of sizes ``size``: where a row ``got``
        something, ``(x * size + acc) / (size + extra)`` (``acc``, ``extra``: the float32 sums and
        mass it received) rounded to the dtype; elsewhere ``x`` as it is."""
        y = (x.to(tl.float32) * size[:, None] + acc) / (size + extra)[:, None]
        return tl.where(got[:, None], y.to(x.dtype), x)

    @triton.jit
    def _finish(X, SIZES, CU, ACC, MASS, OUT, NEW_SIZES, sx_t, so_t, batch, D: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, COPY: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        real = r < tl.load(CU + batch)
        size = tl.load(SIZES + r, mask=real, other=1.0)
        extra = tl.load(MASS + r, mask=real, other=0.0)
        got = real & (extra > 0)
        for c0 in tl.static_range(0, D, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            inside = (c < D)[None, :]
            x = tl.load(X + r[:, None] * sx_t + c[None, :], mask=real[:, None] & inside, other=0.0)
            acc = tl.load(ACC + r[:, None] * D + c[None, :], mask=got[:, None] & inside, other=0.0)
            y = _received_mean(x, size, extra, acc, got)
            # the chunk's loads by every warp done before any store: the compiler may store in
            # another layout than it loaded (the bf16 rows and the float32 sums), so a thread can
            # rewrite an element (OUT may be X) or zero a sum that another thread has yet to read
            tl.debug_barrier()
            if COPY:
                tl.store(OUT + r[:, None] * so_t + c[None, :], y, mask=real[:, None] & inside)
            else:  # in place: only the rows that change
                tl.store(OUT + r[:, None] * so_t + c[None, :], y, mask=got[:, None] & inside)
            # the accumulator back to zeros where the scatter wrote (only rows that received)
            tl.store(ACC + r[:, None] * D + c[None, :], tl.zeros_like(acc), mask=got[:, None] & inside)
        # likewise the sizes and the mass, which every warp reads (a row's size reaches each thread
        # of its row; NEW_SIZES may be SIZES). Without these barriers a warp ahead rewrote what
        # another had yet to read: on an H200, 320 images of 197 rows, a different 6-7 % of the rows
        # that received came out wrong each run, by up to 3 (benchmarks/results/fold_race_h200.json.gz)
        tl.debug_barrier()
        tl.store(NEW_SIZES + r, size + extra, mask=real)
        tl.store(MASS + r, tl.zeros_like(extra), mask=got)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def match_tile_for(batch: int, max_len: int) -> Tuple[int, int, int]:
    """The match's ``(removed rows, key rows, warps)`` for ``batch`` sequences of up to ``max_len``
    rows: :data:`MATCH_TILE`, or :data:`SMALL_MATCH_TILE` where :data:`MATCH_TILE`'s grid has fewer
    than :data:`SMALL_MATCH_GRID` programs (few images: each program's serial loop over the keys is
    the latency). The tile changes how rows are split among programs, not any row's arithmetic."""
    if batch * -(-max_len // MATCH_TILE[0]) < SMALL_MATCH_GRID:
        return SMALL_MATCH_TILE
    return MATCH_TILE


def fold_kernel_reason(x: torch.Tensor, keys: torch.Tensor, num_heads: int) -> Optional[str]:
    """Why :func:`fold_rows` cannot fold these rows (``None``: it can)."""
    if triton is None:
        return "the triton package is not installed"
    t, d = x.shape
    hd = keys.shape[1] // num_heads
    if keys.shape != (t, d) or keys.stride(1) != 1 or x.stride(1) != 1:
        return f"x and keys must be [T, d] with unit channel stride, got {tuple(x.shape)} and {tuple(keys.shape)}"
    if hd < 16 or hd & (hd - 1) or hd * num_heads != d:
        return f"the kernels take a power-of-two head dim of at least 16, got {hd}"
    return None


def similarity_columns(max_len: int) -> int:
    """The columns of :func:`fold_similarities`' rows for images of up to ``max_len`` rows."""
    return max(16, triton.next_power_of_2(max_len)) if triton is not None else max_len


def fold_similarities(keys: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, num_heads: int,
                      out: Optional[torch.Tensor] = None,
                      match_tile: Optional[Tuple[int, int, int]] = None) -> torch.Tensor:
    """The first half of the fold, which needs no decision: every row's metric against every row of
    its image, ``[T, similarity_columns(max_len)]`` float32 (row ``i``, column ``j``: the image's
    ``j``-th row; columns past the image's length are not written), into ``out`` (``[>= T, that]``,
    contiguous) when given. :func:`fold_rows` given these picks each removed row's match from them in
    the kernel that also scatters it: the captured graph computes them beside the actor's decision
    (``EngineOptions.fold_aside``), so the fold after the decision is two kernels of little work.
    ``keys``, ``cu_seqlens``, ``max_len``, ``num_heads``, ``match_tile``: as for :func:`fold_rows`."""
    t, d = keys.shape
    b, cu, np_ = _layout("fold_similarities", keys, keys, num_heads, cu_seqlens, max_len)
    if out is None:
        out = torch.empty((t, np_), dtype=torch.float32, device=keys.device)
    _check_similarities(out, t, np_, "fold_similarities: out")
    block_m, block_n, warps = _check_tile(match_tile_for(b, max_len) if match_tile is None else match_tile,
                                          "fold_similarities")
    grid = (-(-max_len // block_m), -(-max_len // block_n), b)
    _similarity[grid](keys, cu, out, keys.stride(0), HEADS=num_heads, HD=d // num_heads, NP=np_, BLOCK_M=block_m,
                      BLOCK_N=block_n, PRECISION=PRECISION, num_warps=warps)
    return out


def _layout(caller: str, x: torch.Tensor, keys: torch.Tensor, num_heads: int, cu_seqlens: torch.Tensor,
            max_len: int) -> Tuple[int, torch.Tensor, int]:
    """The images, ``cu_seqlens`` as int32 and the similarity columns; ``ValueError`` where the
    kernels cannot take these rows."""
    why = fold_kernel_reason(x, keys, num_heads)
    if why is not None:
        raise ValueError(f"{caller}: {why}")
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return cu_seqlens.shape[0] - 1, cu, similarity_columns(max_len)


def _check_similarities(sim: torch.Tensor, rows: int, columns: int, what: str) -> None:
    if sim.dim() != 2 or sim.shape[0] < rows or sim.shape[1] != columns or sim.dtype != torch.float32 \
            or not sim.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 [>= {rows}, {columns}], got {sim.dtype} "
                         f"{tuple(sim.shape)}")


def _check_tile(tile, caller: str = "fold_rows") -> Tuple[int, int, int]:
    tile = tuple(tile)
    if not all(_pow2(v) for v in tile) or tile[0] < 16 or tile[1] < 16 or tile[2] > 8:
        raise ValueError(f"{caller}: match_tile must be (rows, rows, warps): powers of two, rows >= 16, warps <= 8, "
                         f"got {tile}")
    return tile


def fold_rows(x: torch.Tensor, keys: torch.Tensor, remove: torch.Tensor, sizes: torch.Tensor,
              cu_seqlens: torch.Tensor, max_len: int, num_prefix: int, num_heads: int,
              out: Optional[torch.Tensor] = None, sizes_out: Optional[torch.Tensor] = None,
              scratch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
              match_tile: Optional[Tuple[int, int, int]] = None,
              similarities: Optional[torch.Tensor] = None, finish: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~timm_dora.engine.packing.fold_removed` in three kernels of this module (with
    ``similarities`` two: :func:`_pick`, then the finish), with the same arguments and results
    (``out`` may be ``x``, ``sizes_out`` may be ``sizes``). ``scratch``: a
    float32 accumulator ``[>= T, d]`` and mass ``[>= T]``, contiguous and all zeros, left all zeros
    (a graph keeps them; without, they are allocated zeroed). ``match_tile``: the match's ``(removed
    rows, key rows, warps)`` instead of :func:`match_tile_for`'s, for benchmarks. ``similarities``:
    :func:`fold_similarities` of these ``keys`` (the same ``cu_seqlens`` and ``max_len``): the match
    and the scatter are then one kernel that reads them (the same targets). ``finish=False``: no
    finish; the received sums stay in ``scratch`` (required) for the deletion's gather to finish
    (:func:`~timm_dora.engine.deletion_kernel.delete_rows_fused`'s ``received``), and ``x`` and
    ``sizes`` are returned as they are. Raises ``ValueError`` where :func:`fold_kernel_reason` says
    why not."""
    t, d = x.shape
    b, cu, np_ = _layout("fold_rows", x, keys, num_heads, cu_seqlens, max_len)
    if similarities is not None:
        _check_similarities(similarities, t, np_, "fold_rows: similarities (fold_similarities')")
    remove = remove.contiguous()
    sizes = sizes.contiguous()
    if scratch is None and not finish:
        raise ValueError("fold_rows: finish=False leaves the sums in scratch, which must be given")
    if scratch is None:
        acc = torch.zeros(t, d, dtype=torch.float32, device=x.device)
        mass = torch.zeros(t, dtype=torch.float32, device=x.device)
    else:
        acc, mass = scratch[0][:t], scratch[1][:t]
        if acc.shape != (t, d) or not acc.is_contiguous() or mass.shape != (t,):
            raise ValueError(f"fold_rows: scratch must hold [{t}, {d}] and [{t}] rows, got "
                             f"{tuple(scratch[0].shape)} and {tuple(scratch[1].shape)}")
    block_m, block_n, warps = _check_tile(match_tile_for(b, max_len) if match_tile is None else match_tile)
    rows = (-(-t // BLOCK_R),)
    block_d = min(256, triton.next_power_of_2(d))
    if similarities is not None:
        _pick[(-(-max_len // PICK_ROWS), b)](similarities, x, sizes, remove, cu, acc, mass, x.stride(0),
                                             NUM_PREFIX=num_prefix, NP=np_, D=d, BLOCK_M=PICK_ROWS, BLOCK_D=block_d,
                                             num_warps=4)
    else:
        target = torch.empty(t, dtype=torch.int64, device=x.device)
        _match[(-(-max(max_len - num_prefix, 1) // block_m), b)](
            keys, remove, cu, target, keys.stride(0), HEADS=num_heads, HD=d // num_heads, NUM_PREFIX=num_prefix,
            BLOCK_M=block_m, BLOCK_N=block_n, FLAGS=min(FLAGS, similarity_columns(max_len)), PRECISION=PRECISION,
            num_warps=warps)
        _scatter[rows](x, sizes, remove, target, cu, acc, mass, x.stride(0), b, D=d, BLOCK_R=BLOCK_R,
                       BLOCK_D=block_d, num_warps=4)
    if not finish:
        return x, sizes
    new_sizes = sizes.clone() if sizes_out is None else sizes_out  # (rows past the real ones keep theirs)
    copy = out is None or out.data_ptr() != x.data_ptr()
    out = torch.empty_like(x) if out is None else out
    _finish[rows](x, sizes, cu, acc, mass, out, new_sizes, x.stride(0), out.stride(0), b, D=d, BLOCK_R=BLOCK_R,
                  BLOCK_D=block_d, COPY=copy, num_warps=4)
    return out, new_sizes
