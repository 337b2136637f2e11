"""The whole forward as one CUDA graph: the captured executor for small batches.

At batch 1 to 8 the per-block executor (:mod:`~timm_dora.engine.graphs`) is bound by the host: it
waits for each block's gate vector and, after a deletion, for the new lengths (about 13 waits and
2.5 ms of Python per DeiT-B forward on an H100), and a native model compiled by Inductor is just as
host-bound, so the two traded places from run to run (``benchmarks/results/default_speed_h100.json``).
Here every shape is fixed at the unpruned batch's ``B*S`` rows and every decision stays on the
device, so the forward is one graph, replayed with no host read:

- per block, the same segments as the per-block executor's packed phase, recorded back to back:
  the attention on the packed rows (``cu_seqlens`` in a fixed buffer, the longest possible
  sequence as its maximum) with the actor's gate in line; then the controller on every image
  masked by the gate, the deletion (the survivors gathered to the front of the rows, lengths and
  ``cu_seqlens`` updated) and the history ``(N_l, rho_l, E_<l)`` updated in place; then the MLP on
  all ``B*S`` rows: the rows past the survivors are padding that the attention never reads and the
  deletion never gathers;
- the CLS-token readout at the final ``cu_seqlens``.

The price is that the dense parts (``qkv``, projection, MLP) run on every row of the unpruned
batch at every block: only the attention shrinks. At small batches those products are too short
to fill the GPU anyway; at larger ones the per-block executor, which runs them on the survivors
only, is faster (the crossover, measured on an H100, sets :data:`MAX_BATCH`). The controller and
the deletion run at every block, masked by the gate (where no gate opened they change nothing);
the actor's Triton kernels then see empty sequences and return at once, and the deletion's few
small kernels run an identity gather. (CUDA-graph conditional nodes, in torch releases after the
2.11 of the H100 here, could skip them where no gate opened; not built.)

What the statistics need is recorded per block inside the graph (gates, removals, the actor's
FLOPs, the rows' ids and the removal mask) and copied once per forward; ``model.dora_stats`` is
computed from the copies when read. Only for a deterministic :class:`~timm_dora.policy.ActorPolicy`
of the CLS form (the actor decides inside the graphs) with the CLS-token readout.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from .packing import Packed

__all__ = ["MAX_BATCH", "WHOLE", "whole_reason", "runs_whole", "whole_segment", "forward_whole"]

# Batches up to this size run as one graph (when captured): the crossover against the per-block
# executor on an H100 (benchmarks/small_batch.py: one graph faster at 1 and 8, per block from 16)
MAX_BATCH = 8
# None: as above; True: every forward the runner can run whole, captured or not (the CPU tests run
# it uncaptured); False: never
WHOLE: Optional[bool] = None


def whole_reason(runner) -> Optional[str]:
    """Why a runner's forwards cannot run as one graph (``None``: they can)."""
    if not runner.probing:
        return "the policy decides on the host (not a deterministic CLS actor at its own input size)"
    if not runner._captured_readout:
        return "the readout pools over tokens (captured only for the CLS-token head)"
    return None


def runs_whole(runner) -> bool:
    """Whether this runner's forward runs as one graph (:data:`WHOLE`, :data:`MAX_BATCH`)."""
    if WHOLE is False or whole_reason(runner) is not None:
        return False
    return WHOLE is True or (runner.capture and runner.batch <= MAX_BATCH)


class _Record:
    """What the statistics need, written by the graph at every block (fixed buffers)."""

    def __init__(self, depth: int, batch: int, rows: int, device: torch.device):
        with torch.inference_mode(False):
            self.counts = torch.zeros(2, depth, batch, dtype=torch.long, device=device)  # gate, removed
            self.flops = torch.zeros(depth, batch, dtype=torch.float64, device=device)  # the actor's
            self.ids = torch.zeros(depth, rows, dtype=torch.long, device=device)  # the rows' ids, before
            self.remove = torch.zeros(depth, rows, dtype=torch.bool, device=device)  # the removed rows

    def copy(self) -> SimpleNamespace:
        """This forward's record (the buffers are rewritten by the next replay)."""
        counts = self.counts.clone()
        return SimpleNamespace(gate=counts[0].t().bool(), removed=counts[1].t(), flops=self.flops.clone(),
                               ids=self.ids.clone(), remove=self.remove.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counts, self.flops, self.ids, self.remove))


def whole_segment(runner, fused: bool) -> Callable[[], None]:
    """The function the whole-forward graph records: every block's segments at ``B*S`` rows (the
    controller, the deletion and the history update masked by the gate), then the readout into a
    fixed buffer. ``fused``: the controller reads the keys in place from the attention's ``qkv``
    output (the Triton gate)."""
    r = runner
    depth, rows, p = r.depth, r.batch * r.seq, r.model.num_prefix_tokens
    dense = r.dense_inputs[0]
    rec = r.record
    attend = [r._segment(("attention_packed", l, rows, False, True, fused)) for l in range(depth)]
    control = [r._segment(("controller", l, rows, False, "in_place" if fused else False)) for l in range(depth)]
    mlp = [r._segment(("mlp_compacted", l, rows)) for l in range(depth)]  # the deletion's output -> next input
    read = r._segment(("readout_packed",))
    n_visual, rho, interventions = r.history_in
    gate, (remove, removed, flops) = r.ctrl_in[2], r.ctrl_out

    def whole():
        r.cu.copy_(dense.cu_seqlens)
        r.ids.copy_(dense.ids)
        n_visual.fill_(r.num_patches)
        rho.zero_()
        interventions.zero_()
        if not r.capture:  # uncaptured, the attention and the controller run on the real rows
            r.cur = dense.with_x(r.x[0])
        for l in range(depth):
            attend[l]()  # the attention residual into xa, the gate (and the history's part of it)
            rec.ids[l].copy_(r.ids)
            control[l]()  # the survivors gathered from xa into x[l % 2], the new ids, lengths, cu
            rec.counts[0, l].copy_(gate)
            rec.counts[1, l].copy_(removed)
            rec.flops[l].copy_(flops)
            rec.remove[l].copy_(remove[:rows])
            torch.div(removed, n_visual, out=rho)  # rho_{l+1} = k_l / N_l, then N_{l+1} = N_l - k_l
            n_visual.sub_(removed)
            interventions.add_(gate)
            r._keys_in_place = None  # (a view of this block's qkv output)
            if not r.capture:
                total = int(r.lengths.sum())
                r.cur = Packed(r.x[l % 2][:total], r.lengths.clone(), r.lengths.tolist(), p, r.ids[:total].clone())
            mlp[l]()
        read()
        out = r.logits.get("whole")
        if out is None:  # made by the warm-up, outside the capture's memory pool
            with torch.inference_mode(False):
                out = r.logits["whole"] = torch.empty_like(r.logits["packed"])
        out.copy_(r.logits["packed"])
    return whole


def forward_whole(runner, images: torch.Tensor, fused: bool):
    """One forward of ``images`` (the runner's batch shape) as one graph. Returns the logits and
    the forward's record (:meth:`_Record.copy`). ``fused``: as for :func:`whole_segment`."""
    r = runner
    if getattr(r, "record", None) is None:
        r.record = _Record(r.depth, r.batch, r.batch * r.seq, r.device)
        r.buffer_bytes += r.record.nbytes
    r.host_reads = False  # (decisions stay on the device: no gate or length copies to the host)
    try:
        r.start(images, run_ahead=False)  # the embedding, eagerly, into the first block's input
        r._run(("whole", bool(r.triton_gate and fused)))
    finally:
        r.host_reads, r.cur = True, None
    return r.logits["whole"].clone(), r.record.copy()
