"""Do trained actors do better on the images their policy was trained on? (ours; inference only,
on the 1,000 ``sample1000`` pool images, never ``test``)

    python -m benchmarks.seen_unseen --model deit_tiny_patch16_224.fb_in1k --weights W.safetensors \\
        --data labels.csv --actors c3=RUN/selected st3=STUDENT ... --out seen_unseen.json

PPO trains on the ``rollout`` split only (700 images, about 430 visits each in a 1,171-update stage
of 256 images, 860 over two stages); ``qc`` and ``dev`` (300) are read by the label-free feedback checks and the
selection, never by a gradient (``timm-dora distill`` imitates the teacher's decisions on
``rollout`` and ``qc``). For each actor and each group of images (``rollout``, ``qc``, ``dev`` and
``unseen`` = ``qc`` + ``dev``), paired against native on the same images: its agreement with
native, its paired drop and its GFLOPs, and the agreement of the static every-block ``cls_sim``
rule (the baseline of the ``test`` tables) at the same GFLOPs, interpolated over a sweep run on the
same images. ``advantage_pp`` is the actor's agreement minus that static agreement; an actor that
generalises has the same advantage on ``rollout`` as on ``unseen`` (``seen_minus_unseen_pp`` near
0): images differ in difficulty from split to split, the advantage over a rule that learned nothing
cancels that. Agreement moves in finer steps than the drop (every changed prediction counts).
"""
from __future__ import annotations

import argparse
import itertools
from typing import Any, Dict

import torch

from timm_dora.evaluate import build_method, environment, inference_device, load_model, write_json
from benchmarks.common import CUDA_GRAPHS, command_line, interpolate, paired_row, predict, preload_batches, rounded

SPLITS = ("rollout", "qc", "dev")
GROUPS = {"rollout": ("rollout",), "qc": ("qc",), "dev": ("dev",), "unseen": ("qc", "dev")}
STATIC_K = (7, 9, 11, 13, 15, 17)  # tokens removed at each of blocks 1-11: 2.02 to 1.37 GFLOPs on DeiT-Ti


def every_block(k: int, depth: int) -> str:
    return ",".join(f"{b}:{k}" for b in range(1, depth))


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True, help="the backbone's .safetensors")
    ap.add_argument("--data", required=True, help="labels CSV with the rollout, qc and dev splits")
    ap.add_argument("--actors", nargs="+", required=True, metavar="NAME=FOLDER")
    ap.add_argument("--static-k", type=int, nargs="+", default=list(STATIC_K),
                    help="the static sweep: tokens removed at each block after the first")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="the first LIMIT images of each split (smoke tests)")
    ap.add_argument("--img-size", type=int, default=None, help="build the model for this input size (smoke tests)")
    ap.add_argument("--num-classes", type=int, default=None, help="classifier size (smoke tests)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    actors = dict(a.split("=", 1) for a in args.actors)
    dev, dtype, _ = inference_device(args.device)
    model = load_model(args.model, args.weights, img_size=args.img_size, num_classes=args.num_classes).to(dev, dtype)
    depth = len(model.blocks)
    per_split = {s: preload_batches(model, args.data, [s], dev, dtype, args.batch, args.workers, args.limit) for s in SPLITS}
    batches = [b for s in SPLITS for b in per_split[s]]  # one pass of each method over all splits
    n_images = {s: sum(len(y) for _, y in per_split[s]) for s in SPLITS}
    starts = dict(zip(SPLITS, [0, *itertools.accumulate(n_images[s] for s in SPLITS)]))
    rows_of = {g: torch.cat([torch.arange(starts[s], starts[s] + n_images[s]) for s in GROUPS[g]]) for g in GROUPS}
    labels = torch.cat([y for _, y in batches])

    def run(kind: str, **kw):  # (predictions, per-image GFLOPs) over all splits
        return next(iter(predict(build_method(model, kind, **kw), batches).values()))

    def group(res, g):  # the rows of a group of splits
        return tuple(t[rows_of[g].to(t.device)] for t in res)

    native = run("native")
    nat_g = float(native[1].mean())
    ref = {g: (group(native, g)[0], labels[rows_of[g].to(labels.device)]) for g in GROUPS}  # native's top-1, labels
    static = {k: run("static", schedule=every_block(k, depth), rule="cls_sim") for k in args.static_k}
    res: Dict[str, Any] = {"static": {}, "actors": {}}
    sweep = {}
    for g in GROUPS:
        rows = {k: paired_row(*group(static[k], g), *ref[g], nat_g) for k in args.static_k}
        res["static"][g] = [{"schedule": every_block(k, depth), **r} for k, r in rows.items()]
        sweep[g] = [(r["gflops"], r["agreement"]) for r in rows.values()]
    for name, folder in actors.items():
        out = run("dora", actor=folder, cuda_graphs=CUDA_GRAPHS)  # the test tables' executor
        per: Dict[str, Any] = {"actor": folder}
        for g in GROUPS:
            row = paired_row(*group(out, g), *ref[g], nat_g)
            at = interpolate(sweep[g], row["gflops"])
            per[g] = {**row, "n_images": int(ref[g][1].numel()), "static_agreement": at,
                      "advantage_pp": None if at is None else row["agreement"] - at}
        a, b = per["rollout"]["advantage_pp"], per["unseen"]["advantage_pp"]
        per["seen_minus_unseen_pp"] = None if a is None or b is None else a - b
        res["actors"][name] = per
        print(f"{name}: advantage over static {a if a is None else round(a, 2)} pp (rollout), "
              f"{b if b is None else round(b, 2)} pp (qc + dev) at {per['unseen']['gflops']:.3f} GFLOPs", flush=True)
    cmd = command_line("seen_unseen", argv)
    res = {**environment(dev, cmd), "model": args.model, "dtype": str(dtype).replace("torch.", ""),
           "n_images": n_images, "native_gflops": nat_g, **res}
    write_json(args.out, rounded(res))
    return res


if __name__ == "__main__":
    main()
