"""What merging's fold costs: :func:`timm_dora.engine.packing.fold_removed` alone (not a test).

On random rows of one block at a backbone's shape (default DeiT-Ti at batch 320: 197 rows of width
192, 3 heads per image, 30 % of the visual rows removed, bf16 on CUDA), for each form (``ops``: the
PyTorch ops, ``EngineOptions(fold_kernel=False)``; ``kernels``: the Triton kernels of
``engine.fold_kernel``, CUDA only) the time per call eagerly and replayed from a CUDA graph (the
captured controller's form; synchronised timed loops, median of ``--repeats``) and the kernels that
take it (``torch.profiler``, per call, the largest first). Off CUDA only the ops' eager time (the
smoke test).

    python -m benchmarks.fold_profile --out benchmarks/results/merge_modes/fold_profile_h100.json
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from timm_dora.engine import EngineOptions, packing
from timm_dora.engine.options import using
from timm_dora.evaluate import environment, write_json


def _timed(fn, iters: int, repeats: int, cuda: bool) -> float:
    """Median milliseconds per call over ``repeats`` loops of ``iters`` calls."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--tokens", type=int, default=197, help="rows per image (the CLS row included)")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.3, help="share of the visual rows removed")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    b, s, d = args.batch, args.tokens, args.dim
    t = b * s
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, d, device=dev, generator=g).to(dtype)
    keys = torch.randn(t, 3 * d, device=dev, generator=g).to(dtype)[:, d:2 * d]  # a view of a qkv output
    remove = torch.rand(t, device=dev, generator=g) < args.fraction
    remove[::s] = False  # never the CLS row
    sizes = torch.ones(t, device=dev)
    cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * s
    out = torch.empty_like(x)

    def fold():
        return packing.fold_removed(x, keys, remove, sizes, cu, s, 1, args.heads, out=out)

    res = {**environment(dev), "dtype": str(dtype).replace("torch.", ""),
           "shape": {"batch": b, "tokens": s, "dim": d, "heads": args.heads, "removed_rows": int(remove.sum())},
           "protocol": {"iters": args.iters, "repeats": args.repeats, "statistic": "median over repeats"}}
    options = contextlib.ExitStack()  # the fold reads the active EngineOptions
    for form, kernels in (("ops", False), ("kernels", True)) if cuda else (("ops", False),):
        options.enter_context(using(EngineOptions(fold_kernel=kernels)))
        for _ in range(3):
            fold()
        row = res[form] = {"eager_ms": _timed(fold, args.iters, args.repeats, cuda)}
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fold()
            row["graph_ms"] = _timed(graph.replay, args.iters, args.repeats, cuda)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fold()
                torch.cuda.synchronize()
            top = sorted(((e.key, e.device_time_total / 10) for e in prof.key_averages() if e.device_time_total > 0),
                         key=lambda r: -r[1])
            row["kernels_us_per_call"] = [{"kernel": k.replace("void ", "").replace("at::native::", "")[:90],
                                           "us": round(v, 1)} for k, v in top[:10]]
    options.close()
    write_json(args.out, res)
    print({form: {k: v for k, v in row.items() if k.endswith("_ms")} for form, row in res.items()
           if form in ("ops", "kernels")})
    return res


if __name__ == "__main__":
    main()
