"""Where a training run executes: the data-parallel collectives (:class:`Comm`, no-ops in one
process), joining ``torchrun``'s process group (:func:`init_distributed`), bitwise reproducible CPU
runs (:func:`deterministic_on_cpu`) and the per-phase clock of each update (:class:`PhaseClock`)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, List, Optional

import torch

__all__ = ["Comm", "PhaseClock", "cpu_estimate", "deterministic_on_cpu", "eager_attention", "init_distributed"]


def eager_attention():
    """The attention kernels of the training's eager, no-grad backbone forwards (native, rollout,
    shadows, feedback and dev checks): every SDPA backend but cuDNN's.

    cuDNN's attention builds an execution plan on the host for each new shape (3.5-5.8 ms on the
    H100, torch 2.11), and the shadows and the QC shards bring new batch sizes all the time; the
    FlashAttention and memory-efficient kernels cost no more on the device. Same-run H100 A/B
    (ViT-Ti, 256 rollout images): shadows 0.130 -> 0.059 s per update, rollout unchanged. On the
    CPU the choice is the default one (cuDNN is CUDA only), so CPU runs are unchanged. The critic's
    fixed-shape steps, captured as CUDA graphs, keep the default choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class Comm:
    """Data-parallel collectives through ``torch.distributed`` (on ``group``, default the world);
    no-ops in a single process."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        # NCCL reduces device tensors only; gloo takes CPU tensors
        nccl = self.on and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def subgroup(self, backend: Optional[str] = None) -> "Comm":
        """The same processes on a communicator of their own (``backend``: as the world's, or e.g.
        ``"gloo"`` for host values). Every process must create its subgroups in the same order."""
        return Comm(self.dist.new_group(backend=backend)) if self.on else Comm()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place; returns ``t``."""
        if self.on:
            x = t.to(self.device)
            self.dist.all_reduce(x, group=self.group)
            if x is not t:
                t.copy_(x)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Equal-shaped tensors of all processes concatenated along dim 0 in rank order."""
        if not self.on:
            return t
        x = t.contiguous().to(self.device)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts).to(t.device)

    def broadcast_object(self, obj):
        if not self.on:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier(group=self.group)

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of the first process, in place on every process; returns ``t``."""
        if self.on:
            x = t.to(self.device)
            self.dist.broadcast(x, src=0, group=self.group)
            if x is not t:
                t.copy_(x)
        return t


class PhaseClock:
    """Seconds per phase of one update, for ``metrics.jsonl`` and the speed benchmark.

    On CUDA, events on the current stream: nothing waits for the device until :meth:`read`, which
    the update calls after its metrics have come back to the host anyway. ``sync=True`` (the speed
    benchmark, ``benchmarks/train_speed.py``) synchronizes at every boundary as well, so a phase
    that only keeps the host busy is charged to itself, not to the next one. On the CPU,
    ``time.perf_counter``. A phase marked several times in one update adds up."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.cuda, self.sync = device.type == "cuda", sync
        self.marks: List[tuple] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        if self.sync:
            torch.cuda.current_stream().synchronize()  # (not a stream left running on purpose)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        """End the running phase, naming it ``phase`` (under the profiler also an empty range
        ``phase <name>`` at that moment, so that a trace shows where each phase ends on the host)."""
        with torch.profiler.record_function(f"phase {phase}"):
            self.marks.append((phase, self._now()))

    def read(self) -> Dict[str, float]:
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: Dict[str, float] = {}
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            out[phase] = out.get(phase, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


def init_distributed(cfg) -> bool:
    """Join the process group when launched by ``torchrun`` (WORLD_SIZE > 1): NCCL on CUDA (one
    GPU per process, ``LOCAL_RANK``), gloo on CPU. Returns whether this call created the group."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if cfg.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        cfg.device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


@contextlib.contextmanager
def deterministic_on_cpu(device: str):
    """On the CPU, make a fixed-seed run bitwise reproducible across processes (for one thread
    count, ``torch.get_num_threads()``). torch's CPU ``index_put_(accumulate=True)``, the backward
    of advanced indexing, adds from several threads with atomics, in an order that changes from
    run to run (fresh processes differed by up to 6e-5 after 4 updates of the test run);
    ``torch.use_deterministic_algorithms`` selects its sorted kernel. CUDA runs keep torch's
    default kernels (atomics in backward passes): they are reproducible to float rounding, not
    bit for bit. The previous setting is restored on exit."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if torch.device(device).type == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ours: CPU core-seconds an update spends per rollout image and GFLOP of the backbone's forward,
# from the README's ViT-Ti command on a 2-core machine (about 123 s an update: 2 x 123 / (256 x 2.51))
CPU_CORE_S_PER_IMAGE_GFLOP = 0.38
CPU_NOTE_AFTER_MIN = 30.0  # a CPU run expected to take longer than this is told so at the start


def cpu_estimate(cfg) -> str:
    """On the CPU, a line saying about how long the run will take and the flags for a short one when
    that is more than :data:`CPU_NOTE_AFTER_MIN` minutes (with ``--max-minutes`` the run's own limit
    holds); ``""`` otherwise. Sized from the backbone's GFLOPs, built without memory."""
    if torch.device(cfg.device).type != "cpu" or cfg.max_minutes:
        return ""
    cfg = cfg.scaled()
    import timm

    from ..engine import native_gflops

    with torch.device("meta"):
        model = timm.create_model(cfg.model, pretrained=False, **({"img_size": cfg.img_size} if cfg.img_size else {}))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_update = CPU_CORE_S_PER_IMAGE_GFLOP * native_gflops(model) * cfg.ppo.rollout_images / cores
    total_min = per_update * cfg.ppo.updates / 60
    if total_min <= CPU_NOTE_AFTER_MIN:
        return ""
    return (f"training on the CPU ({cores} cores): about {per_update:.0f} s an update, so {cfg.ppo.updates} updates "
            f"take about {total_min / 60:.0f} h; for a short run pass --max-minutes 30 (or --updates N, "
            f"--rollout-images N); on a GPU an update takes about a second")
