"""What each CUDA graph of the captured executor records.

:class:`Segments` is composed into :class:`~timm_dora.engine.graphs.GraphRunner` (which holds the
fixed buffers, the policy, the forward's state and the captured graphs): :meth:`Segments.build`
returns the function a segment key runs, one builder per kind (a block's attention with the actor's
gate in line, its MLP, the actor's controller with the deletion, chains of whole blocks, the run
ahead, the readout, the whole forward of :mod:`~timm_dora.engine.whole`). The runner captures each
on its first use and replays it afterwards (off CUDA: runs it directly). Every segment reads and
writes only the runner's fixed buffers and its own scratch space; the module docstring of
:mod:`~timm_dora.engine.graphs` tells the whole story.

Graph count: one per segment kind, block and padded size that actually occurs. A fixed policy
needs one set; an actor on varied images captures new sizes as they come (each capture costs a
warm-up run and a device synchronisation, once), at most about 256 sizes per block and kind.
Graphs share one memory pool, so their number costs little memory. Before the first capture one
segment of that pool is reserved for the largest expected scratch (``EngineOptions.reserve_pool``), and the
captures carve their intermediates out of it (H100, batch 320: the pool 9.0 ``[B*S, d]`` tensors
instead of 14.1-14.4, and the steady reserved memory of every graph row below native timm's;
``docs/performance.md``, Memory). ``EngineOptions.mlp_chunks`` runs each graph's MLP in row chunks: a smaller pool, for
0.6-2 % of throughput.

Keys: in the dense phase the graphs keep them (copied into ``k``) only at the actor's blocks
whose gate opened in the last forward (no speculation there), for the controller; elsewhere a
policy that reads ``ctx.keys`` (the controller of a gate that opened unexpectedly) gets them
recomputed from the block input with the same operations (``norm1``, ``qkv``, ``k_norm``), so the
same values. In the packed phase they are copied into ``k`` unless the policy says
``reads_keys = False`` (replay plans, :class:`~timm_dora.policy.NoPrune`). With the actor's Triton
gate, both phases copy only the rows of the images whose gate just opened
(:func:`~timm_dora.policy.actor_kernels.copy_open_keys`, after the gate in the same graph; the gate reads
the CLS keys in place): the controller reads no other rows' keys. With
``EngineOptions.fused_interventions`` as well (the default) nothing is copied and there is no ``k``: the
fused controller reads the keys in place, and a controller where the gate opened unexpectedly
recomputes them from the block input in either phase.
"""
from __future__ import annotations

import inspect
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import attention_keys, attention_residual, final_norm, mlp_residual, readout
from .options import active
from .attention import BACKEND_INFO, varlen_attention
from .deletion_kernel import MAX_ROWS as DELETION_MAX_ROWS
from .deletion_kernel import (GATHER_BLOCK_D, Books, compact_rows, delete_rows_fused, delete_rows_reference,
                              fused_deletion_reason, gather_rows, pick_and_compact)
from .dense_kernels import _plain, layer_norm
from .fold_kernel import fold_similarities
from .packing import fold_kernel_applies, fold_removed
from .protocol import BlockContext
from .varlen_kernel import copy_open_keys
from .whole import aside, whole_segment

__all__ = ["Segments"]

# EngineOptions.mlp_chunks: the MLP of a graph segment in row chunks. Its hidden activations (4d per
# row, twice while GELU runs) are the largest scratch of any segment, so they set the graphs' memory
# pool; the rows are independent, so chunks change only the GEMMs' row counts


def _mlp_rows(blk: nn.Module, x: torch.Tensor, out: torch.Tensor, normed: Optional[torch.Tensor] = None,
              next_norm: Optional[nn.Module] = None, norm_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`~timm_dora.engine.blocks.mlp_residual` of ``x`` into ``out`` in ``EngineOptions.mlp_chunks`` row
    chunks (in place when ``x`` is ``out``: each chunk reads its own rows before writing them;
    likewise ``normed`` and ``norm_into``, its other arguments)."""
    rows = x.shape[0]
    step = -(-rows // active().mlp_chunks)
    if step >= rows:
        return mlp_residual(blk, x, out=out, normed=normed, next_norm=next_norm, norm_into=norm_into)
    part = lambda t, i: None if t is None else t[i:i + step]  # noqa: E731
    for i in range(0, rows, step):
        mlp_residual(blk, x[i:i + step], out=out[i:i + step], normed=part(normed, i), next_norm=next_norm,
                     norm_into=part(norm_into, i))
    return out


def _norms(r, l: int, rows: int, fuse: Tuple[bool, ...]) -> dict:
    """A segment's LayerNorm arguments for the fused residual sums (the whole forward's graph):
    ``fuse``: (``norm1`` read from ``r.normed``,) ``norm2`` kept there by the attention for the
    MLP, ``norm1`` of block ``l + 1`` written there by the MLP."""
    normed = r.normed[:rows] if any(fuse) else None
    *read, mid, after = fuse
    out = {"mid": normed if mid else None, "next_norm": r.model.blocks[l + 1].norm1 if after else None,
           "after": normed if after else None}
    if read:
        out["read"] = normed if read[0] else None
    return out


def _fork_before_gate(r, k: torch.Tensor, rows: int, gate: Callable[..., None]) -> None:
    """(``EngineOptions.gate_beside_decision``) The block's controller decision forked onto the
    Aside stream before its gate: the decision's first kernels (the encoder's, which read the keys
    and the history, not the gate) run beside the gate, which the decision enqueues on the block's
    stream when it asks for it (the policy's ``await_gate``, before the first kernel that reads the
    gate), waiting for it there. The block's attention follows the gate on its stream."""
    r.keys_in_place = k.reshape(rows, -1)  # [rows, d] (a view of the qkv output: row stride 3d)
    block_stream = torch.cuda.current_stream(k.device)
    asked = []

    def await_gate():  # (called inside the decision, on the Aside stream)
        with torch.cuda.stream(block_stream):
            gate(True)
        torch.cuda.current_stream(k.device).wait_stream(block_stream)
        asked.append(True)
    r.await_gate = await_gate
    try:
        _fork_decision(r, k)
    finally:
        r.await_gate = None
    if not asked:
        raise RuntimeError(f"{type(r.policy).__name__}.controller_fixed did not call await_gate: its decision "
                           f"would read a gate not yet computed")


def _fork_decision(r, k: torch.Tensor) -> None:
    """Where the whole graph asked for it (``r.decide_aside``: ``EngineOptions.aside_controller``), the
    block's controller decision forked onto the runner's Aside stream as soon as the block's keys
    ``k`` exist (held until the join), beside the attention that follows on the current stream."""
    if r.decide_aside is not None:
        r.aside.fork(r.decide_aside, k)
        r.decide_aside = None


class Segments:
    """The segments of one :class:`~timm_dora.engine.graphs.GraphRunner` (composed into it as
    ``runner.segments``): :meth:`build` returns the function a segment key runs, reading and
    writing only the runner's fixed buffers and its own scratch space. The runner captures and
    replays them (:meth:`~timm_dora.engine.graphs.GraphRunner.run_segment`)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def build(self, key: tuple) -> Callable[[], None]:
        """The function that segment ``key`` runs (``key[0]`` its kind, ``key[1]`` mostly the block),
        reading and writing the runner's fixed buffers only."""
        build = {
            "readout": self._readout_segment,
            "readout_packed": self._readout_packed_segment,
            "readout_prefix": self._readout_prefix_segment,
            "attention_controller": self._attention_controller_segment,
            "attention_packed_controller": self._attention_controller_segment,
            "run_ahead": self._run_ahead_segment,
            "attention": self._attention_segment,
            "mlp": self._mlp_segment,
            "mlp_compacted": self._mlp_compacted_segment,
            "controller": self._controller_segment,
            "chain": self._chain_segment,
            "attention_packed": self._attention_packed_segment,
            "whole": lambda key: whole_segment(self.runner, *key[1:]),  # the whole forward, planned or not (engine.whole)
        }.get(key[0])
        if build is None:
            raise KeyError(key)
        return build(key)

    def _readout_segment(self, key: tuple) -> Callable[[], None]:
        """The dense readout (final norm and head); ``key[1]`` (optional): its output's name (``"ahead"``:
        a run ahead's own, kept in a fixed buffer)."""
        r = self.runner
        model = r.model
        name = key[1] if len(key) > 1 else "dense"

        def readout_dense():
            final = r.dense_inputs[r.depth % 2]
            logits = readout(model, final.with_x(final_norm(model, final.x)), r.readout_mode)
            if name == "dense":
                r.logits[name] = logits
                return
            fixed = r.logits.get(name)
            if fixed is None:  # made by the warm-up, outside the capture and its memory pool
                with torch.inference_mode(False):
                    fixed = r.logits[name] = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            fixed.copy_(logits)
        return readout_dense

    def _readout_packed_segment(self, key: tuple) -> Callable[[], None]:
        """The CLS-token head after a deletion: the prefix rows of the current layout (cu),
        final norm (per row: the same values as on all rows) and head"""
        r = self.runner
        model = r.model

        def readout_packed():
            x = r.x[r.depth % 2]
            if len(r.prefix) == 1:  # the CLS rows at the sequences' starts (int32: no conversion)
                prefix = x.index_select(0, r.cu[:-1]).unsqueeze(1)
            else:
                prefix = x[r.cu[:-1].long()[:, None] + r.prefix]  # (a buffer: a graph keeps no tensor alive)
            r.logits["packed"] = model.forward_head(final_norm(model, prefix))
        return readout_packed

    def _readout_prefix_segment(self, key: tuple) -> Callable[[], None]:
        """(The whole forward's graph, ``EngineOptions.last_block_prefix_only``) block ``key[1]``'s
        MLP on the prefix rows of its attention's output, before its deletion (in the layout of the
        dense rows where ``key[2]``, else of ``cu``), then the final norm and the CLS-token head: the
        rows no later block reads are left out of the MLP (per row: the prefix rows' values are those
        of the MLP on every row)."""
        r = self.runner
        model = r.model
        l, dense = key[1], key[2]
        blk = model.blocks[l]

        def readout_prefix():
            starts = (r.dense_inputs[l % 2].cu_seqlens if dense else r.cu)[:-1]
            if len(r.prefix) == 1:  # the CLS rows at the sequences' starts (int32: no conversion)
                prefix = r.xa.index_select(0, starts)
            else:
                prefix = r.xa[(starts.long()[:, None] + r.prefix).flatten()]
            rows = mlp_residual(blk, prefix).view(r.batch, len(r.prefix), -1)
            r.logits["packed"] = model.forward_head(final_norm(model, rows))
        return readout_prefix

    def _attention_controller_segment(self, key: tuple) -> Callable[[], None]:
        """A block's attention and, in the same graph, the controller and the deletion, reading the
        keys in place from the qkv output (``EngineOptions.fused_interventions``)."""
        r = self.runner
        l = key[1]
        dense = key[0] == "attention_controller"
        rows = r.batch * r.seq if dense else key[2]
        attend = self.build(("attention", l, False, True) if dense else
                               ("attention_packed", l, rows, False, key[4], True))
        control = self.build(("controller", l, rows, dense, "in_place"))

        def attention_controller():
            attend()
            control()
            # the keys were a view of this segment's qkv output: no reference may outlive the
            # segment (after a capture it would hold that output's memory in the graphs' pool
            # for good, where later captures could otherwise reuse it)
            r.keys_in_place = None
        return attention_controller

    def _run_ahead_segment(self, key: tuple) -> Callable[[], None]:
        """The run ahead: dense blocks 0 .. key[2]-1, each with its speculative MLP, and (key[3]) the readout;
        after the last block's gate, every block's gate vector to the host"""
        end, with_readout = key[2], key[3]
        blocks = [self.build(("attention", i, True, False, "ahead" if i == end - 1 else None))
                  for i in range(end)]
        read = self.build(("readout", "ahead")) if with_readout else None  # (into a fixed buffer:
        # this segment consumes its input, so the warm-up's result is the first call's)

        def run_ahead():
            for block in blocks:
                block()
            if read is not None:
                read()
        return run_ahead

    def _attention_segment(self, key: tuple) -> Callable[[], None]:
        """A dense block's attention residual (with the actor, its gate right after ``qkv``: in line,
        or beside the block on the Aside stream, key[7]); key[2]: the MLP runs in the same graph (speculation); key[3] (optional): the
        controller follows in the same graph and reads the keys in place; key[4] (optional):
        where the gate vector goes: "block" (default) to the host with an event of its own, None
        nowhere (a run ahead's earlier blocks), "ahead" with those of all earlier blocks and the
        run ahead's event (its last block)"""
        r = self.runner
        l = key[1]
        model = r.model
        b = r.batch
        blk = model.blocks[l]
        spec, in_place = key[2], len(key) > 3 and key[3]
        to_host = key[4] if len(key) > 4 else "block"
        # key[5] (optional, the whole forward's graph): which LayerNorms come with a residual sum (_norms)
        norms = _norms(r, l, b * r.seq, key[5] if len(key) > 5 else (False, False, False))
        # key[6] (optional, the whole forward's graph): captured, with a backend whose varlen
        # kernel is the faster there (BACKEND_INFO's small_dense), the rows attend as packed rows
        # of equal lengths; the keys come [B*S, H, hd]
        varlen = len(key) > 6 and key[6] and r.capture and BACKEND_INFO[r.backend].small_dense
        # key[7] (optional, the whole forward's graph): the gate on the Aside stream (whole.aside)
        side = len(key) > 7 and key[7]
        rows_in, attend = r.dense_inputs[l % 2], None
        if varlen:
            rows_in = SimpleNamespace(x=rows_in.x, total=b * r.seq, uniform=False)
            layout = SimpleNamespace(uniform=False, cu_seqlens=r.dense_inputs[0].cu_seqlens, max_len=r.seq, sizes=None)
            attend = lambda q, k, v: varlen_attention(q, k, v, layout, r.scale[l], r.backend)  # noqa: E731
        # where the gate is expected to open (no speculation) the keys are kept for the
        # controller: one copy instead of norm1 and qkv again
        keep = not spec and r.probing and r.k is not None and not in_place
        def gate_dense(cls: torch.Tensor) -> None:
            src = r.dense_inputs[l % 2]
            ctx = BlockContext(l, cls, src, r.full, r.consts.no_rho, r.consts.zeros,
                               r.depth, r.num_patches, r.backend, r.consts)
            row = r.gate_out[l]
            step = r.policy.probe(ctx, cls_key=cls, out=row)
            if step.gate is not row:  # (a fused gate writes its row itself)
                row.copy_(step.gate)
            if step.h is not r.h_out:  # (the memoised history already lives there)
                r.h_out.copy_(step.h)
            if to_host == "block":
                r.gate_host[l].copy_(step.gate, non_blocking=r.capture)
                r.gate_copied(l)
            elif to_host == "ahead":
                r.gate_host[:l + 1].copy_(r.gate_out[:l + 1], non_blocking=r.capture)
                if r.capture:
                    r.ahead_ready.record(torch.cuda.current_stream(r.device))
            # the keys are not kept; gate and history are read from the fixed outputs
            r.steps[l] = replace(step, ctx=None, keys=None, gate=r.gate_out[l], h=r.h_out)

        def cls_keys(k: torch.Tensor) -> None:  # [B, H, S, hd] (or [B*S, H, hd]) -> the CLS keys [B, H, hd] (a view)
            if keep and not r.triton_gate:  # as [B*S, d] rows (heads concatenated), the layout
                # attention_keys gives
                if varlen:
                    r.k[:b * r.seq].copy_(k.reshape(b * r.seq, -1))
                else:
                    r.k.view(b, r.seq, k.shape[1], k.shape[3]).copy_(k.transpose(1, 2))
            cls = k.view(b, r.seq, *k.shape[1:])[:, 0] if varlen else k[:, :, 0]  # (the same strides)
            if side:
                aside(r, lambda: gate_dense(cls), k)
            else:
                gate_dense(cls if r.triton_gate else cls.reshape(b, -1))  # (the modules' gate takes [B, d]: a copy)
            if keep and r.triton_gate:  # the gate ran just above: the open images' keys only
                copy_open_keys(k, r.dense_inputs[0].cu_seqlens, r.seq, r.gate_out[l], r.k)
            if in_place:  # [B*S, d] rows (a view of timm's qkv output: row stride 3d)
                r.keys_in_place = (k if varlen else k.permute(0, 2, 1, 3)).reshape(b * r.seq, -1)
                _fork_decision(r, k)

        def attention_dense():
            attention_residual(blk, rows_in, r.backend, out=r.attn_out(l), keys=False, attend=attend,
                               on_keys=cls_keys if r.probing else None, normed=norms["read"], norm_into=norms["mid"])
            if spec:  # the MLP in the same graph, speculatively (the gate decides later)
                _mlp_rows(blk, r.xa, out=r.x[(l + 1) % 2], normed=norms["mid"], next_norm=norms["next_norm"],
                          norm_into=norms["after"])
        return attention_dense

    def _mlp_segment(self, key: tuple) -> Callable[[], None]:
        """A block's MLP residual, dense or packed: xa -> x[(l + 1) % 2]"""
        r = self.runner
        l = key[1]
        model = r.model
        blk = model.blocks[l]
        rows = key[2]
        src = r.attn_out(l)[:rows]  # in place (no actor) or from xa
        norms = _norms(r, l, rows, key[3] if len(key) > 3 else (False, False))  # (the whole forward's graph)
        return lambda: _mlp_rows(blk, src, out=r.x[(l + 1) % 2][:rows], normed=norms["mid"],
                                 next_norm=norms["next_norm"], norm_into=norms["after"])

    def _mlp_compacted_segment(self, key: tuple) -> Callable[[], None]:
        """The MLP residual of the survivors, gathered into x[l % 2] -> x[(l + 1) % 2]"""
        r = self.runner
        l = key[1]
        model = r.model
        blk = model.blocks[l]
        rows = key[2]
        norms = _norms(r, l, rows, key[3] if len(key) > 3 else (False, False))  # (the whole forward's graph)
        return lambda: _mlp_rows(blk, r.x[l % 2][:rows], out=r.x[(l + 1) % 2][:rows], normed=norms["mid"],
                                 next_norm=norms["next_norm"], norm_into=norms["after"])

    def _controller_segment(self, key: tuple) -> Callable[[], None]:
        """The actor's controller for every image, masked by the gate, and the deletion it decides;
        the returned function's ``decide`` and ``delete`` run the two apart (the whole graph's
        ``EngineOptions.aside_controller``: the decision beside the block's attention), and its
        ``prepare`` the fold's similarities before the deletion (``fold_aside``: beside the decision)."""
        r = self.runner
        l = key[1]
        model = r.model
        blk = model.blocks[l]
        rows, dense, kept = key[2], key[3], key[4]  # kept: the dense attention graph kept the keys;
        # "in_place": the attention of the same graph left a view of them (fused_interventions)
        # key[5] (the whole forward's graph): None, or (first, bound, planned): the deletion keeps
        # its books (deletion_kernel.Books: the history, the record's rows, the rows left), first
        # N_0 at the forward's first deletion, else 0; bound: the plan's rows after this block (0:
        # none); planned: the controller runs where the plan says, whether or not a gate opened
        books = key[5] if len(key) > 5 else None
        # key[6] (the whole forward's graph, EngineOptions.norm_in_gather): the deletion also writes
        # the survivors' norm2 into r.normed for the block's MLP (mlp_compacted's norms "mid")
        norm_into = len(key) > 6 and key[6]
        # key[7] (the whole forward's graph, EngineOptions.last_block_prefix_only): the deletion
        # keeps only its books, its new ids and cu aside (the readout read the layout before it)
        books_only = len(key) > 7 and key[7]
        # a packed gate: in the whole forward in its block's row of gate_out (the attention's key[6])
        gate_in = r.gate_out[l] if books is not None else r.ctrl_in[2]
        p = model.num_prefix_tokens
        # EngineOptions.fused_deletion: the deletion below in deletion_kernel's two Triton kernels
        # (above its MAX_ROWS, five) instead of about 13 PyTorch ones; captured only (CUDA)
        fused = (active().fused_deletion and r.capture and r.xa is not None
                 and fused_deletion_reason(r.xa[:rows], r.ctrl_out[0][:rows]) is None)

        def controller_keys(n: int) -> torch.Tensor:  # the keys of the first n rows: read in place,
            # kept in k (by the dense attention graph only where it kept them, by the packed one
            # wherever k exists), or recomputed from the block input (padded rows included, as
            # the attention computed them; the deletion below overwrites that input only later)
            if kept == "in_place":
                return r.keys_in_place[:n]
            if r.k is not None and (kept or not dense):
                return r.k[:n]
            src = r.dense_inputs[l % 2] if dense else SimpleNamespace(x=r.x[l % 2][:rows], total=rows,
                                                                         uniform=False)
            return attention_keys(blk, src)[:n]

        decided: dict = {}  # what the decision hands the deletion (dropped after it)

        def inputs():  # the controller's keys, cu_seqlens, host lengths, history, N_l and gate
            if dense:
                src = r.dense_inputs[l % 2]
                step = r.steps[l]
                args = (controller_keys(rows), src.cu_seqlens, src.lengths_host, step.h, r.full, step.gate)
            elif r.capture:
                cu = r.cu
                if not r.host_reads and r.triton_gate and not (books and books[2]):  # (the unplanned whole
                    # forward runs the controller at every block: where no gate opened it sees empty
                    # sequences, and its kernels return at once)
                    cu = cu * gate_in.any()
                args = (controller_keys(rows), cu, None) + r.ctrl_in[:2] + (gate_in,)
            else:  # uncaptured: the real rows (sdpa_loop needs the host lengths), padded after
                args = (controller_keys(r.cur.total), r.cur.cu_seqlens, r.cur.lengths_host) + r.ctrl_in[:2] + (gate_in,)
            return args

        def prepare():  # (merge, EngineOptions.fold_aside) the fold's similarities: no decision needed
            if r.fold_sim is None or not active().fold_aside or books_only:
                return
            keys, cu = inputs()[:2]
            if fold_kernel_applies(keys, keys, blk.attn.num_heads):  # (where the fold runs the kernels)
                decided["similarities"] = fold_similarities(keys, cu, r.seq, blk.attn.num_heads, out=r.fold_sim)

        def decide():  # the actor's decision, into the fixed outputs (ctrl_out)
            keys, cu, lengths, h, n_visual, gate = inputs()
            # (written into the fixed outputs directly; uncaptured, the rows past the real ones
            # are not the controller's: no removal there)
            if keys.shape[0] < rows:
                r.ctrl_out[0][keys.shape[0]:rows].zero_()
            asked = {} if r.await_gate is None else {"await_gate": r.await_gate}  # (gate_beside_decision)
            _, removed, _ = r.policy.controller_fixed(
                keys, cu, r.seq, p, h, n_visual, gate, l, r.backend, None if r.capture else lengths,
                out=r.ctrl_out, **asked)
            decided.update(keys=keys, cu=cu, gate=gate, removed=removed)

        def delete():  # the fold (merge) and the deletion the decision asks for
            keys, cu, gate, removed = (decided.pop(k) for k in ("keys", "cu", "gate", "removed"))
            similarities = decided.pop("similarities", None)  # (prepare's, where it ran)
            remove = r.ctrl_out[0][:rows]
            n = keys.shape[0]
            # (EngineOptions.fold_in_gather) the fold's finish inside the fused deletion's gather: row
            # 0, which the rows past the survivors copy, is then a prefix row (never folded into)
            in_gather = (r.merge and fused and p > 0 and active().fold_in_gather and n == rows
                         and r.fold_scratch is not None and fold_kernel_applies(r.xa[:n], keys, blk.attn.num_heads))
            # the deletion in the same graph (the rows padded past the last sequence are never
            # removed: they follow the survivors), the new layout (ids and cu compacted in place),
            # and the new lengths to the host, the only value it waits for before the survivors' MLP
            src = r.dense_inputs[l % 2]
            ids, before = (src.ids, src.cu_seqlens) if dense else (r.ids[:rows], r.cu)
            kept_books = None
            if books is not None:
                first, bound, _ = books
                rec, (n_visual, rho, interventions) = r.record, r.history_in
                kept_books = Books(gate, r.ctrl_out[2], n_visual, rho, interventions, first, rec.counts[1, l],
                                   rec.flops[l], rec.ids[l], rec.remove[l], rec.left[l:l + 1], bound)
            if books_only:  # no fold and no gather: nothing reads the rows after this deletion
                cu_aside, ids_aside = r.layout_aside[0], r.layout_aside[2][:rows]
                if fused:
                    compact_rows(remove, ids, ids_aside, before, removed, r.lengths, cu_aside, books=kept_books)
                else:
                    delete_rows_reference(r.xa[:rows], remove, r.x[l % 2], ids, ids_aside, before, removed, r.lengths,
                                          cu_aside, None, kept_books)
                return
            # the survivors' norm2 in the gather where its kernel takes the rows (one chunk a row); else
            # after the deletion
            norm = None
            if norm_into and fused and r.xa.shape[1] <= GATHER_BLOCK_D and _plain(blk.norm2, r.xa):
                norm = {"norm": (blk.norm2.weight, blk.norm2.bias, blk.norm2.eps, r.normed[:rows])}
            # (EngineOptions.compact_in_pick) with the fold's similarities, its pick and the deletion's
            # compaction by image in one kernel: the new cu, sizes and ids aside (the pick reads the
            # old ones), which the gather copies back
            in_pick = in_gather and similarities is not None and active().compact_in_pick
            # (EngineOptions.compact_beside_fold) else the deletion's compaction on the Aside stream
            # beside the fold: it reads only the decision's flags, and leaves the new cu and sizes
            # aside (the fold reads the old ones), which the gather copies back after the join
            beside_option = active().compact_beside_fold
            beside = (in_gather and not in_pick and getattr(r, "aside", None) is not None
                      and (beside_option or (beside_option is None and rows > DELETION_MAX_ROWS)))
            if in_pick or beside:
                index = torch.empty(rows, dtype=torch.int32, device=remove.device)  # (the block's stream's)
                cu_aside, sizes_aside, ids_aside = r.layout_aside[0], r.layout_aside[1][:rows], r.layout_aside[2][:rows]
            if in_pick:
                pick_and_compact(similarities, r.xa[:rows], r.sizes[:rows], remove, cu, r.seq, p, r.fold_scratch, ids,
                                 ids_aside, before, removed, r.lengths, cu_aside, sizes_aside, books=kept_books,
                                 index=index)
                gather_rows(r.xa[:rows], index, r.x[l % 2], r.sizes[:rows], received=r.fold_scratch,
                            sizes_from=sizes_aside, cu_from=cu_aside, cu_out=r.cu, ids_from=ids_aside,
                            ids_out=r.ids[:rows], **(norm or {}))
            else:
                if beside:
                    aside(r, lambda: compact_rows(remove, ids, r.ids[:rows], before, removed, r.lengths, cu_aside,
                                                  r.sizes[:rows], sizes_out=sizes_aside, books=kept_books, index=index))
                if r.merge:  # the removed rows folded into their survivors first (in place, in xa)
                    fold_removed(r.xa[:n], keys, remove[:n], r.sizes[:n], cu, r.seq, p, blk.attn.num_heads,
                                 out=r.xa[:n], sizes_out=r.sizes[:n], scratch=r.fold_scratch,
                                 similarities=similarities, finish=not in_gather)
                if beside:
                    r.aside.join()
                    gather_rows(r.xa[:rows], index, r.x[l % 2], r.sizes[:rows], received=r.fold_scratch,
                                sizes_from=sizes_aside, cu_from=cu_aside, cu_out=r.cu, **(norm or {}))
                else:
                    (delete_rows_fused if fused else delete_rows_reference)(
                        r.xa[:rows], remove, r.x[l % 2], ids, r.ids[:rows], before, removed, r.lengths, r.cu,
                        r.sizes[:rows] if r.merge else None, kept_books,
                        **({"received": r.fold_scratch} if in_gather else {}), **(norm or {}))
            if norm_into and norm is None:
                r.normed[:rows].copy_(layer_norm(blk.norm2, r.x[l % 2][:rows]))
            if r.host_reads:
                r.lengths_host.copy_(r.lengths, non_blocking=r.capture)
                if r.capture:
                    r.deleted_ready.record()

        def controller():
            decide()
            decided.pop("similarities", None)  # (in line: none, not even a stale one, is folded from)
            delete()
        # (the whole forward's graph may run the decision on its Aside stream, beside the block's
        # attention and the fold's similarities, and the deletion after the join:
        # EngineOptions.aside_controller, fold_aside)
        controller.prepare, controller.decide, controller.delete = prepare, decide, delete
        return controller

    def _chain_segment(self, key: tuple) -> Callable[[], None]:
        """Whole blocks l..m where the policy prunes nothing (no policy call): each block's own
        attention and MLP segments, run back to back in one segment"""
        l = key[1]
        last, rows, dense = key[2], key[3], key[4]
        parts = []
        for j in range(l, last + 1):
            parts.append(self.build(("attention", j, False) if dense else ("attention_packed", j, rows, False, False)))
            parts.append(self.build(("mlp", j, rows)))

        def chain():
            for part in parts:
                part()
        return chain

    def _attention_packed_segment(self, key: tuple) -> Callable[[], None]:
        """A packed block's attention residual (with the actor, its gate right after ``qkv``: in line,
        or with its history part beside the block on the Aside stream, key[8]); key[3]: the MLP runs in the same graph (speculation); key[4]: the history changed
        since the last block (its part of the gate is computed); key[5] (optional): the
        controller follows in the same graph and reads the keys in place; key[6] (optional, the
        whole forward's graph): the gate goes into the block's row of gate_out (kept for the
        record) instead of ctrl_in's"""
        r = self.runner
        l = key[1]
        model = r.model
        b = r.batch
        blk = model.blocks[l]
        rows, spec, fresh = key[2], key[3], key[4]
        in_place = len(key) > 5 and key[5]
        gate_buffer = r.gate_out[l] if len(key) > 6 and key[6] else r.ctrl_in[2]
        norms = _norms(r, l, rows, key[7] if len(key) > 7 else (False, False, False))  # key[7]: as the dense one's
        side = len(key) > 8 and key[8]  # key[8] (the whole forward's graph): the actor's work on the Aside stream
        p = model.num_prefix_tokens
        # (EngineOptions.gate_beside_decision) whether the policy's controller takes await_gate
        awaits = "await_gate" in inspect.signature(r.policy.controller_fixed).parameters if r.probing else False

        def gate_ctx(keys: Optional[torch.Tensor] = None) -> BlockContext:
            layout = SimpleNamespace(batch_size=b, num_prefix=p, uniform=False, min_len=0,
                                     starts=r.cu[:-1])  # min_len 0: feasibility per image; int32 (no copy)
            n_visual, rho, interventions = r.history_in
            if keys is None and r.k is not None:  # (the history part reads no keys)
                keys = r.k[:rows]
            return BlockContext(l, keys, layout, n_visual, rho, interventions,
                                r.depth, r.num_patches, r.backend, r.packed_consts)

        def gate_history():  # the gate's history part, from fixed buffers, at the segment's start
            r.packed_consts.memo.clear()  # the history buffers change in place: recompute
            r.policy.prepare(gate_ctx())  # into h_packed / context_packed (keep_packed)

        def gate_packed(keys: Optional[torch.Tensor] = None, h_read: bool = False):  # the rest of the
            # actor's gate, once the keys exist (the memoised history part: h_packed / context_packed,
            # made by this graph's gate_history or by the last block's graph whose history was fresh);
            # keys: [rows, H, hd] to read in place, else the kept copy; h_read: the decision already
            # reads the history buffer (gate_beside_decision), which must not change here
            h, gate = r.ctrl_in[0], gate_buffer
            step = r.policy.probe(gate_ctx(keys), out=gate)
            if step.h is not h:  # (the memoised history lives there: h_packed)
                if h_read:
                    raise RuntimeError("gate_beside_decision: the policy's probe left the history outside its buffer, "
                                       "which the decision forked before the gate reads")
                h.copy_(step.h)
            if step.gate is not gate:  # (a fused gate writes it itself)
                gate.copy_(step.gate)
            if r.host_reads:
                r.gate_host[l].copy_(step.gate, non_blocking=r.capture)
                r.gate_copied(l)
            r.steps[("packed", l)] = replace(step, ctx=None, keys=None, h=r.ctrl_in[0], gate=gate_buffer)

        def keep_keys(k: torch.Tensor) -> None:  # [rows, H, hd], kept for the policy / controller
            if r.triton_gate:  # the gate reads the CLS keys in place, then only the open
                # images' keys are kept (the controller reads no other)
                def gate(h_read: bool = False):
                    gate_packed(k, h_read)
                    if r.k is not None and not in_place:  # (else a controller recomputes them)
                        copy_open_keys(k, r.cu, r.seq, gate_buffer, r.k)
                if in_place and r.decide_aside is not None and active().gate_beside_decision and awaits:
                    return _fork_before_gate(r, k, rows, gate)
                aside(r, gate, k, on=side)
                if in_place:  # [rows, d] (a view of the qkv output: row stride 3d)
                    r.keys_in_place = k.reshape(rows, -1)
                    _fork_decision(r, k)
                return
            r.k[:rows].copy_(k.reshape(rows, -1))
            if r.probing:
                gate_packed()

        attend = self._attend(l, rows)

        def attention_packed():
            src = SimpleNamespace(x=r.x[l % 2][:rows], total=rows, uniform=False)
            if r.probing and fresh:
                aside(r, gate_history, on=side)
            attention_residual(blk, src, r.backend, out=r.attn_out(l)[:rows], attend=attend, keys=False,
                               on_keys=keep_keys if r.copy_keys else None, normed=norms["read"], norm_into=norms["mid"])
            if spec:  # the MLP in the same graph, speculatively (the gate decides later)
                _mlp_rows(blk, r.xa[:rows], out=r.x[(l + 1) % 2][:rows], normed=norms["mid"],
                          next_norm=norms["next_norm"], norm_into=norms["after"])
        return attention_packed

    def _attend(self, l: int, rows: int) -> Callable:
        """Block ``l``'s attention ``(q, k, v) -> o`` on ``rows`` packed rows (padded past the last
        sequence): captured, the kernel reads ``cu_seqlens`` from the fixed buffer; uncaptured,
        attention on the real rows, padded afterwards."""
        r = self.runner
        static = SimpleNamespace(uniform=False, cu_seqlens=r.cu, max_len=r.seq, sizes=r.sizes)
        scale = r.scale[l]

        def attend(q, k, v):
            if r.capture:
                return varlen_attention(q, k, v, static, scale, r.backend)
            real = r.cur
            t = real.total
            o = varlen_attention(q[:t], k[:t], v[:t], real, scale, r.backend)
            return F.pad(o, (0, 0, 0, 0, 0, rows - t))
        return attend
