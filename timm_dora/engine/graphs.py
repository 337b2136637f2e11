"""A wrapped forward replayed from CUDA graphs (by default on CUDA: :mod:`~timm_dora.engine.capture`).

A ViT-Ti block on an H100 at batch 320 takes about 0.6 ms on the GPU and, run eagerly, about as
much host time in module calls and kernel launches: the eager forward is launch-bound, and after
pruning even more so. Here the forward's heavy segments are captured as CUDA graphs (one launch
each) and only the decisions and the deletion run eagerly, between replays:

- **dense phase** (until the first deletion every image keeps all tokens; shapes are fixed by the
  batch shape): each block's attention residual, each block's MLP residual and the readout (the
  embedding runs eagerly, from the caller's images). For a policy with a graph probe (a
  deterministic :class:`~timm_dora.policy.ActorPolicy`) a block is one graph: the attention
  residual, the MLP residual of all rows (speculatively, only at blocks whose gate stayed closed
  for every image in the last forward: elsewhere it would be wasted, and the MLP follows the
  decision) and, right after ``qkv``, the gate from the CLS keys (the full keys are never
  materialised), which copies the gate vector into pinned host memory and records an event
  there. The host waits for that event only, so it decides while the same graph's attention and
  MLP still run. With the actor's Triton gate (:mod:`timm_dora.policy.actor_kernels`, the default on the
  ``triton`` backend) the gate is one kernel in line, before the attention kernel; otherwise the
  ``nn`` modules' gate (about ten small kernels) runs in line there. **Run ahead**
  (``EngineOptions.run_ahead``): the blocks from block 0 up to the first whose gate opened in the last
  forward (all of them and the readout where none did) are one graph instead, their gates copied
  to pinned memory together right after the last one's; the host takes them as closed, reads them
  once (after the next block's graph is enqueued, or before returning the logits) and, where one
  opened after all, raises :class:`RunAheadMissed`: :func:`timm_dora.engine.patch.run` then runs the
  forward again block by block.
- **packed phase** (after a deletion): rows are padded up to a multiple of a bucket size
  (:func:`rows_bucket`: about 1/256 of the batch's ``B*S`` rows, 16 to 256)
  and each block's attention residual and MLP residual are captured per (block, padded rows).
  Attention runs the varlen kernel with ``cu_seqlens`` in a fixed device buffer and the longest
  possible sequence as its maximum, so the padded rows, past the last sequence, are never read
  (they hold garbage that row-wise LayerNorm/MLP carry along and the deletion never gathers).
  Other policies decide eagerly on the real rows; for the actor a block is again one graph with
  the gate and the MLP speculative (the history copied into fixed buffers first; the gate's
  history part runs at the graph's start, only in the first block after the history changed,
  and is kept in fixed buffers for the later blocks, so that only its CLS part remains once
  the keys exist).
  The deletion gathers the survivors into a fixed buffer (one ``index_select``) and the next
  segment replays. The CLS-token readout is one graph in either phase (after a deletion it reads
  the prefix rows at the current ``cu_seqlens``); pooled readouts run eagerly.
- **chains**: a policy that says beforehand where it prunes nothing (``prunes_nothing_at``: a
  replay plan's other blocks, :class:`~timm_dora.policy.NoPrune` everywhere) is not called there,
  and each run of such blocks is one segment (attention and MLP of every block in it), in either
  phase: a fixed policy pruning at three of 12 blocks replays 10 segments per forward instead of 24.
- **the actor's controller**, where a gate opened (either phase): captured per (block, rows) as
  :meth:`~timm_dora.policy.ActorPolicy.controller_fixed`, the same computation on every image of
  the layout, masked by the gate (no shape depends on which images opened), followed in the same
  graph by the deletion (:func:`~timm_dora.engine.packing.gather_survivors` into the fixed buffer, the
  survivors' ids, lengths and ``cu_seqlens``) and a copy of the new lengths to pinned memory with
  an event: the host waits for that event only, then replays the survivors' MLP (with the Triton
  gate also the next block's attention graph right behind it, its history copied in before the
  wait, so the host's bookkeeping runs while the GPU works). Its products run
  over more rows than the default path's (the gate-active images only), so in bf16 a near-tie can
  decide differently (97-100 % of decisions agree on the H100, ``benchmarks/gpu_check.py``).
  With ``EngineOptions.fused_interventions`` (the default) the controller and the deletion run inside the
  attention's graph where the gate opened in the last forward, reading the keys in place from the
  qkv output (no key copy, one graph instead of two, no gate read between them); where that guess
  is wrong the controller's work is wasted, and it removes nothing.

Fixed buffers (per batch shape): two block inputs ``x[0]``/``x[1]`` (block ``l``
reads ``x[l % 2]``), for the actor the attention-residual output ``xa`` (its speculative MLP must
leave the attention output intact; without the actor the attention residual goes into the next
block's input buffer and the MLP runs in place there, or the deletion gathers it back into the
block's own input buffer) and, for policies that read keys and the actor's ``nn`` gate, the keys
``k`` of packed blocks (each ``[B*S, d]``; not with the Triton gate and
``EngineOptions.fused_interventions``, see below), plus small ones for what a graph hands on (the
dense gates and history, the controller's inputs and outputs). Every segment reads and writes only
these and its own scratch space, so segments are captured lazily, the first time a (block, rows)
pair occurs (a warm-up run, the capture, a replay; the controller's segment, which overwrites the
block input and layout it reads, keeps its warm-up's result instead). All graphs share one memory
pool; since the replay order is not the capture order, nothing a graph allocates is read after
another replays (scratch space of one graph may be another's).

**Merging** (``wrap(..., merge=True)``, the actor only): the controller's graph folds each removed
row into its best match (:func:`~timm_dora.engine.packing.fold_removed`, fixed shapes, in ``xa``)
before the gather, which also gathers the rows' sizes in the fixed buffer ``sizes`` (ones from
each forward's start); the packed attention graphs pass it to the Triton kernel, which adds
``log(size)`` to each key's logits. The segments docstring (:mod:`~timm_dora.engine.segments`)
holds the graph count, the memory pool and where the keys come from.

Off CUDA the same segments run uncaptured (attention on the real rows, padded afterwards): that is
how the CPU tests check this path against the default forward. Inference only: ``eval()``, no
autograd, no autocast, a half-precision varlen backend on CUDA.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .attention import BACKEND_INFO
from .blocks import attention_keys, embed
from .fold_kernel import SIMILARITY_MAX_COLUMNS, similarity_columns
from .options import active
from .packing import Packed, delete_rows
from .protocol import BlockContext, Decision, ForwardConstants, LazyKeysContext
from .segments import Segments

__all__ = ["GraphRunner", "RunAheadMissed", "capture_stream", "decides_in_graphs", "graph_runner", "release_all",
           "graph_mode_reason", "rows_bucket"]

# EngineOptions.reserve_pool: before a runner's first capture, one segment of its graphs' memory pool
# is reserved, as large as the largest segment's scratch is expected to be
# (:meth:`GraphRunner._scratch_bytes`), so that every capture carves its intermediates out of it.
# Without it the pool grew one allocator segment per intermediate size (qkv, the MLP's hidden
# activations, ...), and a segment's memory could not serve a larger intermediate of a later capture.

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
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


class RunAheadMissed(Exception):
    """A gate opened inside a run ahead (``EngineOptions.run_ahead``): this forward's later blocks ran on rows
    that should have been pruned, so :func:`timm_dora.engine.patch.run` runs the forward again, without
    running ahead. Never reaches a caller of the model."""


def rows_bucket(total_rows: int) -> int:
    """Packed rows are padded up to a multiple of this (one graph per block and padded size): about
    1/256 of the unpruned batch's rows, at least 16 and at most 256, so that at most ~256 sizes
    occur per block and padding adds fewer rows than 1/256 of the unpruned batch or 16 (batch 320
    x 197 tokens: 247 rows; batch 8: 16). The H100 measurements were taken with a fixed 256."""
    fixed = active().rows_bucket
    if fixed is not None:
        return fixed
    return min(256, max(16, -(-total_rows // 256)))


def graph_mode_reason(model: nn.Module, images: torch.Tensor, backend: str) -> Optional[str]:
    """Why this forward cannot run from graphs (``None``: it can)."""
    if model.training:
        return "the model is in training mode"
    if torch.is_grad_enabled():
        return "autograd is enabled (run under torch.inference_mode() or torch.no_grad())"
    if images.device.type == "cuda":
        if torch.is_autocast_enabled("cuda"):
            return "autocast is enabled (cast the model to bf16/fp16 instead)"
        if not BACKEND_INFO[backend].captured:
            return f"the {backend!r} attention backend reads sequence lengths on the host (use bf16/fp16)"
    return None


def decides_in_graphs(policy, num_patches: int, dtype: torch.dtype) -> bool:
    """Whether the gate and controller run inside the graphs (a runner's ``probing``): only for a
    plain deterministic ActorPolicy (a subclass may decide differently: it is called as a policy)
    of the CLS form at its own input size, in the activations' dtype, whose keys are kept (the
    packed gate reads them)."""
    probes = getattr(policy, "probes_in_graphs", None)  # (a CapturedPolicy, engine.protocol)
    return probes is not None and probes(num_patches, dtype) and bool(getattr(policy, "reads_keys", True))


class GraphRunner:
    """The graph-replayed forward of one wrapped model for one batch shape and policy.

    :func:`timm_dora.engine.patch.run` drives it block by block, as it drives the eager executor
    (:mod:`~timm_dora.engine.eager`: the interface). What each segment records is
    :attr:`segments`' (:class:`~timm_dora.engine.segments.Segments`); the runner captures and replays
    them (:meth:`run_segment`)."""

    # the packed gate and the controller copy the gate vector and the new lengths to pinned host
    # memory for the host's decisions (False: the whole forward, which decides on the device)
    host_reads = True

    def __init__(self, model: nn.Module, policy, images: torch.Tensor, backend: str, readout_mode: str,
                 merge: bool = False):
        self.model, self.policy, self.backend, self.readout_mode = model, policy, backend, readout_mode
        self.segments = Segments(self)  # what each graph records
        self.merge = merge  # removed rows folded into survivors (the controller's graph), sizes kept in ``sizes``
        self.copy_keys = bool(getattr(policy, "reads_keys", True))
        dev = self.device = images.device
        self.capture = dev.type == "cuda"
        # what capturing costs (engine.capture.engine_info): seconds of warm-ups and captures, bytes of buffers
        self.capture_s, allocated = 0.0, torch.cuda.memory_allocated(dev) if self.capture else 0
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: usable under no_grad too
            self._make_buffers(model, images)
        self.probing = decides_in_graphs(policy, self.num_patches, self.x[0].dtype)
        if merge and not self.probing:
            raise ValueError("merge=True is captured for a deterministic CLS actor only")
        # the actor's gate runs in line on the graph's stream, right after qkv: the Triton gate
        # (one kernel) where the fused kernels run, else the modules' (about ten small kernels; not
        # on a second stream: there its small kernels waited behind the backbone's GEMMs)
        self.triton_gate = self.probing and policy.fused_gate(backend, self.x[0].dtype)
        # the keys of packed blocks, kept for a policy that reads them and for the modules' gate
        # (zeros: with the actor only the open images' rows are copied in; the others keep finite
        # values). Not with the Triton gate and fused_interventions: the gate reads the CLS keys in
        # place, a controller where the gate opened in the last forward reads the keys in place
        # too, and one where it opened unexpectedly recomputes them from the block input (norm1
        # and qkv again, only then): one [B*S, d] buffer less
        if self.copy_keys and not (self.triton_gate and active().fused_interventions):
            with torch.inference_mode(False):
                self.k = torch.zeros_like(self.x[0])
        if self.probing:
            with torch.inference_mode(False):
                self.context_out = torch.zeros(self.depth, self.batch, policy.context_width,
                                               dtype=self.x[0].dtype, device=dev)  # (the actor's dtype)
                self.context_packed = torch.zeros_like(self.context_out)
                # the speculative MLP must not overwrite the attention output (a gate that opens
                # deletes from it): a third buffer. Other policies decide before the MLP, which then
                # runs in place on the attention output, in the next block's input buffer
                self.xa = torch.empty_like(self.x[0])
            self.dense_attended = self.dense_inputs[0].with_x(self.xa)
        if self.capture and self.probing:
            # recorded inside the graphs (external: a record node the host can wait on)
            self.gate_ready = [torch.cuda.Event(external=True) for _ in range(self.depth)]
            self.deleted_ready = torch.cuda.Event(external=True)  # the controller graph's deletion
            self.ahead_ready = torch.cuda.Event(external=True)  # a run-ahead graph's gate vectors
        # run ahead (EngineOptions.run_ahead): the dense blocks 0 .. end-1 in one graph (see _launch_ahead)
        self.run_ahead = self.probing and active().run_ahead
        self._ahead_now, self._ahead = False, 0  # this forward may run ahead; its blocks 0 .. _ahead-1
        self._ahead_unread = False  # their gates not read yet
        self._ahead_logits = False  # it ended with the readout
        # speculation (the actor): block l's graph runs the MLP of all rows before the gate is read
        # unless its gate opened for some image in the last forward that reached it (there the
        # speculative MLP was wasted; a wrong guess the other way costs one gate read's latency)
        self.opened = [False] * self.depth
        self.keys_in_place: Optional[torch.Tensor] = None  # the keys a fused intervention graph reads
        # the whole graph's controller decision to fork onto its Aside stream once the keys exist
        # (EngineOptions.aside_controller; the attention's keys hook forks it and clears this)
        self.decide_aside: Optional[Callable[[], None]] = None
        # (EngineOptions.gate_beside_decision) while that decision is forked before its block's
        # gate: what it calls to have the gate enqueued on the block's stream and waited for
        self.await_gate: Optional[Callable[[], None]] = None
        self._fused_at: Optional[int] = None  # the block whose graph ran the controller too
        # blocks where the policy says, before they run, that it prunes nothing (a replay plan's
        # other blocks, NoPrune's every block) run as chains of whole blocks: one segment each
        skips = getattr(policy, "prunes_nothing_at", None)
        self.skips: Optional[Callable[[int], bool]] = None if self.probing else skips
        self.plan, self.plan_misses = None, 0  # the planned whole forward's (engine.whole)
        self.buffer_bytes = torch.cuda.memory_allocated(dev) - allocated if self.capture else 0

    def release(self) -> None:
        """Destroy the captured graphs now (their memory pool goes back to the allocator's cache)
        and drop the gate's callbacks and the segment builder, the only references from its own
        objects back to it, so that its buffers are freed as soon as it is dropped, without waiting for a
        garbage collection. Called when a wrapped model drops a runner (unwrap, set_policy, the
        cache's least recent entry); the runner must not be used afterwards."""
        self.graphs.clear()
        self.segments = None  # (it refers back to the runner)
        self.consts.keep = self.consts.keep_into = None
        if getattr(self, "packed_consts", None) is not None:
            self.packed_consts.keep = self.packed_consts.keep_into = None

    def attn_out(self, l: int) -> torch.Tensor:
        """Where block ``l``'s attention residual goes: ``xa`` for the actor (see ``__init__``),
        else the next block's input buffer (the MLP then runs in place there)."""
        return self.xa if self.probing else self.x[(l + 1) % 2]

    def _make_buffers(self, model: nn.Module, images: torch.Tensor) -> None:
        dev = images.device
        x0 = embed(model, images)
        b, s, d = x0.shape
        p = model.num_prefix_tokens
        self.batch, self.seq, self.depth, self.num_patches = b, s, len(model.blocks), s - p
        dense = Packed.from_dense(x0, p, track_ids=True)
        for name in ("max_len", "min_len", "cu_seqlens", "starts", "seg", "pos"):
            getattr(dense, name)  # layout tensors are made now, outside any capture
        dtype = x0.dtype
        del x0
        self.x = [torch.empty((b * s, d), dtype=dtype, device=dev) for _ in range(2)]
        self.xa: Optional[torch.Tensor] = None  # the actor's attention output (made once probing is known)
        self.k: Optional[torch.Tensor] = None  # the kept keys (made once the gate's kind is known)
        self.cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)  # cu_seqlens of the packed phase
        # (merge) the patches each packed row stands for: ones until the first fold (start())
        self.sizes = torch.ones(b * s, dtype=torch.float32, device=dev) if self.merge else None
        # (merge, CUDA) the fold kernels' accumulator and mass: zeros, left zeros by every fold
        self.fold_scratch = ((torch.zeros((b * s, d), dtype=torch.float32, device=dev),
                              torch.zeros(b * s, dtype=torch.float32, device=dev)) if self.merge and dev.type == "cuda" else None)
        # where a deletion's compaction leaves the new cu_seqlens, sizes (merge, CUDA) and ids while
        # the old are still read: by the fold beside it (EngineOptions.compact_beside_fold,
        # compact_in_pick) or the readout after it (last_block_prefix_only; entry 0 of cu stays 0)
        self.layout_aside = (torch.zeros(b + 1, dtype=torch.int32, device=dev),
                             torch.empty(b * s, dtype=torch.float32, device=dev) if self.fold_scratch is not None
                             else None, torch.empty(b * s, dtype=torch.long, device=dev))
        # (merge, CUDA, EngineOptions.fold_aside) the fold's similarities, made beside the decision
        self.fold_sim = (torch.empty((b * s, similarity_columns(s)), dtype=torch.float32, device=dev)
                         if self.fold_scratch is not None and b * s <= active().fold_aside_max_rows
                         and similarity_columns(s) <= SIMILARITY_MAX_COLUMNS else None)
        self.prefix = torch.arange(p, device=dev)  # a sequence's prefix rows from its start
        self.dense_inputs = [dense.with_x(t) for t in self.x]  # block l's dense input: [l % 2]
        self.gate_host = torch.zeros((self.depth, b), dtype=torch.bool, pin_memory=self.capture)
        self.consts = ForwardConstants(b, dev)
        for name in ("zeros", "closed", "opened", "no_rho"):
            getattr(self.consts, name)
        self.full = torch.full((b,), self.num_patches, dtype=torch.long, device=dev)
        self.steps: Dict[int, object] = {}
        # packed phase: the history (N_l, rho, E_<l) copied in, and the controller's inputs (h, N_l,
        # gate) that the gate graph writes (N_l is the same buffer; h is h_packed, the kept history)
        self.history_in = (torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, device=dev),
                           torch.zeros(b, dtype=torch.long, device=dev))
        # (h_l: the packed phase's kept history, which a packed gate graph leaves there)
        self.h_packed = torch.zeros(b, 3, device=dev)
        self.ctrl_in = (self.h_packed, self.history_in[0], torch.zeros(b, dtype=torch.bool, device=dev))
        self.packed_consts = ForwardConstants(b, dev)  # the packed gate graphs' own (memo cleared per run)
        for name in ("zeros", "closed", "opened", "no_rho"):
            getattr(self.packed_consts, name)
        # what a graph produces for later use goes into these, outside the graphs' shared pool: a
        # tensor allocated inside a capture may share memory with another graph's scratch space
        # and be overwritten when that graph replays
        self.gate_out = torch.zeros(self.depth, b, dtype=torch.bool, device=dev)  # dense gates per block
        self.h_out = torch.zeros(b, 3, device=dev)  # the dense phase's history
        self.context_out: Optional[torch.Tensor] = None  # the gate's context part of every block (made on first use)

        def keep(h: torch.Tensor, context: torch.Tensor):
            if self.context_out is None or self.context_out.shape != context.shape:
                raise RuntimeError("timm_dora.engine.graphs: gate context buffer missing (made before the capture)")
            return self.h_out.copy_(h), self.context_out.copy_(context)

        self.consts.keep = keep
        self.consts.keep_into = lambda: (self.h_out, self.context_out)
        # the packed phase's history part of the gate, kept the same way: computed by a block's
        # graph only where the history changed since the last block (after a deletion), read by
        # the later blocks' graphs from these buffers (h_packed: made above, the controller's h)
        self.context_packed: Optional[torch.Tensor] = None  # made with context_out

        def keep_packed(h: torch.Tensor, context: torch.Tensor):
            if self.context_packed is None or self.context_packed.shape != context.shape:
                raise RuntimeError("timm_dora.engine.graphs: packed gate context buffer missing (made before the capture)")
            return self.h_packed.copy_(h), self.context_packed.copy_(context)

        self.packed_consts.keep = keep_packed
        self.packed_consts.keep_into = lambda: (self.h_packed, self.context_packed)
        self.ctrl_out = (torch.zeros(b * s + 1, dtype=torch.bool, device=dev),  # remove (first rows)
                         torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.float64, device=dev))
        # the controller graph's deletion: the survivors' ids and lengths (also copied to pinned
        # memory, the one value the host waits for); the rows go to x[l % 2] and cu_seqlens to cu
        self.ids = torch.zeros(b * s, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.long, device=dev)
        self.lengths_host = torch.zeros(b, dtype=torch.long, pin_memory=self.capture)
        self.logits: Dict[str, torch.Tensor] = {}  # the readout graphs' outputs: "dense", "packed"
        self.graphs: Dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.cur: Optional[Packed] = None  # the packed phase's current rows (real layout), else None
        self.scale = [blk.attn.scale for blk in model.blocks]

    def gate_copied(self, l: int) -> None:
        """Mark that block ``l``'s gate vector reached pinned memory: in a capture an event-record
        node of the graph, so the host can wait for the gate alone while the rest of the graph
        (attention, MLP) still runs."""
        if self.capture:
            self.gate_ready[l].record(torch.cuda.current_stream(self.device))

    def _read_gate(self, l: int) -> List[bool]:
        """Block ``l``'s gate vector, as soon as its graph copied it (the attention and the
        speculative MLP of the same graph may still be running); remembers whether it opened."""
        if self.capture:
            self.gate_ready[l].synchronize()
        gate = self.gate_host[l].tolist()
        self.opened[l] = any(gate)
        return gate

    def _padded(self, rows: int) -> int:
        total = self.batch * self.seq
        bucket = rows_bucket(total)
        return min(-(-rows // bucket) * bucket, total)

    # ------------------------------------------------------------------------------------------
    # capture and replay

    def run_segment(self, key: tuple) -> None:
        """Run segment ``key`` (:meth:`Segments.build`): replayed from its graph, captured on first
        use; off CUDA run directly."""
        if not self.capture:
            self.segments.build(key)()
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
        fn = self.segments.build(key)
        start = time.perf_counter()
        # the warm-up, outside the capture (lazy initialisations); the capture only records, and
        # the replay gives this call's result, except for segments that consume their input: the
        # controller (its deletion overwrites the block input and layout it read) and, without the
        # actor, the MLP (in place): they must run once, and the warm-up's result is kept
        side = capture_stream(self.device)
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

    # ------------------------------------------------------------------------------------------
    # one forward

    def start(self, images: Optional[torch.Tensor], run_ahead: bool = True) -> None:
        """The dense phase begins: the batch embedded into the first block's input, eagerly, from
        the caller's tensor (a captured embedding would need the images in a fixed buffer too, a
        batch-sized copy per forward and the memory of that buffer). ``images=None``: the forward's
        graph embeds them itself (the whole forward pays that copy: :meth:`embed_into_first`).
        ``run_ahead=False``: not this forward (it runs again after :class:`RunAheadMissed`)."""
        if images is not None:
            self.embed_into_first(images)
        self._ahead_now = self.run_ahead and run_ahead
        self._ahead, self._ahead_unread, self._ahead_logits = 0, False, False
        self.cur = None
        self._history = (None, None, None)  # the tensors last copied into history_in
        self._history_fresh = False  # copied since the last packed block's graph
        self._launched: Optional[int] = None  # the block whose attention graph delete() already replayed
        self._chained_to = -1  # the last block that ran inside a chain segment this forward

    def embed_into_first(self, images: torch.Tensor) -> None:
        """The embedding of ``images`` into the first block's input (and, merging, the sizes reset)."""
        embed(self.model, images, out=self.x[0])
        if self.merge:
            self.sizes.fill_(1.0)

    @property
    def dense(self) -> bool:
        return self.cur is None

    def block(self, l: int, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
              consts: ForwardConstants) -> Tuple[Decision, bool]:
        """Block ``l``'s attention residual and decision: ``(decision, mlp_done)``, the attention-residual
        rows with their layout kept as :attr:`attended` (the executors' interface:
        :mod:`~timm_dora.engine.eager`)."""
        dec, self.attended, done = self._block(l, n_visual, rho, interventions, consts)
        return dec, done

    def _block(self, l: int, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
               consts: ForwardConstants) -> Tuple[Decision, Packed, bool]:
        """Block ``l``'s ``(decision, attended, mlp_done)``: whether the MLP of the unpruned rows
        already ran (speculatively, while the actor's gate vector travelled to the host).

        The policy's ``ctx.keys`` and ``ctx.packed.x`` are views of the runner's fixed buffers
        (dense-phase keys are computed on first read, from the block input): valid during the
        call only; clone what must be kept."""
        blk = self.model.blocks[l]
        kw = dict(block=l, n_visual=n_visual, rho=rho, interventions=interventions, depth=self.depth,
                  num_patches=self.num_patches, backend=self.backend, constants=consts, releasable=True)
        spec = self.probing and not self.opened[l]
        if self.skips is not None and (l <= self._chained_to or self.skips(l)):
            return self._chain(l, consts)
        if l == 0 and self._ahead_now and not self.opened[0]:
            self._launch_ahead()
        if l < self._ahead:  # ran ahead: its gate taken as closed (checked by _check_ahead)
            return consts.nothing(self.steps[l].gate_flops), self.dense_attended, True
        if self.dense:
            fused = self._fuses(l)
            self._fused_at = l if fused else None
            self.run_segment(("attention_controller", l) if fused else ("attention", l, spec))
            self._check_ahead()  # (the block right after a run ahead: its graph is enqueued)
            src = self.dense_inputs[l % 2]
            ctx = LazyKeysContext(lambda: attention_keys(blk, src), packed=src, **kw)
            if not self.probing:
                return self.policy(ctx), self.dense_inputs[(l + 1) % 2], False
            gate_host = self._read_gate(l)  # the graph may also have run the MLP (speculatively)
            step = self.steps[l]
            if not self.opened[l]:
                return self.policy.decide(step, gate_host, ctx), self.dense_attended, spec
            if fused:  # the controller and the deletion ran in the same graph
                return self._decision(step.gate, self.batch * self.seq), self.dense_attended, spec
            return (self._controller(l, self.batch * self.seq, True, step.gate, kept=not spec and self.k is not None),
                    self.dense_attended, spec)
        src = self.cur
        t, rows = src.total, self._padded(src.total)
        if self._launched == l:  # delete() launched this block's graph right after the survivors' MLP
            self._launched = None
        else:
            self._attention_packed(l, rows, spec, n_visual, rho, interventions)
        if self.k is not None:
            ctx = BlockContext(keys=self.k[:t], packed=src, **kw)
        else:
            ctx = LazyKeysContext(lambda: attention_keys(blk, src), packed=src, **kw)
        if not self.probing:
            return self.policy(ctx), src.with_x(self.attn_out(l)[:t]), False
        # the gate ran in the attention graph (in line, right after qkv): it wrote
        # the gate (also to pinned memory) and the controller's inputs; its vector travels to the
        # host while the same graph's MLP of the unpruned rows runs (speculation, as when dense)
        gate_host = self._read_gate(l)
        if not self.opened[l]:
            return self.policy.decide(self.steps[("packed", l)], gate_host, ctx), src.with_x(self.xa[:t]), spec
        if self._fused_at == l:  # the controller and the deletion ran in the attention's graph
            dec = self._decision(self.ctrl_in[2], rows)
        else:
            dec = self._controller(l, rows, False, self.ctrl_in[2])
        return Decision(dec.gate, dec.removed, dec.remove[:t], dec.flops), src.with_x(self.xa[:t]), spec

    def _attention_packed(self, l: int, rows: int, spec: bool, n_visual: torch.Tensor, rho: torch.Tensor,
                          interventions: torch.Tensor) -> None:
        """Replay block ``l``'s packed attention graph (with the actor: its history copied in first)."""
        if self.probing:  # the gate's history into fixed buffers, read by the attention graph's gate
            # (nothing memoised yet: compute its part of the gate)
            fresh = self.set_history(n_visual, rho, interventions) or not self.packed_consts.memo
            self._history_fresh = False
        else:
            fresh = False
        fused = self._fuses(l)
        self._fused_at = l if fused else None
        self.run_segment(("attention_packed_controller" if fused else "attention_packed", l, rows, spec, fresh))

    def _launch_ahead(self) -> None:
        """Replay the run-ahead graph: dense blocks 0 up to the first block whose gate opened in the
        last forward (every block and the readout where none did). The host goes on without
        waiting: :meth:`_check_ahead` reads the gates later."""
        end = next((i for i in range(1, self.depth) if self.opened[i]), self.depth)
        with_readout = end == self.depth and self._captured_readout
        self.run_segment(("run_ahead", 0, end, with_readout))
        self._ahead, self._ahead_unread, self._ahead_logits = end, True, with_readout

    @property
    def _captured_readout(self) -> bool:
        """Whether the readout is a graph: the model's own CLS-token head (pooled readouts run
        eagerly, see :meth:`finish`)."""
        return self.readout_mode == "model" and self.model.global_pool == "token"

    def _check_ahead(self) -> None:
        """Read the run ahead's gate vectors (once per forward, where the host must know: after the
        next block's graph is enqueued, or before the logits are returned; the copy was made
        right after its last block's gate, so the host rarely waits). Where some gate opened at
        block ``k``, remember it (the next run ahead ends before ``k``) and raise
        :class:`RunAheadMissed`: blocks ``k`` and later ran on rows they should have pruned."""
        if not self._ahead_unread:
            return
        self._ahead_unread = False
        if self.capture:
            self.ahead_ready.synchronize()
        gates = self.gate_host[:self._ahead].tolist()
        first_open = next((i for i, g in enumerate(gates) if any(g)), None)
        if first_open is not None:
            self.opened[first_open] = True
            raise RunAheadMissed(first_open)

    def _fuses(self, l: int) -> bool:
        """Whether block ``l``'s attention graph also runs the controller (``EngineOptions.fused_interventions``,
        with the Triton kernels, where the gate opened for some image in the last forward). A wrong
        guess only wastes the controller's work: with no gate open it removes nothing, and its
        identity deletion leaves the attention output intact for the MLP."""
        return active().fused_interventions and self.triton_gate and self.opened[l]

    def set_history(self, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor) -> bool:
        """Copy the history (N_l, rho_l, E_<l) into the fixed buffers the packed gate reads, only
        what changed (the forward replaces a history tensor when its value changes; the references
        kept here keep a replaced one from being reused). Returns whether it changed since the last
        packed block's graph. :meth:`delete` calls it before it waits for the controller, so that
        the copies run behind the controller instead of between the survivors' MLP and the next
        block's graph."""
        for i, value in enumerate((n_visual, rho, interventions)):
            if self._history[i] is not value:
                self.history_in[i].copy_(value)
                self._history_fresh = True
        self._history = (n_visual, rho, interventions)
        return self._history_fresh

    def _chain(self, l: int, consts: ForwardConstants) -> Tuple[Decision, Packed, bool]:
        """Block ``l`` where the policy said it prunes nothing: the first block of a run of such
        blocks replays them all as one segment (attention and MLP of each; fewer graph launches,
        no host work in between), the others only hand on their output."""
        if l > self._chained_to:
            last = l
            while last + 1 < self.depth and self.skips(last + 1):
                last += 1
            rows = self.batch * self.seq if self.dense else self._padded(self.cur.total)
            self.run_segment(("chain", l, last, rows, self.dense))
            self._chained_to = last
        nothing = consts.nothing()
        if self.dense:
            return nothing, self.dense_inputs[(l + 1) % 2], True
        return nothing, self.cur.with_x(self.x[(l + 1) % 2][: self.cur.total]), True

    def _controller(self, l: int, rows: int, dense: bool, gate: torch.Tensor, kept: bool = False) -> Decision:
        """The controller segment (captured per block and rows, the deletion included: see
        :meth:`delete`) and its decision. ``kept``: the dense attention graph kept the keys."""
        self.run_segment(("controller", l, rows, dense, kept))
        return self._decision(gate, rows)

    def _decision(self, gate: torch.Tensor, rows: int) -> Decision:
        """The decision the last controller graph wrote into the fixed outputs."""
        remove, removed, flops = self.ctrl_out
        # copies: the buffers are rewritten by the next controller of this forward
        return Decision(gate.clone(), removed.clone(), remove[:rows].clone(), flops.clone())

    def leave_dense(self) -> None:
        """Continue packed (e.g. after a decision that changed the history the dense graphs assume)."""
        if self.dense:
            self.cur = self.dense_inputs[0].with_x(self.x[0])  # layout only; x set by the next step
            self.cu.copy_(self.cur.cu_seqlens)
            self.ids.copy_(self.cur.ids)

    def mlp(self, l: int, done: bool) -> None:
        """Block ``l``'s MLP residual on the unpruned rows (unless ``done``); the next block's input."""
        attended = self.attended
        t = attended.total
        if not done:
            self.run_segment(("mlp", l, t if self.dense else self._padded(t)))
        if not self.dense:
            self.cur = attended.with_x(self.x[(l + 1) % 2][:t])

    def delete(self, l: int, dec: Decision, history: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
               ) -> int:
        """Delete the decided rows of :attr:`attended` (gathered into ``x[l % 2]``), then the MLP of
        the survivors; returns their number of rows.

        After the actor's controller graph, which already gathered the survivors and wrote the new
        ``cu_seqlens``, the host only waits for the new lengths and replays the MLP. What needs
        the device besides is enqueued before that wait, behind the controller (the GPU is busy
        there, idle after the wait): the layout's copies (the buffers serve the next deletion)
        and ``history``, the next block's (N_l, rho_l, E_<l), into the gate's fixed buffers."""
        attended = self.attended
        if self.probing:  # every deletion of the actor's runner comes from its controller graph
            lengths, ids = self.lengths.clone(), self.ids.clone()
            if history is not None:
                self.set_history(*history)
            if self.capture:
                self.deleted_ready.synchronize()
            lengths_host = self.lengths_host.tolist()
            total = sum(lengths_host)
            rows = self._padded(total)
            self.run_segment(("mlp_compacted", l, rows))
            # (merge) the sizes as a view: only the uncaptured attention reads them, before the next fold
            self.cur = Packed(self.x[(l + 1) % 2][:total], lengths, lengths_host, attended.num_prefix, ids[:total],
                              self.sizes[:total] if self.merge else None)
            if history is not None and l + 1 < self.depth:
                # and the next block's graph right behind it, before the host's bookkeeping: the
                # survivors' MLP is short (ViT-Ti: shorter than the host's way to the next block)
                self._attention_packed(l + 1, rows, not self.opened[l + 1], *history)
                self._launched = l + 1
            return total
        after = delete_rows(attended, dec.remove, dec.removed, dec.removed_host, out=self.x[l % 2])
        self.cur = after
        self.cu.copy_(after.cu_seqlens)
        self.run_segment(("mlp_compacted", l, self._padded(after.total)))
        self.cur = after.with_x(self.x[(l + 1) % 2][: after.total])
        return after.total

    def finish(self) -> Tuple[Optional[torch.Tensor], Optional[Packed]]:
        """Logits (a copy of the graph's buffer) when the readout was replayed (the CLS-token head,
        dense or after a deletion), else ``None`` and the final rows for the eager readout: pooled
        readouts (their per-image pooling is not captured)."""
        self._check_ahead()
        if self._ahead_logits:  # the run ahead's graph ended with the readout (no gate opened)
            return self.logits["ahead"].clone(), None
        if self._captured_readout:
            kind = "dense" if self.dense else "packed"
            self.run_segment(("readout",) if self.dense else ("readout_packed",))
            return self.logits[kind].clone(), None
        return None, self.dense_inputs[self.depth % 2] if self.dense else self.cur


def graph_runner(model: nn.Module, cache, policy, images: torch.Tensor, backend: str, readout_mode: str,
                 merge: bool = False) -> GraphRunner:
    """The :class:`GraphRunner` of ``model`` for this batch shape, policy and the active
    :class:`~timm_dora.engine.options.EngineOptions` (made on first use);
    ``cache`` (an ``OrderedDict``) keeps the ``EngineOptions.max_cached`` most recent of batches
    above ``planned_max_batch`` and, apart, the ``max_cached_small`` most recent of the others."""
    weight = next(model.parameters())
    key = (tuple(images.shape), images.dtype, str(images.device), id(policy), backend, readout_mode,
           weight.dtype, weight.data_ptr(), merge, active())  # (graphs are recorded under the options)
    entry = cache.get(key)
    if entry is not None and entry.policy is policy:
        cache.move_to_end(key)
        return entry
    entry = GraphRunner(model, policy, images, backend, readout_mode, merge)
    cache[key] = entry
    options = active()
    small = entry.batch <= options.planned_max_batch
    same = [k for k, r in cache.items() if (r.batch <= options.planned_max_batch) == small]  # least recent first
    for k in same[:max(0, len(same) - (options.max_cached_small if small else options.max_cached))]:
        cache.pop(k).release()
    return entry


def release_all(cache) -> None:
    """Release every runner of a wrapped model's cache (:meth:`GraphRunner.release`) and empty it."""
    for runner in cache.values():
        runner.release()
    cache.clear()
