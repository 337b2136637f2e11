"""The whole forward as one CUDA graph: the captured executor for batches up to 16, and for larger
ones whose dense work is small (``EngineOptions.planned_max_gflops``: ViT-Ti and DeiT-Ti at 320).

At small batches the per-block executor (:mod:`~timm_dora.engine.graphs`) is bound by the host: it
waits for each block's gate vector and, after a deletion, for the new lengths (about 13 waits and
2.5 ms of Python per DeiT-B forward on an H100). Here the segments of every block are recorded back
to back as one graph and every decision stays on the device:

- the embedding, from a fixed copy of the images (one batch-sized copy before the replay: the
  graph starts at once, where an eager embedding kept it waiting for a few launches);
- per block, the attention residual with the actor's gate in line, then, where the graph runs the
  controller, the controller on every image masked by the gate, the deletion (with ``merge=True``
  the removed rows folded into their best match first; the survivors gathered to the front of the rows, lengths and ``cu_seqlens`` updated) and the history
  ``(N_l, rho_l, E_<l)`` updated in place, then the MLP; rows past the survivors are padding that
  the attention never reads and the deletion never gathers;
- the CLS-token readout at the final ``cu_seqlens``; where the last block runs the controller
  (``EngineOptions.last_block_prefix_only``), that block's MLP on the prefix rows of its attention's
  output and the readout beside the decision, its deletion keeping only the books, and the plan's
  check right after the last gate (:func:`prefix_readout`).

**Planned** (the default: ``EngineOptions.planned``, batches up to ``planned_max_batch`` or of at
most ``planned_max_gflops`` dense GFLOPs): a
:class:`Plan` bounds the rows each block runs on and names the blocks that run the controller. It
comes from an observed forward (the first of a batch size, by the eager executor:
:func:`plan_from`, the rows seen plus ``EngineOptions.margin_sd`` standard deviations of a batch's total,
the controller where a gate opened). The graph runs the blocks up to the first controller dense
(as the per-block executor's dense phase), the rest packed at their bounds, and copies which
gates opened and how many rows each block left as soon as the last block's gate and deletion are
done (the host reads that once, :func:`held`, while the GPU runs the last MLP and the readout):
where a gate opened outside the plan or a block got more rows than its bound, the
graph's output is discarded, the forward runs again eagerly and the plan grows to cover it (the
bounds only grow, so a stream of batches settles on a plan after a few misses). A plan made or
grown also names the blocks where the plans of the model's other batch sizes run the controller
(the same policy): a gate that opens rarely costs one miss per model, not one per batch size.

At a planned block without a controller the actor's gate is read only by that check: with
``EngineOptions.aside_gates`` (the default) it runs on a second stream (:class:`Aside`), a branch of
the graph beside the block's attention and MLP, joined at the next block, and so does the check.
One H200, the graph's replay alone: ViT-Ti 430 -> 405 us at one image, 501 -> 475 at eight; DeiT-B
forced 723 -> 676 and 1,045 -> 997. With ``EngineOptions.aside_controller`` (the default) a
controller block's decision runs there too, beside the block's attention, projection and residual,
and the fold and the deletion wait for it (the join).

**Unplanned** (``EngineOptions.whole_max_batch``, off by default; ``whole``): every block at the unpruned
batch's ``B*S`` rows with the controller at every block (torch 2.11 has no CUDA-graph conditional
nodes to skip it where no gate opened; the actor's Triton kernels then see empty sequences and
return at once), no host read at all. The planned graph was faster at every batch size measured
(``benchmarks/results/small_batch_h100.json``), since the unplanned one runs the dense parts on
every row of the unpruned batch and the deletion's small kernels at every block.

What the statistics need is recorded per block inside the graph (gates, removals, the actor's
FLOPs, the rows' ids and the removal mask) and copied once per forward; ``model.dora_stats`` is
computed from the copies when read. Only for a deterministic :class:`~timm_dora.policy.ActorPolicy`
of the CLS form (the actor decides inside the graphs) with the CLS-token readout.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from .deletion_kernel import MAX_ROWS as DELETION_MAX_ROWS
from .flops import native_gflops
from .options import active
from .packing import Packed

__all__ = ["Aside", "aside", "Plan", "whole_reason", "runs_whole", "plans", "one_graph_reason", "plan_from", "whole_segment",
           "forward_whole", "held", "prefix_readout"]


class Plan(NamedTuple):
    """A planned whole forward (a graph per plan): ``rows``, the padded rows each block runs on
    (``depth + 1`` entries: the last, the survivors after the last block); ``controls``, the blocks
    whose graph runs the controller and the deletion (elsewhere the gate must stay closed)."""
    rows: Tuple[int, ...]
    controls: Tuple[bool, ...]


def whole_reason(runner) -> Optional[str]:
    """Why a runner's forwards cannot run as one graph (``None``: they can)."""
    if not runner.probing:
        return "the policy decides on the host (not a deterministic CLS actor at its own input size)"
    if not runner._captured_readout:
        return "the readout pools over tokens (captured only for the CLS-token head)"
    return None


def runs_whole(runner) -> bool:
    """Whether this runner's forward runs as one graph (``EngineOptions.whole``, ``whole_max_batch``)."""
    options = active()
    if options.whole is False or whole_reason(runner) is not None:
        return False
    return options.whole is True or (runner.capture and runner.batch <= options.whole_max_batch)


def plans(runner) -> bool:
    """Whether this runner's forward runs as a planned graph (``EngineOptions.planned``,
    ``planned_max_batch``, ``planned_max_gflops``; not where it runs whole unplanned)."""
    options = active()
    if options.planned is False or whole_reason(runner) is not None or runs_whole(runner):
        return False
    return options.planned is True or (runner.capture and (runner.batch <= options.planned_max_batch
                                                           or dense_gflops(runner) <= options.planned_max_gflops))


def dense_gflops(runner) -> float:
    """The runner's batch of images through the backbone unpruned, in GFLOPs (``planned_max_gflops``)."""
    if getattr(runner, "_dense_gflops", None) is None:
        runner._dense_gflops = runner.batch * native_gflops(runner.model, runner.num_patches)
    return runner._dense_gflops


def one_graph_reason(runner) -> Optional[str]:
    """Why this runner's forward replays a graph per block instead of one graph for the whole
    forward (``None``: it runs as one, planned or unplanned)."""
    if runs_whole(runner) or plans(runner):
        return None
    why = whole_reason(runner)
    if why is not None:
        return why
    options = active()
    if options.planned is False:
        return "EngineOptions(planned=False)"
    if not runner.capture:
        return "not captured (planned=None plans captured forwards only)"
    return (f"batch {runner.batch} above EngineOptions.planned_max_batch={options.planned_max_batch} and "
            f"{dense_gflops(runner):.0f} dense GFLOPs above planned_max_gflops={options.planned_max_gflops:g}")


def plan_from(opened: Sequence[bool], removed: Sequence[Sequence[int]], seq: int, bucket: int,
              old: Optional[Plan] = None) -> Plan:
    """The plan that covers an observed forward: ``opened[l]`` whether block ``l``'s gate opened for
    some image, ``removed[i][l]`` the rows image ``i`` lost there, ``seq`` the rows of an image
    entering block 0. Each bound is the rows seen plus ``EngineOptions.margin_sd`` standard deviations of the
    batch's total, padded up to a multiple of ``bucket``, never above the rows of the block before;
    with ``old``, the larger bounds and the union of the controls (a plan only grows). One or two
    images have no spread to take a margin from (one has none; two, half their difference, zero
    where they agree: every later batch that kept more rows would miss, each miss an eager forward
    and a capture, 1.6-1.8 s on an H200, once in 2,000 requests of DeiT-Ti's merging actor at two
    images in three serving runs): their bounds are the full rows, which the latency-bound kernels
    of one or two images run in about the same time (native DeiT-Ti's 116-117 kernels took 0.355 ms
    at one image, 0.374 at two; ``benchmarks/results/serving_latency_h100.json``)."""
    batch, depth = len(removed), len(opened)
    total = batch * seq
    lengths, rows = [seq] * batch, [total]
    for l in range(depth):
        lengths = [n - r[l] for n, r in zip(lengths, removed)]
        t = sum(lengths)
        sd = math.sqrt(sum((n - t / batch) ** 2 for n in lengths) / batch)
        bound = t + math.ceil(active().margin_sd * math.sqrt(batch) * sd) if batch > 2 else total
        rows.append(min(rows[-1], -(-bound // bucket) * bucket))
    controls = [bool(o) for o in opened]
    if old is not None:
        rows = [max(a, b) for a, b in zip(rows, old.rows)]
        controls = [a or b for a, b in zip(controls, old.controls)]
    return Plan(tuple(rows), tuple(controls))


class _Record:
    """What the statistics need, written by the graph at every block: views of one fixed byte
    buffer, so that a forward's record is one copy."""

    def __init__(self, depth: int, batch: int, rows: int, device: torch.device):
        self.shapes = {"flops": ((depth, batch), torch.float64),  # the actor's FLOPs
                       "left": ((depth,), torch.long),  # the rows each deletion left (its books)
                       "counts": ((2, depth, batch), torch.long),  # gate, removed
                       "ids": ((depth, rows), torch.long),  # the rows' ids, before
                       "remove": ((depth, rows), torch.bool)}  # the removed rows
        # where each part starts in the buffer (8-byte aligned), and the buffer's size last
        self.offsets = [0]
        for shape, dtype in self.shapes.values():
            self.offsets.append(self.offsets[-1] + -(-math.prod(shape) * dtype.itemsize // 8) * 8)
        # a planned forward's check, what the host reads: the rows left and the gates (counts[0]),
        # side by side in the buffer
        self.depth, at = depth, self.offsets[list(self.shapes).index("left")]
        self.check = slice(at, at + (depth + depth * batch) * 8)
        with torch.inference_mode(False):
            self.flat = torch.zeros(self.offsets[-1], dtype=torch.uint8, device=device)
            # (the typed views too: under inference_mode they would be inference tensors, which a
            # later capture under no_grad could not write)
            self.counts, self.flops, self.ids, self.remove, self.left = (
                self.views(self.flat)[k] for k in ("counts", "flops", "ids", "remove", "left"))
            self.check_host = torch.zeros(self.check.stop - at, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.closed: dict = {}  # plan -> its closed blocks (an index on the device)
        self.checked = torch.cuda.Event(external=True) if device.type == "cuda" else None

    def views(self, flat: torch.Tensor) -> dict:
        """The typed views of a byte buffer laid out as :attr:`flat`."""
        return {name: flat[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for (name, (shape, dtype)), at in zip(self.shapes.items(), self.offsets)}

    def copy(self) -> "_RecordCopy":
        """This forward's record (the buffer is rewritten by the next replay): one copy now, its
        typed views made when the statistics are read (not on the request's path)."""
        return _RecordCopy(self, self.flat.clone())

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def checked_values(self) -> Tuple[list, list]:
        """The check the host read (after :attr:`checked`): per block, the gates that opened and
        the rows its deletion left (stale where none ran)."""
        values = self.check_host.view(torch.long).tolist()  # (one conversion: a request waits for this)
        depth = self.depth
        batch = (len(values) - depth) // depth
        gates = values[depth:]
        return [sum(gates[l * batch:(l + 1) * batch]) for l in range(depth)], values[:depth]


class _RecordCopy:
    """A forward's copied record: ``gate`` and ``removed`` (``[B, L]``), ``flops`` (``[L, B]``),
    ``ids`` and ``remove`` (``[L, rows]``), views of the copy made on first read."""

    def __init__(self, record: _Record, flat: torch.Tensor):
        self._record, self._flat = record, flat

    @functools.cached_property
    def _views(self) -> dict:
        return self._record.views(self._flat)

    @functools.cached_property
    def gate(self) -> torch.Tensor:
        return self._views["counts"][0].t().bool()

    @functools.cached_property
    def removed(self) -> torch.Tensor:
        return self._views["counts"][1].t()

    @property
    def flops(self) -> torch.Tensor:
        return self._views["flops"]

    @property
    def ids(self) -> torch.Tensor:
        return self._views["ids"]

    @property
    def remove(self) -> torch.Tensor:
        return self._views["remove"]


class Aside:
    """Work of the whole graph that the chain of a request's kernels does not wait for (at a closed
    block the actor's gate, its history part and rho's reset, read only by later gates and the plan's
    check; the check's copies; the closed blocks' record rows): :meth:`fork` enqueues it on a second
    stream behind what the current stream has enqueued so far, :meth:`join` makes the current
    stream wait for all of it. Captured, the two streams are two branches of the graph, which the
    GPU runs side by side. The tensors the forked work reads (a view of the block's ``qkv`` output)
    are held until the join: freed earlier, the allocator could hand their memory to a kernel of
    the current stream that nothing orders after the reads."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.held: list = []
        self.forked = False

    def fork(self, fn: Callable[[], None], *hold: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            fn()
        self.held.extend(hold)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.held.clear()
            self.forked = False


def aside(runner, fn: Callable[[], None], *hold: torch.Tensor, on: bool = True) -> None:
    """``fn()`` on the runner's :class:`Aside` stream where ``on`` (holding ``hold`` until the
    join), else in line."""
    if on:
        runner.aside.fork(fn, *hold)
    else:
        fn()


class _Missed(Exception):
    """Uncaptured, a block got more rows than its plan's bound (captured, the check says so)."""


def whole_segment(runner, fused: bool, plan: Optional[Plan] = None) -> Callable[[], None]:
    """The function the whole-forward graph records: every block's segments (the controller, the
    deletion and the history update masked by the gate), then the readout into a fixed buffer.
    Without ``plan`` every block runs at ``B*S`` rows with the controller; with it at the plan's
    rows, the controller only where it says, and right after the last block's gate and deletion
    the check :func:`forward_whole` reads (on the :class:`Aside` stream with ``EngineOptions.aside_gates``).
    ``fused``: the controller reads the keys in place from the attention's ``qkv`` output (the
    Triton gate)."""
    r = runner
    depth, total, p = r.depth, r.batch * r.seq, r.model.num_prefix_tokens
    checked = plan is not None
    rows, controls = plan if checked else ((total,) * (depth + 1), (True,) * depth)
    # planned, the blocks up to the first controller run dense (equal lengths, the MLP in the
    # attention's graph where no controller follows; captured, the varlen kernel attends, faster
    # here than cuDNN's attention); the rest packed
    n_dense = (controls.index(True) + 1 if True in controls else depth) if checked else 0
    # the history (N_l, rho_l, E_<l) a gate reads changes after a controller (all three) and after
    # the closed block that follows one (rho back to 0), nowhere else: a packed block computes the
    # gate's history part only then (``fresh``), and only that closed block zeroes rho
    after = [l > 0 and controls[l - 1] for l in range(depth)]
    fresh = [l == n_dense or after[l] or (l > 1 and controls[l - 2]) for l in range(depth)]
    # residual sums with the LayerNorm that follows in one kernel (dense_kernels.add_layer_norm):
    # each MLP's with the next block's norm1, and where no deletion comes between them the
    # attention's with norm2; the normalised rows pass through a fixed buffer
    if getattr(r, "normed", None) is None:
        with torch.inference_mode(False):
            r.normed = torch.empty_like(r.x[0])
        r.buffer_bytes += r.normed.numel() * r.normed.element_size()
    after_mlp = [l + 1 < depth for l in range(depth)]  # the MLP writes the next block's norm1
    mid = [not controls[l] for l in range(depth)]  # the attention writes norm2 for its MLP
    # after a deletion (EngineOptions.norm_in_gather; None: up to the deletion kernel's MAX_ROWS
    # rows) the deletion does, with its gather
    asked = active().norm_in_gather
    norm_in_gather = [asked if asked is not None else rows[l] <= DELETION_MAX_ROWS for l in range(depth)]
    norms = [(l > 0 and after_mlp[l - 1], mid[l], after_mlp[l]) for l in range(depth)]
    # EngineOptions.aside_gates: planned and captured, a closed block's actor work (its history
    # part, its gate, rho's reset) on a second stream (Aside), joined at the next block; the
    # history it reads is written only by a controller's deletion, after that join
    side = [checked and r.capture and r.triton_gate and active().aside_gates and not controls[l] for l in range(depth)]
    # EngineOptions.aside_controller: likewise a controller block's decision, forked by the
    # attention's keys hook (segments._fork_decision), joined before the fold and the deletion
    decide_side = [checked and r.capture and r.triton_gate and fused and active().aside_controller and controls[l]
                   for l in range(depth)]
    uses_aside = any(side) or any(decide_side)
    if uses_aside and getattr(r, "aside", None) is None:
        r.aside = Aside(r.device)
    attend = [r.segments.build(("attention", l, not controls[l], fused and controls[l], None, norms[l], True, side[l]) if l < n_dense else
                               ("attention_packed", l, rows[l], False, fresh[l], fused and controls[l], True, norms[l], side[l]))
              for l in range(depth)]
    # the deletion keeps the books (the history, the record's rows, the rows left: deletion_kernel.Books);
    # planned, the first controller (dense) sets the history instead of updating it, so that
    # nothing resets it before, and a deletion past its bound clamps cu_seqlens (captured: the
    # output of such a miss is discarded, but the later blocks' kernels must not index past their rows)
    first = n_dense - 1 if checked and True in controls else None
    books = [(r.num_patches if l == first else 0, rows[l + 1] if checked and r.capture else 0, checked)
             for l in range(depth)]
    # EngineOptions.last_block_prefix_only: a controller at the last block keeps only its books, and
    # that block's MLP runs on the prefix rows before the deletion, with the readout, beside the
    # decision (the CLS-token head reads nothing else)
    last = depth - 1
    prefix_only = prefix_readout(controls)
    control = [r.segments.build(("controller", l, rows[l], l < n_dense, "in_place" if fused else False, books[l],
                                 norm_in_gather[l], prefix_only and l == last)) if controls[l] else None
               for l in range(depth)]
    # the MLP: of the deletion's output (x[l % 2]) or, with no controller, of the attention's (xa)
    mlp = [None if (l < n_dense and not controls[l]) or (prefix_only and l == last) else
           r.segments.build(("mlp_compacted", l, rows[l + 1], (norm_in_gather[l], after_mlp[l])) if controls[l] else
                            ("mlp", l, rows[l + 1], norms[l][1:])) for l in range(depth)]
    read = r.segments.build(("readout_prefix", last, last < n_dense) if prefix_only else ("readout_packed",))
    dense, rec = r.dense_inputs[0], r.record
    n_visual, rho, interventions = r.history_in
    steps = [l if l < n_dense else ("packed", l) for l in range(depth)]
    # the closed blocks' records (nothing removed, the gate's FLOPs) written once after the last
    # block, by the rows of a fixed index (a graph keeps no tensor alive: the record holds it); the
    # dense blocks' gates stay in their rows of gate_out, copied once too
    closed = [l for l in range(depth) if control[l] is None]
    if closed and plan not in rec.closed:
        with torch.inference_mode(False):
            rec.closed[plan] = torch.tensor(closed, device=r.device)

    def check():  # which gates opened, how many rows each deletion left (its books): to the host,
        # with an event, as soon as the last block's gate and deletion are done (the host checks
        # the plan while the GPU runs the last MLP and the readout)
        rec.counts[0].copy_(r.gate_out)  # every block's gates, in its row (dense and packed)
        rec.check_host.copy_(rec.flat[rec.check], non_blocking=r.capture)
        if r.capture:
            rec.checked.record(torch.cuda.current_stream(r.device))

    def closed_records():  # the closed blocks' records: nothing removed, the gate's FLOPs
        gate_flops = {r.steps[steps[l]].gate_flops for l in closed}  # (the same for every image)
        rec.counts[1].index_fill_(0, rec.closed[plan], 0)
        if len(gate_flops) == 1:
            rec.flops.index_fill_(0, rec.closed[plan], gate_flops.pop())
        else:
            for l in closed:
                rec.flops[l].fill_(r.steps[steps[l]].gate_flops)

    def whole():
        r.decide_aside = None  # (set per controller block below, taken by its keys hook)
        r.embed_into_first(r.images_in)  # (the images' fixed buffer: forward_whole)
        if first is None:  # (else the first deletion writes all of them)
            r.cu.copy_(dense.cu_seqlens)
            r.ids.copy_(dense.ids)
            n_visual.fill_(r.num_patches)
            rho.zero_()
            interventions.zero_()
        if not r.capture:  # uncaptured, the attention and the controller run on the real rows
            r.cur = dense.with_x(r.x[0])
        for l in range(depth):
            if not r.capture and r.cur.total > rows[l]:  # (uncaptured the attention needs the real rows)
                raise _Missed
            if uses_aside:
                r.aside.join()  # (the last block's gate, long done: it ran beside this chain)
            if decide_side[l]:
                r.decide_aside = control[l].decide  # (forked as soon as the keys exist)
            attend[l]()  # the attention residual into xa, the gate (and the history's part of it)
            if prefix_only and l == last:
                if decide_side[l] and r.decide_aside is not None:  # (not forked: in line, and the gate with it)
                    r.decide_aside, decide = None, r.decide_aside
                    decide()
                if checked:  # every gate is known, and no later block reads this one's rows: the check
                    check()  # now, in line (the host checks while the GPU runs the decision and the head)
                read()  # (the prefix rows' MLP and the head, beside the decision where it runs aside)
            if control[l] is None:  # planned closed: nothing removed (the check reads the gate)
                if after[l]:
                    aside(r, rho.zero_, on=side[l])
            else:
                if decide_side[l]:
                    if r.decide_aside is not None:  # (not forked: no keys hook ran; in line then)
                        r.decide_aside, decide = None, r.decide_aside
                        decide()
                    control[l].prepare()  # (merge: the fold's similarities, beside the decision)
                    r.aside.join()  # the decision, made beside the attention
                    control[l].delete()
                else:
                    control[l]()
                # (the survivors gathered from xa into x[l % 2], the new ids, lengths, cu; the history
                # (N_l, rho_l, E_<l) updated and the block's record written: its books)
                r.keys_in_place = None  # (a view of this block's qkv output)
                if not r.capture and not (prefix_only and l == last):
                    t = int(r.lengths.sum())
                    r.cur = Packed(r.x[l % 2][:t], r.lengths.clone(), r.lengths.tolist(), p, r.ids[:t].clone(),
                                   r.sizes[:t].clone() if r.merge else None)
            if checked and l == depth - 1 and not prefix_only:  # (beside the last MLP where the gates run aside)
                aside(r, check, on=any(side))
            if mlp[l] is not None:  # (else it ran in the attention's graph)
                mlp[l]()
        if not checked:
            rec.counts[0].copy_(r.gate_out)
        if closed:  # (aside where the gates run there: only the statistics read these rows)
            aside(r, closed_records, on=any(side))
        if not prefix_only:
            read()
        out = r.logits.get("whole")
        if out is None:  # made by the warm-up, outside the capture's memory pool
            with torch.inference_mode(False):
                out = r.logits["whole"] = torch.empty_like(r.logits["packed"])
        out.copy_(r.logits["packed"])
        if uses_aside:
            r.aside.join()  # (the check: the graph ends on the stream it began on)
    return whole


def forward_whole(runner, images: torch.Tensor, fused: bool, plan: Optional[Plan] = None):
    """One forward of ``images`` (the runner's batch shape) as one graph. Returns the logits and
    the forward's record (:meth:`_Record.copy`), or ``None`` where ``plan`` did not hold (a gate
    opened outside it, or a block had more rows than its bound: the output is wrong). ``fused``:
    as for :func:`whole_segment`."""
    r = runner
    if getattr(r, "record", None) is None:
        r.record = _Record(r.depth, r.batch, r.batch * r.seq, r.device)
        r.buffer_bytes += r.record.nbytes
    if getattr(r, "images_in", None) is None:  # the graph embeds the images from a fixed buffer
        with torch.inference_mode(False):
            r.images_in = torch.empty(images.shape, dtype=images.dtype, device=images.device)  # (contiguous)
        r.buffer_bytes += r.images_in.numel() * r.images_in.element_size()
    r.host_reads = False  # (decisions stay on the device: no gate or length copies to the host)
    try:
        r.start(None, run_ahead=False)  # (the graph embeds)
        r.images_in.copy_(images)  # (right before the replay: the GPU waits for no host work between)
        r.run_segment(("whole", bool(r.triton_gate and fused)) + ((plan,) if plan is not None else ()))
    except _Missed:
        return None
    finally:
        r.host_reads, r.cur = True, None
    # the copies enqueued right behind the replay, before the host waits for its check: the GPU
    # runs them without waiting for the host (discarded where the plan did not hold)
    out = r.logits["whole"].clone(), r.record.copy()
    if plan is not None and not held(plan, r.record, last_bound=not prefix_readout(plan.controls)):
        return None
    return out


def prefix_readout(controls: Sequence[bool]) -> bool:
    """Whether the whole graph of a plan with these ``controls`` (every block's, unplanned) reads
    out the prefix rows of the last block's attention (``EngineOptions.last_block_prefix_only``,
    a controller at the last block): its deletion then keeps only its books, and the plan's check
    comes before it."""
    return bool(controls[-1]) and active().last_block_prefix_only


def held(plan: Plan, record: _Record, last_bound: bool = True) -> bool:
    """Whether a planned forward stayed inside its plan (waits for the graph's check): no gate
    opened outside its controls, no deletion left more rows than its bound (a block without one
    keeps the rows before it). ``last_bound=False``: the last block's rows are not checked (no
    block reads them: :func:`prefix_readout`; the check ran before that deletion)."""
    if record.checked is not None:
        record.checked.synchronize()
    opened, left = record.checked_values()
    n, last = plan.rows[0], len(plan.controls) - 1
    for l, (g, c, after, bound) in enumerate(zip(opened, plan.controls, left, plan.rows[1:])):
        n = after if c else n
        if (g and not c) or (n > bound and (last_bound or l < last)):
            return False
    return True
