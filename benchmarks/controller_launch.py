"""The actor's controller at the row counts of batches 1-16: launch settings against time (not a test).

One deletion's controller (:func:`timm_dora.policy.actor_kernels.fused_controller`, the paper's actor
with random weights, bf16) on ``--images`` images of ``--lengths`` rows each, for the key widths of
ViT-Ti and DeiT-B, in each variant of ``ROW_LAUNCH``'s ``k_block`` and ``num_stages`` (the encoder's
K loop over the key width). Each variant runs ``--calls`` times in one CUDA graph
(:func:`benchmarks.common.graph_call_us`); the same removals, budgets and FLOPs are checked
against the default's. Called back to back, the actor's weights stay in L2, where in a request
they come from memory (DeiT-B's `_embed_qkv` took 12.5-13.3 us a deletion in a request's trace);
``--cold-mb`` writes that many MB of a scratch buffer before each call (evicting L2) and reports
the time per call less the writes' own (timed alone the same way).

    python -m benchmarks.controller_launch --out controller_launch.json
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.common import command_line, graph_call_us
from timm_dora import Actor
from timm_dora.evaluate import environment
from timm_dora.policy.actor_kernels import ROW_LAUNCH, fused_controller


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768], help="key widths d")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[197, 130], help="rows of each image")
    ap.add_argument("--k-blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cold-mb", type=int, default=0, help="MB written before each call (0: warm L2)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = {**environment(dev, command_line("controller_launch")), "row_launch": dict(ROW_LAUNCH), "rows": [],
           "cold_mb": args.cold_mb}
    flush, flush_us = (lambda: None), 0.0
    if args.cold_mb:
        scratch = torch.empty(args.cold_mb << 20, dtype=torch.uint8, device=dev)
        flush = scratch.zero_
        flush_us = graph_call_us(flush, args.calls, args.repeats)
        res["flush_us"] = round(flush_us, 3)
    for d in args.widths:
        torch.manual_seed(0)
        actor = Actor(d, 12, 196).to(dev, dtype).eval()
        with torch.no_grad():
            for prm in actor.parameters():
                prm.add_(0.2 * torch.randn_like(prm))
        for b, n in itertools.product(args.images, args.lengths):
            lengths = torch.full((b,), n)
            cu = F.pad(lengths.cumsum(0), (1, 0)).to(dev, torch.int32)
            t = b * n
            keys = torch.randn(t, d, device=dev, dtype=dtype)
            n_visual = (lengths - 1).to(dev)
            h = torch.stack([n_visual / 196, torch.rand(b, device=dev), torch.zeros(b, device=dev)], 1)
            gate = torch.ones(b, dtype=torch.bool, device=dev)
            common = (actor, keys, cu, n, h, n_visual, gate, 4, cu, 1, t)
            with torch.inference_mode():
                ref = fused_controller(*common)
                row = {"d": d, "images": b, "rows": n, "us": {}}
                for k_block, stages in itertools.product(args.k_blocks, args.stages):
                    launch = {"k_block": k_block, "num_stages": stages}
                    name = f"k{k_block}/s{stages}"
                    try:
                        got = fused_controller(*common, launch=launch)
                        same = all(torch.equal(a, c) for a, c in zip(got, ref))
                        def call(launch=launch):
                            flush()
                            fused_controller(*common, launch=launch)
                        row["us"][name] = {"us": round(graph_call_us(call, args.calls, args.repeats) - flush_us, 3),
                                           "same": same}
                    except Exception as e:  # (a launch the GPU cannot run: say why)
                        row["us"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            timed = {k: v["us"] for k, v in row["us"].items() if "us" in v}
            row["best"] = min(timed, key=timed.get)
            row["default"] = f"k{ROW_LAUNCH['k_block']}/s{ROW_LAUNCH['num_stages']}"
            res["rows"].append(row)
            print(d, b, n, "best", row["best"], timed[row["best"]], "default", row["default"], timed.get(row["default"]),
                  flush=True)
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
