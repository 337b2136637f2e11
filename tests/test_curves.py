"""Matched-accuracy comparison of operating curves (timm_dora.evaluate.curves) and the corruptions
(timm_dora.evaluate.corruptions), against values computed by hand."""
import math

import pytest
import torch

from timm_dora.evaluate.corruptions import FAMILIES, corrupt
from timm_dora.evaluate.curves import Point, compare_at_drops, gflops_at_drop, monotone, paired_drop


def test_monotone_pools_adjacent_violators_by_hand():
    assert monotone([0.2, 0.8, 1.4, 1.1]) == pytest.approx([0.2, 0.8, 1.25, 1.25])
    assert monotone([1.0, 0.0, 0.5, 2.0]) == pytest.approx([0.5, 0.5, 0.5, 2.0])  # 1, 0 pool to 0.5; 0.5 ties
    assert monotone([0.1, 0.2, 0.3]) == [0.1, 0.2, 0.3]  # already monotone: unchanged


def test_gflops_at_drop_reads_the_monotone_curve():
    # from the most expensive point: (2.0, 0.2), (1.6, 0.8), (1.2, 1.4), (1.0, 1.1): fitted 0.2, 0.8, 1.25, 1.25
    g, d = [1.2, 2.0, 1.0, 1.6], [1.4, 0.2, 1.1, 0.8]
    assert gflops_at_drop(g, d, 0.5) == pytest.approx(2.0 + (0.5 - 0.2) / 0.6 * (1.6 - 2.0))  # 1.8
    assert gflops_at_drop(g, d, 1.0) == pytest.approx(1.6 + (1.0 - 0.8) / 0.45 * (1.2 - 1.6))
    assert gflops_at_drop(g, d, 1.25) == pytest.approx(1.2)  # reached exactly at a (pooled) point
    assert math.isnan(gflops_at_drop(g, d, 1.5))  # never reached: no extrapolation
    assert math.isnan(gflops_at_drop(g, d, 0.1))  # the most expensive setting already drops more


def test_paired_drop_and_its_standard_error_by_hand():
    native = torch.tensor([1, 1, 1, 0, 1], dtype=torch.bool)
    method = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)
    # differences 0, 1, 0, -1, 1: mean 0.2, mean of squares 0.6, variance 0.56
    out = paired_drop(native, method)
    assert out["paired_drop"] == pytest.approx(20.0)
    assert out["paired_drop_se"] == pytest.approx(100 * math.sqrt(0.56 / 5))


def _points(native, drops_per_point, gflops):
    """Settings whose hits are native's with the first ``k`` correct images turned wrong."""
    pts = []
    for k, g in zip(drops_per_point, gflops):
        c = native.clone()
        c[torch.nonzero(native).squeeze(1)[:k]] = False
        pts.append(Point(k, c, torch.full((native.numel(),), float(g), dtype=torch.float64)))
    return pts


def test_compare_at_drops_point_estimate_and_verdicts():
    n = 400
    native = torch.ones(n, dtype=torch.bool)
    native[::10] = False  # 360 correct
    # reference: drop 0.25 pp per 0.1 GFLOPs; the method needs 0.5 GFLOPs more for the same drop
    ref = _points(native, [0, 2, 4, 6, 8], [2.0, 1.9, 1.8, 1.7, 1.6])
    meth = _points(native, [0, 2, 4, 6, 8], [2.5, 2.4, 2.3, 2.2, 2.1])
    rows = compare_at_drops(meth, ref, native, drops=(1.0,), resamples=200, seed=1)
    (row,) = rows
    # drop 1.0 pp = 4 images of 400: reached at the third point of each curve
    assert row["method_gflops"] == pytest.approx(2.3) and row["reference_gflops"] == pytest.approx(1.8)
    assert row["gflops_diff"] == pytest.approx(0.5)
    lo, hi = row["ci95"]
    assert lo > 0 and row["verdict"] == "reference wins"  # the curves never cross: every resample says so
    same = compare_at_drops(ref, ref, native, drops=(1.0,), resamples=50)[0]
    assert same["gflops_diff"] == 0 and same["ci95"] == [0.0, 0.0] and same["verdict"] == "unresolved"
    out_of_range = compare_at_drops(meth, ref, native, drops=(5.0,), resamples=20)[0]
    assert out_of_range["verdict"] == "undefined" and out_of_range["gflops_diff"] is None


def test_compare_at_drops_refuses_points_on_other_images():
    native = torch.ones(10, dtype=torch.bool)
    bad = [Point(0, torch.ones(9, dtype=torch.bool), torch.ones(9, dtype=torch.float64))]
    with pytest.raises(ValueError, match="same images"):
        compare_at_drops(bad, bad, native)


def test_corruptions_by_hand():
    x = torch.rand(2, 3, 16, 16)
    c = FAMILIES["contrast"][2]  # severity 3
    m = x.mean(dim=(1, 2, 3), keepdim=True)
    assert torch.allclose(corrupt(x, "contrast", 3), (x - m) * c + m)
    flat = torch.full((1, 3, 16, 16), 0.5)
    assert torch.allclose(corrupt(flat, "gaussian_blur", 2), flat)  # blurring a constant image changes nothing
    noisy = corrupt(torch.full((4, 3, 64, 64), 0.5), "gaussian_noise", 1, seed=3)
    assert (noisy - 0.5).std().item() == pytest.approx(FAMILIES["gaussian_noise"][0], rel=0.05)
    assert torch.equal(noisy, corrupt(torch.full((4, 3, 64, 64), 0.5), "gaussian_noise", 1, seed=3))  # seeded
    smooth = torch.linspace(0, 1, 32)[None, None, :, None].expand(1, 3, 32, 32).contiguous()
    j = corrupt(smooth, "jpeg", 1)
    assert j.shape == smooth.shape and 0 < (j - smooth).abs().max() < 0.2  # lossy, but the same picture
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt(x, "fog", 1)
    with pytest.raises(ValueError, match="severity"):
        corrupt(x, "jpeg", 6)
