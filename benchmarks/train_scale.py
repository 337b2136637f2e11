"""Training at the paper's scale on an ImageNet-size image set (issue #56; not a test).

Three steps, each resumable, for runs split over several GPU commands, and a profile:

``make``: an ImageNet-size folder ``ROOT/train/<synset>/<synset>_<k>.JPEG`` made from the 1,000
``sample1000`` images of ``../shared`` (never the ``test`` images): each file a random resized
crop of one source image (scale 0.35-1, aspect 3/4-4/3, random flip) re-encoded as JPEG at one of
ImageNet's typical sizes (500x375, 375x500, 500x333, 500x500, 640x480, ...; quality 75-95), seeded
per file, made by every CPU; then ``timm-dora partition --folder`` draws the splits from it into
``ROOT/splits.csv`` (the README's ImageNet command). Skipped when ``ROOT/complete.json`` says the
same set exists.

``run``: the paper's full recipe (``--recipe paper``, 1,171 updates of 256 streamed rollout
images, feedback every 8 updates on 2,048-image shards, a checkpoint every 50 evaluated on 10,240
dev images, the dev selection) as ``python -m timm_dora.train``, resumed from ``RUN/state.pt`` when
there is one, for at most ``--max-minutes`` (a GPU command's limit). While it runs, a monitor reads
the GPU's used memory (``nvidia-smi``, 2 Hz) and the proportional set size of the trainer and its
data workers (``/proc/*/smaps_rollup``, shared pages counted once). Each run appends a segment to
``RUN/segments.json``; once the recipe is complete, ``--out`` gets the result: ``wall_min`` (the
segments' sum, resuming included), ``first_update_s`` (command start to the end of update 1, from
the update's ``time`` in ``metrics.jsonl``), ``s_per_update`` (median), ``data_wait_fraction``
(the updates' ``data`` phase over their time: waiting for images), ``peak_gpu_gb`` and
``peak_host_gb`` (the segments' maxima).

``ddp``: the same recipe for ``--updates`` updates on one GPU and under ``torchrun`` on ``--gpus``
GPUs of the host, on one set: median seconds per update (after ``--skip`` updates of compiling and
capturing) and ``scaling``, rollout images per second relative to one GPU. Each ``--variants``
entry is one data-parallel run (``name:flags``, where words like ``NCCL_MAX_CTAS=2`` set the run's
environment instead): for example the paper's update of 256 images
split over the GPUs (no flags), and each GPU keeping the one-GPU batch (``--batch-scale N``: the
rollout images and the minibatches times the GPUs, the updates divided by them; the update sees
that many more images). ``--into FILE`` sets the model's entry of ``FILE``'s ``ddp`` (for example
``ddp.deit_base`` of ``train_scale_h100.json``).

``profile`` (CUDA): where an update's time goes that more GPUs do not shorten: the rollout
(``collect``, host-bound) against the plain forward of the same images, its kernel launches and
host waits, and one replay of each captured PPO minibatch step, on a set whose rollout split is held.

``updates`` (one process, or every process under ``torchrun``): a few consecutive updates under the
profiler after a warm-up, as training runs them (the critic's steps beside the next rollout): per
process the phases, the GPU's busy time, the NCCL kernels, the all-reduce calls and their host
time, graph launches and host waits, and optionally each process's Chrome trace: where two GPUs
lose time against one. ``phases`` reads such traces phase by phase: the GPU work each phase
launched (busy time, per stream, NCCL's) and the host time of its launch calls, on the training
thread and beside it (:func:`trace_phases`).

    python -m benchmarks.train_scale make --sources CARRY/sample1000 --root /data/scale
    python -m benchmarks.train_scale run --root /data/scale --run /data/run --model M --weights W \\
        --max-minutes 8 --out benchmarks/results/train_scale_h100.json
    python -m benchmarks.train_scale ddp --root /data/ddp --model deit_base_patch16_224 --gpus 2 \\
        --updates 40 --out OUT/ddp_deit_base.json
    python -m benchmarks.train_scale profile --root /data/small --model deit_base_patch16_224 --batch 128 \\
        --out OUT/profile_deit_base.json
    torchrun --nproc_per_node 2 -m benchmarks.train_scale updates --root /data/ddp --model deit_base_patch16_224 \\
        --extra "--batch-scale 2" --trace-dir OUT --out OUT/updates_deit_base_2.json
    python -m benchmarks.train_scale phases OUT/trace_rank0.json.gz OUT/trace_rank1.json.gz --out phases.json
"""
from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

SIZES = [((500, 375), 40), ((375, 500), 14), ((500, 333), 18), ((333, 500), 6), ((500, 500), 6), ((640, 480), 6),
         ((800, 600), 5), ((1024, 768), 5)]  # (width, height), weight: ImageNet's common shapes
PAPER = {"rollout": 299_776, "qc": 16_384, "dev": 10_240}
RECIPE_UPDATES = 1_171


# ------------------------------------------------------------------------------------------------ make
def _make_class(job) -> int:
    """Every file of one class: ``count`` crops of its source image."""
    from PIL import Image

    source, folder, c, count, seed = job
    img = Image.open(source).convert("RGB")
    w0, h0 = img.size
    os.makedirs(folder, exist_ok=True)
    shapes, weights = zip(*SIZES)
    for k in range(count):
        rng = random.Random((seed * 1_000_003 + c) * 1_000_003 + k)
        area = rng.uniform(0.35, 1.0) * w0 * h0
        ratio = rng.uniform(3 / 4, 4 / 3)
        cw, ch = min(w0, int(round((area * ratio) ** 0.5))), min(h0, int(round((area / ratio) ** 0.5)))
        x, y = rng.randint(0, w0 - cw), rng.randint(0, h0 - ch)
        crop = img.crop((x, y, x + cw, y + ch)).resize(rng.choices(shapes, weights)[0], Image.BICUBIC)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        crop.save(os.path.join(folder, f"{os.path.basename(folder)}_{k:05d}.JPEG"), quality=rng.randint(75, 95))
    return count


def make(args) -> None:
    root = Path(args.root)
    sizes = {"rollout": args.rollout, "qc": args.qc, "dev": args.dev}
    spec = {"sizes": sizes, "seed": args.seed, "sources": len(list(Path(args.sources).glob("*.jpg")))}
    done = root / "complete.json"
    if done.is_file() and json.loads(done.read_text()) == spec:
        print(f"{root}: the set exists")
        return
    sources = sorted(Path(args.sources).glob("*.jpg"))
    if not sources:
        raise SystemExit(f"no *.jpg under {args.sources}")
    total = sum(sizes.values())
    per, extra = divmod(total, len(sources))
    jobs = [(str(s), str(root / "train" / s.stem), c, per + (c < extra), args.seed) for c, s in enumerate(sources)]
    t = time.perf_counter()
    from multiprocessing import Pool

    with Pool(args.workers or os.cpu_count()) as pool:
        made = sum(pool.imap_unordered(_make_class, jobs, chunksize=4))
    t_files = time.perf_counter() - t
    from timm_dora.cli import main as cli

    t = time.perf_counter()
    argv = ["partition", "--folder", str(root / "train"), "--sizes", *[f"{k}={v}" for k, v in sizes.items()],
            "--seed", str(args.seed), "--out", str(root / "splits.csv")]
    if cli(argv) != 0:
        raise SystemExit("partition failed")
    spec.update(files=made, make_s=round(t_files, 1), partition_s=round(time.perf_counter() - t, 1),
                bytes=sum(f.stat().st_size for f in (root / "train").rglob("*.JPEG")))
    done.write_text(json.dumps({k: spec[k] for k in ("sizes", "seed", "sources")}))
    (root / "made.json").write_text(json.dumps(spec, indent=1))
    print(json.dumps(spec))


# ------------------------------------------------------------------------------------------------ monitor
def _descendants(pid: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _pss_gb(pid: int) -> float:
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 2**20  # kB -> GiB


def _gpu_gb(index: str) -> Optional[float]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=10).stdout
        return max(float(x) for x in out.split()) / 1024  # MiB -> GiB
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class Monitor:
    """Peaks of GPU memory in use (nvidia-smi) and of the process tree's PSS, sampled every 0.5 s."""

    def __init__(self, pid: int, gpus: str = "0"):
        self.pid, self.gpus, self.gpu, self.host, self.stop = pid, gpus, 0.0, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.host = max(self.host, _pss_gb(self.pid))
            g = _gpu_gb(self.gpus)
            if g is not None:
                self.gpu = max(self.gpu, g)
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def train_env() -> Dict[str, str]:
    """The environment of a training process started from here (``batch_scale`` too): NVLink
    multicast off (the device tool's KINDS.md), Python output unbuffered."""
    return dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                PYTHONUNBUFFERED="1")


def _train_flags(args, run: Path) -> List[str]:
    flags = ["--model", args.model, "--data", str(Path(args.root) / "splits.csv"), "--out", str(run), "--recipe", "paper",
             "--no-progress"]
    flags += ["--weights", args.weights] if args.weights else ["--random-backbone"]
    return flags + shlex.split(args.extra)


def planned_updates(run: Path, default: int = RECIPE_UPDATES) -> int:
    """The updates the run's configuration asks for (``default`` before it has one: the recipe's)."""
    path = run / "config.json"
    return json.loads(path.read_text())["ppo"]["updates"] if path.exists() else default


def run_metrics(run: Path) -> List[Dict]:
    """The run's ``metrics.jsonl``, one dict per update (none before its first)."""
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.exists() else []


# ------------------------------------------------------------------------------------------------ run
def run(args) -> None:
    run_dir = Path(args.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    segments_file = run_dir / "segments.json"
    segments = json.loads(segments_file.read_text()) if segments_file.exists() else []
    before = run_metrics(run_dir)
    if (run_dir / "selection.json").exists() and before and before[-1]["update"] >= planned_updates(run_dir):
        print("the recipe is complete")
    else:
        cmd = [sys.executable, "-m", "timm_dora.train", *_train_flags(args, run_dir)]
        if args.max_minutes:
            cmd += ["--max-minutes", str(args.max_minutes)]
        if (run_dir / "state.pt").exists():
            cmd.append("--resume")
        start = time.time()
        log = open(run_dir / f"segment{len(segments)}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=train_env())
        mon = Monitor(proc.pid)
        rc = proc.wait()
        mon.close()
        wall = time.time() - start
        after = run_metrics(run_dir)
        new = [m for m in after if m["update"] > (before[-1]["update"] if before else 0)]
        seg = {"command": " ".join(shlex.quote(c) for c in cmd), "rc": rc, "wall_s": round(wall, 1),
               "updates": [new[0]["update"], new[-1]["update"]] if new else None,
               "first_update_s": round(new[0]["time"] - start, 1) if new else None,
               "peak_gpu_gb": round(mon.gpu, 2), "peak_host_gb": round(mon.host, 2)}
        segments.append(seg)
        segments_file.write_text(json.dumps(segments, indent=1))
        print(json.dumps(seg))
        if rc != 0:
            print((run_dir / f"segment{len(segments) - 1}.log").read_text()[-3000:])
            raise SystemExit(rc)
    metrics = run_metrics(run_dir)
    if not metrics or metrics[-1]["update"] < planned_updates(run_dir):
        print(f"update {metrics[-1]['update'] if metrics else 0} of {planned_updates(run_dir)}: run again to resume")
        return
    result = summarise(args, run_dir, segments, metrics)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("segments", "selection")}, indent=1))


def summarise(args, run_dir: Path, segments: List[Dict], metrics: List[Dict]) -> Dict:
    import torch
    import timm

    from benchmarks.common import command_line  # (torch and the package only where a step needs them)

    made = json.loads((Path(args.root) / "made.json").read_text())
    update_s = [m["update_s"] for m in metrics]
    data_s = [m["phases"].get("data", 0.0) for m in metrics]
    selection = json.loads((run_dir / "selection.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "timm": timm.__version__,
        "command": command_line("train_scale") if not args.command_line else args.command_line,
        "train_command": segments[0]["command"],
        "rollout_files": made["sizes"]["rollout"], "qc_files": made["sizes"]["qc"], "dev_files": made["sizes"]["dev"],
        "files_made": made["files"], "set_gb": round(made["bytes"] / 1e9, 2), "make_s": made["make_s"],
        "updates": metrics[-1]["update"],
        "wall_min": round(sum(s["wall_s"] for s in segments) / 60, 2),
        "first_update_s": segments[0]["first_update_s"],
        "s_per_update": round(statistics.median(update_s), 4),
        "data_wait_fraction": round(sum(data_s) / sum(update_s), 4),
        "peak_gpu_gb": max(s["peak_gpu_gb"] for s in segments),
        "peak_host_gb": max(s["peak_host_gb"] for s in segments),
        "skipped_images": metrics[-1].get("skipped_images", 0),
        "recipe": {k: config[k] for k in ("recipe", "feedback_signal", "qc_shards", "checkpoint_every", "selection")},
        "selected": selection["selected"], "violates": selection["violates"],
        "segments": segments,
    }
    result.update(phase_summary(metrics))
    result["targets"] = targets(result)
    return result


def phase_summary(metrics: List[Dict]) -> Dict:
    """Where the recipe's time went: each phase's median over the updates that ran it and its total
    minutes (feedback and checkpoint phases run every 8th and 50th update), and their counts."""
    names = list(dict.fromkeys(k for m in metrics for k in m["phases"]))  # in order of first appearance
    ran = {k: [m["phases"][k] for m in metrics if k in m["phases"]] for k in names}
    return {"phases_median_s": {k: round(statistics.median(v), 4) for k, v in ran.items()},
            "phases_total_min": {k: round(sum(v) / 60, 2) for k, v in ran.items()},
            "feedback_checks": len(ran.get("feedback", [])), "checkpoints": len(ran.get("checkpoint", []))}


def targets(r: Dict) -> Dict[str, bool]:
    """Issue #56's targets for one H100."""
    return {"wall_min<=15": r["wall_min"] <= 15, "first_update_s<=60": r["first_update_s"] <= 60,
            "data_wait_fraction<=0.05": r["data_wait_fraction"] <= 0.05, "peak_gpu_gb<=24": r["peak_gpu_gb"] <= 24,
            "peak_host_gb<=24": r["peak_host_gb"] <= 24, "rollout_files>=299776": r["rollout_files"] >= PAPER["rollout"],
            "updates==1171": r["updates"] == RECIPE_UPDATES}


# ------------------------------------------------------------------------------------------------ profile
def profile(args) -> None:
    """Where an update's fixed time goes, on one GPU: the rollout (``collect``) against the plain
    forward on the same images, its kernel launches and host waits (with the line that waits), and
    one replay of each captured minibatch step (the PPO update is a sequence of such replays)."""
    import collections
    import tempfile
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from timm_dora.engine import run as forward
    from timm_dora.policy import NoPrune
    from timm_dora.train import Trainer, build_parser, config_from_args
    from timm_dora.train.rollout import collect
    from timm_dora.train.runtime import eager_attention
    from benchmarks.common import command_line

    flags = _train_flags(args, Path(tempfile.mkdtemp())) + ["--rollout-data", "held"]
    tr = Trainer(config_from_args(build_parser().parse_args(flags)), sync_phases=True)
    for _ in range(args.warmup):  # compiling, capturing; the last one's phases are recorded
        m = tr.step()
    tr.finish_critic()
    x = tr.images.rollout(tr.u + 1, next(tr.sampler), list(range(args.batch)))

    def ms(fn, n: int) -> float:
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) * 1e3, 2)

    out: Dict = {"model": args.model, "batch": args.batch, "device": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "command": command_line("train_scale"),
                 "phases_synchronised_s": {k: round(v, 4) for k, v in m["phases"].items()}}
    with torch.no_grad(), eager_attention():
        z = forward(tr.model, x, NoPrune())[0].float()
        rollout = functools.partial(collect, tr.model, tr.actor, x, z_native=z, generator=tr.gen)
        out["forward_ms"] = ms(lambda: forward(tr.model, x, NoPrune()), 5)
        out["rollout_ms"] = ms(rollout, 5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # every host wait, with the line that asks for it
            rollout()
            torch.cuda.set_sync_debug_mode(0)
        waits = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        out["rollout_host_waits"] = dict(waits.most_common())
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rollout()
            torch.cuda.synchronize()
        events = prof.key_averages()
        out["rollout_kernel_launches"] = sum(e.count for e in events if "LaunchKernel" in e.key)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]  # the kernels themselves, once each
        out["rollout_kernel_ms"] = round(sum(e.device_time for e in kernels) / 1e3, 2)
    out["replay_ms"] = {str(key): ms(step, 20) for key, step in tr.captured.items()}
    tr.close()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def busy_ms(intervals: List[tuple]) -> float:
    """Milliseconds covered by the union of ``(start_us, end_us)`` intervals (a GPU's busy time:
    kernels of several streams that overlap count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


HOST_CALLS = {"graph_launch": ("cudaGraphLaunch",), "allreduce": ("c10d::allreduce_",),  # (the dispatcher op: once a call)
              "host_wait": ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")}


def trace_summary(events, span_ms: float, updates: int) -> Dict:
    """Per update, from a profile of ``updates`` consecutive updates (``span_ms`` in all): the GPU's
    busy time, the kernels' and the NCCL kernels' time, and the count and host milliseconds of the
    calls in :data:`HOST_CALLS` (graph launches, all-reduces, host waits)."""
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    out = {"wall_ms": round(span_ms / updates, 2),
           "gpu_busy_ms": round(busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / updates, 2),
           "kernel_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / updates, 2),
           "kernels": round(len(kernels) / updates, 1),
           "nccl_kernel_ms": round(sum(e.time_range.elapsed_us() for e in nccl) / 1e3 / updates, 2),
           "nccl_kernels": round(len(nccl) / updates, 1)}
    cpu = [e for e in events if e.device_type.name == "CPU"]
    for key, names in HOST_CALLS.items():
        calls = [e for e in cpu if e.name in names]
        out[f"{key}_calls"] = round(len(calls) / updates, 1)
        out[f"{key}_host_ms"] = round(sum(e.time_range.elapsed_us() for e in calls) / 1e3 / updates, 2)
    return out


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def trace_phases(events: List[Dict]) -> List[Dict]:
    """Each phase of a Chrome trace written by ``updates --trace-dir`` (its ``traceEvents``), in
    order: the window between two ``phase <name>`` markers (:class:`~timm_dora.train.runtime.PhaseClock`
    writes one where a phase ends) and the GPU work *launched* in it, wherever that ran: ``host_ms``
    (the window; ``None`` for the first, which has no start), ``gpu_busy_ms`` (the union of its
    kernels, copies and fills), ``kernels``, ``stream_ms`` (busy milliseconds per stream, NCCL's
    kernels apart under ``"nccl"``), and the host milliseconds of the launch calls (CUDA runtime
    and driver) in the window, by name, on the markers' thread (``main``) and on the others
    (``other``: the critic's steps beside the rollout)."""
    marks = sorted((e["ts"], e["name"][len("phase "):], e["tid"]) for e in events
                   if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase "))
    if not marks:
        raise ValueError("no phase markers in the trace: record it with benchmarks.train_scale updates")
    ends = [t for t, _, _ in marks]
    main = collections.Counter(tid for _, _, tid in marks).most_common(1)[0][0]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    rows = [{"phase": name, "host_ms": None if i == 0 else round((t - ends[i - 1]) / 1e3, 3), "gpu": [],
             "stream_ms": collections.Counter(), "main": collections.Counter(), "other": collections.Counter()}
            for i, (t, name, _) in enumerate(marks)]

    def window(ts: float) -> Optional[int]:
        i = bisect.bisect_left(ends, ts)
        return i if i < len(rows) else None

    for e in events:
        if e.get("cat") in LAUNCH_CATS and e.get("ph") == "X":
            i = window(e["ts"])
            if i is not None:
                rows[i]["main" if e["tid"] == main else "other"][e["name"]] += e["dur"] / 1e3
        elif e.get("cat") in GPU_CATS:
            launch = launches.get(e.get("args", {}).get("correlation"))
            i = None if launch is None else window(launch["ts"])
            if i is not None:
                rows[i]["gpu"].append((e["ts"], e["ts"] + e["dur"]))
                key = "nccl" if "nccl" in e["name"].lower() else str(e["args"].get("stream"))
                rows[i]["stream_ms"][key] += e["dur"] / 1e3
    for r in rows:
        gpu = r.pop("gpu")
        r.update(gpu_busy_ms=round(busy_ms(gpu), 3), kernels=len(gpu),
                 **{k: {n: round(v, 3) for n, v in sorted(r[k].items())} for k in ("stream_ms", "main", "other")})
    return rows


def read_json(path: Path):
    """A JSON file, gunzipped where its name ends in ``.gz`` (traces, ``batch_scale``'s curves)."""
    import gzip

    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def phases(args) -> None:
    """``phases``: :func:`trace_phases` of each trace, into ``--out`` (``{trace: [phase, ...]}``)."""
    out = {path: trace_phases(read_json(Path(path))["traceEvents"]) for path in args.traces}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, rows in out.items():
        print(name)
        for r in rows:
            print(f"  {r['phase']:14s} host {r['host_ms'] or 0:8.1f} ms  GPU busy {r['gpu_busy_ms']:8.1f} ms  "
                  f"{r['kernels']:6d} kernels  " + " ".join(f"{k}:{v:.1f}" for k, v in r["stream_ms"].items()))


def updates(args) -> None:
    """Where the time of an update goes, on one process or on every process under ``torchrun``:
    after ``--warmup`` updates (compiling, capturing), ``--updates`` consecutive updates under the
    profiler (not synchronised in between, so that the critic's steps run beside the next rollout
    as in training), then their phases and :func:`trace_summary`, per process, into ``--out``
    (``{"ranks": [...]}``, written by the first process); with ``--trace-dir`` each process's
    trace as a gzipped Chrome trace (``trace_rank<R>.json.gz``)."""
    import gzip
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from timm_dora.train import Trainer, build_parser, config_from_args
    from timm_dora.train.runtime import init_distributed
    from benchmarks.common import command_line

    rank = int(os.environ.get("RANK", "0"))
    cfg = config_from_args(build_parser().parse_args(_train_flags(args, Path(tempfile.mkdtemp(prefix=f"profile_rank{rank}_")))))
    created = init_distributed(cfg)  # (under torchrun: NCCL on CUDA, gloo on the CPU)
    tr = Trainer(cfg, sync_phases=False)
    cuda = tr.dev.type == "cuda"
    for _ in range(args.warmup):
        tr.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    metrics = []
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.updates):
            metrics.append(tr.step())
        tr.finish_critic()
        if cuda:
            torch.cuda.synchronize()
        span_ms = 1e3 * (time.perf_counter() - start)
    mine = {"rank": rank, "update_s": [round(m["update_s"], 4) for m in metrics],
            "phases": {k: round(statistics.fmean(m["phases"].get(k, 0.0) for m in metrics), 4) for k in metrics[0]["phases"]},
            **trace_summary(prof.events(), span_ms, args.updates)}
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            (Path(args.trace_dir) / f"trace_rank{rank}.json.gz").write_bytes(gzip.compress(Path(f.name).read_bytes()))
    ranks = [mine]
    if tr.comm.on:  # (on the trainer's gloo communicator)
        ranks = [None] * tr.comm.world
        torch.distributed.all_gather_object(ranks, mine, group=tr.host_comm.group)
    tr.close()
    if created:
        torch.distributed.destroy_process_group()
    if rank == 0:
        out = {"model": args.model, "processes": len(ranks), "warmup": args.warmup, "updates": args.updates,
               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
               "command": args.command_line or command_line("train_scale"), "ranks": ranks}
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({k: out[k] for k in ("model", "processes")} | {"wall_ms": [r["wall_ms"] for r in ranks]}))


# ------------------------------------------------------------------------------------------------ ddp
def _timed_run(args, name: str, cmd: List[str], env: Dict[str, str], run_dir: Path) -> Dict:
    """One training run of ``--updates`` updates: its median seconds per update after ``--skip``."""
    start = time.time()
    hung = False
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"{name}: exit {proc.returncode}")
    except subprocess.TimeoutExpired as e:
        hung = True  # kept if every update ran: the measurement is in metrics.jsonl
        print(name, "timed out;", str(e.stderr or b"")[-1500:])
    m = run_metrics(run_dir)
    ppo = json.loads((run_dir / "config.json").read_text())["ppo"]  # (--batch-scale N: updates / N)
    if len(m) < ppo["updates"]:
        raise SystemExit(f"{name}: {len(m)} of {ppo['updates']} updates in {args.timeout} s")
    steady = m[args.skip:]
    rec = {"command": " ".join(shlex.quote(c) for c in cmd), "wall_s": round(time.time() - start, 1),
           "images_per_update": ppo["rollout_images"],
           "minibatches": {k: ppo[f"{k}_minibatch"] for k in ("gate", "controller", "critic")},
           "s_per_update": round(statistics.median(r["update_s"] for r in steady), 4),
           "phases": {k: round(statistics.median(r["phases"].get(k, 0.0) for r in steady), 4) for k in steady[0]["phases"]},
           "last": {k: m[-1][k] for k in ("gflops", "compression", "a_u") if k in m[-1]}}
    if hung:
        rec["exit_timed_out"] = True
    print(name, json.dumps(rec))
    return rec


ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")  # a variant's environment setting, e.g. NCCL_MAX_CTAS=2


def ddp(args) -> None:
    root = Path(args.root)
    out: Dict = {"model": args.model, "gpus": args.gpus, "updates": args.updates, "skip": args.skip}
    extra = ["--updates", str(args.updates), "--checkpoint-every", str(args.updates)]
    runs = [("one_gpu", [sys.executable, "-m", "timm_dora.train"], [], {"CUDA_VISIBLE_DEVICES": "0"})]
    for variant in args.variants:  # name:[ENV=VALUE ...] flags
        name, _, rest = variant.partition(":")
        words = shlex.split(rest)
        settings = dict(w.split("=", 1) for w in words if ENV_WORD.fullmatch(w))
        runs.append((f"{args.gpus}_gpus_{name}", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node", str(args.gpus), "-m", "timm_dora.train"],
                     [w for w in words if not ENV_WORD.fullmatch(w)], settings))
    for name, launcher, flags, settings in runs:
        run_dir = root / f"run_{args.model}_{name}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        out[name] = _timed_run(args, name, launcher + _train_flags(args, run_dir) + extra + flags,
                               dict(train_env(), **settings), run_dir)
        if settings and name != "one_gpu":
            out[name]["env"] = settings
    def rate(r: Dict) -> float:  # rollout images per second
        return r["images_per_update"] / r["s_per_update"]

    one = out["one_gpu"]["s_per_update"]
    for name, *_ in runs[1:]:
        out[name]["scaling"] = round(rate(out[name]) / rate(out["one_gpu"]), 3)
    first = runs[1][0]  # the first variant: the defaults
    out.update(s_per_update=out[first]["s_per_update"], one_gpu_s_per_update=one, scaling=out[first]["scaling"])
    import torch
    from benchmarks.common import command_line

    out.update(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
               variant=args.variants[0], command=args.command_line or command_line("train_scale"))
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.into:  # the result file's ddp entry for this model (train_scale_h100.json's "ddp": {"vit_tiny": ...})
        doc = json.loads(Path(args.into).read_text()) if Path(args.into).exists() else {}
        doc.setdefault("ddp", {})[args.model.split("_patch")[0]] = out
        Path(args.into).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: out[k] for k in ("model", "gpus", "s_per_update", "one_gpu_s_per_update", "scaling")}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    m = sub.add_parser("make")
    m.add_argument("--sources", required=True, help="a folder of <synset>.jpg images (shared sample1000)")
    m.add_argument("--root", required=True)
    for k, v in PAPER.items():
        m.add_argument(f"--{k}", type=int, default=v)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--workers", type=int, default=0)
    for name in ("run", "ddp", "profile", "updates"):
        r = sub.add_parser(name)
        r.add_argument("--root", required=True)
        r.add_argument("--model", default="vit_tiny_patch16_224.augreg_in21k_ft_in1k")
        r.add_argument("--weights", default=None, help="backbone weights (none: random, speed only)")
        r.add_argument("--extra", default="", help="more timm-dora-train flags")
        r.add_argument("--out", required=True)
        r.add_argument("--command-line", default=None, help="the command to record (default: this one)")
    r = sub.choices["run"]
    r.add_argument("--run", required=True)
    r.add_argument("--max-minutes", type=float, default=0.0)
    d = sub.choices["ddp"]
    d.add_argument("--gpus", type=int, default=2)
    d.add_argument("--updates", type=int, default=40)
    d.add_argument("--skip", type=int, default=5)
    d.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    d.add_argument("--variants", nargs="+", default=["default:"],
                   help="name:flags of each data-parallel run (ENV=VALUE words set its environment; "
                        "the first one's scaling is the result's)")
    d.add_argument("--into", default=None, help="a result file whose ddp entry for the model this run sets")
    pr = sub.choices["profile"]
    pr.add_argument("--batch", type=int, default=256, help="rollout images (of the first update's batch)")
    pr.add_argument("--warmup", type=int, default=4)
    up = sub.choices["updates"]
    up.add_argument("--warmup", type=int, default=6)
    up.add_argument("--updates", type=int, default=2)
    up.add_argument("--trace-dir", default=None, help="a folder for each process's gzipped Chrome trace")
    ph = sub.add_parser("phases")
    ph.add_argument("traces", nargs="+", help="Chrome traces written by updates --trace-dir (.json or .json.gz)")
    ph.add_argument("--out", required=True)
    args = ap.parse_args()
    {"make": make, "run": run, "ddp": ddp, "profile": profile, "updates": updates, "phases": phases}[args.step](args)


if __name__ == "__main__":
    main()
