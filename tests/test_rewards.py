"""Rewards (paper App. B): KL fidelity cost, compression increments, gate-off carry, telescoping."""
import math

import pytest
import torch

from timm_dora.train.rewards import (
    compression_before,
    compression_increments,
    fidelity_divergence,
    fill_gate_off,
    step_rewards,
    token_layer_compression,
)

NAN = float("nan")


def test_kl_two_class_by_hand():
    # softmax([3 ln 3, 0] / 3) = [3/4, 1/4]; reference [1/2, 1/2]
    zn = torch.tensor([[0.0, 0.0]])
    z = torch.tensor([[3.0 * math.log(3.0), 0.0]])
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = 0.5 ln(4/3)
    d = fidelity_divergence(zn, z, tau=3.0)
    assert d.shape == (1,) and d.dtype == torch.float32
    assert d.item() == pytest.approx(9.0 * kl, rel=1e-6)
    assert 9.0 * kl == pytest.approx(4.5 * math.log(4.0 / 3.0), rel=1e-12)
    # tau = 1 on the same pair: KL directly, no tau^2 factor
    d1 = fidelity_divergence(zn.double(), torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64), tau=1.0)
    assert d1.dtype == torch.float64 and d1.item() == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-12)


def test_kl_identity_asymmetry_and_stability():
    zn = torch.tensor([[2.0, -1.0, 0.5], [1e4, 0.0, -1e4]])
    assert fidelity_divergence(zn, zn).tolist() == [0.0, 0.0]
    z = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1e4, -1e4]])
    d = fidelity_divergence(zn, z)
    assert torch.isfinite(d).all() and (d > 0).all()
    # huge logits: p^N is one-hot on class 0, q puts log-prob (0 - 1e4)/3 on it -> D = 9 * 1e4/3
    assert d[1].item() == pytest.approx(9.0 * 1e4 / 3.0, rel=1e-6)
    assert fidelity_divergence(z, zn)[0].item() != pytest.approx(d[0].item(), rel=1e-3)  # KL is not symmetric
    # -inf reference logits (masked classes) contribute nothing
    zm = torch.tensor([[0.0, 0.0, float("-inf")]])
    zp = torch.tensor([[3.0 * math.log(3.0), 0.0, float("-inf")]])
    assert fidelity_divergence(zm, zp).item() == pytest.approx(4.5 * math.log(4.0 / 3.0), rel=1e-6)


def test_compression_increments_by_hand():
    k = torch.tensor([[2, 0, 4], [0, 0, 0], [1, 1, 1]])
    dc = compression_increments(k, num_patches=8, depth=3, dtype=torch.float64)
    # dC_l = k_l (L - l) / (L N0) = k_l (3 - l) / 24
    expected = torch.tensor([[6 / 24, 0.0, 4 / 24], [0.0, 0.0, 0.0], [3 / 24, 2 / 24, 1 / 24]], dtype=torch.float64)
    assert torch.allclose(dc, expected, rtol=0, atol=1e-15)
    # N_post = [6, 6, 2] -> C = (2 + 2 + 6) / 24 ; second image 0 ; third N_post = [7, 6, 5] -> 6 / 24
    c = token_layer_compression(k, 8, torch.float64)
    assert torch.allclose(c, torch.tensor([10 / 24, 0.0, 6 / 24], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(dc.sum(1), c, rtol=0, atol=1e-15)
    cb = compression_before(k, 8, torch.float64)
    assert torch.allclose(cb[0], torch.tensor([0.0, 6 / 24, 6 / 24], dtype=torch.float64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        compression_increments(k, 8, depth=4)


def test_compression_sum_random_trajectories():
    g = torch.Generator().manual_seed(0)
    k = torch.randint(0, 9, (64, 12), generator=g) * 2  # never below 4 survivors of 196
    dc = compression_increments(k, 196, 12, torch.float64)
    assert torch.allclose(dc.sum(1), token_layer_compression(k, 196, torch.float64), rtol=0, atol=1e-12)


def test_fill_gate_off():
    d = torch.tensor([[0.3, NAN, 0.5], [NAN, 0.2, NAN], [NAN, NAN, NAN], [0.1, -0.05, 0.4]])
    gate = torch.tensor([[True, False, True], [False, True, False], [False, False, False], [True, True, True]])
    out = fill_gate_off(d, gate)
    expected = torch.tensor([[0.3, 0.3, 0.5], [0.0, 0.2, 0.2], [0.0, 0.0, 0.0], [0.1, -0.05, 0.4]])
    assert torch.equal(out, expected)
    # k counts work like the gate
    k = torch.tensor([[2, 0, 4], [0, 6, 0], [0, 0, 0], [2, 2, 2]])
    assert torch.equal(fill_gate_off(d, k), expected)


def test_step_rewards_by_hand_and_telescoping():
    k = torch.tensor([[2, 0, 4]])
    d = fill_gate_off(torch.tensor([[0.3, NAN, 0.5]], dtype=torch.float64), k)
    r = step_rewards(k, d, 10.0, num_patches=8)
    # r0 = 25 * 6/24 - 10 * 0.3 ; r1 = 0 ; r2 = 25 * 4/24 - 10 * 0.2
    assert r.dtype == torch.float64
    assert r[0].tolist() == pytest.approx([6.25 - 3.0, 0.0, 25 * 4 / 24 - 2.0], abs=1e-12)
    total = 25 * 10 / 24 - 10 * 0.5
    assert r.sum().item() == pytest.approx(total, abs=1e-12)
    term = step_rewards(k, d, 10.0, terminal_only=True, num_patches=8)
    assert term[0].tolist() == pytest.approx([0.0, 0.0, total], abs=1e-12)
    # compression_scale is honoured
    r2 = step_rewards(k, d, 10.0, compression_scale=1.0, num_patches=8)
    assert r2[0, 0].item() == pytest.approx(6 / 24 - 3.0, abs=1e-12)


def test_telescoping_random_and_per_image_coefficient():
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 5, (32, 12), generator=g) * 2
    raw = torch.rand(32, 12, generator=g, dtype=torch.float64) * 2
    d = fill_gate_off(raw, k)
    a = torch.rand(32, generator=g, dtype=torch.float64) * 300
    expected = 25 * token_layer_compression(k, 196, torch.float64) - a * d[:, -1]
    for terminal in (False, True):
        r = step_rewards(k, d, a, terminal_only=terminal, num_patches=196)
        assert torch.allclose(r.sum(1), expected, rtol=0, atol=1e-9)
    # gate-off steps earn exactly zero (no compression, no fidelity change)
    r = step_rewards(k, d, a, num_patches=196)
    assert (r[k == 0] == 0).all()
    with pytest.raises(ValueError):
        step_rewards(k, d, torch.ones(5), num_patches=196)
