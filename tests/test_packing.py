"""Packed batches: row deletion and variable-length attention against a block-diagonal reference."""
import pytest
import torch
import torch.nn.functional as F

from timm_dora.engine.attention import select_backend, varlen_attention
from timm_dora.engine.packing import Packed, delete_rows, gather_survivors, bucket_rows, row_bucket


def block_diagonal_reference(q, k, v, lengths, scale):
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seg[:, None] == seg[None, :]
    logits = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), v.double())


def test_delete_rows_keeps_order_and_lengths():
    lengths = [4, 6, 3]
    x = torch.arange(13, dtype=torch.float)[:, None]
    packed = Packed(x, torch.tensor(lengths), lengths, num_prefix=1)
    remove = torch.zeros(13, dtype=torch.bool)
    remove[[2, 5, 7, 9]] = True  # image 0 loses row 2; image 1 loses rows 5, 7, 9
    out = delete_rows(packed, remove, torch.tensor([1, 3, 0]))
    assert out.lengths_host == [3, 3, 3] and out.lengths.tolist() == [3, 3, 3]
    assert out.x.squeeze(1).tolist() == [0, 1, 3, 4, 6, 8, 10, 11, 12]
    assert out.cu_seqlens.tolist() == [0, 3, 6, 9] and out.uniform
    assert out.pos.tolist() == [0, 1, 2] * 3 and out.seg.tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert out.prefix_rows().squeeze(-1).squeeze(-1).tolist() == [0, 4, 10]


def test_delete_rows_into_a_buffer_without_host_counts_and_gather_survivors():
    """The fixed-shape path (``out=``, counts read after the gather; what the graphs' controller
    runs as ``gather_survivors``): the same survivors, ids and layout as the default path; every
    row of the buffer written (survivors first, then copies of row 0)."""
    lengths = [4, 6, 3]
    x = torch.arange(13, dtype=torch.float)[:, None] + 100
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2])
    packed = Packed(x, torch.tensor(lengths), lengths, num_prefix=1, ids=ids)
    remove = torch.zeros(13, dtype=torch.bool)
    remove[[2, 5, 7, 9]] = True
    ref = delete_rows(packed, remove, torch.tensor([1, 3, 0]))
    buf = torch.full((16, 1), -1.0)
    got = delete_rows(packed, remove, torch.tensor([1, 3, 0]), out=buf)
    assert torch.equal(got.x, ref.x) and got.x.data_ptr() == buf.data_ptr()
    assert torch.equal(got.ids, ref.ids) and got.lengths_host == ref.lengths_host
    assert torch.equal(got.ids, ids[~remove])  # an independent reference: boolean indexing
    assert buf[9:13].squeeze(1).tolist() == [100.0] * 4 and buf[13:].squeeze(1).tolist() == [-1.0] * 3
    buf2 = torch.zeros(13, 1)
    gathered_ids = gather_survivors(x, remove, buf2, ids)
    assert torch.equal(buf2[:9], x[~remove]) and torch.equal(gathered_ids[:9], ids[~remove])
    assert gather_survivors(x, remove, buf2) is None


@pytest.mark.parametrize("lengths", [[5, 9, 1, 7], [6, 6, 6]])
def test_varlen_attention_matches_block_diagonal_reference(lengths):
    torch.manual_seed(0)
    t, h, d = sum(lengths), 3, 8
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    packed = Packed(torch.zeros(t, 1), torch.tensor(lengths), lengths, num_prefix=1)
    out = varlen_attention(q, k, v, packed, 0.3, "sdpa_loop")
    ref = block_diagonal_reference(q, k, v, lengths, 0.3)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("lengths", [[5, 9, 1, 7], [6, 6, 6]])
def test_padded_training_backend_matches_reference_and_its_gradients(lengths):
    torch.manual_seed(1)
    t = sum(lengths)
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    packed = Packed(torch.zeros(t, 1), torch.tensor(lengths), lengths, num_prefix=1)
    out = varlen_attention(q, k, v, packed, 0.4, "padded")
    ref = block_diagonal_reference(q, k, v, lengths, 0.4)
    assert (out - ref).abs().max() < 1e-10
    g1 = torch.autograd.grad(out.square().sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-9 for a, b in zip(g1, g2))


def test_dense_path_equals_per_sequence_path():
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 2, 4) for _ in range(3))
    packed = Packed(torch.zeros(12, 1), torch.tensor([4, 4, 4]), [4, 4, 4], num_prefix=1)
    dense = varlen_attention(q, k, v, packed, 0.5, "sdpa_loop")  # uniform: dense SDPA
    loop = torch.cat([F.scaled_dot_product_attention(*(t[i * 4 : (i + 1) * 4].transpose(0, 1) for t in (q, k, v)), scale=0.5).transpose(0, 1) for i in range(3)])
    assert (dense - loop).abs().max() < 1e-6


def test_backend_selection():
    assert select_backend("cpu", torch.float32) == "sdpa_loop"
    assert select_backend("cpu", torch.bfloat16) == "sdpa_loop"
    with pytest.raises(ValueError, match="cannot run"):
        select_backend("cpu", torch.bfloat16, "torch_varlen")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", torch.float32, "xformers")


def test_row_bucket_by_hand():
    # step 2 ** (bit_length - 6), at least 8
    assert [row_bucket(n) for n in (1, 8, 9, 197, 256, 257)] == [8, 8, 16, 200, 256, 264]
    # 50,432 rows (256 images x 197): bit length 16, step 1,024
    assert row_bucket(50_432) == 51_200
    assert row_bucket(51_200) == 51_200
    for n in range(1, 5000):
        b = row_bucket(n)
        assert n <= b <= n + max(8, n // 32) and b % 8 == 0


def test_bucket_rows_pads_for_the_call_and_returns_the_rows_of_the_input():
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 5)
    seen = []

    def fn(t):
        seen.append(tuple(t.shape))
        return lin(t)

    x = torch.randn(3, 67, 12)  # 201 rows -> 208
    y = bucket_rows(fn, x, enabled=True)
    assert seen == [(208, 12)] and y.shape == (3, 67, 5)
    torch.testing.assert_close(y, lin(x), rtol=0, atol=1e-6)
    # already a bucket size, or switched off (the default on the CPU): fn sees x itself
    seen.clear()
    bucket_rows(fn, torch.randn(208, 12), enabled=True)
    bucket_rows(fn, x)
    assert seen == [(208, 12), (3, 67, 12)]
