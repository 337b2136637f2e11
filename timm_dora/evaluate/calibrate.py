"""``timm-dora calibrate`` (ours): move a trained actor's operating point to a GFLOPs reduction,
without retraining and without labels.

A trained actor prunes as much as its training's accuracy feedback settled on. To serve it at
another point, :meth:`Actor.tilted <timm_dora.policy.Actor.tilted>` subtracts ``t * k`` from the
budget head's logit of every budget ``k``: ``t > 0`` makes each open gate remove fewer tokens,
``t < 0`` more; gates and token choice are the actor's own. :func:`calibrate_tilt` finds, by
bisection on ``t``, the largest tilt at which the actor's mean GFLOPs reduction on the given images
is still at least the target (the reduction falls as ``t`` grows). Only GFLOPs are read: any
images will do (the training pool; never the test split, whose images would then have made a
choice).

    timm-dora calibrate --model deit_tiny_patch16_224.fb_in1k --actor ACTOR --data labels.csv \\
        --splits rollout qc dev --target-reduction 36.5 --out calibrated/

The calibrated actor is saved like any other; its config's ``training.calibration`` records the
tilt, the target, the reduction reached and every step of the search.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..engine import native_gflops
from ..hub import check_backbone, load_actor, save_pretrained
from ..policy import Actor
from .accuracy import loader_for
from .cli import count, positive_int
from .methods import build_method
from .setup import PRECISIONS, environment, inference_device, load_model

__all__ = ["calibrate_tilt", "mean_reduction", "search_tilt"]

MISS_WARN_PP = 1.0  # ours: a reduction this far from the target (percentage points) is reported as a miss


def search_tilt(reduction_at: Callable[[float], float], target_pct: float, *, first_step: float = 0.05,
                steps: int = 12, max_tilt: float = 100.0) -> Tuple[float, List[Dict[str, float]]]:
    """The largest tilt ``t`` with ``reduction_at(t) >= target_pct``, to within a bracket halved
    ``steps`` times, and every ``(tilt, reduction_pct)`` read on the way.

    The bracket is found from ``t = 0`` by doubling ``first_step`` toward the side that crosses the
    target (up to ``|t| = max_tilt``); ``reduction_at`` is taken to fall as ``t`` grows."""
    history: List[Dict[str, float]] = []

    def read(t: float) -> float:
        r = float(reduction_at(t))
        history.append({"tilt": t, "reduction_pct": r})
        return r

    def unreachable() -> ValueError:
        seen = [h["reduction_pct"] for h in history]
        return ValueError(f"no budget tilt within +-{max_tilt:g} reaches a {target_pct:g} % GFLOPs reduction "
                          f"(the tilts tried gave {min(seen):.1f}-{max(seen):.1f} %)")

    if read(0.0) >= target_pct:  # prune less: double t upward until the reduction falls below the target
        ok, bad, t = 0.0, None, first_step
        while bad is None:
            if t > max_tilt:
                raise unreachable()
            if read(t) >= target_pct:
                ok, t = t, 2.0 * t
            else:
                bad = t
    else:  # prune more: double t downward until the reduction reaches it
        ok, bad, t = None, 0.0, -first_step
        while ok is None:
            if -t > max_tilt:
                raise unreachable()
            if read(t) >= target_pct:
                ok = t
            else:
                bad, t = t, 2.0 * t
    for _ in range(steps):
        mid = 0.5 * (ok + bad)
        if read(mid) >= target_pct:
            ok = mid
        else:
            bad = mid
    return ok, history


@torch.inference_mode()
def mean_reduction(model: nn.Module, actor: Actor, batches: Sequence[torch.Tensor], *, cuda_graphs=False) -> Tuple[float, float]:
    """``(mean GFLOPs, reduction %)`` of ``actor`` on ``model`` over image ``batches`` (no labels)."""
    method = build_method(model, "dora", actor=actor, cuda_graphs=cuda_graphs)
    try:
        total, n = 0.0, 0
        for x in batches:
            g = method.outputs(x)["dora"].gflops
            total, n = total + float(g.double().sum()), n + g.numel()
    finally:
        method.close()
    gflops = total / n
    return gflops, 100.0 * (1.0 - gflops / native_gflops(model, actor.num_patches))


def calibrate_tilt(model: nn.Module, actor: Actor, batches: Sequence[torch.Tensor], target_pct: float, *,
                   steps: int = 12, cuda_graphs=False) -> Tuple[Actor, Dict]:
    """``actor`` tilted (:meth:`Actor.tilted`) to the largest tilt at which its mean GFLOPs reduction
    on ``batches`` is at least ``target_pct`` (:func:`search_tilt`), and the search's record."""
    if not 0.0 < target_pct < 100.0:
        raise ValueError(f"the target reduction is a percentage in (0, 100), got {target_pct:g}")
    measured: Dict[float, Tuple[float, float]] = {}  # tilt -> (GFLOPs, reduction %), each read once

    def reduction_at(t: float) -> float:
        measured[t] = mean_reduction(model, actor.tilted(t), batches, cuda_graphs=cuda_graphs)
        return measured[t][1]

    tilt, history = search_tilt(reduction_at, target_pct, steps=steps)
    gflops, reduction = measured[tilt]  # (the search read the tilt it returns)
    record = {"tilt_per_token": tilt, "target_reduction_pct": target_pct, "reduction_pct": reduction, "gflops": gflops,
              "native_gflops": native_gflops(model, actor.num_patches), "images": sum(int(x.shape[0]) for x in batches),
              "search": history}
    if reduction - target_pct > MISS_WARN_PP:
        short = [h for h in history if h["reduction_pct"] < target_pct]  # tilts past the target
        nearest = min(short, key=lambda h: abs(h["tilt"] - tilt)) if short else None
        record["missed"] = f"reached {reduction:.1f} % for a {target_pct:g} % target" + (
            f"; the nearest tilt past it, {nearest['tilt']:+.5f}, gave {nearest['reduction_pct']:.1f} %: more --steps "
            "narrow the bracket, unless the reduction jumps there" if nearest else "")
        warnings.warn(f"calibration missed its target by {reduction - target_pct:.1f} pp: {record['missed']}", stacklevel=2)
    return actor.tilted(tilt), record


def add_parser(sub) -> None:
    ap = sub.add_parser("calibrate", help="move an actor's operating point to a GFLOPs reduction, without labels (ours)",
                        description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="timm model name")
    ap.add_argument("--weights", default=None, help="backbone weights (.safetensors)")
    ap.add_argument("--actor", required=True, help="the trained actor (folder or hf-hub:...)")
    ap.add_argument("--data", required=True, help="labels CSV or image folder (labels are not read)")
    ap.add_argument("--splits", nargs="+", default=["rollout", "qc", "dev"], help="the images to calibrate on")
    ap.add_argument("--target-reduction", type=float, required=True, help="GFLOPs reduction to reach, %% of native")
    ap.add_argument("--steps", type=positive_int, default=12, help="bisection steps once the target is bracketed")
    ap.add_argument("--batch", type=positive_int, default=256, help="images per forward")
    ap.add_argument("--workers", type=count, default=4, help="data loading processes (at most one per CPU)")
    ap.add_argument("--device", default=None, help="default: CUDA when there is one")
    ap.add_argument("--precision", default="auto", choices=[p for p in PRECISIONS if p != "bf16-autocast"],
                    help="auto: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--out", required=True, help="the calibrated actor's folder (hub format)")
    ap.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if "test" in args.splits:
        raise ValueError("--splits must not include test: calibrating on it would make a choice on the test images")
    dev, dtype, _ = inference_device(args.device, args.precision)
    model = load_model(args.model, args.weights).to(dev, dtype)
    actor, config = load_actor(args.actor)
    check_backbone(config, model)
    batches = [x.to(dev, dtype) for split in args.splits
               for x, *_ in loader_for(model, args.data, split, batch=args.batch, workers=args.workers)]
    with warnings.catch_warnings():  # (a miss is printed below as one line)
        warnings.simplefilter("ignore")
        tilted, record = calibrate_tilt(model, actor, batches, args.target_reduction, steps=args.steps)
    record = {**environment(dev), "actor": str(args.actor), "splits": list(args.splits), **record}
    training = dict(config.get("training") or {})
    if "calibration" in training:  # a tilt on top of an earlier one: keep its record
        record["previous"] = training["calibration"]
    training["calibration"] = record
    save_pretrained(tilted, args.out, backbone=config.get("backbone"), extra=training)
    if "missed" in record:
        print(f"timm-dora calibrate: warning: missed the target: {record['missed']}", file=sys.stderr)
    print(f"tilt {record['tilt_per_token']:+.5f} per token: {record['gflops']:.4f} GFLOPs, "
          f"-{record['reduction_pct']:.2f} % (target -{args.target_reduction:g} %) on {record['images']} images "
          f"-> {args.out}", flush=True)
    return 0
