"""A trained actor's throughput against its own dense static oracle at equal GFLOPs (issue #8).

Real weights, the actor from ``--actor`` (e.g. ``timm_dora/hub/actors/<model>``), real images of ``--split``
(default ``rollout``: the test split is for reporting accuracy, and the speed does not need it);
the trained actor's decisions depend on real keys, so random inputs would not do. Rows (same
inputs, same run): native; the wrapped model eagerly and from CUDA graphs; the dense static oracle
at the actor's realized mean GFLOPs (its own FLOPs included, its removals spread over the blocks
as the actor's mean removals: ``benchmarks.common.matched_counts``), eagerly and as one CUDA graph.
Timing and memory fields as ``benchmarks.throughput`` (``benchmarks.common.measure_row``: warm-up,
median of repeats; peaks and the memory allocated when the row started).

    python -m benchmarks.trained_oracle --model vit_tiny_patch16_224.augreg_in21k_ft_in1k \\
        --weights W.safetensors --actor timm_dora/hub/actors/vit_tiny_patch16_224.augreg_in21k_ft_in1k \\
        --data labels.csv --out benchmarks/results/trained_oracle_h100_vit.json
"""
from __future__ import annotations

import argparse

import torch

import timm_dora
from timm_dora.evaluate.bench import bench_inputs
from timm_dora.evaluate import environment, inference_device, load_model, write_json
from timm_dora.engine.flops import backbone_cost
from benchmarks.common import captured, command_line, matched_counts, measure_row, oracle_forward, oracle_gflops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--actor", required=True, help="a published actor's folder (timm_dora/hub/actors/<model>) or Hub id")
    ap.add_argument("--data", required=True, help="labels CSV")
    ap.add_argument("--split", default="rollout")
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--run-ahead", choices=["on", "off"], default="on",
                    help="EngineOptions.run_ahead for the graph row")
    ap.add_argument("--device", default="cuda", help="cuda for real numbers; cpu only to smoke-test the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device(args.device)  # bf16 on CUDA (TF32 off), fp32 on the CPU
    model = load_model(args.model, args.weights).eval().to(dev, dtype)
    inputs, info = bench_inputs(model, batch=args.batch, batches=args.batches, device=dev, dtype=dtype,
                                data=args.data, split=args.split, workers=2)
    res = {**environment(dev, command_line("trained_oracle", argv)),
           "inputs": info, "protocol": {k: getattr(args, k) for k in ("warmup", "iters", "repeats")}, "rows": []}
    native_gflops = 2 * backbone_cost(model).native_macs() / 1e9

    def add(config, fn, gflops, **extra):
        r = measure_row(fn, inputs, args.warmup, args.iters, args.repeats)
        row = {"config": config, "gflops": gflops, **extra, **r}
        res["rows"].append(row)
        write_json(args.out, res)
        print(f"{config:24s} {gflops:7.3f} GFLOPs {r['images_per_s']:10.1f} img/s", flush=True)
        return row

    native = add("native", model, native_gflops)
    def decisions():
        """Mean removals per block and GFLOPs of the wrapped model's decisions on every batch."""
        per_batch = []
        with torch.inference_mode():
            for x in inputs:
                model(x)
                per_batch.append((model.dora_stats.removed.float(), model.dora_stats.gflops))
        return torch.cat([r for r, _ in per_batch]).mean(0), float(torch.cat([g for _, g in per_batch]).mean())

    wrapped = {}  # graphs: its row
    for graphs in (False, True):
        timm_dora.wrap(model, actor=args.actor, cuda_graphs=graphs,
                       options=timm_dora.EngineOptions(run_ahead=args.run_ahead == "on"))
        removed_l, gflops_l = decisions()
        if not graphs:  # the oracle is matched to the eager path's decisions
            removed, gflops = removed_l, gflops_l
        wrapped[graphs] = add("actor_graphs" if graphs else "actor", model, gflops_l,
                              removed_per_block=[round(float(v), 2) for v in removed_l])
        timm_dora.unwrap(model)
    ks = matched_counts(model, {l: float(v) for l, v in enumerate(removed) if v > 0}, gflops)
    fwd = oracle_forward(model, ks)
    oracle = add("oracle(actor)", fwd, oracle_gflops(model, ks), static_k=ks)
    if dev.type == "cuda":
        graph_oracle = add("oracle_graphs(actor)", captured(fwd, inputs[0]), oracle_gflops(model, ks), static_k=ks)
        actor_eager, actor_graphs = wrapped[False], wrapped[True]
        res["summary"] = {
            "gflops_reduction": 1 - gflops / native_gflops,
            "actor_of_oracle": actor_eager["images_per_s"] / oracle["images_per_s"],
            "actor_graphs_of_graph_oracle": actor_graphs["images_per_s"] / graph_oracle["images_per_s"],
            "actor_graphs_of_native": actor_graphs["images_per_s"] / native["images_per_s"],
        }
        print(res["summary"])
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
