"""Localized rewards from complete-prefix shadow evaluation (paper Sec. 3.3, App. B).

For one sampled rollout of ``L`` blocks, with ``k_l`` tokens removed at block ``l`` (``k_l = 0`` at
gate-off steps) and ``z^(l)`` the logits of the complete-prefix shadow that replays blocks
``0..l`` and runs the rest unpruned:

- fidelity cost ``D_l = tau^2 KL(softmax(z^N/tau) || softmax(z^(l)/tau))``, ``tau = 3``
  (Eq. kd / app-reward-kd); ``D_{-1} = 0`` and ``D_l = D_{l-1}`` at gate-off steps;
- compression increment ``dC_l = k_l (L - l) / (L N0)``, summing to the token-layer compression
  ``C = (1/(L N0)) sum_l (N0 - N_l^post)`` (Eq. compression / app-reward-compression);
- step reward ``r_l = 25 dC_l - a_u (D_l - D_{l-1})`` (Eq. reward / app-reward-step), whose sum
  telescopes to ``25 C - a_u D_final`` (Eq. app-reward-telescope).

Everything here is gradient-free bookkeeping on ``[B, L]`` tensors (``B`` images of a rollout).
"""
from __future__ import annotations

from typing import Union

import torch

__all__ = [
    "fidelity_divergence",
    "compression_increments",
    "token_layer_compression",
    "compression_before",
    "fill_gate_off",
    "step_rewards",
]

Coefficient = Union[float, torch.Tensor]


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (never a half type)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def fidelity_divergence(z_native: torch.Tensor, z_pruned: torch.Tensor, tau: float = 3.0) -> torch.Tensor:
    """Per-image fidelity cost ``tau^2 KL(softmax(z^N/tau) || softmax(z/tau))`` (Eq. app-reward-kd).

    Args:
        z_native: ``[B, C]`` logits of the unpruned (Native) forward.
        z_pruned: ``[B, C]`` logits of a (shadow) pruned forward of the same images.
        tau: distillation temperature (3 in the paper).

    Returns:
        ``[B]`` divergences in float32 (float64 if either input is float64). Both distributions
        are taken through ``log_softmax`` (no ``exp`` of raw logits); classes with zero
        reference probability (e.g. ``-inf`` logits) contribute exactly 0. Identical logits
        give exactly 0.
    """
    if z_native.shape != z_pruned.shape or z_native.dim() != 2:
        raise ValueError(f"expected two [B, C] logit tensors of one shape, got {tuple(z_native.shape)} and {tuple(z_pruned.shape)}")
    dtype = _float_dtype(z_native, z_pruned)
    log_p = torch.log_softmax(z_native.to(dtype) / tau, dim=-1)
    log_q = torch.log_softmax(z_pruned.to(dtype) / tau, dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return (tau * tau) * terms.sum(-1)


def compression_increments(k: torch.Tensor, num_patches: int, depth: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dC_l = k_l (L - l) / (L N0)`` per image and block (Eq. compression).

    Args:
        k: ``[B, L]`` tokens removed at each block (0 where the gate is off).
        num_patches: ``N0``, initial visual tokens (CLS and other prefix tokens excluded).
        depth: ``L``; must equal ``k.shape[1]``.

    Returns:
        ``[B, L]`` increments; ``dC.sum(1)`` is the token-layer compression ``C``.
    """
    if k.dim() != 2 or k.shape[1] != depth:
        raise ValueError(f"k must be [B, L={depth}], got {tuple(k.shape)}")
    remaining_blocks = torch.arange(depth, 0, -1, device=k.device, dtype=torch.float64)  # L - l
    dc = k.to(torch.float64) * remaining_blocks / (depth * num_patches)
    return dc.to(dtype)


def token_layer_compression(k: torch.Tensor, num_patches: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``C = (1/(L N0)) sum_l (N0 - N_l^post)`` from the token counts (Eq. app-reward-compression).

    Computed from the post-pruning counts ``N_l^post = N0 - sum_{j<=l} k_j`` (Eq.
    app-reward-counts), independently of :func:`compression_increments`. Returns ``[B]``.
    """
    if k.dim() != 2:
        raise ValueError(f"k must be [B, L], got {tuple(k.shape)}")
    depth = k.shape[1]
    n_post = num_patches - torch.cumsum(k.to(torch.float64), dim=1)
    return ((num_patches - n_post).sum(1) / (depth * num_patches)).to(dtype)


def compression_before(k: torch.Tensor, num_patches: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``C_<l = sum_{j<l} dC_j`` (the critic's scalar of Eq. app-critic-scalars). ``[B, L]``, ``C_<0 = 0``."""
    dc = compression_increments(k, num_patches, k.shape[1], torch.float64)
    return (torch.cumsum(dc, dim=1) - dc).to(dtype)


def fill_gate_off(d_shadow: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Carry the fidelity cost over gate-off steps: ``D_l = D_{l-1}`` where ``k_l = 0``, ``D_{-1} = 0``.

    App. B.2: a gate-off step adds no pruning, so its complete-prefix shadow equals the previous
    one and need not be run. Args: ``d_shadow`` ``[B, L]`` shadow divergences (entries at gate-off
    steps are ignored and may hold anything, NaN included); ``gate`` ``[B, L]`` bool, or the
    removal counts ``k`` (pruned iff ``k > 0``). Returns ``[B, L]``: at each step the divergence of
    the latest gate-on step at or before it, 0 before the first one.
    """
    if d_shadow.shape != gate.shape or d_shadow.dim() != 2:
        raise ValueError(f"d_shadow and gate must both be [B, L], got {tuple(d_shadow.shape)} and {tuple(gate.shape)}")
    on = gate if gate.dtype == torch.bool else gate > 0
    steps = torch.arange(on.shape[1], device=on.device).expand_as(on)
    last_on = torch.cummax(torch.where(on, steps, torch.full_like(steps, -1)), dim=1).values
    carried = d_shadow.gather(1, last_on.clamp_min(0))
    return torch.where(last_on >= 0, carried, torch.zeros_like(carried))


def _coefficient(a_u: Coefficient, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    a = torch.as_tensor(a_u, dtype=dtype, device=device)
    if a.dim() == 0:
        return a
    if a.shape != (batch,):
        raise ValueError(f"a_u must be a scalar or [B={batch}], got {tuple(a.shape)}")
    return a[:, None]


def step_rewards(
    k: torch.Tensor,
    d: torch.Tensor,
    a_u: Coefficient,
    compression_scale: float = 25.0,
    terminal_only: bool = False,
    *,
    num_patches: int,
) -> torch.Tensor:
    """Per-step rewards ``r_l = 25 dC_l - a_u (D_l - D_{l-1})``, ``D_{-1} = 0`` (Eq. reward / app-reward-step).

    Args:
        k: ``[B, L]`` removal counts (0 at gate-off steps).
        d: ``[B, L]`` fidelity costs with gate-off steps already carried forward
            (:func:`fill_gate_off`); ``d[:, -1]`` is ``D_final``.
        a_u: the fidelity coefficient of this update (scalar, or ``[B]``), fixed over the rollout.
        compression_scale: the shared factor 25.
        terminal_only: ablation (Table ablation_stability, "Terminal-only reward"): the same
            return is paid entirely at the last step, ``r_{L-1} = 25 C - a_u D_final`` and
            ``r_l = 0`` for ``l < L-1``.
        num_patches: ``N0``.

    Returns:
        ``[B, L]`` rewards (float32, float64 if ``d`` is float64). In both modes
        ``r.sum(1) = 25 C - a_u D_final`` (Eq. app-reward-telescope).
    """
    if k.shape != d.shape or k.dim() != 2:
        raise ValueError(f"k and d must both be [B, L], got {tuple(k.shape)} and {tuple(d.shape)}")
    dtype = _float_dtype(d)
    batch, depth = k.shape
    a = _coefficient(a_u, batch, dtype, d.device)
    dc = compression_increments(k, num_patches, depth, dtype)
    d = d.to(dtype)
    if terminal_only:
        r = torch.zeros_like(d)
        final = compression_scale * dc.sum(1, keepdim=True) - a * d[:, -1:]
        r[:, -1:] = final
        return r
    d_prev = torch.cat([torch.zeros_like(d[:, :1]), d[:, :-1]], dim=1)
    return compression_scale * dc - a * (d - d_prev)
