"""Where a configuration's GPU memory goes (a diagnostic, CUDA only), in three states:

- ``captured``: after the first forward (every graph captured), before anything is freed;
- ``warm``: after ``--warmup`` more forwards;
- ``steady``: the allocator's cache emptied once after the warm-up (what a server that calls
  ``torch.cuda.empty_cache()`` after warming up keeps), then ``--iters`` forwards: their peaks.

For each state: allocated and reserved memory above ``base`` (allocated before the configuration:
model and input batches), split by memory pool (the default pool, the graph runners' private
pools), and for graph rows what :func:`timm_dora.engine_info` reports: the runners' fixed buffers
(``runner_buffers_mib``: what they allocated outside their pools), ``graphs`` and ``graph_memory_mib``
(buffers and pools). Native timm is the reference. Writes JSON with device, versions and the command.

    python -m benchmarks.memory_breakdown --models vit_tiny_patch16_224 deit_base_patch16_224 \
        --out benchmarks/results/memory_breakdown_h100.json
"""
from __future__ import annotations

import argparse
import collections
import gc

import timm
import torch

import timm_dora
from timm_dora import Actor, ActorPolicy, ReplayPolicy
from timm_dora.evaluate import environment, write_json
from timm_dora.engine.flops import backbone_cost
from benchmarks.common import (apply, command_line, fixed_plan, gate_forced_actor, graph_variants,
                               schedule_for_reduction)

MIB = 2 ** 20


def pools() -> dict:
    """Reserved and allocated bytes per memory pool, and the largest active blocks of private pools."""
    out = collections.defaultdict(lambda: {"segments": 0, "reserved_mib": 0.0, "allocated_mib": 0.0, "segment_mib": [],
                                           "largest_active_mib": []})
    for seg in torch.cuda.memory_snapshot():
        pid = seg.get("segment_pool_id", (0, 0))
        name = "default" if tuple(pid) == (0, 0) else f"pool{tuple(pid)}"
        p = out[name]
        p["segments"] += 1
        p["reserved_mib"] += seg["total_size"] / MIB
        p["allocated_mib"] += seg["allocated_size"] / MIB
        p["segment_mib"].append(seg["total_size"] / MIB)
        if name != "default":
            p["largest_active_mib"] += [b["size"] / MIB for b in seg["blocks"] if b["state"] == "active_allocated"]
    for p in out.values():
        p["segment_mib"] = sorted(p["segment_mib"], reverse=True)
        p["largest_active_mib"] = sorted(p["largest_active_mib"], reverse=True)[:8]
    return dict(out)


def state(base: int) -> dict:
    torch.cuda.synchronize()
    return {"allocated_over_base_mib": (torch.cuda.memory_allocated() - base) / MIB,
            "reserved_over_base_mib": (torch.cuda.memory_reserved() - base) / MIB, "pools": pools()}


def measure(fn, inputs, warmup: int, iters: int, model=None) -> dict:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    r = {"base_mib": base / MIB}
    with torch.inference_mode():
        torch.cuda.reset_peak_memory_stats()
        fn(inputs[0])
        r["captured"] = state(base)
        r["captured"]["peak_allocated_over_base_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        r["captured"]["peak_reserved_over_base_mib"] = (torch.cuda.max_memory_reserved() - base) / MIB
        for i in range(warmup):
            fn(inputs[i % len(inputs)])
        r["warm"] = state(base)
        torch.cuda.empty_cache()
        r["after_empty_cache"] = state(base)
        torch.cuda.reset_peak_memory_stats()
        for i in range(iters):
            fn(inputs[i % len(inputs)])
        torch.cuda.synchronize()
        r["steady"] = {"peak_allocated_over_base_mib": (torch.cuda.max_memory_allocated() - base) / MIB,
                       "peak_reserved_over_base_mib": (torch.cuda.max_memory_reserved() - base) / MIB}
    if model is not None:  # what the engine reports of its graphs (timm_dora.engine_info)
        info = timm_dora.engine_info(model)
        r["runner_buffers_mib"] = sum(s["buffers_mb"] for s in info["batch_shapes"])
        r["graphs"], r["graph_memory_mib"] = info["graphs"], info["memory_mb"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "deit_base_patch16_224"])
    ap.add_argument("--configs", nargs="+", default=["native", "gate_off_graphs", "fixed_graphs", "actor_graphs"])
    ap.add_argument("--reduction", type=float, default=0.38)
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--mlp-chunks", type=int, nargs="+", default=[1], help="EngineOptions.mlp_chunks for the graph rows (each: its own row)")
    ap.add_argument("--reserve-pool", nargs="+", choices=["on", "off"], default=["on"],
                    help="EngineOptions.reserve_pool for the graph rows (each: its own row)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        return _measure(args, argv)
    finally:
        apply({})


def _measure(args, argv):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {**environment(dev, command_line("memory_breakdown", argv)),
               "dtype": "bfloat16", "batch": args.batch, "rows": []}
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).eval().to(dev, dtype)
        inputs = [torch.randn(args.batch, 3, *model.patch_embed.img_size, device=dev, dtype=dtype) for _ in range(2)]
        cost = backbone_cost(model)
        args.run_ahead = ["on"]
        for config, (sfx, settings) in [(c, v) for c in args.configs for v in graph_variants(args, c != "native")]:
            apply(settings)
            if config == "native":
                fn, wrapped = model, None
            elif config == "gate_off_graphs":
                actor = Actor.for_model(model).to(dev, dtype)
                with torch.no_grad():
                    actor.gate_mlp[2].bias.fill_(-1e4)
                fn = wrapped = timm_dora.wrap(model, actor, cuda_graphs=True)
            elif config == "fixed_graphs":
                mean_k = schedule_for_reduction(model, args.reduction, args.blocks)
                plan = fixed_plan(args.batch, cost.num_patches, args.blocks, mean_k, 8, 0, dev)
                fn = wrapped = timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=True)
            elif config == "actor_graphs":
                forced = gate_forced_actor(model, args.blocks).to(dev, dtype)
                fn = wrapped = timm_dora.wrap(model, policy=ActorPolicy(forced), cuda_graphs=True)
            else:
                raise SystemExit(f"unknown config {config!r}")
            r = measure(fn, inputs, args.warmup, args.iters, wrapped)
            row = {"model": name, "config": config + sfx, "settings": settings, **r}
            results["rows"].append(row)
            print(f"{name:24s} {config + sfx:40s} base {r['base_mib']:7.0f}  captured peak res +{r['captured']['peak_reserved_over_base_mib']:6.0f}"
                  f"  warm res +{r['warm']['reserved_over_base_mib']:6.0f}  after empty +{r['after_empty_cache']['reserved_over_base_mib']:6.0f}"
                  f" (alloc +{r['after_empty_cache']['allocated_over_base_mib']:6.0f})"
                  f"  steady peak res +{r['steady']['peak_reserved_over_base_mib']:6.0f} alloc +{r['steady']['peak_allocated_over_base_mib']:6.0f}"
                  f"  buffers {r.get('runner_buffers_mib', 0):6.0f}", flush=True)
            for pname, p in r["after_empty_cache"]["pools"].items():
                print(f"      {pname:22s} {p['segments']:4d} segs  reserved {p['reserved_mib']:8.1f}  allocated {p['allocated_mib']:8.1f}"
                      f"  segments {[round(v) for v in p['segment_mib'][:8]]}", flush=True)
            if wrapped is not None:
                timm_dora.unwrap(wrapped)
            del fn, wrapped
            if args.out:
                write_json(args.out, results)
        del model, inputs
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
