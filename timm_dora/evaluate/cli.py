"""``timm-dora eval``: top-1/top-5, GFLOPs and policy statistics of native and pruned models.

Every batch runs the native model and the chosen method on the same preprocessed images (the
backbone's own deterministic timm preprocessing, :func:`timm_dora.data.eval_transform`), so both
rows of the result are over exactly the same images. Reported per method:

- ``top1`` / ``top5`` (percent) with the exact ``correct1`` / ``correct5`` counts and
  ``agreement`` (top-1 prediction equal to native's, percent); the paired comparison with native
  on the same images (App. C.3): ``degraded`` / ``improved`` (images native gets right and the
  method wrong / the reverse), ``paired_drop`` (percentage points, ``100 (degraded - improved) /
  n``, which equals native's top-1 minus the method's) and ``paired_drop_se``, its standard error
  (percentage points, of the mean of the per-image differences in {-1, 0, 1});
- ``gflops_mean`` and the per-image range ``gflops_min`` / ``gflops_max`` under the App. E.4
  accounting: for DORA (and the selector substitutions) the per-image counts of
  ``model.dora_stats.gflops``, actor included; for ToMe and static schedules the count of their
  (input-uniform) trajectory, matching included;
- ``per_block``: per block the gate activation rate, the min/mean/max budget over the images
  whose gate opened (``null`` where none did) and the mean visual tokens after the block.

Precision: ``auto`` is bf16 weights and activations on CUDA (the paper's single BF16 inference
contract) and fp32 on the CPU; ``bf16-autocast`` keeps fp32 weights under ``torch.autocast``.

Methods (``--method``): ``native``; ``dora`` (``--actor``: folder, ``hf-hub:org/name`` or a bare repo
id; none: the registered actor); ``tome`` (``--r``: one value for every block or one per block;
``--no-prop-attn``); ``pitome`` (PiToMe: the same ``--r``, or its authors' knob ``--ratio`` (fraction of
tokens every block keeps); proportional attention off unless ``--prop-attn``); ``mctf`` (MCTF off the shelf:
``--r`` tokens fused in every block but the first); ``diffrate`` (DiffRate: ``--schedule FILE.json``, a
prune/merge schedule learned by ``python -m timm_dora.evaluate.baselines.diffrate learn``); ``repshift`` (Representation Shift) and
``zerotprune`` (Zero-TPrune): ``--r`` tokens pruned per block; ``vpruner`` (V-Pruner: ``--mask``, a mask
JSON searched offline per backbone and budget by ``python -m timm_dora.evaluate.baselines.vpruner search``); ``static``
(``--schedule 3:40,6:40,9:40``, ``--rule cls_sim|slice``); and the App. F.1 selector substitutions
``random`` / ``similarity`` / ``attention-wpr`` (they need ``--actor``: each batch first runs DORA,
then replays its gates and budgets with the other selector; the DORA row is reported as well).

Library use::

    from timm_dora.evaluate import build_method, evaluate, loader_for
    rows = evaluate(model, [build_method(model, "tome", r=8)], loader_for(model, "labels.csv", "test"))
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Dict, Tuple

from tqdm.auto import tqdm

import torch
import torch.nn as nn

from ..data import data_config
from .accuracy import evaluate, format_rows, loader_for
from .methods import METHODS, Method, build_method
from .setup import PRECISIONS, environment, inference_device, load_model, write_json

__all__ = ["add_parser", "add_model_args", "add_method_args", "command_line", "count", "method_from_args",
           "positive_int", "run_header", "setup"]


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a batch of 0 images measures nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="timm model name, e.g. deit_tiny_patch16_224.fb_in1k")
    ap.add_argument("--weights", default=None, help="local .safetensors state dict of the backbone (default: timm's pretrained download)")
    ap.add_argument("--random-weights", action="store_true", help="random backbone weights (smoke tests only)")
    ap.add_argument("--img-size", type=int, default=None, help="build the model for this input size (smoke tests)")
    ap.add_argument("--input-size", type=positive_int, default=None,
                    help="run at this input size (square, px): the model takes it through timm's dynamic_img_size "
                         "(position embedding resampled per input) and images are preprocessed at it")
    ap.add_argument("--num-classes", type=int, default=None, help="classifier size if not the model's default")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--seed", type=int, default=0, help="random weights and the random selector")


def add_method_args(ap: argparse.ArgumentParser, default: str = "dora") -> None:
    ap.add_argument("--method", choices=METHODS, default=default)
    ap.add_argument("--actor", default=None, help="DORA actor: folder, hf-hub:org/name or repo id (default: the registered one)")
    ap.add_argument("--attn-backend", default="auto", help="DORA's varlen attention backend (auto, triton, flash, torch_varlen, sdpa_loop)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="DORA: wrap(..., cuda_graphs=True), the forward replayed from CUDA graphs (timm_dora.engine.graphs); "
                         "without it the eager executor runs, the reference")
    ap.add_argument("--merge", action=argparse.BooleanOptionalAction, default=None,
                    help="DORA: fold the removed tokens into their most similar survivor (--merge) or delete "
                         "them (--no-merge); default: as the actor was trained (its config's merge)")
    ap.add_argument("--r", type=int, nargs="+", default=None, help="tokens merged (tome, pitome), fused (mctf) or pruned (repshift, zerotprune) per block: one value, or one per block")
    ap.add_argument("--ratio", type=float, default=None,
                    help="pitome: fraction of its visual tokens every block keeps (the authors' knob, 0.5-1), instead of --r")
    ap.add_argument("--prop-attn", action=argparse.BooleanOptionalAction, default=None,
                    help="ToMe / PiToMe with or without proportional attention (default: ToMe on, PiToMe off as its authors' code)")
    ap.add_argument("--mask", default=None, help="vpruner: the searched mask JSON (e.g. benchmarks/baselines/vpruner/<model>_keep<K>.json)")
    ap.add_argument("--schedule", default=None, help="static schedule block:count[,block:count...], e.g. 3:40,6:40,9:40; "
                    "diffrate: a learned schedule JSON")
    ap.add_argument("--rule", choices=("cls_sim", "slice"), default="cls_sim", help="static schedule token rule")
    ap.add_argument("--wpr-iters", type=int, default=30, help="Attention-WPR propagation steps")
    ap.add_argument("--skip-dead", action="store_true",
                    help="every method (native too) leaves out the last block's MLP on the tokens a CLS-token "
                         "readout never reads, and counts what runs (eager only)")


def setup(args) -> Tuple[nn.Module, torch.device, torch.dtype, bool]:
    device, dtype, autocast = inference_device(args.device, args.precision)
    model = load_model(args.model, args.weights, random_weights=args.random_weights, img_size=args.img_size,
                       num_classes=args.num_classes, seed=args.seed, dynamic_img_size=args.input_size is not None)
    return model.to(device, dtype), device, dtype, autocast


def method_from_args(model: nn.Module, args) -> Method:
    return build_method(model, args.method, actor=args.actor, r=args.r, prop_attn=args.prop_attn, ratio=args.ratio,
                        schedule=args.schedule, rule=args.rule, seed=args.seed, wpr_iters=args.wpr_iters,
                        attn_backend=args.attn_backend, cuda_graphs=getattr(args, "cuda_graphs", False),
                        skip_dead=getattr(args, "skip_dead", False), merge=getattr(args, "merge", None),
                        mask=getattr(args, "mask", None))


def run_header(args, device: torch.device, dtype: torch.dtype, autocast: bool) -> Dict[str, Any]:
    """The fields every ``timm-dora eval``/``bench`` JSON starts with: environment, command,
    precision, model and weights."""
    return {
        **environment(device, command_line(args)),
        "dtype": "bf16-autocast" if autocast else str(dtype).replace("torch.", ""),
        "model": args.model,
        "weights": args.weights or ("random" if args.random_weights else "timm-pretrained"),
    }


def command_line(args, prog: str = "timm-dora") -> str:
    """The command that produced ``args`` (rebuilt from the parser: every option that differs from
    its default), so that it is right however the parser was called (console script or ``main([...])``)."""
    ap: argparse.ArgumentParser = args._parser
    parts = [prog, args.command] if getattr(args, "command", None) else [prog]
    for action in ap._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default and not action.required:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts += [flag] + [str(v) for v in value]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def _run(args) -> int:
    model, device, dtype, autocast = setup(args)
    method = method_from_args(model, args)
    loader = loader_for(model, args.data, args.split, batch=args.batch, workers=args.workers, limit=args.limit,
                        class_map=args.class_map, pin_memory=device.type == "cuda", input_size=args.input_size)
    n = len(loader.indices)
    bar = tqdm(total=n, desc=f"eval {args.method}", unit="img", disable=args.quiet, file=sys.stderr, dynamic_ncols=True)
    try:
        rows = evaluate(model, [] if args.method == "native" else [method], loader, device=device, autocast=autocast,
                        progress=lambda seen: bar.update(seen - bar.n), skip_dead=args.skip_dead)
    finally:
        bar.close()
        method.close()
    cfg = data_config(model, img_size=args.input_size)
    payload = {
        **run_header(args, device, dtype, autocast),
        "data": {"spec": str(args.data), "split": args.split, "images": loader.images,
                 "skipped_unreadable": [path for path, _ in loader.skipped]},
        "preprocessing": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "rows": rows,
    }
    print(format_rows(rows))
    if loader.skipped:
        print(f"{len(loader.skipped)} unreadable image(s) left out; {loader.images} evaluated")
    write_json(args.out, payload)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("eval", help="top-1, GFLOPs and policy statistics of native and pruned models",
                               description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add_model_args(ap)
    add_method_args(ap)
    ap.add_argument("--data", required=True, help="labels CSV (or a folder holding labels.csv), or an image folder")
    ap.add_argument("--split", default="test")
    ap.add_argument("--class-map", default=None, help="folder name -> label map for image folders")
    ap.add_argument("--batch", type=positive_int, default=128)
    ap.add_argument("--workers", type=count, default=4, help="data loading processes (at most one per CPU)")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N images only")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--quiet", action="store_true")
    ap.set_defaults(func=_run, _parser=ap)
    return ap
