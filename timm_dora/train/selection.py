"""Checkpoint selection on the development split (paper App. E.2).

    c* in argmin_{c : A_N^dev - A_c^dev <= 1.0} F_c^dev          (Eq. app-experiments-selection)

Accuracies are percentages, ``F`` is mean GFLOPs per image. If no checkpoint is feasible (an
ablation), the final checkpoint is reported and flagged as constraint-violating.

``rule="fit"`` (ours, for small dev splits): each checkpoint's drop is read off a fitted curve
instead of its own noisy measurement. Removing more computation should not cost less accuracy, so
the drops are fitted by a non-increasing function of GFLOPs (isotonic regression, pool adjacent
violators, every checkpoint weighted alike); the rule above then applies to the fitted drops. On
150 dev images one checkpoint's drop has a standard error of 2-2.6 pp, and the plain rule picks
whichever checkpoint's noise fell lowest; the fit pools neighbouring checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["CheckpointRecord", "RULES", "Selection", "fitted_drops", "select_checkpoint"]

RULES = ("min", "fit")

# Float slack on the drop comparison, in percentage points: 81.79 - 80.79 evaluates to
# 1.0000000000000142 in binary floating point and must count as a 1.00-pp drop. Accuracies on a
# 10,240-image split move in steps of ~0.0098 pp, so this slack never changes a real decision.
_TOL_PP = 1e-9


@dataclass(frozen=True)
class CheckpointRecord:
    """One saved checkpoint's development-split measurements (accuracies in percent)."""

    name: str
    top1: float
    native_top1: float
    gflops: float
    disagreement: Optional[float] = None  # ours: % of dev images whose top-1 differs from native's (label-free)

    @property
    def drop_pp(self) -> float:
        """Native-relative Top-1 drop in percentage points."""
        return self.native_top1 - self.top1


@dataclass(frozen=True)
class Selection:
    """The chosen checkpoint; ``violates`` is True when none met the constraint (final one returned)."""

    record: CheckpointRecord
    violates: bool
    feasible: Tuple[str, ...]  # names of all feasible checkpoints, in input order
    drops: Tuple[float, ...] = ()  # the drop each checkpoint was judged by (fitted with rule="fit"), input order

    @property
    def name(self) -> str:
        return self.record.name


def _as_record(r: Union[CheckpointRecord, Mapping[str, Any], Any]) -> CheckpointRecord:
    if isinstance(r, CheckpointRecord):
        return r
    get = (lambda k: r[k]) if isinstance(r, Mapping) else (lambda k: getattr(r, k))
    return CheckpointRecord(str(get("name")), float(get("top1")), float(get("native_top1")), float(get("gflops")))


def fitted_drops(records: Sequence[CheckpointRecord]) -> Tuple[float, ...]:
    """The drops (pp) of ``records`` fitted by a non-increasing function of GFLOPs: isotonic
    regression by pool adjacent violators, every checkpoint weighted alike; checkpoints of equal
    GFLOPs share one value. Returned in input order."""
    order = sorted(range(len(records)), key=lambda i: records[i].gflops)
    blocks: list = []  # [sum of drops, count, indices], along increasing GFLOPs
    for i in order:
        blocks.append([records[i].drop_pp, 1, [i]])
        # merge while a block's mean exceeds its left neighbour's (drops must not increase with GFLOPs),
        # and merge equal GFLOPs
        while len(blocks) > 1 and (blocks[-1][0] / blocks[-1][1] > blocks[-2][0] / blocks[-2][1] + _TOL_PP
                                   or records[blocks[-1][2][0]].gflops == records[blocks[-2][2][-1]].gflops):
            s, n, idx = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][2] += idx
    out = [0.0] * len(records)
    for s, n, idx in blocks:
        for i in idx:
            out[i] = s / n
    return tuple(out)


def select_checkpoint(records: Sequence[Union[CheckpointRecord, Mapping[str, Any]]], target_pp: float = 1.0,
                      rule: str = "min") -> Selection:
    """Lowest-GFLOPs checkpoint with ``native_top1 - top1 <= target_pp`` (Eq. app-experiments-selection).

    ``records`` must be in training order (the last one is the final checkpoint); each is a
    :class:`CheckpointRecord` or a mapping/object with ``name``, ``top1``, ``native_top1``,
    ``gflops``. Ties in GFLOPs (the paper's argmin is a set) go to the higher Top-1, then to the
    earlier checkpoint. With no feasible checkpoint the final one is returned with
    ``violates=True``. ``rule="fit"``: the drops are first fitted (:func:`fitted_drops`).
    """
    if rule not in RULES:
        raise ValueError(f"selection rule must be one of {RULES}, got {rule!r}")
    recs = [_as_record(r) for r in records]
    if not recs:
        raise ValueError("no checkpoints to select from")
    drops = fitted_drops(recs) if rule == "fit" else tuple(r.drop_pp for r in recs)
    feasible = [(i, r) for i, r in enumerate(recs) if drops[i] <= target_pp + _TOL_PP]
    names = tuple(r.name for _, r in feasible)
    if not feasible:
        return Selection(recs[-1], True, names, drops)
    _, best = min(feasible, key=lambda ir: (ir[1].gflops, -ir[1].top1, ir[0]))
    return Selection(best, False, names, drops)
