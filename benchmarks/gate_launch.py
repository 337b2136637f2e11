"""The actor's gate kernel at one to sixteen images (not a test): its launch parameters swept.

At batches 1-16 the gate (``policy.actor_kernels._gate``) runs as one program, at every block of
the whole forward's graph: 12 launches a request, each a serial chain of loads on one SM. Each
configuration (the key width's block, warps, software-pipelining stages) is captured in a CUDA graph
as ``--calls`` gate launches back to back and replayed; the time per launch is the median over
``--repeats`` replays (CUDA events). The configuration in effect (:data:`GATE_LAUNCH`, whose key
block is 64 below that width) is marked.

    python -m benchmarks.gate_launch --out benchmarks/results/gate_launch_h200.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.common import command_line, graph_call_us
from timm_dora.evaluate import environment
from timm_dora.policy import actor_kernels
from timm_dora.policy.actor import Actor


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768], help="key widths d (ViT-Ti, DeiT-B)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    res = {**environment(dev, command_line("gate_launch", argv)), "calls": args.calls, "repeats": args.repeats,
           "default": dict(actor_kernels.GATE_LAUNCH), "rows": []}
    saved = dict(actor_kernels.GATE_LAUNCH)
    torch.manual_seed(0)
    for d in args.widths:
        actor = Actor(d, 12, 196).to(dev, torch.bfloat16).eval()
        heads = d // 64
        for b in args.batches:
            keys = torch.randn(b, 197, 3, heads, 64, device=dev, dtype=torch.bfloat16)[:, 0, 1]  # [B, H, hd] views
            bias = torch.randn(b, actor.gate_hidden, device=dev, dtype=torch.bfloat16)
            n_visual = torch.full((b,), 196, device=dev)
            out = torch.empty(b, dtype=torch.bool, device=dev)
            ref = actor_kernels.fused_gate(actor, keys, bias, n_visual).clone()
            for k_block, warps, stages in itertools.product((64, 128, 256), (2, 4, 8), (1, 2, 3)):
                if k_block > d:
                    continue
                launch = dict(images=16, k_block=k_block, num_warps=warps, num_stages=stages)
                actor_kernels.GATE_LAUNCH.update(launch)
                try:
                    us = graph_call_us(lambda: actor_kernels.fused_gate(actor, keys, bias, n_visual, out=out),
                                       args.calls, args.repeats)
                    same = bool(torch.equal(out, ref))
                finally:
                    actor_kernels.GATE_LAUNCH.clear(), actor_kernels.GATE_LAUNCH.update(saved)
                in_effect = launch["k_block"] == (saved["k_block"] if d >= saved["k_block"] else 64) and all(
                    launch[k] == saved[k] for k in ("num_warps", "num_stages"))
                row = {"d": d, "batch": b, **launch, "us": round(us, 3), "same_gate": same, "in_effect": in_effect}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
