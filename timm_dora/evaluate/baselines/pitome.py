"""PiToMe, spectrum-preserving token merging (Tran et al., NeurIPS 2024), off the shelf on a timm ViT.

Implemented from the paper's description, with hyperparameters read from the authors' public code
(github.com/hchautran/PiToMe, ``algo/pitome``; read only, no code copied). It reuses ToMe's pieces
(:mod:`~timm_dora.evaluate.baselines.tome`): the block is composed from timm's own submodules, with
proportional attention and size tracking, and only the choice of *which* tokens merge differs. Per
block ``l`` with ``N_l`` visual tokens entering and ``r_l`` merges:

1. attention on the tokens entering the block, with proportional attention (``log s_j`` added to
   the logits of key column ``j``; :func:`~timm_dora.evaluate.baselines.tome.attention_with_keys`),
   then the attention residual;
2. *energy scores* on the block's keys averaged over heads (the ToMe metric), visual tokens only:
   ``c_ij = cos(k_i, k_j)`` (the ``N_l x N_l`` similarity matmul) and
   ``E_i = (1/N_l) sum_j f_m(c_ij)``, ``f_m(x) = ELU_alpha(x - m_l)``: ``x - m_l`` above the margin,
   ``alpha (exp(x - m_l) - 1)`` below it. A token in a large cluster of similar tokens has a high
   energy; an isolated (informative) one a low energy;
3. the ``N_l - 2 r_l`` lowest-energy tokens are *protected*: they are neither merged nor absorb a
   token. The ``2 r_l`` highest-energy tokens are the merge candidates, split by alternation in
   energy order: ranks 0, 2, 4, ... form ``A``, ranks 1, 3, 5, ... form ``B`` (``|A| = |B| = r_l``);
4. bipartite matching: every ``A`` token is merged into its most cosine-similar ``B`` token (all
   ``r_l`` of them: ``|A| = r_l``), by size-weighted averaging ``x <- (sum_i s_i x_i) / sum_i s_i``;
   the sizes add up. Output order: prefix tokens, protected tokens (original order), ``B`` tokens
   (energy order);
5. the MLP residual on the ``N_l - r_l`` tokens.

Hyperparameters (the authors' off-the-shelf DeiT / MAE setting): ``alpha = 1``, and a margin that
falls linearly with depth, ``m_l = margin * (1 - l / L)`` with ``margin = 0.75`` (``l = 0 .. L-1``):
early blocks count only near-duplicates as neighbours, late blocks almost any positively aligned
token.

Choices where the paper is silent or leaves options (documented, tested):

- The energy sum includes ``j = i`` (as the authors' code does): the same ``f_m(1)`` for every token,
  so it changes no ranking. Sizes do not weight the energy (the paper's graph has one node per token).
- Prefix tokens (CLS, distillation token, registers) are excluded from the energy graph and the
  matching and put back first: never merged, never a destination.
- ``r_l`` is capped at ``floor(N_l / 2)`` (``2 r_l`` candidates must exist), the same cap as ToMe,
  so :func:`~timm_dora.evaluate.baselines.tome.tome_schedule` gives the effective schedule.
- Similarities and energies in float32; ties in energy go to the lower token index (stable sort),
  ties in the ``A -> B`` argmax to the first maximum.
- The ``A x B`` matching scores are read from the ``N_l x N_l`` similarity matrix already computed
  for the energy (a gather, as the authors do), so the matching adds no matrix product.
- Attention: PyTorch SDPA exactly as ToMe (no bias before the first merge, so ``r = 0`` is the
  native forward; a ``log(size)`` float mask after it). ``prop_attn=False`` drops it.
- The readout is the model's own head.

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only), as ToMe's: patch embedding, per
block the attention projections and the two attention matmuls on the ``P + N_l`` tokens entering
it, the MLP on ``P + N_l - r_l`` tokens, the classifier, **and PiToMe's similarity matmul**
``N_l x N_l`` on head-averaged keys of width ``d_h`` (``N_l^2 d_h`` MACs per merging block; the
matching reuses it). Normalisations, the ELU, the mean, sorts, argmax, gathers, the weighted average
and the head mean count as runtime only. This is exactly what ``torch.utils.flop_counter`` counts
on :func:`pitome_forward` (tested).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine.patch import check_skip_dead, check_supported
from .tome import RSchedule, ToMeCost, merging_forward, merging_gflops, sizes_or_ones

__all__ = ["PiToMe", "energy_scores", "pitome_edges", "pitome_forward", "pitome_gflops", "pitome_margins", "pitome_merge"]

MARGIN = 0.75  # m_0; the margin of block l is MARGIN * (1 - l / L)
ALPHA = 1.0


def pitome_margins(depth: int, margin: float = MARGIN) -> List[float]:
    """Per-block margins ``m_l = margin * (1 - l / depth)``, ``l = 0 .. depth - 1``."""
    return [margin * (1.0 - l / depth) for l in range(depth)]


def energy_scores(metric: torch.Tensor, margin: float, alpha: float = ALPHA) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(E [B, N], sim [B, N, N])``: the energy ``E_i = mean_j ELU_alpha(cos(m_i, m_j) - margin)``
    and the cosine similarities, in float32; ``metric``: ``[B, N, c]`` (visual tokens only)."""
    mv = metric.float()
    mv = mv / mv.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = mv @ mv.transpose(1, 2)  # [B, N, N] (the counted matmul)
    return F.elu(sim - margin, alpha=alpha).mean(dim=-1), sim


def pitome_edges(metric: torch.Tensor, r: int, num_prefix: int, margin: float,
                 alpha: float = ALPHA) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PiToMe's choice for ``r > 0``: ``(protected [B, N_v - 2r], a [B, r], b [B, r], dst [B, r])``:
    visual-token indices of the protected tokens (original order), of the ``A`` tokens (energy ranks
    0, 2, ...) and of the ``B`` tokens (ranks 1, 3, ...); ``dst``: each ``A`` token's position in
    ``b`` (its most cosine-similar ``B`` token). ``metric``: ``[B, N, c]``, prefix first."""
    n = metric.shape[1] - num_prefix
    if r > n // 2:
        raise ValueError(f"cannot merge r={r} tokens from {n} visual tokens (2r candidates needed)")
    energy, sim = energy_scores(metric[:, num_prefix:], margin, alpha)
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    a, b = order[:, 0:2 * r:2], order[:, 1:2 * r:2]
    protected = order[:, 2 * r:].sort(dim=-1).values
    bsz = sim.shape[0]
    scores = sim.gather(1, a[..., None].expand(bsz, r, n)).gather(2, b[:, None, :].expand(bsz, r, r))  # [B, |A|, |B|]
    return protected, a, b, scores.argmax(dim=-1)


def pitome_merge(x: torch.Tensor, metric: torch.Tensor, size: torch.Tensor, r: int, num_prefix: int, margin: float,
                 alpha: float = ALPHA) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` visual tokens of every image by PiToMe (module docstring, steps 2-4).

    ``x``: ``[B, N, C]`` (``num_prefix`` prefix tokens first); ``metric``: ``[B, N, c]``; ``size``:
    ``[B, N]``. Returns ``(x [B, N - r, C], size [B, N - r])``: prefix, protected tokens (original
    order), then the ``B`` tokens, each the size-weighted average of itself and the ``A`` tokens
    merged into it.
    """
    if r <= 0:
        return x, size
    p = num_prefix
    bsz, _, c = x.shape
    protected, a, b, dst = pitome_edges(metric, r, p, margin, alpha)
    xv, sv = x[:, p:], size[:, p:]

    def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t.gather(1, idx[..., None].expand(bsz, idx.shape[1], c))

    sa, sb = sv.gather(1, a), sv.gather(1, b)
    sb_new = sb.scatter_add(1, dst, sa)
    wb = (rows(xv, b) * sb[..., None]).scatter_add(1, dst[..., None].expand(bsz, r, c), rows(xv, a) * sa[..., None])
    return (torch.cat([x[:, :p], rows(xv, protected), wb / sb_new[..., None]], dim=1),
            torch.cat([size[:, :p], sv.gather(1, protected), sb_new], dim=1))


def pitome_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False) -> ToMeCost:
    """GFLOPs per image of :func:`pitome_forward` (the same for every image): ToMe's accounting
    (:func:`~timm_dora.evaluate.baselines.tome.merging_gflops`) with the energy's ``N x N``
    similarity matmul on head-averaged keys at each merging block; ``skip_dead``: the last block's
    MLP on the prefix tokens only. ``matching_gflops``: the energy's similarity matmuls (the
    matching reads its scores from them)."""
    return merging_gflops(model, r, skip_dead, lambda c, l, n: n * n * (c.attn_dim[l] // model.blocks[l].attn.num_heads))


def pitome_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, margin: float = MARGIN, alpha: float = ALPHA,
                   prop_attn: bool = True, skip_dead: bool = False) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with PiToMe merging ``r`` tokens
    per block (an int, or one value per block; capped as ToMe's). ``r = 0`` is the native forward.
    ``margin``: ``m_0`` of the schedule ``m_l = margin (1 - l / L)``. ``skip_dead``: the last block's
    MLP on the prefix tokens only (all a CLS-token readout reads)."""
    margins = pitome_margins(len(model.blocks), margin)
    p = model.num_prefix_tokens
    merge = lambda l, x, metric, size, rl: pitome_merge(x, metric, sizes_or_ones(x, size), rl, p, margins[l], alpha)
    return merging_forward(model, x, r, merge, prop_attn, skip_dead)


class PiToMe:
    """A PiToMe configuration as a callable: ``PiToMe(model, r)(images) -> logits``.

    The model is not modified. ``cost`` holds the per-image GFLOPs and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: RSchedule, margin: float = MARGIN, alpha: float = ALPHA,
                 prop_attn: bool = True, skip_dead: bool = False):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        self.model, self.r, self.margin, self.alpha = model, r, margin, alpha
        self.prop_attn, self.skip_dead = prop_attn, skip_dead
        self.cost = pitome_gflops(model, r, skip_dead)

    @property
    def name(self) -> str:
        r = self.r if isinstance(self.r, int) else ",".join(str(v) for v in self.r)
        extra = "" if self.margin == MARGIN else f", m={self.margin:g}"
        extra += "" if self.alpha == ALPHA else f", alpha={self.alpha:g}"
        return f"pitome(r={r}{extra}{'' if self.prop_attn else ', no prop-attn'})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return pitome_forward(self.model, x, self.r, self.margin, self.alpha, self.prop_attn, self.skip_dead)
