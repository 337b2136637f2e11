"""What each CUDA graph of the captured executor records, and how it is captured and replayed.

:class:`Segments` is mixed into :class:`~timm_dora.engine.graphs.GraphRunner` (which holds the
fixed buffers, the policy and the forward's state): :meth:`Segments._segment` builds the function a
segment key runs, one builder per kind (a block's attention with the actor's gate in line, its MLP,
the actor's controller with the deletion, chains of whole blocks, the run ahead, the readout);
:meth:`Segments._run` runs it, captured on its first use and replayed afterwards (off CUDA: run
directly). Every segment reads and writes only the runner's fixed buffers and its own scratch space;
the module docstring of :mod:`~timm_dora.engine.graphs` tells the whole story.

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

import contextlib
import gc
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import attention_keys, attention_residual, final_norm, mlp_residual, readout
from .options import active
from .attention import varlen_attention
from .packing import fold_removed, gather_survivors
from .protocol import BlockContext
from .varlen_kernel import copy_open_keys
from .whole import whole_segment

__all__ = ["Segments"]

# EngineOptions.reserve_pool: before a runner's first capture, one segment of its graphs' memory pool
# is reserved, as large as the largest segment's scratch is expected to be
# (:meth:`GraphRunner._scratch_bytes`), so that every capture carves its intermediates out of it.
# Without it the pool grew one allocator segment per intermediate size (qkv, the MLP's hidden
# activations, ...), and a segment's memory could not serve a larger intermediate of a later capture.
# EngineOptions.mlp_chunks: the MLP of a graph segment in row chunks. Its hidden activations (4d per
# row, twice while GELU runs) are the largest scratch of any segment, so they set the graphs' memory
# pool; the rows are independent, so chunks change only the GEMMs' row counts


def _mlp_rows(blk: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`~timm_dora.engine.blocks.mlp_residual` of ``x`` into ``out`` in ``EngineOptions.mlp_chunks`` row
    chunks (in place when ``x`` is ``out``: each chunk reads its own rows before writing them)."""
    rows = x.shape[0]
    step = -(-rows // active().mlp_chunks)
    if step >= rows:
        return mlp_residual(blk, x, out=out)
    for i in range(0, rows, step):
        mlp_residual(blk, x[i:i + step], out=out[i:i + step])
    return out


_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One warm-up stream per device for all captures: cuBLAS keeps a workspace (allocated memory,
    never returned) for every stream it has run on, so a new stream per capture leaked about 1 GB
    over a benchmark's captures (H100, peak-memory rows)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic garbage collector off for the duration (a capture): a collection inside a
    capture can destroy an unreachable :class:`torch.cuda.CUDAGraph` (a wrapped model dropped
    with its graphs: model and runner reference each other), and destroying a graph is not
    permitted while a stream captures: it invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``, seen on an H100 in ``profile_forward.py``).
    ``torch.cuda.graph`` collects before capturing only with
    ``torch.compiler.config.force_cudagraph_gc``, and an automatic collection can start at any
    allocation of Python objects during the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Segments:
    """The segments of a :class:`~timm_dora.engine.graphs.GraphRunner` and their capture (a mixin:
    every attribute it reads is the runner's). Each segment reads and writes fixed buffers only
    (the controller's also consumes its input: it is run once per call, see
    :meth:`_replay_or_capture`)."""

    # the packed gate and the controller copy the gate vector and the new lengths to pinned host
    # memory for the host's decisions (False: the whole forward, which decides on the device)
    host_reads = True

    def _segment(self, key: tuple) -> Callable[[], None]:
        """The function that segment ``key`` runs (``key[0]`` its kind, ``key[1]`` mostly the block),
        reading and writing the runner's fixed buffers only."""
        build = {
            "readout": self._readout_segment,
            "readout_packed": self._readout_packed_segment,
            "attention_controller": self._attention_controller_segment,
            "attention_packed_controller": self._attention_controller_segment,
            "run_ahead": self._run_ahead_segment,
            "attention": self._attention_segment,
            "mlp": self._mlp_segment,
            "mlp_compacted": self._mlp_compacted_segment,
            "controller": self._controller_segment,
            "chain": self._chain_segment,
            "attention_packed": self._attention_packed_segment,
            "whole": lambda key: whole_segment(self, *key[1:]),  # the whole forward, planned or not (engine.whole)
        }.get(key[0])
        if build is None:
            raise KeyError(key)
        return build(key)

    def _readout_segment(self, key: tuple) -> Callable[[], None]:
        """The dense readout (final norm and head); ``key[1]`` (optional): its output's name (``"ahead"``:
        a run ahead's own, kept in a fixed buffer)."""
        model = self.model
        name = key[1] if len(key) > 1 else "dense"

        def readout_dense():
            final = self.dense_inputs[self.depth % 2]
            logits = readout(model, final.with_x(final_norm(model, final.x)), self.readout_mode)
            if name == "dense":
                self.logits[name] = logits
                return
            fixed = self.logits.get(name)
            if fixed is None:  # made by the warm-up, outside the capture and its memory pool
                with torch.inference_mode(False):
                    fixed = self.logits[name] = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            fixed.copy_(logits)
        return readout_dense

    def _readout_packed_segment(self, key: tuple) -> Callable[[], None]:
        """The CLS-token head after a deletion: the prefix rows of the current layout (cu),
        final norm (per row: the same values as on all rows) and head"""
        model = self.model

        def readout_packed():
            rows = self.cu[:-1].long()[:, None] + self.prefix  # (a buffer: a graph keeps no tensor alive)
            self.logits["packed"] = model.forward_head(final_norm(model, self.x[self.depth % 2][rows]))
        return readout_packed

    def _attention_controller_segment(self, key: tuple) -> Callable[[], None]:
        """A block's attention and, in the same graph, the controller and the deletion, reading the
        keys in place from the qkv output (``EngineOptions.fused_interventions``)."""
        l = key[1]
        dense = key[0] == "attention_controller"
        rows = self.batch * self.seq if dense else key[2]
        attend = self._segment(("attention", l, False, True) if dense else
                               ("attention_packed", l, rows, False, key[4], True))
        control = self._segment(("controller", l, rows, dense, "in_place"))

        def attention_controller():
            attend()
            control()
            # the keys were a view of this segment's qkv output: no reference may outlive the
            # segment (after a capture it would hold that output's memory in the graphs' pool
            # for good, where later captures could otherwise reuse it)
            self._keys_in_place = None
        return attention_controller

    def _run_ahead_segment(self, key: tuple) -> Callable[[], None]:
        """The run ahead: dense blocks 0 .. key[2]-1, each with its speculative MLP, and (key[3]) the readout;
        after the last block's gate, every block's gate vector to the host"""
        end, with_readout = key[2], key[3]
        blocks = [self._segment(("attention", i, True, False, "ahead" if i == end - 1 else None))
                  for i in range(end)]
        read = self._segment(("readout", "ahead")) if with_readout else None  # (into a fixed buffer:
        # this segment consumes its input, so the warm-up's result is the first call's)

        def run_ahead():
            for block in blocks:
                block()
            if read is not None:
                read()
        return run_ahead

    def _attention_segment(self, key: tuple) -> Callable[[], None]:
        """A dense block's attention residual (with the actor, its gate in line after ``qkv``); key[2]: the MLP runs in the same graph (speculation); key[3] (optional): the
        controller follows in the same graph and reads the keys in place; key[4] (optional):
        where the gate vector goes: "block" (default) to the host with an event of its own, None
        nowhere (a run ahead's earlier blocks), "ahead" with those of all earlier blocks and the
        run ahead's event (its last block)"""
        l = key[1]
        model = self.model
        b = self.batch
        blk = model.blocks[l]
        spec, in_place = key[2], len(key) > 3 and key[3]
        to_host = key[4] if len(key) > 4 else "block"
        # where the gate is expected to open (no speculation) the keys are kept for the
        # controller: one copy instead of norm1 and qkv again
        keep = not spec and self.probing and self.k is not None and not in_place
        def gate_dense(cls: torch.Tensor) -> None:
            src = self.dense_inputs[l % 2]
            ctx = BlockContext(l, cls, src, self.full, self.consts.no_rho, self.consts.zeros,
                               self.depth, self.num_patches, self.backend, self.consts)
            step = self.policy.probe(ctx, cls_key=cls)
            self.gate_out[l].copy_(step.gate)
            if step.h is not self.h_out:  # (the memoised history already lives there)
                self.h_out.copy_(step.h)
            if to_host == "block":
                self.gate_host[l].copy_(step.gate, non_blocking=self.capture)
                self._gate_copied(l)
            elif to_host == "ahead":
                self.gate_host[:l + 1].copy_(self.gate_out[:l + 1], non_blocking=self.capture)
                if self.capture:
                    self.ahead_ready.record(torch.cuda.current_stream(self.device))
            # the keys are not kept; gate and history are read from the fixed outputs
            self.steps[l] = replace(step, ctx=None, keys=None, gate=self.gate_out[l], h=self.h_out)

        def cls_keys(k: torch.Tensor) -> None:  # [B, H, S, hd] -> the CLS keys [B, H, hd] (a view)
            if keep and not self.triton_gate:  # as [B*S, d] rows (heads concatenated), the layout
                # attention_keys gives
                self.k.view(b, self.seq, k.shape[1], k.shape[3]).copy_(k.transpose(1, 2))
            cls = k[:, :, 0]
            if not self.triton_gate:  # the modules' gate takes [B, d] (a copy)
                cls = cls.reshape(b, -1)
            gate_dense(cls)
            if keep and self.triton_gate:  # the gate ran just above: the open images' keys only
                copy_open_keys(k, self.dense_inputs[0].cu_seqlens, self.seq, self.gate_out[l], self.k)
            if in_place:  # [B*S, d] rows (a view of timm's qkv output: row stride 3d)
                self._keys_in_place = k.permute(0, 2, 1, 3).reshape(b * self.seq, -1)

        def attention_dense():
            attention_residual(blk, self.dense_inputs[l % 2], self.backend, out=self._attn_out(l), keys=False,
                               on_keys=cls_keys if self.probing else None)
            if spec:  # the MLP in the same graph, speculatively (the gate decides later)
                _mlp_rows(blk, self.xa, out=self.x[(l + 1) % 2])
        return attention_dense

    def _mlp_segment(self, key: tuple) -> Callable[[], None]:
        """A block's MLP residual, dense or packed: xa -> x[(l + 1) % 2]"""
        l = key[1]
        model = self.model
        blk = model.blocks[l]
        rows = key[2]
        src = self._attn_out(l)[:rows]  # in place (no actor) or from xa
        return lambda: _mlp_rows(blk, src, out=self.x[(l + 1) % 2][:rows])

    def _mlp_compacted_segment(self, key: tuple) -> Callable[[], None]:
        """The MLP residual of the survivors, gathered into x[l % 2] -> x[(l + 1) % 2]"""
        l = key[1]
        model = self.model
        blk = model.blocks[l]
        rows = key[2]
        return lambda: _mlp_rows(blk, self.x[l % 2][:rows], out=self.x[(l + 1) % 2][:rows])

    def _controller_segment(self, key: tuple) -> Callable[[], None]:
        """The actor's controller for every image, masked by the gate, and the deletion it decides."""
        l = key[1]
        model = self.model
        blk = model.blocks[l]
        rows, dense, kept = key[2], key[3], key[4]  # kept: the dense attention graph kept the keys;
        # "in_place": the attention of the same graph left a view of them (fused_interventions)
        p = model.num_prefix_tokens

        def controller_keys(n: int) -> torch.Tensor:  # the keys of the first n rows: read in place,
            # kept in k (by the dense attention graph only where it kept them, by the packed one
            # wherever k exists), or recomputed from the block input (padded rows included, as
            # the attention computed them; the deletion below overwrites that input only later)
            if kept == "in_place":
                return self._keys_in_place[:n]
            if self.k is not None and (kept or not dense):
                return self.k[:n]
            src = self.dense_inputs[l % 2] if dense else SimpleNamespace(x=self.x[l % 2][:rows], total=rows,
                                                                         uniform=False)
            return attention_keys(blk, src)[:n]

        def controller():
            if dense:
                src = self.dense_inputs[l % 2]
                step = self.steps[l]
                args = (controller_keys(rows), src.cu_seqlens, src.lengths_host, step.h, self.full, step.gate)
            elif self.capture:
                cu = self.cu
                if not self.host_reads and self.triton_gate:  # (the whole forward runs the controller at every block: where
                    # no gate opened it sees empty sequences, and its kernels return at once)
                    cu = cu * self.ctrl_in[2].any()
                args = (controller_keys(rows), cu, None) + self.ctrl_in
            else:  # uncaptured: the real rows (sdpa_loop needs the host lengths), padded after
                args = (controller_keys(self.cur.total), self.cur.cu_seqlens, self.cur.lengths_host) + self.ctrl_in
            keys, cu, lengths, h, n_visual, gate = args
            # (written into the fixed outputs directly; uncaptured, the rows past the real ones
            # are not the controller's: no removal there)
            if keys.shape[0] < rows:
                self.ctrl_out[0][keys.shape[0]:rows].zero_()
            _, removed, _ = self.policy.controller_fixed(
                keys, cu, self.seq, p, h, n_visual, gate, l, self.backend, None if self.capture else lengths,
                out=self.ctrl_out)
            remove = self.ctrl_out[0][:rows]
            if self.merge:  # the removed rows folded into their survivors first (in place, in xa)
                n = keys.shape[0]
                _, mass = fold_removed(self.xa[:n], keys, remove[:n], self.sizes[:n], cu, self.seq, p,
                                       blk.attn.num_heads, out=self.xa[:n])
                self.sizes[:n].copy_(mass)
            # the deletion in the same graph (the rows padded past the last sequence are never
            # removed: they follow the survivors), the new layout, and the new lengths to the
            # host, the only value it waits for before the survivors' MLP
            sizes = self.sizes[:rows] if self.merge else None
            if dense:
                src, before = self.dense_inputs[l % 2], self.seq
                ids = gather_survivors(self.xa, remove, self.x[l % 2], src.ids, sizes)
            else:
                before = self.cu[1:] - self.cu[:-1]
                ids = gather_survivors(self.xa[:rows], remove, self.x[l % 2], self.ids[:rows], sizes)
            self.ids[:rows].copy_(ids)
            self.lengths.copy_(before - removed)
            torch.cumsum(self.lengths, 0, dtype=self.cu.dtype, out=self.cu[1:])
            if self.host_reads:
                self.lengths_host.copy_(self.lengths, non_blocking=self.capture)
                if self.capture:
                    self.deleted_ready.record()
        return controller

    def _chain_segment(self, key: tuple) -> Callable[[], None]:
        """Whole blocks l..m where the policy prunes nothing (no policy call): each block's own
        attention and MLP segments, run back to back in one segment"""
        l = key[1]
        last, rows, dense = key[2], key[3], key[4]
        parts = []
        for j in range(l, last + 1):
            parts.append(self._segment(("attention", j, False) if dense else ("attention_packed", j, rows, False, False)))
            parts.append(self._segment(("mlp", j, rows)))

        def chain():
            for part in parts:
                part()
        return chain

    def _attention_packed_segment(self, key: tuple) -> Callable[[], None]:
        """A packed block's attention residual (with the actor, its gate in line); key[3]: the MLP runs in the same graph (speculation); key[4]: the history changed
        since the last block (its part of the gate is computed); key[5] (optional): the
        controller follows in the same graph and reads the keys in place"""
        l = key[1]
        model = self.model
        b = self.batch
        blk = model.blocks[l]
        rows, spec, fresh = key[2], key[3], key[4]
        in_place = len(key) > 5 and key[5]
        p = model.num_prefix_tokens

        def gate_ctx(keys: Optional[torch.Tensor] = None) -> BlockContext:
            layout = SimpleNamespace(batch_size=b, num_prefix=p, uniform=False, min_len=0,
                                     starts=self.cu[:-1].long())  # min_len 0: feasibility per image
            n_visual, rho, interventions = self.history_in
            if keys is None and self.k is not None:  # (the history part reads no keys)
                keys = self.k[:rows]
            return BlockContext(l, keys, layout, n_visual, rho, interventions,
                                self.depth, self.num_patches, self.backend, self.packed_consts)

        def gate_history():  # the gate's history part, from fixed buffers, at the graph's start
            self.packed_consts.memo.clear()  # the history buffers change in place: recompute
            self.policy.prepare(gate_ctx())  # into h_packed / context_packed (keep_packed)

        def gate_packed(keys: Optional[torch.Tensor] = None):  # the rest of the actor's gate, once
            # the keys exist (the memoised history part: h_packed / context_packed, made by this
            # graph's gate_history or by the last block's graph whose history was fresh);
            # keys: [rows, H, hd] to read in place, else the kept copy
            step = self.policy.probe(gate_ctx(keys))
            self.ctrl_in[0].copy_(step.h)
            self.ctrl_in[2].copy_(step.gate)
            if self.host_reads:
                self.gate_host[l].copy_(step.gate, non_blocking=self.capture)
                self._gate_copied(l)
            self.steps[("packed", l)] = replace(step, ctx=None, keys=None, h=self.ctrl_in[0], gate=self.ctrl_in[2])

        def keep_keys(k: torch.Tensor) -> None:  # [rows, H, hd], kept for the policy / controller
            if self.triton_gate:  # the gate reads the CLS keys in place, then only the open
                # images' keys are kept (the controller reads no other)
                gate_packed(k)
                if in_place:  # [rows, d] (a view of the qkv output: row stride 3d)
                    self._keys_in_place = k.reshape(rows, -1)
                elif self.k is not None:  # (else a controller recomputes them)
                    copy_open_keys(k, self.cu, self.seq, self.ctrl_in[2], self.k)
                return
            self.k[:rows].copy_(k.reshape(rows, -1))
            if self.probing:
                gate_packed()

        attend = self._attend(l, rows)

        def attention_packed():
            src = SimpleNamespace(x=self.x[l % 2][:rows], total=rows, uniform=False)
            if self.probing and fresh:
                gate_history()
            attention_residual(blk, src, self.backend, out=self._attn_out(l)[:rows], attend=attend, keys=False,
                               on_keys=keep_keys if self.copy_keys else None)
            if spec:  # the MLP in the same graph, speculatively (the gate decides later)
                _mlp_rows(blk, self.xa[:rows], out=self.x[(l + 1) % 2][:rows])
        return attention_packed

    def _attend(self, l: int, rows: int) -> Callable:
        """Block ``l``'s attention ``(q, k, v) -> o`` on ``rows`` packed rows (padded past the last
        sequence): captured, the kernel reads ``cu_seqlens`` from the fixed buffer; uncaptured,
        attention on the real rows, padded afterwards."""
        static = SimpleNamespace(uniform=False, cu_seqlens=self.cu, max_len=self.seq, sizes=self.sizes)
        scale = self.scale[l]

        def attend(q, k, v):
            if self.capture:
                return varlen_attention(q, k, v, static, scale, self.backend)
            real = self.cur
            t = real.total
            o = varlen_attention(q[:t], k[:t], v[:t], real, scale, self.backend)
            return F.pad(o, (0, 0, 0, 0, 0, rows - t))
        return attend

    def _run(self, key: tuple) -> None:
        if not self.capture:
            self._segment(key)()
            return
        g = self.graphs.get(key)
        if g is not None and torch.cuda.current_device() == self.device.index:
            g.replay()  # (the common case: no device switch, about 10 us of host time less per replay)
            return
        with torch.cuda.device(self.device):  # the model's GPU, whichever is current
            self._replay_or_capture(key)

    def _replay_or_capture(self, key: tuple) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        fn = self._segment(key)
        start = time.perf_counter()
        # the warm-up, outside the capture (lazy initialisations); the capture only records, and
        # the replay gives this call's result, except for segments that consume their input: the
        # controller (its deletion overwrites the block input and layout it read) and, without the
        # actor, the MLP (in place): they must run once, and the warm-up's result is kept
        side = _side_stream(self.device)
        if active().reserve_pool and not self.graphs:
            self._reserve_pool(side)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        if key[:2] == ("attention", 0) or key[0] in ("run_ahead", "whole"):
            # the gate's context (history and block embeddings) is memoised per forward constants:
            # made again inside block 0's capture, so that every replay recomputes it from the
            # weights, and kept in fixed buffers (consts.keep) that the later blocks' graphs read
            self.consts.memo.clear()
        g = torch.cuda.CUDAGraph()
        # captured on the warm-up's stream, not torch's own capture stream: cuBLAS allocates a
        # workspace (33 MiB on the H100, never returned) for every stream it runs on, and the
        # capture stream would be a second one
        with _no_gc(), torch.cuda.graph(g, pool=self.pool, stream=side):
            fn()
        self.graphs[key] = g
        if not self._consumes_input(key):
            g.replay()
        torch.cuda.current_stream(self.device).synchronize()
        self.capture_s += time.perf_counter() - start

    def _scratch_bytes(self) -> int:
        """The largest scratch space a segment is expected to need: a dense block's attention (its
        input's ``norm1``, ``qkv``, the attention output and its reshaped copy: ``6 d`` per row) or
        its MLP (``norm2``, the first linear's output and its activation: ``d + 2 h`` per row, ``h``
        the MLP's widest linear layer, over ``EngineOptions.mlp_chunks`` row chunks)."""
        d = self.x[0].shape[1]
        hidden = max((m.out_features for blk in self.model.blocks for m in blk.mlp.modules()
                      if isinstance(m, nn.Linear)), default=4 * d)
        per_row = max(6 * d, -(-(d + 2 * hidden) // active().mlp_chunks))
        return self.batch * self.seq * per_row * self.x[0].element_size()

    def _reserve_pool(self, side: "torch.cuda.Stream") -> None:
        """Reserve :meth:`_scratch_bytes` in the graphs' pool as one allocator segment
        (``EngineOptions.reserve_pool``): a tensor allocated in a capture of its own (one memset node; the
        graph is kept with the others, never replayed) and freed at once, so that the captures
        after it split their intermediates out of that free block instead of growing the pool
        one segment per intermediate size; what does not fit still gets segments of its own."""
        g = torch.cuda.CUDAGraph()
        with _no_gc(), torch.cuda.graph(g, pool=self.pool, stream=side):
            block = torch.empty(self._scratch_bytes(), dtype=torch.uint8, device=self.device)
            block[:1].zero_()
        del block
        self.graphs[("reserve",)] = g

    def _consumes_input(self, key: tuple) -> bool:
        """Segments that overwrite what they read, so must run exactly once: the controller (its
        deletion gathers into the block input), alone or after the attention in the same graph
        (``EngineOptions.fused_interventions``), a chain of blocks, a run ahead or the whole
        forward (the second block writes into the first one's input) and, without the actor, the
        in-place MLP."""
        return (key[0] in ("controller", "chain", "run_ahead", "attention_controller", "attention_packed_controller",
                           "whole")
                or (key[0] == "mlp" and not self.probing))
