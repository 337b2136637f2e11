"""GFLOPs accounting (paper App. E.4).

One multiply-accumulate is two FLOPs. Counted per image, following that image's realised token
trajectory: patch embedding, every block (attention projections and the two attention matmuls on
the ``P + N_l`` tokens entering the block, the MLP on the ``P + N_l - k_l`` tokens surviving it,
``P`` being the prefix tokens: CLS, registers, distillation token), the classifier, and the
actor's own computation (the gate at every block, the controller only where the gate opened).
An attention-pool (MAP) head counts its query, key/value projections over the tokens reaching it,
its attention matmuls, output projection and MLP. Costs follow the input: a model taking another
input size (``dynamic_img_size``) is counted at the patch count of each forward.

Only matrix products are counted (linear layers, convolutions, attention matmuls), exactly what
``torch.utils.flop_counter`` counts for these ops; LayerNorm, softmax, activations, residual adds,
pooling and token selection/packing are not FLOPs in this accounting (they show up in runtime).
With this rule native DeiT-B/16 at 224 is 35.13 GFLOPs and DINOv2-B/14 at 224 (256 tokens) is
46.32 GFLOPs; the paper's Table 1 rounds its own counts to 35.2 and 46.5.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["BackboneCost", "backbone_cost", "actor_gate_macs", "actor_controller_macs", "native_gflops"]


def _linear_macs_per_row(module: nn.Module) -> int:
    """Sum of ``in * out`` over the ``nn.Linear`` layers inside ``module`` (MACs per token row)."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class BackboneCost:
    """Per-token and per-image MAC counts of a timm ViT, read off its modules."""

    patch_macs: int  # per image
    qkv_macs: List[int]  # per token, per block
    proj_macs: List[int]  # per token, per block
    attn_dim: List[int]  # per block: width of q/k/v (heads * head_dim)
    mlp_macs: List[int]  # per token, per block
    head_macs: int  # per image (classifier, incl. a distillation head; a MAP pool's fixed part)
    num_prefix: int
    num_patches: int
    pool_kv_macs: int = 0  # MAP head: key/value projections per token reaching the pool
    pool_attn: int = 0  # MAP head: latent queries x their width (attention matmuls per pooled token)
    pool_include_prefix: bool = False  # MAP head: the prefix tokens reach the pool too
    head_dim: List[int] = field(default_factory=list)  # per block: one head's width (merging's matching)
    _per_device: Dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def block_macs(self, block: int, n_attn: torch.Tensor, n_mlp: torch.Tensor) -> torch.Tensor:
        """MACs of one block for ``n_attn`` tokens in attention and ``n_mlp`` in the MLP (both
        count prefix tokens). Works elementwise on tensors of per-image counts."""
        n_attn = n_attn.double()
        return (
            n_attn * (self.qkv_macs[block] + self.proj_macs[block])
            + 2 * n_attn * n_attn * self.attn_dim[block]
            + n_mlp.double() * self.mlp_macs[block]
        )

    def blocks_macs(self, n_attn: torch.Tensor, n_mlp: torch.Tensor) -> torch.Tensor:
        """:meth:`block_macs` of every block at once: ``n_attn``, ``n_mlp`` are ``[B, L]``."""
        key = str(n_attn.device)
        if key not in self._per_device:  # copy the per-block constants to the device once
            self._per_device[key] = torch.tensor(
                [[q + pr for q, pr in zip(self.qkv_macs, self.proj_macs)], self.attn_dim, self.mlp_macs],
                dtype=torch.float64, device=n_attn.device,
            )
        linear, attn_dim, mlp = self._per_device[key]
        n_attn = n_attn.double()
        return n_attn * linear + 2 * n_attn * n_attn * attn_dim + n_mlp.double() * mlp

    def match_macs(self, removed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """MACs of merging's matching (``wrap(..., merge=True)``, ours) per image: at each block every
        removed row against the image's surviving visual rows, ``k_l (N_l - k_l) d_h`` (ToMe's
        count). ``removed``: ``[B, L]`` rows removed; ``tokens``: ``[B, L]`` visual rows left."""
        key = f"head_dim:{removed.device}"
        if key not in self._per_device:  # copied to the device once
            self._per_device[key] = torch.tensor(self.head_dim, dtype=torch.float64, device=removed.device)
        return (removed.double() * tokens.double() * self._per_device[key]).sum(1)

    def pool_macs(self, n_final: torch.Tensor) -> torch.Tensor:
        """MACs of a MAP head's per-token part for ``n_final`` tokens leaving the last block
        (prefix included; its own prefix rule applied here): key/value projections and the
        attention matmuls. Zero without a MAP head."""
        n = n_final.double() - (0 if self.pool_include_prefix else self.num_prefix)
        return n * (self.pool_kv_macs + 2 * self.pool_attn)

    def native_macs(self, skip_dead: bool = False) -> float:
        """MACs of the unpruned forward; ``skip_dead``: the last block's MLP on the prefix tokens only
        (what a CLS-token readout reads)."""
        n = torch.tensor([self.num_prefix + self.num_patches])
        depth = len(self.qkv_macs)
        last = torch.tensor([self.num_prefix]) if skip_dead else n
        blocks = sum(float(self.block_macs(i, n, last if i == depth - 1 else n)) for i in range(depth))
        return self.patch_macs + blocks + self.head_macs + float(self.pool_macs(n))


def backbone_cost(model: nn.Module, num_patches: Optional[int] = None) -> BackboneCost:
    """Read the MAC counts of a timm ``VisionTransformer`` from its submodules; ``num_patches``:
    the patch count of the input (default: the size the model was created for)."""
    pe = model.patch_embed
    conv = pe.proj
    n0 = pe.num_patches if num_patches is None else int(num_patches)
    patch_macs = n0 * conv.out_channels * (conv.in_channels // conv.groups) * conv.kernel_size[0] * conv.kernel_size[1]
    head_macs = 0
    for name in ("head", "head_dist"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            head_macs += head.in_features * head.out_features
    pool = getattr(model, "attn_pool", None)
    pool_terms = {}
    if pool is not None:  # the latent queries' projection, output projection and MLP: per latent row
        q = getattr(pool, "q", None)
        per_latent = (_linear_macs_per_row(q) if isinstance(q, nn.Module) else 0) + _linear_macs_per_row(pool.proj)
        mlp = getattr(pool, "mlp", None)
        if mlp is not None:
            per_latent += _linear_macs_per_row(mlp)
        latent = pool.latent.shape[1]
        head_macs += latent * per_latent
        pool_terms = dict(pool_kv_macs=_linear_macs_per_row(pool.kv), pool_attn=latent * pool.kv.out_features // 2,
                          pool_include_prefix=bool(getattr(model, "pool_include_prefix", False)))
    blocks = list(model.blocks)
    return BackboneCost(
        patch_macs=patch_macs,
        qkv_macs=[_linear_macs_per_row(b.attn.qkv) for b in blocks],
        proj_macs=[_linear_macs_per_row(b.attn.proj) for b in blocks],
        attn_dim=[b.attn.qkv.out_features // 3 for b in blocks],
        mlp_macs=[_linear_macs_per_row(b.mlp) for b in blocks],
        head_macs=head_macs,
        num_prefix=model.num_prefix_tokens,
        num_patches=n0,
        **pool_terms,
        head_dim=[b.attn.head_dim for b in blocks],
    )


def native_gflops(model: nn.Module, num_patches: Optional[int] = None, skip_dead: bool = False) -> float:
    """GFLOPs per image of the unpruned model under this accounting (at ``num_patches`` patches:
    another input size of a ``dynamic_img_size`` model; ``skip_dead``: without the last block's MLP
    on the tokens a CLS-token readout never reads)."""
    return 2 * backbone_cost(model, num_patches).native_macs(skip_dead) / 1e9


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
    per_token = actor.w_in.in_features * w + _linear_macs_per_row(actor.encoder)
    fixed = actor.w_h.in_features * w + _linear_macs_per_row(actor.budget_head) + actor.w_k.in_features * w
    return per_token, fixed, _linear_macs_per_row(actor.selector), w
