"""MCTF, Multi-Criteria Token Fusion with One-Step-Ahead Attention (Lee et al., CVPR 2024), off the
shelf (frozen backbone, no fine-tuning) on a timm ViT.

Implemented from the paper's description (arXiv 2403.10030) with the hyperparameters of the
authors' public evaluation scripts (github mlvlab/MCTF, ``run/eval_deit_*_mctf.sh``); no code
copied. Built on :mod:`~timm_dora.evaluate.baselines.tome`'s pieces (``attention_with_keys``,
``proportional_attention``, ``head``, the effective-``r`` schedule) and composing each block's own
timm submodules. A block ``l`` that fuses ``r_l > 0`` tokens runs, on its input ``x`` (``P`` prefix
tokens, ``N_l`` visual tokens, sizes ``s``):

1. **one-step-ahead attention**: ``A = softmax(q k^T / sqrt(d_h) + log s)`` of *this* block on
   the unfused tokens (``q``, ``k`` from ``norm1(x)``, after ``q_norm``/``k_norm``; no values yet),
   ``[B, H, P+N, P+N]``. The informativeness of token ``j`` is ``a_j``, the attention it receives
   averaged over heads and queries (prefix queries included). Fusing with the attention the block
   is about to use, rather than the previous block's (ToMe's), is the paper's one-step-ahead
   attention.
2. **multi-criteria attraction** between visual tokens ``i`` and ``j`` (float32)::

       W_ij = ((1 + cos(x_i, x_j)) / 2) ** (1/tau_sim)          similarity of the block inputs
            * (a'_i a'_j) ** (1/tau_info),  a' = (1/a) / max(1/a)   informativeness (low attention fuses)
            * (s'_i s'_j) ** (1/tau_size),  s' = (1/s) / max(1/s)   size (large tokens resist)

   with the authors' defaults ``tau_sim = 1``, ``tau_info = 20``, ``tau_size = 40``.
3. **bidirectional bipartite soft matching**: the tokens split by alternation over the *whole*
   sequence, prefix included, as the authors' code: ``A`` = the visual tokens at even positions,
   ``B`` = those at odd ones (with one CLS token at position 0: ``A = {v1, v3, ...}``,
   ``B = {v0, v2, ...}``); ``r1 = floor(r/2)`` ``A`` tokens with the highest best edge
   ``max_j W_ij`` fuse into their ``B`` token; then ``r2 = r - r1`` ``B`` tokens (carrying what
   they absorbed) with the highest best edge towards the *unfused* ``A`` tokens fuse into that
   ``A`` token, on the same ``W`` (not recomputed, as the paper). Only one ``|A| x |B|`` similarity
   matmul (visual tokens only) per block.
4. **fusion**: each group becomes ``sum_i a_i s_i x_i / sum_i a_i s_i`` (attention- and
   size-weighted average, the authors' pooling), sizes add up.
5. **attention of the fused tokens by aggregation** (the paper's approximation, no second softmax):
   columns of ``A`` are summed over each group (a group of size ``s`` is attended like its members:
   proportional attention carried over), rows are averaged with the same weights ``a_i s_i``;
   the result multiplies ``V`` of ``norm1`` of the fused tokens, then ``attn.norm``, ``proj``,
   ``ls1`` and the residual on the fused tokens; then the MLP residual on ``P + N_l - r_l`` tokens.
   ``precise=True`` (the authors' "precise" variant) instead recomputes the block's attention on
   the fused tokens with proportional attention (``log s`` bias, ToMe's SDPA path).

Blocks with ``r_l = 0`` run the plain block with proportional attention (exactly timm's block
while every size is 1: ``r = 0`` is the native forward).

Choices where the paper is silent or where we differ (documented, tested):

- Off the shelf: the pretrained weights are used as they are; the paper's *token reduction
  consistency* fine-tuning (which its headline numbers use) is not run. The inference algorithm
  is the authors' evaluated one (one-step-ahead attention with aggregation, bidirectional
  matching, attention-weighted pooling, proportional attention).
- ``r`` as an int fuses in blocks ``1 .. L-1`` (the authors' ``activate_layer [1..11]``: block 0
  runs unfused); a list gives every block's ``r`` (block 0 included). ``r_l`` is capped at
  ``floor(N_l / 2)`` (:func:`~timm_dora.evaluate.baselines.tome.tome_schedule`); the authors' extra
  floor of 10 tokens (never reached by their r = 16 on 196 patches) is not applied.
- Prefix tokens (CLS, distillation, registers) count for the alternation's parity but never fuse
  nor absorb (the authors keep the CLS in ``A`` with ``-inf`` scores: the same effect with one
  CLS; their code protects the first ``A`` rows, which with two prefix tokens would be the CLS and
  a visual token: we protect every prefix token instead). The normalisations ``max(1/a)``,
  ``max(1/s)`` run over the whole sequence, prefix included, as theirs (a positive constant per
  image: no ranking depends on it).
- Output order, as their merge's gather order (it decides the next block's alternation): prefix,
  kept ``A`` tokens in their original order, then kept ``B`` tokens in descending order of their
  best edge towards the kept ``A`` tokens. Ties go to the lower index (stable sorts); their
  ``argsort``/``sort`` are not stable, so exact ties may be ordered otherwise there.
- The readout is the model's own head (``avg`` pooling averages fused tokens without weights).

Side by side with the authors' code (run once outside the repository, fp32 on CPU): their
``models/deit.py`` (``deit_tiny``) with ``utils/mctf.py`` of github mlvlab/MCTF commit ``2004da0``,
unmodified, loaded with timm's ``vit_tiny_patch16_224.augreg_in21k_ft_in1k`` weights (all keys
matched), at their evaluation setting ``mctf_type [r,0,0,1,1,1,20,40,1,1,0]``, ``activate_layer
[1..11]``, against ``MCTF(model, r)``, on 64 pool images (the first 64 ``qc``/``dev`` rows of
``labels_train.csv`` by path), batches of 16. The visual tokens entering every block are identical
(r = 16: 196, 196, 180, ..., 36; r = 8: 196, 196, 188, ..., 116). Top-1 agreement 64/64 at both
r = 16 and r = 8; 62/64 images have logits equal to 1e-3 (median max |difference| 1e-5); on the
other two (another pair at each ``r``) a ranking flips on a tie: two best edges equal, or within
4 ulps, in float32 (exact ties their unstable sort orders otherwise; near ones round differently
with the matmul shapes and the batch), after which the tokens differ: max |logit difference| 0.89
(r = 16), 0.19 (r = 8). Run in float64 throughout (our float32 casts lifted for the check), all
64 images agree to 5e-14 at both ``r``. Before the alternation over the whole sequence and the
kept-``B`` order were adopted, every image differed (r = 16: 3.34, top-1 61/64; r = 8: 1.48, 62/64).

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only), per image. Patch embedding,
classifier (and a MAP head's per-token part) as ToMe. A non-fusing block: ToMe's block count on
its ``P + N_l`` tokens. A fusing block with ``T = P + N_l`` tokens in and ``M = T - r_l`` out:
``q``, ``k`` projections on ``T`` tokens (``2/3`` of ``qkv``), ``QK^T`` on ``T x T``
(``T^2 * attn_dim``), **MCTF's similarity matmul** ``ceil(N_l/2) * floor(N_l/2) * D`` (block
inputs of width ``D``), then the ``v`` projection, ``A V`` (``M^2 * attn_dim``), ``proj`` and MLP on
``M`` tokens. ``precise=True``: ``q, k`` projections and ``QK^T`` on ``T``, the similarity, then the
whole block on ``M``. The ``extra`` share is the similarity matmuls plus, with ``precise``, the
informativeness pass (``qk`` on ``T`` and ``QK^T``). Softmax, head means, scatter-adds (fusion and
attention aggregation), powers and norms are not matrix products. This equals what
``torch.utils.flop_counter`` counts on :func:`mctf_forward` (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import backbone_cost
from ...engine.patch import check_skip_dead, check_supported
from .tome import attention_with_keys, head, tome_schedule

__all__ = [
    "MCTF",
    "mctf_attraction",
    "mctf_block",
    "mctf_forward",
    "mctf_gflops",
    "mctf_matching",
    "mctf_schedule",
]

RSchedule = Union[int, Sequence[int]]
TAU_SIM, TAU_INFO, TAU_SIZE = 1.0, 20.0, 40.0  # the authors' evaluation defaults


def mctf_schedule(model: nn.Module, r: RSchedule) -> Tuple[List[int], List[int]]:
    """``(effective r per block, visual tokens entering each block)``: an int ``r`` fuses in blocks
    ``1 .. L-1`` (block 0 unfused, as the authors); a list is taken per block. Capped at half."""
    if isinstance(r, int):
        r = [0] + [r] * (len(model.blocks) - 1)
    return tome_schedule(model, r)


# --------------------------------------------------------------------------------------------
# multi-criteria attraction and bidirectional matching


def _halves(num_prefix: int) -> Tuple[int, int]:
    """Where the ``A`` and ``B`` halves start among the visual tokens (every second token from
    there): the alternation runs over the whole sequence, prefix included, so ``A`` holds the
    visual tokens at even sequence positions (with one CLS token: ``v1, v3, ...``)."""
    return num_prefix % 2, 1 - num_prefix % 2


def mctf_attraction(metric: torch.Tensor, info: torch.Tensor, size: torch.Tensor, tau_sim: float = TAU_SIM,
                    tau_info: float = TAU_INFO, tau_size: float = TAU_SIZE, num_prefix: int = 0) -> torch.Tensor:
    """The attraction ``W [B, |A|, |B|]`` between the visual tokens of the two halves (``A``: visual
    tokens at even positions of the whole sequence, ``B``: at odd ones; prefix tokens take no part):
    ``metric [B, P+N, D]`` (block inputs), ``info [B, P+N]`` (attention received, ``a``),
    ``size [B, P+N]``, the whole sequence (the normalisations by the max run over it, prefix
    included). A ``tau`` of 0 leaves that criterion out."""
    a0, b0 = (num_prefix + h for h in _halves(num_prefix))
    m = metric.float()
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    w = m[:, a0::2] @ m[:, b0::2].transpose(1, 2)  # cosine similarities (the counted matmul)
    w = ((w + 1) / 2).clamp_min(0)
    if tau_sim:
        w = w ** (1 / tau_sim)
    for crit, tau in ((info, tau_info), (size, tau_size)):
        if tau:
            inv = 1 / crit.float().clamp_min(1e-12)
            inv = inv / inv.amax(dim=1, keepdim=True)
            w = w * (inv[:, a0::2, None] * inv[:, None, b0::2]) ** (1 / tau)
    return w


def mctf_matching(w: torch.Tensor, r: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bidirectional bipartite soft matching on ``W [B, |A|, |B|]``: the slots ``([B, |A|], [B, |B|])``
    each ``A`` and each ``B`` token goes to, ``0 .. |A| + |B| - r - 1``. ``r1 = r // 2`` ``A -> B``
    fusions first (the ``A`` tokens with the highest best edge), then ``r - r1`` ``B -> A`` fusions
    towards the ``A`` tokens left. Kept ``A`` tokens come first in their original order, then the
    kept ``B`` tokens in descending order of their best edge towards the kept ``A`` tokens (the
    order in which the authors' second matching ranks them). Ties go to the lower index."""
    bsz, na, nb = w.shape
    r1, r2 = r // 2, r - r // 2
    if na < 1 or nb < 1 or r1 > na or r2 > nb or na - r1 < 1:
        raise ValueError(f"cannot fuse r={r} tokens with |A|={na}, |B|={nb}")
    dev = w.device
    rows = torch.arange(bsz, device=dev)[:, None]
    a_gone = torch.zeros(bsz, na, dtype=torch.bool, device=dev)
    best1, dst1 = w.max(dim=-1)
    if r1:
        src1 = torch.sort(best1, dim=-1, descending=True, stable=True).indices[:, :r1]
        a_gone[rows, src1] = True
    w2 = w.transpose(1, 2).masked_fill(a_gone[:, None, :], -math.inf)  # B -> unfused A
    best2, dst2 = w2.max(dim=-1)
    rank2 = torch.empty(bsz, nb, dtype=torch.long, device=dev)
    rank2[rows, torch.sort(best2, dim=-1, descending=True, stable=True).indices] = torch.arange(nb, device=dev)
    b_kept = rank2 >= r2  # the r2 highest best edges fuse
    a_kept = ~a_gone
    slot_a = a_kept.long().cumsum(1) - 1
    slot_b = a_kept.sum(1, keepdim=True) + rank2 - r2  # kept B: by descending best edge
    t_b = torch.where(b_kept, slot_b, slot_a.gather(1, dst2))  # B: its own slot, or its A's
    t_a = torch.where(a_kept, slot_a, t_b.gather(1, dst1))  # A: its own slot, or where its B went
    return t_a, t_b


def _group_sum(t: torch.Tensor, dim: int, index: torch.Tensor, n_out: int) -> torch.Tensor:
    """Sum the entries of ``t`` along ``dim`` into ``n_out`` slots; ``index [B, N]`` per image."""
    shape = list(t.shape)
    shape[dim] = n_out
    idx = index.view(index.shape[0], *([1] * (dim - 1)), index.shape[1], *([1] * (t.dim() - dim - 1)))
    return t.new_zeros(shape).scatter_add_(dim, idx.expand_as(t), t)


# --------------------------------------------------------------------------------------------
# one fusing block


def _qk(blk: nn.Module, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    attn = blk.attn
    b, n, _ = y.shape
    d = attn.num_heads * attn.head_dim
    bias = None if attn.qkv.bias is None else attn.qkv.bias[:2 * d]
    qk = F.linear(y, attn.qkv.weight[:2 * d], bias).reshape(b, n, 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    return attn.q_norm(qk[0]), attn.k_norm(qk[1])


def _v(blk: nn.Module, y: torch.Tensor) -> torch.Tensor:
    attn = blk.attn
    b, n, _ = y.shape
    d = attn.num_heads * attn.head_dim
    bias = None if attn.qkv.bias is None else attn.qkv.bias[2 * d:]
    return F.linear(y, attn.qkv.weight[2 * d:], bias).reshape(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)


def mctf_block(blk: nn.Module, x: torch.Tensor, size: torch.Tensor, r: int, num_prefix: int, precise: bool = False,
               taus: Tuple[float, float, float] = (TAU_SIM, TAU_INFO, TAU_SIZE)) -> Tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a fusing block: ``(x + attention residual, size)`` on ``N - r`` tokens
    (prefix first). ``size [B, N]``."""
    attn, p = blk.attn, num_prefix
    b, n, c = x.shape
    y = blk.norm1(x)
    q, k = _qk(blk, y)
    logits = (q @ k.transpose(-2, -1)) * attn.head_dim ** -0.5 + size.log()[:, None, None, :].to(q.dtype)
    a_map = logits.softmax(dim=-1)  # [B, H, N, N] one-step-ahead attention
    info = a_map.float().mean(dim=(1, 2))  # attention received per token
    w = mctf_attraction(x, info, size, *taus, num_prefix=p)
    a0, b0 = _halves(p)
    slots = torch.empty(b, n - p, dtype=torch.long, device=x.device)
    slots[:, a0::2], slots[:, b0::2] = mctf_matching(w, r)
    n_out = n - r
    index = torch.cat([torch.arange(p, device=x.device).expand(b, p), slots + p], dim=1)
    weight = torch.cat([torch.ones_like(info[:, :p]), (info * size.float())[:, p:]], dim=1)  # a_i s_i
    norm = _group_sum(weight, 1, index, n_out)
    xv = _group_sum(x[:, p:].float() * weight[:, p:, None], 1, slots, n_out - p) / norm[:, p:, None]
    x_new = torch.cat([x[:, :p], xv.to(x.dtype)], dim=1)
    size_new = _group_sum(size, 1, index, n_out)
    if precise:
        x_new, _ = attention_with_keys(blk, x_new, size_new.log())
        return x_new, size_new
    # attention of the fused tokens: columns summed per group, rows averaged with a_i s_i
    cols = _group_sum(a_map, 3, index, n_out)
    rows = _group_sum(cols * weight[:, None, :, None].to(cols.dtype), 2, index, n_out) / norm[:, None, :, None].to(cols.dtype)
    y_new = blk.norm1(x_new)
    o = rows @ _v(blk, y_new)
    o = attn.norm(o.transpose(1, 2).reshape(b, n_out, -1))
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(y_new).sigmoid()
    o = attn.proj_drop(attn.proj(o))
    return x_new + blk.drop_path1(blk.ls1(o)), size_new


# --------------------------------------------------------------------------------------------
# forward, GFLOPs


@dataclass(frozen=True)
class MCTFCost:
    gflops: float  # per image, MCTF's own products included
    extra_gflops: float  # MCTF's own products: similarity matmuls (+ the precise informativeness pass)
    matching_gflops: float  # the similarity matmuls' share
    r: List[int]  # effective fusions per block
    tokens: List[int]  # visual tokens after each block


def mctf_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False, precise: bool = False) -> MCTFCost:
    """GFLOPs per image of :func:`mctf_forward` (input-uniform); ``skip_dead``: the last block's MLP
    on the prefix tokens only."""
    cost = backbone_cost(model)
    p = cost.num_prefix
    eff, entering = mctf_schedule(model, r)
    macs = float(cost.patch_macs + cost.head_macs)
    match = extra = 0.0
    last = len(eff) - 1
    for l, (rl, n) in enumerate(zip(eff, entering)):
        t, m = n + p, n + p - rl
        n_mlp = p if skip_dead and l == last else m
        if rl == 0:
            macs += float(cost.block_macs(l, torch.tensor([t]), torch.tensor([n_mlp])))
            continue
        qk = cost.qkv_macs[l] * 2 // 3
        ahead = t * qk + t * t * cost.attn_dim[l]
        sim = math.ceil(n / 2) * (n // 2) * model.embed_dim
        match += sim
        if precise:
            extra += ahead
            macs += ahead + float(cost.block_macs(l, torch.tensor([m]), torch.tensor([n_mlp])))
        else:
            macs += (ahead + m * (cost.qkv_macs[l] - qk + cost.proj_macs[l]) + m * m * cost.attn_dim[l]
                     + n_mlp * cost.mlp_macs[l])
    tokens = [n - rl for rl, n in zip(eff, entering)]
    macs += float(cost.pool_macs(torch.tensor([p + tokens[-1]])))
    return MCTFCost(2 * (macs + match) / 1e9, 2 * (extra + match) / 1e9, 2 * match / 1e9, eff, tokens)


def mctf_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, precise: bool = False, skip_dead: bool = False,
                 taus: Tuple[float, float, float] = (TAU_SIM, TAU_INFO, TAU_SIZE),
                 sizes_out: Optional[list] = None) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with MCTF fusing ``r`` tokens
    per block (an int: blocks ``1 .. L-1``; or one value per block). ``r = 0`` is the native
    forward. ``taus``: ``(tau_sim, tau_info, tau_size)``. ``sizes_out``: a list that receives the
    sizes ``[B, N]`` after every block (``None`` while all are 1)."""
    eff, _ = mctf_schedule(model, r)
    p = model.num_prefix_tokens
    x = embed(model, x)
    size: Optional[torch.Tensor] = None  # None while every token has size 1
    for l, (blk, rl) in enumerate(zip(model.blocks, eff)):
        if rl > 0:
            if size is None:
                size = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
            x, size = mctf_block(blk, x, size, rl, p, precise, taus)
        else:
            x, _ = attention_with_keys(blk, x, None if size is None else size.log())
        if skip_dead and l == len(eff) - 1:
            x = x[:, :p]
        x = mlp_residual(blk, x)
        if sizes_out is not None:
            sizes_out.append(size)
    return head(model, x)


class MCTF:
    """An MCTF configuration as a callable: ``MCTF(model, r)(images) -> logits``.

    The model is not modified (a function of its submodules). ``cost`` holds the per-image GFLOPs
    and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: RSchedule, precise: bool = False, skip_dead: bool = False,
                 taus: Tuple[float, float, float] = (TAU_SIM, TAU_INFO, TAU_SIZE)):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        self.model, self.r, self.precise, self.skip_dead, self.taus = model, r, precise, skip_dead, tuple(taus)
        self.cost = mctf_gflops(model, r, skip_dead, precise)

    @property
    def name(self) -> str:
        r = self.r if isinstance(self.r, int) else ",".join(str(v) for v in self.r)
        extra = ", precise" if self.precise else ""
        if self.taus != (TAU_SIM, TAU_INFO, TAU_SIZE):
            extra += ", tau=" + "/".join(f"{t:g}" for t in self.taus)
        return f"mctf(r={r}{extra})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return mctf_forward(self.model, x, self.r, self.precise, self.skip_dead, self.taus)
