"""The controller graph's deletion step in two Triton kernels (``EngineOptions.fused_deletion``).

After the actor's controller decides which rows go, the captured graph compacts the packed rows:
the survivors' index (``nonzero_static``, four kernels), the gather of the rows and of their ids,
the ids copied back, the new lengths and their cumulative sum, about 13 small kernels in all. At
batches 1-16 (a few thousand rows) each costs launch latency, not bandwidth, so here they are two:

1. :func:`_compact` (one program over all rows): the survivors' new positions (an exclusive
   cumulative sum of ``~remove``) scattered into the gather index (survivors first, in order, then
   row 0, exactly ``nonzero_static(~remove, size=rows, fill_value=0)``), the ids scattered the same
   way, and the new ``lengths`` and ``cu_seqlens[1:]`` from the old ``cu_seqlens`` and ``removed``;
2. :func:`_gather_rows`: the rows of ``x`` gathered by that index (all ``rows`` rows written).

One program holds every row, so the index needs no cross-program scan; the rows are bounded by
:data:`MAX_ROWS` (the planned whole graph has at most 16 * 197 = 3152), above which the caller keeps
the PyTorch ops. Shapes are fixed and nothing is read on the host: a CUDA graph can hold both
kernels and replay them with new ``remove`` patterns.

:func:`delete_rows_reference` is the same step in today's PyTorch ops (the fallback, and what the
tests compare against). Off CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported), which is how the CPU tests check them.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MAX_ROWS", "fused_deletion_reason", "delete_rows_fused", "delete_rows_reference"]

try:  # optional: the CUDA wheels of torch depend on triton, CPU-only ones do not
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    triton = None

# one program holds all rows (the index is one in-register scan): a bound on its block, far above
# the planned whole graph's 3152 rows; more rows keep the PyTorch ops
MAX_ROWS = 8192
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


if triton is not None:

    @triton.jit
    def _compact(REMOVE, IDS, IDS_OUT, INDEX, CU, REMOVED, LENGTHS, CU_OUT, rows, batch,
                 BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
        offs = tl.arange(0, BLOCK_T)
        inside = offs < rows
        keep = (tl.load(REMOVE + offs, mask=inside, other=1) == 0) & inside
        keep_i = keep.to(tl.int32)
        dest = tl.cumsum(keep_i, 0) - keep_i  # a survivor's new row: the survivors before it
        total = tl.sum(keep_i, 0)
        fill = inside & (offs >= total)  # past the survivors: copies of row 0 (nonzero_static's fill)
        ids = tl.load(IDS + offs, mask=inside, other=0)
        first = tl.load(IDS + offs * 0, mask=fill, other=0)  # ids[0] where it is filled in
        seq = tl.arange(0, BLOCK_B)
        live = seq < batch
        start = tl.load(CU + seq, mask=live, other=0).to(tl.int64)
        end = tl.load(CU + seq + 1, mask=live, other=0).to(tl.int64)
        lengths = (end - start) - tl.load(REMOVED + seq, mask=live, other=0).to(tl.int64)
        cu = tl.cumsum(lengths, 0)
        # everything read before anything is written: IDS_OUT may be IDS and CU_OUT may be CU (the
        # graph compacts its fixed buffers in place), and threads of one program do not run in step
        tl.debug_barrier()
        tl.store(INDEX + dest, offs, mask=keep)
        tl.store(INDEX + offs, tl.zeros_like(offs), mask=fill)
        tl.store(IDS_OUT + dest, ids, mask=keep)
        tl.store(IDS_OUT + offs, first, mask=fill)
        tl.store(LENGTHS + seq, lengths.to(LENGTHS.dtype.element_ty), mask=live)
        tl.store(CU_OUT + 1 + seq, cu.to(CU_OUT.dtype.element_ty), mask=live)

    @triton.jit
    def _gather_rows(X, INDEX, OUT, rows, stride_x, stride_o,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        src = tl.load(INDEX + r, mask=live, other=0).to(tl.int64) * stride_x
        dst = r.to(tl.int64) * stride_o
        for c0 in tl.static_range(0, D, BLOCK_D):
            cs = c0 + tl.arange(0, BLOCK_D)
            m = live[:, None] & (cs < D)[None, :]
            tl.store(OUT + dst[:, None] + cs[None, :], tl.load(X + src[:, None] + cs[None, :], mask=m), mask=m)


def fused_deletion_reason(x: torch.Tensor, remove: torch.Tensor) -> Optional[str]:
    """Why :func:`delete_rows_fused` cannot take these rows (``None``: it can)."""
    if triton is None:
        return "the triton package is not installed"
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPES:
        return f"x must be [rows, d] float32/float16/bfloat16 with unit column stride, got {x.dtype} {tuple(x.shape)}"
    if remove.shape != (x.shape[0],) or remove.dtype != torch.bool or remove.stride(0) != 1:
        return f"remove must be a contiguous [{x.shape[0]}] bool vector, got {remove.dtype} {tuple(remove.shape)}"
    if x.shape[0] > MAX_ROWS:
        return f"one program takes at most MAX_ROWS={MAX_ROWS} rows, got {x.shape[0]}"
    return None


def _check_layout(rows: int, ids: torch.Tensor, ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                  lengths_out: torch.Tensor, cu_out: torch.Tensor) -> None:
    b = removed.shape[0]
    if ids.shape != (rows,) or ids_out.shape != (rows,) or cu.shape != (b + 1,) or lengths_out.shape != (b,) \
            or cu_out.shape != (b + 1,):
        raise ValueError(f"ids/ids_out [{rows}], cu/cu_out [{b + 1}], lengths_out [{b}] expected, got "
                         f"{tuple(ids.shape)}, {tuple(ids_out.shape)}, {tuple(cu.shape)}, {tuple(cu_out.shape)}, "
                         f"{tuple(lengths_out.shape)}")


def delete_rows_reference(x: torch.Tensor, remove: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                          ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                          lengths_out: torch.Tensor, cu_out: torch.Tensor) -> torch.Tensor:
    """The deletion step in PyTorch ops (the captured controller's code before this module), into
    the given buffers; returns the gather index ``[rows]``.

    ``x`` ``[rows, d]``: the rows (padded past ``cu[-1]``: those are never removed); ``remove``
    ``[rows]`` bool; ``out`` ``[>= rows, d]``, not overlapping ``x``: its first ``rows`` rows get the
    survivors in order, then copies of row 0; ``ids`` ``[rows]``: per-row ids gathered the same way
    into ``ids_out`` (may be ``ids``); ``cu`` ``[B + 1]``: the layout before; ``removed`` ``[B]``:
    the rows removed per sequence (the per-sequence count of ``remove``); ``lengths_out`` ``[B]``
    and ``cu_out`` ``[B + 1]`` (may be ``cu``; ``cu_out[0]`` is left as it is, 0): the layout after."""
    _check_layout(x.shape[0], ids, ids_out, cu, removed, lengths_out, cu_out)
    # packing.gather_survivors' ops (survivors first, then row 0), then the layout's
    index = torch.nonzero_static(~remove, size=x.shape[0], fill_value=0).squeeze(1)
    torch.index_select(x, 0, index, out=out[: x.shape[0]])
    ids_out.copy_(ids.index_select(0, index))
    lengths_out.copy_((cu[1:] - cu[:-1]) - removed)
    torch.cumsum(lengths_out, 0, dtype=cu_out.dtype, out=cu_out[1:])
    return index


def delete_rows_fused(x: torch.Tensor, remove: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                      ids_out: torch.Tensor, cu: torch.Tensor, removed: torch.Tensor,
                      lengths_out: torch.Tensor, cu_out: torch.Tensor) -> torch.Tensor:
    """:func:`delete_rows_reference` in two Triton kernels (the same arguments and results, the
    index as int32). Raises ``ValueError`` where :func:`fused_deletion_reason` says why not."""
    why = fused_deletion_reason(x, remove)
    if why is not None:
        raise ValueError(f"delete_rows_fused: {why}")
    rows, d = x.shape
    _check_layout(rows, ids, ids_out, cu, removed, lengths_out, cu_out)
    if out.dim() != 2 or out.shape[0] < rows or out.shape[1] != d or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [>= {rows}, {d}] {x.dtype} with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not (ids.is_contiguous() and ids_out.is_contiguous() and cu.is_contiguous() and cu_out.is_contiguous()
            and removed.is_contiguous() and lengths_out.is_contiguous()):
        raise ValueError("delete_rows_fused: ids, cu, removed and the outputs must be contiguous")
    index = torch.empty(rows, dtype=torch.int32, device=x.device)
    block_t = triton.next_power_of_2(rows)
    _compact[(1,)](remove, ids, ids_out, index, cu, removed, lengths_out, cu_out, rows, removed.shape[0],
                   BLOCK_T=block_t, BLOCK_B=triton.next_power_of_2(max(removed.shape[0], 1)),
                   num_warps=8 if block_t > 1024 else 4)
    block_r = 16
    _gather_rows[(triton.cdiv(rows, block_r),)](x, index, out, rows, x.stride(0), out.stride(0), D=d,
                                                 BLOCK_R=block_r, BLOCK_D=min(256, triton.next_power_of_2(d)),
                                                 num_warps=4)
    return index
