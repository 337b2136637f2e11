"""PiToMe, spectrum-preserving token merging (Tran et al., NeurIPS 2024), off the shelf on a timm ViT.

Implemented from the paper's description, with the algorithm's details and hyperparameters read from
the authors' public code (github.com/hchautran/PiToMe, ``algo/pitome``, commit ``550b5de``; read
only, no code copied). The paper's Eq. 4 writes the energy kernel as ``f_m(x) = x`` above the
margin; the authors' code (the one their image-classification scripts run) uses
``ELU_alpha(x - m)``, i.e. ``x - m`` above it, which ranks tokens differently. We follow the code.
The repository's history changed the vision patch several times (margin 0.9 / 0.95 / 0.75, how
many leading blocks use plain bipartite matching, proportional attention on or off) and no commit
is tied to the paper's tables, so we follow its last state, ``550b5de`` (its ``main_ic.py`` with
``patch.deit``). It reuses ToMe's pieces (:mod:`~timm_dora.evaluate.baselines.tome`): the block
is composed from timm's own submodules, with size tracking, and only the choice of *which* tokens
merge differs. Per block ``l`` with ``N_l`` visual tokens entering and ``r_l`` merges:

1. attention on the tokens entering the block, then the attention residual. Proportional attention
   (``log s_j`` added to the logits of key column ``j``) is **off** by default, as in the authors'
   evaluated code (its block calls attention without the sizes); ``prop_attn=True`` turns it on;
2. *energy scores* on the block's keys averaged over heads (the ToMe metric), visual tokens only:
   ``c_ij = cos(k_i, k_j)`` (the ``N_l x N_l`` similarity matmul) and
   ``E_i = (1/N_l) sum_j f_m(c_ij)``, ``f_m(x) = ELU_alpha(x - m_l)``: ``x - m_l`` above the margin,
   ``alpha (exp(x - m_l) - 1)`` below it. A token in a large cluster of similar tokens has a high
   energy; an isolated (informative) one a low energy. The visual tokens are ranked by energy
   (descending) and split by alternation: ranks 0, 2, 4, ... form ``A``, ranks 1, 3, 5, ... ``B``;
3. the first ``ceil(L / 2)`` blocks (``bsm_blocks``) merge by *energy-ordered bipartite soft
   matching* over all visual tokens (the authors' ``pitome_bsm``): every ``A`` token's edge is its
   best cosine similarity to a ``B`` token, the ``r_l`` ``A`` tokens with the highest edges merge
   into their ``B`` token, nothing is protected. The later blocks *protect*: only the ``2 r_l``
   highest-energy tokens are candidates (``|A| = |B| = r_l``), every ``A`` token merges into its
   most similar ``B`` token, and the ``N_l - 2 r_l`` lowest-energy tokens are neither merged nor
   absorb a token;
4. merging is size-weighted averaging ``x <- (sum_i s_i x_i) / sum_i s_i``; the sizes add up.
   Output order: prefix tokens, kept tokens (original order), ``B`` tokens (energy order);
5. the MLP residual on the ``N_l - r_l`` tokens.

The knob: the authors' ``ratio`` (``PiToMe(model, ratio=0.9)``, ``--ratio``): every block keeps that
fraction of the visual tokens entering it, ``r_l = floor(N_l - N_l * ratio)``
(:func:`pitome_ratio_schedule`; ratio 0.9 on 196 patches: ``r = 19, 17, 16, 14, 13, 11, 10, 9, 8, 7,
7, 6``). The ``r`` form (tokens merged per block, an int or one per block, as ToMe's) is kept for
schedules matched to other methods; both run the same blocks.

Hyperparameters (the authors' off-the-shelf DeiT / MAE setting): ``alpha = 1``, and a margin that
falls linearly with depth, ``m_l = margin * (1 - l / L)`` with ``margin = 0.75`` (``l = 0 .. L-1``):
early blocks count only near-duplicates as neighbours, late blocks almost any positively aligned
token.

Choices where the paper is silent or leaves options (documented, tested):

- The energy sum includes ``j = i`` (as the authors' code does): the same ``f_m(1)`` for every token,
  so it changes no ranking. Sizes do not weight the energy (the paper's graph has one node per token).
- Prefix tokens (CLS, distillation token, registers) are excluded from the energy graph and the
  matching and put back first: never merged, never a destination.
- ``r_l`` is capped at ``floor(N_l / 2)`` (the same cap as ToMe; any ``ratio >= 0.5`` stays under it),
  so :func:`~timm_dora.evaluate.baselines.tome.tome_schedule` gives the effective schedule.
- Similarities and energies in float32; ties in energy and in the edges go to the lower token index
  (stable sorts; the authors' sorts are unstable), ties in the ``A -> B`` argmax to the first maximum.
- The ``A x B`` matching scores are read from the ``N_l x N_l`` similarity matrix already computed
  for the energy (a gather, as the authors do), so the matching adds no matrix product.
- Attention: PyTorch SDPA exactly as ToMe (no bias while every size is 1, so ``r = 0`` is the native
  forward; with ``prop_attn`` a ``log(size)`` float mask after the first merge).
- The readout is the model's own head.

Side by side with the authors' code (run once outside the repository, fp32 on CPU): their
``patch.deit`` of commit ``550b5de`` applied to timm 1.0.31's ``vit_tiny_patch16_224`` with the
``augreg_in21k_ft_in1k`` weights (adapter: ``dist_token = None``, ``pre_logits`` an identity, the
``attn_mask`` keyword dropped and the classifier applied to their pooled features; their algorithm
untouched), against ``PiToMe(model, ratio=R)`` with the defaults, on 64 pool images (the first 64
``qc``/``dev`` rows of ``labels_train.csv`` by path; 33 ``qc``, 31 ``dev``), batches of 16.
The visual tokens entering every block are identical (ratio 0.9: 196, 177, 160, 144, 130, 117, 106,
96, 87, 79, 72, 65). Max |logit difference| and top-1 agreement: ratio 0.9: 2.0e-5, 64/64;
0.925: 1.56 (2 images above 1e-3, median 9e-6), 63/64; 0.95: 1.4e-5, 64/64; 0.975: 0.89 (1 image
above 1e-3), 64/64 -- the few outliers are near-ties that the two sort orders break differently.
Before this check the module protected tokens in every block and used proportional attention:
against the authors' code that gave 8.6 / 6.1 max |logit difference| and 53/64 / 57/64 top-1
agreement at ratio 0.9 / 0.95 (protection everywhere alone: 7.8 / 4.1, 56/64 / 57/64).

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only), as ToMe's: patch embedding, per
block the attention projections and the two attention matmuls on the ``P + N_l`` tokens entering
it, the MLP on ``P + N_l - r_l`` tokens, the classifier, **and PiToMe's similarity matmul**
``N_l x N_l`` on head-averaged keys of width ``d_h`` (``N_l^2 d_h`` MACs per merging block, in the
matching blocks and the protecting ones alike; the matching reuses it). Normalisations, the ELU,
the mean, sorts, argmax, gathers, the weighted average and the head mean count as runtime only.
This is exactly what ``torch.utils.flop_counter`` counts on :func:`pitome_forward` (tested).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine.patch import check_skip_dead, check_supported
from .tome import RSchedule, ToMeCost, merging_forward, merging_gflops, sizes_or_ones

__all__ = ["PiToMe", "energy_scores", "pitome_bsm_blocks", "pitome_edges", "pitome_forward", "pitome_gflops", "pitome_margins",
           "pitome_merge", "pitome_ratio_schedule"]

MARGIN = 0.75  # m_0; the margin of block l is MARGIN * (1 - l / L)
ALPHA = 1.0
PROP_ATTN = False  # default of prop_attn: the authors' evaluated code passes no sizes to attention


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


def pitome_edges(metric: torch.Tensor, r: int, num_prefix: int, margin: float, alpha: float = ALPHA,
                 bsm: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PiToMe's choice for ``r > 0``: ``(kept, src [B, r], dst_tokens, dst [B, r])``, visual-token
    indices; ``metric``: ``[B, N, c]``, prefix first. The visual tokens are ranked by energy
    (descending); ranks 0, 2, ... form ``A``, ranks 1, 3, ... ``B``.

    ``bsm=False`` (protecting block): ``A`` and ``B`` are the ``2r`` highest-energy tokens, every
    ``A`` token merges (``src = A``, ``|A| = |B| = r``), ``kept`` are the ``N - 2r`` protected tokens
    (original order). ``bsm=True`` (energy-ordered bipartite soft matching over *all* tokens):
    ``|A| = ceil(N/2)``, ``|B| = floor(N/2)``; the ``r`` ``A`` tokens with the highest best cosine
    similarity to a ``B`` token merge (``src``), the other ``A`` tokens are ``kept`` (original
    order). ``dst_tokens``: the ``B`` tokens (energy order); ``dst``: each ``src`` token's position
    in ``dst_tokens`` (its most cosine-similar ``B`` token)."""
    n = metric.shape[1] - num_prefix
    if r > (math.ceil(n / 2) if bsm else n // 2):
        raise ValueError(f"cannot merge r={r} tokens from {n} visual tokens ({'|A|' if bsm else '2r candidates'} too small)")
    energy, sim = energy_scores(metric[:, num_prefix:], margin, alpha)
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    bsz = sim.shape[0]
    if bsm:
        a, b = order[:, 0::2], order[:, 1::2]
    else:
        a, b = order[:, 0:2 * r:2], order[:, 1:2 * r:2]
    scores = sim.gather(1, a[..., None].expand(bsz, a.shape[1], n)).gather(2, b[:, None, :].expand(bsz, a.shape[1], b.shape[1]))
    best, dst = scores.max(dim=-1)  # [B, |A|]: first maximum
    if not bsm:
        return order[:, 2 * r:].sort(dim=-1).values, a, b, dst
    edge = torch.sort(best, dim=-1, descending=True, stable=True).indices
    src, kept = edge[:, :r], edge[:, r:]
    return a.gather(1, kept).sort(dim=-1).values, a.gather(1, src), b, dst.gather(1, src)


def pitome_merge(x: torch.Tensor, metric: torch.Tensor, size: torch.Tensor, r: int, num_prefix: int, margin: float,
                 alpha: float = ALPHA, bsm: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` visual tokens of every image by PiToMe (module docstring, steps 2-4; ``bsm``: the
    energy-ordered bipartite soft matching of the early blocks, :func:`pitome_edges`).

    ``x``: ``[B, N, C]`` (``num_prefix`` prefix tokens first); ``metric``: ``[B, N, c]``; ``size``:
    ``[B, N]``. Returns ``(x [B, N - r, C], size [B, N - r])``: prefix, kept tokens (original
    order), then the ``B`` tokens, each the size-weighted average of itself and the tokens merged
    into it.
    """
    if r <= 0:
        return x, size
    p = num_prefix
    bsz, _, c = x.shape
    kept, src, b, dst = pitome_edges(metric, r, p, margin, alpha, bsm)
    xv, sv = x[:, p:], size[:, p:]

    def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t.gather(1, idx[..., None].expand(bsz, idx.shape[1], c))

    sa, sb = sv.gather(1, src), sv.gather(1, b)
    sb_new = sb.scatter_add(1, dst, sa)
    wb = (rows(xv, b) * sb[..., None]).scatter_add(1, dst[..., None].expand(bsz, r, c), rows(xv, src) * sa[..., None])
    return (torch.cat([x[:, :p], rows(xv, kept), wb / sb_new[..., None]], dim=1),
            torch.cat([size[:, :p], sv.gather(1, kept), sb_new], dim=1))


def pitome_ratio_schedule(model: nn.Module, ratio: float) -> List[int]:
    """The authors' knob as an ``r`` schedule: every block keeps the fraction ``ratio`` of the
    visual tokens entering it, ``r_l = floor(N_l - N_l * ratio)`` (float arithmetic exactly as the
    authors' ``math.floor(T - T * ratio)``), ``N_{l+1} = N_l - r_l``. ``ratio`` in ``[0.5, 1]``
    (at most half the tokens can merge)."""
    if not 0.5 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0.5, 1] (the fraction of tokens each block keeps), got {ratio}")
    n = model.patch_embed.num_patches
    out = []
    for _ in model.blocks:
        r = math.floor(n - n * ratio) if ratio < 1.0 else 0
        out.append(r)
        n -= r
    return out


def pitome_bsm_blocks(depth: int) -> int:
    """The authors' number of leading blocks that merge by energy-ordered bipartite soft matching
    (no protected tokens): ``ceil(depth / 2)``."""
    return math.ceil(depth / 2)


def pitome_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False) -> ToMeCost:
    """GFLOPs per image of :func:`pitome_forward` (the same for every image): ToMe's accounting
    (:func:`~timm_dora.evaluate.baselines.tome.merging_gflops`) with the energy's ``N x N``
    similarity matmul on head-averaged keys at each merging block; ``skip_dead``: the last block's
    MLP on the prefix tokens only. ``matching_gflops``: the energy's similarity matmuls (the
    matching reads its scores from them)."""
    return merging_gflops(model, r, skip_dead, lambda c, l, n: n * n * (c.attn_dim[l] // model.blocks[l].attn.num_heads))


def pitome_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, margin: float = MARGIN, alpha: float = ALPHA,
                   prop_attn: bool = PROP_ATTN, skip_dead: bool = False, bsm_blocks: Optional[int] = None) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with PiToMe merging ``r`` tokens
    per block (an int, or one value per block; capped as ToMe's). ``r = 0`` is the native forward.
    ``margin``: ``m_0`` of the schedule ``m_l = margin (1 - l / L)``. ``bsm_blocks``: how many
    leading blocks merge by energy-ordered bipartite soft matching instead of protecting tokens
    (``None``: the authors' ``ceil(L / 2)``; ``0``: protection in every block). ``prop_attn``:
    proportional attention (``log s`` on the logits; off in the authors' evaluated code).
    ``skip_dead``: the last block's MLP on the prefix tokens only (all a CLS-token readout reads)."""
    margins = pitome_margins(len(model.blocks), margin)
    nb = pitome_bsm_blocks(len(model.blocks)) if bsm_blocks is None else bsm_blocks
    p = model.num_prefix_tokens
    merge = lambda l, x, metric, size, rl: pitome_merge(x, metric, sizes_or_ones(x, size), rl, p, margins[l], alpha, l < nb)
    return merging_forward(model, x, r, merge, prop_attn, skip_dead)


class PiToMe:
    """A PiToMe configuration as a callable: ``PiToMe(model, r)(images) -> logits`` (``r`` tokens
    merged per block) or ``PiToMe(model, ratio=0.9)(images)`` (the authors' knob: every block keeps
    that fraction of its visual tokens, :func:`pitome_ratio_schedule`). Exactly one of the two.

    The model is not modified. ``cost`` holds the per-image GFLOPs and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: Optional[RSchedule] = None, margin: float = MARGIN, alpha: float = ALPHA,
                 prop_attn: bool = PROP_ATTN, skip_dead: bool = False, *, ratio: Optional[float] = None,
                 bsm_blocks: Optional[int] = None):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        if (r is None) == (ratio is None):
            raise ValueError("PiToMe needs exactly one of r (tokens merged per block) and ratio (fraction kept per block)")
        self.ratio = ratio
        self.r = pitome_ratio_schedule(model, ratio) if ratio is not None else r
        self.model, self.margin, self.alpha, self.bsm_blocks = model, margin, alpha, bsm_blocks
        self.prop_attn, self.skip_dead = prop_attn, skip_dead
        self.cost = pitome_gflops(model, self.r, skip_dead)

    @property
    def name(self) -> str:
        if self.ratio is not None:
            knob = f"ratio={self.ratio:g}"
        else:
            knob = "r=" + (str(self.r) if isinstance(self.r, int) else ",".join(str(v) for v in self.r))
        extra = "" if self.margin == MARGIN else f", m={self.margin:g}"
        extra += "" if self.alpha == ALPHA else f", alpha={self.alpha:g}"
        extra += "" if self.bsm_blocks is None else f", bsm={self.bsm_blocks}"
        extra += "" if self.prop_attn == PROP_ATTN else (", prop-attn" if self.prop_attn else ", no prop-attn")
        return f"pitome({knob}{extra})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return pitome_forward(self.model, x, self.r, self.margin, self.alpha, self.prop_attn, self.skip_dead, self.bsm_blocks)
