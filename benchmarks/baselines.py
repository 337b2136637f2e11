"""The paper's comparison set on one backbone, as curves with bootstrap intervals (issue #61; not a test).

On one GPU, for one backbone and its published DORA actor:

1. **DORA's operating curve**: the published actor calibrated (``timm-dora calibrate``'s
   :func:`~timm_dora.evaluate.calibrate.calibrate_tilt`) to each ``--dora-targets`` GFLOPs reduction
   on the pool's ``--calibration-splits`` (never ``test``), plus the published actor itself.
2. **Every baseline's sweep of its own knob**: ToMe, MCTF, Representation Shift and Zero-TPrune
   over ``r``, PiToMe over its keep ratio per block; DiffRate over the schedules learned on the pool's
   rollout split (``--diffrate DIR``) and, as the paper runs it, over the authors' published
   schedules (``--diffrate-authors DIR``: DeiT-Ti's, applied to any backbone of 196 patches and 12
   blocks); V-Pruner over the masks its offline search exported (``--vpruner DIR``).
3. For every setting, on the ``--split`` images (the 1,300 ``test`` images): per-image top-1 hits
   and GFLOPs beside native's (top-1, paired drop and its standard error, agreement), and
   throughput at batch ``--batch`` with the App. E.5 protocol (:func:`~timm_dora.evaluate.bench.bench`;
   each method on its own attention path; DORA as ``timm_dora.wrap`` runs it by default).
4. ``vs_dora`` per method: the GFLOPs difference to DORA's curve at matched paired drops of 0.5,
   1.0 and 1.5 pp with a 95 % bootstrap interval over images (:mod:`timm_dora.evaluate.curves`).
5. ``shift``: every method at its setting nearest ``--shift-reduction`` fewer GFLOPs, on corrupted
   copies of the same images (:mod:`timm_dora.evaluate.corruptions`: Gaussian noise, Gaussian blur,
   JPEG, contrast at severities ``--severities``): paired drop against native on the same corrupted
   images, and mean GFLOPs.

Per-setting results are kept in ``--state`` as they are measured, so a command stopped by a time
limit goes on where it stopped when run again; ``--forget M`` measures method ``M`` afresh (after a
change), ``--retime KEY`` times a setting again (a resumed run's reference), ``--report-only``
writes the JSON from the state alone (on any machine; the device and versions stay the measuring
run's). One H100, both Tiny backbones, a few minutes each::

    python -m benchmarks.baselines --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W \\
        --data labels.csv --calibration-data labels_train.csv --diffrate benchmarks/baselines/diffrate \\
        --vpruner benchmarks/baselines/vpruner --out benchmarks/results/baselines_vit_tiny.json

``python -m benchmarks.baselines table OUT...`` prints the README's table from such files.

CPU smoke test (random tiny model): ``--random-weights --img-size 64 --device cpu --batch 4
--warmup 1 --iters 1 --repeats 1 --resamples 20``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmarks.common import command_line, log
from timm_dora.data import eval_transform, open_split, preload
from timm_dora.engine.flops import native_gflops
from timm_dora.evaluate import NativeMethod, environment, load_model, precision_for
from timm_dora.evaluate.accuracy import loader_for
from timm_dora.evaluate.bench import bench, bench_inputs
from timm_dora.evaluate.calibrate import calibrate_tilt
from timm_dora.evaluate.corruptions import corrupt
from timm_dora.evaluate.curves import Point, compare_at_drops, paired_drop
from timm_dora.evaluate.methods import DoraMethod, Method, build_method
from timm_dora.hub import resolve_actor

R_SWEEP = [2, 4, 6, 8, 10, 12, 14, 16, 18]
SWEEPS: Dict[str, Tuple[str, str, List]] = {  # method: (label, knob, values): about 5 % to 55 % fewer GFLOPs on ViT-Ti
    "tome": ("ToMe", "r", R_SWEEP),
    "pitome": ("PiToMe", "ratio", [0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.91, 0.9, 0.88, 0.86]),  # its authors' knob
    "mctf": ("MCTF", "r", R_SWEEP + [20]),  # (block 0 does not fuse: each r removes less)
    "repshift": ("Representation Shift", "r", R_SWEEP),
    "zerotprune": ("Zero-TPrune", "r", R_SWEEP),
}
DORA_TARGETS = [10, 15, 20, 25, 30, 35, 40, 45, 50]
MATCHED_DROPS = (0.5, 1.0, 1.5)


def _file_sweep(folder: Optional[str], model_name: Optional[str]) -> List[str]:
    """The knob files (DiffRate schedules, V-Pruner masks) in ``folder``: those for this backbone's
    architecture, or every one (``model_name=None``: schedules transferred from another backbone)."""
    if not folder:
        return []
    arch = model_name.split(".")[0] if model_name else ""
    return sorted(str(p) for p in Path(folder).glob(f"{arch}*.json"))


class Run:
    """One backbone's measurements, kept per setting in a state file as they are made."""

    def __init__(self, args, t0: float):
        self.args, self.t0 = args, t0
        self.device = torch.device(args.device)
        self.dtype, _ = precision_for(self.device, "auto")
        model = load_model(args.model, args.weights, random_weights=args.random_weights, img_size=args.img_size,
                           seed=args.seed)
        self.model = model.to(self.device, self.dtype).eval()
        self.n0 = self.model.patch_embed.num_patches
        self.native_gflops = native_gflops(self.model)
        ds = open_split(args.data, args.split, eval_transform(self.model))
        if args.limit is not None and args.limit < len(ds):
            ds = torch.utils.data.Subset(ds, range(args.limit))
        self.images01, self.labels = preload(ds, device=self.device, dtype=torch.float32, batch_size=64,
                                             num_workers=args.workers)
        cfg = self.model.pretrained_cfg
        self.mean = torch.tensor(cfg.get("mean", (0.5,) * 3), device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg.get("std", (0.5,) * 3), device=self.device).view(1, 3, 1, 1)
        self.images = self.images01.to(self.dtype)
        self.images01 = self.images01 * self.std + self.mean  # back to [0, 1] for the corruptions
        self.n = self.images.shape[0]
        log(f"{args.model}: {self.n} {args.split} images on {self.device}", t0)
        self.state_path = Path(args.state) if args.state else None
        self.state: Dict[str, Dict] = {}
        if self.state_path is not None and self.state_path.exists():
            self.state = torch.load(self.state_path, weights_only=False)
            log(f"resumed {len(self.state)} measured settings from {self.state_path}", t0)
        # settings measured again in this run (a resumed run's own reference timings), with their
        # earlier throughput kept beside the new one
        for prefix in args.forget:  # settings to measure afresh (a method changed), their shift rows too
            for key in [k for k in self.state if k.startswith(prefix) or k.startswith("shift ") and
                        k.split(" ")[3:4] == [prefix.split(" ")[0]]]:
                del self.state[key]
        self.retimed: Dict[str, Dict] = {}
        for key in args.retime:
            if key in self.state:
                old = self.state.pop(key)
                self.retimed[key] = {"earlier_images_per_s": old.get("images_per_s"),
                                     "earlier_repeats_images_per_s": old.get("repeats_images_per_s")}
        self.inputs, self.bench_info = bench_inputs(self.model, batch=args.batch, batches=args.batches,
                                                    device=self.device, dtype=self.dtype, images=self.images)

    def save(self) -> None:
        if self.state_path is not None:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.state, self.state_path)

    @torch.inference_mode()
    def per_image(self, m: Method, images: torch.Tensor) -> Point:
        hits, gflops = [], []
        for s in range(0, images.shape[0], self.args.batch):
            x, y = images[s : s + self.args.batch], self.labels[s : s + self.args.batch]
            out = m.outputs(x)[m.name]
            hits.append((out.logits.float().argmax(1) == y).cpu())
            gflops.append(out.gflops.double().cpu())
        return Point(None, torch.cat(hits), torch.cat(gflops))

    def measure(self, key: str, make: Callable[[], Method], time_it: bool = True) -> Dict:
        """Per-image hits and GFLOPs of one setting on the clean images, and its throughput."""
        if key in self.state:
            return self.state[key]
        if self.args.report_only:
            raise ValueError(f"--report-only: {key!r} was never measured (run on the GPU first)")
        m = make()
        try:
            p = self.per_image(m, self.images)
            rec: Dict = {"correct": p.correct, "gflops": p.gflops, "config": getattr(m, "config", {})}
            if time_it:
                res = bench(m.timing_fn(), self.inputs, warmup=self.args.warmup, iters=self.args.iters,
                            repeats=self.args.repeats)
                rec.update(images_per_s=res["images_per_s"], repeats_images_per_s=res.get("repeats_images_per_s"),
                           attention_ops=res.get("attention_ops"))
        finally:
            if hasattr(m, "close"):
                m.close()
        self.state[key] = rec
        self.save()
        log(f"{key:34s} top-1 {100 * rec['correct'].float().mean():6.2f}  {rec['gflops'].mean():6.3f} GFLOPs  "
            f"{rec.get('images_per_s', float('nan')):9.0f} img/s", self.t0)
        return rec

    def corrupted(self, family: str, severity: int) -> torch.Tensor:
        out = torch.empty_like(self.images)
        for s in range(0, self.n, 256):
            x = corrupt(self.images01[s : s + 256], family, severity, seed=self.args.seed + s)
            out[s : s + 256] = ((x - self.mean) / self.std).to(self.dtype)
        return out


def _knob(v):
    """A knob as the JSON shows it: a number, or a schedule / mask file's name."""
    return Path(v).name if isinstance(v, str) else v


def _row(rec: Dict, native: torch.Tensor, knob) -> Dict:
    c = rec["correct"]
    return {"knob": knob, "top1": 100.0 * float(c.float().mean()), **paired_drop(native, c),
            "agreement": None, "gflops": float(rec["gflops"].mean()), "images_per_s": rec.get("images_per_s"),
            "repeats_images_per_s": rec.get("repeats_images_per_s"), "attention_ops": rec.get("attention_ops"), "config": rec.get("config")}


def run(args, t0: float) -> Dict:
    r = Run(args, t0)
    native = r.measure("native", lambda: NativeMethod(r.model))
    nat_c = native["correct"]

    # DORA: the published actor and its calibrated curve
    actor = resolve_actor(r.model, args.actor)
    unreachable: List[Dict] = []
    if args.calibration_data:
        cal_batches = [x.to(r.device, r.dtype) for split in args.calibration_splits
                       for x, *_ in loader_for(r.model, args.calibration_data, split, batch=args.batch, workers=args.workers)]
    dora_points: List[Tuple[object, Dict]] = []
    dora_points.append(("published", r.measure("dora published", lambda: DoraMethod(r.model, actor, cuda_graphs=None))))
    for target in args.dora_targets:
        key = f"dora calibrated {target:g}"
        if key not in r.state and not args.calibration_data:
            continue  # (a resumed run without the pool reuses the tilts it found before)
        if key not in r.state:
            try:
                tilted, record = calibrate_tilt(r.model, actor, cal_batches, float(target), steps=args.calibration_steps)
            except ValueError as e:  # (no tilt reaches it: the curve has no point there)
                unreachable.append({"target_reduction_pct": target, "reason": str(e)})
                log(f"{key}: {e}", t0)
                continue
            rec = r.measure(key, lambda: DoraMethod(r.model, tilted, cuda_graphs=None))
            rec["calibration"] = {**{k: record[k] for k in ("tilt_per_token", "target_reduction_pct", "reduction_pct",
                                                            "images") if k in record},
                                  "data": args.calibration_data, "splits": list(args.calibration_splits)}
            r.save()
        dora_points.append((target, r.state[key]))

    # the baselines' sweeps
    methods: Dict[str, Dict] = {}
    specs: List[Tuple[str, str, str, str, List]] = [  # (key, method, label, knob, values)
        (name, name, label, knob, (args.r if knob == "r" else None) or vals)
        for name, (label, knob, vals) in SWEEPS.items() if name in args.methods]
    for name, method, label, knob, files in (
            ("diffrate", "diffrate", "DiffRate", "schedule", _file_sweep(args.diffrate, args.model)),
            ("diffrate_authors", "diffrate", "DiffRate (authors' schedules)", "schedule",
             _file_sweep(args.diffrate_authors, None)),
            ("vpruner", "vpruner", "V-Pruner", "mask", _file_sweep(args.vpruner, args.model))):
        if name.split("_")[0] in args.methods and files:
            specs.append((name, method, label, knob, files))
    for name, method, label, knob, vals in specs:
        recs = []
        for v in vals:
            kw = {knob: v}
            recs.append((v, r.measure(f"{name} {_knob(v)}", lambda: build_method(r.model, method, **kw))))
        methods[name] = {"label": label, "method": method, "knob": knob, "recs": recs}

    # curves, matched comparisons
    dora_curve = [Point(k, rec["correct"], rec["gflops"]) for k, rec in dora_points]
    out_methods = {}
    for name, m in methods.items():
        pts = [Point(v, rec["correct"], rec["gflops"]) for v, rec in m["recs"]]
        vs = compare_at_drops(pts, dora_curve, nat_c, MATCHED_DROPS, resamples=args.resamples, seed=args.seed) if pts else []
        out_methods[name] = {"label": m["label"], "knob": m["knob"],
                             "sweep": [_row(rec, nat_c, _knob(v)) for v, rec in m["recs"]],
                             "vs_dora": vs}
    log("matched comparisons done", t0)

    # shift: every method at its setting nearest the reduction
    target_g = r.native_gflops * (1 - args.shift_reduction / 100)
    chosen = {"dora": min(dora_points, key=lambda p: abs(float(p[1]["gflops"].mean()) - target_g))}
    for name, m in methods.items():
        if m["recs"]:
            chosen[name] = min(m["recs"], key=lambda p: abs(float(p[1]["gflops"].mean()) - target_g))
    sets: Dict[Tuple[str, int], torch.Tensor] = {}  # corrupted copies, made when first needed

    def images_for(fam: str, sev: int) -> torch.Tensor:
        if (fam, sev) not in sets:
            sets[fam, sev] = r.corrupted(fam, sev)
        return sets[fam, sev]

    def shift_key(fam: str, sev: int, name: str, v) -> str:
        return f"shift {fam} {sev} {name} {_knob(v)}"

    pairs = [(fam, sev) for fam in args.families for sev in args.severities]
    for name, v in [("native", None)] + [(n, p[0]) for n, p in chosen.items()]:
        todo = [(f, s) for f, s in pairs if shift_key(f, s, name, v) not in r.state]
        if not todo or args.report_only:
            continue
        if name == "native":
            m: Method = NativeMethod(r.model)
        elif name == "dora":
            a = actor if v == "published" else actor.tilted(r.state[f"dora calibrated {v:g}"]["calibration"]["tilt_per_token"])
            m = DoraMethod(r.model, a, cuda_graphs=None)
        else:
            m = build_method(r.model, methods[name]["method"], **{methods[name]["knob"]: v})
        try:
            for fam, sev in todo:
                p = r.per_image(m, images_for(fam, sev))
                r.state[shift_key(fam, sev, name, v)] = (p.correct, p.gflops)
        finally:
            if hasattr(m, "close"):
                m.close()
        r.save()
        log(f"shift: {name} {_knob(v)} on {len(todo)} corrupted sets", t0)
    shift_rows = []
    missing = []  # (only with --report-only: shift rows its GPU runs never measured)
    for fam, sev in pairs:
        nat_s = r.state[shift_key(fam, sev, "native", None)][0]
        for name, (v, _) in chosen.items():
            if shift_key(fam, sev, name, v) not in r.state:
                missing.append({"method": name, "knob": _knob(v), "family": fam, "severity": sev})
                continue
            c, g = r.state[shift_key(fam, sev, name, v)]
            shift_rows.append({"method": name, "knob": _knob(v), "family": fam, "severity": sev,
                               "native_top1": 100.0 * float(nat_s.float().mean()), **paired_drop(nat_s, c),
                               "gflops": float(g.mean())})

    env = environment(r.device, args.command)
    if args.report_only:  # the numbers are the GPU runs': their device and versions, this command beside them
        measured = json.loads(Path(args.out).read_text())
        env = {**{k: measured[k] for k in env if k in measured}, "report_command": args.command}
        r.retimed = r.retimed or measured.get("retimed", {})
    payload = {
        **env,
        "dtype": measured["dtype"] if args.report_only else str(r.dtype).replace("torch.", ""),
        "model": args.model,
        "weights": args.weights or ("random" if args.random_weights else "timm-pretrained"),
        "data": {"spec": str(args.data), "split": args.split, "images": r.n},
        "protocol": {"batch": args.batch, "batches": r.bench_info["batches"], "warmup": args.warmup, "iters": args.iters,
                     "repeats": args.repeats, "statistic": "median over repeats", "bootstrap_resamples": args.resamples,
                     "matched_drops_pp": list(MATCHED_DROPS),
                     "matching": "each curve's paired drops made monotone in GFLOPs (isotonic regression), then the GFLOPs "
                                 "where it reaches the drop (linear interpolation, no extrapolation); difference = "
                                 "method - DORA (positive: DORA needs less); 95 % percentile interval over image "
                                 "resamples (timm_dora.evaluate.curves)"},
        "native": {"top1": 100.0 * float(nat_c.float().mean()), "gflops": r.native_gflops,
                   "images_per_s": native.get("images_per_s"), "attention_ops": native.get("attention_ops")},
        "dora": {"actor": str(args.actor or "published (" + args.model + ")"),
                 "calibrated_on": next(({"data": rec["calibration"].get("data", args.calibration_data),
                                         "splits": rec["calibration"].get("splits", args.calibration_splits)}
                                        for k, rec in dora_points if k != "published"), None),
                 "unreachable_targets": unreachable,
                 "curve": [{**_row(rec, nat_c, k), "calibration": rec.get("calibration")} for k, rec in dora_points]},
        "methods": out_methods,
        "retimed": {k: {**v, "images_per_s": r.state[k].get("images_per_s"),
                        "repeats_images_per_s": r.state[k].get("repeats_images_per_s")} for k, v in r.retimed.items()},
        **({"note": args.note} if args.note else {}),
        "shift": {"reduction_target_pct": args.shift_reduction, "missing": missing, "implementation": "timm_dora.evaluate.corruptions "
                  "(torch, torchvision blur, PIL JPEG, with ImageNet-C's parameters)", "rows": shift_rows},
    }
    return payload


def table(docs: List[Dict]) -> str:
    """The README's table from comparison runs: per backbone native, DORA's published actor and each
    method at its setting nearest DORA's GFLOPs (top-1, GFLOPs, images/s), and the matched
    comparison at a 1.0 pp drop (method - DORA GFLOPs, 95 % interval, verdict; at 1.5 or 0.5 pp,
    said so, where a curve does not reach 1.0 pp)."""
    lines = ["| backbone | method (setting) | top-1 (%) | GFLOPs | images/s | GFLOPs - DORA's at a 1.0 pp drop [95 % CI] |",
             "|---|---|---:|---:|---:|---|"]
    for d in docs:
        bb = d["model"].split("_patch")[0]
        nat = d["native"]
        lines.append(f"| {bb} | native | {nat['top1']:.2f} | {nat['gflops']:.3f} | {nat['images_per_s']:,.0f} | |")
        dora = next(p for p in d["dora"]["curve"] if p["knob"] == "published")
        lines.append(f"| {bb} | **DORA** (published) | {dora['top1']:.2f} | {dora['gflops']:.3f} | "
                     f"{dora['images_per_s']:,.0f} | |")
        for m in d["methods"].values():
            if not m["sweep"]:
                continue
            p = min(m["sweep"], key=lambda q: abs(q["gflops"] - dora["gflops"]))
            by_drop = {v["drop_pp"]: v for v in m["vs_dora"] if v["ci95"] is not None}
            at = next((t for t in (1.0, 1.5, 0.5) if t in by_drop), None)
            if at is None:
                vs = "no drop of 0.5-1.5 pp on both curves"
            else:
                v = by_drop[at]
                lo, hi = v["ci95"]
                vs = (f"{v['gflops_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + ("" if at == 1.0 else f" at {at:g} pp") + ": "
                      + {"reference wins": "DORA wins", "method wins": "DORA loses", "unresolved": "tie"}[v["verdict"]])
            knob = re.sub(r"^.*_patch\d+_\d+_", "", str(p["knob"])).replace(".json", "")  # a file: its own part
            lines.append(f"| {bb} | {m['label']} ({m['knob']} {knob}) | {p['top1']:.2f} | {p['gflops']:.3f} | "
                         f"{p['images_per_s']:,.0f} | {vs} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["table"]:  # python -m benchmarks.baselines table FILE... : the README's table
        print(table([json.loads(Path(f).read_text()) for f in argv[1:]]))
        return {}
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--random-weights", action="store_true", help="random backbone (smoke tests)")
    ap.add_argument("--img-size", type=int, default=None, help="override the input size (smoke tests)")
    ap.add_argument("--actor", default=None, help="DORA actor (default: the published one for --model)")
    ap.add_argument("--data", required=True, help="labels CSV with the --split images")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=None, help="first N images only (quick checks)")
    ap.add_argument("--calibration-data", default=None, help="labels CSV of the pool for DORA's calibration")
    ap.add_argument("--calibration-splits", nargs="+", default=["qc", "dev"])
    ap.add_argument("--calibration-steps", type=int, default=10)
    ap.add_argument("--dora-targets", type=float, nargs="+", default=DORA_TARGETS, help="GFLOPs reductions, %%")
    ap.add_argument("--methods", nargs="+", default=list(SWEEPS) + ["diffrate", "vpruner"])
    ap.add_argument("--r", type=int, nargs="+", default=None, help="one r sweep for the methods whose knob is r "
                                                                   "(default: each its own)")
    ap.add_argument("--diffrate", default=None, help="folder of DiffRate schedules (<arch>*.json)")
    ap.add_argument("--diffrate-authors", default=None, help="folder of the authors' DiffRate schedules (every *.json; "
                                                                   "applied to any backbone of the same token count)")
    ap.add_argument("--vpruner", default=None, help="folder of V-Pruner masks (<arch>*.json)")
    ap.add_argument("--shift-reduction", type=float, default=35.0)
    ap.add_argument("--families", nargs="+", default=["gaussian_noise", "gaussian_blur", "jpeg", "contrast"])
    ap.add_argument("--severities", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retime", nargs="*", default=[], help="settings of the state to measure again (e.g. native "
                                                            "'dora published'): a resumed run's timing reference")
    ap.add_argument("--forget", nargs="*", default=[], help="drop the state's settings (and shift rows) of these methods "
                                                             "(e.g. mctf: measured afresh after a change)")
    ap.add_argument("--note", default=None, help="a note kept in the JSON (how the runs behind it went)")
    ap.add_argument("--report-only", action="store_true", help="measure nothing: write --out from the state alone "
                    "(device and versions kept from the --out the measuring run wrote; shift rows never measured "
                    "listed in shift.missing)")
    ap.add_argument("--state", default=None, help="per-setting results, kept for resuming (default: OUT.state.pt)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.command = command_line("baselines", argv)
    if args.split in args.calibration_splits:
        ap.error("--calibration-splits must not include the evaluation split")
    args.state = args.state or args.out + ".state.pt"
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    payload = run(args, t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    log(f"wrote {args.out}", t0)
    return payload


if __name__ == "__main__":
    main()
