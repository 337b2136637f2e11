"""Accuracy-matched comparison (paper App. E.2) and a table in the shape of the paper's Table 1.

Rule, per dataset: for each baseline, among its *measured* operating points (no interpolation),
take the point whose top-1 is closest to DORA's top-1, provided the difference is at most
``tol = 0.1`` percentage points; a baseline without such a point is omitted ("--" in the table)
and left out of the average. The *Average of baselines* row is the unweighted mean over the
matched baselines (Native and DORA excluded) of top-1, GFLOPs and throughput (throughput over
the matched baselines that have one).

Where the paper is silent we chose:

- the 0.1 pp bound is inclusive, with a 1e-9 allowance for floating-point noise (80.8 vs 80.9 matches);
- ties (two points equally close, e.g. 0.05 above and 0.05 below) go to the point with lower
  GFLOPs, then higher throughput, then the earlier point: the tie favours the baseline;
- accuracies are compared as given (full precision), not after rounding to one decimal.

    from timm_dora.evaluate.matching import Point, compare, format_table
    rows = compare(Point("DORA", 80.8, 21.7, 3944), {"ToMe": [Point("ToMe", 80.9, 24.1, 3163), ...]},
                   native=Point("Native", 81.8, 35.2, 3230))
    print(format_table(rows, backbone="DeiT-B"))
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

__all__ = ["TOLERANCE", "Point", "match", "compare", "format_table", "points_from_rows", "table_from_results"]

TOLERANCE = 0.1  # percentage points
_EPS = 1e-9


@dataclass
class Point:
    """One measured operating point: top-1 (%), GFLOPs/image, images/s (``None``: not timed)."""

    method: str
    top1: float
    gflops: float
    images_per_s: Optional[float] = None
    config: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)


def match(target_top1: float, points: Iterable[Point], tol: float = TOLERANCE) -> Optional[Point]:
    """The point closest to ``target_top1`` within ``tol`` pp (ties: lower GFLOPs, then higher
    throughput, then the earlier point); ``None`` if no point is within ``tol``."""
    best, best_key = None, None
    for i, p in enumerate(points):
        d = abs(float(p.top1) - float(target_top1))
        if d > tol + _EPS:
            continue
        ips = p.images_per_s if p.images_per_s is not None else -math.inf
        key = (round(d, 9), float(p.gflops), -ips, i)
        if best_key is None or key < best_key:
            best, best_key = p, key
    return best


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def compare(
    dora: Point,
    baselines: Mapping[str, Sequence[Point]],
    native: Optional[Point] = None,
    tol: float = TOLERANCE,
) -> List[Dict[str, Any]]:
    """Table rows: Native (if given), each baseline's matched point (``matched: False`` and
    ``None`` values when no point is within ``tol``), *Average of baselines*, DORA."""
    rows: List[Dict[str, Any]] = []
    if native is not None:
        rows.append({"method": "Native", "kind": "native", "matched": True, **_vals(native)})
    matched = []
    for name, pts in baselines.items():
        m = match(dora.top1, pts, tol)
        if m is None:
            rows.append({"method": name, "kind": "baseline", "matched": False, "top1": None, "gflops": None,
                         "images_per_s": None, "config": None, "candidates": len(pts)})
        else:
            matched.append(m)
            rows.append({"method": name, "kind": "baseline", "matched": True, **_vals(m), "candidates": len(pts)})
    ips = [m.images_per_s for m in matched if m.images_per_s is not None]
    rows.append({
        "method": "Average of baselines",
        "kind": "average",
        "matched": bool(matched),
        "top1": _mean([m.top1 for m in matched]),
        "gflops": _mean([m.gflops for m in matched]),
        "images_per_s": _mean(ips),
        "count": len(matched),
    })
    rows.append({"method": dora.method or "DORA", "kind": "dora", "matched": True, **_vals(dora)})
    return rows


def _vals(p: Point) -> Dict[str, Any]:
    return {"top1": p.top1, "gflops": p.gflops, "images_per_s": p.images_per_s, "config": p.config}


def _fmt(v: Optional[float], digits: int) -> str:
    if v is None:
        return "--"
    return f"{v:.{digits}f}"


def format_table(rows: Sequence[Dict[str, Any]], backbone: str = "", gflops_digits: Optional[int] = None,
                 top1_digits: int = 1) -> str:
    """Markdown table in the shape of Table 1: Backbone | Method | Top-1 Acc (%) | GFLOPs | Throughput
    (images/s); ``--`` for no match. ``gflops_digits``: default 1 (2 when native is below 10 GFLOPs)."""
    if gflops_digits is None:
        ref = next((r["gflops"] for r in rows if r.get("kind") == "native" and r.get("gflops")), None)
        ref = ref if ref is not None else max((r["gflops"] or 0.0) for r in rows)
        gflops_digits = 1 if ref >= 10 else 2
    lines = ["| Backbone | Method | Top-1 Acc (%) | GFLOPs | Throughput (images/s) |", "|---|---|---:|---:|---:|"]
    for i, r in enumerate(rows):
        name = r["method"]
        if r.get("kind") == "average":
            name = f"*{name}*"
        elif r.get("kind") == "dora":
            name = f"**{name}**"
        lines.append(
            f"| {backbone if i == 0 else ''} | {name} | {_fmt(r.get('top1'), top1_digits)} | "
            f"{_fmt(r.get('gflops'), gflops_digits)} | {_fmt(r.get('images_per_s'), 0)} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# from result files (benchmarks/compare.py, timm-dora eval/bench)


def _family(method: str) -> str:
    """``tome(r=8)`` -> ``tome``; ``static-cls_sim(3:40,...)`` -> ``static-cls_sim``."""
    return method.split("(")[0]


def points_from_rows(rows: Iterable[Mapping[str, Any]]) -> Dict[str, List[Point]]:
    """Group result rows (``method``, ``top1``, ``gflops``, optional ``images_per_s``) into point
    lists per method family (``tome(r=4)`` and ``tome(r=8)`` are two points of ``tome``)."""
    out: Dict[str, List[Point]] = {}
    for r in rows:
        if r.get("top1") is None:
            continue
        fam = _family(str(r["method"]))
        out.setdefault(fam, []).append(
            Point(str(r["method"]), float(r["top1"]), float(r["gflops"]), r.get("images_per_s"), r.get("config"))
        )
    return out


def table_from_results(results: Union[str, Path, Mapping[str, Any]], dora: str = "dora", native: str = "native",
                       exclude: Sequence[str] = ("static-slice",), backbone: Optional[str] = None,
                       tol: float = TOLERANCE) -> Dict[str, Any]:
    """Matched rows and the formatted table from a result JSON (a path or the loaded dict) whose
    ``rows`` hold native, DORA and baseline sweeps. ``exclude``: families that are speed references,
    not methods (the zero-overhead slice schedule by default)."""
    if not isinstance(results, Mapping):
        results = json.loads(Path(results).read_text())
    groups = points_from_rows(results["rows"])
    if dora not in groups:
        raise ValueError(f"no {dora!r} row in the results; families present: {sorted(groups)}")
    d = groups.pop(dora)[0]
    n = groups.pop(native, [None])[0]
    base = {k: v for k, v in groups.items() if k not in exclude}
    rows = compare(Point("DORA", d.top1, d.gflops, d.images_per_s, d.config), base,
                   None if n is None else Point("Native", n.top1, n.gflops, n.images_per_s), tol)
    name = backbone or str(results.get("model", ""))
    return {"rows": rows, "table": format_table(rows, name), "tolerance_pp": tol}
