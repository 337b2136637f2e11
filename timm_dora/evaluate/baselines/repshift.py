"""Representation Shift (Choi et al., ICCV 2025), training-free token pruning on a frozen timm ViT.

Implemented from the paper's description (arXiv 2508.00367, "Representation Shift: Unifying Token
Compression with FlashAttention": its abstract, its definition ``dx = D(F(x), x)`` and the caption of
its Fig. 2, as quoted by the arXiv page and paper summaries; the authors' README at
github.com/mlvlab/Representation-Shift for the off-the-shelf DeiT command; their code was not read,
nothing copied). The point of the method: a token-importance
score that needs no attention map, so attention stays a fused kernel (FlashAttention). The score of a
token is its *representation shift* through a layer, ``dx = D(F(x), x)``: the distance between the
token entering a sub-layer and the token leaving it, with ``D`` the L2 distance and ``F`` the MLP (the
paper's main setting: "the L2 distance between token representations before and after the MLP
layer"). Tokens with the smallest shift are taken to be redundant and are removed. The paper's
off-the-shelf ViT setting (the authors' DeiT command ``--use_flash True --drop_r [...]``) is
*pruning*, so that is what this module does (no merging).

Per block ``l`` with ``N_l`` visual tokens entering and ``r_l`` to remove (``where="mlp"``, default):

1. the attention residual on all ``P + N_l`` tokens, through PyTorch SDPA with no mask (timm's fused
   path: FlashAttention on CUDA; no attention map is ever materialised);
2. the MLP residual on all ``P + N_l`` tokens: ``x' = x + drop_path2(ls2(mlp(norm2(x))))``;
3. the shift ``s_i = ||x'_i - x_i||_2`` of every visual token (float32) -- the distance between the
   token in the residual stream before and after the MLP sub-layer;
4. the ``r_l`` visual tokens with the smallest shift are deleted from ``x'``; the ``N_l - r_l`` kept
   tokens stay in their original order after the prefix tokens. Block ``l + 1`` sees them.

``where="attn"`` (the paper's ablation on which layer's shift to use): the shift is taken across the
attention sub-layer, ``s_i = ||x_i + drop_path1(ls1(attn(norm1(x))_i)) - x_i||_2``, and the tokens
are removed right there, before the block's MLP (which then runs on ``P + N_l - r_l`` tokens).

Choices where the paper is silent (documented, tested):

- "Before and after the MLP layer" is read in the residual stream: the shift is the norm of the
  sub-layer's whole update to the token (LayerScale included, as on DINOv2), not the distance between
  the MLP's own input ``norm2(x)`` and its output (which live at different scales).
- Prefix tokens (CLS, distillation token, registers) are never scored and never removed.
- ``r_l`` is capped at ``N_l - 1``: at least one visual token always survives (an average-pooling
  head needs one); :func:`repshift_schedule` gives the effective per-block ``r`` and token counts.
  The knob is ``r`` (tokens per block), as for ToMe; :func:`repshift_ratio_schedule` turns the
  authors' per-layer drop ratios into ``r`` with ``r_l = floor(ratio_l * N_l)``.
- Ties in the shift go to the lower token index (stable sort): it is kept, the later one removed.
- With ``where="mlp"`` the last block's pruning changes only what the head reads (an average pool
  reads fewer tokens); with ``skip_dead`` (CLS readout) the last block's MLP runs on the prefix only,
  nothing is scored there and its effective ``r`` is 0.
- Every block keeps timm's plain (maskless) SDPA call, so ``r = 0`` is exactly the native forward:
  pruning needs no attention bias (no sizes, unlike ToMe's proportional attention).
- The readout is the model's own head.

No side-by-side run with the authors' code: github mlvlab/Representation-Shift could not be
retrieved here (no snapshot available), so the agreement is unchecked.

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only), as :mod:`.tome`'s: patch embedding,
per block the attention projections and the two attention matmuls on the ``P + N_l`` tokens entering
it, the MLP on ``P + N_l`` tokens (``where="mlp"``: pruning happens after it) or ``P + N_l - r_l``
(``where="attn"``), the classifier (and a MAP head's per-token part on the tokens leaving the last
block). The shift score itself is a difference and a norm, and the selection a sort and a gather:
none is a matrix product, so Representation Shift adds runtime but **no** GFLOPs over the pruned
backbone. ``torch.utils.flop_counter`` counts exactly this on :func:`repshift_forward` (tested; its
CPU SDPA entry is counted or not depending on the torch release, see ``tests/helpers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import backbone_cost
from ...engine.patch import check_skip_dead, check_supported
from .tome import RSchedule, attention_with_keys, head, r_per_block

__all__ = [
    "RepShift",
    "RepShiftCost",
    "WHERE",
    "repshift_forward",
    "repshift_gflops",
    "repshift_prune",
    "repshift_ratio_schedule",
    "repshift_schedule",
    "representation_shift",
]

WHERE = ("mlp", "attn")  # the sub-layer across which the shift is measured


def representation_shift(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``||after_i - before_i||_2`` per token, in float32: ``[B, N]`` from two ``[B, N, C]``."""
    return (after.float() - before.float()).norm(dim=-1)


def repshift_prune(x: torch.Tensor, shift: torch.Tensor, r: int, num_prefix: int) -> torch.Tensor:
    """Delete the ``r`` visual tokens of every image with the smallest ``shift``.

    ``x``: ``[B, N, C]`` (``num_prefix`` prefix tokens first); ``shift``: ``[B, N - num_prefix]``, the
    visual tokens' scores. Returns ``[B, N - r, C]``: the prefix tokens, then the kept visual tokens
    in their original order. Ties go to the lower index (kept first).
    """
    if r <= 0:
        return x
    p = num_prefix
    n = x.shape[1] - p
    if shift.shape[1] != n:
        raise ValueError(f"shift has {shift.shape[1]} scores for {n} visual tokens")
    if r >= n:
        raise ValueError(f"cannot remove r={r} of {n} visual tokens (at least one must stay)")
    order = torch.sort(shift, dim=-1, descending=True, stable=True).indices
    keep = order[:, : n - r].sort(dim=-1).values
    kept = x[:, p:].gather(1, keep[..., None].expand(-1, n - r, x.shape[-1]))
    return torch.cat([x[:, :p], kept], dim=1)


def repshift_schedule(model: nn.Module, r: RSchedule, skip_dead: bool = False) -> Tuple[List[int], List[int]]:
    """``(effective r per block, visual tokens entering each block)``; ``r_l`` is capped at
    ``N_l - 1`` (at least one visual token survives every block); ``skip_dead``: the last block
    removes nothing (its MLP runs on the prefix tokens only, nothing is scored)."""
    n = model.patch_embed.num_patches
    eff, entering = [], []
    rs = r_per_block(model, r)
    if skip_dead:
        rs[-1] = 0
    for rl in rs:
        entering.append(n)
        rl = min(rl, n - 1)
        eff.append(rl)
        n -= rl
    return eff, entering


def repshift_ratio_schedule(model: nn.Module, ratios: Sequence[float]) -> List[int]:
    """The authors' per-layer drop ratios (e.g. ``[0.2, 0, 0, 0.2, 0, 0, 0.2, 0, 0, 0, 0, 0]`` for
    DeiT) as an ``r`` schedule: ``r_l = floor(ratio_l * N_l)`` of the ``N_l`` visual tokens entering
    block ``l`` (our rounding)."""
    if len(ratios) != len(model.blocks):
        raise ValueError(f"{len(ratios)} ratios for {len(model.blocks)} blocks")
    if any(not 0 <= q < 1 for q in ratios):
        raise ValueError(f"drop ratios must lie in [0, 1), got {list(ratios)}")
    n, rs = model.patch_embed.num_patches, []
    for q in ratios:
        rl = min(int(q * n), n - 1)
        rs.append(rl)
        n -= rl
    return rs


@dataclass(frozen=True)
class RepShiftCost:
    gflops: float  # per image (the shift score adds none: it is not a matrix product)
    r: List[int]  # effective removals per block
    tokens: List[int]  # visual tokens after each block


def _check_where(where: str) -> None:
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")


def repshift_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False, where: str = "mlp") -> RepShiftCost:
    """GFLOPs per image of :func:`repshift_forward` (the same for every image: a fixed ``r``
    schedule); ``skip_dead``: the last block's MLP on the prefix tokens only."""
    _check_where(where)
    cost = backbone_cost(model)
    p = cost.num_prefix
    eff, entering = repshift_schedule(model, r, skip_dead)
    macs = float(cost.patch_macs + cost.head_macs)
    for l, (rl, n) in enumerate(zip(eff, entering)):
        if skip_dead and l == len(eff) - 1:
            n_mlp = p
        else:
            n_mlp = n + p - (rl if where == "attn" else 0)
        macs += float(cost.block_macs(l, torch.tensor([n + p]), torch.tensor([n_mlp])))
    tokens = [n - rl for rl, n in zip(eff, entering)]
    macs += float(cost.pool_macs(torch.tensor([p + tokens[-1]])))
    return RepShiftCost(2 * macs / 1e9, eff, tokens)


def repshift_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, where: str = "mlp",
                     skip_dead: bool = False) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with Representation Shift
    removing ``r`` tokens per block (an int, or one value per block; capped at ``N_l - 1``). ``r = 0``
    is the native forward. ``where``: the sub-layer whose shift scores the tokens (``"mlp"``: removed
    after the block's MLP; ``"attn"``: removed after the attention, before the MLP). ``skip_dead``:
    the last block's MLP on the prefix tokens only (all a CLS-token readout reads)."""
    _check_where(where)
    eff, _ = repshift_schedule(model, r, skip_dead)
    p = model.num_prefix_tokens
    last = len(eff) - 1
    x = embed(model, x)
    for l, (blk, rl) in enumerate(zip(model.blocks, eff)):
        mid, _ = attention_with_keys(blk, x)  # fused SDPA, no mask: no attention map
        if rl > 0 and where == "attn":
            mid = repshift_prune(mid, representation_shift(x[:, p:], mid[:, p:]), rl, p)
        if skip_dead and l == last:
            mid = mid[:, :p]
        x = mlp_residual(blk, mid)
        if rl > 0 and where == "mlp":
            x = repshift_prune(x, representation_shift(mid[:, p:], x[:, p:]), rl, p)
    return head(model, x)


class RepShift:
    """A Representation Shift configuration as a callable: ``RepShift(model, r)(images) -> logits``.

    The model is not modified (a function of its submodules). ``cost`` holds the per-image GFLOPs
    and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: RSchedule, where: str = "mlp", skip_dead: bool = False):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        _check_where(where)
        self.model, self.r, self.where, self.skip_dead = model, r, where, skip_dead
        self.cost = repshift_gflops(model, r, skip_dead, where)

    @property
    def name(self) -> str:
        r = self.r if isinstance(self.r, int) else ",".join(str(v) for v in self.r)
        return f"repshift(r={r}{'' if self.where == 'mlp' else ', ' + self.where})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return repshift_forward(self.model, x, self.r, self.where, self.skip_dead)
