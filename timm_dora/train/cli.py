"""``timm-dora-train``: train a DORA actor for a timm ViT with the paper's PPO recipe.

    timm-dora-train --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W.safetensors \\
        --data ../shared/data/imagenet-mini/labels.csv --out runs/vit_tiny

Also ``python -m timm_dora.train`` and, data parallel, ``torchrun --nproc_per_node N -m
timm_dora.train ...``. The loop itself is :class:`~timm_dora.train.loop.Trainer`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from ..command import one_line_errors
from .config import TrainConfig, build_parser, check_resume, config_from_args
from .loop import Trainer
from .runtime import cpu_estimate, deterministic_on_cpu, init_distributed

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """``timm-dora-train``; also ``torchrun --nproc_per_node N -m timm_dora.train ...`` (data parallel)."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    created = init_distributed(cfg)
    out, existed = Path(cfg.out), Path(cfg.out).exists()
    rc = 1
    try:
        rc = one_line_errors("timm-dora-train", lambda: _main(args, cfg))
        return rc
    finally:
        if rc != 0 and not existed:  # a run that failed before writing anything leaves no empty --out
            with contextlib.suppress(OSError):  # (not empty, or another process removed it)
                out.rmdir()
        if created:
            import torch.distributed as dist

            if rc == 0:  # leave together: a peer tearing down gloo early can abort the other
                dist.barrier()
                dist.destroy_process_group()
            # after an error the peers may wait in another collective: this process just leaves
            # (torchrun then stops the others) rather than wait with them for a timeout


def _main(args: argparse.Namespace, cfg: TrainConfig) -> int:
    out = Path(cfg.out)
    if (out / "state.pt").exists() and not args.resume:
        print(f"{out}/state.pt exists: pass --resume to continue it, or choose another --out", file=sys.stderr)
        return 2
    if args.resume and (out / "config.json").exists():
        check_resume(cfg, json.loads((out / "config.json").read_text()))
    note = cpu_estimate(cfg) if int(os.environ.get("RANK", "0")) == 0 else ""
    if note:
        print(f"timm-dora-train: {note}", file=sys.stderr)
    with deterministic_on_cpu(cfg.device):
        return _train(args, cfg, out)


def _train(args: argparse.Namespace, cfg: TrainConfig, out: Path) -> int:
    trainer = Trainer(cfg)
    if args.resume:
        state_file = out / "state.pt"
        if not state_file.exists():
            print(f"--resume: no {state_file}", file=sys.stderr)
            return 2
        trainer.load_state_dict(torch.load(state_file, map_location="cpu", weights_only=True))
        if trainer.comm.main:
            _truncate_log(out / "metrics.jsonl", trainer.u)  # drop lines logged after the checkpoint
        trainer.comm.barrier()
    if trainer.comm.main:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(trainer.cfg), indent=1))  # the recipe resolved
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    if not trainer.comm.main:
        return 0
    sel = summary["selected"]
    flag = " (VIOLATES the target: no checkpoint met it)" if summary["violates"] else ""
    print(f"selected {sel['name']}: dev top-1 {sel['top1']:.2f} (native {sel['native_top1']:.2f}), "
          f"{sel['gflops']:.3f} GFLOPs{flag} -> {out / 'selected'}")
    return 0


def _truncate_log(path: Path, last_update: int) -> None:
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["update"] <= last_update]
        path.write_text("".join(ln + "\n" for ln in lines))
