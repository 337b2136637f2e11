"""Accuracy, GFLOPs and throughput of native, ToMe sweeps, static schedules, DiffRate (and DORA) per backbone.

For each backbone (default: the two real ones in ``../shared/weights``, ViT-Ti AugReg and DeiT-Ti):

1. the ``--split`` images of ``--data`` are preprocessed once with the backbone's own eval transform
   and kept on the GPU (bf16);
2. top-1/top-5 and GFLOPs (App. E.4) of every configuration on all of them, in one pass (native,
   ToMe for every ``--r``, static schedules for every ``--static-reductions`` target at
   ``--static-blocks`` with the ``cls_sim`` rule and the zero-overhead ``slice`` speed reference,
   V-Pruner for every ``--vpruner-masks`` file searched for the backbone's architecture,
   DiffRate for every learned schedule ``<--diffrate>/<arch>_*.json`` of the backbone (from
   ``python -m timm_dora.evaluate.baselines.diffrate learn``, e.g. ``benchmarks/baselines/diffrate``),
   DORA when ``--actor`` is given, and then the App. F.1 selector substitutions ``--selectors``
   that keep DORA's gates and budgets);
3. throughput of every configuration with the App. E.5 protocol (:func:`timm_dora.evaluate.bench.time_forward`)
   on full batches of those same images (1,300 test images give 4 batches of 320);
4. with a DORA row, the accuracy-matched table (App. E.2, :mod:`timm_dora.evaluate.matching`).

One JSON per backbone, ``<out>/compare_<model>.json``. The paper's timing is 200 + 200 forwards x 5
repeats; for a quick run on one H100 use ``--warmup 50 --iters 50 --repeats 3`` (both Tiny
backbones then take a few minutes)::

    python -m benchmarks.compare --data ../shared/data/imagenet-mini/labels.csv --split test \
        --out benchmarks/results/compare --warmup 50 --iters 50 --repeats 3

CPU smoke test (random tiny model): ``--random-weights --img-size 64 --device cpu --batch 4
--warmup 1 --iters 1 --repeats 1``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

import torch

from timm_dora.evaluate.bench import bench, bench_inputs
from timm_dora.data import eval_transform, open_split, preload
from timm_dora.evaluate import (
    DiffRateMethod,
    DoraMethod,
    NativeMethod,
    SelectorMethod,
    StaticMethod,
    ToMeMethod,
    VPrunerMethod,
    environment,
    evaluate,
    format_rows,
    load_model,
    precision_for,
    tensor_batches,
)
from timm_dora.evaluate.baselines.static import schedule_for_reduction
from timm_dora.evaluate.baselines.vpruner import VPrunerMask, architecture
from timm_dora.engine.flops import native_gflops
from timm_dora.evaluate.matching import table_from_results
from benchmarks.common import command_line, log

MODELS = ["vit_tiny_patch16_224.augreg_in21k_ft_in1k", "deit_tiny_patch16_224.fb_in1k"]
_REPO = Path(__file__).resolve().parents[1]
SHARED_WEIGHTS = [_REPO.parent / "shared" / "weights", _REPO / "shared" / "weights"]


def find_weights(name: str) -> Optional[str]:
    """``<name>*.safetensors`` in ``../shared/weights`` (or ``./shared/weights``) if there is exactly one."""
    for folder in SHARED_WEIGHTS:
        hits = sorted(folder.glob(f"{name}*.safetensors")) if folder.is_dir() else []
        if len(hits) == 1:
            return str(hits[0])
    return None


def vpruner_masks(specs: List[str], model: torch.nn.Module) -> List[Path]:
    """The V-Pruner mask files among ``specs`` (files, or folders of ``*.json``) searched for
    ``model``'s architecture, by keep count (most kept first)."""
    files = [f for s in specs for f in (sorted(Path(s).glob("*.json")) if Path(s).is_dir() else [Path(s)])]
    masks = [(VPrunerMask.load(f), f) for f in files]
    return [f for m, f in sorted(masks, key=lambda mf: -mf[0].keep) if m.model == architecture(model)]


def run_backbone(name: str, weights: Optional[str], actor: Optional[str], args, t0: float) -> dict:
    device = torch.device(args.device)
    dtype, _ = precision_for(device, "auto")
    model = load_model(name, weights, random_weights=args.random_weights, img_size=args.img_size, seed=args.seed)
    model = model.to(device, dtype)
    ds = open_split(args.data, args.split, eval_transform(model))
    if args.limit is not None and args.limit < len(ds):
        ds = torch.utils.data.Subset(ds, range(args.limit))
    images, labels = preload(ds, device=device, dtype=dtype, batch_size=64, num_workers=args.workers)
    log(f"{name}: {images.shape[0]} {args.split} images preprocessed on {device}", t0)

    methods = []
    for r in args.r:
        methods.append(ToMeMethod(model, r))
    schedules = []
    for red in args.static_reductions:
        s = schedule_for_reduction(model, red, args.static_blocks)
        if s and s not in schedules:
            schedules.append(s)
    for s in schedules:
        for rule in ("cls_sim", "slice"):
            methods.append(StaticMethod(model, s, rule))
    for path in vpruner_masks(args.vpruner_masks, model):
        methods.append(VPrunerMethod(model, path))
    if args.diffrate:
        for path in sorted(Path(args.diffrate).glob(f"{name.split('.')[0]}_*.json")):
            methods.append(DiffRateMethod(model, str(path)))
    dora = DoraMethod(model, actor) if actor else None  # wraps last: the others use the submodules
    if dora is not None:
        methods.append(dora)

    rows = evaluate(model, methods, tensor_batches(images, labels, args.batch), device=device)
    log(f"{name}: accuracy of {len(rows)} configurations", t0)

    inputs, info = bench_inputs(model, batch=args.batch, batches=args.batches, device=device, dtype=dtype, images=images)
    timers = {"native": NativeMethod(model).timing_fn(), **{m.name: m.timing_fn() for m in methods}}
    for row in rows:
        res = bench(timers[row["method"]], inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
        row.update({k: res[k] for k in ("images_per_s", "ms_per_batch", "repeats_images_per_s", "attention_ops")})
        log(f"{name}: {row['method']:32s} top-1 {row['top1']:6.2f}  {row['gflops']:6.3f} GFLOPs  "
            f"{row['images_per_s']:9.0f} img/s  {', '.join(res['attention_ops'])}", t0)
    if dora is not None:
        dora.close()
    if dora is not None and args.cuda_graphs:
        # the same actor replayed from CUDA graphs (timm_dora.engine.graphs): accuracy, GFLOPs and speed
        g = DoraMethod(model, actor, cuda_graphs=True)
        g.name = "dora-cuda-graphs"
        row = [r for r in evaluate(model, [g], tensor_batches(images, labels, args.batch), device=device)
               if r["method"] == g.name][0]  # (with native: the row's agreement with native predictions)
        res = bench(g.timing_fn(), inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
        row.update({k: res[k] for k in ("images_per_s", "ms_per_batch", "repeats_images_per_s", "attention_ops")})
        g.close()
        rows.append(row)
        log(f"{name}: {row['method']:32s} top-1 {row['top1']:6.2f}  {row['gflops']:6.3f} GFLOPs  "
            f"{row['images_per_s']:9.0f} img/s", t0)
    # App. F.1 selector substitutions: DORA's own gates and budgets, another selector (accuracy only)
    selector_rows = []
    for sel in (args.selectors if actor else []):
        m = SelectorMethod(model, sel, actor, seed=args.seed)
        rows_s = evaluate(model, [m], tensor_batches(images, labels, args.batch), device=device)  # with agreement, paired drop
        m.close()
        selector_rows += [r for r in rows_s if r["method"] == sel]
        log(f"{name}: selector {sel:14s} top-1 {selector_rows[-1]['top1']:6.2f}", t0)

    payload = {
        **environment(device, args.command),
        "dtype": str(dtype).replace("torch.", ""),
        "model": name,
        "weights": weights or ("random" if args.random_weights else "timm-pretrained"),
        "actor": actor,
        "native_gflops": native_gflops(model),
        "data": {"spec": str(args.data), "split": args.split, "images": int(images.shape[0])},
        "protocol": {"batch": args.batch, "batches": info["batches"], "warmup": args.warmup, "iters": args.iters,
                     "repeats": args.repeats, "statistic": "median over repeats", "inputs": info},
        "static_schedules": [{str(b): k for b, k in s.items()} for s in schedules],
        "rows": rows,
        "selector_substitution": selector_rows,
    }
    print(format_rows(rows, per_block=dora is not None))
    if dora is not None:
        matched = table_from_results(payload, backbone=name, exclude=("static-slice", "dora-cuda-graphs"))
        payload["matched"] = matched
        print(matched["table"])
    return payload


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--weights", nargs="+", default=None, help="one .safetensors per model (default: ../shared/weights/<model>*)")
    ap.add_argument("--random-weights", action="store_true", help="random backbones (smoke tests)")
    ap.add_argument("--img-size", type=int, default=None, help="override the input size (smoke tests)")
    ap.add_argument("--actor", nargs="+", default=None, help="one DORA actor per model (folder or hf-hub:...; 'none' to skip)")
    ap.add_argument("--data", required=True, help="labels CSV (or folder / image folder)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=None, help="first N images only (quick checks)")
    ap.add_argument("--r", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16], help="ToMe sweep (r per block)")
    ap.add_argument("--static-reductions", type=float, nargs="+", default=[0.2, 0.3, 0.4], help="static GFLOPs-reduction targets")
    ap.add_argument("--static-blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--vpruner-masks", nargs="*", default=[],
                    help="V-Pruner mask JSONs or folders of them (e.g. benchmarks/baselines/vpruner); each backbone "
                         "runs those searched for its architecture")
    ap.add_argument("--diffrate", default=None,
                    help="folder of learned DiffRate schedules, <arch>_<target>.json (e.g. benchmarks/baselines/diffrate)")
    ap.add_argument("--selectors", nargs="*", default=["random", "similarity", "attention-wpr"],
                    help="App. F.1 selector substitutions run with the DORA actor (accuracy only)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also evaluate and time DORA with wrap(..., cuda_graphs=True) (row dora-cuda-graphs)")
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=25, help="at most this many timing batches (full batches of the split)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output folder: one compare_<model>.json per backbone")
    args = ap.parse_args(argv)
    args.command = command_line("compare", argv)
    if args.weights is not None and len(args.weights) != len(args.models):
        ap.error("--weights needs one file per model")
    if args.actor is not None and len(args.actor) != len(args.models):
        ap.error("--actor needs one entry per model ('none' to skip one)")
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for i, name in enumerate(args.models):
        weights = None
        if not args.random_weights:
            weights = args.weights[i] if args.weights else find_weights(name)
            if weights is None:
                ap.error(f"no weights for {name}: pass --weights (or --random-weights for a smoke test)")
        actor = None if args.actor is None or args.actor[i].lower() == "none" else args.actor[i]
        payload = run_backbone(name, weights, actor, args, t0)
        path = out / f"compare_{name}.json"
        path.write_text(json.dumps(payload, indent=1))
        log(f"wrote {path}", t0)
        results.append(payload)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
