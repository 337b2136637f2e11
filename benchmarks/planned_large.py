"""Large batches: the per-block executor against the planned whole graph and the compiled oracle.

In one process on one GPU (bf16), at each ``--batches`` size, for ``vit_tiny_published`` and
``deit_tiny_published`` (the published actors on the ``test`` images: speed only) and
``deit_base_forced`` (DeiT-B, random weights, the gate forced open at blocks 3, 6 and 9, random
images), interleaved rounds (``--rounds`` x ``--per-round`` forwards, the two input batches in
turn; median ms per batch, CUDA events) of:

- ``oracle_gemm_embed``: the dense slicing oracle at DORA's realised mean removal per block, the
  patch embedding as one matrix product, ``torch.compile`` (``benchmarks.default_speed``'s
  strongest reference); ``oracle_gemm_embed_graph``: the same captured as one CUDA graph
  (``benchmarks.common.captured``: input copied in, output cloned), which no host can slow down;
- ``per_block``: the wrapped model with ``EngineOptions(planned_max_gflops=0)`` (a graph per
  block: host reads of each gate and of the lengths after each deletion);
- ``planned``: ``EngineOptions(planned_max_gflops=inf, aside_controller=False)`` (one graph per
  plan, no host read but the plan's check, rows bounded by the plan);
- ``planned_aside``: the same with the controller's decision on the second stream
  (``aside_controller``, the default);
- ``torch_deletion``: the defaults with ``fused_deletion=False`` (the deletion in PyTorch ops, as
  the engine ran batches above ``deletion_kernel.MAX_ROWS`` rows before its programs were split);
- ``default``: ``wrap(model, actor)`` with no options (``engine_info``'s ``graph`` says which ran);
- any ``--options NAME=JSON`` variant: the defaults with those ``EngineOptions`` fields (an A/B).

Per executor also, from three more forwards under the profiler: ``kernels`` a forward,
``kernel_us`` (their summed time) and ``idle_us`` (the gaps over 5 us between kernels: the GPU
waiting for the host); per DORA executor ``plan_misses``.

    python -m benchmarks.planned_large --vit-weights W --deit-weights W2 --data labels.csv \\
        --out benchmarks/results/planned_large_h200.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
from typing import Any, Callable, Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

import timm_dora
from timm_dora import EngineOptions
from timm_dora.evaluate import inference_device, loader_for, write_json
from benchmarks.common import captured, deit_forced, header, oracle_forward, published
from benchmarks.default_speed import gemm_embed

VARIANTS = {"per_block": dict(planned_max_gflops=0),
            "planned": dict(planned_max_gflops=math.inf, aside_controller=False),
            "planned_aside": dict(planned_max_gflops=math.inf),
            "torch_deletion": dict(fused_deletion=False),
            "default": None}


def ms_per_forward(fn: Callable, inputs: List[torch.Tensor], per: int) -> float:
    """Milliseconds a forward over ``per`` forwards back to back (the inputs in turn)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(per):
        fn(inputs[i % len(inputs)])
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / per


def kernels(fn: Callable, inputs: List[torch.Tensor], n: int = 3) -> Dict[str, float]:
    """Kernels a forward, their summed microseconds and the gaps over 5 us between them."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            fn(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(ev, ev[1:])]
    return {"kernels": len(ev) / n, "kernel_us": round(sum(e.time_range.elapsed_us() for e in ev) / n, 1),
            "idle_us": round(sum(g for g in gaps if g > 5) / n, 1)}


def removal(model, actor, inputs: List[torch.Tensor]) -> Dict[int, int]:
    """DORA's mean removal per block over ``inputs`` (the eager executor), rounded: the oracle's."""
    timm_dora.wrap(model, actor, cuda_graphs=False)
    with torch.inference_mode():
        removed = torch.cat([model(x) is not None and model.dora_stats.removed.float() for x in inputs]).mean(0)
    timm_dora.unwrap(model)
    return {l: int(round(float(r))) for l, r in enumerate(removed) if r > 0}


def measure(model, actor, inputs: List[torch.Tensor], args) -> Dict[str, Any]:
    torch._dynamo.reset()
    oracle = torch.compile(oracle_forward(model, removal(model, actor, inputs), gemm_embed(model)))
    fns: Dict[str, Callable] = {}
    if "oracle_gemm_embed" in args.executors:
        fns["oracle_gemm_embed"] = oracle
    if "oracle_gemm_embed_graph" in args.executors:
        with torch.inference_mode():
            fns["oracle_gemm_embed_graph"] = captured(oracle, inputs[0])
    wrapped = {}
    for name, opts in args.variants.items():  # one copy of the model per variant: each keeps its graphs
        if name not in args.executors:
            continue
        m = copy.deepcopy(model)
        timm_dora.wrap(m, actor, options=None if opts is None else EngineOptions(**opts))
        wrapped[name] = fns[name] = m
    row: Dict[str, Any] = {}
    times: Dict[str, List[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for name, fn in fns.items():  # warm-up: compile, observe, capture
            ms_per_forward(fn, inputs, 6)
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(ms_per_forward(fn, inputs, args.per_round))
        for name, fn in fns.items():
            row[name] = {"ms": round(statistics.median(times[name]), 4), **kernels(fn, inputs)}
    for name, m in wrapped.items():
        info = timm_dora.engine_info(m)
        row[name].update(graph=info["graph"], plan_misses=sum(s["plan_misses"] for s in info["batch_shapes"]))
        timm_dora.unwrap(m)
    oracles = [row[k]["ms"] for k in ("oracle_gemm_embed", "oracle_gemm_embed_graph") if k in row]
    for name in wrapped:
        if oracles:  # (the faster oracle's time over this executor's: images/s over the oracle's)
            row[name]["oracle_over_this"] = round(min(oracles) / row[name]["ms"], 3)
    del wrapped, fns
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vit-weights", required=True)
    ap.add_argument("--deit-weights", required=True)
    ap.add_argument("--data", required=True, help="labels CSV with a test split")
    ap.add_argument("--configs", nargs="+", default=["vit_tiny_published", "deit_tiny_published", "deit_base_forced"])
    ap.add_argument("--batches", type=int, nargs="+", default=[320])
    ap.add_argument("--executors", nargs="+", default=["oracle_gemm_embed", "oracle_gemm_embed_graph", "per_block",
                                                       "planned", "planned_aside", "default"],
                    help=f"of oracle_gemm_embed, oracle_gemm_embed_graph, {', '.join(VARIANTS)} and --options' names")
    ap.add_argument("--options", nargs="*", default=[], metavar="NAME=JSON",
                    help='more executors: the defaults with these EngineOptions fields, e.g. gelu=\'{"fused_gelu": true}\'')
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.variants = dict(VARIANTS)
    for spec in args.options:
        name, _, fields = spec.partition("=")
        args.variants[name] = json.loads(fields)
        EngineOptions(**args.variants[name])  # a field that does not exist fails here, before any GPU work
        args.executors.append(name)
    unknown = set(args.executors) - {"oracle_gemm_embed", "oracle_gemm_embed_graph", *args.variants}
    if unknown:
        ap.error(f"unknown executors {sorted(unknown)}")
    dev, dtype, _ = inference_device("cuda", "bf16")
    args.warmup, args.iters, args.repeats = 6, args.per_round, args.rounds
    res = header(dev, "planned_large", argv, args, rounds=args.rounds, per_round=args.per_round)
    for config in args.configs:
        for b in args.batches:
            if config == "deit_base_forced":
                model, actor, make = deit_forced(dev, dtype)
                inputs = make(b)
            else:
                model, actor = published(ap, config, args, dev, dtype)
                loader = loader_for(model, args.data, "test", batch=b, workers=4, limit=2 * b)
                inputs = [x.to(dev, dtype) for x, *_ in loader if x.shape[0] == b]
            res.setdefault(config, {})[str(b)] = row = measure(model, actor, inputs, args)
            print(config, b, {k: (v["ms"], v.get("oracle_over_this")) for k, v in row.items()}, flush=True)
            write_json(args.out, res)
            del model, inputs


if __name__ == "__main__":
    main()
