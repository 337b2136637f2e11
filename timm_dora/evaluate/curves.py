"""Operating curves compared at matched accuracy, with bootstrap intervals over images (ours).

A method's *curve* is its sweep: points ``(GFLOPs, paired drop)`` measured on the same images as
native, one per setting of its knob. Two curves are compared where they lose the same accuracy.
Measured drops are noisy, so a cheaper setting can look better than a dearer one; each curve is
first made monotone by isotonic regression (:func:`monotone`: the paired drops, ordered from the
most expensive setting to the cheapest, fitted non-decreasing by pooling adjacent violators), which
neither picks the luckiest setting nor lets one unlucky setting decide. :func:`gflops_at_drop`
then reads the GFLOPs at which the fitted drop reaches a target ``d``, interpolating linearly
between the two settings that bracket it. It is undefined (``nan``) where the curve's most
expensive setting already drops ``d`` or more, or where no setting drops ``d``: no extrapolation.

:func:`compare_at_drops` gives, for each target, ``method - reference`` GFLOPs (positive: the method
needs more computation for the same accuracy, the reference wins) and its 95 % percentile interval
from a bootstrap over images: each resample draws the images with replacement, recomputes every
point of both curves (the paired drops and, for methods whose cost varies per image, the mean
GFLOPs) and reads both again. An interval that contains 0 is a difference the images cannot
resolve.

Per-image inputs: ``correct`` ``[n]`` (bool, the setting's top-1 hit), ``gflops`` ``[n]`` and the
native model's ``correct`` on the same images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

__all__ = ["Point", "compare_at_drops", "gflops_at_drop", "monotone", "paired_drop"]


@dataclass
class Point:
    """One setting of a method on ``n`` images: per-image top-1 hits and GFLOPs."""

    knob: object
    correct: torch.Tensor  # [n] bool
    gflops: torch.Tensor  # [n] float64


def paired_drop(native: torch.Tensor, correct: torch.Tensor) -> Dict[str, float]:
    """Native's top-1 minus the method's in percentage points, and its standard error (the mean and
    standard error of the per-image differences in ``{-1, 0, 1}``)."""
    diff = native.double() - correct.double()
    n = diff.numel()
    mean = float(diff.mean())
    var = float((diff * diff).mean()) - mean * mean
    return {"paired_drop": 100.0 * mean, "paired_drop_se": 100.0 * math.sqrt(max(var, 0.0) / n)}


def monotone(drops: Sequence[float]) -> List[float]:
    """The non-decreasing least-squares fit to ``drops`` (pool adjacent violators, equal weights):
    a curve's paired drops, ordered from its most expensive setting to its cheapest, with the noise
    that makes a cheaper setting look better removed by averaging the settings that disagree."""
    blocks: List[List[float]] = []  # [sum, count] of each pooled run
    for d in drops:
        blocks.append([float(d), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def gflops_at_drop(gflops: Sequence[float], drops: Sequence[float], target: float) -> float:
    """The GFLOPs at which the curve ``(gflops[i], drops[i])``, made monotone (:func:`monotone`),
    reaches a paired drop of ``target`` (see the module docstring)."""
    pts = sorted(zip(gflops, drops), key=lambda p: -p[0])
    if not pts:
        return math.nan
    g = [p[0] for p in pts]
    d = monotone([p[1] for p in pts])
    if d[0] >= target:
        return math.nan
    for g0, d0, g1, d1 in zip(g, d, g[1:], d[1:]):
        if d0 < target <= d1:
            return g0 + (target - d0) / (d1 - d0) * (g1 - g0)
    return math.nan


def _curve(points: Sequence[Point], native: torch.Tensor, idx: torch.Tensor):
    """GFLOPs and paired drops (pp) of every point, ``[R, K]`` each, on the resamples ``idx`` ``[R, n]``."""
    nat = native.double()[idx]
    g = torch.stack([p.gflops.double()[idx].mean(1) for p in points], 1)
    d = torch.stack([100.0 * (nat - p.correct.double()[idx]).mean(1) for p in points], 1)
    return g, d


def compare_at_drops(method: Sequence[Point], reference: Sequence[Point], native: torch.Tensor,
                     drops: Sequence[float] = (0.5, 1.0, 1.5), resamples: int = 1000, seed: int = 0,
                     level: float = 0.95) -> List[Dict[str, object]]:
    """``method`` against ``reference`` at each paired drop of ``drops`` (see the module docstring):
    per target, both curves' GFLOPs there, their difference, its bootstrap interval, the share of
    resamples where both were defined and a verdict (``reference wins``, ``method wins`` or
    ``unresolved``; ``undefined`` where a curve does not reach the target on all images)."""
    n = native.numel()
    if any(p.correct.numel() != n or p.gflops.numel() != n for p in list(method) + list(reference)):
        raise ValueError("every point must be measured on the same images as native")
    if not method or not reference:
        raise ValueError("both curves need at least one point")
    full = torch.arange(n)[None]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (resamples, n), generator=gen)
    (gm, dm), (gr, dr) = _curve(method, native, full), _curve(reference, native, full)
    (bgm, bdm), (bgr, bdr) = _curve(method, native, idx), _curve(reference, native, idx)
    out = []
    for target in drops:
        a = gflops_at_drop(gm[0].tolist(), dm[0].tolist(), target)
        b = gflops_at_drop(gr[0].tolist(), dr[0].tolist(), target)
        diffs = []
        for r in range(resamples):
            x = gflops_at_drop(bgm[r].tolist(), bdm[r].tolist(), target)
            y = gflops_at_drop(bgr[r].tolist(), bdr[r].tolist(), target)
            if not (math.isnan(x) or math.isnan(y)):
                diffs.append(x - y)
        row: Dict[str, object] = {"drop_pp": target, "method_gflops": _num(a), "reference_gflops": _num(b),
                                  "gflops_diff": _num(a - b), "defined_fraction": len(diffs) / resamples}
        if diffs and not (math.isnan(a) or math.isnan(b)):
            q = torch.tensor(diffs, dtype=torch.float64)
            lo, hi = (float(torch.quantile(q, t)) for t in ((1 - level) / 2, (1 + level) / 2))
            row["ci95"] = [lo, hi]
            row["verdict"] = "reference wins" if lo > 0 else "method wins" if hi < 0 else "unresolved"
        else:
            row["ci95"] = None
            row["verdict"] = "undefined"
        out.append(row)
    return out


def _num(v: float):
    return None if math.isnan(v) else float(v)
