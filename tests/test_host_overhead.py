"""Structural properties of the wrapped forward's host work (issue #8): which policies make the host
wait for the device, and that the shortcuts taken to avoid host work compute the same values."""
import pytest
import torch

import sync_counter
import timm_dora
from benchmarks.common import fixed_plan, gate_forced_actor
from timm_dora import Actor, ActorPolicy, NoPrune, ReplayPolicy
from timm_dora.engine.packing import Packed, delete_rows

BLOCKS = [3, 6, 9]


@pytest.fixture(scope="module")
def micro():
    torch.manual_seed(0)
    return sync_counter.micro_model(), torch.randn(4, 3, 32, 32)


def _syncs(model, x, **kw):
    timm_dora.wrap(model, **kw)
    try:
        c = sync_counter.count_ops(model, x)
        return c.syncs, model.dora_stats
    finally:
        timm_dora.unwrap(model)


def _plan(batch, device="cpu"):
    return fixed_plan(batch, 64, BLOCKS, [10, 10, 10], 4, 0, device)


def test_noprune_and_replay_policies_never_wait_for_the_device(micro):
    model, x = micro
    for policy in (NoPrune(), ReplayPolicy(_plan(x.shape[0]), check=False), ReplayPolicy(_plan(x.shape[0]), check=True)):
        syncs, stats = _syncs(model, x, policy=policy)
        assert sum(syncs.values()) == 0, (type(policy).__name__, dict(syncs))
    assert (stats.removed[:, BLOCKS] > 0).all()


def test_actor_reads_the_device_once_per_block_and_once_more_per_deletion(micro):
    model, x = micro
    closed = Actor.for_model(model)
    with torch.no_grad():
        closed.gate_mlp[2].bias.fill_(-1e4)
    syncs, _ = _syncs(model, x, actor=closed)
    assert dict(syncs) == {"tolist": 12}  # the gate vector, one read per block
    syncs, stats = _syncs(model, x, actor=gate_forced_actor(model, BLOCKS))
    pruning_blocks = int((stats.removed.sum(0) > 0).sum())
    assert pruning_blocks >= 1
    assert dict(syncs) == {"tolist": 12 + pruning_blocks}  # + the new lengths after each deletion


def test_replay_plan_naming_an_image_beyond_the_batch_raises(micro):
    model, x = micro
    timm_dora.wrap(model, policy=ReplayPolicy({2: (torch.tensor([5]), torch.tensor([0]))}))
    try:
        with pytest.raises(ValueError, match="names image 5"):
            model(x)
    finally:
        timm_dora.unwrap(model)


def test_delete_rows_with_host_counts_equals_the_synchronising_path():
    lengths = [5, 3, 6]
    packed = Packed(torch.randn(14, 2), torch.tensor(lengths), lengths, 1, torch.arange(14))
    remove = torch.zeros(14, dtype=torch.bool)
    remove[[2, 3, 7, 10, 11, 13]] = True
    removed = torch.tensor([2, 1, 3])
    a, b = delete_rows(packed, remove, removed), delete_rows(packed, remove, removed, [2, 1, 3])
    assert a.lengths_host == b.lengths_host == [3, 2, 3]
    assert torch.equal(a.x, b.x) and torch.equal(a.ids, b.ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    # into a fixed buffer without host counts: gathered before the counts are read, same rows
    out = torch.full((20, 2), float("nan"))
    c = delete_rows(packed, remove, removed, out=out)
    assert c.lengths_host == [3, 2, 3] and c.x.data_ptr() == out.data_ptr()
    assert torch.equal(c.x, a.x) and torch.equal(c.ids, a.ids) and torch.equal(c.cu_seqlens, a.cu_seqlens)
    keep = [i for i in range(14) if not remove[i]]
    assert torch.equal(c.x, packed.x[keep]) and c.ids.tolist() == keep  # against the rows by hand


@torch.no_grad()
def test_gate_bias_for_all_blocks_equals_each_blocks_own():
    torch.manual_seed(0)
    a = Actor(16, 5, 12)
    h, key = torch.rand(3, 3), torch.randn(3, 16)
    bias = a.gate_bias(h, None, torch.float32)
    assert bias.shape == (5, 3, 64)
    for l in range(5):
        assert torch.equal(bias[l], a.gate_bias(h, l, torch.float32))
        assert torch.equal(a.gate_logit(key, h, l, bias[l]), a.gate_logit(key, h, l))
    blocks = torch.tensor([4, 0, 2])
    assert torch.equal(a.gate_logit(key, h, blocks), a.gate_logit(key, h, blocks, a.gate_bias(h, blocks, torch.float32)))


@torch.no_grad()
def test_gate_logit_is_the_gate_mlp_on_the_concatenated_input():
    """The split first layer (CLS part per block, context part per forward) against the paper's
    gate as written: the MLP on [K_CLS; e^G_l; h_l] (Sec. 3.2), per block and per image."""
    torch.manual_seed(0)
    a = Actor(16, 5, 12)
    with torch.no_grad():
        a.gate_embed.normal_()
    h, key = torch.rand(3, 3), torch.randn(3, 16)
    for blocks in (2, torch.tensor([4, 0, 2])):
        e = a.gate_embed[blocks].expand(3, -1)
        reference = a.gate_mlp(torch.cat([key, e, h], -1)).squeeze(-1)
        torch.testing.assert_close(a.gate_logit(key, h, blocks), reference, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_recorded_history_follows_the_trajectory(micro):
    """The gate's history is memoised while nothing changes; it must still be h_l of every block."""
    model, x = micro
    actor = gate_forced_actor(model, [2, 5])
    policy = ActorPolicy(actor, record=True)
    timm_dora.wrap(model, policy=policy)
    try:
        model(x)
        s = model.dora_stats
    finally:
        timm_dora.unwrap(model)
    n0, depth = 64, 12
    entering = torch.cat([torch.full((x.shape[0], 1), n0), s.tokens[:, :-1]], 1)
    assert (s.removed[:, [2, 5]] > 0).all()
    for l, rec in enumerate(policy.records):
        rho = s.removed[:, l - 1].float() / entering[:, l - 1].float() if l else torch.zeros(x.shape[0])
        e = s.gate[:, :l].long().sum(1)
        assert torch.equal(rec.h, actor.history(entering[:, l], rho, e)), l
