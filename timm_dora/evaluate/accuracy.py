"""Accuracy, GFLOPs and policy statistics of native and the methods on the same images
(:func:`evaluate`), accumulated per row by :class:`Tally` and printed by :func:`format_rows`."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..data import ReadableBatches, eval_transform, open_split
from .methods import Method, NativeMethod, Output

__all__ = ["Tally", "evaluate", "format_rows", "loader_for", "tensor_batches"]


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


def loader_for(model: nn.Module, data: str, split: str = "test", *, batch: int = 64, workers: int = 4,
               limit: Optional[int] = None, class_map=None, pin_memory: bool = False, input_size: Optional[int] = None):
    """``(images, labels)`` batches of ``split`` of ``data`` (labels CSV or image folder; the first
    ``limit`` images where given) with the model's eval preprocessing (at ``input_size`` px where
    given), read by ``workers`` processes (at most one per CPU this process may use). An unreadable
    image is left out with one warning naming it and listed in the result's ``skipped``
    (:class:`~timm_dora.data.ReadableBatches`), as training leaves it out of its fixed sets."""
    ds = open_split(data, split, class_map=class_map)
    indices = range(min(len(ds), limit) if limit is not None else len(ds))
    return ReadableBatches(ds, eval_transform(model, img_size=input_size), batch_size=batch, num_workers=workers,
                           indices=indices, pin_memory=pin_memory)


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
    skip_dead: bool = False,
) -> List[Dict[str, Any]]:
    """Native (``native=True``) and every method on each ``(images, labels, ...)`` batch; one row
    per output (see :class:`Tally`), native first (``skip_dead``: native without the last block's
    dead MLP rows, as the methods built with it)."""
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    dtype = p.dtype
    tallies: Dict[str, Tally] = {}
    nat = NativeMethod(model, skip_dead) if native else None
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
