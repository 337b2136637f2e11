"""ViT-Ti at batch 320: DORA's default forward against the compiled slicing oracle (not a test).

In one process on one GPU (bf16, two batches of ``test`` images, the published actor): both timed
interleaved (``--rounds`` rounds of 25 x 2 forwards each, alternating, after a warm-up; median
ms per batch), then the CUDA kernels of 5 x 2 forwards of each under the torch profiler, per
kernel name: GPU time and calls per batch. Writes ``vit_interleaved.json`` (the oracle's per-block
removal, every round, the medians) and ``vit_<name>.txt`` (the kernel table, headed by the total
kernel time and the kernel count per batch) into ``--out``. What it showed is in
``docs/performance.md``.

    python -m benchmarks.kernel_profile --vit-weights W.safetensors --data labels.csv --out <dir>
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import timm_dora
from timm_dora.evaluate import loader_for
from benchmarks.common import command_line, ms_per_batch, oracle_forward, vit_published


def kernel_table(fn, xs, path: Path) -> float:
    """The kernel table of 5 x len(xs) forwards of ``fn`` into ``path``; returns the kernel ms per batch."""
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            for x in xs:
                fn(x)
        torch.cuda.synchronize()
    n = 5 * len(xs)
    rows = {e.key[:90]: (e.self_device_time_total / n / 1e3, e.count / n)
            for e in p.key_averages() if "CUDA" in str(e.device_type)}
    total = sum(v[0] for v in rows.values())
    with open(path, "w") as f:
        f.write(f"{path.stem}: kernels {total:.3f} ms/batch, {sum(v[1] for v in rows.values()):.0f} kernels/batch\n")
        for k, (ms, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:45]:
            f.write(f"{ms:8.4f} ms {c:6.1f}x {k}\n")
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vit-weights", required=True)
    ap.add_argument("--data", required=True, help="labels CSV with a test split")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", required=True, help="a folder")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    model, actor = vit_published(args, dev, dtype)
    xs = [x.to(dev, dtype) for x, *_ in loader_for(model, args.data, "test", batch=320, workers=4, limit=640)
          if x.shape[0] == 320]
    oracle_model = copy.deepcopy(model)
    timm_dora.wrap(model, actor)
    with torch.inference_mode():
        for _ in range(5):
            for x in xs:
                model(x)
        removed = model.dora_stats.removed.float().mean(0)
        ks = {l: int(round(float(r))) for l, r in enumerate(removed) if r > 0}
        fns = {"dora_default": model, "oracle_compiled": torch.compile(oracle_forward(oracle_model, ks))}
        for _ in range(10):
            for fn in fns.values():
                for x in xs:
                    fn(x)
        rounds = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                rounds[k].append(ms_per_batch(fn, xs))
        median = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
        kernels = {k: kernel_table(fn, xs, out / f"vit_{k}.txt") for k, fn in fns.items()}
    res = {"command": command_line("kernel_profile", argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "oracle_removal_per_block": ks,
           "rounds_ms": rounds, "median_ms": median, "kernel_ms": kernels,
           "oracle_over_dora": median["oracle_compiled"] / median["dora_default"]}
    (out / "vit_interleaved.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_ms", "kernel_ms", "oracle_over_dora")}))


if __name__ == "__main__":
    main()
