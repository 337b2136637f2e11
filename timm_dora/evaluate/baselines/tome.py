"""ToMe, Token Merging (Bolya et al., ICLR 2023), as a dense baseline on a timm ViT.

Implemented from the paper's description (no code copied), composing each block's own timm
submodules (``norm1``, ``attn.qkv``, ``attn.q_norm``/``k_norm``, ``attn.norm``, ``attn.proj``,
``ls1``, ``drop_path1``, ``norm2``, ``mlp``, ``ls2``, ``drop_path2``) as :mod:`timm_dora.engine.patch`
does. Per block ``l``:

1. attention on the tokens entering the block, with *proportional attention*: ``log s_j`` (the
   size of key token ``j``, i.e. how many patches it stands for) is added to every attention
   logit of column ``j`` after the ``1/sqrt(d_h)`` scaling;
2. the attention residual;
3. *bipartite soft matching* on the block's keys averaged over heads: the visual tokens are
   split by alternation into ``A`` (even positions among the visual tokens) and ``B`` (odd
   positions); each ``A`` token draws an edge to its most cosine-similar ``B`` token; the ``r_l``
   edges with the highest similarity are merged: the ``A`` token is folded into its ``B`` token by
   size-weighted averaging, ``x <- (sum_i s_i x_i) / sum_i s_i``, and the sizes add up. Output
   order: prefix tokens, unmerged ``A`` tokens (original order), then ``B`` tokens;
4. the MLP residual on the ``N_l - r_l`` merged tokens.

Choices where the ToMe paper is silent or leaves options (documented, tested):

- Prefix tokens (CLS, distillation token, registers) are taken out before matching and put back
  first: they are never merged and never absorb a token ("CLS protected"); the alternation runs
  over the visual tokens only.
- ``r_l`` is capped at ``floor(N_l / 2)`` visual tokens (ToMe merges at most half the tokens of
  a layer); :func:`tome_schedule` gives the effective per-block ``r`` and token counts.
- Similarity scores are computed in float32 (the paper's score-comparison rule); ties between
  equal edge scores go to the lower ``A`` index (stable sort).
- Attention: PyTorch SDPA. While every token still has size 1 (before the first merge, and for
  ``r = 0``) the bias is all zeros and is not passed, so the call is exactly timm's fused one
  (FlashAttention on CUDA); after the first merge the ``log(size)`` bias is passed as a float
  ``attn_mask`` of shape ``[B, 1, 1, N]``, which on CUDA rules out FlashAttention (no bias) and
  selects the memory-efficient SDPA kernel (additive bias): the fastest path whose semantics
  allow proportional attention. ``prop_attn=False`` runs ToMe without it (flash throughout).
- ``prune=True`` (ours, the ToMe paper's prune-versus-merge ablation): the same matching, but the
  ``r_l`` matched ``A`` tokens are deleted instead of folded into their ``B`` token (no sizes, no
  proportional attention): it separates what ToMe gains by choosing redundant tokens from what it
  gains by keeping their content (:func:`bipartite_prune`; ``docs/training_rounds.md``, *DORA against
  ToMe*).
- The readout is the model's own head (CLS token; ``avg`` pooling averages merged tokens
  without size weights, as timm's head does).

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only): patch embedding, per block the
attention projections and the two attention matmuls on the ``P + N_l`` tokens entering it, the
MLP on ``P + N_l - r_l`` tokens, the classifier, **and ToMe's matching**: the similarity matmul
``|A| x |B|`` on head-averaged keys of width ``d_h`` (``ceil(N_l/2) * floor(N_l/2) * d_h`` MACs
per merging block). Normalisations, argmax/sort, the weighted average (scatter-add), the
``log(size)`` bias and the head mean are not matrix products and count as runtime only. This is
exactly what ``torch.utils.flop_counter`` counts on :func:`tome_forward` (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import BackboneCost, backbone_cost
from ...engine.patch import check_skip_dead, check_supported

__all__ = [
    "ToMe",
    "attention_output",
    "attention_qk",
    "attention_with_keys",
    "bipartite_edges",
    "bipartite_prune",
    "bipartite_soft_matching",
    "head",
    "merging_forward",
    "merging_gflops",
    "proportional_attention",
    "qkv_heads",
    "r_per_block",
    "sizes_or_ones",
    "tome_forward",
    "tome_gflops",
    "tome_schedule",
]

RSchedule = Union[int, Sequence[int]]


# --------------------------------------------------------------------------------------------
# dense pieces shared by the dense baselines (ToMe, static schedules)


def head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Final norm and the model's own head (``forward_head``)."""
    return model.forward_head(model.norm(x))


def proportional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_size: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_h) + log s) v`` through SDPA; ``q, k, v``: ``[B, H, N, d_h]``.

    ``log_size``: ``[B, N]`` (``None``: all sizes are 1, plain attention). It is added to the
    logits of every query for key column ``j``, which is the same as attending to ``s_j`` copies
    of key ``j``.
    """
    mask = None if log_size is None else log_size[:, None, None, :].to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv_heads(blk: nn.Module, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``, each ``[B, H, N, d_h]``, of the block's ``attn.qkv`` on ``y`` (its ``norm1``
    output), ``q_norm``/``k_norm`` applied."""
    attn = blk.attn
    b, n, _ = y.shape
    qkv = attn.qkv(y).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


def attention_output(blk: nn.Module, x: torch.Tensor, y: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``x + drop_path1(ls1(proj(norm(o))))``: the attention residual of the heads' output ``o``
    (``[B, H, N, d_h]``) on the block input ``x`` (``y``: its ``norm1``, for a gated attention)."""
    attn = blk.attn
    b, n, _ = x.shape
    o = attn.norm(o.transpose(1, 2).reshape(b, n, -1))
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(y).sigmoid()
    o = attn.proj_drop(attn.proj(o))
    return x + blk.drop_path1(blk.ls1(o))


def attention_qk(
    blk: nn.Module, x: torch.Tensor, log_size: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x + drop_path1(ls1(attn(norm1(x))))`` composed from the block's submodules (the same ops
    as timm's fused path), with optional proportional attention; also returns the queries and the
    keys ``[B, H, N, d_h]`` (after ``q_norm``/``k_norm``)."""
    y = blk.norm1(x)
    q, k, v = qkv_heads(blk, y)
    return attention_output(blk, x, y, proportional_attention(q, k, v, log_size)), q, k


def attention_with_keys(
    blk: nn.Module, x: torch.Tensor, log_size: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_qk` without the queries: the attention residual and the keys."""
    x, _, k = attention_qk(blk, x, log_size)
    return x, k


# --------------------------------------------------------------------------------------------
# bipartite soft matching


def bipartite_edges(metric: torch.Tensor, r: int, num_prefix: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The matching step of :func:`bipartite_soft_matching` (``r > 0``): ``(src [B, r], dst [B, r],
    unm [B, |A| - r])``, the ``A`` indices merged (most similar edge first), the ``B`` index each
    goes into, and the ``A`` indices kept, in their original order. ``metric``: ``[B, N, c]``."""
    p, n = num_prefix, metric.shape[1]
    mv = metric[:, p:].float()
    mv = mv / mv.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    ma, mb = mv[:, 0::2], mv[:, 1::2]
    na, nb = ma.shape[1], mb.shape[1]
    if nb == 0 or r > na:
        raise ValueError(f"cannot merge r={r} tokens from {n - p} visual tokens (|A|={na}, |B|={nb})")
    scores = ma @ mb.transpose(1, 2)  # [B, |A|, |B|] cosine similarities (the counted matmul)
    best, dst = scores.max(dim=-1)  # each A token's edge: its most similar B token
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices
    src, unm = order[:, :r], order[:, r:].sort(dim=-1).values
    return src, dst.gather(1, src), unm


def bipartite_soft_matching(
    x: torch.Tensor, metric: torch.Tensor, size: torch.Tensor, r: int, num_prefix: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` visual tokens of every image by ToMe's bipartite soft matching.

    Args:
        x: ``[B, N, C]`` tokens (``num_prefix`` prefix tokens first).
        metric: ``[B, N, c]`` matching features (ToMe: the block's keys averaged over heads).
        size: ``[B, N]`` token sizes (patches each token stands for).
        r: merges per image; must be ``<= |A| = ceil(N_vis / 2)`` and ``|B| >= 1`` when ``r > 0``.
        num_prefix: prefix tokens, excluded from matching and kept first.

    Returns ``(x [B, N - r, C], size [B, N - r])``: prefix, unmerged ``A`` tokens in their
    original order, then the ``B`` tokens (each the size-weighted average of itself and the ``A``
    tokens merged into it).
    """
    if r <= 0:
        return x, size
    p = num_prefix
    b, n, c = x.shape
    src, dst_of_src, unm = bipartite_edges(metric, r, p)
    xv, sv = x[:, p:], size[:, p:]
    xa, xb = xv[:, 0::2], xv[:, 1::2]
    sa, sb = sv[:, 0::2], sv[:, 1::2]
    # size-weighted average: sum of s*x over each merged group, divided by the summed size
    sb_new = sb.scatter_add(1, dst_of_src, sa.gather(1, src))
    wb = (xb * sb[..., None]).scatter_add(
        1, dst_of_src[..., None].expand(b, r, c), xa.gather(1, src[..., None].expand(b, r, c)) * sa.gather(1, src)[..., None]
    )
    xb_new = wb / sb_new[..., None]
    x_unm = xa.gather(1, unm[..., None].expand(b, unm.shape[1], c))
    s_unm = sa.gather(1, unm)
    return torch.cat([x[:, :p], x_unm, xb_new], dim=1), torch.cat([size[:, :p], s_unm, sb_new], dim=1)


def bipartite_prune(x: torch.Tensor, metric: torch.Tensor, r: int, num_prefix: int) -> torch.Tensor:
    """:func:`bipartite_soft_matching`'s matching with the ``r`` matched ``A`` tokens deleted instead
    of merged: ``[B, N - r, C]`` in the same order (prefix, unmatched ``A`` tokens, ``B`` tokens
    unchanged)."""
    if r <= 0:
        return x
    p = num_prefix
    _, _, unm = bipartite_edges(metric, r, p)
    xv = x[:, p:]
    xa = xv[:, 0::2]
    x_unm = xa.gather(1, unm[..., None].expand(-1, unm.shape[1], x.shape[-1]))
    return torch.cat([x[:, :p], x_unm, xv[:, 1::2]], dim=1)


# --------------------------------------------------------------------------------------------
# schedule, forward, GFLOPs


def r_per_block(model: nn.Module, r: RSchedule) -> List[int]:
    """``r`` as one value per block (an int repeated; a list checked against the depth, all >= 0)."""
    depth = len(model.blocks)
    if isinstance(r, int):
        rs = [r] * depth
    else:
        rs = [int(v) for v in r]
        if len(rs) != depth:
            raise ValueError(f"r schedule has {len(rs)} entries but the model has {depth} blocks")
    if any(v < 0 for v in rs):
        raise ValueError(f"r must be >= 0, got {rs}")
    return rs


def tome_schedule(model: nn.Module, r: RSchedule) -> Tuple[List[int], List[int]]:
    """``(effective r per block, visual tokens entering each block)``; ``r_l`` is capped at
    ``floor(N_l / 2)`` (at most half the visual tokens are merged in one block)."""
    n = model.patch_embed.num_patches
    eff, entering = [], []
    for rl in r_per_block(model, r):
        entering.append(n)
        rl = min(rl, n // 2)
        eff.append(rl)
        n -= rl
    return eff, entering


@dataclass(frozen=True)
class ToMeCost:
    gflops: float  # per image, matching included
    matching_gflops: float  # the similarity matmuls' share
    r: List[int]  # effective merges per block
    tokens: List[int]  # visual tokens after each block


def merging_gflops(model: nn.Module, r: RSchedule, skip_dead: bool,
                   match_macs: Callable[[BackboneCost, int, int], float]) -> ToMeCost:
    """GFLOPs per image of a merging forward on ToMe's schedule (:func:`tome_schedule`): the
    backbone on the tokens entering each block (attention) and left after its merge (MLP), plus
    ``match_macs(cost, l, n)``, the method's own matrix products at a merging block ``l`` with ``n``
    visual tokens (``cost``: the model's :class:`~timm_dora.engine.flops.BackboneCost`);
    ``skip_dead``: the last block's MLP on the prefix tokens only."""
    cost = backbone_cost(model)
    p = cost.num_prefix
    eff, entering = tome_schedule(model, r)
    macs = float(cost.patch_macs + cost.head_macs)
    match = 0.0
    for l, (rl, n) in enumerate(zip(eff, entering)):
        n_mlp = p if skip_dead and l == len(eff) - 1 else n + p - rl
        macs += float(cost.block_macs(l, torch.tensor([n + p]), torch.tensor([n_mlp])))
        if rl > 0:
            match += match_macs(cost, l, n)
    tokens = [n - rl for rl, n in zip(eff, entering)]
    return ToMeCost(2 * (macs + match) / 1e9, 2 * match / 1e9, eff, tokens)


def tome_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False) -> ToMeCost:
    """GFLOPs per image of :func:`tome_forward` (same for every image: ToMe is input-uniform):
    :func:`merging_gflops` with the bipartite similarity matmul ``ceil(N/2) x floor(N/2)`` on
    head-averaged keys; ``skip_dead``: the last block's MLP on the prefix tokens only."""
    return merging_gflops(model, r, skip_dead, lambda cost, l, n: math.ceil(n / 2) * (n // 2)
                          * (cost.attn_dim[l] // model.blocks[l].attn.num_heads))


Merge = Callable[[int, torch.Tensor, torch.Tensor, Optional[torch.Tensor], int],
                 Tuple[torch.Tensor, Optional[torch.Tensor]]]


def merging_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, merge: Merge, prop_attn: bool = True,
                    skip_dead: bool = False) -> torch.Tensor:
    """Logits of a ViT whose blocks reduce ``r`` tokens on ToMe's schedule (:func:`tome_schedule`)
    between the attention and the MLP: ``merge(l, x, metric, size, r_l) -> (x, size)`` at every
    block with ``r_l > 0``, ``metric`` the block's keys averaged over heads, ``size`` ``None``
    while every token stands for one patch (then no proportional attention). ``skip_dead``: the
    last block's MLP on the prefix tokens only (all a CLS-token readout reads)."""
    eff, _ = tome_schedule(model, r)
    p = model.num_prefix_tokens
    x = embed(model, x)
    size: Optional[torch.Tensor] = None  # None while every token has size 1
    for l, (blk, rl) in enumerate(zip(model.blocks, eff)):
        log_size = size.log() if (size is not None and prop_attn) else None
        x, k = attention_with_keys(blk, x, log_size)
        if rl > 0:
            x, size = merge(l, x, k.mean(1), size, rl)
        if skip_dead and l == len(eff) - 1:
            x = x[:, :p]
        x = mlp_residual(blk, x)
    return head(model, x)


def sizes_or_ones(x: torch.Tensor, size: Optional[torch.Tensor]) -> torch.Tensor:
    """``size``, or ones for every token of ``x`` before the first merge."""
    return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if size is None else size


def tome_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, prop_attn: bool = True,
                 skip_dead: bool = False, prune: bool = False) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with ToMe merging ``r`` tokens
    per block (an int, or one value per block). ``r = 0`` is the native forward. ``skip_dead``: the
    last block's MLP on the prefix tokens only (all a CLS-token readout reads). ``prune``: delete
    the matched tokens instead of merging them (:func:`bipartite_prune`; sizes stay 1)."""
    p = model.num_prefix_tokens

    def merge(l, x, metric, size, rl):
        if prune:
            return bipartite_prune(x, metric, rl, p), size
        return bipartite_soft_matching(x, metric, sizes_or_ones(x, size), rl, p)

    return merging_forward(model, x, r, merge, prop_attn, skip_dead)


class ToMe:
    """A ToMe configuration as a callable: ``ToMe(model, r)(images) -> logits``.

    The model is not modified (a function of its submodules). ``cost`` holds the per-image GFLOPs
    and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: RSchedule, prop_attn: bool = True, skip_dead: bool = False,
                 prune: bool = False):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        self.model, self.r, self.prop_attn, self.skip_dead, self.prune = model, r, prop_attn, skip_dead, prune
        self.cost = tome_gflops(model, r, skip_dead)

    @property
    def name(self) -> str:
        r = self.r if isinstance(self.r, int) else ",".join(str(v) for v in self.r)
        if self.prune:
            return f"tome-prune(r={r})"
        return f"tome(r={r}{'' if self.prop_attn else ', no prop-attn'})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tome_forward(self.model, x, self.r, self.prop_attn, self.skip_dead, self.prune)
