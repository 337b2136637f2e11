"""The privileged critic (paper App. D.1): scalar state, shapes, budget dependence, packing."""
import math

import pytest
import torch

from timm_dora.train.critic import SCALAR_DIM, Critic, native_features, scalar_state, trajectory_scalar_states

D, L, M, C = 32, 3, 6, 10


def _critic(seed=0):
    torch.manual_seed(seed)
    return Critic(embed_dim=D, depth=L, num_budgets=M, num_classes=C).eval()


def _inputs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    s = len(lengths)
    tokens = torch.randn(sum(lengths), D, generator=g)
    q = torch.rand(s, SCALAR_DIM, generator=g)
    z = torch.randn(s, C, generator=g)
    return tokens, q, z


def test_native_features_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]], dtype=torch.float64)
    phi = native_features(p.log(), tau_b=0.1)
    h0 = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    h1 = -(2 * 0.4 * math.log(0.4) + 0.2 * math.log(0.2))
    assert phi.shape == (2, 4) and phi.dtype == torch.float32
    assert phi[0].tolist() == pytest.approx([0.5, 0.2, h0, 0.0], abs=1e-6)
    assert phi[1].tolist() == pytest.approx([0.4, 0.0, h1, 1.0], abs=1e-6)


def test_scalar_state_layout_is_ten_numbers():
    assert SCALAR_DIM == 10  # [N/N0, l/(L-1), C_<l, E_<l/(L-1), D_{l-1}] + phi^N (4) + [a/300]
    phi = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    q = scalar_state(torch.tensor([6]), 1, 3, 8, torch.tensor([0.25]), torch.tensor([1]), torch.tensor([0.3]), phi, 150.0)
    assert q.shape == (1, 10)
    assert q[0].tolist() == pytest.approx([0.75, 0.5, 0.25, 0.5, 0.3, 0.9, 0.8, 0.1, 0.0, 0.5], abs=1e-7)


def test_trajectory_scalar_states_by_hand():
    k = torch.tensor([[2, 0, 4]])
    d = torch.tensor([[0.3, 0.3, 0.5]])
    phi = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    q = trajectory_scalar_states(k, d, phi, 30.0, num_patches=8)
    assert q.shape == (1, 3, 10)
    tail = [0.9, 0.8, 0.1, 0.0, 0.1]
    assert q[0, 0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0, 0.0] + tail, abs=1e-7)
    assert q[0, 1].tolist() == pytest.approx([0.75, 0.5, 0.25, 0.5, 0.3] + tail, abs=1e-7)
    assert q[0, 2].tolist() == pytest.approx([0.75, 1.0, 0.25, 0.5, 0.3] + tail, abs=1e-7)


def test_architecture_sizes():
    c = Critic(embed_dim=768, depth=12, num_budgets=96)
    assert c.u_dim == 384
    assert c.gate_head[0].in_features == c.budget_head[0].in_features == 384
    assert c.selector_head[0].in_features == 417 and c.selector_head[0].out_features == 128
    assert c.scalar_proj.in_features == 10 and c.logit_proj.in_features == 1000
    assert c.block_embed.shape == (12, 256) and c.type_embed.shape == (2, 256)
    assert c.budget_embed.weight.shape == (96, 32)
    assert len(c.blocks) == 2 and c.blocks[0].fc1.out_features == 512 and c.blocks[0].num_heads == 4


@torch.no_grad()
def test_output_shapes_and_budget_dependence():
    critic = _critic()
    lengths = [5, 3, 5]
    tokens, q, z = _inputs(lengths)
    block = torch.tensor([0, 2, 1])
    a = critic(tokens, lengths, block, q, z, torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.5, 0.25]))
    b = critic(tokens, lengths, block, q, z, torch.tensor([5, 3, 0]), torch.tensor([0.75, 0.25, 0.5]))
    assert a.gate.shape == a.budget.shape == a.selector.shape == (3,) and a.u.shape == (3, 384)
    assert torch.equal(a.gate, b.gate) and torch.equal(a.budget, b.budget)
    assert (a.selector != b.selector).all()
    # the fraction alone moves V^S too
    c = critic(tokens, lengths, block, q, z, torch.tensor([0, 1, 2]), torch.tensor([0.1, 0.1, 0.1]))
    assert (c.selector != a.selector).all()
    assert critic(tokens, lengths, block, q, z).selector is None
    # the privileged inputs and the block index matter
    assert not torch.equal(critic(tokens, lengths, block, q, z + 1).gate, a.gate)
    assert not torch.equal(critic(tokens, lengths, block, q * 0, z).gate, a.gate)
    assert not torch.equal(critic(tokens, lengths, torch.tensor([1, 2, 1]), q, z).gate[0], a.gate[0])


@torch.no_grad()
def test_packed_batch_equals_per_sequence():
    critic = _critic()
    lengths = [7, 2, 4]
    tokens, q, z = _inputs(lengths, seed=3)
    block = torch.tensor([2, 0, 1])
    joint = critic(tokens, lengths, block, q, z)
    offset = 0
    for i, n in enumerate(lengths):
        alone = critic(tokens[offset:offset + n], [n], block[i:i + 1], q[i:i + 1], z[i:i + 1])
        # batched and single-sequence matmuls round differently (1.1e-6 seen on a 16-core CPU)
        assert torch.allclose(alone.gate, joint.gate[i:i + 1], atol=1e-5)
        assert torch.allclose(alone.u, joint.u[i:i + 1], atol=1e-5)
        offset += n
    # changing one sequence's tokens leaves the others' values untouched
    t2 = tokens.clone()
    t2[:7] += 1.0
    moved = critic(t2, lengths, block, q, z)
    assert moved.gate[0] != joint.gate[0]
    assert torch.allclose(moved.gate[1:], joint.gate[1:], atol=1e-6)


@torch.no_grad()
def test_token_types_and_order_matter():
    critic = _critic()
    lengths = [6]
    tokens, q, z = _inputs(lengths, seed=4)
    base = critic(tokens, lengths, 1, q, z).gate
    assert not torch.allclose(critic(tokens, lengths, 1, q, z, num_prefix=2).gate, base)
    # permuting visual tokens (no positional embedding) does not change the value; swapping CLS does
    perm = torch.tensor([0, 3, 1, 5, 2, 4])
    assert torch.allclose(critic(tokens[perm], lengths, 1, q, z).gate, base, atol=1e-6)
    swap = torch.tensor([1, 0, 2, 3, 4, 5])
    assert not torch.allclose(critic(tokens[swap], lengths, 1, q, z).gate, base, atol=1e-6)


def test_gradients_reach_every_parameter():
    critic = _critic()
    lengths = [4, 6]
    tokens, q, z = _inputs(lengths, seed=5)
    out = critic(tokens, lengths, torch.tensor([0, 2]), q, z, torch.tensor([1, 4]), torch.tensor([0.5, 0.4]))
    (out.gate.sum() + out.budget.sum() + out.selector.sum()).backward()
    missing = [n for n, p in critic.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_input_validation():
    critic = _critic()
    tokens, q, z = _inputs([3, 3])
    with pytest.raises(ValueError):
        critic(tokens, [3, 2], 0, q, z)
    with pytest.raises(ValueError):
        critic(tokens, [3, 3], 0, q[:, :9], z)
    with pytest.raises(ValueError):
        critic(tokens, [3, 3], L, q, z)


@torch.no_grad()
def test_encode_takes_device_lengths_and_checks_blocks():
    critic = _critic()
    lengths = [5, 3, 5]
    tokens, q, z = _inputs(lengths)
    block = torch.tensor([0, 2, 1])
    u = critic.encode(tokens, lengths, block, q, z)
    assert torch.equal(critic.encode(tokens, lengths, block, q, z, device_lengths=torch.tensor(lengths)), u)
    with pytest.raises(RuntimeError, match="out of range"):  # a device assertion for tensors (no host read)
        critic.encode(tokens, lengths, torch.tensor([0, L, 1]), q, z)
    with pytest.raises(ValueError, match="out of range"):
        critic.encode(tokens, lengths, -1, q, z)


@pytest.mark.parametrize("num_prefix", [1, 2])
def test_padded_batch_equals_packed_values_and_gradients(num_prefix):
    """encode_padded (fixed shapes, padded keys masked) gives the packed encode's u_l and gradients;
    garbage in the padding changes nothing."""
    lengths = [7, 2, 4]
    tokens, q, z = _inputs(lengths, seed=6)
    block = torch.tensor([2, 0, 1])
    n = 9
    padded = torch.randn(len(lengths), n, D) * 50  # the padding is garbage
    offset = 0
    for i, m in enumerate(lengths):
        padded[i, :m] = tokens[offset:offset + m]
        offset += m
    grads = []
    for fn in ("packed", "padded"):
        critic = _critic()
        critic.train()
        if fn == "packed":
            u = critic.encode(tokens, lengths, block, q, z, num_prefix)
        else:
            u = critic.encode_padded(padded, torch.tensor(lengths), block, q, z, num_prefix)
        loss = critic.gate_value(u).square().sum() + critic.selector_value(u, torch.tensor([1, 4, 0]), torch.tensor([0.5, 0.4, 0.1])).sum()
        loss.backward()
        grads.append((u.detach(), {k: p.grad.clone() for k, p in critic.named_parameters() if p.grad is not None}))
    (u_packed, g_packed), (u_padded, g_padded) = grads
    assert torch.allclose(u_padded, u_packed, atol=1e-5)
    assert g_packed.keys() == g_padded.keys()
    for k in g_packed:
        assert torch.allclose(g_padded[k], g_packed[k], atol=1e-5, rtol=1e-4), k


def test_bf16_token_branch_stays_within_its_stated_tolerance():
    """The training fast path runs the critic's token branch under bf16 autocast (``critic_bf16``,
    fp32 weights, heads and losses). Against the fp32 reference on the same minibatch (CPU autocast,
    the same bf16 rounding): ``u_l`` within 3 % of its scale, the value loss within 1 %, and each
    parameter's gradient within 5 % of its norm (cosine >= 0.998)."""
    lengths = [9, 5, 7, 3]
    tokens, q, z = _inputs(lengths, seed=11)
    block = torch.tensor([2, 0, 1, 2])
    padded = torch.zeros(len(lengths), 9, D)
    offset = 0
    for i, m in enumerate(lengths):
        padded[i, :m] = tokens[offset:offset + m]
        offset += m
    target = torch.randn(len(lengths), generator=torch.Generator().manual_seed(3))
    out = {}
    for bf16 in (False, True):
        critic = _critic()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            u = critic.encode_padded(padded, torch.tensor(lengths), block, q, z)
        u = u.float()
        loss = (critic.gate_value(u) - target).square().mean()
        loss.backward()
        out[bf16] = u.detach(), loss.detach(), {k: p.grad.clone() for k, p in critic.named_parameters() if p.grad is not None}
    (u32, l32, g32), (u16, l16, g16) = out[False], out[True]
    assert u16.dtype == torch.float32 and not torch.equal(u16, u32)  # autocast did run in bf16
    assert (u16 - u32).norm() <= 0.03 * u32.norm()
    assert abs(float(l16 - l32)) <= 0.01 * float(l32)
    assert g32.keys() == g16.keys()
    for k in g32:
        assert (g16[k] - g32[k]).norm() <= 0.05 * g32[k].norm() + 1e-12, k
        assert torch.nn.functional.cosine_similarity(g16[k].flatten(), g32[k].flatten(), dim=0) >= 0.998, k
