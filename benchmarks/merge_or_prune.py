"""What ToMe gains by merging, and what by choosing redundant tokens, on the pool images (ours; not a test).

ToMe and DORA's deletion differ in two things at once: which tokens go (ToMe: the ``A`` tokens most
similar to a ``B`` token) and what becomes of them (ToMe folds them into that token and lets it
attend with weight ``log(size)``). For each ``r`` this runs, paired against native on the same
images (fp32 on the CPU; the 1,000 ``sample1000`` images by default, never ``test``):

- ``merge``: ToMe as published (proportional attention), the tables' ToMe rows;
- ``merge_no_prop``: the same merge without proportional attention;
- ``prune``: the same matching, the matched tokens deleted (``ToMe(..., prune=True)``).

All three cost the same GFLOPs (the same matching, the same token counts).

    python -m benchmarks.merge_or_prune --model deit_tiny_patch16_224.fb_in1k --weights W.safetensors \\
        --data labels.csv --r 9 10 11 12 --out merge_or_prune_deit_tiny.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch

from timm_dora.evaluate import environment, load_model, loader_for
from timm_dora.evaluate.baselines import ToMe, tome_gflops
from benchmarks.common import POOL, command_line, paired  # (the pool and the paired row of the other pool studies)

MODES = {"merge": dict(prop_attn=True), "merge_no_prop": dict(prop_attn=False), "prune": dict(prune=True)}


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--data", required=True, help="labels CSV with the pool's splits")
    ap.add_argument("--splits", nargs="+", default=list(POOL))
    ap.add_argument("--r", nargs="+", type=int, required=True, help="ToMe's merges per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--img-size", type=int, default=None, help="(smoke tests: a small random backbone)")
    ap.add_argument("--num-classes", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if "test" in args.splits:
        raise ValueError("merge_or_prune: a development study, it never reads the test split")
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.weights, img_size=args.img_size, num_classes=args.num_classes).eval()
    xs: List[torch.Tensor] = []
    ys: List[torch.Tensor] = []
    for split in args.splits:
        for x, y, *_ in loader_for(model, args.data, split, batch=50, workers=args.workers):
            xs.append(x)
            ys.append(y)
    labels = torch.cat(ys)
    rows = []
    with torch.inference_mode():
        native = torch.cat([model(x).argmax(1) for x in xs])
        for r in args.r:
            gflops = round(tome_gflops(model, r).gflops, 4)
            for mode, kw in MODES.items():
                method = ToMe(model, r, **kw)
                pred = torch.cat([method(x).argmax(1) for x in xs])
                rows.append({"r": r, "mode": mode, **paired(pred, native, labels), "gflops": gflops})
                print(json.dumps(rows[-1]), flush=True)
    res = {**environment(torch.device("cpu"), command_line("merge_or_prune", argv)),
           "model": args.model, "splits": args.splits, "images": len(labels),
           "native_top1": round((native == labels).float().mean().item() * 100, 2), "rows": rows}
    Path(args.out).write_text(json.dumps(res, separators=(",", ":")))
    return res


if __name__ == "__main__":
    main()
