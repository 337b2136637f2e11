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
from typing import Dict, List, Optional, Tuple

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
    standardize,
)
from .rewards import step_rewards, token_layer_compression
from .rollout import Trajectory, collect, evaluate_controller, evaluate_gate, shadow_divergences
from .runtime import Comm, PhaseClock, eager_attention
from .selection import CheckpointRecord

__all__ = ["Trainer"]


@dataclass
class _Minibatch:
    """The transition ids of one PPO minibatch, and the rows of the step's buffers they are: on
    the host (``rows``; the controller's buffers hold the gate-on transitions only) and on the
    device (``idx``)."""

    ids: List[int]
    rows: List[int]
    idx: Optional[torch.Tensor] = None


class Trainer:
    """Holds the frozen wrapped backbone, the actor, the critic, optimisers and all training state."""

    def __init__(self, cfg: TrainConfig, sync_phases: bool = False):
        self.cfg = cfg.check()
        self.comm = Comm()
        self.dev = torch.device(cfg.device)
        self.clock = PhaseClock(self.dev, sync=sync_phases)  # per-phase times of each update
        if cfg.ppo.rollout_images % self.comm.world:
            raise ValueError(f"--rollout-images {cfg.ppo.rollout_images} must be divisible by the number of processes {self.comm.world}")
        self.local_batch = cfg.ppo.rollout_images // self.comm.world
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
        self.gate_batch = StaticBatch(p.gate_minibatch, self.dev)
        self.ctrl_batch = StaticBatch(p.controller_minibatch, self.dev)
        self.critic_batch = StaticBatch(p.critic_minibatch, self.dev)
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
        counts = self.comm.sum_(torch.tensor(im.local_sizes + [int((self.dev_native_pred == im.dev.labels).sum())],
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
        """One PPO update (rollout, shadows, feedback, update); returns its metrics (the first
        process's hold every process's rollout)."""
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
            counts = comm.sum_(torch.stack([(self.qc_native[sel].long() - correct.long()).sum(),
                                            (self.qc_native_pred[sel] != pred).sum()]).double().cpu())
            # both measures logged (the second calibrates the other's target); the signal steers
            measured = [float(c) / self.check_sizes[shard] for c in counts]
            signal = measured[0] if cfg.feedback_signal == "drop" else measured[1]
            self.feedback.update(u, signal, shard)
            m.update(d_u=signal, d_smoothed=self.feedback.smoothed, qc_shard=shard, a_next=self.feedback.coefficient,
                     qc_drop=measured[0], qc_disagreement=measured[1])
            clock.mark("feedback")
        skipped = self.images.skipped
        if comm.world > 1:  # the update reads every process's rollout, merged, on the first process
            traj, d, skipped = self._gather(traj, d)
            clock.mark("gather")
        if comm.main:
            rewards = step_rewards(traj.k, d, a_u, p.compression_scale, cfg.terminal_only, num_patches=self.num_patches)
            m.update(self._ppo_update(traj, d, rewards, a_u))
            if self.background.busy:
                self._critic_record = m  # its loss_value comes with finish_critic
        if comm.world > 1:
            self._share_actor()
            clock.mark("share")
        if self.dev.type == "cuda":
            torch.cuda.current_stream().synchronize()  # (not the critic's stream: see finish_critic)
        t_all = time.perf_counter() - t0
        if comm.main:
            comp = token_layer_compression(traj.k, self.num_patches)
            sums = torch.stack([rewards.sum(1).sum(), comp.sum(), traj.gflops.sum(), d[:, -1].sum(),
                                traj.gate.float().sum() / self.depth, (traj.k > 0).sum().float()]).double().cpu()
            keys = ("return_mean", "compression", "gflops", "d_final", "gate_rate", "interventions")
            m.update({k: float(v) / batch for k, v in zip(keys, sums)})
            m["skipped_images"] = skipped  # unreadable files met so far, all processes
        clock.mark("metrics")
        m.update(rollout_images_per_s=batch / t_rollout, update_s=t_all, phases=clock.read(), time=time.time())
        return m

    def _gather(self, traj: Trajectory, d: torch.Tensor) -> Tuple[Trajectory, torch.Tensor, int]:
        """Data parallel: every process's rollout, shadow divergences and unreadable-file count on
        the first process, merged as one rollout of the whole batch (:meth:`Trajectory.merge`); the
        other processes get their own back. One exchange of every tensor's bytes
        (:meth:`Comm.gather_tensors`)."""
        names = [f.name for f in dataclasses.fields(Trajectory) if f.name not in ("plan", "num_prefix")]
        mine = [getattr(traj, n) for n in names] + [d, torch.tensor([self.images.skipped], device=d.device)]
        parts = self.comm.gather_tensors(mine)
        if not self.comm.main:
            return traj, d, self.images.skipped
        trajs = [Trajectory(**dict(zip(names, part)), plan={}, num_prefix=traj.num_prefix) for part in parts]
        skipped = int(sum(part[-1] for part in parts))
        return Trajectory.merge(trajs), torch.cat([part[-2] for part in parts]), skipped

    def _share_actor(self) -> None:
        """The first process's updated actor, copied to every process (one broadcast)."""
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

    def _step(self, key, fn, params: List[torch.Tensor], opts: List[str]) -> torch.Tensor:
        """One PPO minibatch step ``fn`` (reading only static buffers): eager, or (on CUDA)
        replayed from the CUDA graph captured for ``key`` on its first call."""
        if not self.graphs:
            return fn()
        step = self.captured.get(key)
        if step is None:
            step = self.captured[key] = CapturedStep(fn, params, [self.opts[o] for o in opts])
        return step()

    def _gate_minibatch(self) -> torch.Tensor:
        """Clipped PPO on the gate decisions of the minibatch in ``self.gate_batch`` (App. D.2-D.3)
        and the gate's gradient step; returns ``[loss, entropy]`` (detached). The sums count the
        real rows (``w``), divided by the minibatch's size."""
        gb, p = self.gate_batch, self.cfg.ppo
        i = gb.idx
        lp, ent = evaluate_gate(self.actor, gb.cls_key[i], gb.h[i], gb.block[i], gb.gate[i])
        surr = clipped_surrogate(lp, gb.logp_old[i], gb.adv[i], p.clip_eps)
        loss = torch.where(gb.w, surr - p.entropy_gate * ent, 0.0).sum() / gb.n
        params = self.groups["gate"]
        self.opts["gate"].zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
        self.opts["gate"].step()
        return torch.stack([loss, torch.where(gb.w, ent, 0.0).sum() / gb.n]).detach()

    def _controller_minibatch(self) -> torch.Tensor:
        """Clipped PPO on the budget and selector decisions of the minibatch in ``self.ctrl_batch``
        (App. D.2-D.4): symmetric PCGrad of the two losses' gradients on the shared encoder, each
        head its own gradient, then the three gradient steps; returns ``[loss_B, loss_S, H_B, H_S]``
        (detached). Each loss reaches the shared encoder and its own head only, so one backward
        pass per loss gives every gradient."""
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
        for name in ("shared", "budget", "selector"):
            self.opts[name].zero_grad(set_to_none=True)
        n = len(shared)
        for q, g in zip(budget + selector, g_b[n:] + g_s[n:]):
            q.grad = g
        apply_pcgrad(shared, g_b[:n], g_s[:n], p.max_grad_norm, p.pcgrad_eps)
        torch.nn.utils.clip_grad_norm_(budget, p.max_grad_norm)
        torch.nn.utils.clip_grad_norm_(selector, p.max_grad_norm)
        for name in ("shared", "budget", "selector"):
            self.opts[name].step()
        return torch.stack([loss_b, loss_s, hb, hs]).detach()

    def _critic_minibatch(self, gate_on: bool) -> torch.Tensor:
        """Clipped value regression of every value head (App. D.2) on the minibatch in
        ``self.critic_batch``, then the gradient step; returns the (detached) loss. The heads run on
        every row; the losses count the real rows (``w``), the budget and selector ones only the
        gate-on transitions, each divided by its count. ``gate_on=False`` (no gate-on
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
        torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
        self.opts["critic"].step()
        return loss.detach()

    def _load(self, kind: str, mb: _Minibatch, on_h: List[int]):
        """Put minibatch ``mb`` of a ``kind`` of step (``gate``, ``controller``, ``critic``) in its
        static buffers; returns ``(key, step, params, optimisers)`` for :meth:`_step`."""
        if kind == "gate":
            self.gate_batch.select(mb.idx, len(mb.ids))
            return "gate", self._gate_minibatch, self.groups["gate"], ["gate"]
        if kind == "controller":
            self.ctrl_batch.select(mb.idx, len(mb.ids))
            g = self.groups
            return "controller", self._controller_minibatch, g["shared"] + g["budget"] + g["selector"], ["shared", "budget", "selector"]
        n_on, key = self._critic_key(mb, on_h)
        self.critic_batch.select(mb.idx, len(mb.ids), n_on)
        return key, functools.partial(self._critic_minibatch, key[1]), list(self.critic.parameters()), ["critic"]

    @staticmethod
    def _critic_key(mb: _Minibatch, on_h: List[int]):
        """``(loss divisor: gate-on transitions in mb, the step's key)``."""
        n_on = sum(on_h[t] for t in mb.ids)
        return n_on, ("critic", n_on > 0)

    def _critic_steps(self, mbs: List[_Minibatch], on_h: List[int]) -> torch.Tensor:
        """The critic's minibatch steps of an update; their mean loss."""
        losses = [self._step(*self._load("critic", mb, on_h)).double().reshape(-1) for mb in mbs]
        return torch.stack(losses).mean(0)

    def finish_critic(self) -> None:
        """With ``overlap`` an update's critic steps run beside the next rollout, which does not read
        the critic (:class:`~timm_dora.train.graph_step.BackgroundSteps`). Wait for them before the
        critic is read or its buffers refilled (old values, a checkpoint); their mean loss goes
        into their own update's metrics. The steps and their order are those without overlap."""
        mean = self.background.finish()
        if mean is not None:
            self._critic_record["loss_value"] = float(mean)
            self._critic_record = None

    def _epoch(self, pool: List[int], size: int) -> List[_Minibatch]:
        """Minibatches of one epoch over the transitions ``pool``, shuffled on the host."""
        ids = [pool[i] for i in torch.randperm(len(pool), generator=self.cpu_gen).tolist()]
        return [_Minibatch(ids[s : s + size], ids[s : s + size]) for s in range(0, len(ids), size)]

    def _ppo_update(self, traj: Trajectory, d: torch.Tensor, rewards: torch.Tensor, a_u: float) -> Dict[str, float]:
        """One PPO update on the whole batch's trajectory, in this process (under ``torchrun`` the
        first process runs it on the merged rollouts of all: :meth:`_gather`).

        Every minibatch step reads fixed-shape static buffers (:class:`~timm_dora.train.graph_step.StaticBatch`: the update's
        tensors, padded token sequences, the minibatch's rows and weights), so the step is the
        same on every call: on CUDA it is replayed from a CUDA graph. The integers the minibatches
        depend on come to the host in one transfer and all minibatch indices go to the device in
        one."""
        cfg, p, dev = self.cfg, self.cfg.ppo, self.dev
        b, depth = traj.k.shape
        n_t, n_c = b * depth, traj.ctrl_t.numel()
        # host copies of the feasible and gate-on flags, lengths and controller rows, in t order
        host = torch.cat([traj.feasible.long(), (traj.ctrl_of >= 0).long(), traj.token_lengths, traj.ctrl_of,
                          traj.ctrl_lengths])
        feas_h, on_h, tok_len_h, ctrl_of_h, ctrl_len_h = (t.tolist() for t in host.cpu().split([n_t] * 4 + [n_c]))
        # minibatches, drawn in the order the loops use them; their rows go to the device at once
        feasible = [t for t, f in enumerate(feas_h) if f]
        gate_on = [t for t, o in enumerate(on_h) if o]
        actor_epochs = [(self._epoch(feasible, p.gate_minibatch), self._epoch(gate_on, p.controller_minibatch))
                        for _ in range(p.actor_epochs)]
        for _, ctrl_mbs in actor_epochs:
            for mb in ctrl_mbs:
                mb.rows = [ctrl_of_h[t] for t in mb.ids]  # rows of the controller's buffers
        critic_mbs = [mb for _ in range(p.critic_epochs) for mb in self._epoch(list(range(n_t)), p.critic_minibatch)]
        mbs = [mb for gate_mbs, ctrl_mbs in actor_epochs for mb in gate_mbs + ctrl_mbs] + critic_mbs
        flat = torch.tensor([t for mb in mbs for t in mb.rows], dtype=torch.long).to(dev)
        for mb, idx in zip(mbs, flat.split([len(mb.rows) for mb in mbs])):
            mb.idx = idx

        phi = native_features(traj.z_native, self.cfg.tau_b)
        q = trajectory_scalar_states(traj.k, d, phi, a_u, self.num_patches).transpose(0, 1).reshape(n_t, -1)
        ci = traj.ctrl_t
        n_ctrl = traj.ctrl_lengths - 1
        frac = self.actor.budgets[traj.budget_index].float() / n_ctrl.clamp_min(1).float()  # k_l / N_l
        # the critic's inputs, padded: H_l of each transition in P + N0 rows (one scatter per update)
        tokens = Packed(traj.tokens, traj.token_lengths, tok_len_h, traj.num_prefix).padded(traj.num_prefix + self.num_patches)
        self.finish_critic()  # the last update's critic steps, if still running
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
        adv_g = standardize(ret_t - vg_ret, traj.feasible, p.adv_eps)
        ones = torch.ones(n_c, dtype=torch.bool, device=dev)
        adv_b = standardize(ret_t[ci] - self.rms.denormalize(vb[ci]), ones, p.adv_eps)
        adv_s = standardize(ret_t[ci] - self.rms.denormalize(vs), ones, p.adv_eps)
        self.rms.update(ret_t)
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
            for kind, mbs in (("gate", gate_mbs), ("controller", ctrl_mbs)):
                for mb in mbs:
                    logs[kind].append(self._step(*self._load(kind, mb, on_h)).double().reshape(-1))
        self.actor.eval()
        self.clock.mark("actor_update")
        self.critic.train()
        if not (self.graphs and cfg.overlap):
            for mb in critic_mbs:
                logs["critic"].append(self._step(*self._load("critic", mb, on_h)).double().reshape(-1))
        else:  # left running beside the next update's rollout (see finish_critic)
            replays = all(self._critic_key(mb, on_h)[1] in self.captured for mb in critic_mbs)
            self.background.launch(functools.partial(self._critic_steps, critic_mbs, on_h), replays, reads=[flat])
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
        """Stop the data workers and release the captured steps (before the process group goes:
        graphs that hold collectives must not outlive their communicators)."""
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
        sums = self.comm.sum_(torch.stack([(pred == dev.labels).sum().double(), gflops.double().sum(),
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
        self.comm.barrier()
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
                out_of_time = self.comm.broadcast_object(cfg.max_minutes > 0 and time.perf_counter() - start > 60 * cfg.max_minutes)
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
