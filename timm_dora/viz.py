"""Pictures of DORA: per-image pruning trajectories, policy statistics, training dynamics, trade-offs.

Numbers and drawing are kept apart. The ``*_data`` functions turn the existing outputs
(:class:`~timm_dora.patch.DoraStats`, ``metrics.jsonl`` rows of :mod:`timm_dora.train`, eval/bench
JSON) into plain dicts of Python numbers and numpy arrays, reading every number from those outputs
(kept tokens from ``stats.tokens``, budgets from ``stats.removed``, GFLOPs from ``stats.gflops``,
``a_u``/``d_u`` from the log) and never recomputing them another way. The ``plot_*`` functions
draw such a dict and return a matplotlib ``Figure``; :func:`save` writes it as PNG and/or SVG.

    stats = model.dora_stats                                       # after a wrapped forward
    data = trajectory_data(stats, 0, model=model, image=images[0])
    save(plot_trajectory(data), "out/trajectory")                  # out/trajectory.png, .svg

    fig, datas = trajectory_grid(model, images)                    # runs the wrapped model
    plot_policy(policy_data(list_of_stats, native_gflops(model)))
    plot_training(training_data(read_metrics("runs/x/metrics.jsonl")))
    plot_tradeoff(tradeoff_data(read_results(["eval.json", "bench.json"])))

Artists carrying plotted values have a ``gid`` (``"trajectory-0-3"``, ``"a_u"``, ``"drop_mean"``,
...), so ``fig.findobj(lambda a: a.get_gid() == "a_u")`` finds them. Blocks are numbered from 0,
as in ``DoraStats`` and the paper. matplotlib (the ``viz`` extra) is imported only inside the
drawing functions; figures are built with ``matplotlib.figure.Figure`` (no pyplot, no GUI backend).

The ``timm-dora viz`` command (:func:`add_parser`): ``trajectory``, ``policy``, ``training`` and
``tradeoff`` pictures, each written with its numbers as JSON next to it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "patch_geometry",
    "to_uint8_image",
    "grey_patches",
    "trajectory_data",
    "concat_stats",
    "policy_data",
    "read_metrics",
    "training_data",
    "read_results",
    "tradeoff_data",
    "plot_trajectory",
    "plot_trajectory_grid",
    "plot_policy",
    "plot_training",
    "plot_tradeoff",
    "trajectory",
    "trajectory_grid",
    "collect_stats",
    "save",
    "add_parser",
]

PathLike = Union[str, "os.PathLike[str]"]
FORMATS = ("png", "svg")
GREY = 200  # uint8 grey that removed patches are faded towards
KEEP = 0.25  # share of the original pixel left in a removed patch

# readable defaults for every picture (applied with rc_context while a figure is built and saved)
_RC = {
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.fonttype": "none",  # text stays text in SVG
    "svg.hashsalt": "timm-dora",  # reproducible SVG ids
}


# ============================================================================================
# plot data (no matplotlib)
# ============================================================================================


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
    from .data import data_config

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
    """The trajectory of image ``index`` of a forward's :class:`~timm_dora.patch.DoraStats`.

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
            from .flops import native_gflops as _native

            native_gflops = _native(model)
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

    ``stats``: one :class:`~timm_dora.patch.DoraStats`, a list of them (e.g. one per batch of a
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
    """The rows of a training ``metrics.jsonl`` (one JSON object per line; blank lines skipped)."""
    rows = []
    with open(path) as f:
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


# ============================================================================================
# drawing (matplotlib imported lazily)
# ============================================================================================


def _figure(**kwargs):
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kwargs)


def _rc():
    import matplotlib

    return matplotlib.rc_context(_RC)


def _wrap_title(text: str, width_in: float) -> str:
    """``text`` wrapped at spaces to lines that fit ``width_in`` inches at the figure-title size."""
    import textwrap

    chars = max(20, int(width_in * 72 / (0.55 * _RC["figure.titlesize"])))
    return "\n".join(textwrap.wrap(text, chars, break_on_hyphens=False))


def _suptitle(fig, text: str) -> None:
    """A figure title wrapped to the figure's width, so that it is never clipped."""
    fig.suptitle(_wrap_title(text, fig.get_figwidth()))


def _block_ticks(ax, depth: int) -> None:
    step = 1 if depth <= 16 else int(math.ceil(depth / 12))
    ax.set_xticks(list(range(0, depth, step)))
    ax.set_xlim(-0.6, depth - 0.4)


def _row_label(data: Mapping[str, Any]) -> str:
    name = data.get("name") or f"image {data['index']}"
    g, native = data["gflops"], data.get("native_gflops")
    text = f"{name}\n{g:.2f} GFLOPs"
    if native:
        text += f" ({100.0 * (g / native - 1.0):+.1f} %)"
    return text


def _draw_trajectory_row(axes, data: Mapping[str, Any], row: int) -> None:
    n0 = data["num_patches"]
    img = data["image"]
    ph, pw = data["patch_size"]
    gh, gw = data["grid_size"]
    if img is None:  # no picture: a white canvas with the patch grid
        img = np.full((gh * ph, gw * pw, 3), 255, dtype=np.uint8)
    ax = axes[0]
    ax.imshow(img, interpolation="antialiased", gid=f"trajectory-{row}-input")
    ax.set_title(f"input: {n0} tokens" if data["blocks"] else f"{n0} kept (gate never opened)")
    ax.set_ylabel(_row_label(data), fontsize=9)
    for j, (l, k, mask) in enumerate(zip(data["blocks"], data["kept"], data["masks"]), start=1):
        ax = axes[j]
        ax.imshow(grey_patches(img, mask, (ph, pw)), interpolation="antialiased", gid=f"trajectory-{row}-{l}")
        ax.set_title(f"block {l}: {k} kept")
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
        for s in ax.spines.values():
            s.set_visible(True)
            s.set_linewidth(0.5)


def plot_trajectory_grid(datas: Sequence[Mapping[str, Any]], title: Optional[str] = None, panel: float = 1.75):
    """Several trajectories (one row per image, from :func:`trajectory_data`), side by side.

    Column 0 is the input; then one panel per block where that image's gate opened, titled
    ``"block l: N kept"``, with the patches removed up to that block greyed out. Each image's own
    panels image ``i`` / block ``l`` have ``gid = f"trajectory-{i}-{l}"``.
    """
    if not datas:
        raise ValueError("no trajectories to draw")
    ncols = 1 + max(len(d["blocks"]) for d in datas)
    nrows = len(datas)
    width = panel * ncols + 0.6
    lines = _wrap_title(title, width).count("\n") + 1 if title else 0
    with _rc():
        fig = _figure(figsize=(width, panel * nrows + 0.1 + 0.25 * lines))
        grid = fig.subplots(nrows, ncols, squeeze=False)
        for i, data in enumerate(datas):
            _draw_trajectory_row(grid[i], data, i)
            for ax in grid[i][1 + len(data["blocks"]):]:
                ax.set_visible(False)
        if title:
            _suptitle(fig, title)
    return fig


def plot_trajectory(data: Mapping[str, Any], title: Optional[str] = None, panel: float = 1.75):
    """One image's trajectory (see :func:`plot_trajectory_grid`)."""
    return plot_trajectory_grid([data], title, panel)


def plot_policy(data: Mapping[str, Any], title: Optional[str] = None):
    """Policy summary (paper Fig. 3): intervention rate per block, min-max and mean budget per
    block over gate-active images (a filled point where the budget collapsed to one value), and the
    histogram of per-image GFLOPs reduction relative to native.

    gids: ``rate-{l}`` (the bar of block ``l``), ``budget_range``, ``budget_mean``, ``budget_collapsed``,
    ``reduction_hist``, ``reduction_mean``.
    """
    depth = data["depth"]
    blocks = np.asarray(data["blocks"])
    with _rc():
        fig = _figure(figsize=(12.5, 3.8))
        ax_rate, ax_budget, ax_hist = fig.subplots(1, 3, width_ratios=[1, 1, 1.1])

        bars = ax_rate.bar(blocks, 100.0 * np.asarray(data["rate"]), color="#4C72B0", width=0.75)
        for l, patch in zip(blocks, bars):
            patch.set_gid(f"rate-{l}")
        ax_rate.set_ylim(0, 105)
        ax_rate.set_xlabel("block")
        ax_rate.set_ylabel("images with gate open (%)")
        ax_rate.set_title("(a) where the gate intervenes")
        _block_ticks(ax_rate, depth)

        act = np.asarray(data["active"]) > 0
        lo, hi, mean = (np.asarray(data[k]) for k in ("budget_min", "budget_max", "budget_mean"))
        collapsed = np.asarray(data["collapsed"])
        spread = act & ~collapsed
        ax_budget.vlines(blocks[spread], lo[spread], hi[spread], color="#4C72B0", lw=5, alpha=0.45,
                         label="min-max" if spread.any() else None, gid="budget_range")
        ax_budget.plot(blocks[spread], mean[spread], "o", mfc="white", mec="#4C72B0", mew=1.5, ls="none",
                       label="mean" if spread.any() else None, gid="budget_mean")
        ax_budget.plot(blocks[collapsed], mean[collapsed], "o", color="#C44E52", ls="none",
                       label="single budget" if collapsed.any() else None, gid="budget_collapsed")
        ax_budget.set_xlabel("block")
        ax_budget.set_ylabel("tokens removed per image")
        ax_budget.set_title("(b) budget over gate-active images")
        _block_ticks(ax_budget, depth)
        if act.any():
            # headroom above the data for a one-row legend, so that it never covers a range
            ax_budget.set_ylim(0, max(float(np.nanmax(hi)), 1.0) * 1.3)
            ax_budget.legend(loc="upper center", ncols=3, frameon=False, handlelength=1.2, columnspacing=1.0)
        else:
            ax_budget.set_ylim(0, 1)
            ax_budget.text(0.5, 0.5, "the gate never opened", transform=ax_budget.transAxes, ha="center", va="center")
        ax_budget.yaxis.set_major_locator(_max_n(6, integer=True))

        counts, edges = np.asarray(data["hist_counts"]), np.asarray(data["hist_edges"])
        ax_hist.stairs(counts, edges, fill=True, color="#55A868", alpha=0.8, gid="reduction_hist")
        ax_hist.axvline(data["reduction_mean"], color="k", lw=1.2, ls="--", gid="reduction_mean")
        ax_hist.set_xlabel("GFLOPs reduction vs native (%)")
        ax_hist.set_ylabel("images")
        ax_hist.yaxis.set_major_locator(_max_n(6, integer=True))
        ax_hist.set_title(f"(c) per image: {data['reduction_min']:.1f} to {data['reduction_max']:.1f} %, "
                          f"mean {data['reduction_mean']:.1f} % (dashed)")
        ax_hist.xaxis.set_major_locator(_max_n(6))
        sup = f"{data['num_images']} images, mean {data['gflops_mean']:.3f} GFLOPs (native {data['native_gflops']:.3f})"
        _suptitle(fig, f"{title}: {sup}" if title else sup)
    return fig


def _max_n(n: int, integer: bool = False):
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(n, integer=integer)


def plot_training(data: Mapping[str, Any], title: Optional[str] = None):
    """Training dynamics (paper Fig. 4): ``a_u`` per update, the feedback checks' QC drop (points)
    with their recent ``window``-check mean and the target, compression and mean return.

    gids: ``a_u``, ``drop``, ``drop_mean``, ``target``, ``compression``, ``return_mean``.
    """
    with _rc():
        fig = _figure(figsize=(10.5, 6.2))
        axes = fig.subplots(2, 2, sharex=True)
        (ax_a, ax_d), (ax_c, ax_r) = axes
        ax_a.plot(data["update"], data["a_u"], drawstyle="steps-post", color="#4C72B0", gid="a_u")
        ax_a.set_ylabel("fidelity coefficient $a_u$")
        ax_a.set_title("(a) fidelity coefficient")

        if len(data["check_update"]):
            ax_d.plot(data["check_update"], data["drop_pp"], "o", ms=4, color="0.55", ls="none",
                      label="check $d_u$", gid="drop")
            ax_d.plot(data["check_update"], data["drop_mean_pp"], "-o", ms=3, color="#C44E52",
                      label=f"mean of last {data['window']} checks", gid="drop_mean")
        else:
            ax_d.text(0.5, 0.5, "no feedback checks in the log", transform=ax_d.transAxes, ha="center", va="center")
        ax_d.axhline(data["target_pp"], color="k", ls="--", lw=1, label=f"target {data['target_pp']:g} pp", gid="target")
        ax_d.set_ylabel("QC top-1 drop (pp)")
        ax_d.set_title("(b) accuracy feedback")
        ax_d.legend(loc="best", frameon=False)

        for ax, key, label, sub in (
            (ax_c, "compression", "token-layer compression", "(c) compression"),
            (ax_r, "return_mean", "mean return per image", "(d) return"),
        ):
            x, y = data[key]
            if len(x):
                ax.plot(x, y, color="#55A868" if key == "compression" else "#8172B2", gid=key)
            else:
                ax.text(0.5, 0.5, f"no {key} in the log", transform=ax.transAxes, ha="center", va="center")
            ax.set_ylabel(label)
            ax.set_title(sub)
            ax.set_xlabel("PPO update")
        for ax in axes.flat:
            ax.xaxis.set_major_locator(_max_n(8))
        sup = f"{data['num_updates']} updates, {len(data['check_update'])} feedback checks"
        _suptitle(fig, f"{title}: {sup}" if title else sup)
    return fig


_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "8"]


def plot_tradeoff(data: Mapping[str, Any], title: Optional[str] = None):
    """Trade-offs (paper Fig. 5), one column per model: top-1 vs GFLOPs and top-1 vs throughput;
    for a model without top-1 in the results, throughput vs GFLOPs (the axis label says so).

    DORA rows (method containing "dora" or starting with "actor") are stars. Each point has
    ``gid = f"{model}|{label}|{panel}"`` with panel ``gflops``, ``throughput`` or ``throughput_vs_gflops``.
    """
    import matplotlib

    models = data["models"]
    if not models:
        raise ValueError("no result rows to draw")
    any_top1 = any(data["has_top1"].values())
    nrows = 2 if any_top1 else 1
    # one colour per method; one marker per method family (the name before "@"); DORA: a star
    labels = data["labels"]
    method_of = {p["label"]: p["method"] for pts in data["points"].values() for p in pts}
    colors = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    families = list(dict.fromkeys(method_of[m].split("@")[0] for m in labels))
    style = {}
    for i, m in enumerate(labels):
        family = method_of[m].split("@")[0]
        marker = "*" if _is_dora(method_of[m]) else _MARKERS[families.index(family) % len(_MARKERS)]
        style[m] = dict(color=colors(i % colors.N), marker=marker)
    with _rc():
        fig = _figure(figsize=(4.6 * len(models) + 0.4, 3.4 * nrows + 1.0))
        grid = fig.subplots(nrows, len(models), squeeze=False)
        handles: Dict[str, Any] = {}
        for j, model in enumerate(models):
            pts = data["points"][model]
            if data["has_top1"][model]:
                panels = [("gflops", "GFLOPs per image", "top1", "top-1 (%)"),
                          ("throughput", "throughput (images/s)", "top1", "top-1 (%)")]
                xkeys = {"gflops": "gflops", "throughput": "images_per_s"}
            else:
                panels = [("throughput_vs_gflops", "GFLOPs per image", "images_per_s",
                           "throughput (images/s)\n(no top-1 in results)")]
                xkeys = {"throughput_vs_gflops": "gflops"}
            for i in range(nrows):
                ax = grid[i][j]
                if i >= len(panels):
                    ax.set_visible(False)
                    continue
                panel, xlabel, ykey, ylabel = panels[i]
                drawn = 0
                for p in pts:
                    x, y = p[xkeys[panel]], p[ykey]
                    if x is None or y is None:
                        continue
                    st = style[p["label"]]
                    h = ax.plot([x], [y], ls="none", marker=st["marker"], color=st["color"],
                                ms=14 if p["dora"] else 8, mec="k" if p["dora"] else st["color"], mew=0.6,
                                gid=f"{model}|{p['label']}|{panel}")[0]
                    handles.setdefault(p["label"], h)
                    drawn += 1
                if not drawn:
                    ax.text(0.5, 0.5, f"no rows with both {xlabel.split(' (')[0]}\nand {ylabel.split(' (')[0]}",
                            transform=ax.transAxes, ha="center", va="center")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                ax.xaxis.set_major_locator(_max_n(5))
                if i == 0:
                    head, dot, tag = model.partition(".")
                    ax.set_title(f"{head}\n{dot}{tag}" if len(model) > 32 and tag else model)
        ncol = min(len(handles), 4 if len(models) == 1 else 5)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=max(ncol, 1), frameon=False)
        sup = title or "accuracy / efficiency trade-off"
        if data["devices"]:
            sup += f" ({', '.join(data['devices'])})"
        _suptitle(fig, sup)
    return fig


def save(fig, stem: PathLike, formats: Sequence[str] = FORMATS, dpi: int = 110) -> List[Path]:
    """Write ``fig`` as ``stem.png`` and/or ``stem.svg``; returns the paths written."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    with _rc():
        for fmt in formats:
            fmt = fmt.lower().lstrip(".")
            if fmt not in FORMATS:
                raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
            path = stem.with_name(stem.name + "." + fmt)
            kw = {"dpi": dpi} if fmt == "png" else {}
            if fmt == "png":
                kw["metadata"] = {"Software": None}
            else:
                kw["metadata"] = {"Date": None, "Creator": None}
            fig.savefig(path, format=fmt, facecolor="white", **kw)
            paths.append(path)
    return paths


# ============================================================================================
# one-call helpers on a wrapped model
# ============================================================================================


@torch.no_grad()
def trajectory_grid(
    model: torch.nn.Module,
    images: torch.Tensor,
    names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> Tuple[Any, List[Dict[str, Any]]]:
    """Run the wrapped ``model`` on normalised ``images`` ``[B, 3, H, W]`` and draw every image's
    trajectory (rows = images). Returns ``(figure, [trajectory_data, ...])``."""
    from .patch import is_wrapped

    if not is_wrapped(model):
        raise ValueError("trajectory_grid needs a model wrapped by timm_dora.wrap")
    p = next(model.parameters())
    model(images.to(p.device, p.dtype))
    stats = model.dora_stats
    datas = [
        trajectory_data(stats, i, model=model, image=images[i], name=None if names is None else names[i])
        for i in range(images.shape[0])
    ]
    return plot_trajectory_grid(datas, title), datas


def trajectory(model: torch.nn.Module, image: torch.Tensor, name: Optional[str] = None, title: Optional[str] = None):
    """:func:`trajectory_grid` for one normalised image ``[3, H, W]``; returns ``(figure, data)``."""
    fig, datas = trajectory_grid(model, image[None], None if name is None else [name], title)
    return fig, datas[0]


@torch.no_grad()
def collect_stats(model: torch.nn.Module, dataset, batch_size: int = 64, limit: Optional[int] = None) -> List[Any]:
    """Run the wrapped ``model`` over a dataset of ``(image, label, ...)`` items; one DoraStats per batch (on the CPU)."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    subset = torch.utils.data.Subset(dataset, range(n))
    loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, shuffle=False)
    p = next(model.parameters())
    out = []
    for batch in loader:
        model(batch[0].to(p.device, p.dtype))
        s = model.dora_stats
        out.append({k: _cpu(getattr(s, k)) for k in ("gate", "removed", "tokens", "gflops")})
    return out


# ============================================================================================
# CLI: timm-dora viz
# ============================================================================================


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
    from .actor import Actor
    from .patch import wrap
    from .train import create_backbone

    kw = {}
    if args.img_size:
        kw["img_size"] = args.img_size
    if args.num_classes:
        kw["num_classes"] = args.num_classes
    model = create_backbone(args.model, args.weights, **kw).to(args.device)
    if args.actor:
        actor = Actor.from_pretrained(args.actor)
        label = f"trained actor {Path(str(args.actor).rstrip('/')).name or args.actor}"
        updates = ((getattr(actor, "pretrained_config", None) or {}).get("training") or {}).get("updates")
        if updates:
            label += f" ({updates} PPO updates)"
    else:
        torch.manual_seed(args.seed)
        actor = Actor.for_model(model)
        label = f"untrained actor (fresh initialisation, seed {args.seed})"
    wrap(model, actor.eval())
    return model, f"{args.model}, {label}"


def _cmd_trajectory(args) -> int:
    from PIL import Image

    from .data import eval_transform

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
    from .data import eval_transform, open_split
    from .flops import native_gflops

    model, label = _model_and_actor(args)
    ds = open_split(args.data, args.split, eval_transform(model))
    stats = collect_stats(model, ds, args.batch_size, args.limit)
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


def _cmd_tradeoff(args) -> int:
    data = tradeoff_data(read_results(args.results))
    fig = plot_tradeoff(data, args.title)
    _write(fig, Path(args.out), args.name or "tradeoff", data, args)
    return 0


def _guard(cmd):
    """Report missing files and invalid inputs as one line and exit code 2, not a traceback."""

    def run(args) -> int:
        import sys

        try:
            return cmd(args)
        except (FileNotFoundError, ValueError) as e:
            print(f"timm-dora viz {args.picture}: error: {e}", file=sys.stderr)
            return 2

    return run


def _common(p) -> None:
    p.add_argument("--out", required=True, help="output folder (pictures and their numbers as JSON)")
    p.add_argument("--name", default=None, help="file name stem (default: the picture's name)")
    p.add_argument("--format", nargs="+", default=list(FORMATS), choices=FORMATS, help="output formats")
    p.add_argument("--dpi", type=int, default=110, help="PNG resolution")


def _model_args(p) -> None:
    p.add_argument("--model", required=True, help="timm model name, e.g. vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    p.add_argument("--weights", default=None, help="local .safetensors state dict of the backbone")
    p.add_argument("--actor", default=None, help="trained actor (folder or hf-hub:org/name); default: a freshly initialised one")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed of the untrained actor (without --actor)")
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
    t.set_defaults(func=_guard(_cmd_trajectory))

    q = sub.add_parser("policy", help="intervention rate, budgets and GFLOPs reduction over a dataset split")
    _model_args(q)
    q.add_argument("--data", required=True, help="labels CSV (with a split column) or ImageFolder root")
    q.add_argument("--split", default="dev")
    q.add_argument("--batch-size", type=int, default=64)
    q.add_argument("--limit", type=int, default=None, help="use only the first N images of the split")
    _common(q)
    q.set_defaults(func=_guard(_cmd_policy))

    r = sub.add_parser("training", help="a_u, feedback drops, compression and return from metrics.jsonl")
    r.add_argument("--metrics", required=True, help="metrics.jsonl written by timm-dora-train")
    r.add_argument("--target", type=float, default=None,
                   help="target drop as a fraction (default: target_drop of config.json next to the log, else 0.01)")
    r.add_argument("--window", type=int, default=8, help="feedback checks in the running mean")
    r.add_argument("--title", default=None)
    _common(r)
    r.set_defaults(func=_guard(_cmd_training))

    s = sub.add_parser("tradeoff", help="top-1 vs GFLOPs and vs throughput from eval/bench JSON")
    s.add_argument("--results", nargs="+", required=True, help="eval or bench JSON files")
    s.add_argument("--title", default=None)
    _common(s)
    s.set_defaults(func=_guard(_cmd_tradeoff))
