"""The accuracy-computation trade-off of one backbone on one split: DORA (every seed of a recipe,
and the checkpoints of their runs), the static sweep, ToMe r = 4..14 and DORA's gates and budgets
with random token choice, all paired against native on the same images, with and without the
dead compute of a CLS readout (``skip_dead``).

    python -m benchmarks.tradeoff --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W.safetensors \\
        --data labels.csv --split test --seed-actors 0=run0/selected 1=run1/selected 2=run2/selected \\
        --checkpoints run1/checkpoints/u* --publish-as timm_dora/hub/actors/<model> \\
        --out benchmarks/results/tradeoff_vit_tiny.json

Which seed's actor is published is chosen on the development split, never on ``--split``: each
seed's selected actor carries its dev record (``training`` in its config) and the paper's selection
rule (lowest dev GFLOPs within the target drop, App. E.2) is applied across the seeds; or, with
``--choice``, the seed ``benchmarks.choose_seed`` chose on the whole labelled pool. Where the
records carry the dev per-image spread (``dev_spread_pct``, written by ``timm-dora distill``), seeds
below ``--min-dev-spread`` (the per-image target, 5 % of native GFLOPs) are left out first: on ViT-Ti
one distillation seed took the teacher's rarer block-5 budget for 6 % of dev images instead of the
teacher's 10 %, which collapses the p10-p90 spread to about 1 % at the same mean.

Rows per method: ``top1``, ``drop_pp`` (native's top-1 minus the method's, on the same images),
``drop_se_pp`` (its paired standard error), ``gflops`` (mean per image, App. E.4 accounting) and
``gflops_reduction_pct``; DORA rows add the per-image ``gflops_p10`` / ``gflops_p90``, and the
published seed is paired with every ToMe row image by image (``dora.vs_tome``: ``drop_gap_pp``,
its drop minus ToMe's, with the paired ``drop_gap_se_pp``), each seed with the ToMe row nearest
in GFLOPs (``vs_tome_nearest``). The static
sweep covers reductions of ``--static-reductions`` (percent of native GFLOPs) for each block family
of ``--static-blocks`` with the ``cls_sim`` rule; ``static_at_dora`` is the static drop linearly
interpolated at DORA's GFLOPs, and ``targets.static_covers_half_to_twice`` says whether one family
spans 0.5x to 2x DORA's saving (the default 5-75 % does up to a 37.5 % saving). The top-level tables are the plain models; ``skip_dead`` holds the
same tables with the last block's MLP on the CLS row only (identical logits, fewer GFLOPs). Every
DORA row runs on the executor ``timm_dora.wrap`` picks by default (``dora_cuda_graphs``: ``None``,
captured wherever it can be).

bf16 on CUDA, fp32 on the CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from timm_dora.evaluate import build_method, environment, inference_device, load_model, write_json
from timm_dora.evaluate.baselines.static import schedule_for_reduction
from timm_dora.train.selection import CheckpointRecord, select_checkpoint
from benchmarks.common import (CUDA_GRAPHS, command_line, interpolate, native_row, paired_gap, paired_row, predict,
                               preload_batches, rounded)

MODEL = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
# every DORA row runs on the executor benchmarks.common.CUDA_GRAPHS names (wrap's default; why: there)


def _dev_record(actor_dir: str, name: str) -> Tuple[CheckpointRecord, Optional[float]]:
    """The actor's dev record and its per-image spread on dev (p90 - p10 GFLOPs, % of native) where
    the record has it (``timm-dora distill`` writes it; ``None`` otherwise)."""
    t = json.loads((Path(actor_dir) / "config.json").read_text()).get("training") or {}
    if "dev_top1" not in t:
        raise ValueError(f"{actor_dir}: its config has no dev record (training.dev_top1): not a timm-dora-train actor")
    spread = None if t.get("dev_spread_pct") is None else float(t["dev_spread_pct"])
    return CheckpointRecord(name, float(t["dev_top1"]), float(t["dev_native_top1"]), float(t["dev_gflops"])), spread


def choose_seed(actors: Dict[str, str], target_pp: float, min_spread: float):
    """The seed to publish, on dev records only: the paper's rule (lowest dev GFLOPs within
    ``target_pp``) among the seeds whose recorded dev spread is at least ``min_spread`` % of native
    (or unrecorded); among all seeds when none is. Returns ``(Selection, {seed: its dev record with
    spread_pct})``, each actor's config read once."""
    dev = {s: _dev_record(p, s) for s, p in actors.items()}
    per_image = [s for s, (_, spread) in dev.items() if spread is None or spread >= min_spread]
    choice = select_checkpoint([dev[s][0] for s in per_image or actors], target_pp=target_pp)
    return choice, {s: {**vars(record), "spread_pct": spread} for s, (record, spread) in dev.items()}


def read_choice(path: str, seeds) -> Tuple[str, Dict[str, Any]]:
    """The seed a ``benchmarks.choose_seed`` record chose and the record, after checking that it chose among
    exactly ``seeds`` (``ValueError`` otherwise)."""
    with open(path) as f:
        rec = json.load(f)
    had = sorted(str(s["seed"]) for s in rec["seeds"])
    if had != sorted(seeds):
        raise ValueError(f"--choice {path} chose among seeds {had}, but --seed-actors gives {sorted(seeds)}")
    return str(rec["chosen"]["seed"]), rec


def _table(model, batches, labels, args, actors: Dict[str, str], published: str, skip_dead: bool,
           checkpoints: Sequence[str]) -> Dict[str, Any]:
    nat_p, nat = native_row(model, batches, labels, skip_dead)
    ng = nat["gflops"]
    row = lambda p, g, **kw: paired_row(p, g, nat_p, labels, ng, **kw)  # noqa: E731
    t: Dict[str, Any] = {"native": nat}

    seeds, by_seed, seed_preds = [], {}, {}
    for seed, path in actors.items():
        rows = predict(build_method(model, "random" if seed == published else "dora", actor=path, seed=args.random_seed,
                                     cuda_graphs=CUDA_GRAPHS, skip_dead=skip_dead), batches)
        by_seed[seed], seed_preds[seed] = row(*rows["dora"], spread=True), rows["dora"][0]
        seeds.append({"seed": int(seed), "actor": path, **by_seed[seed]})
        if seed == published:
            t["random_selector"] = {"seed": args.random_seed, **row(*rows["random"])}
    d = dict(by_seed[published])
    drops = [s["drop_pp"] for s in seeds]
    reds = [s["gflops_reduction_pct"] for s in seeds]
    t["dora"] = {"actor": args.publish_as or actors[published], "seed": int(published), **d, "seeds": seeds,
                 "seeds_drop_pp_mean": statistics.mean(drops), "seeds_drop_pp_sd": statistics.pstdev(drops),
                 "seeds_gflops_reduction_pct_mean": statistics.mean(reds),
                 "seeds_gflops_reduction_pct_sd": statistics.pstdev(reds)}

    t["static"] = []
    for fam in args.static_blocks:
        blocks = [int(b) for b in fam.split(",")]
        seen = set()
        for red in args.static_reductions:
            sched = schedule_for_reduction(model, red / 100.0, blocks)
            key = tuple(sorted(sched.items()))
            if not sched or key in seen:
                continue
            seen.add(key)
            spec = ",".join(f"{b}:{k}" for b, k in sorted(sched.items()))
            method = build_method(model, "static", schedule=spec, rule="cls_sim", skip_dead=skip_dead)
            p, g = next(iter(predict(method, batches).values()))
            t["static"].append({"schedule": spec, "family": fam, "rule": "cls_sim", **row(p, g)})
    t["static_at_dora"] = {}
    for fam in args.static_blocks:
        pts = [(s["gflops"], s["drop_pp"]) for s in t["static"] if s["family"] == fam]
        t["static_at_dora"][fam] = interpolate(pts, d["gflops"])

    t["tome"], tome_preds = [], {}
    for r in range(args.tome_r[0], args.tome_r[1] + 1):
        p, g = next(iter(predict(build_method(model, "tome", r=r, skip_dead=skip_dead), batches).values()))
        t["tome"].append({"r": r, **row(p, g)})
        tome_preds[r] = p
    # DORA against ToMe image by image: every r for the published seed, the r nearest in GFLOPs for each seed
    t["dora"]["vs_tome"] = [{"r": tm["r"], "gflops": tm["gflops"], **paired_gap(seed_preds[published], tome_preds[tm["r"]], labels)}
                            for tm in t["tome"]]
    for s in seeds:
        near = min(t["tome"], key=lambda tm: abs(tm["gflops"] - s["gflops"]))
        s["vs_tome_nearest"] = {"r": near["r"], **paired_gap(seed_preds[str(s["seed"])], tome_preds[near["r"]], labels)}

    t["checkpoints"] = []
    for path in checkpoints:
        p, g = predict(build_method(model, "dora", actor=path, cuda_graphs=CUDA_GRAPHS, skip_dead=skip_dead), batches)["dora"]
        t["checkpoints"].append({"actor": path, **row(p, g)})
    return t


def _targets(t: Dict[str, Any], min_reduction: float) -> Dict[str, Any]:
    d = t["dora"]
    static = [v for v in t["static_at_dora"].values() if v is not None]
    return {
        "drop_pp_le_1": d["drop_pp"] <= 1.0,
        f"gflops_reduction_pct_ge_{min_reduction:g}": d["gflops_reduction_pct"] >= min_reduction,
        "dominates_static": bool(static) and min(static) > d["drop_pp"],
        "random_selector_1pp_worse": t["random_selector"]["drop_pp"] - d["drop_pp"] >= 1.0,
        "per_image_spread_ge_5pct": d["spread_pct_of_native"] >= 5.0,
        "static_covers_half_to_twice": _static_covers(t["static"], d["gflops_reduction_pct"]),
    }


def _static_covers(static: List[Dict[str, Any]], saving_pct: float) -> bool:
    """Whether one block family of the static sweep spans 0.5x to 2x DORA's GFLOPs saving (the
    range the sweep must cover, issue #29)."""
    families: Dict[str, List[float]] = {}
    for s in static:
        families.setdefault(s["family"], []).append(s["gflops_reduction_pct"])
    return any(min(v) <= 0.5 * saving_pct and max(v) >= 2.0 * saving_pct for v in families.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--weights", required=True, help="the backbone's .safetensors")
    ap.add_argument("--data", required=True, help="labels CSV")
    ap.add_argument("--split", default="test")
    ap.add_argument("--seed-actors", nargs="+", required=True, metavar="SEED=FOLDER",
                    help="each training seed's selected actor (its config holds its dev record)")
    ap.add_argument("--target-pp", type=float, default=1.0, help="the dev selection's drop target across seeds")
    ap.add_argument("--min-dev-spread", type=float, default=5.0,
                    help="only seeds whose dev record shows this per-image spread (p90 - p10 GFLOPs, %% of native) "
                         "are selected, where records carry it (all seeds when none qualifies)")
    ap.add_argument("--choice", default=None, help="a benchmarks.choose_seed record: publish the seed it chose on the "
                    "pool (among exactly --seed-actors) instead of applying the dev rule")
    ap.add_argument("--publish-as", default=None, help="the hub folder the chosen seed's actor is published to")
    ap.add_argument("--checkpoints", nargs="*", default=[], help="more actors to place on the picture (run checkpoints)")
    ap.add_argument("--static-blocks", nargs="+", default=["3,6,9", "1,2,3,4,5,6,7,8,9,10,11"],
                    help="block families of the static sweep (equal counts at each block of a family)")
    ap.add_argument("--static-reductions", type=float, nargs="+",
                    default=list(range(5, 80, 5)), help="static sweep, percent of native GFLOPs (5-75: twice a "
                    "saving of up to 37.5 %%)")
    ap.add_argument("--tome-r", type=int, nargs=2, default=[4, 14])
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--min-reduction", type=float, default=30.0, help="the GFLOPs-reduction target (percent)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="first N images only (smoke tests)")
    ap.add_argument("--img-size", type=int, default=None, help="build the model for this input size (smoke tests)")
    ap.add_argument("--num-classes", type=int, default=None, help="classifier size (smoke tests)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device(args.device)  # bf16 on CUDA (TF32 off), fp32 on the CPU
    actors = dict(a.split("=", 1) for a in args.seed_actors)
    if args.choice:
        published, rec = read_choice(args.choice, actors)
        published_seed = {"seed": int(published), "rule": rec["rule"]["text"], "choice": args.choice,
                          **{k: rec["rule"][k] for k in ("min_reduction_pct", "min_spread_pct")},
                          "violates": rec["chosen"]["violates"], "splits": rec["splits"], "n_images": rec["n_images"]}
    else:
        choice, dev_records = choose_seed(actors, args.target_pp, args.min_dev_spread)
        published = choice.record.name
        published_seed = {"seed": int(published), "rule": "lowest dev GFLOPs within the target, among seeds with the dev spread",
                          "target_pp": args.target_pp, "violates": choice.violates,
                          "min_dev_spread_pct": args.min_dev_spread, "dev": dev_records}

    model = load_model(args.model, args.weights, img_size=args.img_size, num_classes=args.num_classes).to(dev, dtype)
    batches = preload_batches(model, args.data, [args.split], dev, dtype, args.batch, args.workers, args.limit)
    labels = torch.cat([y for _, y in batches])
    cmd = command_line("tradeoff", argv)
    res: Dict[str, Any] = {**environment(dev, cmd), "model": args.model, "split": args.split,
                           "n_images": int(labels.numel()), "dtype": str(dtype).replace("torch.", ""),
                           "dora_cuda_graphs": CUDA_GRAPHS, "published_seed": published_seed}
    res.update(_table(model, batches, labels, args, actors, published, False, args.checkpoints))
    res["targets"] = _targets(res, args.min_reduction)
    res["skip_dead"] = _table(model, batches, labels, args, actors, published, True, [])
    write_json(args.out, rounded(res))
    d = res["dora"]
    print(f"native {res['native']['top1']:.2f} %, {res['native']['gflops']:.3f} GFLOPs; DORA seed {published}: "
          f"drop {d['drop_pp']:.2f} +- {d['drop_se_pp']:.2f} pp at -{d['gflops_reduction_pct']:.1f} % "
          f"(p10-p90 {d['spread_pct_of_native']:.1f} %); seeds {[round(s['drop_pp'], 2) for s in d['seeds']]} pp, "
          f"{[round(s['gflops_reduction_pct'], 1) for s in d['seeds']]} %", flush=True)
    print(f"random selector {res['random_selector']['drop_pp']:.2f} pp; static at DORA: {res['static_at_dora']}; "
          f"targets {res['targets']}", flush=True)
    return res


if __name__ == "__main__":
    main()
