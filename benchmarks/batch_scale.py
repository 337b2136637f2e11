"""Does a larger PPO batch learn the same actor? The ablation behind ``--batch-scale``.

On N GPUs the trainer either splits the paper's 256-image update over the processes (the same
maths as one GPU, but little faster: the update is latency-bound) or, with ``--batch-scale N``,
gives every process the paper's batch: N x the rollout images and minibatches per update (the same
optimiser steps per update; each minibatch drawn evenly from the N blocks of 256 images,
``--strata``) and 1/N of the updates, feedback checks and checkpoints, so a run reads
the same images and checks at the same image counts. N processes compute what one process computes
on the whole batch (``tests/test_ddp.py``), so the larger-batch arm runs here on one GPU.

Arms (``--arms``, ``name:flags``) times seeds, all running at once on one GPU, each in a new process
session so that they outlive a device call (limited in time; the runs go on while the machine is
held): ``launch`` starts (or resumes, from ``state.pt``) every run that is not running or finished,
``wait`` reports progress until all are done or the time is up, ``pack`` brings the runs back
without their resumable state. ``curves`` keeps each run's
configuration and per-update record in one small JSON file, finished or not; ``pool`` evaluates
chosen checkpoints deterministically on every pool split (rollout, qc, dev; never ``test``);
``compare`` sets the arms side by side in windows of rollout images seen::

    python -m benchmarks.batch_scale launch --root /tmp/bs --weights W --data pool.csv
    python -m benchmarks.batch_scale wait --root /tmp/bs --minutes 9
    python -m benchmarks.batch_scale pack --root /tmp/bs --out $OUT   # then: cat runs.tgz.part* | tar xz
    python -m benchmarks.batch_scale curves --root /tmp/bs --out curves.json.gz
    python -m benchmarks.batch_scale pool --root /tmp/bs --weights W --data pool.csv \\
        --checkpoints paper_s0:u00600 scale2_s0:u00300 --device cpu --out pool.json
    python -m benchmarks.batch_scale compare --curves curves.json.gz --out compare.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.common import command_line
from benchmarks.train_scale import planned_updates, read_json, run_metrics, train_env

MODEL = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
ARMS = ("paper:", "scale2:--batch-scale 2")


def _runs(args) -> List[tuple]:
    return [(f"{arm.partition(':')[0]}_s{seed}", shlex.split(arm.partition(':')[2]), seed)
            for arm in args.arms for seed in args.seeds]


def _alive(run: Path) -> bool:
    pid = run / "pid"
    if not pid.exists():
        return False
    try:
        os.kill(int(pid.read_text()), 0)
    except (ProcessLookupError, ValueError):
        return False
    # a finished child of a session leader that exited can linger as a zombie: ask ps
    state = subprocess.run(["ps", "-o", "stat=", "-p", pid.read_text().strip()], capture_output=True, text=True).stdout
    return bool(state.strip()) and not state.strip().startswith("Z")


def _done(run: Path) -> bool:
    """Exited cleanly after its last update (a run stopped by ``--max-minutes`` exits cleanly too)."""
    if not ((run / "selection.json").exists() and (run / "finished").exists()) or _alive(run):
        return False
    m = run_metrics(run)
    return bool(m) and m[-1]["update"] >= planned_updates(run)


def launch(args) -> None:
    import torch

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        (root / "env.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    for i, (name, flags, seed) in enumerate(_runs(args)):
        run = root / name
        if _done(run) or _alive(run):
            print(name, "finished" if _done(run) else "running")
            continue
        run.mkdir(parents=True, exist_ok=True)
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus)] if args.gpus > 1 else []
        cmd = [sys.executable, *launcher, "-m", "timm_dora.train", "--model", args.model, "--weights", args.weights,
               "--data", args.data, "--out", str(run), "--seed", str(seed), "--no-progress", *flags,
               *shlex.split(args.extra)]
        if (run / "state.pt").exists():
            cmd.append("--resume")
        # the shell marks a clean exit, so a run killed half-way is told from a finished one
        shell = " ".join(shlex.quote(c) for c in cmd) + f" && touch {shlex.quote(str(run / 'finished'))}"
        env = dict(train_env(), TORCHINDUCTOR_COMPILE_THREADS="1")  # (several runs compile at once)
        if args.devices:  # one-process runs spread over the host's GPUs, in turn
            env["CUDA_VISIBLE_DEVICES"] = args.devices[i % len(args.devices)]
        with open(run / "log", "a") as log:
            proc = subprocess.Popen(["bash", "-c", shell], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        (run / "pid").write_text(str(proc.pid))
        (run / "command").write_text(" ".join(shlex.quote(c) for c in cmd))
        print(name, "started:", " ".join(cmd[1:]))


def wait(args) -> None:
    root, t0 = Path(args.root), time.time()
    while True:
        states = []
        for name, _, _ in _runs(args):
            run = root / name
            m = run_metrics(run)
            planned = planned_updates(run, default=0)
            state = "done" if _done(run) else "running" if _alive(run) else "stopped"
            states.append(state)
            print(f"{name}: {state}, update {m[-1]['update'] if m else 0}/{planned}"
                  + (f", {m[-1]['update_s']:.2f} s/update, C {m[-1]['compression']:.3f}" if m else ""), flush=True)
        if all(s != "running" for s in states) or time.time() - t0 > 60 * args.minutes:
            print("ALL DONE" if all(s == "done" for s in states) else "not all done", flush=True)
            for name, _, _ in _runs(args):
                log = root / name / "log"
                if not _done(root / name) and not _alive(root / name) and log.exists():
                    print(name, "log tail:\n", log.read_text()[-2000:])
            return
        time.sleep(max(1.0, min(args.every, 60 * args.minutes - (time.time() - t0))))  # (never past --minutes)


def stop(args) -> None:
    for name, _, _ in _runs(args):
        run = Path(args.root) / name
        if _alive(run):
            os.killpg(int((run / "pid").read_text()), signal.SIGTERM)
            print(name, "stopped")


def pack(args) -> None:
    """The runs under ``--root`` without their ``state.pt`` (17 MB each, only for resuming) as one
    gzipped tar cut into parts of at most ``--part-mb`` MB in ``--out`` (a device call returns at most
    8 files of 16 MiB). Unpack with ``cat runs.tgz.part* | tar xz``."""
    import io
    import tarfile

    root, out = Path(args.root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.name not in ("state.pt", "pid"):
                tar.add(path, arcname=str(path.relative_to(root)))
    data, size = buf.getvalue(), int(args.part_mb * 2**20)
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    for i, part in enumerate(parts):
        (out / f"runs.tgz.part{i:02d}").write_bytes(part)  # (in order under a glob)
    print(f"{len(data) / 2**20:.1f} MB in {len(parts)} parts")


CURVE_KEYS = ("compression", "gflops", "gate_rate", "a_u", "return_mean", "qc_disagreement", "qc_drop", "dev_gflops",
              "dev_top1", "dev_native_top1", "dev_disagreement")


def _write_json(path: Path, doc) -> None:
    """Compact JSON, gzipped where the name ends in ``.gz`` (curves: a few hundred KB as plain text)."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def curves(args) -> None:
    """Each run's configuration and per-update record (``CURVE_KEYS``, where logged), finished or
    not, into one JSON file (gzipped where ``--out`` ends in ``.gz``): what ``compare`` reads (small
    enough to commit, unlike the runs)."""
    root = Path(args.root)
    env = json.loads((root / "env.json").read_text()) if (root / "env.json").exists() else {}
    out = {"command": command_line("batch_scale", sys.argv[1:]), **env, **json.loads(args.env or "{}"), "runs": {}}
    for run in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").exists()):
        cfg = json.loads((run / "config.json").read_text())
        out["runs"][run.name] = {
            "command": (run / "command").read_text() if (run / "command").exists() else None,
            "finished": (run / "finished").exists(), "seed": cfg["ppo"]["seed"], "batch_scale": cfg.get("batch_scale", 1),
            "rollout_images": cfg["ppo"]["rollout_images"], "updates": cfg["ppo"]["updates"],
            "minibatches": [cfg["ppo"][f"{k}_minibatch"] for k in ("gate", "controller", "critic")],
            "feedback_cadence": cfg["feedback_cadence"], "checkpoint_every": cfg["checkpoint_every"],
            "recipe": cfg["recipe"], "actor_width": cfg["actor_width"],
            "keys": ["update", *CURVE_KEYS],
            "rows": [[m["update"], *(None if m.get(k) is None else round(m[k], 5) for k in CURVE_KEYS)] for m in run_metrics(run)],
        }
        print(run.name, len(out["runs"][run.name]["rows"]), "updates")
    _write_json(Path(args.out), out)


def pool(args) -> None:
    """The given checkpoints (``RUN:NAME``, e.g. ``paper_s0:u00600``) evaluated deterministically
    on every pool split (rollout, qc, dev; never ``test``): GFLOPs, agreement with native and the
    paired labelled drop."""
    import torch

    from timm_dora import unwrap
    from timm_dora.evaluate import build_method, environment, evaluate, load_model, loader_for

    dev = torch.device(args.device)
    model = load_model(args.model, args.weights).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    batches = {s: [(x, y) for x, y, *_ in loader_for(model, args.data, s, batch=100, workers=2)] for s in ("rollout", "qc", "dev")}
    out = {**environment(dev, command_line("batch_scale", sys.argv[1:])), "checkpoints": {}}
    for ck in args.checkpoints:
        run, _, name = ck.partition(":")
        res = {}
        for split, b in batches.items():
            rows = evaluate(model, [build_method(model, "dora", actor=str(Path(args.root) / run / "checkpoints" / name))], b)
            res[split] = {k: rows[-1][k] for k in ("images", "paired_drop", "paired_drop_se", "agreement", "gflops")}
            res[split]["native_gflops"] = rows[0]["gflops"]
        unwrap(model)  # (build_method wrapped it with this checkpoint's actor)
        out["checkpoints"][ck] = res
        print(ck, {s: (round(v["paired_drop"], 2), round(v["agreement"], 2), round(v["gflops"], 3)) for s, v in res.items()},
              flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


def _window(rows: List[list], keys: List[str], key: str, images: int, lo: float, hi: float) -> float:
    i = keys.index(key)
    vals = [r[i] for r in rows if lo < r[0] * images <= hi and r[i] is not None]
    return statistics.fmean(vals) if vals else float("nan")


def seed_bootstrap(a: List[float], b: List[float], resamples: int = 10_000, seed: int = 0) -> Dict[str, float]:
    """``mean(b) - mean(a)`` and its 95 % bootstrap interval over seeds (each arm's runs drawn with
    replacement, ``resamples`` times, seeded). With three seeds an arm has 10 distinct resamples:
    a coarse interval, but one that says what three seeds cannot resolve."""
    rng = random.Random(seed)
    diffs = sorted(statistics.fmean(rng.choices(b, k=len(b))) - statistics.fmean(rng.choices(a, k=len(a)))
                   for _ in range(resamples))
    return {"diff": statistics.fmean(b) - statistics.fmean(a), "low": diffs[int(0.025 * resamples)],
            "high": diffs[int(0.975 * resamples) - 1]}


def compare(args) -> None:
    """Per arm (the runs ``ARM_sSEED`` grouped by ``ARM``), the mean and spread over seeds of the rollouts'
    compression and GFLOPs and of the feedback's pool-wide disagreement, in windows of rollout
    images seen (``--by images``: the arms at equal data) or of updates (``--by updates``: at equal
    policy updates, each clipped by PPO); for every arm after the first, per window its difference
    from the first arm with a 95 % bootstrap interval over seeds (:func:`seed_bootstrap`, ``vs``)."""
    runs = {}
    for f in args.curves:
        runs.update(read_json(Path(f))["runs"])
    arms: Dict[str, List[dict]] = {}
    for name, r in runs.items():  # (runs are named ARM_sSEED)
        arms.setdefault(name.rsplit("_s", 1)[0], []).append(r)
    edges = [args.window * i for i in range(int(args.images // args.window) + 1)]
    out = {"command": command_line("batch_scale", sys.argv[1:]), "by": args.by, "window": args.window, "arms": {}}
    for arm, rs in arms.items():
        table = []
        for lo, hi in zip(edges, edges[1:]):
            row = {args.by: [lo, hi]}
            for key in ("compression", "gflops", "qc_disagreement", "a_u"):
                vals = [_window(r["rows"], r["keys"], key, r["rollout_images"] if args.by == "images" else 1, lo, hi)
                        for r in rs]
                vals = [v for v in vals if v == v]
                row[key] = {"mean": statistics.fmean(vals) if vals else None,
                            "sd": statistics.stdev(vals) if len(vals) > 1 else None, "runs": len(vals), "values": vals}
            table.append(row)
        out["arms"][arm] = {"runs": len(rs), "batch_scale": sorted({r["batch_scale"] for r in rs}),
                            "seeds": sorted(r["seed"] for r in rs), "windows": table}
    first = next(iter(out["arms"].values()), None)
    for arm in list(out["arms"])[1:]:  # against the first arm, window by window
        for w, w0 in zip(out["arms"][arm]["windows"], first["windows"]):
            w["vs"] = {key: seed_bootstrap(w0[key]["values"], w[key]["values"])
                       for key in ("compression", "gflops", "qc_disagreement") if w[key]["values"] and w0[key]["values"]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, a in out["arms"].items():
        mean = lambda w, key: None if w[key]["mean"] is None else round(w[key]["mean"], 3)
        print(name, [(w[args.by][1], mean(w, "compression"), mean(w, "qc_disagreement"))
                     for w in a["windows"] if w["compression"]["mean"] is not None])  # (windows a run reached)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("launch", "wait", "stop", "pack", "curves", "pool", "compare"):
        p = sub.add_parser(name)
        if name != "compare":
            p.add_argument("--root", required=True, help="the folder of the runs")
        if name in ("launch", "wait", "stop"):
            p.add_argument("--arms", nargs="+", default=list(ARMS), help="name:timm-dora-train flags")
            p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
        if name in ("launch", "pool"):
            p.add_argument("--model", default=MODEL)
            p.add_argument("--weights", required=True)
            p.add_argument("--data", required=True, help="labels CSV of the pool (rollout, qc, dev splits)")
        if name == "launch":
            p.add_argument("--extra", default="", help="more flags for every run")
            p.add_argument("--gpus", type=int, default=1, help="processes (GPUs) per run, under torchrun when above 1")
            p.add_argument("--devices", nargs="+", default=None, help="GPUs the runs take in turn (CUDA_VISIBLE_DEVICES)")
        if name == "wait":
            p.add_argument("--minutes", type=float, default=9.0)
            p.add_argument("--every", type=float, default=60.0)
        if name == "curves":
            p.add_argument("--env", default=None, help="JSON of facts to record (device, torch) where the root has no env.json")
        if name == "pool":
            p.add_argument("--checkpoints", nargs="+", required=True, help="RUN:CHECKPOINT, e.g. paper_s0:u00600")
            p.add_argument("--device", default="cuda")
        if name == "pack":
            p.add_argument("--out", required=True, help="a folder for the parts (the device call's $OUT)")
            p.add_argument("--part-mb", type=float, default=15.0)
        if name == "compare":
            p.add_argument("--curves", nargs="+", required=True, help="files written by curves")
            p.add_argument("--by", choices=("images", "updates"), default="images",
                           help="windows of rollout images seen (equal data) or of updates (equal policy steps)")
            p.add_argument("--window", type=int, default=51_200, help="rollout images (or updates) per window")
            p.add_argument("--images", type=int, default=307_200, help="where the windows end (images or updates)")
        if name in ("curves", "pool", "compare"):
            p.add_argument("--out", required=True)
    args = ap.parse_args()
    {"launch": launch, "wait": wait, "stop": stop, "pack": pack, "curves": curves, "pool": pool,
     "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
