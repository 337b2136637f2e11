"""Where the ``cuda_graphs=True`` rows lose time against native timm and the static oracle (not a test).

Per backbone (random weights, bf16, batch 320, H100) and configuration, on the same GPU-resident
batches: the wall time of a forward (:func:`timm_dora.bench.time_forward`, median of repeats) and,
from ``torch.profiler`` over ``--profile-iters`` forwards, the GPU busy time (the union of kernel
and copy intervals), the idle time between busy stretches (and which kernels it falls between),
the kernels launched per forward and the kernels by name (time and count per
forward). Kernels inside CUDA graphs are traced individually, so a graph row and its reference
can be compared kernel by kernel. Configurations:

- ``native``, ``native_graph`` (the unwrapped model, eagerly / captured as one graph);
- ``noprune_graphs`` (wrapped, never prunes, from graphs: the cost of splitting the forward into
  per-block graphs), ``gate_off_graphs`` (an actor whose gate never opens);
- per ``--reductions`` target (``R@blocks`` as in ``throughput.py``): ``fixed``, ``fixed_graphs``
  (the fixed replay policy) and ``oracle_graphs`` (the same mean counts by slicing, one graph);
- ``actor_graphs`` / ``actor_replay_graphs``: an untrained actor forced open at the first target's
  blocks against a replay of its own decisions (the same deletions; no gate, no controller), both
  on the one batch the decisions were recorded on.

    python benchmarks/kernel_gaps.py --out benchmarks/results/kernel_gaps_h100.json
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import timm  # noqa: E402

import timm_dora  # noqa: E402
from helpers import recorded_plan  # noqa: E402
from throughput import (captured, fixed_plan, gate_forced_actor, gflops_of, oracle_forward, parse_reduction,  # noqa: E402
                        schedule_for_reduction, static_counts)
from timm_dora import Actor, ActorPolicy, ReplayPolicy, bench  # noqa: E402
from timm_dora.evaluate import environment, write_json  # noqa: E402
from timm_dora.flops import backbone_cost  # noqa: E402
from timm_dora.policy import NoPrune  # noqa: E402


def gpu_kernels(fn, x, iters: int, top: int, top_gaps: int = 12):
    """GPU busy time, kernels per forward, the ``top`` kernels by time, and the GPU's idle time
    between busy stretches, with the ``top_gaps`` (last kernel before, first kernel after) pairs
    that it falls between (the gap between forwards included; all per forward)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(x)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith("dora.")]  # (our record_function ranges, not kernels)
    kernels = [e for e in events if not any(w in e.name.lower() for w in ("memcpy", "memset"))]
    busy, gaps = busy_and_gaps((e.time_range.start, e.time_range.end, e.name) for e in events)
    by = {}
    for e in kernels:
        t, n = by.get(e.name, (0.0, 0))
        by[e.name] = (t + e.time_range.end - e.time_range.start, n + 1)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return {"busy_ms": busy / iters / 1000, "kernels_per_forward": len(kernels) / iters,
            "kernel_ms": sum(t for t, _ in by.values()) / iters / 1000,
            "top": [{"kernel": k, "ms": t / iters / 1000, "calls": n / iters} for k, (t, n) in ranked],
            "idle_ms": sum(g for g, _ in gaps.values()) / iters / 1000,
            "idle_top": [{"after": a, "before": b, "ms": g / iters / 1000, "count": n / iters}
                         for (a, b), (g, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top_gaps]]}


def busy_and_gaps(intervals):
    """``(start, end, name)`` intervals -> the length of their union and the gaps between its
    stretches, by (name of the interval ending a stretch, name of the one starting the next):
    ``{(before, after): (total gap, count)}``."""
    busy, start, end, last = 0.0, None, None, None
    gaps = {}
    for s, t, name in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                busy += end - start
                pair = (_short(last), _short(name))
                g, n = gaps.get(pair, (0.0, 0))
                gaps[pair] = (g + s - end, n + 1)
            start, end, last = s, t, name
        elif t >= end:
            end, last = t, name
    busy += 0 if end is None else end - start
    return busy, gaps


def _short(name: str) -> str:
    """A kernel's name without its template and argument lists (enough to tell them apart)."""
    return name.split("(")[0].split("<")[0].replace("void ", "")[:80]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "deit_base_patch16_224"])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--reductions", nargs="+", default=["0.38@3,6,9", "0.55@1,4,7"])
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = {**environment(dev, "python benchmarks/kernel_gaps.py " + " ".join(argv if argv is not None else sys.argv[1:])),
           "batch": args.batch, "rows": []}
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name).eval().to(dev, dtype)
        cost = backbone_cost(model)
        inputs = [torch.randn(args.batch, 3, *model.patch_embed.img_size, device=dev, dtype=dtype) for _ in range(6)]

        def row(config, fn, wrapped=None, batches=None, **extra):
            gc.collect()
            torch.cuda.synchronize()
            r = bench.time_forward(fn, batches or inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
            k = gpu_kernels(fn, inputs[0], args.profile_iters, args.top)
            if wrapped is not None:
                extra["gflops"] = float(wrapped.dora_stats.gflops.mean())
            res["rows"].append({"model": name, "config": config, "ms_per_batch": r["ms_per_batch"], **k, **extra})
            print(f"{name:24s} {config:24s} wall {r['ms_per_batch']:7.3f} ms  GPU busy {k['busy_ms']:7.3f} ms"
                  f"  idle {k['idle_ms']:6.3f} ms  {k['kernels_per_forward']:5.0f} kernels", flush=True)
            if wrapped is not None:
                timm_dora.unwrap(wrapped)

        row("native", model)
        row("native_graph", captured(model, inputs[0]))
        row("noprune_graphs", timm_dora.wrap(model, policy=NoPrune(), cuda_graphs=True), model)
        closed = Actor.for_model(model).to(dev, dtype)
        with torch.no_grad():
            closed.gate_mlp[2].bias.fill_(-1e4)
        row("gate_off_graphs", timm_dora.wrap(model, closed, cuda_graphs=True), model)
        for i, target in enumerate(args.reductions):
            red, blocks = parse_reduction(target, [3, 6, 9])
            mean_k = schedule_for_reduction(model, red, blocks)
            plan = fixed_plan(args.batch, cost.num_patches, blocks, mean_k, 16, 0, dev)
            tag = f"@{target}"
            row("fixed" + tag, timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False)), model)
            ks = static_counts(gflops_of(timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False)), plan, inputs), blocks)
            timm_dora.unwrap(model)
            row("fixed_graphs" + tag, timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=True), model)
            row("oracle_graphs" + tag, captured(oracle_forward(model, ks), inputs[0]), static_k=ks)
            if i == 0:
                forced = gate_forced_actor(model, blocks).to(dev, dtype)
                actor_plan = recorded_plan(model, ActorPolicy(forced), inputs[0])
                # both on the recorded batch only (the actor decides per batch)
                row("actor_graphs" + tag, timm_dora.wrap(model, forced, cuda_graphs=True), model, inputs[:1])
                row("actor_replay_graphs" + tag,
                    timm_dora.wrap(model, policy=ReplayPolicy(actor_plan, check=False), cuda_graphs=True), model, inputs[:1])
        del model, inputs
        torch.cuda.empty_cache()
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
