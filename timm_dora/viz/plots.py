"""Drawing DORA's pictures (matplotlib, imported only inside the functions): each ``plot_*`` takes
the dict of a ``*_data`` function of :mod:`~timm_dora.viz.data` and returns a
``matplotlib.figure.Figure`` (no pyplot, no GUI backend); :func:`save` writes PNG and/or SVG. Also
one-call helpers that run a wrapped model and draw (:func:`trajectory_grid`)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..data import ReadableBatches
from ..engine import is_wrapped
from .data import _cpu, _is_dora, grey_patches, trajectory_data

__all__ = ["FORMATS", "collect_stats", "plot_policy", "plot_sweep", "plot_tradeoff", "plot_training", "plot_trajectory",
           "plot_trajectory_grid", "save", "trajectory", "trajectory_grid"]

PathLike = Union[str, "os.PathLike[str]"]
FORMATS = ("png", "svg")

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


def _row_label(data: Mapping[str, Any], chars: int = 22) -> str:
    """The row's vertical label: its name cut into lines of at most ``chars`` characters (a label
    longer than the panel's height would be clipped), then its GFLOPs."""
    import textwrap

    name = data.get("name") or f"image {data['index']}"
    g, native = data["gflops"], data.get("native_gflops")
    # break after underscores first (a marked space), inside a word only where it must
    lines = textwrap.wrap(str(name).replace("_", "_\0 "), chars) or [""]
    lines = [ln.replace("\0 ", "").replace("\0", "") for ln in lines]
    lines.append(f"{g:.2f} GFLOPs" + (f" ({100.0 * (g / native - 1.0):+.1f} %)" if native else ""))
    return "\n".join(lines)


def _draw_trajectory_row(axes, data: Mapping[str, Any], row: int, panel: float = 1.75) -> None:
    n0 = data["num_patches"]
    img = data["image"]
    ph, pw = data["patch_size"]
    gh, gw = data["grid_size"]
    if img is None:  # no picture: a white canvas with the patch grid
        img = np.full((gh * ph, gw * pw, 3), 255, dtype=np.uint8)
    ax = axes[0]
    ax.imshow(img, interpolation="antialiased", gid=f"trajectory-{row}-input")
    ax.set_title(f"input: {n0} tokens" if data["blocks"] else f"{n0} kept (gate never opened)")
    ax.set_ylabel(_row_label(data, chars=int(panel * 13)), fontsize=9)  # (about 13 characters an inch at 9 pt)
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
            _draw_trajectory_row(grid[i], data, i, panel)
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




@torch.no_grad()
def trajectory_grid(
    model: torch.nn.Module,
    images: torch.Tensor,
    names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> Tuple[Any, List[Dict[str, Any]]]:
    """Run the wrapped ``model`` on normalised ``images`` ``[B, 3, H, W]`` and draw every image's
    trajectory (rows = images). Returns ``(figure, [trajectory_data, ...])``."""
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
    """Run the wrapped ``model`` over a dataset of ``(image, label, ...)`` items; one DoraStats per batch (on the CPU).
    A dataset of this package's (:func:`timm_dora.data.open_split`) is read as evaluation reads it:
    an unreadable image is left out with one warning naming it."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if hasattr(dataset, "read") and hasattr(dataset, "paths"):
        loader = ReadableBatches(dataset, dataset.transform or (lambda img: img), batch_size, indices=range(n))
    else:
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(n)), batch_size=batch_size,
                                             shuffle=False)
    p = next(model.parameters())
    out = []
    for batch in loader:
        model(batch[0].to(p.device, p.dtype))
        s = model.dora_stats
        out.append({k: _cpu(getattr(s, k)) for k in ("gate", "removed", "tokens", "gflops")})
    return out


def plot_sweep(datas: Sequence[Mapping[str, Any]], title: Optional[str] = None, target_pp: float = 1.0):
    """Drop against GFLOPs, one panel per backbone (dicts of :func:`~timm_dora.viz.data.sweep_data`):
    the static and ToMe sweeps as lines, DORA's checkpoints and seeds as small stars, the seed chosen
    on dev (the published actor where the sweep published one) as a large star with its standard
    error, the random selector as a cross, native at 0 and the ``target_pp`` drop as a dashed line.
    Artists have ``gid = f"{model}|{series}"``."""
    if not datas:
        raise ValueError("no trade-off sweeps to draw")
    colors = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:cyan", "tab:olive")
    with _rc():
        fig = _figure(figsize=(6.0 * len(datas) + 0.6, 5.2))
        axes = fig.subplots(1, len(datas), squeeze=False)[0]
        handles: Dict[str, Any] = {}
        for ax, d in zip(axes, datas):
            m = d["model"]
            lines = [k for k in d["series"] if not k.startswith("DORA")]
            for i, name in enumerate(lines):
                g, y, _ = zip(*d["series"][name]) if d["series"][name] else ((), (), ())
                handles.setdefault(name, ax.plot(g, y, marker="os^v"[i % 4], ms=4, lw=1.2, color=colors[i % len(colors)],
                                                 gid=f"{m}|{name}")[0])
            for name, ms, col in (("DORA checkpoints", 7, "0.6"), ("DORA seeds", 10, "tab:orange")):
                pts = d["series"].get(name) or []
                if pts:
                    g, y, _ = zip(*pts)
                    handles.setdefault(name, ax.plot(g, y, ls="none", marker="*", ms=ms, color=col, gid=f"{m}|{name}")[0])
            g, y, se = d["dora"]
            chosen = f"DORA (seed chosen on {'the pool' if d.get('chosen_on') == 'pool' else 'dev'})"
            handles.setdefault(chosen, ax.errorbar([g], [y], yerr=[se], fmt="*", ms=16, color="tab:red", mec="k", mew=0.6,
                                                   capsize=3, gid=f"{m}|{chosen}"))
            if d.get("random_selector"):
                g, y, _ = d["random_selector"]
                handles.setdefault("DORA gates, random tokens", ax.plot([g], [y], ls="none", marker="X", ms=9, color="k",
                                                                       gid=f"{m}|random selector")[0])
            handles.setdefault("native", ax.plot([d["native_gflops"]], [0.0], ls="none", marker="o", ms=8, color="k",
                                                 mfc="w", gid=f"{m}|native")[0])
            ax.axhline(target_pp, ls="--", lw=0.8, color="0.4")
            ax.axhline(0.0, lw=0.6, color="0.8")
            ys = [y for pts in d["series"].values() for _, y, _ in pts] + [d["dora"][1]]
            top = max([4.0, 3.0 * target_pp, d["dora"][1] + 1.5] + ([d["random_selector"][1] + 0.5] if d.get("random_selector") else []))
            ax.set_ylim(min(-1.0, min(ys) - 0.5), top)  # the steep ends of the sweeps run off the top
            ax.set_xlabel("GFLOPs per image")
            ax.set_ylabel(f"top-1 drop vs native (pp), {d.get('split') or ''} {d.get('n_images') or ''} images")
            ax.set_title(m)
            ax.grid(alpha=0.3)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=2 if len(datas) == 1 else 4,
                   frameon=False)
        devices = sorted({str(d["device"]) for d in datas if d.get("device")})
        _suptitle(fig, (title or "drop against GFLOPs") + (f" ({', '.join(devices)})" if devices else ""))
    return fig


def plot_comparison(datas: Sequence[Mapping[str, Any]], title: Optional[str] = None):
    """The comparison set (dicts of :func:`~timm_dora.viz.data.comparison_data`), one column per
    backbone: top-1 against GFLOPs (top row) and against throughput (bottom row; markers only), every
    method's sweep as a line, DORA's calibrated curve as red stars, native as a ring. Artists have
    ``gid = f"{model}|{label}|{panel}"`` with panel ``gflops`` or ``throughput``."""
    import matplotlib

    if not datas:
        raise ValueError("no comparison runs to draw")
    labels = list(dict.fromkeys(k for d in datas for k in d["curves"]))
    cmap = matplotlib.colormaps["tab10"]
    palette = [cmap(i) for i in range(cmap.N) if i != 3]  # (tab10's red is DORA's alone)
    with _rc():
        fig = _figure(figsize=(5.6 * len(datas) + 0.4, 8.4))
        grid = fig.subplots(2, len(datas), squeeze=False)
        handles: Dict[str, Any] = {}
        for j, d in enumerate(datas):
            m = d["model"]
            for i, (panel, key, xlabel) in enumerate((("gflops", "gflops", "GFLOPs per image"),
                                                      ("throughput", "images_per_s", "throughput (images/s)"))):
                ax = grid[i][j]
                for c, label in enumerate(labels):
                    pts = [p for p in d["curves"].get(label, []) if p.get(key) is not None and p.get("top1") is not None]
                    if not pts:
                        continue
                    dora = label == "DORA"
                    line = panel == "gflops" or dora  # (throughput is not monotone in a knob: markers only)
                    h = ax.plot([p[key] for p in pts], [p["top1"] for p in pts], marker="*" if dora else _MARKERS[c % len(_MARKERS)],
                                ls="-" if line else "none", ms=11 if dora else 5, lw=2.0 if dora else 1.1,
                                color="tab:red" if dora else palette[c % len(palette)],
                                mec="k" if dora else None, mew=0.5, zorder=3 if dora else 2, gid=f"{m}|{label}|{panel}")[0]
                    handles.setdefault(label, h)
                nat = d["native"]
                if nat.get(key) is not None:
                    handles.setdefault("native", ax.plot([nat[key]], [nat["top1"]], ls="none", marker="o", ms=8, color="k",
                                                         mfc="w", gid=f"{m}|native|{panel}")[0])
                ax.set_ylim(nat["top1"] - 8.0, nat["top1"] + 1.0)  # the steep ends of the sweeps run off the bottom
                ax.set_xlabel(xlabel)
                ax.set_ylabel(f"top-1 (%), {d.get('split') or ''} {d.get('n_images') or ''} images")
                ax.grid(alpha=0.3)
                if i == 0:
                    ax.set_title(m)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=5, frameon=False)
        devices = sorted({str(d["device"]) for d in datas if d.get("device")})
        _suptitle(fig, (title or "token reduction: top-1 against GFLOPs and throughput") +
                  (f" ({', '.join(devices)})" if devices else ""))
    return fig
