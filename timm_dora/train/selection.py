"""Checkpoint selection on the development split (paper App. E.2).

    c* in argmin_{c : A_N^dev - A_c^dev <= 1.0} F_c^dev          (Eq. app-experiments-selection)

Accuracies are percentages, ``F`` is mean GFLOPs per image. If no checkpoint is feasible (an
ablation), the final checkpoint is reported and flagged as constraint-violating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Tuple, Union

__all__ = ["CheckpointRecord", "Selection", "select_checkpoint"]

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

    @property
    def name(self) -> str:
        return self.record.name


def _as_record(r: Union[CheckpointRecord, Mapping[str, Any], Any]) -> CheckpointRecord:
    if isinstance(r, CheckpointRecord):
        return r
    get = (lambda k: r[k]) if isinstance(r, Mapping) else (lambda k: getattr(r, k))
    return CheckpointRecord(str(get("name")), float(get("top1")), float(get("native_top1")), float(get("gflops")))


def select_checkpoint(records: Sequence[Union[CheckpointRecord, Mapping[str, Any]]], target_pp: float = 1.0) -> Selection:
    """Lowest-GFLOPs checkpoint with ``native_top1 - top1 <= target_pp`` (Eq. app-experiments-selection).

    ``records`` must be in training order (the last one is the final checkpoint); each is a
    :class:`CheckpointRecord` or a mapping/object with ``name``, ``top1``, ``native_top1``,
    ``gflops``. Ties in GFLOPs (the paper's argmin is a set) go to the higher Top-1, then to the
    earlier checkpoint. With no feasible checkpoint the final one is returned with
    ``violates=True``.
    """
    recs = [_as_record(r) for r in records]
    if not recs:
        raise ValueError("no checkpoints to select from")
    feasible = [(i, r) for i, r in enumerate(recs) if r.drop_pp <= target_pp + _TOL_PP]
    names = tuple(r.name for _, r in feasible)
    if not feasible:
        return Selection(recs[-1], True, names)
    _, best = min(feasible, key=lambda ir: (ir[1].gflops, -ir[1].top1, ir[0]))
    return Selection(best, False, names)
