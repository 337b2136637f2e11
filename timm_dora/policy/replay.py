"""Policies that decide nothing themselves: :class:`NoPrune` (never prunes) and
:class:`ReplayPolicy` (deletes recorded tokens, by position among the current visual tokens; used
for shadow evaluations, selector-substitution studies, tests and benchmarks)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..engine.packing import removal_mask
from ..engine.protocol import BlockContext, Decision

__all__ = ["NoPrune", "ReplayPolicy"]


class NoPrune:
    """A policy that never removes a token (the wrapped model then equals the native one)."""

    reads_keys = False  # (see timm_dora.engine.graphs: keys are then never materialised for it)
    exportable = True  # (see timm_dora.engine.protocol: torch.export can trace it)

    def __call__(self, ctx: BlockContext) -> Decision:
        return ctx.nothing()

    def prunes_nothing_at(self, block: int) -> bool:
        """Known before block ``block`` runs: this policy removes nothing there (see :mod:`timm_dora.engine.graphs`)."""
        return True

class ReplayPolicy:
    """Replays recorded deletions.

    ``plan[l] = (image, col)``: two ``[R]`` int64 tensors; at block ``l`` image ``image[r]`` loses
    the visual token at column ``col[r]`` (0-based among that image's visual tokens entering block
    ``l``, in order). Blocks missing from the plan prune nothing. ``stop_after``: replay only blocks
    ``<= stop_after`` (a complete-prefix shadow); later blocks run unpruned. ``check``: validate
    the plan against the batch (on the host, no extra sync).

    The plan is read once, at construction (one device-to-host copy for all blocks): per block and
    image the removal count and column range, so a forward never waits for the device (the new
    lengths are known on the host). Do not modify the plan's tensors afterwards.
    """

    reads_keys = False  # decisions come from the plan (see timm_dora.engine.graphs)
    exportable = True  # the plan is read at construction, not from the forward's tensors

    def __init__(self, plan: Dict[int, Tuple[torch.Tensor, torch.Tensor]], stop_after: Optional[int] = None, check: bool = True):
        self.plan = plan
        self.stop_after = stop_after
        self.check = check
        self._host = _plan_on_host(plan)
        self._device: Dict[tuple, Tuple[torch.Tensor, ...]] = {}  # per (block, batch, device); see _device_step

    def __call__(self, ctx: BlockContext) -> Decision:
        b = ctx.packed.batch_size
        dev = ctx.packed.lengths.device
        step = self.plan.get(ctx.block)
        if step is None or (self.stop_after is not None and ctx.block > self.stop_after) or ctx.block not in self._host:
            return ctx.nothing()
        counts, lo, hi = self._host[ctx.block]
        if len(counts) > b:
            raise ValueError(f"replay plan at block {ctx.block} names image {len(counts) - 1} of a batch of {b}")
        if self.check:
            n_host = ctx.n_visual_host
            if any(c and (lo[i] < 0 or hi[i] >= n_host[i]) for i, c in enumerate(counts)):
                raise ValueError(f"replay plan at block {ctx.block} names a token beyond an image's visual tokens")
            if any(n_host[i] - c < 1 for i, c in enumerate(counts)):
                raise ValueError(f"replay plan at block {ctx.block} would remove every visual token of an image")
        image, col, removed, gate = self._device_step(ctx.block, b, dev)
        return Decision(gate, removed, removal_mask(ctx.packed, image, col),
                        removed_host=counts + [0] * (b - len(counts)))

    def prunes_nothing_at(self, block: int) -> bool:
        """True where the plan removes nothing (or ``stop_after`` cuts it off): the call would
        return ``ctx.nothing()``, so the CUDA-graph path runs such blocks without calling it
        (:mod:`timm_dora.engine.graphs`, chains of whole blocks)."""
        return block not in self._host or (self.stop_after is not None and block > self.stop_after)

    def _device_step(self, block: int, b: int, dev: torch.device):
        """``(image, col, removed, gate)`` of a plan block on ``dev`` for a batch of ``b``, made
        once (the plan is fixed) instead of four kernels per deletion in every forward."""
        key = (block, b, str(dev))
        cached = self._device.get(key)
        if cached is None:
            image, col = (t.to(dev) for t in self.plan[block])
            removed = torch.tensor(self._host[block][0] + [0] * (b - len(self._host[block][0])), dtype=torch.long, device=dev)
            cached = self._device[key] = (image, col, removed, removed > 0)
        return cached


def _plan_on_host(plan: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> Dict[int, Tuple[List[int], List[int], List[int]]]:
    """Per non-empty block of a replay plan: per image (up to the highest one named) the removal
    count and the lowest and highest column, read with one device-to-host copy."""
    blocks = [l for l, (image, _) in plan.items() if image.numel()]
    if not blocks:
        return {}
    dev = plan[blocks[0]][0].device
    flat = torch.cat([torch.stack([plan[l][0].reshape(-1).long(), plan[l][1].reshape(-1).long().to(plan[l][0].device)]).to(dev)
                      for l in blocks], 1).cpu()
    out = {}
    for l, (image, col) in zip(blocks, flat.split([plan[l][0].numel() for l in blocks], 1)):
        m = int(image.max()) + 1
        counts = torch.bincount(image, minlength=m)
        lo = torch.full((m,), 0, dtype=torch.long).scatter_reduce(0, image, col, "amin", include_self=False)
        hi = torch.full((m,), -1, dtype=torch.long).scatter_reduce(0, image, col, "amax", include_self=False)
        out[l] = (counts.tolist(), lo.tolist(), hi.tolist())
    return out
