"""GFLOPs accounting (paper App. E.4).

One multiply-accumulate is two FLOPs. Counted per image, following that image's realised token
trajectory: patch embedding, every block (attention projections and the two attention matmuls on
the ``P + N_l`` tokens entering the block, the MLP on the ``P + N_l - k_l`` tokens surviving it,
``P`` being the prefix tokens: CLS, registers, distillation token), the classifier, and the
policy's own computation as its decisions report it (DORA's actor: the gate at every block, the
controller only where the gate opened; counted by :mod:`timm_dora.policy.actor_flops`).
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
from typing import Dict, List, Optional

import torch
import torch.nn as nn

__all__ = ["BackboneCost", "backbone_cost", "linear_macs_per_row", "native_gflops"]


def linear_macs_per_row(module: nn.Module) -> int:
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
        per_latent = (linear_macs_per_row(q) if isinstance(q, nn.Module) else 0) + linear_macs_per_row(pool.proj)
        mlp = getattr(pool, "mlp", None)
        if mlp is not None:
            per_latent += linear_macs_per_row(mlp)
        latent = pool.latent.shape[1]
        head_macs += latent * per_latent
        pool_terms = dict(pool_kv_macs=linear_macs_per_row(pool.kv), pool_attn=latent * pool.kv.out_features // 2,
                          pool_include_prefix=bool(getattr(model, "pool_include_prefix", False)))
    blocks = list(model.blocks)
    return BackboneCost(
        patch_macs=patch_macs,
        qkv_macs=[linear_macs_per_row(b.attn.qkv) for b in blocks],
        proj_macs=[linear_macs_per_row(b.attn.proj) for b in blocks],
        attn_dim=[b.attn.qkv.out_features // 3 for b in blocks],
        mlp_macs=[linear_macs_per_row(b.mlp) for b in blocks],
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
