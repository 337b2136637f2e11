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
``--no-prop-attn``); ``static`` (``--schedule 3:40,6:40,9:40``, ``--rule cls_sim|slice``); and the
App. F.1 selector substitutions ``random`` / ``similarity`` / ``attention-wpr`` (they need
``--actor``: each batch first runs DORA, then replays its gates and budgets with the other
selector; the DORA row is reported as well).

Library use::

    from timm_dora.evaluate import build_method, evaluate, loader_for
    rows = evaluate(model, [build_method(model, "tome", r=8)], loader_for(model, "labels.csv", "test"))
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = [
    "METHODS",
    "Method",
    "Output",
    "Tally",
    "build_method",
    "environment",
    "evaluate",
    "format_rows",
    "load_model",
    "loader_for",
    "native_forward",
    "precision_for",
    "tensor_batches",
]

METHODS = ("native", "dora", "tome", "static", "random", "similarity", "attention-wpr")
PRECISIONS = ("auto", "fp32", "bf16", "bf16-autocast")


# --------------------------------------------------------------------------------------------
# environment, model, precision


def environment(device: torch.device, command: Optional[str] = None) -> Dict[str, Any]:
    """Device, versions and the command line (default: ``sys.argv``), for result JSON files."""
    import timm

    import timm_dora

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    if command is None:
        command = " ".join([Path(sys.argv[0]).name] + sys.argv[1:])
    return {
        "command": command,
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "timm": timm.__version__,
        "timm_dora": timm_dora.__version__,
        "python": platform.python_version(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
    }


def precision_for(device: torch.device, precision: str = "auto") -> Tuple[torch.dtype, bool]:
    """``(weights/activations dtype, autocast)`` for ``precision`` on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    cuda = torch.device(device).type == "cuda"
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    if precision == "bf16":
        return torch.bfloat16, False
    if precision == "bf16-autocast":
        if not cuda:
            raise ValueError("bf16-autocast is for CUDA; use fp32 (or bf16) on the CPU")
        return torch.float32, True
    return torch.float32, False


def load_model(
    name: str,
    weights: Optional[str] = None,
    *,
    random_weights: bool = False,
    img_size: Optional[int] = None,
    num_classes: Optional[int] = None,
    seed: int = 0,
) -> nn.Module:
    """A frozen timm backbone in eval mode: local safetensors ``weights``, random weights
    (``random_weights``, seeded; for smoke tests) or timm's pretrained download."""
    from .train import create_backbone

    kw: Dict[str, Any] = {}
    if img_size is not None:
        kw["img_size"] = img_size
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if weights is not None and random_weights:
        raise ValueError("pass --weights or --random-weights, not both")
    if random_weights:
        torch.manual_seed(seed)
        return create_backbone(name, None, pretrained=False, **kw)
    return create_backbone(name, weights, pretrained=weights is None, **kw)


def native_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's own forward, also on a wrapped model (``forward_head(forward_features(x))``)."""
    from .patch import is_wrapped

    if is_wrapped(model):
        return model.forward_head(model.forward_features(x))
    return model(x)


# --------------------------------------------------------------------------------------------
# methods


@dataclass
class Output:
    """One method's result on one batch."""

    logits: torch.Tensor
    gflops: torch.Tensor  # [B] per-image GFLOPs
    gate: Optional[torch.Tensor] = None  # [B, L] bool
    removed: Optional[torch.Tensor] = None  # [B, L]
    tokens: Optional[torch.Tensor] = None  # [B, L] visual tokens after each block
    backend: Optional[str] = None


def _uniform(b: int, device, gflops: float, removed: Optional[Sequence[int]] = None, n0: Optional[int] = None) -> Dict[str, Any]:
    out: Dict[str, Any] = {"gflops": torch.full((b,), float(gflops), dtype=torch.float64, device=device)}
    if removed is not None:
        r = torch.tensor(list(removed), dtype=torch.long, device=device)
        out["removed"] = r[None].expand(b, -1)
        out["gate"] = out["removed"] > 0
        out["tokens"] = (n0 - torch.cumsum(r, 0))[None].expand(b, -1)
    return out


class Method:
    """A method under evaluation: ``outputs(x) -> {row name: Output}`` and a lean ``timing_fn``."""

    name = "method"
    config: Dict[str, Any] = {}

    def outputs(self, x: torch.Tensor) -> Dict[str, Output]:
        raise NotImplementedError

    def timing_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable timed by :mod:`timm_dora.bench` (logits only)."""
        raise NotImplementedError

    def close(self) -> None:
        """Undo what the method did to the model (e.g. unwrap)."""


class NativeMethod(Method):
    name = "native"

    def __init__(self, model: nn.Module):
        from .flops import native_gflops

        self.model, self.gflops, self.config = model, native_gflops(model), {}

    def outputs(self, x):
        logits = native_forward(self.model, x)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.gflops))}

    def timing_fn(self):
        from .patch import is_wrapped

        return self.model if not is_wrapped(self.model) else (lambda x: native_forward(self.model, x))


class DoraMethod(Method):
    """DORA with a (deterministic) actor; wraps the model in place until :meth:`close`."""

    name = "dora"

    def __init__(self, model: nn.Module, actor=None, **wrap_kwargs):
        from .patch import is_wrapped, wrap

        self.model = model
        self._owns = not is_wrapped(model)
        wrap(model, actor, **wrap_kwargs)
        self.config = {"actor": actor if isinstance(actor, (str, type(None))) else type(actor).__name__}

    def _output(self, logits, s) -> Output:
        return Output(logits, s.gflops, s.gate, s.removed, s.tokens, s.backend)

    def outputs(self, x):
        logits = self.model(x)
        return {self.name: self._output(logits, self.model.dora_stats)}

    def timing_fn(self):
        return self.model

    def close(self):
        from .patch import is_wrapped, unwrap

        if self._owns and is_wrapped(self.model):
            unwrap(self.model)


class SelectorMethod(DoraMethod):
    """App. F.1: DORA's gates and budgets on each batch, another selector (rows: ``dora`` and it)."""

    def __init__(self, model: nn.Module, selector: str, actor=None, seed: int = 0, wpr_iters: int = 30, **wrap_kwargs):
        from .baselines.selectors import SELECTORS

        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {tuple(SELECTORS)}, got {selector!r}")
        super().__init__(model, actor, **wrap_kwargs)
        self.cls, self.name = SELECTORS[selector], selector
        self.kwargs: Dict[str, Any] = {"model": model}
        if selector == "random":
            self.kwargs["generator"] = torch.Generator().manual_seed(seed)
        if selector == "attention-wpr":
            self.kwargs["iters"] = wpr_iters
        self.config = {**self.config, "selector": selector, "seed": seed if selector == "random" else None,
                       "wpr_iters": wpr_iters if selector == "attention-wpr" else None}

    def outputs(self, x):
        from .patch import run

        logits_d, st_d = run(self.model, x, self.model._dora.policy)
        policy = self.cls.from_stats(st_d, **self.kwargs)
        logits_s, st_s = run(self.model, x, policy)
        return {"dora": self._output(logits_d, st_d), self.name: self._output(logits_s, st_s)}

    def timing_fn(self):
        raise ValueError("selector substitutions are an accuracy study (App. F.1); they have no deployment timing")


class ToMeMethod(Method):
    def __init__(self, model: nn.Module, r, prop_attn: bool = True):
        from .baselines.tome import ToMe

        self.fn = ToMe(model, r, prop_attn)
        self.name = self.fn.name
        self.n0 = model.patch_embed.num_patches
        self.config = {"r": r if isinstance(r, int) else list(r), "prop_attn": prop_attn, "r_effective": self.fn.cost.r,
                       "matching_gflops": self.fn.cost.matching_gflops}

    def outputs(self, x):
        logits = self.fn(x)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.fn.cost.gflops, self.fn.cost.r, self.n0))}

    def timing_fn(self):
        return self.fn


class StaticMethod(Method):
    def __init__(self, model: nn.Module, schedule, rule: str = "cls_sim"):
        from .baselines.static import StaticPrune

        self.fn = StaticPrune(model, schedule, rule)
        self.name = self.fn.name
        self.n0 = model.patch_embed.num_patches
        self.ks = [self.fn.schedule.get(l, 0) for l in range(len(model.blocks))]
        self.config = {"schedule": {str(b): k for b, k in sorted(self.fn.schedule.items())}, "rule": rule}

    def outputs(self, x):
        logits = self.fn(x)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.fn.gflops, self.ks, self.n0))}

    def timing_fn(self):
        return self.fn


def _parse_r(r):
    if r is None:
        raise ValueError("--method tome needs --r (one value, or one per block)")
    if isinstance(r, (list, tuple)):
        return int(r[0]) if len(r) == 1 else [int(v) for v in r]
    return int(r)


def build_method(
    model: nn.Module,
    method: str,
    *,
    actor=None,
    r=None,
    prop_attn: bool = True,
    schedule=None,
    rule: str = "cls_sim",
    seed: int = 0,
    wpr_iters: int = 30,
    attn_backend: str = "auto",
    cuda_graphs: bool = False,
) -> Method:
    """A :class:`Method` by name (see :data:`METHODS`)."""
    if method == "native":
        return NativeMethod(model)
    if method == "dora":
        return DoraMethod(model, actor, attn_backend=attn_backend, cuda_graphs=cuda_graphs)
    if method == "tome":
        return ToMeMethod(model, _parse_r(r), prop_attn)
    if method == "static":
        if not schedule:
            raise ValueError("--method static needs --schedule block:count[,block:count...]")
        return StaticMethod(model, schedule, rule)
    if method in ("random", "similarity", "attention-wpr"):
        return SelectorMethod(model, method, actor, seed=seed, wpr_iters=wpr_iters, attn_backend=attn_backend)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


# --------------------------------------------------------------------------------------------
# accumulation


class Tally:
    """Running totals of one row over the dataset (exact counts; per-block policy statistics)."""

    def __init__(self, name: str, config: Optional[Dict[str, Any]] = None):
        self.name, self.config = name, dict(config or {})
        self.n = self.c1 = self.c5 = self.agree = 0
        self.degraded = self.improved = 0
        self.compared = False  # saw native predictions (agreement and the paired comparison exist)
        self.g_sum, self.g_min, self.g_max = 0.0, float("inf"), float("-inf")
        self.p_sum = self.p_min = self.p_max = None  # per-block arrays once seen
        self.gate_sum = self.b_sum = self.b_min = self.b_max = self.tok_sum = None
        self.backend: Optional[str] = None

    def update(self, out: Output, labels: torch.Tensor, native_pred: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = out.logits.float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        pred = top[:, 0]
        self.n += labels.numel()
        self.c1 += int((pred == labels).sum())
        self.c5 += int((top == labels[:, None]).any(1).sum())
        if native_pred is not None:
            self.compared = True
            self.agree += int((pred == native_pred).sum())
            native_ok, ok = native_pred == labels, pred == labels
            self.degraded += int((native_ok & ~ok).sum())
            self.improved += int((ok & ~native_ok).sum())
        g = out.gflops.double()
        self.g_sum += float(g.sum())
        self.g_min, self.g_max = min(self.g_min, float(g.min())), max(self.g_max, float(g.max()))
        if out.gate is not None:
            gate = out.gate.bool()
            rem = out.removed.long()
            big = torch.iinfo(torch.long).max
            gs = gate.long().sum(0).cpu()
            bs = torch.where(gate, rem, 0).sum(0).cpu()
            bmin = torch.where(gate, rem, big).min(0).values.cpu()
            bmax = torch.where(gate, rem, -1).max(0).values.cpu()
            ts = out.tokens.long().sum(0).cpu()
            if self.gate_sum is None:
                self.gate_sum, self.b_sum, self.b_min, self.b_max, self.tok_sum = gs, bs, bmin, bmax, ts
            else:
                self.gate_sum += gs
                self.b_sum += bs
                self.tok_sum += ts
                self.b_min = torch.minimum(self.b_min, bmin)
                self.b_max = torch.maximum(self.b_max, bmax)
        if out.backend is not None:
            self.backend = out.backend
        return pred

    def _paired(self, n: int) -> Dict[str, Any]:
        """The paired comparison with native (none for the native row itself, or for a row
        evaluated without native predictions)."""
        if self.name == "native" or not self.compared:
            return {}
        d, i = self.degraded, self.improved
        mean = (d - i) / n
        var = max((d + i) / n - mean * mean, 0.0)  # of the per-image differences in {-1, 0, 1}
        return {"degraded": d, "improved": i, "paired_drop": 100.0 * mean,
                "paired_drop_se": 100.0 * math.sqrt(var / n)}

    def result(self) -> Dict[str, Any]:
        n = max(self.n, 1)
        row: Dict[str, Any] = {
            "method": self.name,
            "config": self.config,
            "images": self.n,
            "correct1": self.c1,
            "correct5": self.c5,
            "top1": 100.0 * self.c1 / n,
            "top5": 100.0 * self.c5 / n,
            "agreement": 100.0 if self.name == "native" else (100.0 * self.agree / n if self.compared else None),
            **self._paired(n),
            "gflops": self.g_sum / n,
            "gflops_min": self.g_min,
            "gflops_max": self.g_max,
        }
        if self.backend is not None:
            row["attn_backend"] = self.backend
        if self.gate_sum is not None:
            blocks = []
            for l in range(len(self.gate_sum)):
                g = int(self.gate_sum[l])
                blocks.append({
                    "block": l,
                    "gate_rate": g / n,
                    "budget_min": int(self.b_min[l]) if g else None,
                    "budget_mean": float(self.b_sum[l]) / g if g else None,
                    "budget_max": int(self.b_max[l]) if g else None,
                    "tokens_mean": float(self.tok_sum[l]) / n,
                })
            row["per_block"] = blocks
        return row


# --------------------------------------------------------------------------------------------
# data and the loop


def loader_for(model: nn.Module, data: str, split: str = "test", *, batch: int = 64, workers: int = 4,
               limit: Optional[int] = None, class_map=None, pin_memory: bool = False):
    """A DataLoader over ``split`` of ``data`` (labels CSV or image folder) with the model's eval preprocessing."""
    from .data import eval_transform, open_split

    ds = open_split(data, split, eval_transform(model), class_map=class_map)
    if limit is not None and limit < len(ds):
        ds = torch.utils.data.Subset(ds, range(limit))
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False, num_workers=workers, pin_memory=pin_memory)


def tensor_batches(images: torch.Tensor, labels: torch.Tensor, batch: int) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
    """Batches of preloaded tensors (e.g. from :func:`timm_dora.data.preload`)."""
    for s in range(0, images.shape[0], batch):
        yield images[s:s + batch], labels[s:s + batch]


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    methods: Sequence[Method],
    batches: Iterable,
    *,
    device: Optional[torch.device] = None,
    autocast: bool = False,
    native: bool = True,
    progress: Optional[Callable[[int], None]] = None,
) -> List[Dict[str, Any]]:
    """Native (``native=True``) and every method on each ``(images, labels, ...)`` batch; one row
    per output (see :class:`Tally`), native first."""
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    dtype = p.dtype
    tallies: Dict[str, Tally] = {}
    nat = NativeMethod(model) if native else None
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    seen = 0
    for item in batches:
        x, y = item[0], item[1]
        x = x.to(device, dtype if not autocast else torch.float32, non_blocking=True)
        y = torch.as_tensor(y).to(device)
        with amp:
            native_pred = None
            if nat is not None:
                out = nat.outputs(x)["native"]
                native_pred = tallies.setdefault("native", Tally("native", {})).update(out, y)
            for m in methods:
                for name, out in m.outputs(x).items():
                    tallies.setdefault(name, Tally(name, m.config if name == m.name else {})).update(out, y, native_pred)
        seen += y.numel()
        if progress is not None:
            progress(seen)
    return [t.result() for t in tallies.values()]


# --------------------------------------------------------------------------------------------
# printing


def format_rows(rows: Sequence[Dict[str, Any]], per_block: bool = True) -> str:
    """A readable table of evaluation rows (and per-block policy statistics)."""
    lines = [f"{'method':34s} {'top-1':>7s} {'top-5':>7s} {'agree':>7s} {'drop (pp)':>12s} {'GFLOPs':>8s}  "
             f"{'per-image range':>17s} {'img/s':>9s}"]
    for r in rows:
        ips = r.get("images_per_s")
        top1 = "--" if r.get("top1") is None else f"{r['top1']:.2f}"
        top5 = "--" if r.get("top5") is None else f"{r['top5']:.2f}"
        agree = "--" if r.get("agreement") is None else f"{r['agreement']:.1f}"
        drop = "--" if r.get("paired_drop") is None else f"{r['paired_drop']:.2f}±{r['paired_drop_se']:.2f}"
        lines.append(
            f"{r['method'][:34]:34s} {top1:>7s} {top5:>7s} {agree:>7s} {drop:>12s} {r['gflops']:8.3f}  "
            f"{r['gflops_min']:8.3f}-{r['gflops_max']:<8.3f} {'--' if ips is None else f'{ips:9.0f}':>9s}"
        )
    if per_block:
        for r in rows:
            blocks = r.get("per_block")
            if not blocks or not any(b["gate_rate"] > 0 for b in blocks):
                continue
            lines.append(f"\n{r['method']}: per block (budget over gate-active images)")
            lines.append(f"{'block':>5s} {'gate rate':>9s} {'budget min/mean/max':>21s} {'tokens':>8s}")
            for b in blocks:
                bud = "--" if b["budget_mean"] is None else f"{b['budget_min']}/{b['budget_mean']:.1f}/{b['budget_max']}"
                lines.append(f"{b['block']:5d} {b['gate_rate']:9.3f} {bud:>21s} {b['tokens_mean']:8.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="timm model name, e.g. deit_tiny_patch16_224.fb_in1k")
    ap.add_argument("--weights", default=None, help="local .safetensors state dict of the backbone (default: timm's pretrained download)")
    ap.add_argument("--random-weights", action="store_true", help="random backbone weights (smoke tests only)")
    ap.add_argument("--img-size", type=int, default=None, help="build the model for this input size (smoke tests)")
    ap.add_argument("--num-classes", type=int, default=None, help="classifier size if not the model's default")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--seed", type=int, default=0, help="random weights and the random selector")


def add_method_args(ap: argparse.ArgumentParser, default: str = "dora") -> None:
    ap.add_argument("--method", choices=METHODS, default=default)
    ap.add_argument("--actor", default=None, help="DORA actor: folder, hf-hub:org/name or repo id (default: the registered one)")
    ap.add_argument("--attn-backend", default="auto", help="DORA's varlen attention backend (auto, triton, flash, torch_varlen, sdpa_loop)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="DORA: wrap(..., cuda_graphs=True), the forward replayed from CUDA graphs (timm_dora.graphs)")
    ap.add_argument("--r", type=int, nargs="+", default=None, help="ToMe merges per block: one value, or one per block")
    ap.add_argument("--no-prop-attn", action="store_true", help="ToMe without proportional attention")
    ap.add_argument("--schedule", default=None, help="static schedule block:count[,block:count...], e.g. 3:40,6:40,9:40")
    ap.add_argument("--rule", choices=("cls_sim", "slice"), default="cls_sim", help="static schedule token rule")
    ap.add_argument("--wpr-iters", type=int, default=30, help="Attention-WPR propagation steps")


def setup(args) -> Tuple[nn.Module, torch.device, torch.dtype, bool]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":  # the paper's timing/inference contract: no TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype, autocast = precision_for(device, args.precision)
    model = load_model(args.model, args.weights, random_weights=args.random_weights, img_size=args.img_size,
                       num_classes=args.num_classes, seed=args.seed)
    return model.to(device, dtype), device, dtype, autocast


def method_from_args(model: nn.Module, args) -> Method:
    return build_method(model, args.method, actor=args.actor, r=args.r, prop_attn=not args.no_prop_attn,
                        schedule=args.schedule, rule=args.rule, seed=args.seed, wpr_iters=args.wpr_iters,
                        attn_backend=args.attn_backend, cuda_graphs=getattr(args, "cuda_graphs", False))


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
    import shlex

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


def write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))


def _run(args) -> int:
    from .data import data_config

    model, device, dtype, autocast = setup(args)
    method = method_from_args(model, args)
    loader = loader_for(model, args.data, args.split, batch=args.batch, workers=args.workers, limit=args.limit,
                        class_map=args.class_map, pin_memory=device.type == "cuda")
    n = len(loader.dataset)

    def progress(seen):
        if not args.quiet:
            print(f"\r{seen}/{n} images", end="", file=sys.stderr, flush=True)

    try:
        rows = evaluate(model, [] if args.method == "native" else [method], loader, device=device, autocast=autocast,
                        progress=progress)
    finally:
        method.close()
    if not args.quiet:
        print(file=sys.stderr)
    cfg = data_config(model)
    payload = {
        **run_header(args, device, dtype, autocast),
        "data": {"spec": str(args.data), "split": args.split, "images": n},
        "preprocessing": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "rows": rows,
    }
    print(format_rows(rows))
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
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="first N images only")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--quiet", action="store_true")
    ap.set_defaults(func=_run, _parser=ap)
    return ap
