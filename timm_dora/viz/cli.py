"""``timm-dora viz``: ``trajectory``, ``policy``, ``training`` and ``tradeoff`` pictures, each written
as PNG/SVG with its numbers as JSON next to it."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..api import wrap
from ..backbone import create_backbone
from ..data import eval_transform, open_split
from ..engine import native_gflops
from ..hub import resolve_actor
from ..policy import Actor
from .data import comparison_data, is_comparison, is_sweep, policy_data, read_metrics, read_results, sweep_data, tradeoff_data, training_data
from .plots import FORMATS, collect_stats, plot_comparison, plot_policy, plot_sweep, plot_tradeoff, plot_training, save, trajectory_grid

__all__ = ["add_parser"]




def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _write(fig, out: Path, name: str, numbers: Any, args) -> None:
    paths = save(fig, out / name, args.format, args.dpi)
    (out / f"{name}.json").write_text(json.dumps(_jsonable(numbers), indent=1) + "\n")
    for p in paths + [out / f"{name}.json"]:
        print(p)


def _model_and_actor(args):
    kw = {}
    if args.img_size:
        kw["img_size"] = args.img_size
    if args.num_classes:
        kw["num_classes"] = args.num_classes
    if sum((args.weights is not None, args.pretrained, args.random_weights)) != 1:
        raise ValueError("the backbone's weights: pass one of --weights FILE, --pretrained (timm downloads them) or "
                         "--random-weights (the title then says so)")
    model = create_backbone(args.model, args.weights, pretrained=args.pretrained, **kw).to(args.device)
    if args.actor == "random":
        torch.manual_seed(args.seed)
        actor = Actor.for_model(model)
        label = f"untrained actor (fresh initialisation, seed {args.seed})"
    else:
        actor = resolve_actor(model, args.actor)  # None: the actor published for the model
        label = f"trained actor {Path(str(args.actor).rstrip('/')).name or args.actor}" if args.actor else "published actor"
        updates = ((getattr(actor, "pretrained_config", None) or {}).get("training") or {}).get("updates")
        if updates:
            label += f" ({updates} PPO updates)"
    wrap(model, actor.eval())
    return model, f"{args.model}{' (random weights)' if args.random_weights else ''}, {label}"


def _cmd_trajectory(args) -> int:
    from PIL import Image

    model, label = _model_and_actor(args)
    tf = eval_transform(model)
    imgs, names = [], []
    for path in args.images:
        with open(path, "rb") as f:
            imgs.append(tf(Image.open(f).convert("RGB")))
        names.append(Path(path).stem)
    out = Path(args.out)
    fig, datas = trajectory_grid(model, torch.stack(imgs), names, title=label)
    numbers = [{k: v for k, v in d.items() if k not in ("image", "masks")} for d in datas]
    _write(fig, out, args.name or "trajectory", {"title": label, "images": [str(p) for p in args.images], "trajectories": numbers}, args)
    return 0


def _cmd_policy(args) -> int:
    model, label = _model_and_actor(args)
    ds = open_split(args.data, args.split, eval_transform(model))
    stats = collect_stats(model, ds, args.batch, args.limit)
    data = policy_data(stats, native_gflops(model))
    title = f"{label}, split {args.split}"
    fig = plot_policy(data, title)
    numbers = {k: v for k, v in data.items() if k != "reduction"}
    numbers["title"] = title
    _write(fig, Path(args.out), args.name or "policy", numbers, args)
    return 0


def _cmd_training(args) -> int:
    target = args.target
    if target is None:  # the run's own target (timm-dora-train writes OUT/config.json)
        cfg = Path(args.metrics).with_name("config.json")
        try:
            target = float(json.loads(cfg.read_text())["target_drop"]) if cfg.is_file() else 0.01
        except (ValueError, KeyError, TypeError):
            target = 0.01
    data = training_data(read_metrics(args.metrics), target=target, window=args.window)
    fig = plot_training(data, args.title or Path(args.metrics).name)
    _write(fig, Path(args.out), args.name or "training", data, args)
    return 0


def _json_or_none(path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except ValueError:  # JSON lines: eval/bench rows
        return None


def _cmd_tradeoff(args) -> int:
    docs = [_json_or_none(p) for p in args.results]
    comparisons = [is_comparison(d) for d in docs]
    if any(comparisons):  # benchmarks/baselines.py documents: every method's curve per backbone
        if not all(comparisons):
            raise ValueError("--results: give comparison runs (benchmarks/baselines.py) only, or none")
        data = [comparison_data(d) for d in docs]
        _write(plot_comparison(data, args.title), Path(args.out), args.name or "comparison", data, args)
        return 0
    sweeps = [is_sweep(d) for d in docs]
    if any(sweeps):  # benchmarks/tradeoff.py documents: drop against GFLOPs per backbone
        if not all(sweeps):
            raise ValueError("--results: give trade-off sweeps (benchmarks/tradeoff.py) or eval/bench results, not both")
        data = [sweep_data(d) for d in docs]
        fig = plot_sweep(data, args.title)
        _write(fig, Path(args.out), args.name or "tradeoff", data, args)
        return 0
    data = tradeoff_data(read_results(args.results))
    fig = plot_tradeoff(data, args.title)
    _write(fig, Path(args.out), args.name or "tradeoff", data, args)
    return 0


def _common(p) -> None:
    p.add_argument("--out", required=True, help="output folder (pictures and their numbers as JSON)")
    p.add_argument("--name", default=None, help="file name stem (default: the picture's name)")
    p.add_argument("--format", nargs="+", default=list(FORMATS), choices=FORMATS, help="output formats")
    p.add_argument("--dpi", type=int, default=110, help="PNG resolution")


def _model_args(p) -> None:
    p.add_argument("--model", required=True, help="timm model name, e.g. vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    p.add_argument("--weights", default=None, help="local .safetensors state dict of the backbone")
    p.add_argument("--pretrained", action="store_true", help="timm's pretrained weights (downloaded)")
    p.add_argument("--random-weights", action="store_true", help="random backbone weights (the title says so)")
    p.add_argument("--actor", default=None, help="trained actor (folder or hf-hub:org/name), or 'random' for a freshly "
                                                 "initialised one; default: the actor published for --model")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed of --actor random")
    p.add_argument("--img-size", type=int, default=None, help="override the model's input size")
    p.add_argument("--num-classes", type=int, default=None, help="override the classifier size")
    p.add_argument("--device", default="cpu", help="torch device")


def add_parser(subparsers) -> None:
    """Register ``timm-dora viz`` (``trajectory``, ``policy``, ``training``, ``tradeoff``)."""
    p = subparsers.add_parser("viz", help="pictures: pruning trajectories, policy statistics, training dynamics",
                              description="Draw DORA pictures as PNG/SVG (matplotlib: pip install 'timm-dora[viz]').")
    sub = p.add_subparsers(dest="picture", metavar="PICTURE", required=True)

    t = sub.add_parser("trajectory", help="per-image pruning trajectories (removed patches greyed out)")
    _model_args(t)
    t.add_argument("--images", nargs="+", required=True, help="image files (preprocessed as the model's eval transform)")
    _common(t)
    t.set_defaults(func=_cmd_trajectory)

    q = sub.add_parser("policy", help="intervention rate, budgets and GFLOPs reduction over a dataset split")
    _model_args(q)
    q.add_argument("--data", required=True, help="labels CSV (with a split column) or ImageFolder root")
    q.add_argument("--split", default="dev")
    q.add_argument("--batch", "--batch-size", dest="batch", type=int, default=64, help="images per forward")
    q.add_argument("--limit", type=int, default=None, help="use only the first N images of the split")
    _common(q)
    q.set_defaults(func=_cmd_policy)

    r = sub.add_parser("training", help="a_u, feedback drops, compression and return from metrics.jsonl")
    r.add_argument("--metrics", required=True, help="metrics.jsonl written by timm-dora-train")
    r.add_argument("--target", type=float, default=None,
                   help="target drop as a fraction (default: target_drop of config.json next to the log, else 0.01)")
    r.add_argument("--window", type=int, default=8, help="feedback checks in the running mean")
    r.add_argument("--title", default=None)
    _common(r)
    r.set_defaults(func=_cmd_training)

    s = sub.add_parser("tradeoff", help="top-1 vs GFLOPs and vs throughput from eval/bench JSON or comparison runs "
                                        "(benchmarks/baselines.py), or drop vs GFLOPs from trade-off sweeps "
                                        "(benchmarks/tradeoff.py)")
    s.add_argument("--results", nargs="+", required=True,
                   help="eval or bench JSON files, comparison runs or trade-off sweeps (one panel per backbone)")
    s.add_argument("--title", default=None)
    _common(s)
    s.set_defaults(func=_cmd_tradeoff)
