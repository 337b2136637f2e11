"""The DORA actor's own FLOPs (paper App. E.4: the gate at every block, the controller only where
the gate opened), counted under the engine's rule (:mod:`timm_dora.engine.flops`: only matrix
products, one multiply-accumulate = two FLOPs). The policy reports them in each
:class:`~timm_dora.engine.protocol.Decision`; the engine adds them to the image's cost.
"""
from __future__ import annotations

import weakref
from typing import Tuple

import torch
import torch.nn as nn

from ..engine.flops import linear_macs_per_row

__all__ = ["actor_gate_macs", "actor_controller_macs", "controller_macs_terms"]


def actor_gate_macs(actor) -> int:
    """Gate MACs per image per block: ``(d+19)*64 + 64*1``."""
    return sum(m.in_features * m.out_features for m in actor.gate_mlp if isinstance(m, nn.Linear))


def actor_controller_macs(actor, n_visual: torch.Tensor) -> torch.Tensor:
    """Controller MACs for gate-active images with ``n_visual`` surviving visual tokens.

    ``n = N_l + 1`` tokens (CLS included) go through ``W_in`` and the encoder block (QKV,
    attention matmuls, output projection, FFN); ``W_h`` runs on CLS; the budget head on ``Z_CLS``;
    ``W_k`` once per image and the selector MLP on the ``N_l`` visual tokens:
    ``n * per_token + 2 n^2 w + fixed + (n - 1) * selector``, computed as
    ``n * (2 w n + per_token + selector) + fixed - selector`` (integer-valued float64, exact).
    """
    per_token, fixed, selector, w = controller_macs_terms(actor)
    n = n_visual.double() + 1
    return n * (n * (2 * w) + (per_token + selector)) + (fixed - selector)


_CONTROLLER_TERMS: "weakref.WeakKeyDictionary[nn.Module, Tuple[int, int, int, int]]" = weakref.WeakKeyDictionary()


def controller_macs_terms(actor) -> Tuple[int, int, int, int]:
    """``(per_token, fixed, selector, width)`` MACs of an actor's controller, read off its modules
    once: the terms of :func:`actor_controller_macs` (which the fused controller's budget kernel
    evaluates on the GPU, :mod:`timm_dora.policy.actor_kernels`). Under ``torch.compile`` they are
    read off the modules without the cache: Dynamo would guard on the weak dictionary's length,
    which the garbage collector changes at any time (a flaky "guard failed on the same frame")."""
    if torch.compiler.is_compiling():
        return _controller_terms(actor)
    terms = _CONTROLLER_TERMS.get(actor)
    if terms is None:
        terms = _CONTROLLER_TERMS[actor] = _controller_terms(actor)
    return terms


def _controller_terms(actor) -> Tuple[int, int, int, int]:
    w = actor.width
    per_token = actor.w_in.in_features * w + linear_macs_per_row(actor.encoder)
    fixed = actor.w_h.in_features * w + linear_macs_per_row(actor.budget_head) + actor.w_k.in_features * w
    return per_token, fixed, linear_macs_per_row(actor.selector), w
