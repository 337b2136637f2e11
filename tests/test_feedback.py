"""Closed-loop accuracy feedback (paper App. C) on hand-worked sequences."""
import pytest
import torch

from timm_dora.train.feedback import FeedbackController, paired_drop


def test_paired_drop():
    cn = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0])
    cd = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0])
    # native-correct/dora-wrong: 2, native-wrong/dora-correct: 1 -> (2 - 1) / 8
    assert paired_drop(cn, cd) == 0.125
    assert paired_drop(cd, cn) == -0.125  # signed
    assert paired_drop([True, False], [True, False]) == 0.0
    with pytest.raises(ValueError):
        paired_drop([1, 0], [1])


def _run(fb, drops, start=1, stop=32):
    """Drive updates start..stop; drops[u] is the measured drop at check u. Returns a_u per u."""
    used = {}
    for u in range(start, stop + 1):
        used[u] = fb.coefficient
        if fb.due(u):
            fb.update(u, drops[u], fb.next_shard())
    return used


DROPS = {8: 0.05, 16: 0.0, 24: -0.02, 32: 0.0125}


def test_hand_worked_sequence_with_cadence_and_clips():
    fb = FeedbackController()
    used = _run(fb, DROPS)
    # a_1..a_8 = 30 ; u=8: (0.05-0.01)/0.01 = 4 -> clipped to 2 -> 30 + 10 = 40 applies from u=9
    assert all(used[u] == 30.0 for u in range(1, 9))
    assert all(used[u] == 40.0 for u in range(9, 17))
    # u=16: (0 - 0.01)/0.01 = -1 -> 40 - 5 = 35
    assert all(used[u] == 35.0 for u in range(17, 25))
    # u=24: (-0.02 - 0.01)/0.01 = -3 -> clipped to -2 -> 35 - 10 = 25
    assert all(used[u] == 25.0 for u in range(25, 33))
    # u=32: (0.0125 - 0.01)/0.01 = 0.25 -> 25 + 1.25
    assert fb.coefficient == pytest.approx(26.25, abs=1e-12)
    assert [h["shard"] for h in fb.history] == [0, 1, 2, 3]
    assert [h["u"] for h in fb.history] == [8, 16, 24, 32]


def test_bounds_and_target():
    low = FeedbackController(a_init=5.0)
    low.update(8, -1.0)  # -2 after the inner clip: 5 - 10 -> 0
    assert low.coefficient == 0.0
    low.update(16, -1.0)
    assert low.coefficient == 0.0
    high = FeedbackController(a_init=295.0)
    high.update(8, 0.05)  # 295 + 10 -> 300
    assert high.coefficient == 300.0
    # target 0.005: drop 0.01 -> (0.01 - 0.005)/0.01 = 0.5 -> +2.5 (scale stays 0.01)
    t = FeedbackController(target=0.005)
    t.update(8, 0.01)
    assert t.coefficient == pytest.approx(32.5, abs=1e-12)


def test_cadence_and_order_guards():
    fb = FeedbackController()
    assert [u for u in range(1, 25) if fb.due(u)] == [8, 16, 24]
    with pytest.raises(ValueError):
        fb.update(7, 0.02)
    fb.update(8, 0.02)
    with pytest.raises(ValueError):
        fb.update(8, 0.02)  # no double application
    with pytest.raises(ValueError):
        fb.due(0)


def test_round_robin_shards():
    fb = FeedbackController(num_shards=3)
    assert [fb.next_shard() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_fixed_ablation_never_changes():
    fb = FeedbackController(fixed=True)
    used = _run(fb, DROPS)
    assert set(used.values()) == {30.0} and fb.coefficient == 30.0
    assert len(fb.history) == 4 and fb.shard_pointer == 4


def test_state_dict_exact_resume():
    full = FeedbackController()
    _run(full, DROPS)
    first = FeedbackController()
    _run(first, DROPS, 1, 16)
    state = first.state_dict()
    resumed = FeedbackController(a_init=123.0, fixed=True)  # config and state come from the state dict
    resumed.load_state_dict(state)
    _run(resumed, DROPS, 17, 32)
    assert resumed.state_dict() == full.state_dict()
    with pytest.raises(ValueError):
        resumed.update(32, 0.0)


def test_moving_average_of_the_drops_by_hand():
    """``ema=0.5``: the rule reads 0.03, then 0.5 * 0.03 + 0.5 * (-0.01) = 0.01 (on target: no
    change), then 0.5 * 0.01 + 0.5 * 0.02 = 0.015; a resumed controller continues the average."""
    fb = FeedbackController(a_init=30.0, target=0.01, cadence=1, num_shards=1, ema=0.5)
    assert fb.update(1, 0.03) == 30.0 + 5 * 2  # (0.03 - 0.01) / 0.01 = 2
    assert fb.update(2, -0.01) == 40.0 and fb.smoothed == pytest.approx(0.01)
    again = FeedbackController(cadence=1, num_shards=1)
    again.load_state_dict(fb.state_dict())
    assert again.update(3, 0.02) == pytest.approx(40.0 + 5 * 0.5) and again.smoothed == pytest.approx(0.015)
    assert [h["smoothed"] for h in again.history] == pytest.approx([0.03, 0.01, 0.015])
    with pytest.raises(ValueError, match="moving-average weight"):
        FeedbackController(ema=1.0)


def test_disagreement_counts_every_changed_prediction():
    from timm_dora.train.feedback import disagreement

    native = torch.tensor([3, 1, 4, 1, 5])
    assert disagreement(native, torch.tensor([3, 1, 4, 1, 5])) == 0.0
    assert disagreement(native, torch.tensor([3, 2, 4, 7, 5])) == 0.4  # 2 of 5 changed, labels not needed
    with pytest.raises(ValueError, match="equally long"):
        disagreement(native, native[:3])
