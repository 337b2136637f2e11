"""A/B of change 25 (benchmarks/NOTES.md) in one run: the fixed policy and NoPrune from CUDA graphs
with chains of skipped blocks (``prunes_nothing_at``) and without (the per-block path), alternated
twice per case. H100, bf16, batch 320, random weights and inputs (not a test; ``--device cpu``
only smoke-tests the script: the graph path then runs uncaptured).

    python benchmarks/chain_ab.py --out benchmarks/results/chain_ab_h100.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import timm  # noqa: E402

import timm_dora  # noqa: E402
from throughput import fixed_plan, schedule_for_reduction  # noqa: E402
from timm_dora import NoPrune, ReplayPolicy, bench  # noqa: E402
from timm_dora.evaluate import environment, write_json  # noqa: E402
from timm_dora.flops import backbone_cost  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "deit_base_patch16_224"])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--img-size", type=int, default=None, help="override the model's input size (smoke tests)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    res = []
    for name in args.models:
        torch.manual_seed(0)
        kw = {} if args.img_size is None else {"img_size": args.img_size}
        model = timm.create_model(name, **kw).eval().to(dev, dt)
        cost = backbone_cost(model)
        size = model.patch_embed.img_size
        inputs = [torch.randn(args.batch, 3, *size, device=dev, dtype=dt) for _ in range(args.batches)]
        cases = []
        for red, blocks in ((0.38, [3, 6, 9]), (0.55, [1, 4, 7])):
            mk = schedule_for_reduction(model, red, blocks)
            cases.append((f"fixed@{red}", fixed_plan(args.batch, cost.num_patches, blocks, mk, 16, 0, dev)))
        cases.append(("noprune", None))
        for case, plan in cases:
            for rep in range(2):
                for chain in (True, False):
                    pol = NoPrune() if plan is None else ReplayPolicy(plan, check=False)
                    if not chain:
                        pol.prunes_nothing_at = None  # the per-block path (before change 25)
                    timm_dora.wrap(model, policy=pol, cuda_graphs=True)
                    with torch.inference_mode():
                        model(inputs[0])
                    r = bench.time_forward(model, inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
                    row = dict(model=name, case=case, chain=chain, rep=rep, ms_per_batch=r["ms_per_batch"],
                               gflops=float(model.dora_stats.gflops.mean()))
                    print(row, flush=True)
                    res.append(row)
                    timm_dora.unwrap(model)
        del model, inputs
    result = {**environment(dev), "rows": res}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
