"""Accuracy matching (App. E.2) on synthetic operating-point curves."""
from __future__ import annotations

import json

import pytest

from timm_dora.evaluate.matching import Point, compare, format_table, match, points_from_rows, table_from_results


def _curve(name, pts):
    return [Point(name, t, g, ips, config=i) for i, (t, g, ips) in enumerate(pts)]


def test_closest_within_tolerance_without_interpolation():
    pts = _curve("tome", [(81.5, 30.0, 3000), (80.86, 26.0, 3100), (80.75, 24.0, 3200), (79.9, 20.0, 3500)])
    m = match(80.8, pts)
    assert m is pts[2]  # 0.05 below beats 0.06 above; the measured point, not an interpolation
    assert (m.top1, m.gflops) == (80.75, 24.0)


def test_boundary_is_inclusive_and_beyond_is_missing():
    assert match(80.8, _curve("a", [(80.9, 24.1, 1)])).top1 == 80.9  # exactly 0.1 pp (float noise allowed)
    assert match(80.8, _curve("a", [(80.7, 24.1, 1)])).top1 == 80.7
    assert match(80.8, _curve("a", [(80.91, 24.1, 1), (80.69, 20.0, 1)])) is None
    assert match(80.8, []) is None


def test_ties_favour_the_baseline():
    # equally close above and below: lower GFLOPs wins, then higher throughput, then the earlier point
    pts = _curve("b", [(80.85, 25.0, 3000), (80.75, 23.0, 2000)])
    assert match(80.8, pts).gflops == 23.0
    pts = _curve("b", [(80.85, 23.0, 3000), (80.75, 23.0, 3500)])
    assert match(80.8, pts).images_per_s == 3500
    pts = _curve("b", [(80.8, 23.0, None), (80.8, 23.0, None)])
    assert match(80.8, pts) is pts[0]


def test_compare_omits_missing_and_averages_unweighted():
    dora = Point("DORA", 80.8, 21.7, 3944)
    base = {
        "ToMe": _curve("ToMe", [(80.9, 24.1, 3163), (80.2, 20.0, 3500)]),
        "DiffRate": _curve("DiffRate", [(80.5, 22.1, 3512)]),  # 0.3 pp away: no match
        "MCTF": _curve("MCTF", [(80.8, 21.9, 2122)]),
        "Untimed": _curve("Untimed", [(80.75, 30.0, None)]),
    }
    rows = compare(dora, base, native=Point("Native", 81.8, 35.2, 3230))
    names = [r["method"] for r in rows]
    assert names == ["Native", "ToMe", "DiffRate", "MCTF", "Untimed", "Average of baselines", "DORA"]
    by = {r["method"]: r for r in rows}
    assert by["DiffRate"]["matched"] is False and by["DiffRate"]["top1"] is None
    avg = by["Average of baselines"]
    assert avg["count"] == 3
    assert avg["top1"] == pytest.approx((80.9 + 80.8 + 80.75) / 3)
    assert avg["gflops"] == pytest.approx((24.1 + 21.9 + 30.0) / 3)
    assert avg["images_per_s"] == pytest.approx((3163 + 2122) / 2)  # over the timed matches only
    table = format_table(rows, backbone="DeiT-B")
    lines = table.splitlines()
    assert lines[0].startswith("| Backbone | Method | Top-1 Acc (%) | GFLOPs | Throughput (images/s) |")
    assert "| DeiT-B | Native | 81.8 | 35.2 | 3230 |" in lines
    assert "|  | DiffRate | -- | -- | -- |" in lines
    assert "|  | **DORA** | 80.8 | 21.7 | 3944 |" in lines
    assert "|  | *Average of baselines* | 80.8 | 25.3 | 2642 |" in lines


def test_no_baseline_matches():
    rows = compare(Point("DORA", 70.0, 1.0, 10.0), {"ToMe": _curve("ToMe", [(75.0, 2.0, 5.0)])})
    avg = rows[-2]
    assert avg["method"] == "Average of baselines" and avg["count"] == 0 and avg["top1"] is None
    assert "| *Average of baselines* | -- | -- | -- |" in format_table(rows)


def test_table_from_result_rows(tmp_path):
    rows = [
        {"method": "native", "top1": 75.0, "gflops": 2.51, "images_per_s": 40000.0},
        {"method": "tome(r=2)", "top1": 74.6, "gflops": 2.2, "images_per_s": 41000.0},
        {"method": "tome(r=4)", "top1": 74.02, "gflops": 1.9, "images_per_s": 45000.0},
        {"method": "static-cls_sim(3:20)", "top1": 73.0, "gflops": 1.8, "images_per_s": 50000.0},
        {"method": "static-slice(3:20)", "top1": 74.0, "gflops": 1.7, "images_per_s": 60000.0},
        {"method": "dora", "top1": 74.0, "gflops": 1.6, "images_per_s": 30000.0},
    ]
    assert sorted(points_from_rows(rows)) == ["dora", "native", "static-cls_sim", "static-slice", "tome"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "vit_tiny", "rows": rows}))
    out = table_from_results(path)
    by = {r["method"]: r for r in out["rows"]}
    assert by["tome"]["top1"] == 74.02 and by["static-cls_sim"]["matched"] is False
    assert "static-slice" not in by  # a speed reference, excluded by default
    assert "| vit_tiny | Native | 75.0 | 2.51 | 40000 |" in out["table"]
