"""PPO pieces for DORA (paper Sec. 3.5, App. D.2-D.4).

- :func:`gae_shared_return`: GAE on the gate values and the common lambda-return shared by the
  three decision types (Eq. app-critic-gae); :func:`decision_advantages` subtracts each type's
  own baseline.
- :func:`standardize`: advantage standardization over the eligible transitions only.
- :func:`clipped_surrogate`: the clipped PPO policy loss (``eps = 0.2``).
- :class:`RunningMeanStd` and :func:`clipped_value_loss`: running-return normalization and the
  PPO-style clipped Huber value loss.
- :func:`pcgrad_symmetric` / :func:`apply_pcgrad`: symmetric PCGrad between the budget and
  selector gradients on the shared controller (Eq. app-critic-pcgrad), then clipping to 0.5.
- :func:`minibatches`: one epoch's shuffled minibatches, drawn evenly from ``strata`` blocks of
  the update's images where asked (ours, for data parallel: each process's exact share).
- :func:`actor_parameter_groups`: the gate / shared controller / budget / selector partition of
  the actor's parameters that the separate optimizers and PCGrad act on.
- :class:`PPOConfig`: the hyperparameters of Table app-critic-training.

Value normalization (App. D.2 says only "running-return normalization ... used only for value
regression"): the value heads predict returns in normalized units. Per update: compute
``V^old`` in return units as ``rms.denormalize(head output)``, run GAE, then ``rms.update`` with
the update's lambda-returns and regress the heads on ``rms.normalize(R^lambda)``; the clipped
value loss compares against the heads' recorded (normalized) outputs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = [
    "gae_shared_return",
    "decision_advantages",
    "standardize",
    "clipped_surrogate",
    "RunningMeanStd",
    "clipped_value_loss",
    "pcgrad_symmetric",
    "apply_pcgrad",
    "minibatches",
    "actor_parameter_groups",
    "PPOConfig",
]


# --------------------------------------------------------------------------------------------
# returns and advantages


def gae_shared_return(
    rewards: torch.Tensor, v_gate_old: torch.Tensor, lam: float = 0.95, gamma: float = 1.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE on the pre-update gate values and the shared lambda-return (Eq. app-critic-gae).

    ``delta_l = r_l + gamma V^G_{l+1} - V^G_l``, ``A^G_l = delta_l + gamma lam A^G_{l+1}``,
    ``R^lambda_l = A^G_l + V^G_l``, with ``V^G_L = A^G_L = 0`` (each row is one complete
    ``L``-step trajectory; the paper uses ``gamma = 1``, ``lam = 0.95``). Every step, gate-on or
    not, enters the recursion.

    Args:
        rewards: ``[B, L]``; v_gate_old: ``[B, L]`` gate values in return units.

    Returns:
        ``(A^G, R^lambda)``, both ``[B, L]``.
    """
    if rewards.shape != v_gate_old.shape or rewards.dim() != 2:
        raise ValueError(f"rewards and v_gate_old must both be [B, L], got {tuple(rewards.shape)} and {tuple(v_gate_old.shape)}")
    values = v_gate_old.to(rewards.dtype)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for l in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, l] + gamma * next_value - values[:, l]
        next_adv = delta + gamma * lam * next_adv
        adv[:, l] = next_adv
        next_value = values[:, l]
    return adv, adv + values


def decision_advantages(returns: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """``A^X_l = R^lambda_l - V^X_{l,old}`` for a decision type ``X`` in ``{G, B, S}`` (Eq. app-critic-gae).

    For ``X = G`` this equals the ``A^G`` of :func:`gae_shared_return`.
    """
    return returns - v_old.to(returns.dtype)


def standardize(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
                sum_: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """``(A - mean) / (std + eps)`` with mean and (population) std over ``mask``-ed entries only.

    App. D.2: gate advantages over transitions with a non-empty feasible budget set; budget and
    selector advantages over gate-on transitions. Entries outside ``mask`` are returned as 0.
    With no eligible entry the result is all zeros. ``sum_``: sums a tensor over processes in
    place (data parallel: each holds part of the entries; the moments are those of all of them).
    """
    if adv.shape != mask.shape:
        raise ValueError(f"adv {tuple(adv.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.bool()
    if sum_ is not None:  # two passes over all processes' entries: count and sum, then squares
        count_sum = sum_(torch.stack([mask.sum().to(torch.float64), torch.where(mask, adv, 0).sum(dtype=torch.float64)]))
        n = int(count_sum[0])
        if n == 0:
            return torch.zeros_like(adv)
        mean = (count_sum[1] / n).to(adv.dtype)
        square = sum_(torch.where(mask, (adv - mean).square(), 0).sum(dtype=torch.float64)[None])
        std = (square[0] / n).sqrt().to(adv.dtype)
        return torch.where(mask, (adv - mean) / (std + eps), torch.zeros_like(adv))
    n = int(mask.sum())
    if n == 0:
        return torch.zeros_like(adv)
    sel = adv[mask]
    mean = sel.mean()
    std = sel.std(unbiased=False) if n > 1 else torch.zeros_like(mean)
    return torch.where(mask, (adv - mean) / (std + eps), torch.zeros_like(adv))


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """Per-transition clipped PPO loss ``-min(rho A, clip(rho, 1-eps, 1+eps) A)``, ``rho = exp(logp_new - logp_old)``.

    Returned elementwise (the negated surrogate, to be minimised); average it over the
    minibatch's eligible transitions.
    """
    ratio = torch.exp(logp_new - logp_old)
    return -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps, 1.0 + eps) * adv)


# --------------------------------------------------------------------------------------------
# value regression


class RunningMeanStd:
    """Running mean and variance of the lambda-returns (parallel/Welford merge of batch moments).

    Starts at ``count = 0, mean = 0, var = 1`` (so :meth:`normalize` is the identity before the
    first :meth:`update`). Statistics are Python floats (float64); :meth:`state_dict` /
    :meth:`load_state_dict` restore them exactly.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.count = 0.0
        self.mean = 0.0
        self.var = 1.0

    def update(self, x: torch.Tensor, sum_: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Merge the population moments of all entries of ``x`` (``sum_``: sums a tensor over
        processes in place; data parallel, the moments of every process's entries)."""
        x = x.detach().reshape(-1).to(torch.float64)
        if sum_ is not None:
            count_sum = sum_(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum()]))
            n = int(count_sum[0])
            if n == 0:
                return
            b_mean = float(count_sum[1]) / n
            b_var = float(sum_((x - b_mean).square().sum()[None])[0]) / n
        else:
            n = x.numel()
            if n == 0:
                return
            b_mean = float(x.mean())
            b_var = float(x.var(unbiased=False))
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / total
        self.mean = self.mean + delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> Dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var, "eps": self.eps}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.count, self.mean, self.var = float(state["count"]), float(state["mean"]), float(state["var"])
        self.eps = float(state.get("eps", self.eps))


def clipped_value_loss(
    v_new: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, clip: float = 0.2, huber_delta: float = 1.0
) -> torch.Tensor:
    """PPO-style clipped Huber value loss, elementwise, in normalized return units (App. D.2).

    ``v_clip = v_old + clip(v_new - v_old, -clip, clip)``;
    ``loss = max(huber(v_new - target), huber(v_clip - target))``.

    The paper names the loss but not its constants. Ours: ``clip = 0.2`` (the PPO policy ``eps``,
    applied in normalized units where returns have unit scale, so one update moves a value by at
    most 0.2 return standard deviations beyond the old prediction) and ``huber_delta = 1.0``
    (quadratic within one return standard deviation).
    """
    v_clip = v_old + (v_new - v_old).clamp(-clip, clip)
    def huber(err: torch.Tensor) -> torch.Tensor:
        a = err.abs()
        return torch.where(a <= huber_delta, 0.5 * err * err, huber_delta * (a - 0.5 * huber_delta))
    return torch.maximum(huber(v_new - target), huber(v_clip - target))


# --------------------------------------------------------------------------------------------
# PCGrad on the shared controller


def pcgrad_symmetric(g_b: torch.Tensor, g_s: torch.Tensor, eps: float = 1e-12) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric PCGrad on flat gradient vectors (Eq. app-critic-pcgrad).

    ``c = min(g_B . g_S, 0)``; ``g~_B = g_B - c g_S / (|g_S|^2 + eps)``,
    ``g~_S = g_S - c g_B / (|g_B|^2 + eps)``. Both projections use the original gradients;
    non-conflicting pairs (``c = 0``) are returned unchanged.
    """
    if g_b.shape != g_s.shape or g_b.dim() != 1:
        raise ValueError(f"expected two flat gradients of one size, got {tuple(g_b.shape)} and {tuple(g_s.shape)}")
    c = torch.clamp(torch.dot(g_b, g_s), max=0.0)
    return g_b - c * g_s / (g_s.dot(g_s) + eps), g_s - c * g_b / (g_b.dot(g_b) + eps)


def _flat(grads: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(grads) != len(params):
        raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
    return torch.cat([
        (torch.zeros_like(p) if g is None else g.to(p.dtype)).reshape(-1) for g, p in zip(grads, params)
    ])


def apply_pcgrad(
    params: Sequence[torch.Tensor],
    grads_budget: Sequence[Optional[torch.Tensor]],
    grads_selector: Sequence[Optional[torch.Tensor]],
    max_norm: float = 0.5,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Write the PCGrad-combined gradient into ``p.grad`` of the shared controller parameters.

    ``grads_budget`` / ``grads_selector``: gradients of the budget and selector PPO losses
    (entropy terms included) with respect to ``params`` (``None`` = unused, zero), e.g. from
    ``torch.autograd.grad(loss_b, params, retain_graph=True, allow_unused=True)``. The projected
    gradients (:func:`pcgrad_symmetric` on the concatenation over all of ``params``) are summed,
    the sum is clipped to ``max_norm`` (``torch.nn.utils.clip_grad_norm_`` semantics) and stored
    in ``p.grad`` (replacing any previous value). The budget/selector private heads keep their
    own gradients; this touches only ``params``. Returns the norm before clipping, a 0-dim tensor
    as from ``clip_grad_norm_`` (reading it waits for the device).
    """
    params = list(params)
    g_b, g_s = pcgrad_symmetric(_flat(grads_budget, params), _flat(grads_selector, params), eps)
    total = g_b + g_s
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = total[offset:offset + n].view_as(p).clone()
        offset += n
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def minibatches(pool: Sequence[int], size: int, images: int, strata: int, gen: torch.Generator) -> List[List[int]]:
    """One epoch's minibatches over the transitions ``pool`` (numbered ``t = l * images + b`` for the
    ``b``-th of the update's ``images`` images at block ``l``), shuffled with ``gen``.

    ``strata == 1`` (the paper): one shuffle, cut into minibatches of ``size`` (the last one shorter).
    ``strata = S > 1`` (ours; ``--batch-scale S`` sets it): the images are ``S`` equal blocks, each
    block's transitions are shuffled on their own and cut into ``M`` near-equal pieces, and
    minibatch ``j`` is the ``j``-th piece of every block. ``M``, the fewest minibatches with no
    piece over ``size // S`` and none over ``size`` in all, is ``ceil(len(pool) / size)`` unless a
    block holds more than its share of ``pool``. Every transition is in one minibatch; each holds
    at most ``size // S`` of each block, so a process holding whole blocks knows its rows' number
    in advance (data parallel: static buffers of exactly its share, no padding). A stratified
    draw, not the paper's uniform one; ``benchmarks/batch_scale.py`` measures what it learns."""
    if strata == 1:
        ids = [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
        return [ids[s : s + size] for s in range(0, len(ids), size)]
    per, cap = images // strata, size // strata
    if images % strata or cap < 1:
        raise ValueError(f"{strata} strata need images ({images}) divisible by them and a minibatch ({size}) of at least one each")
    blocks: List[List[int]] = [[] for _ in range(strata)]
    for t in pool:
        blocks[(t % images) // per].append(t)
    m = max([-(-len(pool) // size)] + [-(-len(b) // cap) for b in blocks])
    blocks = [[b[i] for i in torch.randperm(len(b), generator=gen).tolist()] for b in blocks]
    return [[t for b in blocks for t in b[j * len(b) // m : (j + 1) * len(b) // m]] for j in range(m)]


def actor_parameter_groups(actor: nn.Module) -> Dict[str, List[nn.Parameter]]:
    """Partition a :class:`~timm_dora.policy.actor.Actor`'s parameters by optimizer (App. D.3-D.4).

    ``gate``: gate block embedding and gate MLP. ``shared``: the controller encoder shared by
    budget and selector (``W_in``, controller block embedding, ``W_h``, Transformer block) -- the
    parameters PCGrad acts on. ``budget``: the budget head. ``selector``: ``W_k`` and the selector
    MLP (private to the selector).
    """
    names = {
        "gate": ("gate_embed", "gate_mlp"),
        "shared": ("w_in", "block_embed", "w_h", "encoder"),
        "budget": ("budget_head",),
        "selector": ("w_k", "selector"),
    }
    groups: Dict[str, List[nn.Parameter]] = {g: [] for g in names}
    owner = {prefix: g for g, prefixes in names.items() for prefix in prefixes}
    for name, p in actor.named_parameters():
        g = owner.get(name.split(".", 1)[0])
        if g is None:
            raise ValueError(f"actor parameter {name!r} belongs to no optimizer group")
        groups[g].append(p)
    return groups


# --------------------------------------------------------------------------------------------
# hyperparameters


@dataclass
class PPOConfig:
    """Training hyperparameters (Table app-critic-training, App. D.2-D.4), shared by all backbones.

    Values not given by the paper, chosen by us, are marked ``# ours``.
    """

    rollout_images: int = 256  # images rolled out per update (paper: 256)
    total_images: int = 299_776  # rollout_images x updates (one pass over the paper's rollout split)
    updates: int = 1_171  # PPO updates (paper: 1,171)
    actor_epochs: int = 4  # epochs of the actor's minibatch steps per update
    critic_epochs: int = 4  # epochs of the critic's minibatch steps per update
    gate_minibatch: int = 512  # transitions per gate minibatch
    controller_minibatch: int = 64  # gate-on transitions per budget + selector minibatch
    critic_minibatch: int = 128  # transitions per critic minibatch
    strata: int = 1  # ours: minibatches drawn evenly from this many equal blocks of the update's images (minibatches(); --batch-scale K multiplies it by K, so each of K processes holds its exact share)
    max_grad_norm: float = 0.5  # gradient-norm clip of every step
    lr_gate: float = 5e-5  # the gate's Adam learning rate (each group its own Adam, torch's betas and eps: ours)
    lr_critic: float = 1e-4  # the critic's learning rate
    lr_shared: float = 2e-5  # the controller encoder's learning rate (shared by budget and selector)
    lr_budget: float = 5e-5  # the budget head's learning rate
    lr_selector: float = 2e-5  # the selector's learning rate
    seed: int = 42  # seeds the learners, the sampler and the rollouts' noise
    clip_eps: float = 0.2  # PPO's ratio clip
    gamma: float = 1.0  # discount over the blocks
    gae_lambda: float = 0.95  # lambda of the shared lambda-return
    kd_temperature: float = 3.0  # temperature of the fidelity divergence (App. B)
    compression_scale: float = 25.0  # scale of the compression reward (App. B)
    entropy_gate: float = 0.01  # ours: the gate's entropy bonus
    entropy_budget: float = 0.01  # ours: the budget head's entropy bonus
    entropy_selector: float = 0.001  # ours: the selector's entropy bonus (first-draw entropy)
    value_clip: float = 0.2  # ours: PPO eps in normalized return units
    huber_delta: float = 1.0  # ours: the value loss's Huber delta
    adv_eps: float = 1e-8  # ours: the advantage standardisation's guard
    pcgrad_eps: float = 1e-12  # PCGrad's division guard

    def __post_init__(self) -> None:
        if self.rollout_images * self.updates != self.total_images:
            raise ValueError(
                f"rollout_images * updates = {self.rollout_images * self.updates} != total_images = {self.total_images}"
            )

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)
