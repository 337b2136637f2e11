"""Where the wrapped forward's time goes (torch profiler), and how often it synchronises.

For each backbone (random weights, bf16, batch 320 on CUDA) and configuration (``gate_off``: the
actor's gate never opens; ``fixed``: the replay policy of ``benchmarks.throughput`` at about 37 %
fewer GFLOPs; ``actor``: an untrained actor whose gate is forced open at the same blocks), reports:

- ``ms_per_forward``: median wall time of a forward (CUDA events), next to native timm;
- ``device_ms``: per forward, the span on the GPU timeline of each ``dora.*`` scope of
  :func:`timm_dora.engine.patch.run` (attention, policy = actor + selection, compact = deletion and
  repacking, mlp, readout), from ``torch.profiler`` over ``--iters`` forwards. It is the span from
  the scope's first kernel to its last, so it includes the GPU's idle gaps while the host catches
  up: a launch-bound or synchronising scope shows up with its real cost;
- ``overhead_share``: policy + compact spans over the forward's wall time;
- ``syncs_per_forward``: host-device synchronisations counted by ``torch.cuda.set_sync_debug_mode``;
- ``*_graphs`` rows (``cuda_graphs=True``, where the profiler sees no scopes): ``actor_share``,
  one minus the time of a replay of the actor's own decisions (same deletions, packing and
  GFLOPs; no gate, no controller) over the actor's forward, both from graphs on the same batch
  (``--graphs-only``: these rows alone).

    python -m benchmarks.profile_forward --out benchmarks/results/profile_h100.json
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import timm
import torch

import timm_dora
from timm_dora import Actor, ActorPolicy, ReplayPolicy
from timm_dora.evaluate import environment, write_json
from timm_dora.engine.flops import backbone_cost
from benchmarks.common import command_line, fixed_plan, gate_forced_actor, recorded_plan, schedule_for_reduction

SCOPES = ("dora.attention", "dora.policy", "dora.compact", "dora.mlp", "dora.readout")


def wall_ms(fn, x, iters):
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def count_syncs(fn, x):
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def scope_times(fn, x, iters):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(x)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.key in SCOPES:
            dev_us = getattr(ev, "device_time_total", None)
            if dev_us is None:
                dev_us = ev.cuda_time_total
            out[ev.key] = {"device_ms": dev_us / 1000 / iters}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["deit_base_patch16_224", "vit_tiny_patch16_224"])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--reduction", type=float, default=0.38)
    ap.add_argument("--graphs-only", action="store_true",
                    help="only the cuda_graphs=True rows (actor share against a replay), no eager profile")
    ap.add_argument("--graph-configs", nargs="+", default=["gate_off", "actor", "actor_modules"],
                    choices=["gate_off", "actor", "actor_modules"], help="which cuda_graphs=True rows")
    ap.add_argument("--fused-interventions", choices=["on", "off"], default="on",
                    help="EngineOptions.fused_interventions: the controller in the attention's graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from timm_dora import EngineOptions
    from timm_dora.engine.options import using

    with using(EngineOptions(fused_interventions=args.fused_interventions == "on")):  # (every model wrapped here)
        return _profile(args)


def _profile(args):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = {**environment(dev, command_line("profile_forward")),
           "batch": args.batch, "rows": []}
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name).eval().to(dev, dtype)
        x = torch.randn(args.batch, 3, *model.patch_embed.img_size, device=dev, dtype=dtype)
        cost = backbone_cost(model)
        mean_k = schedule_for_reduction(model, args.reduction, args.blocks)
        closed = Actor.for_model(model)
        with torch.no_grad():
            closed.gate_mlp[2].bias.fill_(-1e4)
        configs = {
            "gate_off": dict(actor=closed.to(dev, dtype)),
            "fixed": dict(policy=ReplayPolicy(fixed_plan(args.batch, cost.num_patches, args.blocks, mean_k, 16, 0, dev), check=False)),
            "actor": dict(actor=gate_forced_actor(model, args.blocks).to(dev, dtype)),
        }
        with torch.inference_mode():
            for _ in range(args.warmup):
                model(x)
            native_ms = wall_ms(model, x, args.iters)
            for cfg, kw in ({} if args.graphs_only else configs).items():
                timm_dora.wrap(model, cuda_graphs=False, **kw)
                for _ in range(args.warmup):
                    model(x)
                ms = wall_ms(model, x, args.iters)
                scopes = scope_times(model, x, args.iters)
                syncs = count_syncs(model, x)
                s = model.dora_stats
                over = sum(scopes.get(k, {}).get("device_ms", 0.0) for k in ("dora.policy", "dora.compact"))
                row = {"model": name, "config": cfg, "native_ms": native_ms, "ms_per_forward": ms,
                       "gflops": float(s.gflops.mean()), "scopes": scopes, "overhead_device_ms": over,
                       "overhead_share": over / ms, "syncs_per_forward": syncs}
                res["rows"].append(row)
                print(f"{name:24s} {cfg:9s} {ms:7.2f} ms (native {native_ms:6.2f}) syncs {syncs:3d} "
                      + " ".join(f"{k[5:]}={v['device_ms']:.2f}" for k, v in scopes.items())
                      + f"  overhead {100 * over / ms:.1f} %", flush=True)
                timm_dora.unwrap(model)
            res["rows"] += actor_share_graphs(model, name, configs, x, args.warmup, args.iters, args.graph_configs)
        del model
        torch.cuda.empty_cache()
    write_json(args.out, res)


def actor_share_graphs(model, name, configs, x, warmup, iters, which=("gate_off", "actor", "actor_modules")):
    """The actor's share of the ``cuda_graphs=True`` forward (no profiler scopes inside graphs):
    the actor's forward against a replay of the same decisions (the same deletion, packing and
    GFLOPs, no gate or controller), both from graphs, on the same batch."""
    rows = []
    # the actor's controller fused (the default on the triton backend) and as nn modules
    for cfg, fused in (("gate_off", None), ("actor", None), ("actor_modules", False)):
        if cfg not in which:
            continue
        actor = configs[cfg.split("_modules")[0]]["actor"]
        plan = recorded_plan(model, ActorPolicy(actor), x)
        ms = {}
        policy = ActorPolicy(actor, fused_controller=fused)
        for tag, kw in (("actor", dict(policy=policy)), ("replay", dict(policy=ReplayPolicy(plan, check=False)))):
            timm_dora.wrap(model, cuda_graphs=True, **kw)
            for _ in range(warmup):
                model(x)
            ms[tag] = wall_ms(model, x, iters)
            ms[tag + "_gflops"] = float(model.dora_stats.gflops.mean())
            timm_dora.unwrap(model)
        share = 1 - ms["replay"] / ms["actor"]
        rows.append({"model": name, "config": cfg + "_graphs", "ms_per_forward": ms["actor"],
                     "replay_ms": ms["replay"], "gflops": ms["actor_gflops"], "replay_gflops": ms["replay_gflops"],
                     "actor_share": share})
        print(f"{name:24s} {cfg + '_graphs':15s} {ms['actor']:7.2f} ms, its decisions replayed {ms['replay']:7.2f} ms:"
              f" actor {100 * share:.1f} % of the forward", flush=True)
    return rows


if __name__ == "__main__":
    main()
