"""Zero-TPrune (Wang, Dedhia and Jha, CVPR 2024), zero-shot token pruning on a frozen timm ViT.

Implemented from the paper's description (arXiv 2305.17328: its WPR recursion, EIR/VHF formulas,
iteration counts, VHF range, CLS initialisation, S-stage partition/feature/metric ablation winners and
the I'-S-I order, as stated in public summaries of the paper; the authors' code was not available
here; no code copied), composing each block's own timm submodules as :mod:`~timm_dora.evaluate.baselines.tome` does. Tokens are *deleted* (no
merging, no sizes). A block ``l`` that prunes ``r_l > 0`` of its ``N_l`` visual tokens (``P`` prefix
tokens, ``T = P + N_l`` tokens in all) runs:

1. **attention with explicit probabilities**: ``q, k, v`` from ``norm1(x)`` (after ``q_norm`` /
   ``k_norm``), ``A_h = softmax(q k^T * scale)`` ``[B, H, T, T]``, ``o = A_h v``, then ``attn.norm``,
   ``proj``, ``ls1`` and the residual: the same attention the block computes (the probabilities are
   materialised once, not recomputed), so the graph is exactly the block's own.
2. **I'-stage** (pre-ranking, prunes nothing): one step of weighted PageRank per head,
   ``s_h <- A_h^T s_h`` from the initial distribution ``s0`` (below), aggregated over heads by EIR/VHF.
3. **S-stage** (``r_S`` tokens): the visual tokens are sorted by their I'-importance (ascending,
   stable) and cut into two groups, ``A`` = the ``ceil(N_l/2)`` least important, ``B`` = the rest
   (the paper's *sequential, unimportant-first* partition); every ``A`` token's edge is its highest
   cosine similarity to a ``B`` token on the block's keys (all heads concatenated, width
   ``attn_dim``, the paper's *Key* feature and *cosine* metric); the ``r_S`` ``A`` tokens with the
   highest edges are deleted (the ``B`` token is kept unchanged).
4. **I-stage** (``r_I = r_l - r_S`` tokens): weighted PageRank on the attention graph of the
   ``T - r_S`` tokens left: the rows and columns of the deleted tokens are taken out of every
   ``A_h`` and each row is renormalised to sum 1 (the graph stays row-stochastic);
   ``s_h <- A_h^T s_h``, ``iters_l`` times, from ``s0``; the ``r_I`` visual tokens of lowest
   aggregated importance are deleted.
5. the MLP residual on the ``T - r_l`` tokens left (prefix first, visual tokens in their order).

Blocks with ``r_l = 0`` run the plain block through SDPA (:func:`~.tome.attention_with_keys`), so
``r = 0`` is exactly the native forward.

Importance, as in the paper:

- ``s0``: uniform, except that the class token(s) (CLS and a distillation token: the prefix tokens
  that are not registers) start with ``sqrt(T)`` times the score of the others (the paper's default
  "Zero-TPrune"; ``cls_boost=False`` is its "Zero-TPrune-uni"); normalised to sum 1.
- **EIR** (emphasising informative regions): the heads are aggregated by a root mean square,
  ``s_i = sqrt(sum_h m_h s_h,i^2 / sum_h m_h)``.
- **VHF** (variance-based head filter): ``m_h = 1`` when ``v_min <= Var_h <= v_max`` (the paper's
  range ``[0.01, 0.7]``), else 0. *Our choice where the paper is silent on the scale*: ``Var_h`` is
  the population variance of head ``h``'s visual-token scores divided by their mean (a mean-1
  distribution: 0 for a uniform head, so thresholds do not depend on ``N_l``); if no head of an
  image passes, all its heads are used. ``vhf=None`` turns the filter off.
- WPR iterations, the paper's converged values: ``iters = 30`` in the first three blocks, ``5`` in
  the middle ones, ``1`` in the last three (its ranges are 30-50, 5-10 and 1; we take the low ends).
  An int or one value per block overrides them.

Choices where the paper is silent or which the comparison protocol fixes (documented, tested):

- **Where**: the pruning happens inside block ``l``, after its attention residual and before its MLP,
  on block ``l``'s own attention graph (ToMe's position in this repo's comparison set; the paper
  inserts its pruning layer between blocks and reads the previous block's attention: the same graph,
  one MLP earlier).
- **The knob** ``r``: tokens deleted per block, an int (every block, as ToMe) or one per block. The
  paper configures pruning layers with keep rates (e.g. DynamicViT-like stages); any such schedule
  is a list ``r`` (the tokens it deletes at each block, 0 elsewhere). ``r_l`` is capped at
  ``N_l - MIN_KEEP`` (at least ``MIN_KEEP = 4`` visual tokens stay).
- **The I/S split**: ``r_S = min(floor(s_frac * r_l), ceil(N_l/2))`` (``s_frac = 0.5``; at most
  the ``A`` group), ``r_I = r_l - r_S``; with
  ``r_S = 0`` the I'- and S-stages are skipped (pure I-stage).
- Prefix tokens take part in the graph (rows and columns) but are never deleted, never in ``A`` or
  ``B``. Scores and similarities in float32; ties go to the lower index (stable sorts).
- The readout is the model's own head.

No side-by-side run with the authors' code: none was found here (the only public
repository named Zero-TPrune is a course project, not the authors'), so the agreement is unchecked.

GFLOPs (App. E.4 rule, 1 MAC = 2 FLOPs, matrix products only), per image. Patch embedding, the
classifier and a MAP head's per-token part as ToMe / MCTF. Every block: ``qkv`` and ``proj`` on the
``T`` tokens in, ``QK^T`` and ``A V`` (``T^2 attn_dim`` each), the MLP on ``T - r_l`` tokens (the
materialised probabilities are the same two matmuls, so no attention is recomputed). **Zero-TPrune's
own products** (``extra``), in a pruning block: the I'-stage's one matrix-vector product per head
(``H T^2``, only when ``r_S > 0``), the S-stage's similarity ``ceil(N_l/2) floor(N_l/2) attn_dim``
(only when ``r_S > 0``) and the I-stage's ``iters_l`` matrix-vector products per head on the reduced
graph (``iters_l H (T - r_S)^2``, only when ``r_I > 0``). Softmax, renormalisation, norms, sorts,
gathers, squares and roots are not matrix products. This equals what ``torch.utils.flop_counter``
counts on :func:`zerotprune_forward` (tested; the SDPA of non-pruning blocks where torch counts it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import backbone_cost
from ...engine.patch import check_skip_dead, check_supported
from .tome import RSchedule, r_per_block, attention_with_keys, head

__all__ = [
    "ZeroTPrune",
    "aggregate_heads",
    "s_stage",
    "weighted_pagerank",
    "wpr_iterations",
    "zerotprune_block",
    "zerotprune_forward",
    "zerotprune_gflops",
    "zerotprune_schedule",
]

MIN_KEEP = 4  # visual tokens that always stay
VHF = (0.01, 0.7)  # the paper's variance range of the head filter
S_FRAC = 0.5  # share of r_l deleted by the S-stage
Iters = Union[None, int, Sequence[int]]


def weighted_pagerank(attn: torch.Tensor, s: torch.Tensor, iters: int) -> torch.Tensor:
    """Weighted PageRank: ``s <- A^T s``, ``iters`` times (a token is important when important
    tokens attend to it). ``attn``: ``[..., N, N]`` row-stochastic (row ``i``: how token ``i``
    attends); ``s``: ``[..., N]``. One ``N x N`` matrix-vector product per step, as a batched matmul."""
    for _ in range(iters):
        s = (s.unsqueeze(-2) @ attn).squeeze(-2)
    return s


def aggregate_heads(s: torch.Tensor, num_prefix: int, vhf: Optional[Tuple[float, float]] = VHF) -> torch.Tensor:
    """EIR aggregation with the VHF filter: ``[B, H, N]`` per-head scores -> ``[B, N]``,
    ``sqrt(sum_h m_h s_h^2 / sum_h m_h)``; ``m_h``: the head's visual-score variance (scores divided
    by their mean) within ``vhf``; no head passing (or ``vhf=None``): every head counts."""
    s = s.float()
    mask = torch.ones(s.shape[:2], dtype=s.dtype, device=s.device)
    if vhf is not None:
        vis = s[..., num_prefix:]
        var = (vis / vis.mean(-1, keepdim=True).clamp_min(1e-30)).var(-1, unbiased=False)
        keep = (var >= vhf[0]) & (var <= vhf[1])
        keep = keep | ~keep.any(dim=1, keepdim=True)  # no head passes: all heads
        mask = keep.to(s.dtype)
    return ((s * s * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).sqrt()


def s_stage(keys: torch.Tensor, importance: torch.Tensor, r: int) -> torch.Tensor:
    """The S-stage's choice on the visual tokens: ``[B, r]`` indices (among them) to delete.
    ``keys``: ``[B, N, c]``; ``importance``: ``[B, N]`` (I'-stage). ``A`` = the ``ceil(N/2)`` least
    important tokens, ``B`` = the rest; the ``r`` ``A`` tokens most cosine-similar to some ``B`` token."""
    n = keys.shape[1]
    na = (n + 1) // 2
    if r > na or n - na < 1:
        raise ValueError(f"S-stage cannot delete r={r} of {n} visual tokens (|A|={na})")
    order = torch.sort(importance.float(), dim=-1, stable=True).indices
    ia, ib = order[:, :na], order[:, na:]
    m = keys.float()
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    ma = m.gather(1, ia[..., None].expand(-1, -1, m.shape[-1]))
    mb = m.gather(1, ib[..., None].expand(-1, -1, m.shape[-1]))
    best = (ma @ mb.transpose(1, 2)).amax(-1)  # [B, |A|] (the counted similarity matmul)
    pick = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :r]
    return ia.gather(1, pick)


# --------------------------------------------------------------------------------------------
# schedule


def wpr_iterations(depth: int, iters: Iters = None) -> List[int]:
    """WPR steps per block: the paper's 30 (first three blocks), 5 (middle), 1 (last three)."""
    if iters is None:
        return [30 if l < 3 else (1 if l >= depth - 3 else 5) for l in range(depth)]
    if isinstance(iters, int):
        return [iters] * depth
    out = [int(v) for v in iters]
    if len(out) != depth or any(v < 1 for v in out):
        raise ValueError(f"iters must be {depth} values >= 1, got {out}")
    return out


def _split(rl: int, n: int, s_frac: float) -> Tuple[int, int]:
    """``(r_S, r_I)`` for ``r_l`` of ``n`` visual tokens: ``r_S = floor(s_frac r_l)``, at most ``|A|``."""
    rs = min(int(math.floor(s_frac * rl)), (n + 1) // 2)
    return rs, rl - rs


def zerotprune_schedule(model: nn.Module, r: RSchedule) -> Tuple[List[int], List[int]]:
    """``(effective r per block, visual tokens entering each block)``; ``r_l <= N_l - MIN_KEEP``."""
    n = model.patch_embed.num_patches
    eff, entering = [], []
    for rl in r_per_block(model, r):
        entering.append(n)
        rl = max(0, min(rl, n - MIN_KEEP))
        eff.append(rl)
        n -= rl
    return eff, entering


def _boosted(model: nn.Module) -> int:
    """Prefix tokens that start with the class-token boost: CLS and a distillation token (not registers)."""
    return model.num_prefix_tokens - int(getattr(model, "num_reg_tokens", 0) or 0)


def _initial(b: int, h: int, t: int, n_boost: int, cls_boost: bool, device) -> torch.Tensor:
    s = torch.ones(b, h, t, device=device)
    if cls_boost and n_boost:
        s[..., :n_boost] = math.sqrt(t)
    return s / s.sum(-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# one pruning block


def zerotprune_block(blk: nn.Module, x: torch.Tensor, r: int, num_prefix: int, iters: int, *, s_frac: float = S_FRAC,
                     vhf: Optional[Tuple[float, float]] = VHF, n_boost: int = 1, cls_boost: bool = True,
                     keep_out: Optional[list] = None) -> torch.Tensor:
    """The attention half of a pruning block: ``x + attention residual`` on ``T - r`` tokens (prefix
    first, visual tokens in their order). ``keep_out``: a list that receives the kept visual indices
    ``[B, N - r]`` (among the block's input visual tokens)."""
    attn, p = blk.attn, num_prefix
    b, t, _ = x.shape
    n = t - p
    h = attn.num_heads
    y = blk.norm1(x)
    qkv = attn.qkv(y).reshape(b, t, 3, h, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    probs = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1)  # [B, H, T, T] the block's attention
    o = attn.norm((probs @ v).transpose(1, 2).reshape(b, t, -1))
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(y).sigmoid()
    x = x + blk.drop_path1(blk.ls1(attn.proj_drop(attn.proj(o))))

    rs, ri = _split(r, n, s_frac)
    graph = probs.float()
    dev = x.device
    keep = torch.arange(n, device=dev).expand(b, n)  # visual indices still in
    if rs > 0:
        s1 = aggregate_heads(weighted_pagerank(graph, _initial(b, h, t, n_boost, cls_boost, dev), 1), p, vhf)  # I'
        keys = k.transpose(1, 2).reshape(b, t, -1)[:, p:]
        gone = s_stage(keys, s1[:, p:], rs)
        alive = torch.ones(b, n, dtype=torch.bool, device=dev)
        alive[torch.arange(b, device=dev)[:, None], gone] = False
        keep = keep[alive].view(b, n - rs)
        rows = torch.cat([torch.arange(p, device=dev).expand(b, p), keep + p], dim=1)  # tokens left
        tl = rows.shape[1]
        graph = graph.gather(2, rows[:, None, :, None].expand(b, h, tl, t))
        graph = graph.gather(3, rows[:, None, None, :].expand(b, h, tl, tl))
        graph = graph / graph.sum(-1, keepdim=True).clamp_min(1e-30)
    if ri > 0:
        tl = graph.shape[-1]
        s = aggregate_heads(weighted_pagerank(graph, _initial(b, h, tl, n_boost, cls_boost, dev), iters), p, vhf)
        order = torch.sort(s[:, p:], dim=-1, descending=True, stable=True).indices[:, :tl - p - ri]
        keep = keep.gather(1, order.sort(dim=-1).values)
    if keep_out is not None:
        keep_out.append(keep)
    xv = x[:, p:].gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))
    return torch.cat([x[:, :p], xv], dim=1)


# --------------------------------------------------------------------------------------------
# GFLOPs, forward


@dataclass(frozen=True)
class ZeroTPruneCost:
    gflops: float  # per image, Zero-TPrune's own products included
    extra_gflops: float  # Zero-TPrune's own products: WPR matrix-vector products and the S-stage similarity
    r: List[int]  # effective deletions per block
    tokens: List[int]  # visual tokens after each block


def zerotprune_gflops(model: nn.Module, r: RSchedule, skip_dead: bool = False, iters: Iters = None,
                      s_frac: float = S_FRAC) -> ZeroTPruneCost:
    """GFLOPs per image of :func:`zerotprune_forward` (the same for every image); ``skip_dead``: the
    last block's MLP on the prefix tokens only."""
    cost = backbone_cost(model)
    p = cost.num_prefix
    eff, entering = zerotprune_schedule(model, r)
    its = wpr_iterations(len(eff), iters)
    macs = float(cost.patch_macs + cost.head_macs)
    extra = 0.0
    for l, (rl, n) in enumerate(zip(eff, entering)):
        t = n + p
        n_mlp = p if skip_dead and l == len(eff) - 1 else t - rl
        macs += float(cost.block_macs(l, torch.tensor([t]), torch.tensor([n_mlp])))
        if rl == 0:
            continue
        h = model.blocks[l].attn.num_heads
        rs, ri = _split(rl, n, s_frac)
        if rs > 0:
            extra += h * t * t + ((n + 1) // 2) * (n // 2) * cost.attn_dim[l]
        if ri > 0:
            extra += its[l] * h * (t - rs) ** 2
    tokens = [n - rl for rl, n in zip(eff, entering)]
    macs += float(cost.pool_macs(torch.tensor([p + tokens[-1]])))
    return ZeroTPruneCost(2 * (macs + extra) / 1e9, 2 * extra / 1e9, eff, tokens)


def zerotprune_forward(model: nn.Module, x: torch.Tensor, r: RSchedule, skip_dead: bool = False, *, iters: Iters = None,
                       s_frac: float = S_FRAC, vhf: Optional[Tuple[float, float]] = VHF, cls_boost: bool = True,
                       keep_out: Optional[list] = None) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with Zero-TPrune deleting ``r``
    visual tokens per block (an int, or one value per block; capped at ``N_l - MIN_KEEP``). ``r = 0``
    is the native forward. ``keep_out``: receives, per pruning block, the kept visual indices."""
    eff, _ = zerotprune_schedule(model, r)
    its = wpr_iterations(len(eff), iters)
    p, n_boost = model.num_prefix_tokens, _boosted(model)
    x = embed(model, x)
    for l, (blk, rl) in enumerate(zip(model.blocks, eff)):
        if rl > 0:
            x = zerotprune_block(blk, x, rl, p, its[l], s_frac=s_frac, vhf=vhf, n_boost=n_boost, cls_boost=cls_boost,
                                 keep_out=keep_out)
        else:
            x, _ = attention_with_keys(blk, x)
        if skip_dead and l == len(eff) - 1:
            x = x[:, :p]
        x = mlp_residual(blk, x)
    return head(model, x)


class ZeroTPrune:
    """A Zero-TPrune configuration as a callable: ``ZeroTPrune(model, r)(images) -> logits``.

    The model is not modified. ``cost`` holds the per-image GFLOPs and the effective schedule.
    """

    def __init__(self, model: nn.Module, r: RSchedule, skip_dead: bool = False, iters: Iters = None,
                 s_frac: float = S_FRAC, vhf: Optional[Tuple[float, float]] = VHF, cls_boost: bool = True):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        if not 0.0 <= s_frac <= 1.0:
            raise ValueError(f"s_frac must be in [0, 1], got {s_frac}")
        wpr_iterations(len(model.blocks), iters)  # validates
        self.model, self.r, self.skip_dead, self.iters = model, r, skip_dead, iters
        self.s_frac, self.vhf, self.cls_boost = s_frac, (None if vhf is None else tuple(vhf)), cls_boost
        self.cost = zerotprune_gflops(model, r, skip_dead, iters, s_frac)

    @property
    def name(self) -> str:
        r = self.r if isinstance(self.r, int) else ",".join(str(v) for v in self.r)
        extra = "" if self.s_frac == S_FRAC else f", s={self.s_frac:g}"
        extra += "" if self.vhf == VHF else (", no vhf" if self.vhf is None else f", vhf={self.vhf[0]:g}-{self.vhf[1]:g}")
        extra += "" if self.cls_boost else ", uni"
        if self.iters is not None:
            extra += ", iters=" + (str(self.iters) if isinstance(self.iters, int) else ",".join(map(str, self.iters)))
        return f"zerotprune(r={r}{extra})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return zerotprune_forward(self.model, x, self.r, self.skip_dead, iters=self.iters, s_frac=self.s_frac,
                                  vhf=self.vhf, cls_boost=self.cls_boost)
