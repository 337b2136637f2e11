"""Training speed, phase by phase (issue #28; not a test).

Runs the real ``timm-dora-train`` code path (the CLI's parser and ``TrainConfig``, ``Trainer.step``,
``Trainer.save_checkpoint``) for a few updates of each configuration, with the device synchronised
at every phase boundary (``Trainer(sync_phases=True)``; a normal run records the same phases with
CUDA events and no extra waits). Per configuration it records the seconds of every phase of every
update, ``s_per_update`` (median over the measured updates, after ``--warmup`` updates), the median
of each phase, one feedback check and one checkpoint (dev evaluation + saving), and the minutes the
full recipe would take: ``setup + one-time + U * (s_per_update - feedback share) + U / cadence *
feedback + ceil(U / checkpoint_every) * checkpoint`` for ``U = 1,171`` updates, where ``one-time``
is what the warm-up updates took beyond a plain update (compiling, capturing CUDA graphs).

Configurations (each a list of CLI flags; ``--data``/``--weights-dir`` fill in the paths):

- ``vit_tiny_paper``: ViT-Ti AugReg with real weights, the paper's defaults.
- ``vit_tiny_strong``: the same with ``--augment strong`` (the published actors' recipe).
- ``deit_base_random``: DeiT-B/16 with random weights (speed only).

    python -m benchmarks.train_speed --data CARRY/data/labels.csv --weights-dir CARRY \\
        --configs vit_tiny_paper vit_tiny_strong deit_base_random --updates 23 --warmup 3 \\
        --out benchmarks/results/train_speed_h100.json [--profile OUT/profile.txt]

``--profile FILE`` also runs one more update of the first configuration under ``torch.profiler``
and writes its op table (self CPU and CUDA time, calls) and the kernel-launch count to FILE.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from timm_dora.evaluate import environment
from timm_dora.train import Trainer, build_parser, config_from_args
from benchmarks.common import command_line

VIT = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
CONFIGS: Dict[str, List[str]] = {
    "vit_tiny_paper": ["--model", VIT, "--weights", "{weights}/" + VIT + ".bf16.safetensors"],
    "vit_tiny_strong": ["--model", VIT, "--weights", "{weights}/" + VIT + ".bf16.safetensors", "--augment", "strong"],
    "deit_base_random": ["--model", "deit_base_patch16_224", "--random-backbone"],
}
FULL_RECIPE_UPDATES = 1_171


def trainer_for(name: str, args, out: Path) -> Trainer:
    flags = [f.format(weights=args.weights_dir) for f in CONFIGS[name]]
    flags += ["--data", args.data, "--out", str(out), "--no-progress", "--recipe", "paper", "--actor-width", "128",
             *args.extra]  # the recipe and actor measured
    if args.device:
        flags += ["--device", args.device]
    cfg = config_from_args(build_parser().parse_args(flags))
    return Trainer(cfg, sync_phases=True)


def measure(name: str, args) -> Dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        trainer = trainer_for(name, args, Path(tmp))
        if trainer.dev.type == "cuda":
            torch.cuda.synchronize()
        setup_s = time.perf_counter() - t
        updates = []
        for _ in range(args.warmup + args.updates):
            m = trainer.step()
            updates.append({"update": m["update"], "update_s": sum(m["phases"].values()), "phases": m["phases"],
                            "feedback": "d_u" in m, "compression": m["compression"], "gflops": m["gflops"]})
            print(f"{name} u{m['update']:03d} {updates[-1]['update_s']:.3f} s  "
                  + " ".join(f"{k}={v:.3f}" for k, v in m["phases"].items()), flush=True)
        t = time.perf_counter()
        trainer.save_checkpoint()
        if trainer.dev.type == "cuda":
            torch.cuda.synchronize()
        checkpoint_s = time.perf_counter() - t
        if args.profile and name == args.configs[0]:
            profile(trainer, args.profile)
        trainer.stop_prefetch()  # its workers would go on making batches during the next configuration
    cfg = trainer.cfg
    del trainer  # freed here (CUDA graphs and all) before the next configuration starts its workers
    gc.collect()
    measured = updates[args.warmup :]
    plain = [u for u in measured if not u["feedback"]]
    phases = sorted({k for u in measured for k in u["phases"]})
    phase_median = {k: statistics.median(u["phases"].get(k, 0.0) for u in plain or measured) for k in phases}
    feedback = [u["phases"]["feedback"] for u in updates if u["feedback"]]
    feedback_s = statistics.median(feedback) if feedback else None
    s_update = statistics.median(u["update_s"] for u in measured)
    s_plain = statistics.median(u["update_s"] for u in (plain or measured))
    u_total = FULL_RECIPE_UPDATES
    one_time_s = sum(max(u["update_s"] - s_plain, 0.0) for u in updates[: args.warmup])  # compiling, capturing
    full_s = (setup_s + one_time_s + u_total * s_plain + (u_total // cfg.feedback_cadence) * (feedback_s or 0.0)
              + math.ceil(u_total / cfg.checkpoint_every) * checkpoint_s)
    return {
        "flags": CONFIGS[name] + args.extra,
        "rollout_images": cfg.ppo.rollout_images,
        "warmup_updates": args.warmup,
        "measured_updates": len(measured),
        "s_per_update": s_update,
        "s_per_update_without_feedback": s_plain,
        "phases": phase_median,
        "feedback_s": feedback_s,
        "checkpoint_s": checkpoint_s,
        "setup_s": setup_s,
        "one_time_s": one_time_s,
        "full_recipe_min": full_s / 60,
        "rollout_images_per_s": cfg.ppo.rollout_images / statistics.median(
            u["phases"]["data"] + u["phases"]["native"] + u["phases"]["rollout"] + u["phases"]["shadows"] for u in measured),
        "updates": updates,
    }


def profile(trainer: Trainer, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.dev.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        trainer.step()
        if trainer.dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")}
    with open(path, "w") as f:
        f.write(f"kernel launches in one update: {launches}\nhost waits: {json.dumps(syncs)}\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70))
        if trainer.dev.type == "cuda":
            f.write("\n\n")
            f.write(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="labels CSV with rollout/qc/dev splits")
    ap.add_argument("--weights-dir", default=".", help="folder with <model>.bf16.safetensors")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--updates", type=int, default=20, help="measured updates per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--extra", default="", help="more timm-dora-train flags for every configuration, one string: "
                    "--extra='--no-cuda-graphs'")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.extra = shlex.split(args.extra)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res = {**environment(dev, command_line("train_speed", argv)),
           "configs": {}}
    for name in args.configs:
        res["configs"][name] = measure(name, args)
        r = res["configs"][name]
        print(f"== {name}: {r['s_per_update']:.3f} s/update, full recipe {r['full_recipe_min']:.1f} min", flush=True)
        if args.out:  # written after every configuration: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
