"""Resolution transfer: a published actor, trained at its backbone's input size, evaluated at others.

The backbone is built with timm's ``dynamic_img_size`` (its position embedding resampled to each
input), the images of ``--split`` are preprocessed at each size, and native and DORA run on the same
images (``timm_dora.evaluate``). The actor keeps its budget grid as fractions of the patches it
was trained with (``Actor.grid``), so at 192 px (144 patches) budget ``k`` of its 196-patch grid
removes ``round(k * 144 / 196)`` tokens.

    python -m benchmarks.resolution_transfer --weights W.safetensors --data labels.csv \\
        --sizes 192 224 256 --out benchmarks/results/resolution_transfer.json

bf16 on CUDA, fp32 on the CPU (``--device``).
"""
from __future__ import annotations

import argparse

from timm_dora.evaluate import build_method, environment, evaluate, inference_device, load_model, loader_for, write_json
from benchmarks.common import command_line

MODEL = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--weights", required=True, help="the backbone's .safetensors")
    ap.add_argument("--actor", default=None, help="actor folder or Hub id (default: the one published for --model)")
    ap.add_argument("--data", required=True, help="labels CSV")
    ap.add_argument("--split", default="test")
    ap.add_argument("--sizes", type=int, nargs="+", default=[192, 224, 256])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="first N images only (smoke tests)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device(args.device)  # bf16 on CUDA (TF32 off), fp32 on the CPU
    res = {**environment(dev, command_line("resolution_transfer", argv)),
           "model": args.model, "actor": args.actor or "published", "split": args.split,
           "dtype": str(dtype).replace("torch.", ""), "rows": []}
    for size in args.sizes:
        model = load_model(args.model, args.weights, dynamic_img_size=True).to(dev, dtype)
        method = build_method(model, "dora", actor=args.actor)
        loader = loader_for(model, args.data, args.split, batch=args.batch, workers=args.workers, limit=args.limit,
                            input_size=size)
        try:
            native, dora = evaluate(model, [method], loader, device=dev)
        finally:
            method.close()
        n0 = (size // 16) ** 2
        row = {"size": size, "patches": n0, "n_images": native["images"], "native_top1": native["top1"],
               "dora_top1": dora["top1"], "drop_pp": dora["paired_drop"], "drop_se_pp": dora["paired_drop_se"],
               "agreement": dora["agreement"], "native_gflops": native["gflops"], "gflops": dora["gflops"],
               "gflops_min": dora["gflops_min"], "gflops_max": dora["gflops_max"],
               "gflops_reduction_pct": 100.0 * (1.0 - dora["gflops"] / native["gflops"]),
               "per_block": dora.get("per_block")}
        res["rows"].append(row)
        write_json(args.out, res)
        print(f"{size:4d} px ({n0} patches): native {row['native_top1']:.2f} %, DORA {row['dora_top1']:.2f} % "
              f"(drop {row['drop_pp']:.2f} +- {row['drop_se_pp']:.2f} pp), {row['gflops']:.3f} GFLOPs "
              f"({-row['gflops_reduction_pct']:+.1f} %)", flush=True)
    return res


if __name__ == "__main__":
    main()
