"""Training DORA actors with the paper's PPO recipe (Sec. 3.3-3.5, App. B-E), and the CLI.

    timm-dora-train --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W.safetensors \\
        --data ../shared/data/imagenet-mini/labels.csv --out runs/vit_tiny

One update ``u`` (App. C/D):

1. draw ``rollout_images`` images from the rollout pool; the fidelity coefficient ``a_u`` is fixed
   for this rollout and its update;
2. Native logits, a sampled rollout on the frozen bf16 backbone (hard deletion through the
   inference code, :func:`timm_dora.train.rollout.collect`) and the complete-prefix shadows
   (:func:`timm_dora.train.rollout.shadow_divergences`), all under ``no_grad``;
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

import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ..backbone import create_backbone
from ..data import HeldImages
from ..engine import Packed, run, wrap
from ..policy import Actor, ActorPolicy, NoPrune, RolloutNoise, encoder_sizes
from . import pool as P
from .checkpoints import CheckpointLog, actor_width, warm_start
from .config import TrainConfig
from .critic import Critic, native_features, trajectory_scalar_states
from .feedback import FeedbackController
from .graph_step import BackgroundSteps, CapturedStep, StaticBatch
from .images import TrainingImages
from .ppo import (
    RunningMeanStd, actor_parameter_groups, apply_pcgrad, clipped_surrogate, clipped_value_loss, gae_shared_return,
    minibatches, standardize,
)
from .rewards import step_rewards, token_layer_compression
from .rollout import Trajectory, collect, evaluate_controller, evaluate_gate, shadow_divergences
from .runtime import Comm, PhaseClock, eager_attention
from .selection import CheckpointRecord

__all__ = ["Trainer"]


@dataclass
class _Minibatch:
    """One PPO minibatch: its transitions' ids (numbered over every process's images), and this
    process's rows of the step's buffers among them (the controller's buffers hold the gate-on
    transitions only): on the host (``rows``) and on the device, in chunks of at most the
    buffers' capacity (``chunks``; one, empty, where this process holds none). ``n_on``: the
    gate-on transitions among ``ids`` (the critic's divisor)."""

    ids: List[int]
    rows: List[int]
    n_on: int = 0
    chunks: Optional[List[torch.Tensor]] = None


class Trainer:
    """Holds the frozen wrapped backbone, the actor, the critic, optimisers and all training state."""

    def __init__(self, cfg: TrainConfig, sync_phases: bool = False):
        self.cfg = cfg.check()
        # data parallel: device tensors (the update's flags, sums and gradients) on the world's
        # communicator; host counts on gloo; the critic's gradients, summed while the next rollout
        # runs, on a communicator of their own (nothing else is in flight on it)
        self.comm = Comm()
        self.host_comm = self.comm.subgroup("gloo")
        self.critic_comm = self.comm.subgroup()
        self.dev = torch.device(cfg.device)
        self.clock = PhaseClock(self.dev, sync=sync_phases)  # per-phase times of each update
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.ppo.seed)  # (a backbone without weights: its random initialisation)
        kw = {}
        if cfg.img_size:
            kw["img_size"] = cfg.img_size
        if cfg.num_classes:
            kw["num_classes"] = cfg.num_classes
        model = create_backbone(cfg.model, cfg.weights, pretrained=cfg.pretrained, **kw)

        # data: the backbone's own preprocessing (App. E.1); the splits' labels and disjointness are
        # checked before any GPU work; the fixed sets are held on the device, rollouts streamed
        # (or held for small pools: train.images)
        cfg.augment = P.augment_level(cfg.augment)
        self.images = TrainingImages(cfg, model)
        self.cfg = cfg = cfg.resolved(len(self.images.pool), actor_width(cfg.actor_width, cfg.init_actor, model)).check()
        # (after resolved(): --batch-scale multiplies the rollout images)
        if cfg.ppo.rollout_images % self.comm.world:
            raise ValueError(f"--rollout-images {cfg.ppo.rollout_images} must be divisible by the number of processes {self.comm.world}")
        self.local_batch = cfg.ppo.rollout_images // self.comm.world
        self.images.check(model.num_classes)
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.model = wrap(model.to(self.dev, self.dtype), policy=NoPrune(), readout=cfg.readout, skip_dead=cfg.skip_dead,
                          merge=cfg.merge, cuda_graphs=False)
        self.num_patches, self.depth = model.patch_embed.num_patches, len(model.blocks)
        self.images.load(cfg, self.dev, self.dtype, self.comm.rank, self.comm.world)

        # learners, initialised from the seed alone (not from how many data loaders ran before)
        torch.manual_seed(cfg.ppo.seed)
        self.actor = Actor.for_model(model, budget_step=cfg.budget_step, merge=cfg.merge, **encoder_sizes(cfg.actor_width))
        self.init_training = warm_start(cfg.init_actor, self.actor, self.model, cfg.readout) if cfg.init_actor else {}
        self.actor = self.actor.to(self.dev)
        self.critic = Critic.for_model(model, budget_step=cfg.budget_step, backend="padded").to(self.dev)
        self.graphs = cfg.cuda_graphs and self.dev.type == "cuda"
        p = cfg.ppo
        g = actor_parameter_groups(self.actor)
        self.groups = g
        # capturable: the minibatch steps are replayed from CUDA graphs (on CUDA)
        adam = functools.partial(torch.optim.Adam, capturable=self.graphs)
        self.opts = {
            "gate": adam(g["gate"], lr=p.lr_gate),
            "shared": adam(g["shared"], lr=p.lr_shared),
            "budget": adam(g["budget"], lr=p.lr_budget),
            "selector": adam(g["selector"], lr=p.lr_selector),
            "critic": adam(self.critic.parameters(), lr=p.lr_critic),
        }
        # a minibatch's rows spread over the processes. Stratified (--strata, --batch-scale) with whole
        # strata per process: exactly its share of size // strata per stratum held. Else its share is
        # about size / world (binomial) and fits its buffers but for a few minibatches (two chunks).
        # (DeiT-B, 2 H200s, --batch-scale 2: the 5/4 buffers cost 24 % more actor-step GPU time)
        def capacity(size: int) -> int:
            world, strata = self.comm.world, p.strata
            if world == 1:
                return size
            if strata % world == 0:
                return strata // world * (size // strata)
            return min(size, -(-5 * size // (4 * world)))

        self.gate_batch = StaticBatch(capacity(p.gate_minibatch), self.dev)
        self.ctrl_batch = StaticBatch(capacity(p.controller_minibatch), self.dev)
        self.critic_batch = StaticBatch(capacity(p.critic_minibatch), self.dev)
        self.captured: Dict[object, CapturedStep] = {}  # minibatch steps by kind, captured on first use
        self.background = BackgroundSteps()  # overlap: the critic's steps beside the next rollout
        self._critic_record: Optional[Dict] = None  # the metrics waiting for their critic loss
        # the critic's fixed-shape token branch, compiled by Inductor (--compile; on CUDA by default): H100,
        # ViT-Ti: critic update 0.39 -> 0.27 s, ~40 s of compiling in the first update (the controller: no gain)
        compiled = cfg.compile if cfg.compile is not None else self.dev.type == "cuda"
        self.critic_tokens = torch.compile(self.critic.encode_padded, dynamic=False) if compiled else self.critic.encode_padded
        self.rms = RunningMeanStd()
        target, scale = cfg.feedback_rule
        self.feedback = FeedbackController(a_init=cfg.a_init, target=target, scale=scale, cadence=cfg.feedback_cadence,
                                           num_shards=len(self.images.check_shards), fixed=cfg.fixed_coefficient, ema=cfg.feedback_ema)
        self.sampler = P.RolloutSampler(len(self.images.pool), p.rollout_images, torch.Generator().manual_seed(p.seed))
        self.gen = torch.Generator(device=self.dev).manual_seed(p.seed)  # rollout noise, same on every process
        self.cpu_gen = torch.Generator().manual_seed(p.seed + 1)  # minibatch order
        self.u = 0
        self.checkpoints = CheckpointLog(self.out, self.comm.main)
        # Native references on the checks and dev (fixed backbone); the sizes and native counts of
        # all processes' shares
        im = self.images
        self.qc_native_pred = self._predict(im.checks, NoPrune())[0]
        self.qc_native = self.qc_native_pred == im.checks.labels
        self.dev_native_pred, _ = self._predict(im.dev, NoPrune())
        counts = self.host_comm.sum_(torch.tensor(im.local_sizes + [int((self.dev_native_pred == im.dev.labels).sum())],
                                             dtype=torch.float64))
        self.check_sizes, self.dev_size = [int(c) for c in counts[:-2]], int(counts[-2])
        self.dev_native_top1 = 100.0 * float(counts[-1]) / max(1, self.dev_size)
        if min(self.check_sizes + [self.dev_size]) < 1:
            raise ValueError(f"no readable image in a feedback shard or in the dev split (sizes {self.check_sizes}, "
                             f"{self.dev_size})")
        self._tb = None

    # ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _predict(self, images: HeldImages, policy, rows: Optional[torch.Tensor] = None) -> tuple:
        """Top-1 predictions and GFLOPs of ``policy`` on the held ``images`` (``rows`` of them)."""
        preds, gflops = [], []
        n = len(images) if rows is None else rows.numel()
        with eager_attention():
            for s in range(0, n, self.cfg.eval_batch):
                sel = slice(s, s + self.cfg.eval_batch) if rows is None else rows[s : s + self.cfg.eval_batch]
                logits, stats = run(self.model, images.inputs(sel, self.dtype), policy)
                preds.append(logits.argmax(1))
                gflops.append(stats.gflops)
        if not preds:  # (a process may hold no image of a small shard)
            return torch.zeros(0, dtype=torch.long, device=self.dev), torch.zeros(0, device=self.dev)
        return torch.cat(preds), torch.cat(gflops)

    # ---------------------------------------------------------------------------------------
    def step(self) -> Dict[str, float]:
        """One PPO update (rollout, shadows, feedback, update); returns its metrics (data parallel:
        over every process's images, the same on every process)."""
        cfg, p, comm = self.cfg, self.cfg.ppo, self.comm
        self.u += 1
        u = self.u
        clock = self.clock
        t0 = time.perf_counter()
        clock.start()
        batch = p.rollout_images
        mine = torch.arange(comm.rank * self.local_batch, (comm.rank + 1) * self.local_batch)
        # batches from this update on, made ahead from a copy of the sampler as it stands now
        self.images.start(self.sampler, u - 1, mine.tolist())
        idx = next(self.sampler)  # the global batch, identical on every process
        noise = RolloutNoise.draw(self.depth, batch, self.actor.num_budgets, self.num_patches, self.gen, self.dev)
        x = self.images.rollout(u, idx, mine.tolist())
        clock.mark("data")
        a_u = self.feedback.coefficient
        self.actor.eval()
        with torch.no_grad(), eager_attention():
            z_native = run(self.model, x, NoPrune())[0].float()
            clock.mark("native")
            traj = collect(self.model, self.actor, x, z_native=z_native, noise=noise.rows(mine.to(self.dev)))
            clock.mark("rollout")
            d = shadow_divergences(self.model, x, traj, p.kd_temperature, cfg.shadow_chunk)
            clock.mark("shadows")
        if self.dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
        t_rollout = time.perf_counter() - t0
        m: Dict[str, float] = {"update": u, "a_u": a_u}
        if self.feedback.due(u):  # each process its share of the shard, the counts summed
            shard = self.feedback.next_shard()
            sel = self.images.check_shards[shard]
            pred, _ = self._predict(self.images.checks, ActorPolicy(self.actor), sel)
            correct = pred == self.images.checks.labels[sel]
            counts = self.host_comm.sum_(torch.stack([(self.qc_native[sel].long() - correct.long()).sum(),
                                            (self.qc_native_pred[sel] != pred).sum()]).double().cpu())
            # both measures logged (the second calibrates the other's target); the signal steers
            measured = [float(c) / self.check_sizes[shard] for c in counts]
            signal = measured[0] if cfg.feedback_signal == "drop" else measured[1]
            self.feedback.update(u, signal, shard)
            m.update(d_u=signal, d_smoothed=self.feedback.smoothed, qc_shard=shard, a_next=self.feedback.coefficient,
                     qc_drop=measured[0], qc_disagreement=measured[1])
            clock.mark("feedback")
        # every process its own images' rewards and update rows (data parallel: _ppo_update)
        rewards = step_rewards(traj.k, d, a_u, p.compression_scale, cfg.terminal_only, num_patches=self.num_patches)
        m.update(self._ppo_update(traj, d, rewards, a_u))
        if self.background.busy:
            self._critic_record = m  # its loss_value comes with finish_critic
        if self.dev.type == "cuda":
            torch.cuda.current_stream().synchronize()  # (not the critic's stream: see finish_critic)
        t_all = time.perf_counter() - t0
        comp = token_layer_compression(traj.k, self.num_patches)
        sums = torch.stack([rewards.sum(1).sum(), comp.sum(), traj.gflops.sum(), d[:, -1].sum(),
                            traj.gate.float().sum() / self.depth, (traj.k > 0).sum().float()]).double().cpu()
        sums = self.host_comm.sum_(torch.cat([sums, torch.tensor([float(self.images.skipped)], dtype=torch.float64)]))
        keys = ("return_mean", "compression", "gflops", "d_final", "gate_rate", "interventions")
        m.update({k: float(v) / batch for k, v in zip(keys, sums)})
        m["skipped_images"] = int(sums[-1])  # unreadable files met so far, all processes
        clock.mark("metrics")
        m.update(rollout_images_per_s=batch / t_rollout, update_s=t_all, phases=clock.read(), time=time.time())
        return m

    def _share_actor(self) -> None:
        """The first process's updated actor, copied to every process (one broadcast). The processes
        took the same steps from the same summed gradients (an all-reduce gives every process the
        same bits), so actor and critic stay equal; the rollouts depend on the actor alone being
        one, so it is made sure of (the critic only sets each process's baselines)."""
        params = list(self.actor.parameters())
        flat = self.comm.broadcast_(torch.cat([q.detach().reshape(-1) for q in params]))
        if not self.comm.main:
            with torch.no_grad():
                for q, v in zip(params, flat.split([q.numel() for q in params])):
                    q.copy_(v.view_as(q))

    def _critic_precision(self):
        """bf16 autocast for the critic's token branch (``critic_bf16``; by default on CUDA only);
        weights, Adam, the value heads and the losses stay fp32. No autocast cache: the steps are
        captured as CUDA graphs."""
        on = self.cfg.critic_bf16 if self.cfg.critic_bf16 is not None else self.dev.type == "cuda"
        if on:
            return torch.autocast(self.dev.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def _values(self, cb: "StaticBatch", idx: torch.Tensor) -> torch.Tensor:
        """``u_l`` (fp32) of the transitions ``idx`` of the critic's buffers ``cb``."""
        with self._critic_precision():
            u = self.critic_tokens(cb.tokens[idx], cb.lengths[idx], cb.block[idx], cb.q[idx], cb.zn[idx],
                                          self.model.num_prefix_tokens)
        return u.float()

    def _step(self, kind: str, mb: _Minibatch) -> torch.Tensor:
        """One PPO minibatch step of a ``kind`` (``gate``, ``controller``, ``critic``): this
        process's rows of ``mb`` chunk by chunk through the step's static buffers, the gradients
        summed over processes once, then the optimiser steps (:class:`CapturedStep`: on CUDA
        replayed from the CUDA graphs captured for the step's key on its first call). Returns the
        step's logged values (detached)."""
        key, batch, grads, apply, params, opts, comm = self._kind(kind, mb)
        step = self.captured.get(key)
        if step is None:
            step = self.captured[key] = CapturedStep(grads, apply, params, [self.opts[o] for o in opts],
                                                     reduce=comm.sum_ if comm.world > 1 else None, graphs=self.graphs)
        step.begin()
        for idx in mb.chunks:
            batch.select(idx, len(mb.ids), mb.n_on)
            step.add()
        return step.finish()

    def _kind(self, kind: str, mb: _Minibatch):
        """``(key, static buffers, grads, apply, params, optimisers, comm)`` of a ``kind`` of step."""
        g = self.groups
        if kind == "gate":
            return ("gate", self.gate_batch, self._gate_grads, functools.partial(self._apply, g["gate"], "gate"),
                    g["gate"], ["gate"], self.comm)
        if kind == "controller":
            return ("controller", self.ctrl_batch, self._controller_grads, self._controller_apply,
                    g["shared"] + g["budget"] + g["selector"], ["shared", "budget", "selector"], self.comm)
        on = mb.n_on > 0  # (no gate-on transition in the minibatch: the budget and selector heads rest)
        params = list(self.critic.parameters())
        return (("critic", on), self.critic_batch, functools.partial(self._critic_grads, on),
                functools.partial(self._apply, params, "critic"), params, ["critic"], self.critic_comm)

    # Each kind of step in two parts (CapturedStep): ``grads`` -- the gradients and logged values of
    # the rows in the buffers, sums over the real rows (``w``) divided by the minibatch's divisors, so
    # that chunks and processes add up -- and ``apply``, the optimiser steps on the summed gradients.

    def _gate_grads(self) -> List[Optional[torch.Tensor]]:
        """Clipped PPO on the gate decisions (App. D.2-D.3); ``[*grads, [loss, entropy]]``."""
        gb, p = self.gate_batch, self.cfg.ppo
        i = gb.idx
        lp, ent = evaluate_gate(self.actor, gb.cls_key[i], gb.h[i], gb.block[i], gb.gate[i])
        surr = clipped_surrogate(lp, gb.logp_old[i], gb.adv[i], p.clip_eps)
        loss = torch.where(gb.w, surr - p.entropy_gate * ent, 0.0).sum() / gb.n
        grads = torch.autograd.grad(loss, self.groups["gate"], allow_unused=True)
        return [*grads, torch.stack([loss, torch.where(gb.w, ent, 0.0).sum() / gb.n]).detach()]

    def _apply(self, params: List[torch.Tensor], opt: str, parts: List[Optional[torch.Tensor]]) -> torch.Tensor:
        """The gate's and the critic's ``apply``: the summed gradients, clipped, one optimiser step."""
        for q, g in zip(params, parts):
            q.grad = g
        torch.nn.utils.clip_grad_norm_(params, self.cfg.ppo.max_grad_norm)
        self.opts[opt].step()
        return parts[-1]

    def _controller_grads(self) -> List[Optional[torch.Tensor]]:
        """Clipped PPO on the budget and selector decisions (App. D.2-D.4): each loss's gradient on
        the shared encoder and its own head (one backward pass per loss reaches both);
        ``[*g_B, *g_S, [loss_B, loss_S, H_B, H_S]]``."""
        cb, p = self.ctrl_batch, self.cfg.ppo
        i = cb.idx
        lb, hb, ls, hs = evaluate_controller(self.actor, cb.keys[i], cb.lengths[i], cb.h[i], cb.block[i],
                                             cb.budget_index[i], cb.order[i], cb.valid[i])

        def mean(x: torch.Tensor) -> torch.Tensor:  # over the real rows, by the minibatch size
            return torch.where(cb.w, x, 0.0).sum() / cb.n

        hb, hs = mean(hb), mean(hs)
        loss_b = mean(clipped_surrogate(lb, cb.budget_logp_old[i], cb.adv_b[i], p.clip_eps)) - p.entropy_budget * hb
        loss_s = mean(clipped_surrogate(ls, cb.selector_logp_old[i], cb.adv_s[i], p.clip_eps)) - p.entropy_selector * hs
        shared, budget, selector = self.groups["shared"], self.groups["budget"], self.groups["selector"]
        g_b = torch.autograd.grad(loss_b, shared + budget, retain_graph=True, allow_unused=True)
        g_s = torch.autograd.grad(loss_s, shared + selector, allow_unused=True)
        return [*g_b, *g_s, torch.stack([loss_b, loss_s, hb, hs]).detach()]

    def _controller_apply(self, parts: List[Optional[torch.Tensor]]) -> torch.Tensor:
        """Symmetric PCGrad of the two gradients on the shared encoder, each head its own
        gradient, then the three gradient steps."""
        p = self.cfg.ppo
        shared, budget, selector = self.groups["shared"], self.groups["budget"], self.groups["selector"]
        n, nb = len(shared), len(shared) + len(budget)
        g_b, g_s = parts[:nb], parts[nb:-1]
        for q, g in zip(budget + selector, g_b[n:] + g_s[n:]):
            q.grad = g
        apply_pcgrad(shared, g_b[:n], g_s[:n], p.max_grad_norm, p.pcgrad_eps)
        torch.nn.utils.clip_grad_norm_(budget, p.max_grad_norm)
        torch.nn.utils.clip_grad_norm_(selector, p.max_grad_norm)
        for name in ("shared", "budget", "selector"):
            self.opts[name].step()
        return parts[-1]

    def _critic_grads(self, gate_on: bool) -> List[Optional[torch.Tensor]]:
        """Clipped value regression of every value head (App. D.2); ``[*grads, [loss]]``. The heads
        run on every row; the losses count the real rows (``w``), the budget and selector ones only
        the gate-on transitions, each divided by its count. ``gate_on=False`` (no gate-on
        transition in the minibatch) leaves those heads out: their parameters get no gradient and
        Adam skips them."""
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
        grads = torch.autograd.grad(loss, list(critic.parameters()), allow_unused=True)
        return [*grads, loss.detach()[None]]

    def _critic_steps(self, mbs: List[_Minibatch]) -> torch.Tensor:
        """The critic's minibatch steps of an update; their mean loss."""
        return torch.stack([self._step("critic", mb).double().reshape(-1) for mb in mbs]).mean(0)

    def finish_critic(self) -> None:
        """With ``overlap`` an update's critic steps run beside the next rollout, which does not read
        the critic (:class:`~timm_dora.train.graph_step.BackgroundSteps`). Wait for them before the
        critic is read or its buffers refilled (old values, a checkpoint); their mean loss goes
        into their own update's metrics. The steps and their order are those without overlap."""
        mean = self.background.finish()
        if mean is not None:
            self._critic_record["loss_value"] = float(mean)
            self._critic_record = None

    def _epoch(self, pool: List[int], size: int, images: int) -> List[_Minibatch]:
        """Minibatches of one epoch over the transitions ``pool`` of an update of ``images`` images,
        shuffled on the host (:func:`~.ppo.minibatches`)."""
        return [_Minibatch(ids, []) for ids in minibatches(pool, size, images, self.cfg.ppo.strata, self.cpu_gen)]

    def _ppo_update(self, traj: Trajectory, d: torch.Tensor, rewards: torch.Tensor, a_u: float) -> Dict[str, float]:
        """One PPO update, data parallel: every process holds its own images' trajectory and rows,
        and the update is the one a single process would take on the whole batch.

        Transitions are numbered ``t = l * B + b`` over all ``B`` images of the update (process
        ``r`` holds images ``r * B/world ...``). Every process draws the same minibatches of those
        numbers (the same seeded shuffles, from every process's feasible and gate-on flags: one
        exchange) and runs its own rows of each; the advantages are standardised and the returns
        normalised with moments summed over processes; each step's gradients are summed over
        processes once (:meth:`_step`), so every process takes the same optimiser steps.

        Every minibatch step reads fixed-shape static buffers (:class:`~timm_dora.train.graph_step.StaticBatch`: the update's
        tensors, padded token sequences, the minibatch's rows and weights), so the step is the
        same on every call: on CUDA it is replayed from CUDA graphs. The integers the minibatches
        depend on come to the host in one transfer and all minibatch indices go to the device in
        one."""
        cfg, p, dev, comm = self.cfg, self.cfg.ppo, self.dev, self.comm
        self.finish_critic()  # the last update's critic steps, if still running (before any sum here)
        sum_ = comm.sum_ if comm.world > 1 else None
        b, depth = traj.k.shape  # this process's images
        n_t, n_c = b * depth, traj.ctrl_t.numel()
        every = b * comm.world  # the update's images
        # the feasible and gate-on flags of every process (t order over all images), and this
        # process's lengths and controller rows, in one transfer
        flags = comm.gather(torch.stack([traj.feasible.long(), (traj.ctrl_of >= 0).long()]).view(1, 2, depth, b))
        host = torch.cat([flags.permute(1, 2, 0, 3).reshape(-1), traj.token_lengths, traj.ctrl_of, traj.ctrl_lengths])
        feas_h, on_h, tok_len_h, ctrl_of_h, ctrl_len_h = (t.tolist() for t in host.cpu().split([n_t * comm.world] * 2 + [n_t] * 2 + [n_c]))
        first = comm.rank * b

        def local(t: int) -> int:  # this process's transition number of t, or -1
            image = t % every - first
            return (t // every) * b + image if 0 <= image < b else -1

        # minibatches, drawn in the order the loops use them; this process's rows go to the device at once
        feasible = [t for t, f in enumerate(feas_h) if f]
        gate_on = [t for t, o in enumerate(on_h) if o]
        actor_epochs = [(self._epoch(feasible, p.gate_minibatch, every), self._epoch(gate_on, p.controller_minibatch, every))
                        for _ in range(p.actor_epochs)]
        critic_mbs = [mb for _ in range(p.critic_epochs)
                      for mb in self._epoch(list(range(len(feas_h))), p.critic_minibatch, every)]
        for gate_mbs, ctrl_mbs in actor_epochs:
            for mb in gate_mbs:
                mb.rows = [x for x in map(local, mb.ids) if x >= 0]
            for mb in ctrl_mbs:  # rows of the controller's buffers
                mb.rows = [ctrl_of_h[x] for x in map(local, mb.ids) if x >= 0]
        for mb in critic_mbs:
            mb.rows = [x for x in map(local, mb.ids) if x >= 0]
            mb.n_on = sum(on_h[t] for t in mb.ids)
        mbs = [(mb, self.gate_batch.capacity) for gate_mbs, _ in actor_epochs for mb in gate_mbs]
        mbs += [(mb, self.ctrl_batch.capacity) for _, ctrl_mbs in actor_epochs for mb in ctrl_mbs]
        mbs += [(mb, self.critic_batch.capacity) for mb in critic_mbs]
        pieces = [[mb.rows[s : s + cap] for s in range(0, len(mb.rows), cap)] or [[]] for mb, cap in mbs]
        flat = torch.tensor([t for ps in pieces for piece in ps for t in piece], dtype=torch.long).to(dev)
        chunks = iter(flat.split([len(piece) for ps in pieces for piece in ps]))
        for (mb, _), ps in zip(mbs, pieces):
            mb.chunks = [next(chunks) for _ in ps]

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
        adv_g = standardize(ret_t - vg_ret, traj.feasible, p.adv_eps, sum_)
        ones = torch.ones(n_c, dtype=torch.bool, device=dev)
        adv_b = standardize(ret_t[ci] - self.rms.denormalize(vb[ci]), ones, p.adv_eps, sum_)
        adv_s = standardize(ret_t[ci] - self.rms.denormalize(vs), ones, p.adv_eps, sum_)
        self.rms.update(ret_t, sum_)
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
        self.actor.train()
        for gate_mbs, ctrl_mbs in actor_epochs:
            for kind, kind_mbs in (("gate", gate_mbs), ("controller", ctrl_mbs)):
                for mb in kind_mbs:
                    logs[kind].append(self._step(kind, mb).double().reshape(-1))
        self.actor.eval()
        if comm.world > 1:
            self._share_actor()
        self.clock.mark("actor_update")
        self.critic.train()
        if not (self.graphs and cfg.overlap):
            for mb in critic_mbs:
                logs["critic"].append(self._step("critic", mb).double().reshape(-1))
        else:  # left running beside the next update's rollout (see finish_critic)
            replays = all(self._kind("critic", mb)[0] in self.captured for mb in critic_mbs)
            self.background.launch(functools.partial(self._critic_steps, critic_mbs), replays, reads=[flat])
        self.clock.mark("critic_update")
        # one transfer for every logged value: per-step reads would stall the host
        names = {"gate": ("loss_gate", "entropy_gate"), "critic": ("loss_value",),
                 "controller": ("loss_budget", "loss_selector", "entropy_budget", "entropy_selector")}
        out = {k: float("nan") for ks in names.values() for k in ks}
        kinds = [k for k in names if logs[k]]
        if kinds:
            means = torch.cat([torch.stack(logs[k]).mean(0) for k in kinds]).cpu()
            keys = [name for k in kinds for name in names[k]]
            out.update({k: float(v) for k, v in zip(keys, means)})
        return out

    # ---------------------------------------------------------------------------------------

    def stop_prefetch(self) -> None:
        """Stop the processes making rollout batches ahead (the next update starts them again)."""
        self.images.close()

    def close(self) -> None:
        """Stop the data workers, wait for the critic's steps and release the captured steps."""
        self.finish_critic()
        self.stop_prefetch()
        self.captured.clear()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------------
    # checkpoints: dev evaluation, the training state, saving (CheckpointLog)

    def evaluate_dev(self) -> CheckpointRecord:
        """The actor on the dev split: each process its share, the counts summed (every process
        calls it)."""
        dev = self.images.dev
        pred, gflops = self._predict(dev, ActorPolicy(self.actor))
        sums = self.host_comm.sum_(torch.stack([(pred == dev.labels).sum().double(), gflops.double().sum(),
                                           (pred != self.dev_native_pred).sum().double()]).cpu())
        top1, mean_gflops, disagreement = (float(v) / self.dev_size for v in sums)
        return CheckpointRecord(f"u{self.u:05d}", 100.0 * top1, self.dev_native_top1, mean_gflops, 100.0 * disagreement)

    def state_dict(self) -> Dict:
        self.finish_critic()  # (overlap: the critic's last steps may still be running)
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
            "checkpoints": self.checkpoints.records,
            "config": dataclasses.asdict(self.cfg),
            "cpu_threads": torch.get_num_threads(),
        }

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
        self.checkpoints.records = list(state["checkpoints"])
        threads = state.get("cpu_threads")
        if self.dev.type == "cpu" and threads and threads != torch.get_num_threads():
            # CPU float reductions split their work by thread count: the same count continues exactly
            print(f"--resume: using {threads} CPU threads, as the saved run did (this process had "
                  f"{torch.get_num_threads()})", file=sys.stderr)
            torch.set_num_threads(threads)

    def save_checkpoint(self) -> CheckpointRecord:
        """Evaluate on dev (every process its share) and save actor + training state (first process)."""
        rec = self.evaluate_dev()
        cfg = self.cfg
        facts = {
            "updates": self.u, "target_drop": cfg.target_drop, "a_u": self.feedback.coefficient,
            "dev_top1": rec.top1, "dev_native_top1": rec.native_top1, "dev_gflops": rec.gflops,
            "model": cfg.model, "data": cfg.data, **({"skip_dead": True} if cfg.skip_dead else {}),
            **({"init_actor": cfg.init_actor, "init_training": self.init_training} if cfg.init_actor else {}),
        }
        self.checkpoints.save(rec, self.actor, self.model, facts, self.state_dict)
        self.host_comm.barrier()
        return rec

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
        unwritten: List[Dict] = []  # metrics in update order; one may wait for its critic loss (overlap)

        def write(final: bool = False) -> None:
            if final:
                self.finish_critic()
            while unwritten and unwritten[0] is not self._critic_record:
                m = unwritten.pop(0)
                if main:
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    self._tensorboard(m)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(a=f"{m['a_u']:.1f}", C=f"{m['compression']:.3f}", G=f"{m['gflops']:.2f}")

        try:
            while self.u < cfg.total_updates:
                m = self.step()
                out_of_time = self.host_comm.broadcast_object(cfg.max_minutes > 0 and time.perf_counter() - start > 60 * cfg.max_minutes)
                if self.u % cfg.checkpoint_every == 0 or self.u == cfg.total_updates or out_of_time:
                    t = time.perf_counter()
                    rec = self.save_checkpoint()
                    m.update(dev_top1=rec.top1, dev_gflops=rec.gflops, dev_native_top1=rec.native_top1,
                             dev_disagreement=rec.disagreement)
                    m["phases"]["checkpoint"] = time.perf_counter() - t  # dev evaluation and saving
                unwritten.append(m)
                write()
                if out_of_time:
                    print(f"--max-minutes reached after update {self.u}: stopping (resume with --resume)", file=sys.stderr)
                    break
        finally:
            write(final=True)
            self.stop_prefetch()
            if log is not None:
                log.close()
            if bar is not None:
                bar.close()
        summary = self.checkpoints.select(cfg.target_drop, cfg.selection, self.model) if main else None
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
