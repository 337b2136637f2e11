"""The controller graph's deletion in two Triton kernels (``timm_dora.engine.deletion_kernel``,
``EngineOptions.fused_deletion``).

The PyTorch fallback is compared with the code it replaces (``gather_survivors`` and the lengths and
``cu_seqlens`` of the controller segment); the kernels, in Triton's interpreter (a subprocess:
``TRITON_INTERPRET=1`` must be set before they are defined) and on CUDA replayed from a graph with
new removal patterns, with the fallback. Every comparison is exact.
"""
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_same_forwards, capture_graph, engine_options, run_interpreted, triton_version  # noqa: F401 (fixture)
from timm_dora.engine.deletion_kernel import (MAX_ROWS, Books, delete_rows_fused, delete_rows_reference,
                                              fused_deletion_reason)
from timm_dora.engine.packing import gather_survivors


def make_case(seed: int, b: int, prefix: int, max_visual: int, pad: int, d: int, dtype: torch.dtype,
              mode: str, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """A packed batch as the controller graph sees it: ``b`` sequences of ``prefix`` rows and 1 ..
    ``max_visual`` visual rows, ``pad`` rows past the last; ``remove`` marks visual rows only
    (``mode``: "none"; "random", 0 .. all of each image's; "all", every visual row of image 0 and
    some of the others), ``removed`` counts them per image."""
    g = torch.Generator().manual_seed(seed)
    visual = torch.randint(1, max_visual + 1, (b,), generator=g)
    lengths = visual + prefix
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    rows = int(cu[-1]) + pad
    remove = torch.zeros(rows, dtype=torch.bool)
    removed = torch.zeros(b, dtype=torch.long)
    for i in range(b):
        n = int(visual[i])
        if mode == "none":
            k = 0
        elif mode == "all" and i == 0:
            k = n
        else:
            k = int(torch.randint(0, n + 1, (), generator=g))
        cols = torch.randperm(n, generator=g)[:k]
        remove[int(cu[i]) + prefix + cols] = True
        removed[i] = k
    case = dict(x=torch.randn(rows, d, generator=g).to(dtype), remove=remove, removed=removed, cu=cu,
                ids=torch.randint(0, 1000, (rows,), generator=g))
    return {k: v.to(device) for k, v in case.items()}


CASES = [  # (seed, B, prefix, max visual, padded rows, d, dtype, mode)
    (0, 1, 1, 16, 0, 40, torch.float32, "random"),
    (1, 3, 1, 30, 7, 40, torch.bfloat16, "random"),
    (2, 5, 2, 20, 3, 300, torch.float16, "random"),  # d > 256: several column chunks
    (3, 4, 1, 25, 5, 64, torch.bfloat16, "none"),
    (4, 6, 5, 12, 1, 64, torch.float32, "all"),  # image 0 keeps only its prefix
    (5, 16, 1, 196, 0, 8, torch.bfloat16, "random"),  # up to the planned graph's 16 x 197 rows
    (6, 2, 1, 9, 20, 24, torch.float16, "all"),
]


def make_books(case: Dict[str, torch.Tensor], first: int, bound: int) -> Books:
    """Books for a case, in buffers holding other values (the graph's fixed buffers): a history of
    ``N_l`` at least the visual rows, ``E`` of earlier interventions, gates open where rows go and
    at some other images; the record's rows 3 entries longer than the rows (untouched)."""
    b, rows, dev = case["removed"].shape[0], case["x"].shape[0], case["x"].device
    g = torch.Generator().manual_seed(rows)
    gate = (case["removed"].cpu() > 0) | (torch.rand(b, generator=g) < 0.3)
    return Books(gate.to(dev), (torch.rand(b, generator=g, dtype=torch.float64) * 1e6).round().to(dev),
                 torch.randint(200, 260, (b,), generator=g).to(dev), torch.full((b,), 7.0, device=dev),
                 torch.randint(0, 4, (b,), generator=g).to(dev), first, torch.full((b,), -1, device=dev),
                 torch.full((b,), -1.0, dtype=torch.float64, device=dev),
                 torch.full((rows + 3,), -1, device=dev), torch.ones(rows + 3, dtype=torch.bool, device=dev),
                 torch.full((1,), -1, device=dev), bound)


# books: (first, bound) per case: the history updated or set (the forward's first deletion), no
# clamp, a bound the survivors exceed (cu clamped) and one they do not
BOOKS = [(0, 0), (196, 0), (0, 5), (0, 10 ** 6)]


def run_step(fn, case: Dict[str, torch.Tensor], in_place: bool, books: Optional[tuple] = None,
             sizes: bool = False) -> List[torch.Tensor]:
    """``fn`` (the fallback or the kernels) on fresh output buffers: ``[index, out, ids, lengths,
    cu]`` after the step, then with ``books`` (``(first, bound)``) the books' tensors and with
    ``sizes`` the rows' sizes (gathered in place). ``in_place``: ids and cu compacted in their own
    buffers (the packed phase); else into separate ones (the dense phase)."""
    x, b = case["x"], case["removed"].shape[0]
    out = torch.full((x.shape[0] + 3, x.shape[1]), 7.0, dtype=x.dtype, device=x.device)  # 3 rows past: untouched
    ids, cu = case["ids"].clone(), case["cu"].clone()
    ids_out, cu_out = (ids, cu) if in_place else (torch.zeros_like(ids), torch.zeros_like(cu))
    lengths = torch.zeros(b, dtype=torch.long, device=x.device)
    kept = make_books(case, *books) if books is not None else None
    size = (torch.arange(x.shape[0], device=x.device) % 7 + 1).float() if sizes else None
    index = fn(x, case["remove"], out, ids, ids_out, cu, case["removed"], lengths, cu_out, size, kept)
    return [index.long(), out, ids_out, lengths, cu_out] + ([t for t in kept if isinstance(t, torch.Tensor)]
                                                             if kept is not None else []) + ([size] if sizes else [])


def todays_step(case: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """What the controller segment ran before the kernels (packed phase), on fresh buffers."""
    x = case["x"]
    out = torch.full((x.shape[0] + 3, x.shape[1]), 7.0, dtype=x.dtype)
    index = torch.nonzero_static(~case["remove"], size=x.shape[0], fill_value=0).squeeze(1)
    ids = gather_survivors(x, case["remove"], out, case["ids"])
    cu = case["cu"].clone()
    lengths = (cu[1:] - cu[:-1]) - case["removed"]
    torch.cumsum(lengths, 0, dtype=cu.dtype, out=cu[1:])
    return [index, out, ids, lengths, cu]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("spec", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_reference_is_todays_deletion(spec, in_place):
    case = make_case(*spec)
    got = run_step(delete_rows_reference, case, in_place)
    for name, a, b in zip(("index", "out", "ids", "lengths", "cu"), got, todays_step(case)):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # and what it means: the survivors in order, then row 0; the lengths are the survivors per image
    keep = ~case["remove"]
    total = int(keep.sum())
    index, out, ids, lengths, cu = got
    assert torch.equal(out[:total], case["x"][keep]) and torch.equal(ids[:total], case["ids"][keep])
    assert torch.equal(out[total:len(keep)], case["x"][:1].expand(len(keep) - total, -1))
    assert (out[len(keep):] == 7).all()
    seq = torch.searchsorted(case["cu"][1:].long(), torch.arange(len(keep)), right=True)  # padding: b
    per_image = torch.zeros(len(lengths) + 1, dtype=torch.long).index_add_(0, seq, keep.long())[:-1]
    assert torch.equal(lengths, per_image) and int(cu[0]) == 0 and int(cu[-1]) == total - int(keep[int(case["cu"][-1]):].sum())


@pytest.mark.parametrize("books", BOOKS)
def test_reference_books_by_hand(books):
    """The books the reference keeps, computed here from their definitions: ids and flags before,
    the history updated (or set at the first deletion), the rows left, cu clamped past the bound;
    the sizes gathered as the rows are."""
    case = make_case(1, 3, 1, 30, 7, 40, torch.bfloat16, "random")
    first, bound = books
    before, plain = make_books(case, first, bound), run_step(delete_rows_reference, case, True)
    index, _, _, lengths, cu, gate, flops, n_visual, rho, interventions, rec_removed, rec_flops, \
        rec_ids, rec_remove, left, size = run_step(delete_rows_reference, case, True, books, sizes=True)
    removed, rows = case["removed"], case["x"].shape[0]
    n_before = torch.full_like(removed, first) if first else before.n_visual
    assert torch.equal(rho, removed.float() / n_before.float()) and torch.equal(n_visual, n_before - removed)
    assert torch.equal(interventions, gate.long() + (0 if first else before.interventions))
    assert torch.equal(rec_removed, removed) and torch.equal(rec_flops, flops)
    assert torch.equal(rec_ids[:rows], case["ids"]) and (rec_ids[rows:] == -1).all()
    assert torch.equal(rec_remove[:rows], case["remove"]) and rec_remove[rows:].all()
    survivors = int(lengths.sum())
    assert int(left) == survivors and torch.equal(lengths, plain[3])
    assert torch.equal(cu, plain[4].clamp(max=bound - 1) if 0 < bound < survivors else plain[4])
    assert torch.equal(size, ((torch.arange(rows) % 7 + 1).float())[index])


def test_limits_are_checked():
    """Bad inputs get a one-line reason; any number of rows is taken (above ``MAX_ROWS``, by
    several programs)."""
    x = torch.zeros(MAX_ROWS + 1, 8)
    why = fused_deletion_reason(x, torch.zeros(MAX_ROWS + 1, dtype=torch.bool))
    if why == "the triton package is not installed":
        pytest.skip(why)
    assert why is None
    assert "remove" in fused_deletion_reason(x[:10], torch.zeros(10, dtype=torch.uint8))
    assert "float32" in fused_deletion_reason(x[:10].double(), torch.zeros(10, dtype=torch.bool))
    assert fused_deletion_reason(x[:10], torch.zeros(10, dtype=torch.bool)) is None
    with pytest.raises(ValueError, match="remove must be a contiguous"):
        b = torch.zeros(1, dtype=torch.long)
        delete_rows_fused(x, torch.zeros(MAX_ROWS + 1, dtype=torch.uint8), x.clone(), b, b,
                          torch.zeros(2, dtype=torch.int32), b, b, torch.zeros(2, dtype=torch.int32))
    # the sizes, in either half, before anything is written
    from timm_dora.engine.deletion_kernel import compact_rows
    four, one, cu = torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"delete_rows_fused: sizes must be a contiguous \[4\] float32 vector"):
        delete_rows_fused(x[:4], torch.zeros(4, dtype=torch.bool), x[:4].clone(), four, four.clone(), cu, one, one,
                          cu.clone(), torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"delete_rows_fused: sizes_out must be a contiguous \[4\] float32 vector"):
        compact_rows(torch.zeros(4, dtype=torch.bool), four, four.clone(), cu, one, one, cu.clone(), torch.ones(4),
                     sizes_out=torch.ones(3))


INTERPRETED = r"""
import functools, json, sys
import torch
sys.path.insert(0, {tests!r})
from test_deletion_kernel import BOOKS, CASES, make_case, run_step
from timm_dora.engine.deletion_kernel import compact_rows, delete_rows_fused, delete_rows_reference, gather_rows

def split(block):  # the two halves with the new cu and sizes aside, copied back by the gather
    def step(x, remove, out, ids, ids_out, cu, removed, lengths, cu_out, sizes, books):
        cu_aside = torch.full_like(cu_out, -5)  # (entry 0 is not the deletion's: it stays as cu_out has it)
        sizes_aside = None if sizes is None else torch.full_like(sizes, -5.0)
        cu_before = cu.clone()
        index = compact_rows(remove, ids, ids_out, cu, removed, lengths, cu_aside, sizes, sizes_out=sizes_aside,
                             books=books, block_rows=block)
        if (sizes is not None and not torch.equal(sizes, sizes_before[0])) or not torch.equal(cu, cu_before):
            bad.append(["sizes or cu written in place", block])
        gather_rows(x, index, out, sizes, sizes_from=sizes_aside, cu_from=cu_aside, cu_out=cu_out)
        return index
    return step

def by_image(block):  # a program per image, nothing in place: the ids, cu and sizes aside, copied back
    def step(x, remove, out, ids, ids_out, cu, removed, lengths, cu_out, sizes, books):
        ids_aside, cu_aside = torch.full_like(ids, -5), torch.full_like(cu_out, -5)
        sizes_aside = None if sizes is None else torch.full_like(sizes, -5.0)
        before = (ids.clone(), cu.clone(), None if sizes is None else sizes.clone())
        index = compact_rows(remove, ids, ids_aside, cu, removed, lengths, cu_aside, sizes, sizes_out=sizes_aside,
                             books=books, block_rows=block, per_image=True)
        if not (torch.equal(ids, before[0]) and torch.equal(cu, before[1])
                and (sizes is None or torch.equal(sizes, before[2]))):
            bad.append(["ids, cu or sizes written in place by image", block])
        gather_rows(x, index, out, sizes, sizes_from=sizes_aside, cu_from=cu_aside, cu_out=cu_out,
                    ids_from=ids_aside, ids_out=ids_out)
        return index
    return step

bad, n = [], 0
sizes_before = [None]
for block in (None, 16):  # one program over all rows; programs of 16 rows (MAX_ROWS's many programs)
    forms = [("fused", functools.partial(delete_rows_fused, block_rows=block)), ("split", split(block))]
    for form, fused in forms + ([("by_image", by_image(block))] if {by_image} else []):
        for i, spec in enumerate(CASES):
            case = make_case(*spec)
            for in_place in (True, False):
                for books, sizes in ((None, False), (BOOKS[i % len(BOOKS)], True), (BOOKS[(i + 1) % len(BOOKS)], False)):
                    sizes_before[0] = (torch.arange(case["x"].shape[0]) % 7 + 1).float()  # (run_step's)
                    got = run_step(fused, case, in_place, books, sizes)
                    ref = run_step(delete_rows_reference, case, in_place, books, sizes)
                    n += 1
                    for j, (a, b) in enumerate(zip(got, ref, strict=True)):
                        if a.dtype != b.dtype or not torch.equal(a, b):
                            bad.append([form, block, spec[0], in_place, books, sizes, j])
# no rows at all (two empty sequences): the layout is still written, by either form
empty = dict(x=torch.zeros(0, 8), remove=torch.zeros(0, dtype=torch.bool), removed=torch.zeros(2, dtype=torch.long),
             cu=torch.zeros(3, dtype=torch.int32), ids=torch.zeros(0, dtype=torch.long))
for block in (None, 16):
    for fn in [functools.partial(delete_rows_fused, block_rows=block)] + ([by_image(block)] if {by_image} else []):
        got = run_step(fn, empty, False)
        ref = run_step(delete_rows_reference, empty, False)
        n += 1
        if not all(torch.equal(a, b) for a, b in zip(got[1:], ref[1:])):
            bad.append([block, "empty"])
print(json.dumps({{"cases": n, "bad": bad}}))
"""


def test_interpreted_kernels_match_reference():
    """Every output, the books (each kind of books among the cases) and the sizes included, by one
    program and by programs of 16 rows (ids, cu and sizes in place too); and the same split in its
    two halves with the new cu and sizes left aside (``compact_rows`` writes neither the sizes nor the
    cu a fold beside it reads) and copied back by ``gather_rows``; and compacted by image (a program
    per image, in one pass or 16 rows at a time; Triton 3.9 on), with the ids aside too."""
    pytest.importorskip("triton")
    # (the compaction by image loops over each image's rows, bounds read from cu_seqlens: Triton's
    # interpreter runs that from 3.9 on; compiled, any version)
    by_image = triton_version() >= (3, 9)
    res = run_interpreted(INTERPRETED.format(tests=str(Path(__file__).resolve().parent), by_image=by_image),
                          timeout=900)
    assert res["cases"] == (36 * len(CASES) + 4 if by_image else 24 * len(CASES) + 2) and res["bad"] == [], res["bad"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [16, 48])  # one program; 48 x 197 rows, above MAX_ROWS: several
def test_cuda_graph_replays_new_patterns(b):
    """Captured once into fixed buffers (ids and cu compacted in place, as the controller graph
    does), replayed with other removal patterns of the same shapes: equal to the fallback."""
    pytest.importorskip("triton")
    prefix, d, rows = 1, 192, b * 197
    assert (rows > MAX_ROWS) == (b == 48)
    bufs = dict(x=torch.empty(rows, d, dtype=torch.bfloat16, device="cuda"),
                remove=torch.zeros(rows, dtype=torch.bool, device="cuda"),
                removed=torch.zeros(b, dtype=torch.long, device="cuda"),
                cu=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
                ids=torch.zeros(rows, dtype=torch.long, device="cuda"))
    out = torch.zeros(rows, d, dtype=torch.bfloat16, device="cuda")
    lengths = torch.zeros(b, dtype=torch.long, device="cuda")

    def load(case):  # a case padded to the fixed rows (padding never removed)
        n = case["x"].shape[0]
        for k in ("x", "remove", "ids"):
            bufs[k].zero_()
            bufs[k][:n].copy_(case[k])
        bufs["removed"].copy_(case["removed"])
        bufs["cu"].copy_(case["cu"])
        return {k: v.clone() for k, v in bufs.items()}

    load(make_case(10, b, prefix, 196, 0, d, torch.bfloat16, "random", "cuda"))
    graph, index = capture_graph(lambda: delete_rows_fused(bufs["x"], bufs["remove"], out, bufs["ids"], bufs["ids"],
                                                           bufs["cu"], bufs["removed"], lengths, bufs["cu"]))
    for seed, mode in ((11, "random"), (12, "none"), (13, "all"), (14, "random")):
        before = load(make_case(seed, b, prefix, 196, 0, d, torch.bfloat16, mode, "cuda"))
        graph.replay()
        ref = run_step(delete_rows_reference, before, in_place=True)
        torch.cuda.synchronize()
        for name, a, r in zip(("index", "out", "ids", "lengths", "cu"),
                              [index.long(), out, bufs["ids"], lengths, bufs["cu"]], ref):
            assert torch.equal(a, r[:rows] if name == "out" else r), (seed, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_rows", [None, 512])  # 96 images: above MAX_ROWS; and programs of 512 rows
def test_cuda_programs_with_books_and_sizes_equal_the_reference(block_rows):
    """Above ``MAX_ROWS`` the programs run concurrently on the GPU (the interpreter runs them one
    after another): ids, cu and sizes compacted in place, the books kept, all as the reference."""
    pytest.importorskip("triton")
    import functools
    fused = functools.partial(delete_rows_fused, block_rows=block_rows)
    for seed, mode, books in ((20, "random", (0, 0)), (21, "all", (196, 0)), (22, "random", (0, 5000))):
        case = make_case(seed, 96, 1, 196, 9, 192, torch.bfloat16, mode, "cuda")
        assert case["x"].shape[0] > MAX_ROWS or block_rows
        got = run_step(fused, case, True, books, sizes=True)
        ref = run_step(delete_rows_reference, case, True, books, sizes=True)
        for j, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (seed, j)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the capture)")
@pytest.mark.parametrize("planned", [None, False])  # the planned whole graph (batch 12), the per-block executor
def test_cuda_forward_with_fused_deletion_is_unchanged(planned, monkeypatch, engine_options):
    """A wrapped model with ``EngineOptions(fused_deletion=True)`` runs the kernels in its controller
    graphs and decides and computes as with the PyTorch deletion (the same rows, exactly)."""
    pytest.importorskip("triton")
    import timm_dora
    from timm_dora.engine import segments as segments_module
    from helpers import SMALL_FAMILIES, images, kind_actor, make_model

    calls = []
    real = segments_module.delete_rows_fused
    monkeypatch.setattr(segments_module, "delete_rows_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw).to("cuda", torch.bfloat16)
    actor = kind_actor(model, "forced").to("cuda", torch.bfloat16)
    xs = [images(model, 12, seed=s).to("cuda", torch.bfloat16) for s in (1, 1, 2)]

    def forwards():
        timm_dora.wrap(model, actor=actor)
        try:
            with torch.inference_mode():
                return [(model(x), model.dora_stats) for x in xs]  # observed, captured, replayed
        finally:
            timm_dora.unwrap(model)

    engine_options(planned=planned, fused_deletion=False)
    ref = forwards()
    assert not calls
    engine_options(fused_deletion=True)
    got = forwards()
    assert calls  # (counted where captured: the kernels then replay without Python)
    assert_same_forwards(got, ref)


NORMED = r"""
import json, torch
import torch.nn.functional as F
from timm_dora.engine.deletion_kernel import gather_rows
from timm_dora.engine.dense_kernels import layer_norm_triton

g = torch.Generator().manual_seed(0)
out = {}
for d in (24, 256):  # a row in part of the gather's chunk, and filling it
    rows = 37
    x = torch.randn(rows, d, generator=g) * 3 + 1
    index = torch.randperm(rows, generator=g)[:30].to(torch.int32)
    index = torch.cat([index, torch.zeros(rows - 30, dtype=torch.int32)])  # (past the survivors: row 0)
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    plain, got = torch.full((rows + 2, d), 7.0), torch.full((rows + 2, d), 7.0)
    normed = torch.full((rows + 2, d), float("nan"))
    gather_rows(x, index, plain)
    gather_rows(x, index, got, norm=(w, b, 1e-6, normed))
    # with the fold's finish on the way (its sums and mass at a few source rows)
    sizes, acc, mass = torch.ones(rows) * 2, torch.zeros(rows, d), torch.zeros(rows)
    acc[5:9], mass[5:9] = torch.randn(4, d, generator=g), 1.0
    folded, folded_normed = torch.zeros(rows, d), torch.zeros(rows, d)
    gather_rows(x, index, folded, sizes, received=(acc, mass), norm=(w, b, 1e-6, folded_normed))
    out[d] = {"rows_equal": torch.equal(got, plain),
              "normed_equal_kernel": torch.equal(normed[:rows], layer_norm_triton(got[:rows], w, b, 1e-6)),
              "normed_vs_torch": float((normed[:rows] - F.layer_norm(got[:rows], (d,), w, b, 1e-6)).abs().max()),
              "past_rows_untouched": bool(torch.isnan(normed[rows:]).all()),
              "folded_normed_equal_kernel": torch.equal(folded_normed, layer_norm_triton(folded, w, b, 1e-6)),
              "folded_rows_changed": int((folded != plain[:rows]).any(1).sum())}
print(json.dumps(out))
"""


def test_interpreted_gather_writes_the_layer_norm_of_its_rows():
    """``gather_rows``' ``norm``: the gathered rows unchanged, and their LayerNorm exactly as
    ``dense_kernels``' own kernel computes it (the MLP's, which it replaces), within rounding of
    ``F.layer_norm``, the rows past the gathered ones untouched; after the fold's finish too (the
    LayerNorm of the finished rows)."""
    pytest.importorskip("triton")
    res = run_interpreted(NORMED, timeout=300)
    for d, case in res.items():
        assert case["rows_equal"] and case["normed_equal_kernel"] and case["past_rows_untouched"], (d, case)
        assert case["normed_vs_torch"] < 1e-4, (d, case)
        assert case["folded_normed_equal_kernel"] and case["folded_rows_changed"] > 0, (d, case)


def test_gather_norm_is_checked():
    """A one-line reason for a LayerNorm the gather cannot take, before anything is written."""
    from timm_dora.engine.deletion_kernel import GATHER_BLOCK_D, gather_rows
    d = GATHER_BLOCK_D + 64
    x, out = torch.zeros(4, d), torch.full((4, d), 3.0)
    with pytest.raises(ValueError, match=rf"gather_rows: norm takes rows of at most {GATHER_BLOCK_D} channels, a "
                                         rf"weight and a bias \[{d}\] and normed \[>= 4, {d}\] torch.float32"):
        gather_rows(x, torch.zeros(4, dtype=torch.int32), out, norm=(torch.ones(d), torch.zeros(d), 1e-6, out.clone()))
    assert (out == 3.0).all()
    with pytest.raises(ValueError, match=r"normed \[>= 4, 8\] torch.float32"):
        gather_rows(x[:, :8], torch.zeros(4, dtype=torch.int32), out[:, :8].contiguous(),
                    norm=(torch.ones(8), torch.zeros(8), 1e-6, torch.zeros(3, 8)))
