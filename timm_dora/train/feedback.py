"""Closed-loop accuracy feedback on the fidelity coefficient (paper Sec. 3.4, App. C).

PPO updates are indexed ``u = 1, 2, ...``; update ``u`` (its rollout and its PPO step) uses the
coefficient ``a_u``, with ``a_1 = 30``. Every 8th update (``u % 8 == 0``), after collecting the
rollout and before the policy update, the deterministic actor is evaluated on the next of 8 fixed
QC shards (round robin) and the paired Top-1 drop ``d_u`` (Eq. app-feedback-paired-drop) sets

    a_{u+1} = clip_[0,300]( a_u + 5 clip_[-2,2]( (d_u - d*) / 0.01 ) )     (Eq. app-feedback-update)

with target ``d* = 0.01``; otherwise ``a_{u+1} = a_u``. The new value applies from the next rollout.

``--feedback-signal disagreement`` (ours): the trainer passes :func:`disagreement` (the share of QC
images whose top-1 differs from native's) instead of the paired drop, with ``target`` the
disagreement to hold and ``scale`` the same fraction of it as the paper's ``0.01`` of ``d*``.

``ema`` (ours, for small QC sets; 0 is the paper's rule): the rule reads an exponential moving
average of the checks' drops, ``d~_u = ema d~_prev + (1 - ema) d_u`` (the first check's own), so
that a few images' noise moves the coefficient less.

Usage per update ``u``::

    a_u = fb.coefficient                      # rollout + rewards + PPO of update u use a_u
    if fb.due(u):
        shard = fb.next_shard()               # evaluate the deterministic actor on this shard
        fb.update(u, paired_drop(c_native, c_dora), shard)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["FeedbackController", "SIGNALS", "disagreement", "paired_drop"]

SIGNALS = ("drop", "disagreement")  # what a check measures: the paper's paired drop, or (ours) label-free disagreement

Correct = Union[torch.Tensor, Sequence[bool], Sequence[int]]


def paired_drop(correct_native: Correct, correct_dora: Correct) -> float:
    """``d = (1/M) sum_i (c^N_i - c^D_i) = Acc_N - Acc_D`` as a signed fraction (Eq. app-feedback-paired-drop).

    ``correct_native`` / ``correct_dora``: per-image Top-1 correctness of the Native and DORA
    predictions on the same images (bool or 0/1). ``100 d`` is the drop in percentage points.
    """
    cn = torch.as_tensor(correct_native).reshape(-1).to(torch.float64)
    cd = torch.as_tensor(correct_dora).reshape(-1).to(torch.float64)
    if cn.numel() != cd.numel() or cn.numel() == 0:
        raise ValueError(f"need two equally long, non-empty correctness vectors, got {cn.numel()} and {cd.numel()}")
    return float((cn - cd).mean())


def disagreement(pred_native: torch.Tensor, pred_dora: torch.Tensor) -> float:
    """The share of images whose top-1 class differs from the native model's (ours, ``--feedback-signal
    disagreement``): label-free, so a check can read images without labels, and on the same images it
    moves in finer steps than the paired drop (every flip counts, not only flips of correct answers)."""
    a, b = torch.as_tensor(pred_native).reshape(-1), torch.as_tensor(pred_dora).reshape(-1)
    if a.numel() != b.numel() or a.numel() == 0:
        raise ValueError(f"need two equally long, non-empty prediction vectors, got {a.numel()} and {b.numel()}")
    return float((a != b).double().mean())


class FeedbackController:
    """State of the fidelity-coefficient feedback loop.

    Args:
        a_init: ``a_1`` (30).
        target: ``d*`` as a fraction (0.01; the sweep uses 0.005 / 0.015).
        scale: normalization of the error (0.01, fixed across targets).
        step: gain (5).
        inner_clip: bound of the normalized error (2: clip to ``[-2, 2]``).
        bounds: range of the coefficient (``[0, 300]``).
        cadence: check every ``cadence`` updates (8).
        num_shards: QC shards evaluated round robin (8 shards of 2,048 images).
        fixed: ablation "Fixed coefficient": checks still run (and are logged) but the
            coefficient never changes.
        ema: weight of the past in the moving average of the drops the rule reads (ours; 0: the
            paper's, each check's own drop).
    """

    def __init__(
        self,
        a_init: float = 30.0,
        target: float = 0.01,
        scale: float = 0.01,
        step: float = 5.0,
        inner_clip: float = 2.0,
        bounds: Tuple[float, float] = (0.0, 300.0),
        cadence: int = 8,
        num_shards: int = 8,
        fixed: bool = False,
        ema: float = 0.0,
    ) -> None:
        if cadence < 1 or num_shards < 1 or scale <= 0 or bounds[0] > bounds[1]:
            raise ValueError("need cadence >= 1, num_shards >= 1, scale > 0 and bounds[0] <= bounds[1]")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"the drop's moving-average weight must be in [0, 1), got {ema}")
        self.ema = float(ema)
        self.smoothed: Optional[float] = None  # the moving average of the drops so far (None: no check yet)
        self.target, self.scale, self.step, self.inner_clip = float(target), float(scale), float(step), float(inner_clip)
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.cadence, self.num_shards, self.fixed = int(cadence), int(num_shards), bool(fixed)
        self.coefficient = float(a_init)
        self.shard_pointer = 0
        self.last_update = 0  # u of the latest applied check (0: none yet)
        self.history: List[Dict[str, float]] = []

    def due(self, u: int) -> bool:
        """Whether update ``u`` (1-based) carries a feedback check (``u % cadence == 0``)."""
        if u < 1:
            raise ValueError(f"updates are numbered from 1, got u={u}")
        return u % self.cadence == 0

    def next_shard(self) -> int:
        """The QC shard for the next check (round robin); advances the pointer."""
        shard = self.shard_pointer
        self.shard_pointer = (shard + 1) % self.num_shards
        return shard

    def proposed(self, a: float, drop: float) -> float:
        """``clip_bounds(a + step clip((drop - target)/scale, -c, c))`` (Eq. app-feedback-update)."""
        err = (drop - self.target) / self.scale
        err = min(max(err, -self.inner_clip), self.inner_clip)
        return min(max(a + self.step * err, self.bounds[0]), self.bounds[1])

    def update(self, u: int, drop: float, shard: Optional[int] = None) -> float:
        """Apply the check of update ``u`` with paired drop ``drop`` (a fraction); returns ``a_{u+1}``.

        ``shard`` (optional) is only logged in :attr:`history`.

        Raises if ``u`` carries no check or was already applied (checks must come in increasing
        ``u``), so a resumed run cannot apply a check twice.
        """
        if not self.due(u):
            raise ValueError(f"update u={u} has no feedback check (cadence {self.cadence})")
        if u <= self.last_update:
            raise ValueError(f"feedback for u={u} already applied (last applied u={self.last_update})")
        before = self.coefficient
        drop = float(drop)
        self.smoothed = drop if self.smoothed is None else self.ema * self.smoothed + (1.0 - self.ema) * drop
        after = before if self.fixed else self.proposed(before, self.smoothed)
        self.coefficient = after
        self.last_update = u
        self.history.append({"u": u, "shard": shard, "drop": drop, "smoothed": self.smoothed, "a_before": before,
                             "a_after": after})
        return after

    def state_dict(self) -> Dict[str, Any]:
        return {
            "coefficient": self.coefficient,
            "smoothed": self.smoothed,
            "shard_pointer": self.shard_pointer,
            "last_update": self.last_update,
            "history": [dict(h) for h in self.history],
            "config": {
                "target": self.target, "scale": self.scale, "step": self.step, "inner_clip": self.inner_clip,
                "bounds": list(self.bounds), "cadence": self.cadence, "num_shards": self.num_shards,
                "fixed": self.fixed, "ema": self.ema,
            },
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        cfg = state.get("config")
        if cfg is not None:
            self.target, self.scale, self.step = float(cfg["target"]), float(cfg["scale"]), float(cfg["step"])
            self.inner_clip, self.bounds = float(cfg["inner_clip"]), (float(cfg["bounds"][0]), float(cfg["bounds"][1]))
            self.cadence, self.num_shards, self.fixed = int(cfg["cadence"]), int(cfg["num_shards"]), bool(cfg["fixed"])
            self.ema = float(cfg.get("ema", 0.0))
        self.coefficient = float(state["coefficient"])
        self.smoothed = state.get("smoothed")
        self.shard_pointer = int(state["shard_pointer"])
        self.last_update = int(state["last_update"])
        self.history = [dict(h) for h in state["history"]]
