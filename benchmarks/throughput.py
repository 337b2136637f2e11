"""Throughput benchmark following the paper's App. E.5 protocol (not a test).

GPU-resident preprocessed inputs (random images: throughput does not depend on pixel or weight
values), bf16 weights and activations, batch 320, ``--batches`` distinct batches cycled, per repeat
200 warm-up and 200 timed forwards with a CUDA synchronisation right before and after the timed
loop, 5 repeats, median (:func:`timm_dora.evaluate.bench.time_forward`). Configurations per backbone:

- ``native``: the unwrapped timm model (its fused SDPA attention).
- ``gate_off``: wrapped with an actor whose gate never opens (the actor's gate runs every block).
- ``gate_off_spec``: the same with ``speculate=True`` (each block's MLP is enqueued before the
  host reads the gate, so the GPU queue does not drain at the read).
- ``gate_off_graphs``: the same with ``cuda_graphs=True`` (the whole forward stays dense: every
  segment replayed from CUDA graphs, the MLP enqueued before each gate read).
- ``fixed``: wrapped with a fixed replay policy with per-image variable budgets at fixed blocks
  (deletion, compaction, packing and varlen attention, no actor), one per ``--reductions`` target.
- ``fixed_graphs``: the same with ``cuda_graphs=True`` (graphs until the first deletion).
- ``actor``: wrapped with a random-weight actor whose gate is forced open at the same blocks as the
  fixed policy (all of DORA's inference work: gate, controller, selection, packing).
- ``actor_spec``: the same with ``speculate=True`` (the speculative MLP is wasted at the blocks
  where the gate opens; its FLOPs are not in the row's GFLOPs).
- ``actor_graphs``: the same with ``cuda_graphs=True``.
- ``oracle``: a dense run with a static schedule removing the fixed policy's mean count at the
  same blocks (``x[:, :n]`` slicing, zero selection or packing overhead): the ceiling at equal
  GFLOPs.
- ``oracle_graphs``: the same static schedule captured as one CUDA graph (CUDA only): no launch
  overhead at all, the ceiling for the ``*_graphs`` rows (the eager ``oracle`` is itself
  launch-bound on small backbones).
- ``actor_oracle`` / ``actor_oracle_graphs``: the same two at the actor rows' realized mean GFLOPs,
  the actor's own FLOPs included (its removals per block scaled until the GFLOPs match,
  :func:`benchmarks.common.matched_counts`): the ceiling for the ``actor*`` rows at equal GFLOPs.

Each row also records on CUDA ``peak_memory_mib``, the peak allocated memory over the whole row
(weights and the cycled input batches included, so rows of one backbone compare; graph rows'
captures included: a capture's warm-up runs outside the graphs' pool), ``steady_peak_memory_mib``,
the same after the first warm-up (every batch seen, every graph captured: what serving costs), and
``peak_reserved_mib``, the peak memory reserved by the allocator after the first warm-up (the
cache is emptied before each row; the graphs' pools count here). ``base_memory_mib`` is what was
allocated when the row started (the model, the inputs, and what earlier rows left: the first graph
capture of a process leaves cuBLAS's workspace for the capture stream, 33 MiB on the H100, in
every later row), and ``peak_over_base_mib`` / ``steady_peak_over_base_mib`` the two peaks above
it: what the row's own forwards add (the actor's weights, allocated before the row, not included).

Usage (prints a table; writes JSON with device, versions and the command):

    python -m benchmarks.throughput --models deit_base_patch16_224 vit_tiny_patch16_224 \
        --out benchmarks/results/throughput_h100.json
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import timm
import torch

import timm_dora
from timm_dora import Actor, ActorPolicy, ReplayPolicy
from timm_dora.evaluate import environment, write_json
from timm_dora.engine.flops import backbone_cost
from benchmarks.common import (apply, captured, command_line, fixed_plan, gate_forced_actor, graph_variants,
                               matched_counts, measure_row, oracle_forward, oracle_gflops, schedule_for_reduction)


def parse_reduction(target: str, default_blocks: List[int]):
    """``"0.55@1,4,7"`` -> ``(0.55, [1, 4, 7])``; ``"0.38"`` -> ``(0.38, default_blocks)``."""
    red, _, blocks = str(target).partition("@")
    try:
        value = float(red)
        chosen = [int(b) for b in blocks.split(",")] if blocks else list(default_blocks)
    except ValueError:
        raise SystemExit(f"--reductions: {target!r} is not R or R@b,b,... (e.g. 0.55@1,4,7)") from None
    if not 0 < value < 1:
        raise SystemExit(f"--reductions: {target!r}: the reduction must be in (0, 1)")
    return value, chosen


def static_counts(stats, blocks: List[int]) -> Dict[int, int]:
    """The oracle's removal count per block: the fixed policy's mean count there, rounded."""
    per_block = stats.removed.float().mean(0)
    return {l: int(round(float(per_block[l]))) for l in blocks}


def gflops_of(model, plan, inputs):
    timm_dora.set_policy(model, ReplayPolicy(plan, check=False))
    with torch.inference_mode():
        model(inputs[0])
    return model.dora_stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["deit_base_patch16_224", "vit_tiny_patch16_224"])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reductions", nargs="+", default=["0.38", "0.55@1,4,7"],
                    help="GFLOPs reduction targets, each optionally with its own pruning blocks "
                         "(R@b,b,b; default --blocks): at blocks 3, 6, 9 at most ~46 %% is reachable")
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--spread", type=int, default=16, help="per-image budget spread around the mean")
    ap.add_argument("--configs", nargs="+",
                    default=["native", "gate_off", "gate_off_spec", "gate_off_graphs", "fixed", "fixed_graphs",
                             "actor", "actor_spec", "actor_graphs", "oracle", "oracle_graphs",
                             "actor_oracle", "actor_oracle_graphs"])
    ap.add_argument("--attn-backends", nargs="+", default=["auto"],
                    help="the wrapped rows once per attention backend (a config gets the suffix [backend] "
                         "when more than one is given: an A/B in one run)")
    ap.add_argument("--controllers", nargs="+", default=["auto"], choices=["auto", "modules"],
                    help="the actor rows once per controller: auto (the fused Triton kernels where the triton "
                         "backend runs) and/or modules (fused_controller=False); suffix [c] when more than one")
    ap.add_argument("--fused-interventions", choices=["on", "off"], default="on",
                    help="EngineOptions.fused_interventions for the *_graphs rows (the actor's controller in "
                         "its block's attention graph)")
    ap.add_argument("--run-ahead", nargs="+", choices=["on", "off"], default=["on"],
                    help="EngineOptions.run_ahead for the gate-off and actor *_graphs rows (the dense "
                         "blocks before the first open gate as one graph); both: an A/B in "
                         "one run, suffix [run_ahead=...]")
    ap.add_argument("--mlp-chunks", nargs="+", type=int, default=[1],
                    help="EngineOptions.mlp_chunks for the *_graphs rows (each graph's MLP in this many row "
                         "chunks: a smaller memory pool); several: an A/B in one run, suffix [mlp_chunks=...]")
    ap.add_argument("--reserve-pool", nargs="+", choices=["on", "off"], default=["on"],
                    help="EngineOptions.reserve_pool for the *_graphs rows (one segment of the graphs' memory "
                         "pool reserved before the first capture); both: suffix [reserve_pool=...]")
    ap.add_argument("--img-size", type=int, default=None, help="override the model's input size (smoke tests)")
    ap.add_argument("--device", default="cuda", help="cuda for real numbers; cpu only to smoke-test the script")
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args(argv)
    try:
        return _measure(args, argv)
    finally:  # (a caller in the same process measures with the defaults again)
        apply({})


def _measure(args, argv) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {
        **environment(dev, command_line("throughput", argv)),
        "protocol": {k: getattr(args, k) for k in ("batch", "batches", "warmup", "iters", "repeats")},
        "dtype": str(dtype).replace("torch.", ""),
        "rows": [],
    }
    for name in args.models:
        torch.manual_seed(0)
        kw = {} if args.img_size is None else {"img_size": args.img_size}
        model = timm.create_model(name, pretrained=False, **kw).eval().to(dev, dtype)
        cost = backbone_cost(model)
        native_gflops = 2 * cost.native_macs() / 1e9
        inputs = [torch.randn(args.batch, 3, *model.patch_embed.img_size, device=dev, dtype=dtype) for _ in range(args.batches)]
        rows = results["rows"]  # written out after every row (a run cut short keeps what it measured)

        def failed(config, e):
            """Record a failing configuration (the others' numbers must not be lost)."""
            rows.append({"model": name, "config": config, "error": f"{type(e).__name__}: {e}"})
            write_json(args.out, results)
            print(f"{name:28s} {config:22s} FAILED: {type(e).__name__}: {e}", flush=True)

        def add(config, fn, gflops, **extra):
            try:
                r = measure_row(fn, inputs, args.warmup, args.iters, args.repeats)
            except Exception as e:
                failed(config, e)
                return
            row = {"model": name, "config": config, "gflops": gflops, **extra, **r}
            rows.append(row)
            write_json(args.out, results)
            print(f"{name:28s} {config:22s} {gflops:8.3f} GFLOPs {r['images_per_s']:10.1f} img/s {r['ms_per_batch']:8.3f} ms/batch", flush=True)

        def first_forward(wrapped, config):
            """One forward for the row's statistics; a failure is recorded (and the model unwrapped)."""
            try:
                with torch.inference_mode():
                    wrapped(inputs[0])
                return True
            except Exception as e:
                failed(config, e)
                timm_dora.unwrap(wrapped)
                return False

        if "native" in args.configs:
            add("native", model, native_gflops)
        actor = Actor.for_model(model).to(dev, dtype)
        with torch.no_grad():
            actor.gate_mlp[2].bias.fill_(-1e4)
        for ab in args.attn_backends:
            sfx = "" if len(args.attn_backends) == 1 else f"[{ab}]"
            for config, speculate, graphs in (("gate_off", False, False), ("gate_off_spec", True, False),
                                              ("gate_off_graphs", False, True)):
                if config not in args.configs:
                    continue
                for vsfx, settings in graph_variants(args, graphs):
                    apply(settings)
                    row_name = config + sfx + vsfx
                    timm_dora.wrap(model, actor, speculate=speculate, cuda_graphs=graphs, attn_backend=ab)
                    if not first_forward(model, row_name):
                        continue
                    add(row_name, model, float(model.dora_stats.gflops.mean()), backend=model.dora_stats.backend)
                    timm_dora.unwrap(model)
        for target in args.reductions:
            red, blocks = parse_reduction(target, args.blocks)
            mean_k = schedule_for_reduction(model, red, blocks)
            plan = fixed_plan(args.batch, cost.num_patches, blocks, mean_k, args.spread, 0, dev)
            timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=False)
            stats = gflops_of(model, plan, inputs)
            g = float(stats.gflops.mean())
            tag = f"@{int(round(100 * (1 - g / native_gflops)))}%"
            timm_dora.unwrap(model)
            forced = gate_forced_actor(model, blocks).to(dev, dtype)  # one actor: equal decisions
            actor_stats = None  # the forced actor's statistics (equal in all its rows): its oracle's input
            for ab in args.attn_backends:
                sfx = "" if len(args.attn_backends) == 1 else f"[{ab}]"
                if "fixed" in args.configs:
                    timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), attn_backend=ab, cuda_graphs=False)
                    if first_forward(model, "fixed" + tag + sfx):
                        add("fixed" + tag + sfx, model, g, backend=model.dora_stats.backend, blocks=blocks,
                            mean_k=mean_k, tokens_range=[int(stats.tokens[:, -1].min()), int(stats.tokens[:, -1].max())])
                        timm_dora.unwrap(model)
                for vsfx, settings in graph_variants(args, True, run_ahead=False) if "fixed_graphs" in args.configs else []:
                    apply(settings)
                    row_name = "fixed_graphs" + tag + sfx + vsfx
                    timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=True, attn_backend=ab)
                    if first_forward(model, row_name):
                        add(row_name, model, g, backend=model.dora_stats.backend, blocks=blocks, mean_k=mean_k)
                        timm_dora.unwrap(model)
                for config, speculate, graphs in (("actor", False, False), ("actor_spec", True, False),
                                                  ("actor_graphs", False, True)):
                    if config not in args.configs:
                        continue
                    for ctl, (vsfx, settings) in [(c, v) for c in args.controllers for v in graph_variants(args, graphs)]:
                        csfx = sfx + ("" if len(args.controllers) == 1 else f"[{ctl}]") + vsfx
                        apply(settings)
                        policy = ActorPolicy(forced, speculate=speculate, fused_controller=None if ctl == "auto" else False)
                        timm_dora.wrap(model, policy=policy, cuda_graphs=graphs, attn_backend=ab)
                        if not first_forward(model, config + tag + csfx):
                            continue
                        s = actor_stats = model.dora_stats
                        add(config + "(random)" + tag + csfx, model, float(s.gflops.mean()), backend=s.backend,
                            gate_rate=s.gate.float().mean(0).tolist(), policy_gflops=float(s.policy_gflops.mean()))
                        timm_dora.unwrap(model)
            ks = static_counts(stats, blocks)
            fwd = oracle_forward(model, ks)
            if "oracle" in args.configs:
                add("oracle" + tag, fwd, oracle_gflops(model, ks), static_k=ks)
            if "oracle_graphs" in args.configs and dev.type == "cuda":
                add("oracle_graphs" + tag, captured(fwd, inputs[0]), oracle_gflops(model, ks), static_k=ks)
            if {"actor_oracle", "actor_oracle_graphs"} & set(args.configs) and actor_stats is None:
                failed("oracle(actor)" + tag, RuntimeError("needs an actor row (actor, actor_spec or actor_graphs)"))
            elif {"actor_oracle", "actor_oracle_graphs"} & set(args.configs):
                # the dense oracle at the actor's realized GFLOPs (its own FLOPs included), its
                # removals spread over the blocks like the actor's
                removed = actor_stats.removed.float().mean(0)
                ks = matched_counts(model, {l: float(removed[l]) for l in blocks}, float(actor_stats.gflops.mean()))
                fwd = oracle_forward(model, ks)
                if "actor_oracle" in args.configs:
                    add("oracle(actor)" + tag, fwd, oracle_gflops(model, ks), static_k=ks)
                if "actor_oracle_graphs" in args.configs and dev.type == "cuda":
                    add("oracle_graphs(actor)" + tag, captured(fwd, inputs[0]), oracle_gflops(model, ks), static_k=ks)
        model = inputs = None  # freed before the next backbone
        torch.cuda.empty_cache()
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
