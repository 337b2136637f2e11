"""A/B of change 25 (benchmarks/NOTES.md) in one run: the fixed policy and NoPrune from CUDA graphs
with chains of skipped blocks (``prunes_nothing_at``) and without (the per-block path), alternated
twice per case. H100, bf16, batch 320, random weights and inputs.

    python benchmarks/chain_ab.py --out benchmarks/results/chain_ab_h100.json
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import timm, timm_dora
from timm_dora import ReplayPolicy, NoPrune, bench
from throughput import fixed_plan, schedule_for_reduction
from timm_dora.flops import backbone_cost
from timm_dora.evaluate import environment, write_json
out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
dev, dt = torch.device("cuda"), torch.bfloat16
res = []
for name in ("vit_tiny_patch16_224", "deit_base_patch16_224"):
    torch.manual_seed(0)
    model = timm.create_model(name).eval().to(dev, dt)
    cost = backbone_cost(model)
    inputs = [torch.randn(320, 3, 224, 224, device=dev, dtype=dt) for _ in range(25)]
    cases = []
    for red, blocks in ((0.38, [3, 6, 9]), (0.55, [1, 4, 7])):
        mk = schedule_for_reduction(model, red, blocks)
        cases.append((f"fixed@{red}", fixed_plan(320, cost.num_patches, blocks, mk, 16, 0, dev)))
    cases.append(("noprune", None))
    for case, plan in cases:
        for rep in range(2):
            for chain in (True, False):
                pol = NoPrune() if plan is None else ReplayPolicy(plan, check=False)
                if not chain:
                    pol.prunes_nothing_at = None  # the per-block path (before change 25)
                timm_dora.wrap(model, policy=pol, cuda_graphs=True)
                with torch.inference_mode(): model(inputs[0])
                r = bench.time_forward(model, inputs, warmup=50, iters=50, repeats=3)
                row = dict(model=name, case=case, chain=chain, rep=rep, ms_per_batch=r["ms_per_batch"])
                print(row, flush=True); res.append(row)
                timm_dora.unwrap(model)
    del model, inputs; torch.cuda.empty_cache()
write_json(out, {**environment(dev), "rows": res})
