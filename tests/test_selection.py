"""Checkpoint selection (paper App. E.2)."""
import pytest

from timm_dora.train.selection import CheckpointRecord, select_checkpoint


def R(name, top1, gflops, native=81.79):
    return CheckpointRecord(name, top1, native, gflops)


def test_lowest_gflops_within_one_point():
    recs = [
        R("u100", 81.5, 25.0),
        R("u200", 80.5, 20.0),  # drop 1.29: infeasible although cheapest
        R("u300", 80.79, 21.66),  # drop 1.00 exactly (81.79 - 80.79 is 1.0000000000000142 in floats)
        R("u400", 81.0, 22.0),
    ]
    sel = select_checkpoint(recs)
    assert sel.name == "u300" and not sel.violates
    assert sel.feasible == ("u100", "u300", "u400")
    # a tighter target changes the choice
    assert select_checkpoint(recs, target_pp=0.5).name == "u100"
    assert select_checkpoint(recs, target_pp=0.8).name == "u400"


def test_infeasible_returns_final_flagged():
    recs = [R("a", 78.0, 15.0), R("b", 78.65, 17.78), R("c", 77.0, 14.0)]
    sel = select_checkpoint(recs)
    assert sel.name == "c" and sel.violates and sel.feasible == ()


def test_ties_and_mappings():
    recs = [
        {"name": "x", "top1": 81.0, "native_top1": 81.79, "gflops": 20.0},
        {"name": "y", "top1": 81.2, "native_top1": 81.79, "gflops": 20.0},
        {"name": "z", "top1": 81.2, "native_top1": 81.79, "gflops": 20.0},
    ]
    assert select_checkpoint(recs).name == "y"  # tie on GFLOPs: higher Top-1, then earlier
    with pytest.raises(ValueError):
        select_checkpoint([])


def test_fitted_drops_by_hand_and_the_fit_rule():
    """Drops along increasing GFLOPs must not increase: 3.0, 0.5, 2.0, 0.0, 0.0 pools the violating
    pair (0.5, 2.0) into 1.25. At a 1 pp target the plain rule takes the lucky 1.6-GFLOPs
    checkpoint (0.5 pp measured), the fit the 1.8 one."""
    from timm_dora.train.selection import fitted_drops

    recs = [CheckpointRecord(f"u{i}", 80.0 - d, 80.0, g)
            for i, (g, d) in enumerate([(1.7, 2.0), (1.5, 3.0), (2.0, 0.0), (1.6, 0.5), (1.8, 0.0)])]
    assert [round(v, 9) for v in fitted_drops(recs)] == [1.25, 3.0, 0.0, 1.25, 0.0]
    assert select_checkpoint(recs, 1.0).name == "u3"
    fit = select_checkpoint(recs, 1.0, rule="fit")
    assert (fit.name, fit.violates, fit.feasible) == ("u4", False, ("u2", "u4"))
    # equal GFLOPs share one fitted value; a run that only gets worse violates
    same = [CheckpointRecord("a", 79.0, 80.0, 1.5), CheckpointRecord("b", 80.0, 80.0, 1.5)]
    assert fitted_drops(same) == (0.5, 0.5)
    with pytest.raises(ValueError, match="selection rule must be one of"):
        select_checkpoint(recs, 1.0, rule="lcb")
