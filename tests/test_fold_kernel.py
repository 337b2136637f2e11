"""Merging's fold in Triton (``timm_dora.engine.fold_kernel``), against the PyTorch ops of
``packing.fold_removed``: in Triton's interpreter on the CPU (float32: the same targets, values
within rounding, sizes exact, padding rows never read, in place or not, with a kept scratch left
zeros), and compiled on CUDA,
also replayed from a CUDA graph."""
import pytest
import torch

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import capture_graph, run_interpreted, triton_version
from timm_dora.engine import packing

pytest.importorskip("triton")

CASES = r"""
import json, torch
from timm_dora.engine.deletion_kernel import (compact_rows, delete_rows_fused, delete_rows_reference, gather_rows,
                                              pick_and_compact)
from timm_dora.engine.fold_kernel import fold_rows, fold_similarities, similarity_columns
from timm_dora.engine.packing import fold_removed

def case(heads, hd, lengths, pad, p, seed, device="cpu", dtype=torch.float32, classes=0):
    g = torch.Generator().manual_seed(seed)
    t, d = sum(lengths), heads * hd
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(t + pad, d, generator=g)
    keys = torch.randn(t + pad, 3 * d, generator=g)[:, d:2 * d]  # a view of a qkv output
    if classes:  # every head's key a one-hot of a few classes: the metric is that one-hot, so the
        # similarities are exactly 0 or 1 in any order of the sums, and equal maxima go to the first
        one_hot = torch.eye(hd)[torch.randint(0, classes, (t + pad,), generator=g)]
        keys.copy_(one_hot.repeat(1, heads))
    remove = torch.rand(t + pad, generator=g) < 0.35
    for s0, n in zip(cu[:-1].tolist(), lengths):
        remove[s0:s0 + p] = False  # never a prefix row
        if remove[s0 + p:s0 + n].all():
            remove[s0 + n - 1] = False  # a survivor in every image that removes
    remove[t:] = False
    x[t:] = float("nan")  # padding: never read
    sizes = torch.randint(1, 5, (t + pad,), generator=g).float()
    return [a.to(device) for a in (x.to(dtype), keys.to(dtype), remove, sizes, cu)], t

out = {}
for name, heads, hd, lengths, pad, p, classes in (("one_tile", 3, 16, [5, 1, 33, 64], 7, 1, 0),
                                                  ("tiles", 2, 32, [17, 9, 130], 0, 2, 0),
                                                  ("ties", 2, 16, [40, 90], 0, 1, 5),
                                                  ("long", 2, 16, [300, 20], 0, 1, 0)):  # (flags read twice)
    (x, keys, remove, sizes, cu), t = case(heads, hd, lengths, pad, p, 0, classes=classes)
    ref_x, ref_s = fold_removed(x, keys, remove, sizes, cu, max(lengths), p, heads)
    got_x, got_s = fold_rows(x, keys, remove, sizes, cu, max(lengths), p, heads)
    # any match tile splits the rows among programs differently, the same arithmetic per row
    tiled = [fold_rows(x, keys, remove, sizes, cu, max(lengths), p, heads, match_tile=tile)
             for tile in ((16, 16, 1), (32, 64, 2))]
    inplace = x.clone()
    fold_rows(inplace, keys, remove, sizes, cu, max(lengths), p, heads, out=inplace)
    # a kept scratch (longer than the rows) serves fold after fold, left zeros; sizes in place
    scratch = (torch.zeros(x.shape[0] + 3, x.shape[1]), torch.zeros(x.shape[0] + 3))
    kept = []
    for _ in range(2):
        xs, s_in = x.clone(), sizes.clone()
        fold_rows(xs, keys, remove, s_in, cu, max(lengths), p, heads, out=xs, sizes_out=s_in, scratch=scratch)
        kept.append((xs, s_in))
    # the match from precomputed similarities (into a longer buffer, columns past each image unread)
    sim = torch.full((x.shape[0] + 2, similarity_columns(max(lengths))), float("nan"))
    fold_similarities(keys, cu, max(lengths), heads, out=sim)
    metric = keys[:t].reshape(t, heads, hd).mean(1)
    metric = metric / metric.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim_err = 0.0
    for s0, n in zip(cu[:-1].tolist(), lengths):
        m = metric[s0:s0 + n]
        sim_err = max(sim_err, float((sim[s0:s0 + n, :n] - m @ m.t()).abs().max()))
    picked_scratch = (torch.zeros(x.shape[0], x.shape[1]), torch.zeros(x.shape[0]))
    picked = x.clone()
    _, picked_s = fold_rows(picked, keys, remove, sizes, cu, max(lengths), p, heads, out=picked, scratch=picked_scratch,
                            similarities=sim)
    # the finish in the fused deletion's gather (EngineOptions.fold_in_gather): the fold left in a
    # scratch, then the deletion, against the fold's own finish, then the reference deletion
    removed = torch.stack([remove[s0:s0 + n].sum() for s0, n in zip(cu[:-1].tolist(), lengths)])
    def deleted(fn, fold_finish, **kw):
        xs, s_in, ids, cu_out = x.clone(), sizes.clone(), torch.arange(x.shape[0]), cu.clone()
        rows_out, lengths_out = torch.full_like(x, 7.0), torch.zeros(len(lengths), dtype=torch.long)
        fold_rows(xs, keys, remove, s_in, cu, max(lengths), p, heads, out=xs, sizes_out=s_in, finish=fold_finish,
                  scratch=kw.get("received"))
        fn(xs, remove, rows_out, ids, ids, cu_out, removed, lengths_out, cu_out, s_in, None, **kw)
        return [rows_out.nan_to_num(123.0), s_in, ids, cu_out, lengths_out]
    gathered_scratch = (torch.zeros(x.shape[0] + 3, x.shape[1]), torch.zeros(x.shape[0] + 3))
    gathered = deleted(delete_rows_fused, False, received=gathered_scratch)
    finished = deleted(delete_rows_reference, True)
    # the compaction before the fold (EngineOptions.compact_beside_fold runs the two side by side):
    # its new cu and sizes aside, so the fold reads the layout it folds in; the gather copies them
    xs, s_in, ids, cu_in = x.clone(), sizes.clone(), torch.arange(x.shape[0]), cu.clone()
    rows_out, lengths_out = torch.full_like(x, 7.0), torch.zeros(len(lengths), dtype=torch.long)
    cu_aside, s_aside = torch.full_like(cu, -5), torch.full_like(sizes, -5.0)
    index = compact_rows(remove, ids, ids, cu_in, removed, lengths_out, cu_aside, s_in, sizes_out=s_aside)
    beside_scratch = (torch.zeros(x.shape[0], x.shape[1]), torch.zeros(x.shape[0]))
    fold_rows(xs, keys, remove, s_in, cu_in, max(lengths), p, heads, out=xs, sizes_out=s_in, finish=False,
              scratch=beside_scratch)
    gather_rows(xs, index, rows_out, s_in, received=beside_scratch, sizes_from=s_aside, cu_from=cu_aside, cu_out=cu_in)
    beside = [rows_out.nan_to_num(123.0), s_in, ids, cu_in, lengths_out]
    # the pick (from the similarities) and the compaction by image in one launch
    # (EngineOptions.compact_in_pick), the ids, cu and sizes aside, then the gather; against the
    # pick, the compaction and the gather apart (the same programs' arithmetic: exactly equal)
    def picked_deletion(together):
        xs, s_in, ids, cu_in = x.clone(), sizes.clone(), torch.arange(x.shape[0]), cu.clone()
        rows_out, lengths_out = torch.full_like(x, 7.0), torch.zeros(len(lengths), dtype=torch.long)
        ids_aside, cu_aside, s_aside = torch.full_like(ids, -5), torch.full_like(cu, -5), torch.full_like(sizes, -5.0)
        scratch = (torch.zeros(x.shape[0], x.shape[1]), torch.zeros(x.shape[0]))
        if together:
            index = pick_and_compact(sim, xs, s_in, remove, cu_in, max(lengths), p, scratch, ids, ids_aside, cu_in,
                                     removed, lengths_out, cu_aside, s_aside)
        else:
            fold_rows(xs, keys, remove, s_in, cu_in, max(lengths), p, heads, out=xs, sizes_out=s_in, finish=False,
                      scratch=scratch, similarities=sim)
            index = compact_rows(remove, ids, ids_aside, cu_in, removed, lengths_out, cu_aside, s_in,
                                 sizes_out=s_aside, per_image=True)
        gather_rows(xs, index, rows_out, s_in, received=scratch, sizes_from=s_aside, cu_from=cu_aside, cu_out=cu_in,
                    ids_from=ids_aside, ids_out=ids)
        zeros = not scratch[0].any().item() and not scratch[1].any().item()
        return [rows_out.nan_to_num(123.0), s_in, ids, cu_in, lengths_out], zeros
    (in_pick, in_pick_zeros), (apart, _) = picked_deletion(True), picked_deletion(False)
    out[name] = {"in_gather_equal": [torch.equal(a, b) for a, b in zip(gathered, finished)],
                 "beside_equal": [torch.equal(a, b) for a, b in zip(beside, finished)],
                 "beside_scratch_zeros": not beside_scratch[0].any().item() and not beside_scratch[1].any().item(),
                 "in_pick_equal": [torch.equal(a, b) for a, b in zip(in_pick, apart)], "in_pick_scratch_zeros": in_pick_zeros,
                 "in_pick_layout_equal": [torch.equal(a, b) for a, b in zip(in_pick[2:], finished[2:])],
                 "in_pick_max_abs_diff": float((in_pick[0] - finished[0]).abs().max()),
                 "in_gather_scratch_zeros": not gathered_scratch[0].any().item() and not gathered_scratch[1].any().item(),
                 "sim_max_abs_diff": sim_err, "sim_rows_past_untouched": bool(torch.isnan(sim[t:]).all()),
                 "picked_max_abs_diff": float((picked[:t] - ref_x[:t]).abs().max()),
                 "picked_sizes_equal": torch.equal(picked_s[:t], ref_s[:t]),
                 "picked_padding_untouched": bool(torch.isnan(picked[t:]).all()),
                 "picked_scratch_zeros": not picked_scratch[0].any().item() and not picked_scratch[1].any().item(),
                 "max_abs_diff": float((got_x[:t] - ref_x[:t]).abs().max()),
                 "inplace_max_abs_diff": float((inplace[:t] - ref_x[:t]).abs().max()),
                 "tiles_equal": all(torch.equal(a[:t], got_x[:t]) and torch.equal(s[:t], got_s[:t]) for a, s in tiled),
                 "sizes_equal": torch.equal(got_s[:t], ref_s[:t]), "padding_sizes_kept": torch.equal(got_s[t:], sizes[t:]),
                 "padding_untouched": bool(torch.isnan(inplace[t:]).all()), "folded": int(remove.sum()),
                 "received": int((ref_s[:t] > sizes[:t]).sum()),
                 "scratch_max_abs_diff": max(float((xs[:t] - ref_x[:t]).abs().max()) for xs, _ in kept),
                 "scratch_sizes_equal": all(torch.equal(s_in, torch.cat([ref_s[:t], sizes[t:]])) for _, s_in in kept),
                 "scratch_zeros": not scratch[0].any().item() and not scratch[1].any().item()}
print(json.dumps(out))
"""


@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run these kernels")
def test_interpreted_fold_equals_the_pytorch_ops():
    res = run_interpreted(CASES, timeout=300)
    for case in res.values():
        assert case["folded"] > 10 and case["received"] > 5
        assert case["max_abs_diff"] < 1e-5 and case["inplace_max_abs_diff"] < 1e-5
        assert case["tiles_equal"]
        assert case["sizes_equal"] and case["padding_sizes_kept"] and case["padding_untouched"]
        assert case["scratch_max_abs_diff"] < 1e-5 and case["scratch_sizes_equal"] and case["scratch_zeros"]
        # the precomputed similarities: the metric's products; the fold that picks from them
        assert case["sim_max_abs_diff"] < 1e-5 and case["sim_rows_past_untouched"]
        assert case["picked_max_abs_diff"] < 1e-5 and case["picked_sizes_equal"] and case["picked_padding_untouched"]
        assert case["picked_scratch_zeros"]
        # finished in the deletion's gather: rows, sizes, ids, layout all exactly as finished before it
        assert case["in_gather_equal"] == [True] * 5 and case["in_gather_scratch_zeros"]
        # and with the compaction first, its layout aside: the same, exactly
        assert case["beside_equal"] == [True] * 5 and case["beside_scratch_zeros"]
        # the pick and the compaction by image in one launch: what the two apart give, exactly; the
        # layout and ids as the finished fold's deletion, the rows within the pick's rounding
        assert case["in_pick_equal"] == [True] * 5 and case["in_pick_scratch_zeros"]
        assert case["in_pick_layout_equal"] == [True] * 3 and case["in_pick_max_abs_diff"] < 1e-5


def test_fold_kernel_says_what_it_cannot_fold():
    from timm_dora.engine.fold_kernel import fold_kernel_reason, fold_rows

    x = torch.zeros(4, 64)
    assert fold_kernel_reason(x, torch.zeros(4, 64), 2) is None  # head dim 32
    assert fold_kernel_reason(x, torch.zeros(4, 64), 4) is None  # head dim 16
    assert "got 8" in fold_kernel_reason(x, torch.zeros(4, 64), 8)
    assert "got 24" in fold_kernel_reason(torch.zeros(4, 48), torch.zeros(4, 48), 2)
    assert "unit channel stride" in fold_kernel_reason(x, torch.zeros(64, 4).t(), 2)
    with pytest.raises(ValueError, match="fold_rows: the kernels take a power-of-two head dim of at least 16, got 8"):
        fold_rows(torch.zeros(4, 32), torch.zeros(4, 32), torch.zeros(4, dtype=torch.bool), torch.ones(4),
                  torch.tensor([0, 4], dtype=torch.int32), 4, 1, 4)
    from timm_dora.engine.fold_kernel import fold_similarities
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fold_similarities: out must be a contiguous float32 \[>= 4, 16\], got "
                                         r"torch.float32 \(4, 8\)"):
        fold_similarities(x, cu, 4, 2, out=torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"fold_rows: similarities \(fold_similarities'\) must be a contiguous "
                                         r"float32 \[>= 4, 16\], got torch.float16"):
        fold_rows(x, x, torch.zeros(4, dtype=torch.bool), torch.ones(4), cu, 4, 1, 2,
                  similarities=torch.zeros(4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="fold_similarities: the kernels take a power-of-two head dim"):
        fold_similarities(torch.zeros(4, 32), cu, 4, 4)
    with pytest.raises(ValueError, match="fold_rows: finish=False leaves the sums in scratch, which must be given"):
        fold_rows(x, x, torch.zeros(4, dtype=torch.bool), torch.ones(4), cu, 4, 1, 2, finish=False)
    with pytest.raises(ValueError, match="fold_removed: finish=False needs the fold kernels"):
        packing.fold_removed(x, x, torch.zeros(4, dtype=torch.bool), torch.ones(4), cu, 4, 1, 2, finish=False)
    from timm_dora.engine.deletion_kernel import delete_rows_fused
    with pytest.raises(ValueError, match=r"delete_rows_fused: received must be a contiguous float32 \[>= 4, 64\] "
                                         r"accumulator and \[>= 4\] mass, with the sizes"):
        one = torch.zeros(1, dtype=torch.long)
        delete_rows_fused(x, torch.zeros(4, dtype=torch.bool), x.clone(), torch.zeros(4, dtype=torch.long),
                          torch.zeros(4, dtype=torch.long), cu, one, one, cu.clone(), torch.ones(4),
                          received=(torch.zeros(4, 32), torch.zeros(4)))
    with pytest.raises(ValueError, match=r"fold_rows: match_tile must be .*, got \(16, 24, 4\)"):
        fold_rows(x, x, torch.zeros(4, dtype=torch.bool), torch.ones(4), torch.tensor([0, 4], dtype=torch.int32), 4, 1,
                  2, match_tile=(16, 24, 4))


def test_the_match_takes_more_programs_for_few_images():
    from timm_dora.engine import fold_kernel as fk

    assert fk.match_tile_for(320, 197) == fk.MATCH_TILE
    assert fk.match_tile_for(1, 197) == fk.SMALL_MATCH_TILE and fk.match_tile_for(16, 197) == fk.SMALL_MATCH_TILE
    assert fk.match_tile_for(64, 197) == fk.MATCH_TILE  # (the sizes its tiles were chosen at)
    # the switch: where MATCH_TILE's grid (images x chunks of its rows) reaches SMALL_MATCH_GRID programs
    per_image = -(-197 // fk.MATCH_TILE[0])
    few = -(-fk.SMALL_MATCH_GRID // per_image) - 1
    assert fk.match_tile_for(few, 197) == fk.SMALL_MATCH_TILE and fk.match_tile_for(few + 1, 197) == fk.MATCH_TILE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fold_kernel_matches_the_ops_and_replays_from_a_graph(monkeypatch, engine_options):
    """bf16 on CUDA: the kernels' targets come from a float32-accurate product (tf32x3), the ops'
    from a float32 one, so near-ties aside the same rows change the same way; captured once, the
    graph gives the same result."""
    scope = {}
    exec(CASES.split("out = {}")[0], scope)
    (x, keys, remove, sizes, cu), t = scope["case"](3, 64, [197, 1, 90, 142, 64, 65, 128, 129], 5, 1, 0,
                                                     device="cuda", dtype=torch.bfloat16)
    args = (keys, remove, sizes, cu, 197, 1, 3)
    engine_options(fold_kernel=False)
    ref_x, ref_s = packing.fold_removed(x, *args)
    engine_options(fold_kernel=True)
    got_x, got_s = packing.fold_removed(x, *args)
    rows = (got_x[:t].float() - ref_x[:t].float()).abs().amax(1) <= 1e-2 * ref_x[:t].float().abs().amax(1)
    assert rows.float().mean() > 0.99 and (got_s[:t] == ref_s[:t]).float().mean() > 0.99
    out = torch.empty_like(x)
    graph, _ = capture_graph(lambda: packing.fold_removed(x, *args, out=out))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out[:t].float(), got_x[:t].float(), rtol=1e-2, atol=1e-2)  # (atomics: any order)
    # the match from precomputed similarities (EngineOptions.fold_aside): the same targets (the same
    # products), so the same sizes and, up to the atomics' order, the same rows; captured and replayed
    from timm_dora.engine.fold_kernel import fold_similarities
    sim = torch.empty(x.shape[0], 256, device="cuda")
    picked_x, picked_s = packing.fold_removed(x, *args, similarities=fold_similarities(keys, cu, 197, 3, out=sim))
    assert torch.equal(picked_s[:t], got_s[:t])
    torch.testing.assert_close(picked_x[:t].float(), got_x[:t].float(), rtol=1e-2, atol=1e-2)
    graph, _ = capture_graph(lambda: packing.fold_removed(x, *args, out=out,
                                                          similarities=fold_similarities(keys, cu, 197, 3, out=sim)))
    out.zero_()
    sim.zero_()
    graph.replay()
    torch.testing.assert_close(out[:t].float(), got_x[:t].float(), rtol=1e-2, atol=1e-2)
    # exact ties (one-hot metrics: similarities exactly 0 or 1): the first of equal maxima, as the
    # ops' argmax, by the match and by the pick alike (Triton's interpreter ignores the pick's
    # tie_break_left, so only here is it checked)
    (tx, tkeys, tremove, tsizes, tcu), tt = scope["case"](2, 16, [197, 90, 150], 0, 1, 1, device="cuda",
                                                         dtype=torch.bfloat16, classes=5)
    targs = (tkeys, tremove, tsizes, tcu, 197, 1, 2)
    engine_options(fold_kernel=False)
    tref = packing.fold_removed(tx, *targs)
    engine_options(fold_kernel=True)
    tsim = fold_similarities(tkeys, tcu, 197, 2)
    for got in (packing.fold_removed(tx, *targs), packing.fold_removed(tx, *targs, similarities=tsim)):
        assert torch.equal(got[1][:tt], tref[1][:tt])
        torch.testing.assert_close(got[0][:tt].float(), tref[0][:tt].float(), rtol=1e-2, atol=1e-2)
    # the kernels are forward-only: rows that carry a gradient take the ops, which keep it
    grad_x = x[:t].float().requires_grad_()
    folded, _ = packing.fold_removed(grad_x, keys[:t].float(), remove[:t], sizes[:t], cu, 197, 1, 3)
    folded.sum().backward()
    assert grad_x.grad is not None and torch.isfinite(grad_x.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fold_finished_in_the_gather_equals_its_own_finish():
    """``EngineOptions.fold_in_gather`` on CUDA, where a program's warps do not run in step (the
    interpreter runs them as one): the fold left in a scratch and finished by the deletion's gather
    gives, replay after replay, the rows, sizes and layout of the fold finished before the deletion
    (the same targets; the received sums up to their float32 atomics' order)."""
    from timm_dora.engine.deletion_kernel import delete_rows_fused
    from timm_dora.engine.fold_kernel import fold_rows
    scope = {}
    exec(CASES.split("out = {}")[0], scope)
    # (and 40 full images, 8,696 rows: this test passed with the race between a program's warps
    # that the barriers of the finish and the gather now prevent, at its first 816 rows alone)
    lengths = [197, 1, 90, 142, 64, 65, 128, 129] + [197] * 40
    (x, keys, remove, sizes, cu), t = scope["case"](3, 64, lengths, 5, 1, 0, device="cuda", dtype=torch.bfloat16)
    removed = torch.stack([remove[s0:s0 + n].sum() for s0, n in zip(cu[:-1].tolist(), lengths)])
    scratch = (torch.zeros(x.shape[0], x.shape[1], device="cuda"), torch.zeros(x.shape[0], device="cuda"))

    def deleted(in_gather: bool):
        xs, s_in, ids, cu_out = x.clone(), sizes.clone(), torch.arange(x.shape[0], device="cuda"), cu.clone()
        rows, lengths_out = torch.zeros_like(x), torch.zeros(len(lengths), dtype=torch.long, device="cuda")
        fold_rows(xs, keys, remove, s_in, cu, 197, 1, 3, out=xs, sizes_out=s_in, scratch=scratch, finish=not in_gather)
        delete_rows_fused(xs, remove, rows, ids, ids, cu_out, removed, lengths_out, cu_out, s_in,
                          received=scratch if in_gather else None)
        return rows.nan_to_num(123.0), s_in, ids, cu_out, lengths_out

    ref = deleted(False)
    for _ in range(20):
        got = deleted(True)
        for a, b in zip(got[1:], ref[1:]):
            assert torch.equal(a, b)
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=1e-2, atol=1e-2)
        assert not scratch[0].any() and not scratch[1].any()  # (left zeros for the next fold)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fold_in_place_equals_the_ops_run_after_run(engine_options):
    """The fold finished by its own kernel, in place (``out`` the rows, ``sizes_out`` the sizes, as
    the graphs run it) at a batch's size (64 images of 197 rows), equals the PyTorch ops fold run
    after run: the finish's warps all read a row's size and mass before any rewrites them (without
    that, on an H200, hundreds of rows came out wrong by up to 3, differently each run)."""
    from timm_dora.engine.fold_kernel import fold_rows
    scope = {}
    exec(CASES.split("out = {}")[0], scope)
    lengths = [197] * 64
    # one-hot keys: exact similarities, so the ops and the kernels pick the same targets
    (x, keys, remove, sizes, cu), t = scope["case"](3, 64, lengths, 0, 1, 0, device="cuda", classes=7)
    engine_options(fold_kernel=False)
    ref_x, ref_s = packing.fold_removed(x, keys, remove, sizes, cu, 197, 1, 3)
    scratch = (torch.zeros(t, x.shape[1], device="cuda"), torch.zeros(t, device="cuda"))
    for _ in range(5):
        xs, s_in = x.clone(), sizes.clone()
        fold_rows(xs, keys, remove, s_in, cu, 197, 1, 3, out=xs, sizes_out=s_in, scratch=scratch)
        torch.testing.assert_close(xs, ref_x, rtol=1e-5, atol=1e-5)
        assert torch.equal(s_in, ref_s)
        assert not scratch[0].any() and not scratch[1].any()
