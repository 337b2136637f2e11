"""Serving latency: a stream of small requests, as a server sees it (not a test).

For each configuration (``vit_tiny_published`` and ``deit_tiny_published``: the published actors on
the ``test`` images; ``deit_base_forced``: DeiT-B with random weights and the actor forced open at
blocks 3, 6 and 9, on random images) and each request size of ``--batches``, one GPU, bf16: a
stream of ``--warmup-requests`` then ``--requests`` requests, each a batch already on the GPU
(successive images of a pool, so the actor sees new images), timed on the host from the call to
the logits readable on the host (``logits.cpu()``). The executors of one request size are made
and warmed up side by side, then take turns in ``--rounds`` rounds of the timed requests. DORA wraps
a copy of the model once per configuration and serves every request size with it, as a server's
one model does (so the plans of the sizes served before inform a new size's first plan). Per
executor:

- ``native_eager``, ``native_compiled`` (``torch.compile``, default mode), ``native_reduce_overhead``
  (``mode="reduce-overhead"``: CUDA graphs, the one-line baseline a server would pick);
- ``dora_default``: ``timm_dora.wrap(model, actor)`` with no options;
- ``dora_compiled_ro``: ``torch.compile(wrapped, mode="reduce-overhead")`` (its ``error`` when it
  cannot run);

with ``p50_ms``, ``p99_ms``, ``max_ms``, ``images_per_s`` (images over the summed request times:
one request at a time) and, for the DORA rows, ``plan_misses`` and ``captures`` (the planned
graph's misses and the graphs captured during the timed requests, from
:func:`timm_dora.engine_info`: a steady state pays neither). ``--kernels`` adds, from 10 more
requests under the profiler, ``kernels_per_request``, ``kernel_ms_per_request`` and
``cudaGraphLaunch_ms`` (a graph's launch costs host time per node); ``--sequence`` one more request's
kernels in order, each with its time, and per family (``sequence``). ``--mixed`` adds a row ``mixed``
per configuration: a stream whose request sizes cycle through :func:`mixed_sizes` (``--batches`` in a
seeded random order, as a dynamic batcher's), after a warm-up that serves every size (a server's
steady state: no capture or plan miss is owed there). The result file is rewritten after each batch
size; ``--resume`` skips what it already holds.

    python -m benchmarks.serving_latency --vit-weights W --deit-weights W2 --data labels.csv \\
        --out benchmarks/results/serving_latency_h100.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

import timm_dora
from timm_dora.evaluate import inference_device, loader_for, write_json
from benchmarks.common import deit_forced, header, published

CONFIGS = ("vit_tiny_published", "deit_tiny_published", "deit_base_forced")
EXECUTORS = ("native_eager", "native_compiled", "native_reduce_overhead", "dora_default", "dora_compiled_ro")


Batch = Union[int, Sequence[int]]  # images a request, or the request sizes of a mixed stream in turn


def request_size(batch: Batch, i: int) -> int:
    """Images of request ``i``: ``batch``, or ``batch[i % len(batch)]`` for a mixed stream."""
    return batch if isinstance(batch, int) else batch[i % len(batch)]


MIXED_LENGTH = 64  # requests in a mixed stream's cycle of sizes (its warm-up serves one cycle at least)


def mixed_sizes(batches: Sequence[int], length: int = MIXED_LENGTH, seed: int = 0) -> List[int]:
    """A mixed stream's request sizes: ``length`` draws from ``batches`` (seeded), each size at
    least once."""
    rng = random.Random(seed)
    sizes = list(batches) + [rng.choice(list(batches)) for _ in range(length - len(batches))]
    rng.shuffle(sizes)
    return sizes


def stream(fn: Callable, pool: torch.Tensor, batch: Batch, first: int, count: int) -> List[float]:
    """Milliseconds of each of ``count`` requests, requests ``first`` onwards of the stream that
    takes the images of ``pool`` in turn: each request of ``batch`` images, or of a mixed stream's
    sizes (:func:`request_size`), the first images of successive windows of the largest size."""
    window = batch if isinstance(batch, int) else max(batch)
    n = pool.shape[0] - pool.shape[0] % window
    times = []
    with torch.inference_mode():
        for i in range(first, first + count):
            start = (i * window) % n
            x = pool[start:start + request_size(batch, i)]
            t = time.perf_counter()
            fn(x).float().cpu()  # (the logits readable on the host: synchronises)
            times.append(1e3 * (time.perf_counter() - t))
    return times


def summary(times: List[float], batch: Batch, first: int = 0) -> Dict[str, float]:
    """p50, p99 and max of ``times`` (ms), and the images of those requests (requests ``first``
    onwards of a ``batch`` stream, :func:`request_size`) over their summed time."""
    images = sum(request_size(batch, first + i) for i in range(len(times)))
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_ms": round(statistics.median(ordered), 4), "p99_ms": round(p99, 4), "max_ms": round(ordered[-1], 4),
            "images_per_s": round(1e3 * images / sum(times), 1)}


def kernel_profile(fn: Callable, pool: torch.Tensor, batch: int, first: int, count: int = 10) -> Dict[str, float]:
    """Device kernels (CUDA graph nodes included, each counted) and their summed time per request,
    over ``count`` requests under the profiler; ``cudaGraphLaunch_ms``: the host time of graph
    launches per request (it grows with a graph's node count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stream(fn, pool, batch, first, count)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launch = sum(e.self_cpu_time_total for e in events if e.key == "cudaGraphLaunch")
    return {"kernels_per_request": sum(e.count for e in kernels) / count,
            "kernel_ms_per_request": round(sum(e.self_device_time_total for e in kernels) / count / 1e3, 4),
            "cudaGraphLaunch_ms": round(launch / count / 1e3, 4)}


FAMILIES = (("gemm", ("gemm", "nvjet", "cutlass", "sm90_", "cublas")), ("attention", ("varlen", "_attn", "flash", "fmha", "sdpa")),
            ("norm", ("layer_norm", "layernorm", "_normalized")), ("copy", ("memcpy", "memset", "copy_", "fill")))


def family(kernel: str) -> str:
    """A kernel's family by its name: ``gemm``, ``attention``, ``norm``, ``copy``, else ``triton``
    (Triton kernels: Inductor's or this package's) or ``other``."""
    low = kernel.lower()
    for name, marks in FAMILIES:
        if any(m in low for m in marks):
            return name
    return "triton" if low.startswith(("triton", "_")) else "other"


def kernel_sequence(fn: Callable, pool: torch.Tensor, batch: int, first: int) -> Dict[str, Any]:
    """The device kernels of one request in the order they ran, each ``[name, microseconds, start]``
    (names cut to 120 characters; ``start``: microseconds after the first kernel began, so kernels
    on two streams show where they overlapped), per family (:func:`family`) their count and time,
    and ``span_us``, the first kernel's start to the last one's end: where a request's kernels go."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stream(fn, pool, batch, first, 1)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start if kernels else 0
    seq = [[e.name[:120], round(e.time_range.elapsed_us(), 2), round(e.time_range.start - t0, 2)] for e in kernels]
    span = max((e.time_range.end for e in kernels), default=t0) - t0
    families: Dict[str, List[float]] = {}
    for name, us, _ in seq:
        f = families.setdefault(family(name), [0, 0.0])
        f[0] += 1
        f[1] = round(f[1] + us, 2)
    return {"kernels": seq, "families": families, "span_us": round(span, 2)}


def profiles(fn: Callable, pool: torch.Tensor, batch: int, first: int, args) -> Dict[str, Any]:
    """After the timed requests: ``--kernels``' profile of 10 requests, then ``--sequence``'s one."""
    out = kernel_profile(fn, pool, batch, first) if args.kernels else {}
    if args.sequence:
        out["sequence"] = kernel_sequence(fn, pool, batch, first + 10)
    return out


def graph_counts(model) -> Dict[str, int]:
    info = timm_dora.engine_info(model)
    return {"plan_misses": sum(s["plan_misses"] for s in info["batch_shapes"]), "graphs": info["graphs"]}


def config_and_pool(ap: argparse.ArgumentParser, config: str, args, dev, dtype, images: int):
    """``(model, actor, pool)`` of a configuration of :data:`CONFIGS`: DeiT-B forced on ``images``
    random images, a published actor on the first ``images`` of ``args.data``'s ``test`` split (a
    usage error through ``ap`` without ``--data``)."""
    if config == "deit_base_forced":
        model, actor, make = deit_forced(dev, dtype)
        return model, actor, torch.cat(make(images // 2))
    if not args.data:
        ap.error(f"{config} needs --data")
    model, actor = published(ap, config, args, dev, dtype)
    pool = torch.cat([x for x, *_ in loader_for(model, args.data, "test", batch=64, workers=4, limit=images)])
    return model, actor, pool.to(dev, dtype)


def executor(name: str, model, actor, served: Optional[Dict[str, torch.nn.Module]] = None
             ) -> Tuple[Callable, Optional[torch.nn.Module]]:
    """``(fn, wrapped)``: the function that serves a request, and for the DORA executors the wrapped
    model (a copy of ``model``: the native executors keep theirs unwrapped, so that all of one
    request size can run side by side); ``served``: the wrapped copies kept across request sizes,
    by executor (one is made and kept where it has none)."""
    if name.startswith("native"):
        if name == "native_eager":
            return model, None
        mode = "reduce-overhead" if name == "native_reduce_overhead" else "default"
        return torch.compile(model, mode=mode, dynamic=False), None
    wrapped = None if served is None else served.get(name)
    if wrapped is None:
        wrapped = timm_dora.wrap(copy.deepcopy(model), actor)
        if served is not None:
            served[name] = wrapped
    if name == "dora_compiled_ro":
        return torch.compile(wrapped, mode="reduce-overhead", dynamic=False), wrapped
    return wrapped, wrapped


def measure(names: List[str], model, actor, pool: torch.Tensor, batch: Batch, args,
            served: Optional[Dict[str, torch.nn.Module]] = None) -> Dict[str, Any]:
    """The executors' rows at one request size (or a mixed stream's sizes in turn,
    :func:`request_size`): each warmed up, then ``--rounds`` rounds in which
    every executor serves its share of ``--requests`` in turn (the host's and the GPU's drifts
    within a call fall on all of them alike). An executor that fails gets its ``error`` instead.
    ``served``: the DORA executors' wrapped copies kept across request sizes (:func:`executor`;
    the caller unwraps them); without, each is made here and unwrapped after."""
    w, n, rounds = args.warmup_requests, args.requests, args.rounds
    shares = [n // rounds + (r < n % rounds) for r in range(rounds)]
    torch._dynamo.reset()
    fns: Dict[str, Tuple[Callable, Optional[torch.nn.Module]]] = {}
    rows: Dict[str, Any] = {}
    times: Dict[str, List[float]] = {}
    counts: Dict[str, Dict[str, int]] = {}

    def attempt(name: str, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as e:  # (a compiled wrapped model may not run: say why)
            message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            rows[name] = {"error": f"{type(e).__name__}: {message}"}
            wrapped = fns.pop(name, (None, None))[1]
            if served is not None:
                served.pop(name, None)
            if wrapped is not None:
                timm_dora.unwrap(wrapped)

    def make(name: str) -> None:
        fns[name] = executor(name, model, actor, served)
        stream(fns[name][0], pool, batch, 0, w)
        times[name] = []
        if fns[name][1] is not None:
            counts[name] = graph_counts(fns[name][1])

    def serve(name: str, first: int, count: int) -> None:
        times[name] += stream(fns[name][0], pool, batch, first, count)

    def finish(name: str) -> None:
        fn, wrapped = fns[name]
        row = summary(times[name], batch, w)
        if wrapped is not None:
            after = graph_counts(wrapped)
            row["plan_misses"] = after["plan_misses"] - counts[name]["plan_misses"]
            row["captures"] = after["graphs"] - counts[name]["graphs"]
            row["executor"] = timm_dora.engine_info(wrapped)["executor"]
        rows[name] = {**row, **profiles(fn, pool, batch, w + n, args)}

    try:
        for name in names:
            attempt(name, lambda: make(name))
        first = w
        for share in shares:
            for name in list(fns):
                attempt(name, lambda: serve(name, first, share))
            first += share
        for name in list(fns):
            attempt(name, lambda: finish(name))
    finally:
        for name, (_, wrapped) in fns.items():
            if wrapped is not None and (served is None or served.get(name) is not wrapped):
                timm_dora.unwrap(wrapped)
        torch._dynamo.reset()
    return rows


def targets(res: Dict[str, Any]) -> Dict[str, Any]:
    """Issue #60's targets, read off the rows: DORA default's images/s over native
    ``reduce-overhead``'s (DeiT-B forced >= 1.0 at every batch; the Tiny actors >= 0.9 at batches
    up to 8 and >= 1.0 at 16) and its p99 over its p50 (<= 1.5), each with whether it is met."""
    out: Dict[str, Any] = {}
    for config in CONFIGS:
        sizes = {b: row for b, row in res.get(config, {}).items() if b.isdigit()}  # (not the mixed stream's)
        for b, row in sorted(sizes.items(), key=lambda kv: int(kv[0])):
            dora, native = row.get("dora_default", {}), row.get("native_reduce_overhead", {})
            if "images_per_s" not in dora:
                continue
            t = out.setdefault(config, {})[b] = {}
            if "images_per_s" in native:
                floor = 1.0 if config == "deit_base_forced" or int(b) >= 16 else 0.9
                ratio = dora["images_per_s"] / native["images_per_s"]
                t["over_reduce_overhead"] = {"ratio": round(ratio, 3), "target": floor, "met": ratio >= floor}
            tail = dora["p99_ms"] / dora["p50_ms"]
            t["p99_over_p50"] = {"ratio": round(tail, 3), "target": 1.5, "met": tail <= 1.5}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vit-weights", default=None, help="ViT-Ti weights (vit_tiny_published)")
    ap.add_argument("--deit-weights", default=None, help="DeiT-Ti weights (deit_tiny_published)")
    ap.add_argument("--data", default=None, help="labels CSV with a test split (the published configs)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--warmup-requests", type=int, default=200)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed requests are split into")
    ap.add_argument("--pool-images", type=int, default=640, help="images the requests cycle through")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile 10 more requests: device kernels and their time per request")
    ap.add_argument("--sequence", action="store_true",
                    help="also record one more request's kernels in order, with their times and families")
    ap.add_argument("--mixed", action="store_true",
                    help="also a stream of requests whose sizes cycle through --batches in a seeded random order")
    ap.add_argument("--resume", action="store_true", help="keep the rows --out already holds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.mixed and args.warmup_requests < MIXED_LENGTH:
        ap.error(f"--mixed needs --warmup-requests of at least {MIXED_LENGTH} (one cycle of its sizes), "
                 f"got {args.warmup_requests}")
    if not 1 <= args.rounds <= args.requests:
        ap.error(f"--rounds must be between 1 and --requests ({args.requests}), got {args.rounds}")
    dev, dtype, _ = inference_device("cuda", "bf16")
    res: Dict[str, Any] = header(dev, "serving_latency", argv, argparse.Namespace(warmup=args.warmup_requests,
                                 iters=args.requests, repeats=1), timing="per request, host clock, to logits on the host")
    res["protocol"]["rounds"] = args.rounds
    if args.resume and args.out and os.path.exists(args.out):
        res.update({k: v for k, v in json.load(open(args.out)).items() if k in CONFIGS})
    for config in args.configs:
        model, actor, pool = config_and_pool(ap, config, args, dev, dtype, args.pool_images)
        rows = res.setdefault(config, {})
        served: Dict[str, torch.nn.Module] = {}
        for b in args.batches + (["mixed"] if args.mixed else []):
            row = rows.setdefault(str(b), {})
            todo = [name for name in args.executors if name not in row]
            if not todo:
                continue
            row.update(measure(todo, model, actor, pool, mixed_sizes(args.batches) if b == "mixed" else b, args, served))
            for name in todo:
                print(config, b, name, row[name], flush=True)
            if args.out:
                write_json(args.out, res)
        for wrapped in served.values():
            timm_dora.unwrap(wrapped)
        del model, actor, pool, served
        torch.cuda.empty_cache()
    res["targets"] = targets(res)
    if args.out:
        write_json(args.out, res)


if __name__ == "__main__":
    main()
