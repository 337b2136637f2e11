"""Launch settings of the engine's small dense kernels at the row counts of batches 1-16 (not a test).

Each variant runs ``--calls`` times back to back inside one CUDA graph (a small request is a chain of
such graph nodes); the time per call is the graph's replay time over the calls, the median of
``--repeats`` replays. Read: the residual sum with the LayerNorm (``dense_kernels._add_layer_norm_fwd``)
per rows-per-program and warps, beside ``torch.compile``'s kernel for ``layer_norm(x + d)`` (which
does not write the sum: a quarter fewer bytes).

    python -m benchmarks.small_kernels --out small_kernels.json
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton

from timm_dora.engine import dense_kernels as dk
from benchmarks.common import command_line, graph_call_us
from timm_dora.evaluate import environment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768])
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 320])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = {**environment(dev, command_line("small_kernels")), "add_layer_norm": []}
    for d in args.widths:
        w, b = torch.randn(d, device=dev, dtype=dtype), torch.randn(d, device=dev, dtype=dtype)
        block_n = triton.next_power_of_2(d)
        for n in args.images:
            rows = n * 197
            x, br = torch.randn(rows, d, device=dev, dtype=dtype), torch.randn(rows, d, device=dev, dtype=dtype)
            s, y = torch.empty_like(x), torch.empty_like(x)
            row = {"d": d, "images": n, "rows": rows, "in_effect": dk._ln_config(block_n)}
            compiled = torch.compile(lambda x, br: F.layer_norm(x + br, (d,), w, b, 1e-6), dynamic=False)
            row["inductor_us"] = round(graph_call_us(lambda: compiled(x, br), args.calls, args.repeats), 3)
            configs = {}
            for per in (1, 2, 4, 8, 16, 32):
                if per * block_n > 16384:
                    continue
                for warps in (1, 2, 4, 8):
                    def run(per=per, warps=warps):
                        dk._add_layer_norm_fwd[(triton.cdiv(rows, per),)](
                            x, br, s, w, b, y, rows, d, d, d, d, d, 1e-6, BLOCK_N=block_n, ROWS=per, num_warps=warps)
                    configs[f"{per}x{warps}"] = round(graph_call_us(run, args.calls, args.repeats), 3)
            row["triton_us"] = configs
            row["best"] = min(configs, key=configs.get)
            res["add_layer_norm"].append(row)
            print("add_layer_norm", d, n, row["inductor_us"], row["best"], configs[row["best"]],
                  "in effect", row["in_effect"], configs.get("%dx%d" % row["in_effect"]), flush=True)
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
