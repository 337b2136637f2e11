"""Training DORA actors with the paper's PPO recipe (Sec. 3.3-3.5, App. B-E), and the CLI.

    timm-dora-train --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W.safetensors \\
        --data ../shared/data/imagenet-mini/labels.csv --out runs/vit_tiny

One update ``u`` (App. C/D):

1. draw ``rollout_images`` images from the rollout pool; the fidelity coefficient ``a_u`` is fixed
   for this rollout and its update;
2. Native logits, a sampled rollout on the frozen bf16 backbone (hard deletion through the
   inference code, :func:`timm_dora.rollout.collect`) and the complete-prefix shadows
   (:func:`timm_dora.rollout.shadow_divergences`), all under ``no_grad``;
3. every ``feedback_cadence`` updates, after the rollout and before the update: the deterministic
   actor on the next QC shard, paired Top-1 drop ``d_u``, ``a_{u+1}`` by the clipped rule;
4. rewards ``r_l = 25 dC_l - a_u (D_l - D_{l-1})``; old critic values; GAE with the shared
   lambda-return; advantages standardised per decision type over eligible transitions;
5. ``actor_epochs`` of clipped PPO: gate (minibatch 512), budget + selector (minibatch 64, symmetric
   PCGrad on the shared controller, clipped to 0.5); ``critic_epochs`` of clipped Huber value
   regression on normalised returns (minibatch 128); separate Adam optimisers.

Checkpoints are saved every ``checkpoint_every`` updates (the actor with ``save_pretrained`` and the
full training state for exact resume); each is evaluated on the dev split, and at the end the
selection rule (lowest dev GFLOPs with a Native-relative drop <= the target, else the final one,
flagged) picks the actor written to ``OUT/selected``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .actor import Actor
from . import data as D
from .critic import Critic, native_features, trajectory_scalar_states
from .feedback import FeedbackController, paired_drop
from .graph_step import CapturedStep
from .packing import Packed
from .patch import run, wrap
from .policy import ActorPolicy, NoPrune, RolloutNoise
from .ppo import (
    PPOConfig, RunningMeanStd, actor_parameter_groups, apply_pcgrad, clipped_surrogate, clipped_value_loss,
    gae_shared_return, standardize,
)
from .rewards import step_rewards, token_layer_compression
from .rollout import Trajectory, collect, evaluate_controller, evaluate_gate, shadow_divergences
from .selection import CheckpointRecord, select_checkpoint

__all__ = ["TrainConfig", "Trainer", "main"]


@dataclass
class TrainConfig:
    """Everything a training run needs; defaults are the paper's (``ppo``) or marked ours."""

    model: str
    data: str  # labels CSV (with a split column) or an ImageFolder root for the rollout split
    out: str
    weights: Optional[str] = None  # local weights file (timm pretrained_cfg_overlay)
    pretrained: bool = False  # let timm fetch the pretrained weights instead
    img_size: Optional[int] = None  # override the model's input size (small tests)
    num_classes: Optional[int] = None
    rollout_split: str = "rollout"
    qc_split: str = "qc"
    dev_split: str = "dev"
    qc_data: Optional[str] = None  # separate ImageFolder roots (default: --data with the split)
    dev_data: Optional[str] = None
    augment: str = "none"  # ours, for small pools: "none" | "light" | "strong" (data.train_transform; True = "light")
    cutmix_prob: float = 0.5  # ours: with --augment strong, the share of rollout images given a patch CutMix from another pool image
    budget_step: int = 2  # the budget grid {s, 2s, ..., N0 - 4} of actor and critic (paper: 2)
    init_actor: Optional[str] = None  # warm start from a saved actor (folder or Hub id); critic, optimizers, feedback fresh
    readout: str = "model"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    target_drop: float = 0.01
    a_init: float = 30.0
    fixed_coefficient: bool = False  # ablation
    terminal_only: bool = False  # ablation
    feedback_cadence: int = 8
    qc_shards: int = 8
    tau_b: float = 0.1  # ours: low-margin threshold of the critic's phi^N (paper: backbone-specific, unstated)
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # stop early (checkpoint, select) after this wall time; 0: no limit
    data_workers: Optional[int] = None  # ours: processes augmenting rollout batches ahead of the update (None: min(4, cores - 1); 0: none)
    shadow_chunk: int = 2048  # shadow rows per packed forward (memory only: each row is computed alone)
    eval_batch: int = 256
    tensorboard: bool = False
    progress: bool = True
    cuda_graphs: bool = True  # ours: replay the PPO minibatch steps from CUDA graphs (CUDA, one process)
    compile: Optional[bool] = None  # ours: torch.compile (Inductor) the critic's token branch; None: on CUDA only
    critic_bf16: Optional[bool] = None  # ours: the critic's token branch under bf16 autocast (fp32 weights, Adam, heads, losses); None: on CUDA only
    ppo: PPOConfig = field(default_factory=PPOConfig)

    @property
    def total_updates(self) -> int:
        return self.ppo.updates


def create_backbone(name: str, weights: Optional[str] = None, pretrained: bool = False, **kwargs) -> nn.Module:
    """A frozen timm model in eval mode; ``weights``: a local safetensors file of its state dict.

    The file is loaded with ``load_state_dict`` (strict) rather than through
    ``pretrained_cfg_overlay``, which some timm versions route to their JAX ``.npz`` loader for
    AugReg models. The model keeps its ``pretrained_cfg`` (architecture and tag).
    """
    import timm

    if weights is not None:
        if not str(weights).endswith(".safetensors"):
            raise ValueError(f"--weights must be a .safetensors file (pickle checkpoints are not loaded): {weights}")
        from safetensors.torch import load_file

        model = timm.create_model(name, pretrained=False, **kwargs)
        model.load_state_dict(load_file(str(weights)))
    else:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    return model.eval().requires_grad_(False)


class _Comm:
    """Data-parallel collectives through ``torch.distributed``; no-ops in a single process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        # NCCL reduces device tensors only; gloo takes CPU tensors
        nccl = self.on and dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place; returns ``t``."""
        if self.on:
            x = t.to(self.device)
            self.dist.all_reduce(x)
            if x is not t:
                t.copy_(x)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Equal-shaped tensors of all processes concatenated along dim 0 in rank order."""
        if not self.on:
            return t
        x = t.contiguous().to(self.device)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x)
        return torch.cat(parts).to(t.device)

    def broadcast_object(self, obj):
        if not self.on:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier()

    def sum_list(self, grads, params) -> List[torch.Tensor]:
        """Sum a list of per-parameter gradients (``None`` = zero) across processes (in one
        process: the list as given)."""
        if not self.on:
            return list(grads)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])
        self.sum_(flat)
        out, offset = [], 0
        for p in params:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def sum_grads(self, params) -> None:
        """Replace each ``p.grad`` by its sum across processes. A parameter no process used keeps
        ``grad = None`` (as in a single process, where Adam then skips it)."""
        if not self.on:
            return
        used = self.sum_(torch.tensor([float(p.grad is not None) for p in params]))
        for p, g, u in zip(params, self.sum_list([p.grad for p in params], params), used.tolist()):
            p.grad = g.clone() if u > 0 else None


@dataclass
class _Minibatch:
    """Global transition ids of one PPO minibatch (identical on every process) and this process's
    share of them as local ids: on the host (``local``) and on the device (``idx``)."""

    ids: List[int]
    local: List[int]
    idx: Optional[torch.Tensor] = None


class _StaticBatch:
    """Static buffers of one kind of PPO minibatch: one update's per-transition tensors (refilled in
    place every update, in buffers of a fixed number of rows) and one minibatch's rows (refilled
    before every step), so that a step always reads the same tensors
    (:class:`~timm_dora.graph_step.CapturedStep`).

    A minibatch fills ``capacity`` rows: ``idx`` (local row ids, padded with 0, a real row) and
    ``w`` (which rows are real); ``n`` and ``n_on`` are the loss divisors (global counts)."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.idx = torch.zeros(capacity, dtype=torch.long, device=device)
        self.w = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.n = torch.ones((), device=device)
        self.n_on = torch.ones((), device=device)
        self.shapes: Dict[str, tuple] = {}

    def load(self, rows: int, **tensors: torch.Tensor) -> bool:
        """Copy one update's tensors (each of at most ``rows`` rows) into buffers of ``rows`` rows;
        returns whether any buffer was (re)allocated (a new shape: captured steps must be captured
        again). Rows past a tensor's own keep the values of an earlier update (real rows, never read
        as real here)."""
        fresh = False
        for k, t in tensors.items():
            shape = (rows, *t.shape[1:], t.dtype)
            if self.shapes.get(k) != shape:
                setattr(self, k, t.new_zeros(rows, *t.shape[1:]))
                self.shapes[k] = shape
                fresh = True
            getattr(self, k)[: t.shape[0]].copy_(t)
        return fresh

    def select(self, idx: torch.Tensor, n: int, n_on: int = 1) -> None:
        m = idx.shape[0]
        self.idx[:m].copy_(idx)
        self.idx[m:].zero_()
        self.w.copy_(torch.arange(self.capacity, device=self.w.device) < m)
        self.n.fill_(float(n))
        self.n_on.fill_(float(max(n_on, 1)))


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
            torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        """End the running phase, naming it ``phase``."""
        self.marks.append((phase, self._now()))

    def read(self) -> Dict[str, float]:
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: Dict[str, float] = {}
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            out[phase] = out.get(phase, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


class Trainer:
    """Holds the frozen wrapped backbone, the actor, the critic, optimisers and all training state."""

    def __init__(self, cfg: TrainConfig, sync_phases: bool = False):
        self.cfg = cfg
        self.comm = _Comm()
        self.dev = torch.device(cfg.device)
        self.clock = PhaseClock(self.dev, sync=sync_phases)  # per-phase times of each update
        if cfg.ppo.rollout_images % self.comm.world:
            raise ValueError(f"--rollout-images {cfg.ppo.rollout_images} must be divisible by the number of processes {self.comm.world}")
        self.local_batch = cfg.ppo.rollout_images // self.comm.world
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.ppo.seed)
        kw = {}
        if cfg.img_size:
            kw["img_size"] = cfg.img_size
        if cfg.num_classes:
            kw["num_classes"] = cfg.num_classes
        model = create_backbone(cfg.model, cfg.weights, pretrained=cfg.pretrained, **kw)
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.model = wrap(model.to(self.dev, self.dtype), policy=NoPrune(), readout=cfg.readout)
        self.num_patches = model.patch_embed.num_patches
        self.depth = len(model.blocks)

        # data: the backbone's own preprocessing (App. E.1); splits must be disjoint
        ev = D.eval_transform(model)
        cfg.augment = D.augment_level(cfg.augment)
        if not 0.0 <= cfg.cutmix_prob <= 1.0:
            raise ValueError(f"--cutmix-prob must be in [0, 1], got {cfg.cutmix_prob}")
        self.patch = model.patch_embed.patch_size[0]
        tr = D.train_transform(model, cfg.augment)
        self.rollout_set = D.open_split(cfg.data, cfg.rollout_split, tr)
        qc_set = D.open_split(cfg.qc_data or cfg.data, cfg.qc_split, ev)
        dev_set = D.open_split(cfg.dev_data or cfg.data, cfg.dev_split, ev)
        D.check_disjoint({"rollout": self.rollout_set, "qc": qc_set, "dev": dev_set})
        self.rollout_pool = None if cfg.augment != "none" else D.preload(self.rollout_set, self.dev)
        self.augmented, self.prefetch = None, None
        if cfg.augment != "none":
            self.rollout_set.keep_decoded()  # decode each file once; the random crop/flip still run per update
            self.augmented = D.AugmentedPool(self.rollout_set, cfg.ppo.seed, cfg.augment == "strong", cfg.cutmix_prob, self.patch)
        if cfg.data_workers is not None and cfg.data_workers < 0:
            raise ValueError(f"--data-workers must be 0 or more, got {cfg.data_workers}")
        self.workers = cfg.data_workers if cfg.data_workers is not None else min(4, (os.cpu_count() or 1) - 1)
        self.qc_x, self.qc_y = D.preload(qc_set, self.dev)
        self.dev_x, self.dev_y = D.preload(dev_set, self.dev)
        self.qc_shard_idx = D.fixed_shards(len(qc_set), cfg.qc_shards)

        # learners
        self.actor = Actor.for_model(model, budget_step=cfg.budget_step)
        if cfg.init_actor:
            self.actor.load_state_dict(_warm_start(cfg.init_actor, self.actor, self.model, cfg.readout))
        self.actor = self.actor.to(self.dev)
        self.critic = Critic.for_model(model, budget_step=cfg.budget_step, backend="padded").to(self.dev)
        self.graphs = cfg.cuda_graphs and self.dev.type == "cuda" and self.comm.world == 1
        p = cfg.ppo
        g = actor_parameter_groups(self.actor)
        self.groups = g
        # capturable: the minibatch steps are replayed from CUDA graphs (one process on CUDA)
        adam = functools.partial(torch.optim.Adam, capturable=self.graphs)
        self.opts = {
            "gate": adam(g["gate"], lr=p.lr_gate),
            "shared": adam(g["shared"], lr=p.lr_shared),
            "budget": adam(g["budget"], lr=p.lr_budget),
            "selector": adam(g["selector"], lr=p.lr_selector),
            "critic": adam(self.critic.parameters(), lr=p.lr_critic),
        }
        self.gate_batch = _StaticBatch(p.gate_minibatch, self.dev)
        self.ctrl_batch = _StaticBatch(p.controller_minibatch, self.dev)
        self.critic_batch = _StaticBatch(p.critic_minibatch, self.dev)
        self.captured: Dict[object, CapturedStep] = {}  # minibatch steps by kind, captured on first use
        # the critic's fixed-shape token branch, compiled by Inductor (--compile; on CUDA by default):
        # H100, ViT-Ti, same run: critic update 0.39 -> 0.27 s, about 40 s of compiling in the first
        # update. The controller's forward gained nothing (its fp32 attention backward dominates).
        compiled = cfg.compile if cfg.compile is not None else self.dev.type == "cuda"
        self.critic_tokens = torch.compile(self.critic.encode_padded, dynamic=False) if compiled else self.critic.encode_padded
        self.rms = RunningMeanStd()
        self.feedback = FeedbackController(
            a_init=cfg.a_init, target=cfg.target_drop, cadence=cfg.feedback_cadence,
            num_shards=len(self.qc_shard_idx), fixed=cfg.fixed_coefficient,
        )
        self.sampler = D.RolloutSampler(len(self.rollout_set), p.rollout_images, torch.Generator().manual_seed(p.seed))
        self.gen = torch.Generator(device=self.dev).manual_seed(p.seed)  # rollout noise, same on every process
        self.cpu_gen = torch.Generator().manual_seed(p.seed + 1)  # minibatch order
        self.u = 0
        self.checkpoints: List[Dict] = []
        # Native references on QC and dev (fixed backbone)
        self.qc_native = self._predict(self.qc_x, NoPrune())[0] == self.qc_y
        dev_native, _ = self._predict(self.dev_x, NoPrune())
        self.dev_native_top1 = 100.0 * float((dev_native == self.dev_y).float().mean())
        self._tb = None

    # ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _predict(self, x: torch.Tensor, policy) -> tuple:
        preds, gflops = [], []
        for s in range(0, x.shape[0], self.cfg.eval_batch):
            logits, stats = run(self.model, x[s : s + self.cfg.eval_batch].to(self.dtype), policy)
            preds.append(logits.argmax(1))
            gflops.append(stats.gflops)
        return torch.cat(preds), torch.cat(gflops)

    def _rollout_images(self, idx: torch.Tensor) -> torch.Tensor:
        """The rollout inputs of pool images ``idx`` at this update, made in this process
        (:class:`~timm_dora.data.AugmentedPool`: every draw seeded per (seed, update, image))."""
        if self.rollout_pool is not None:
            return self.rollout_pool[0][idx.to(self.dev)].to(self.dtype)
        return torch.stack([self.augmented[(self.u, i)][1] for i in idx.tolist()]).to(self.dev, self.dtype)

    def _next_images(self, idx: List[int], mine: torch.Tensor) -> torch.Tensor:
        """This process's rollout inputs of the global batch ``idx``: from the workers that made
        them ahead (``data_workers``), else made here. The prefetched keys must be this update's."""
        if self.prefetch is None:
            return self._rollout_images(torch.tensor(idx)[mine])
        keys, x = next(self.prefetch)
        expect = [(self.u, idx[m]) for m in mine.tolist()]
        if keys != expect:
            raise RuntimeError(f"prefetched rollout batch {keys[:2]}... is not update {self.u}'s {expect[:2]}...")
        return x.to(self.dev, self.dtype)

    # ---------------------------------------------------------------------------------------
    def step(self) -> Dict[str, float]:
        """One PPO update (rollout, shadows, feedback, update); returns its metrics (global over
        all processes)."""
        cfg, p, comm = self.cfg, self.cfg.ppo, self.comm
        self.u += 1
        u = self.u
        clock = self.clock
        t0 = time.perf_counter()
        clock.start()
        batch = p.rollout_images
        mine = torch.arange(comm.rank * self.local_batch, (comm.rank + 1) * self.local_batch)
        if self.prefetch is None and self.augmented is not None and self.workers > 0:
            # batches from this update on, made ahead from a copy of the sampler as it stands now
            self.prefetch = D.RolloutPrefetch(self.augmented, self.sampler, u - 1, mine.tolist(), self.workers, self.dtype)
        idx = next(self.sampler)  # the global batch, identical on every process
        noise = RolloutNoise.draw(self.depth, batch, self.actor.num_budgets, self.num_patches, self.gen, self.dev)
        x = self._next_images(idx, mine)
        clock.mark("data")
        a_u = self.feedback.coefficient
        self.actor.eval()
        with torch.no_grad():
            z_native = run(self.model, x, NoPrune())[0].float()
            clock.mark("native")
            traj = collect(self.model, self.actor, x, z_native=z_native, noise=noise.rows(mine.to(self.dev)))
            clock.mark("rollout")
            d = shadow_divergences(self.model, x, traj, p.kd_temperature, cfg.shadow_chunk)
            clock.mark("shadows")
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t_rollout = time.perf_counter() - t0
        m: Dict[str, float] = {"update": u, "a_u": a_u}
        if self.feedback.due(u):  # once, on the first process, then shared
            shard = self.feedback.next_shard()
            drop = None
            if comm.main:
                sel = torch.tensor(self.qc_shard_idx[shard], device=self.dev)
                pred, _ = self._predict(self.qc_x[sel], ActorPolicy(self.actor))
                drop = paired_drop(self.qc_native[sel], pred == self.qc_y[sel])
            drop = comm.broadcast_object(drop)
            self.feedback.update(u, drop, shard)
            m.update(d_u=drop, qc_shard=shard, a_next=self.feedback.coefficient)
            clock.mark("feedback")
        rewards = step_rewards(traj.k, d, a_u, p.compression_scale, cfg.terminal_only, num_patches=self.num_patches)
        m.update(self._ppo_update(traj, d, rewards, a_u))
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        comp = token_layer_compression(traj.k, self.num_patches)
        sums = comm.sum_(torch.stack([
            rewards.sum(1).sum(), comp.sum(), traj.gflops.sum(), d[:, -1].sum(),
            traj.gate.float().sum() / self.depth, (traj.k > 0).sum().float(),
        ]).double().cpu())
        keys = ("return_mean", "compression", "gflops", "d_final", "gate_rate", "interventions")
        m.update({k: float(v) / batch for k, v in zip(keys, sums)})
        clock.mark("metrics")
        m.update(rollout_images_per_s=batch / t_rollout, update_s=t_all, phases=clock.read())
        return m

    def _critic_precision(self):
        """bf16 autocast for the critic's token branch (``critic_bf16``; by default on CUDA only);
        weights, Adam, the value heads and the losses stay fp32. No autocast cache: the steps are
        captured as CUDA graphs."""
        on = self.cfg.critic_bf16 if self.cfg.critic_bf16 is not None else self.dev.type == "cuda"
        if on:
            return torch.autocast(self.dev.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def _values(self, cb: "_StaticBatch", idx: torch.Tensor) -> torch.Tensor:
        """``u_l`` (fp32) of the transitions ``idx`` of the critic's buffers ``cb``."""
        with self._critic_precision():
            u = self.critic_tokens(cb.tokens[idx], cb.lengths[idx], cb.block[idx], cb.q[idx], cb.zn[idx],
                                          self.model.num_prefix_tokens)
        return u.float()

    def _step(self, key, fn, params: List[torch.Tensor], opts: List[str]) -> torch.Tensor:
        """One PPO minibatch step ``fn`` (reading only static buffers): eager, or (one process on
        CUDA) replayed from the CUDA graph captured for ``key`` on its first call."""
        if not self.graphs:
            return fn()
        step = self.captured.get(key)
        if step is None:
            step = self.captured[key] = CapturedStep(fn, params, [self.opts[o] for o in opts])
        return step()

    def _gate_minibatch(self) -> torch.Tensor:
        """Clipped PPO on the gate decisions of the minibatch in ``self.gate_batch`` (App. D.2-D.3)
        and the gate's gradient step; returns ``[loss, entropy]`` (detached). The sums count the
        real rows (``w``), divided by the minibatch's global size."""
        gb, p = self.gate_batch, self.cfg.ppo
        i = gb.idx
        lp, ent = evaluate_gate(self.actor, gb.cls_key[i], gb.h[i], gb.block[i], gb.gate[i])
        surr = clipped_surrogate(lp, gb.logp_old[i], gb.adv[i], p.clip_eps)
        loss = torch.where(gb.w, surr - p.entropy_gate * ent, 0.0).sum() / gb.n
        params = self.groups["gate"]
        self.opts["gate"].zero_grad(set_to_none=True)
        loss.backward()
        self.comm.sum_grads(params)
        torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
        self.opts["gate"].step()
        return torch.stack([loss, torch.where(gb.w, ent, 0.0).sum() / gb.n]).detach()

    def _controller_minibatch(self) -> torch.Tensor:
        """Clipped PPO on the budget and selector decisions of the minibatch in ``self.ctrl_batch``
        (App. D.2-D.4): symmetric PCGrad of the two losses' gradients on the shared encoder, each
        head its own gradient, then the three gradient steps; returns ``[loss_B, loss_S, H_B, H_S]``
        (detached). Each loss reaches the shared encoder and its own head only, so one backward
        pass per loss gives every gradient."""
        cb, p, comm = self.ctrl_batch, self.cfg.ppo, self.comm
        i = cb.idx
        lb, hb, ls, hs = evaluate_controller(self.actor, cb.keys[i], cb.lengths[i], cb.h[i], cb.block[i],
                                             cb.budget_index[i], cb.order[i], cb.valid[i])

        def mean(x: torch.Tensor) -> torch.Tensor:  # over the real rows, by the global minibatch size
            return torch.where(cb.w, x, 0.0).sum() / cb.n

        hb, hs = mean(hb), mean(hs)
        loss_b = mean(clipped_surrogate(lb, cb.budget_logp_old[i], cb.adv_b[i], p.clip_eps)) - p.entropy_budget * hb
        loss_s = mean(clipped_surrogate(ls, cb.selector_logp_old[i], cb.adv_s[i], p.clip_eps)) - p.entropy_selector * hs
        shared, budget, selector = self.groups["shared"], self.groups["budget"], self.groups["selector"]
        g_b = torch.autograd.grad(loss_b, shared + budget, retain_graph=True, allow_unused=True)
        g_s = torch.autograd.grad(loss_s, shared + selector, allow_unused=True)
        for name in ("shared", "budget", "selector"):
            self.opts[name].zero_grad(set_to_none=True)
        n = len(shared)
        for q, g in zip(budget + selector, g_b[n:] + g_s[n:]):
            q.grad = g
        comm.sum_grads(budget + selector)
        apply_pcgrad(shared, comm.sum_list(g_b[:n], shared), comm.sum_list(g_s[:n], shared), p.max_grad_norm, p.pcgrad_eps)
        torch.nn.utils.clip_grad_norm_(budget, p.max_grad_norm)
        torch.nn.utils.clip_grad_norm_(selector, p.max_grad_norm)
        for name in ("shared", "budget", "selector"):
            self.opts[name].step()
        return torch.stack([loss_b, loss_s, hb, hs]).detach()

    def _critic_minibatch(self, gate_on: bool) -> torch.Tensor:
        """Clipped value regression of every value head (App. D.2) on the minibatch in
        ``self.critic_batch``, then the gradient step; returns the (detached) loss. The heads run on
        every row; the losses count the real rows (``w``), the budget and selector ones only the
        gate-on transitions, each divided by its global count. ``gate_on=False`` (no gate-on
        transition in the minibatch) leaves those heads out, so their parameters get no gradient
        and Adam skips them."""
        cb, p = self.critic_batch, self.cfg.ppo
        critic, idx = self.critic, cb.idx
        u = self._values(cb, idx)
        lg = clipped_value_loss(critic.gate_value(u), cb.vg[idx], cb.target[idx], p.value_clip, p.huber_delta)
        loss = torch.where(cb.w, lg, 0.0).sum() / cb.n
        if gate_on:
            c = cb.ctrl_of[idx]
            on, cm = (c >= 0) & cb.w, c.clamp_min(0)
            lb = clipped_value_loss(critic.budget_value(u), cb.vb[idx], cb.target[idx], p.value_clip, p.huber_delta)
            vsn = critic.selector_value(u, cb.budget_index[cm], cb.frac[cm])
            ls = clipped_value_loss(vsn, cb.vs[cm], cb.target[idx], p.value_clip, p.huber_delta)
            loss = loss + torch.where(on, lb, 0.0).sum() / cb.n_on
            loss = loss + torch.where(on, ls, 0.0).sum() / cb.n_on
        params = list(critic.parameters())
        self.opts["critic"].zero_grad(set_to_none=True)
        loss.backward()
        self.comm.sum_grads(params)
        torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
        self.opts["critic"].step()
        return loss.detach()

    def _standardize(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantage standardisation over the eligible transitions of *all* processes."""
        if self.comm.world == 1:
            return standardize(adv, mask, self.cfg.ppo.adv_eps)
        sel = adv[mask].double()
        n, s1, s2 = self.comm.sum_(torch.stack([sel.new_tensor(float(sel.numel())), sel.sum(), (sel * sel).sum()]).cpu())
        if n == 0:
            return torch.zeros_like(adv)
        mean = s1 / n
        std = (s2 / n - mean * mean).clamp_min(0).sqrt() if n > 1 else torch.zeros_like(mean)
        return torch.where(mask, (adv - float(mean)) / (float(std) + self.cfg.ppo.adv_eps), torch.zeros_like(adv))

    def _local(self, t_global: List[int]) -> List[int]:
        """This process's transitions among global transition ids ``l * B + g``, as local ids."""
        batch, bl, rank = self.cfg.ppo.rollout_images, self.local_batch, self.comm.rank
        return [(t // batch) * bl + (t % batch) % bl for t in t_global if (t % batch) // bl == rank]

    def _epoch(self, pool: List[int], size: int) -> List[_Minibatch]:
        """Minibatches of one epoch over the global transitions ``pool``, shuffled on the host."""
        ids = [pool[i] for i in torch.randperm(len(pool), generator=self.cpu_gen).tolist()]
        return [_Minibatch(ids[s : s + size], self._local(ids[s : s + size])) for s in range(0, len(ids), size)]

    def _ppo_update(self, traj: Trajectory, d: torch.Tensor, rewards: torch.Tensor, a_u: float) -> Dict[str, float]:
        """One PPO update. Minibatches are drawn over the global batch (identically on every
        process); each process evaluates the transitions it holds, losses are sums divided by the
        global minibatch counts, and gradients are summed across processes before PCGrad,
        clipping and the optimiser steps, so the maths equals the single-process update.

        Every minibatch step reads fixed-shape static buffers (:class:`_StaticBatch`: the update's
        tensors, padded token sequences, the minibatch's rows and weights), so the step is the
        same on every call: one process on CUDA replays it from a CUDA graph. The integers the
        minibatches depend on come to the host in one transfer and all minibatch indices go to the
        device in one; a process holding none of a minibatch runs it with no real row (zero
        gradients, the same collectives)."""
        p, dev, comm = self.cfg.ppo, self.dev, self.comm
        b, depth = traj.k.shape
        batch = p.rollout_images
        n_t, n_c = b * depth, traj.ctrl_t.numel()
        # host copies: global feasible and gate-on flags in t order, then this process's layout
        flags = torch.stack([traj.feasible, traj.ctrl_of >= 0]).long().view(2, depth, b).permute(2, 1, 0)
        flags = comm.gather(flags.contiguous()).permute(2, 1, 0).reshape(-1)  # [2, L, B] flattened
        host = torch.cat([flags, traj.token_lengths, traj.ctrl_of, traj.ctrl_lengths])
        sizes = [batch * depth] * 2 + [n_t] * 2 + [n_c]
        feas_h, on_h, tok_len_h, ctrl_of_h, ctrl_len_h = (t.tolist() for t in host.cpu().split(sizes))
        # minibatches, drawn in the order the loops use them; their local ids go to the device at once
        feas_g = [t for t, f in enumerate(feas_h) if f]
        on_g = [t for t, o in enumerate(on_h) if o]
        actor_epochs = [(self._epoch(feas_g, p.gate_minibatch), self._epoch(on_g, p.controller_minibatch))
                        for _ in range(p.actor_epochs)]
        for _, ctrl_mbs in actor_epochs:
            for mb in ctrl_mbs:
                mb.local = [ctrl_of_h[t] for t in mb.local]  # rows of the controller's buffers
        critic_mbs = [mb for _ in range(p.critic_epochs) for mb in self._epoch(list(range(batch * depth)), p.critic_minibatch)]
        mbs = [mb for gate_mbs, ctrl_mbs in actor_epochs for mb in gate_mbs + ctrl_mbs] + critic_mbs
        flat = torch.tensor([t for mb in mbs for t in mb.local], dtype=torch.long).to(dev)
        for mb, idx in zip(mbs, flat.split([len(mb.local) for mb in mbs])):
            mb.idx = idx

        phi = native_features(traj.z_native, self.cfg.tau_b)
        q = trajectory_scalar_states(traj.k, d, phi, a_u, self.num_patches).transpose(0, 1).reshape(n_t, -1)
        ci = traj.ctrl_t
        n_ctrl = traj.ctrl_lengths - 1
        frac = self.actor.budgets[traj.budget_index].float() / n_ctrl.clamp_min(1).float()  # k_l / N_l
        # the critic's inputs, padded: H_l of each transition in P + N0 rows (one scatter per update)
        tokens = Packed(traj.tokens, traj.token_lengths, tok_len_h, traj.num_prefix).padded(traj.num_prefix + self.num_patches)
        cb = self.critic_batch
        fresh = cb.load(n_t, tokens=tokens, lengths=traj.token_lengths, block=traj.block, q=q,
                        zn=traj.z_native.repeat(depth, 1), ctrl_of=traj.ctrl_of, budget_index=traj.budget_index, frac=frac)

        # old values (normalised units) and the shared lambda-return
        self.critic.eval()
        chunk = 1024
        with torch.no_grad():
            t_loc = torch.arange(n_t, device=dev)
            u = torch.cat([self._values(cb, t_loc[s : s + chunk]) for s in range(0, n_t, chunk)])
            vg, vb = self.critic.gate_value(u), self.critic.budget_value(u)
            vs = self.critic.selector_value(u[ci], traj.budget_index, frac)
        self.clock.mark("old_values")
        vg_ret = self.rms.denormalize(vg)
        _, ret = gae_shared_return(rewards, vg_ret.view(depth, b).T, p.gae_lambda, p.gamma)
        ret_t = ret.T.reshape(-1)
        adv_g = self._standardize(ret_t - vg_ret, traj.feasible)
        ones = torch.ones(n_c, dtype=torch.bool, device=dev)
        adv_b = self._standardize(ret_t[ci] - self.rms.denormalize(vb[ci]), ones)
        adv_s = self._standardize(ret_t[ci] - self.rms.denormalize(vs), ones)
        self.rms.update(comm.gather(ret_t.view(depth, b).T.contiguous()).T.reshape(-1))  # global, t order
        fresh |= cb.load(n_t, vg=vg, vb=vb, vs=vs, target=self.rms.normalize(ret_t))

        # the actor's inputs: the gate's per transition, the controller's per gate-on transition
        # (keys padded to 1 + N0 rows, the recorded order to the largest budget's columns)
        fresh |= self.gate_batch.load(n_t, cls_key=traj.cls_key, h=traj.h, block=traj.block, gate=traj.gate,
                                      logp_old=traj.gate_logp_old, adv=adv_g)
        pad = (0, int(self.actor.budgets[-1]) - traj.order.shape[1])
        kb = self.ctrl_batch
        fresh |= kb.load(n_t, keys=Packed(traj.ctrl_keys, traj.ctrl_lengths, ctrl_len_h, 1).padded(1 + self.num_patches),
                         lengths=traj.ctrl_lengths, h=traj.h[ci], block=traj.block[ci], budget_index=traj.budget_index,
                         budget_logp_old=traj.budget_logp_old, selector_logp_old=traj.selector_logp_old,
                         order=F.pad(traj.order, pad), valid=F.pad(traj.valid, pad), adv_b=adv_b, adv_s=adv_s)
        kb.lengths[n_c:].fill_(1 + self.num_patches)  # rows no transition fills: a harmless full sequence
        if fresh:
            self.captured.clear()  # new buffers: capture again

        logs: Dict[str, List[torch.Tensor]] = {"gate": [], "controller": [], "critic": []}
        gate_params = self.groups["gate"]
        ctrl_params = self.groups["shared"] + self.groups["budget"] + self.groups["selector"]
        self.actor.train()
        for gate_mbs, ctrl_mbs in actor_epochs:
            for mb in gate_mbs:
                self.gate_batch.select(mb.idx, len(mb.ids))
                logs["gate"].append(self._step("gate", self._gate_minibatch, gate_params, ["gate"]).double())
            for mb in ctrl_mbs:
                kb.select(mb.idx, len(mb.ids))
                out = self._step("controller", self._controller_minibatch, ctrl_params, ["shared", "budget", "selector"])
                logs["controller"].append(out.double())
        self.actor.eval()
        self.clock.mark("actor_update")

        self.critic.train()
        cparams = list(self.critic.parameters())
        for mb in critic_mbs:
            n_on_g = sum(on_h[t] for t in mb.ids)  # the loss divisor: gate-on transitions of all processes
            cb.select(mb.idx, len(mb.ids), n_on_g)
            gate_on = n_on_g > 0 and n_c > 0  # (n_c: this process holds gate-on transitions)
            out = self._step(("critic", gate_on), functools.partial(self._critic_minibatch, gate_on), cparams, ["critic"])
            logs["critic"].append(out.double().reshape(1))
        self.critic.eval()
        self.clock.mark("critic_update")
        # one transfer (and one all-reduce) for every logged value: per-step reads would stall the host
        names = {"gate": ("loss_gate", "entropy_gate"), "critic": ("loss_value",),
                 "controller": ("loss_budget", "loss_selector", "entropy_budget", "entropy_selector")}
        out = {k: float("nan") for ks in names.values() for k in ks}
        kinds = [k for k in names if logs[k]]
        if kinds:
            means = comm.sum_(torch.cat([torch.stack(logs[k]).mean(0) for k in kinds]).cpu())
            keys = [name for k in kinds for name in names[k]]
            out.update({k: float(v) for k, v in zip(keys, means)})
        return out

    # ---------------------------------------------------------------------------------------
    def evaluate_dev(self) -> CheckpointRecord:
        pred, gflops = self._predict(self.dev_x, ActorPolicy(self.actor))
        top1 = 100.0 * float((pred == self.dev_y).float().mean())
        return CheckpointRecord(f"u{self.u:05d}", top1, self.dev_native_top1, float(gflops.mean()))

    def state_dict(self) -> Dict:
        return {
            "u": self.u,
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "opts": {k: o.state_dict() for k, o in self.opts.items()},
            "rms": self.rms.state_dict(),
            "feedback": self.feedback.state_dict(),
            "sampler": self.sampler.state_dict(),
            "gen": self.gen.get_state(),
            "cpu_gen": self.cpu_gen.get_state(),
            "checkpoints": self.checkpoints,
            "config": dataclasses.asdict(self.cfg),
            "cpu_threads": torch.get_num_threads(),
        }

    def stop_prefetch(self) -> None:
        """Stop the processes making rollout batches ahead (the next update starts them again)."""
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None

    def load_state_dict(self, state: Dict) -> None:
        self.stop_prefetch()  # its batches follow the sampler state being replaced
        self.u = int(state["u"])
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        for k, o in self.opts.items():
            o.load_state_dict(state["opts"][k])
        self.rms.load_state_dict(state["rms"])
        self.feedback.load_state_dict(state["feedback"])
        self.sampler.load_state_dict(state["sampler"])
        self.gen.set_state(state["gen"])
        self.cpu_gen.set_state(state["cpu_gen"])
        self.checkpoints = list(state["checkpoints"])
        threads = state.get("cpu_threads")
        if self.dev.type == "cpu" and threads and threads != torch.get_num_threads():
            # CPU float reductions split their work by thread count: the same count continues exactly
            print(f"--resume: using {threads} CPU threads, as the saved run did (this process had "
                  f"{torch.get_num_threads()})", file=sys.stderr)
            torch.set_num_threads(threads)

    def save_checkpoint(self) -> CheckpointRecord:
        """Evaluate on dev and save actor + training state (first process only; shared record)."""
        rec = None
        if self.comm.main:
            rec = self.evaluate_dev()
            folder = self.out / "checkpoints" / rec.name
            self.actor.save_pretrained(folder, backbone=self.model, extra=self._training_facts(rec))
        rec = self.comm.broadcast_object(rec)
        self.checkpoints.append(dataclasses.asdict(rec))
        if self.comm.main:
            torch.save(self.state_dict(), self.out / "state.pt")
        self.comm.barrier()
        return rec

    def _training_facts(self, rec: CheckpointRecord) -> Dict:
        return {
            "updates": self.u, "target_drop": self.cfg.target_drop, "a_u": self.feedback.coefficient,
            "dev_top1": rec.top1, "dev_native_top1": rec.native_top1, "dev_gflops": rec.gflops,
            "model": self.cfg.model, "data": self.cfg.data,
        }

    def select(self) -> Dict:
        """Apply the dev selection rule and write the chosen actor to ``OUT/selected``."""
        recs = [CheckpointRecord(**r) for r in self.checkpoints]
        choice = select_checkpoint(recs, target_pp=100.0 * self.cfg.target_drop)
        actor = Actor.from_pretrained(self.out / "checkpoints" / choice.record.name)
        summary = {"selected": dataclasses.asdict(choice.record), "violates": choice.violates,
                   "target_pp": 100.0 * self.cfg.target_drop, "checkpoints": self.checkpoints}
        actor.save_pretrained(self.out / "selected", backbone=self.model,
                              extra={**actor.pretrained_config.get("training", {}), "selection": summary})
        (self.out / "selection.json").write_text(json.dumps(summary, indent=1))
        return summary

    def fit(self) -> Dict:
        """Run (or resume) to ``total_updates``; checkpoint, log, select."""
        cfg, main = self.cfg, self.comm.main
        log = open(self.out / "metrics.jsonl", "a") if main else None
        bar = None
        if cfg.progress and main:
            from tqdm.auto import tqdm

            # tqdm shows s/update (or updates/s) and the remaining time
            bar = tqdm(total=cfg.total_updates, initial=self.u, desc="DORA PPO", unit="update", dynamic_ncols=True)
        start = time.perf_counter()
        try:
            while self.u < cfg.total_updates:
                m = self.step()
                out_of_time = self.comm.broadcast_object(cfg.max_minutes > 0 and time.perf_counter() - start > 60 * cfg.max_minutes)
                if self.u % cfg.checkpoint_every == 0 or self.u == cfg.total_updates or out_of_time:
                    t = time.perf_counter()
                    rec = self.save_checkpoint()
                    m.update(dev_top1=rec.top1, dev_gflops=rec.gflops, dev_native_top1=rec.native_top1)
                    m["phases"]["checkpoint"] = time.perf_counter() - t  # dev evaluation and saving
                if main:
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    self._tensorboard(m)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(a=f"{m['a_u']:.1f}", C=f"{m['compression']:.3f}", G=f"{m['gflops']:.2f}")
                if out_of_time:
                    print(f"--max-minutes reached after update {self.u}: stopping (resume with --resume)", file=sys.stderr)
                    break
        finally:
            self.stop_prefetch()
            if log is not None:
                log.close()
            if bar is not None:
                bar.close()
        summary = self.select() if main else None
        return self.comm.broadcast_object(summary)

    def _tensorboard(self, m: Dict) -> None:
        if not self.cfg.tensorboard:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out / "tb"))
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "update" and math.isfinite(v):
                self._tb.add_scalar(k, v, self.u)


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="timm-dora-train",
        description="Train a DORA actor for a timm ViT with the paper's PPO recipe.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="timm model name, e.g. vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--data", required=True, help="labels CSV (path,label,...,split) or ImageFolder root")
    ap.add_argument("--out", required=True, help="output directory (checkpoints, metrics.jsonl, selected/)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/state.pt exactly")
    ap.add_argument("--augment", nargs="?", const="light", default="none", choices=D.AUGMENT_LEVELS,
                    help="rollout augmentation for small pools (ours): light = crop (0.5-1) + flip; strong = crop "
                         "(0.25-1) + flip + RandAugment + label-free patch CutMix (--cutmix-prob); bare --augment = light")
    skip = {"model", "data", "out", "ppo", "augment"}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        _add(ap, f.name, f.type, f.default)
    for f in dataclasses.fields(PPOConfig):
        if f.name != "total_images":  # = rollout_images * updates
            _add(ap, f.name, f.type, f.default, prefix="ppo")
    return ap


def _add(ap, name, typ, default, prefix=None):
    flag = "--" + name.replace("_", "-")
    dest = f"{prefix}__{name}" if prefix else name
    typ = str(typ)
    if "bool" in typ:
        ap.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default)
    elif "int" in typ and "Optional" not in typ:
        ap.add_argument(flag, dest=dest, type=int, default=default)
    elif "float" in typ:
        ap.add_argument(flag, dest=dest, type=float, default=default)
    elif "Optional[int]" in typ:
        ap.add_argument(flag, dest=dest, type=int, default=default)
    else:
        ap.add_argument(flag, dest=dest, type=str, default=default)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    ppo_kw = {k.split("__", 1)[1]: v for k, v in vars(args).items() if k.startswith("ppo__")}
    top = {k: v for k, v in vars(args).items() if not k.startswith("ppo__") and k != "resume"}
    ppo_kw["total_images"] = ppo_kw["rollout_images"] * ppo_kw["updates"]
    return TrainConfig(ppo=PPOConfig(**ppo_kw), **top)


def _warm_start(source: str, actor: Actor, model: nn.Module, readout: str) -> Dict[str, torch.Tensor]:
    """The weights of the saved actor at ``source`` (``--init-actor``), checked against the
    backbone and against the actor this run would make (same sizes), or a ``ValueError``."""
    from .hub import check_backbone, load_pretrained

    loaded, config = load_pretrained(source)
    check_backbone(config, model, readout)
    if loaded.config() != actor.config():
        here = actor.config()
        diff = {k: (v, here.get(k)) for k, v in loaded.config().items() if here.get(k) != v}
        raise ValueError(f"--init-actor {source}: its sizes differ from this run's actor (saved, here): {diff}")
    return loaded.state_dict()


def _truncate_log(path: Path, last_update: int) -> None:
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["update"] <= last_update]
        path.write_text("".join(ln + "\n" for ln in lines))


def _init_distributed(cfg: TrainConfig) -> bool:
    """Join the process group when launched by ``torchrun`` (WORLD_SIZE > 1): NCCL on CUDA (one
    GPU per process, ``LOCAL_RANK``), gloo on CPU. Returns whether this call created the group."""
    import os

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


def main(argv: Optional[List[str]] = None) -> int:
    """``timm-dora-train``; also ``torchrun --nproc_per_node N -m timm_dora.train ...`` (data parallel)."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    created = _init_distributed(cfg)
    try:
        return _main(args, cfg)
    finally:
        if created:
            import torch.distributed as dist

            dist.barrier()  # leave together: a peer tearing down gloo early can abort the other
            dist.destroy_process_group()


def _main(args: argparse.Namespace, cfg: TrainConfig) -> int:
    out = Path(cfg.out)
    if (out / "state.pt").exists() and not args.resume:
        print(f"{out}/state.pt exists: pass --resume to continue it, or choose another --out", file=sys.stderr)
        return 2
    with _deterministic_on_cpu(cfg.device):
        return _train(args, cfg, out)


@contextlib.contextmanager
def _deterministic_on_cpu(device: str):
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
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    summary = trainer.fit()
    if not trainer.comm.main:
        return 0
    sel = summary["selected"]
    flag = " (VIOLATES the target: no checkpoint met it)" if summary["violates"] else ""
    print(f"selected {sel['name']}: dev top-1 {sel['top1']:.2f} (native {sel['native_top1']:.2f}), "
          f"{sel['gflops']:.3f} GFLOPs{flag} -> {out / 'selected'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
