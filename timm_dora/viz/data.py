"""The numbers of DORA's pictures, with no matplotlib: plain dicts of Python numbers and numpy
arrays read from the existing outputs (:class:`~timm_dora.engine.patch.DoraStats`,
``metrics.jsonl`` rows of :mod:`timm_dora.train`, eval/bench JSON), never recomputed another way
(kept tokens from ``stats.tokens``, budgets from ``stats.removed``, GFLOPs from ``stats.gflops``,
``a_u``/``d_u`` from the log). :mod:`~timm_dora.viz.plots` draws them."""
from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..data import data_config
from ..engine import native_gflops as _native_gflops

__all__ = ["concat_stats", "grey_patches", "patch_geometry", "policy_data", "read_metrics", "read_results",
           "to_uint8_image", "tradeoff_data", "training_data", "trajectory_data"]

PathLike = Union[str, "os.PathLike[str]"]
GREY = 200  # uint8 grey that removed patches are faded towards
KEEP = 0.25  # share of the original pixel left in a removed patch




def _pair(v: Any) -> Tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def patch_geometry(model: torch.nn.Module) -> Dict[str, Tuple[int, int]]:
    """``patch_size``, ``grid_size`` and ``img_size`` (``(h, w)`` pairs) of a timm ViT's patch embedding."""
    pe = model.patch_embed
    patch = _pair(pe.patch_size)
    grid = _pair(pe.grid_size)
    return {"patch_size": patch, "grid_size": grid, "img_size": (grid[0] * patch[0], grid[1] * patch[1])}


def _mean_std(model: torch.nn.Module) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    cfg = data_config(model)
    return tuple(float(m) for m in cfg["mean"]), tuple(float(s) for s in cfg["std"])


def to_uint8_image(
    image: Any,
    model: Optional[torch.nn.Module] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
) -> np.ndarray:
    """An ``[H, W, 3]`` uint8 RGB array for display.

    ``image``: a normalised ``[3, H, W]`` float tensor as the model saw it (denormalised with
    ``mean``/``std``, by default the model's own, from its timm data config), a ``PIL.Image`` or a
    uint8 ``[H, W, 3]`` array (used as is).
    """
    if isinstance(image, torch.Tensor) and image.is_floating_point():
        x = image.detach().float().cpu()
        if x.dim() != 3 or x.shape[0] != 3:
            raise ValueError(f"a float image must be [3, H, W], got {tuple(x.shape)}")
        if mean is None or std is None:
            if model is None:
                raise ValueError("a normalised tensor image needs the model (or mean and std) to be denormalised")
            mean, std = _mean_std(model)
        x = x * torch.tensor(std, dtype=torch.float32)[:, None, None] + torch.tensor(mean, dtype=torch.float32)[:, None, None]
        return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    if isinstance(image, torch.Tensor):
        image = image.cpu().numpy()
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got dtype {arr.dtype} and shape {arr.shape}")
    return arr


def grey_patches(image: np.ndarray, mask: np.ndarray, patch_size: Tuple[int, int]) -> np.ndarray:
    """``image`` with the patches where ``mask`` (``[gh, gw]`` bool, True = removed) is set faded to grey."""
    ph, pw = patch_size
    gh, gw = mask.shape
    if image.shape[:2] != (gh * ph, gw * pw):
        raise ValueError(f"image is {image.shape[:2]} but the patch grid covers {(gh * ph, gw * pw)}")
    pixel_mask = np.repeat(np.repeat(mask, ph, axis=0), pw, axis=1)
    faded = np.round(KEEP * image.astype(np.float32) + (1 - KEEP) * GREY).astype(np.uint8)
    return np.where(pixel_mask[..., None], faded, image)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def trajectory_data(
    stats: Any,
    index: int = 0,
    *,
    model: Optional[torch.nn.Module] = None,
    image: Any = None,
    name: Optional[str] = None,
    patch_size: Optional[Tuple[int, int]] = None,
    grid_size: Optional[Tuple[int, int]] = None,
    native_gflops: Optional[float] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
) -> Dict[str, Any]:
    """The trajectory of image ``index`` of a forward's :class:`~timm_dora.engine.patch.DoraStats`.

    Geometry comes from ``model`` (or ``patch_size``/``grid_size``); ``native_gflops`` defaults to
    :func:`timm_dora.native_gflops` of ``model``. Returns::

        blocks   [l, ...]        blocks where this image's gate opened (stats.gate)
        kept     [N_{l+1}, ...]  visual tokens kept after each of them (stats.tokens)
        removed  [k_l, ...]      tokens removed there (stats.removed)
        masks    [len(blocks), gh, gw] bool: patches removed so far (cumulative, stats.removed_patches)
        removed_patches  {l: [grid index, ...]} removed at each intervention block
        image    [H, W, 3] uint8 or None;  patch_size, grid_size, num_patches
        gflops   this image's GFLOPs (stats.gflops);  native_gflops;  name;  index

    Raises ``ValueError`` when the stats lack ``removed_patches`` or when their patch masks do not
    add up to ``stats.tokens``.
    """
    if model is not None:
        geo = patch_geometry(model)
        patch_size = patch_size or geo["patch_size"]
        grid_size = grid_size or geo["grid_size"]
        if native_gflops is None:
            native_gflops = _native_gflops(model)
    if patch_size is None or grid_size is None:
        raise ValueError("trajectory_data needs the model, or patch_size and grid_size")
    gh, gw = _pair(grid_size)
    n0 = gh * gw
    tokens = _cpu(stats.tokens)[index].tolist()
    gate = _cpu(stats.gate)[index].tolist()
    removed = _cpu(stats.removed)[index].tolist()
    depth = len(tokens)
    rp = list(getattr(stats, "removed_patches", None) or [])
    if len(rp) != depth:
        raise ValueError(f"stats.removed_patches has {len(rp)} entries for {depth} blocks: these stats cannot show which patches were removed")
    gone = np.zeros(n0, dtype=bool)
    blocks, kept, rem, masks, per_block = [], [], [], [], {}
    for l in range(depth):
        here: List[int] = []
        if rp[l] is not None:
            img_idx, patch_idx = (_cpu(t) for t in rp[l])
            here = patch_idx[img_idx == index].tolist()
            gone[here] = True
        if int(gone.sum()) != n0 - int(tokens[l]):
            raise ValueError(
                f"image {index}, block {l}: removed_patches account for {int(gone.sum())} removed patches "
                f"but stats.tokens says {n0 - int(tokens[l])} of {n0}"
            )
        if gate[l]:
            blocks.append(l)
            kept.append(int(tokens[l]))
            rem.append(int(removed[l]))
            masks.append(gone.reshape(gh, gw).copy())
            per_block[l] = sorted(int(i) for i in here)
    img = None
    if image is not None:
        img = to_uint8_image(image, model, mean, std)
        ph, pw = _pair(patch_size)
        if img.shape[:2] != (gh * ph, gw * pw):
            raise ValueError(
                f"image is {img.shape[1]}x{img.shape[0]} pixels but the model sees {gw * pw}x{gh * ph}: pass the "
                "image as the model saw it (e.g. the normalised tensor from timm_dora.data.eval_transform)"
            )
    return {
        "index": int(index),
        "name": name,
        "image": img,
        "patch_size": _pair(patch_size),
        "grid_size": (gh, gw),
        "num_patches": n0,
        "depth": depth,
        "blocks": blocks,
        "kept": kept,
        "removed": rem,
        "masks": np.stack(masks) if masks else np.zeros((0, gh, gw), dtype=bool),
        "removed_patches": per_block,
        "gflops": float(_cpu(stats.gflops)[index]),
        "native_gflops": None if native_gflops is None else float(native_gflops),
    }


def concat_stats(stats: Any) -> Dict[str, torch.Tensor]:
    """``gate`` [N, L], ``removed`` [N, L], ``tokens`` [N, L], ``gflops`` [N] on the CPU.

    ``stats``: one :class:`~timm_dora.engine.patch.DoraStats`, a list of them (e.g. one per batch of a
    dataset), or a mapping with those (already concatenated) tensors.
    """
    if isinstance(stats, Mapping):
        items = [stats]
    elif isinstance(stats, (list, tuple)):
        items = list(stats)
    else:
        items = [stats]
    if not items:
        raise ValueError("no statistics given")

    def get(s, key):
        v = s[key] if isinstance(s, Mapping) else getattr(s, key)
        return _cpu(torch.as_tensor(v))

    out = {k: torch.cat([get(s, k) for s in items]) for k in ("gate", "removed", "tokens", "gflops")}
    out["gate"] = out["gate"].bool()
    return out


def policy_data(stats: Any, native_gflops: float, bins: Union[int, str] = "auto") -> Dict[str, Any]:
    """Policy statistics over a dataset (paper Fig. 3), from DoraStats of every image.

    Returns (per block ``l`` of ``L``, as numpy arrays): ``rate`` (share of images whose gate
    opened), ``active`` (their count), ``budget_min``/``budget_max``/``budget_mean`` of
    ``stats.removed`` over gate-active images (NaN where none), ``collapsed`` (a single budget
    for every active image); per image: ``reduction`` = ``100 (1 - gflops / native_gflops)``
    (percent of the native GFLOPs saved) with ``reduction_min/mean/max``; ``hist_counts``,
    ``hist_edges`` (``np.histogram`` of ``reduction``); ``num_images``, ``native_gflops``,
    ``gflops_mean``.
    """
    s = concat_stats(stats)
    gate, removed, gflops = s["gate"].numpy(), s["removed"].numpy(), s["gflops"].double().numpy()
    n, depth = gate.shape
    active = gate.sum(0)
    bmin = np.full(depth, np.nan)
    bmax = np.full(depth, np.nan)
    bmean = np.full(depth, np.nan)
    for l in range(depth):
        k = removed[gate[:, l], l]
        if k.size:
            bmin[l], bmax[l], bmean[l] = k.min(), k.max(), k.mean()
    reduction = 100.0 * (1.0 - gflops / float(native_gflops))
    if isinstance(bins, str) and bins == "auto":
        span = float(reduction.max() - reduction.min()) if n else 0.0
        bins = int(min(30, max(5, math.ceil(span / 1.0)))) if span > 0 else 5
    counts, edges = np.histogram(reduction, bins=bins)
    return {
        "num_images": int(n),
        "depth": int(depth),
        "blocks": np.arange(depth),
        "rate": gate.mean(0) if n else np.zeros(depth),
        "active": active.astype(np.int64),
        "budget_min": bmin,
        "budget_max": bmax,
        "budget_mean": bmean,
        "collapsed": (active > 0) & (bmin == bmax),
        "reduction": reduction,
        "reduction_min": float(reduction.min()),
        "reduction_mean": float(reduction.mean()),
        "reduction_max": float(reduction.max()),
        "hist_counts": counts,
        "hist_edges": edges,
        "native_gflops": float(native_gflops),
        "gflops_mean": float(gflops.mean()),
    }


def read_metrics(path: PathLike) -> List[Dict[str, Any]]:
    """The rows of a training ``metrics.jsonl`` (one JSON object per line; blank lines skipped;
    gzip-compressed where the name ends in ``.gz``)."""
    rows = []
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        for i, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON object ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    return rows


def _column(rows: Sequence[Mapping[str, Any]], key: str) -> Tuple[np.ndarray, np.ndarray]:
    xs = [r["update"] for r in rows if key in r and r[key] is not None]
    ys = [r[key] for r in rows if key in r and r[key] is not None]
    return np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.float64)


def training_data(rows: Sequence[Mapping[str, Any]], target: float = 0.01, window: int = 8) -> Dict[str, Any]:
    """Training dynamics (paper Fig. 4) from ``metrics.jsonl`` rows (:func:`read_metrics`).

    Returns ``update``/``a_u`` (every update: the fidelity coefficient it used), ``check_update``,
    ``d_u`` (each feedback check's paired QC drop, a fraction), ``drop_pp`` (the same in
    percentage points), ``drop_mean_pp`` (mean of the last ``window`` checks' ``drop_pp``, the
    paper's "recent eight-check mean"), ``target_pp`` (``100 target``), and
    ``compression``/``return_mean``/``gflops`` as ``(update, value)`` arrays (empty when a key is
    not in the log).
    """
    rows = sorted(rows, key=lambda r: r["update"])
    upd, a = _column(rows, "a_u")
    cu, d = _column(rows, "d_u")
    drop_pp = 100.0 * d
    mean_pp = np.array([drop_pp[max(0, i - window + 1) : i + 1].mean() for i in range(drop_pp.size)])
    out: Dict[str, Any] = {
        "update": upd,
        "a_u": a,
        "check_update": cu,
        "d_u": d,
        "drop_pp": drop_pp,
        "drop_mean_pp": mean_pp,
        "window": int(window),
        "target_pp": 100.0 * float(target),
        "num_updates": len(rows),
    }
    for key in ("compression", "return_mean", "gflops"):
        out[key] = _column(rows, key)
    return out


def read_results(paths: Union[PathLike, Sequence[PathLike]]) -> List[Dict[str, Any]]:
    """Result rows from eval/bench JSON files.

    A file is a JSON list of rows, an object with a ``rows`` (or ``results``) list (the format of
    ``timm-dora eval``/``bench`` and ``benchmarks/throughput.py``), one row object, or JSON lines.
    Row fields used: ``model``, ``method`` and/or ``config``, ``top1`` (optional), ``gflops``,
    ``images_per_s`` (optional); a file's top-level ``model`` and ``device`` are copied into rows
    that have none. Each row gets ``source`` (the file name).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows: List[Dict[str, Any]] = []
    for path in paths:
        text = Path(path).read_text()
        try:
            doc = json.loads(text)
            docs = doc if isinstance(doc, list) else [doc]
        except json.JSONDecodeError:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        for d in docs:
            if not isinstance(d, Mapping):
                raise ValueError(f"{path}: expected JSON objects, got {type(d).__name__}")
            inner = d.get("rows", d.get("results"))
            items = inner if isinstance(inner, list) else [d]
            for r in items:
                r = dict(r)
                for key in ("model", "device"):
                    if key in d and key not in r and isinstance(d[key], str):
                        r[key] = d[key]
                r.setdefault("source", Path(path).name)
                rows.append(r)
    return rows


def _num(v: Any) -> Optional[float]:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _is_dora(method: str) -> bool:
    m = method.lower()
    return "dora" in m or m.startswith("actor")


def _config_text(config: Any) -> str:
    if isinstance(config, Mapping):
        return ", ".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None)
    return "" if config is None else str(config)


def tradeoff_data(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Points for top-1 vs GFLOPs and top-1 vs throughput (paper Fig. 5), per model.

    A point is a ``(model, method, config)``; rows naming the same one are merged, the first value
    of each field winning (e.g. ``top1`` from an eval file, ``images_per_s`` from a bench file of
    the same method and config). Rows without ``method`` use ``config`` as the method. A point's
    ``label`` is its method, with the config added when one model has the method under several
    configs. Returns ``{"models": [...], "labels": [...], "points": {model: [{"label", "method",
    "config", "top1", "gflops", "images_per_s", "dora"}, ...]}, "has_top1": {model: bool},
    "devices": [...]}``. A model without any ``top1`` is drawn as throughput vs GFLOPs instead.
    """
    merged: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
    devices: List[str] = []
    for r in rows:
        model = str(r.get("model", "?"))
        if r.get("method") is not None:
            method, config = str(r["method"]), _config_text(r.get("config"))
        else:
            method, config = _config_text(r.get("config")) or "?", ""
        p = merged.setdefault((model, method, config), {
            "model": model, "method": method, "config": config, "top1": None, "gflops": None, "images_per_s": None})
        for key in ("top1", "gflops", "images_per_s"):
            if p[key] is None:
                p[key] = _num(r.get(key))
        if r.get("device") and r["device"] not in devices:
            devices.append(str(r["device"]))
    configs: Dict[Tuple[str, str], int] = {}
    for model, method, _ in merged:
        configs[(model, method)] = configs.get((model, method), 0) + 1
    models: List[str] = []
    labels: List[str] = []
    points: Dict[str, List[Dict[str, Any]]] = {}
    for (model, method, config), p in merged.items():
        label = method
        if configs[(model, method)] > 1 and config:
            label += f" [{config if len(config) <= 40 else config[:37] + '...'}]"
        if model not in models:
            models.append(model)
        if label not in labels:
            labels.append(label)
        points.setdefault(model, []).append({**p, "label": label, "dora": _is_dora(method)})
    return {
        "models": models,
        "labels": labels,
        "points": points,
        "has_top1": {m: any(p["top1"] is not None for p in points[m]) for m in models},
        "devices": devices,
    }


def is_sweep(doc: Any) -> bool:
    """Whether a JSON document is a trade-off sweep of ``benchmarks/tradeoff.py`` (native, DORA,
    static and ToMe tables of one backbone)."""
    return isinstance(doc, Mapping) and all(k in doc for k in ("native", "dora", "static", "tome"))


def _pt(row: Mapping[str, Any]) -> Tuple[float, float, float]:
    return float(row["gflops"]), float(row["drop_pp"]), float(row.get("drop_se_pp") or 0.0)


def sweep_data(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """Points of a trade-off sweep (``benchmarks/tradeoff.py``), drop against GFLOPs, every number as
    the document has it: ``series`` maps a name to its ``(gflops, drop_pp, drop_se_pp)`` points
    (``static <blocks>`` per block family and ``ToMe`` in order of GFLOPs, ``DORA checkpoints``,
    ``DORA seeds``), ``dora`` is the point of the seed chosen on dev, or on the pool where the sweep
    says so (``chosen_on``: ``"dev"`` or ``"pool"``; the published actor where the sweep published
    one), ``random_selector`` DORA's gates and budgets with random tokens;
    ``native_gflops`` is native's (drop 0)."""
    if not is_sweep(doc):
        raise ValueError("not a trade-off sweep (benchmarks/tradeoff.py): it needs native, dora, static and tome")
    series: Dict[str, List[Tuple[float, float, float]]] = {}
    # (a trimmed ablation table keeps a note instead of a sweep it shares with its backbone's main table)
    for s in doc["static"] if isinstance(doc["static"], list) else []:
        name = " ".join(w for w in ("static", s.get("rule"), "blocks", s.get("family", "?")) if w)
        series.setdefault(name, []).append(_pt(s))
    series["ToMe r=" + "..".join(str(r["r"]) for r in (doc["tome"][0], doc["tome"][-1]))] = [_pt(r) for r in doc["tome"]]
    for name in list(series):
        series[name].sort()
    if doc.get("checkpoints"):
        series["DORA checkpoints"] = [_pt(c) for c in doc["checkpoints"]]
    series["DORA seeds"] = [_pt(s) for s in doc["dora"].get("seeds", [])]
    return {
        "model": str(doc.get("model", "?")), "device": doc.get("device"), "split": doc.get("split"),
        "n_images": doc.get("n_images"), "native_gflops": float(doc["native"]["gflops"]),
        "native_top1": float(doc["native"]["top1"]), "series": series, "dora": _pt(doc["dora"]),
        "dora_seed": doc["dora"].get("seed"),
        "chosen_on": "pool" if (doc.get("published_seed") or {}).get("choice") else "dev",
        "random_selector": _pt(doc["random_selector"]) if doc.get("random_selector") else None,
    }


def is_comparison(doc: Any) -> bool:
    """Whether a JSON document is a comparison run of ``benchmarks/baselines.py`` (one backbone:
    native, DORA's curve, every method's sweep)."""
    return isinstance(doc, Mapping) and all(k in doc for k in ("native", "dora", "methods", "shift"))


def comparison_data(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The curves of a comparison run (``benchmarks/baselines.py``), every number as the document
    has it: ``curves`` maps a label to its points ``{knob, gflops, top1, images_per_s}`` in order of
    GFLOPs, DORA's calibrated curve (the published actor included) under ``"DORA"``."""
    if not is_comparison(doc):
        raise ValueError("not a comparison run (benchmarks/baselines.py): it needs native, dora, methods and shift")

    def pts(rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        keep = ("knob", "gflops", "top1", "images_per_s")
        return sorted(({k: r.get(k) for k in keep} for r in rows), key=lambda p: float(p["gflops"]))

    curves = {"DORA": pts(doc["dora"]["curve"])}
    for m in doc["methods"].values():
        curves[str(m["label"])] = pts(m["sweep"])
    nat = doc["native"]
    return {"model": str(doc.get("model", "?")), "device": doc.get("device"),
            "split": (doc.get("data") or {}).get("split"), "n_images": (doc.get("data") or {}).get("images"),
            "native": {"gflops": float(nat["gflops"]), "top1": float(nat["top1"]), "images_per_s": nat.get("images_per_s")},
            "curves": curves}
