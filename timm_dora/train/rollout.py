"""Rollouts with complete-prefix shadow evaluations (paper Sec. 3.3-3.4, App. A.3, B).

A rollout runs the frozen backbone on a batch of images with the *sampled* actor through the same
packed forward as inference (:func:`timm_dora.engine.patch.run`, hard deletion), and records what PPO
needs: observations (CLS keys, history, controller keys, the residual tokens ``H_l`` the critic
reads), actions (gate, budget index, Plackett-Luce order), old log-probabilities and token counts.

Shadow evaluations then replay, for every image and every block ``l`` where it pruned, the
recorded deletions at blocks ``0..l`` and run the remaining blocks unpruned
(:class:`~timm_dora.policy.ReplayPolicy`), giving ``z^(l)`` and
``D_l = tau^2 KL(softmax(z^N/tau) || softmax(z^(l)/tau))``. All shadows of a rollout run as one
packed batch (in chunks), not one image at a time. Gate-off steps need no shadow
(``D_l = D_{l-1}``), and the last pruning step of an image needs none either: its complete prefix
is the rollout itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..engine import BlockContext, Decision, run
from ..policy import Actor, ActorPolicy, NoPrune, ReplayPolicy, RolloutNoise
from ..policy.actor import masked_categorical, plackett_luce_log_prob, selector_entropy
from .rewards import fidelity_divergence, fill_gate_off

__all__ = ["Trajectory", "collect", "shadow_divergences", "evaluate_gate", "evaluate_controller"]

Plan = Dict[int, Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Trajectory:
    """One rollout of ``B`` images over ``L`` blocks.

    Transitions are numbered ``t = l * B + b``. Gate fields cover all ``B * L`` transitions;
    controller fields (prefix ``ctrl_``) the gate-on transitions, in the order they were taken;
    ``ctrl_of[t]`` maps a transition to its controller index (``-1`` when the gate was off).
    """

    # per image
    z_native: torch.Tensor  # [B, C] float32
    z_final: torch.Tensor  # [B, C] float32
    k: torch.Tensor  # [B, L] removed tokens
    gflops: torch.Tensor  # [B]
    plan: Plan  # the recorded deletions, replayable
    # per transition (t = l * B + b)
    block: torch.Tensor  # [B*L]
    cls_key: torch.Tensor  # [B*L, d]
    h: torch.Tensor  # [B*L, 3]
    feasible: torch.Tensor  # [B*L] bool
    gate: torch.Tensor  # [B*L] bool
    gate_logp_old: torch.Tensor  # [B*L]
    tokens: torch.Tensor  # [sum lengths, d] residual tokens H_l entering each block (critic input)
    token_lengths: torch.Tensor  # [B*L] rows of H_l per transition (prefix included)
    ctrl_of: torch.Tensor  # [B*L] long
    # per gate-on transition
    ctrl_t: torch.Tensor  # [A] transition index
    ctrl_keys: torch.Tensor  # [sum (N_l+1), d] CLS + visual keys
    ctrl_lengths: torch.Tensor  # [A]
    budget_index: torch.Tensor  # [A]
    budget_logp_old: torch.Tensor  # [A]
    order: torch.Tensor  # [A, K] sampled order (columns among the visual tokens)
    valid: torch.Tensor  # [A, K] True on the first k columns of each row (the budget), False after
    selector_logp_old: torch.Tensor  # [A]
    num_prefix: int

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def depth(self) -> int:
        return self.k.shape[1]


class _Recording:
    """Policy wrapper that keeps each block's input tokens and layout (the critic's ``H_l``)."""

    def __init__(self, policy: ActorPolicy):
        self.policy = policy
        self.tokens: List[torch.Tensor] = []
        self.lengths: List[torch.Tensor] = []
        self.plan: Plan = {}

    def __call__(self, ctx: BlockContext) -> Decision:
        self.tokens.append(ctx.packed.x)
        self.lengths.append(ctx.packed.lengths)
        dec = self.policy(ctx)
        rec = self.policy.records[-1]
        if rec.order is not None:
            image = rec.active[:, None].expand_as(rec.order)[rec.valid]
            self.plan[ctx.block] = (image, rec.order[rec.valid])
        return dec


@torch.no_grad()
def collect(model: nn.Module, actor: Actor, images: torch.Tensor, generator: Optional[torch.Generator] = None,
            z_native: Optional[torch.Tensor] = None, noise: Optional[RolloutNoise] = None) -> Trajectory:
    """Sample one rollout on ``images`` with the wrapped ``model`` (see module docstring).

    ``z_native``: the Native logits, computed here (unpruned forward) when not given. ``noise``:
    pre-drawn sampling noise for these images (else ``generator`` draws it block by block).
    """
    if z_native is None:
        z_native = run(model, images, NoPrune())[0].float()
    policy = ActorPolicy(actor, sample=True, generator=generator, record=True, noise=noise)
    rec = _Recording(policy)
    logits, stats = run(model, images, rec)
    b, depth = stats.removed.shape
    records = policy.records
    dev = images.device
    cls_key = torch.cat([r.cls_key.float() for r in records])
    gate_logit = torch.cat([r.gate_logit for r in records])
    gate = torch.cat([r.gate for r in records])
    feasible = torch.cat([r.feasible for r in records])
    gate_logp = torch.distributions.Bernoulli(logits=gate_logit).log_prob(gate.float())

    ctrl = [r for r in records if r.order is not None]
    ctrl_t = torch.cat([r.block * b + r.active for r in ctrl]) if ctrl else torch.zeros(0, dtype=torch.long, device=dev)
    ctrl_of = torch.full((b * depth,), -1, dtype=torch.long, device=dev)
    ctrl_of[ctrl_t] = torch.arange(ctrl_t.numel(), device=dev)
    kmax = max([r.order.shape[1] for r in ctrl], default=0)

    def pad_order(r, fill):
        t = r.order if fill == "order" else r.valid
        pad = torch.full((t.shape[0], kmax - t.shape[1]), 0 if fill == "order" else False, dtype=t.dtype, device=dev)
        return torch.cat([t, pad], 1)

    if ctrl:
        budget_logp = torch.cat([masked_categorical(r.budget_logits).log_prob(r.budget_index) for r in ctrl])
        sel_logp = torch.cat([plackett_luce_log_prob(r.scores, r.order, r.valid) for r in ctrl])
        order = torch.cat([pad_order(r, "order") for r in ctrl])
        valid = torch.cat([pad_order(r, "valid") for r in ctrl])
        ctrl_keys = torch.cat([r.ctrl_keys.float() for r in ctrl])
        ctrl_lengths = torch.cat([r.n_visual + 1 for r in ctrl])
        budget_index = torch.cat([r.budget_index for r in ctrl])
    else:
        z = torch.zeros(0, device=dev)
        budget_logp = sel_logp = z
        order = torch.zeros(0, 0, dtype=torch.long, device=dev)
        valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)
        ctrl_keys = torch.zeros(0, cls_key.shape[1], device=dev)
        ctrl_lengths = budget_index = torch.zeros(0, dtype=torch.long, device=dev)
    return Trajectory(
        z_native=z_native, z_final=logits.float(), k=stats.removed, gflops=stats.gflops, plan=rec.plan,
        block=torch.arange(depth, device=dev).repeat_interleave(b),
        cls_key=cls_key, h=torch.cat([r.h for r in records]), feasible=feasible, gate=gate, gate_logp_old=gate_logp,
        tokens=torch.cat(rec.tokens).float(), token_lengths=torch.cat(rec.lengths), ctrl_of=ctrl_of,
        ctrl_t=ctrl_t, ctrl_keys=ctrl_keys, ctrl_lengths=ctrl_lengths, budget_index=budget_index,
        budget_logp_old=budget_logp, order=order, valid=valid, selector_logp_old=sel_logp,
        num_prefix=model.num_prefix_tokens,
    )


def _prefix_plan(plan: Plan, image: torch.Tensor, last: torch.Tensor) -> Plan:
    """Deletions of shadow rows ``r`` (image ``image[r]``, replaying blocks ``<= last[r]``)."""
    out: Plan = {}
    for l, (img, col) in plan.items():
        rows = torch.nonzero(last >= l).squeeze(1)
        if rows.numel() == 0 or img.numel() == 0:
            continue
        # entries of each image are contiguous in ``img`` (recorded in image order)
        counts = torch.bincount(img, minlength=int(image.max()) + 1 if image.numel() else 0)
        starts = torch.cumsum(counts, 0) - counts
        n = counts[image[rows]]
        total = int(n.sum())
        if total == 0:
            continue
        seq = torch.repeat_interleave(torch.arange(rows.numel(), device=img.device), n, output_size=total)
        within = torch.arange(total, device=img.device) - (torch.cumsum(n, 0) - n)[seq]
        entry = starts[image[rows]][seq] + within
        out[l] = (rows[seq], col[entry])
    return out


@torch.no_grad()
def shadow_divergences(model: nn.Module, images: torch.Tensor, traj: Trajectory, tau: float = 3.0,
                       chunk: int = 512, include_last: bool = False) -> torch.Tensor:
    """``D [B, L]``: complete-prefix fidelity costs with gate-off steps carried forward.

    ``include_last``: also run the shadow of each image's last pruning step (it equals the rollout's
    own output; used to test exactly that).
    """
    k = traj.k
    b, depth = k.shape
    on = k > 0
    steps = torch.arange(depth, device=k.device).expand_as(k)
    last_on = torch.where(on, steps, torch.full_like(steps, -1)).max(1).values
    need = on if include_last else on & (steps < last_on[:, None])
    image, block = torch.nonzero(need, as_tuple=True)
    d = torch.zeros(b, depth, dtype=torch.float32, device=k.device)
    d_final = fidelity_divergence(traj.z_native, traj.z_final, tau)
    has = last_on >= 0
    d[has, last_on[has]] = d_final[has]
    for s in range(0, image.numel(), chunk):
        img, last = image[s : s + chunk], block[s : s + chunk]
        plan = _prefix_plan(traj.plan, img, last)
        z = run(model, images[img], ReplayPolicy(plan, check=False))[0].float()
        d[img, last] = fidelity_divergence(traj.z_native[img], z, tau)
    return fill_gate_off(d, k)


# --------------------------------------------------------------------------------------------
# re-evaluating recorded actions under the current actor (PPO)


def evaluate_gate(actor: Actor, cls_key: torch.Tensor, h: torch.Tensor, block: torch.Tensor, gate: torch.Tensor):
    """Log-prob and entropy of recorded gate decisions ``gate`` (``[S]`` bool) under the current
    actor, from their observations (``cls_key`` ``[S, d]``, ``h`` ``[S, 3]``, ``block`` ``[S]``).

    The distribution skips argument validation (a host synchronisation per check).
    """
    logit = actor.gate_logit(cls_key, h, block).float()
    dist = torch.distributions.Bernoulli(logits=logit, validate_args=False)
    return dist.log_prob(gate.float()), dist.entropy()


def evaluate_controller(actor: Actor, keys: torch.Tensor, lengths: torch.Tensor, h: torch.Tensor, block: torch.Tensor,
                        budget_index: torch.Tensor, order: torch.Tensor, valid: torch.Tensor):
    """Budget and selector log-probs and entropies of recorded controller decisions under the
    current actor, on a padded batch of fixed shapes (no host reads).

    ``keys`` ``[A, N, d]``: each sequence's CLS key then its visual keys, zero-padded after
    ``lengths[a]`` rows (:meth:`~timm_dora.engine.packing.Packed.padded` of ``Trajectory.ctrl_keys``);
    ``h`` ``[A, 3]``, ``block`` and ``budget_index`` ``[A]``; ``order``/``valid`` ``[A, K]`` the
    recorded Plackett-Luce order (any ``K`` at least the largest budget, ``valid`` False beyond
    each row's budget). Padded visual columns score ``-inf``, so they take no probability.
    Returns ``(log pi_B, H_B, log pi_S, H_S)``, each ``[A]``.
    """
    z = actor.encode_padded(keys, lengths, h, block)
    n = lengths - 1
    dist = masked_categorical(actor.budget_logits(z[:, 0], n), validate_args=False)
    k = actor.budgets[budget_index]
    scores = actor.selector_scores(z[:, 1:], k.float() / n.float())
    cols = torch.arange(scores.shape[1], device=scores.device)
    scores = scores.masked_fill(cols[None, :] >= n[:, None], float("-inf"))
    order = torch.where(valid, order, torch.zeros_like(order))
    return dist.log_prob(budget_index), dist.entropy(), plackett_luce_log_prob(scores, order, valid), selector_entropy(scores)
