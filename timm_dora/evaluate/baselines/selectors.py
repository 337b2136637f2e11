"""Selector substitutions (paper App. F.1): DORA's recorded gates and budgets, another token rule.

Each policy here replays a recorded DORA run *exactly* in where and how much it prunes (the gate
``g_l`` and budget ``k_l`` of every image at every block) and swaps only *which* ``k_l`` visual
tokens are removed. Each rule reads the block's own, evolving (already pruned) representation,
so trajectories diverge from DORA's after the first substitution. They are component
substitutions, not the complete baseline methods.

- :class:`RandomSelector`: ``k_l`` visual tokens uniformly at random (a ``torch.Generator`` makes
  it reproducible; the paper reports mean +- std over five seeds).
- :class:`SimilaritySelector` (ToMe-style key similarity): the keys of the block, averaged over
  heads as ToMe's matching metric, cosine similarity between every pair of visual tokens of the
  image; a token's redundancy is its highest similarity to any *other* visual token; the ``k_l``
  most redundant are removed. (ToMe's bipartite matching can remove at most half the tokens and
  DORA's budgets go up to ``N_l - 4``, so the rule scores all pairs; it is one-shot, not greedy:
  both members of a near-duplicate pair score high.)
- :class:`AttentionWPRSelector` (Zero-TPrune-style weighted PageRank): the block's attention
  probabilities ``A_h = softmax(q k^T / sqrt(d_h))`` over the ``P + N_l`` tokens that entered the
  block. The policy only receives keys (``BlockContext.keys``), so the queries are recomputed
  from the block input rows (``BlockContext.packed.x``) with the block's own ``norm1``, the query
  third of ``attn.qkv`` and ``attn.q_norm``: exactly the probabilities the block used. The graph
  is the head average ``A = mean_h A_h`` (row-stochastic); importance starts uniform and is
  propagated ``iters`` times as ``s <- A^T s`` (a token is important when important tokens attend
  to it); the ``k_l`` visual tokens of lowest importance are removed. CLS and other prefix tokens
  take part in the graph but are never removed. Zero-TPrune's head filter and region emphasis
  are not used (the paper's substitution names only the attention-graph importance rule).

Recorded runs come from :class:`~timm_dora.engine.patch.DoraStats` (``.removed`` and ``.gate``, e.g.
``model.dora_stats`` after a deterministic DORA forward) or from the :class:`~timm_dora.policy.StepRecord`
list of an ``ActorPolicy(record=True)``. The batch must hold the same images in the same order.

Each decision carries the selector's own matrix-product FLOPs (``Decision.flops``; Random: none;
Similarity: ``N_l^2 d_h``; Attention-WPR: query projection, ``q k^T`` and ``iters`` matrix-vector
products, per image, MACs x 2), so ``dora_stats.gflops`` stays a complete count.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from ...engine.packing import removal_mask, rows_where
from ...engine.protocol import BlockContext, Decision
from ...policy import NoPrune, StepRecord
from ...policy.actor import ordered_topk
from .zerotprune import weighted_pagerank

__all__ = ["SELECTORS", "RandomSelector", "SimilaritySelector", "AttentionWPRSelector", "RecordedSelector"]


class RecordedSelector:
    """Base class: follows recorded ``removed [B, L]`` (and ``gate [B, L]``) exactly.

    Subclasses implement :meth:`scores` (higher = removed first) on the padded visual tokens of the
    images that prune at this block.
    """

    name = "recorded"

    def __init__(self, removed: torch.Tensor, gate: Optional[torch.Tensor] = None, *, model: Optional[nn.Module] = None):
        removed = torch.as_tensor(removed).long()
        if removed.dim() != 2:
            raise ValueError(f"removed must be [B, L], got shape {tuple(removed.shape)}")
        if gate is None:
            gate = removed > 0
        gate = torch.as_tensor(gate).bool()
        if gate.shape != removed.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and removed {tuple(removed.shape)} differ in shape")
        if bool(((removed > 0) & ~gate).any()):
            raise ValueError("recorded run removes tokens where its gate is closed")
        self.removed, self.gate, self.model = removed, gate, model
        self._removed_host = removed.cpu()  # host copy: which images prune where, without syncs

    # ---------------------------------------------------------------- construction from a run
    @classmethod
    def from_stats(cls, stats, **kwargs) -> "RecordedSelector":
        """From a :class:`~timm_dora.engine.patch.DoraStats` (``removed`` and ``gate``)."""
        return cls(stats.removed, stats.gate, **kwargs)

    @classmethod
    def from_records(cls, records: Sequence[StepRecord], **kwargs) -> "RecordedSelector":
        """From the per-block :class:`StepRecord` list of an ``ActorPolicy(record=True)`` forward."""
        if not records:
            raise ValueError("no step records (was the ActorPolicy created with record=True?)")
        depth = max(r.block for r in records) + 1
        b = records[0].gate.shape[0]
        dev = records[0].gate.device
        removed = torch.zeros(b, depth, dtype=torch.long, device=dev)
        gate = torch.zeros(b, depth, dtype=torch.bool, device=dev)
        for r in records:
            gate[:, r.block] = r.gate
            if r.budget is not None and r.active.numel():
                removed[r.active, r.block] = r.budget.long()
        return cls(removed, gate, **kwargs)

    # ---------------------------------------------------------------- the policy
    def scores(self, ctx: BlockContext, pad: "_Padded") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``([A, S - P] removal scores of the visual tokens, [A] float64 FLOPs or None)``."""
        raise NotImplementedError

    def __call__(self, ctx: BlockContext) -> Decision:
        b, l = ctx.packed.batch_size, ctx.block
        if self.removed.shape[0] != b:
            raise ValueError(f"recorded run has {self.removed.shape[0]} images, this batch {b}")
        if l >= self.removed.shape[1]:
            return NoPrune()(ctx)
        dev = ctx.keys.device
        k_host = self._removed_host[:, l]
        gate, removed = self.gate[:, l].to(dev), self.removed[:, l].to(dev)
        active_host = torch.nonzero(k_host > 0).squeeze(1).tolist()
        if not active_host:
            return Decision(gate, removed)
        n_host = ctx.n_visual_host
        if any(n_host[i] - int(k_host[i]) < 1 for i in active_host):
            raise ValueError(f"recorded budget at block {l} would remove every visual token of an image")
        pad = _Padded(ctx, active_host)
        s, flops_active = self.scores(ctx, pad)
        s = s.float().masked_fill(~pad.valid[:, ctx.packed.num_prefix:], float("-inf"))
        k = removed[pad.active]
        order, valid = ordered_topk(s, k, kmax=int(k_host.max()))  # bound on the host: no sync
        remove = removal_mask(ctx.packed, pad.active[:, None], order, valid)  # masked, not indexed: no sync
        flops = None
        if flops_active is not None:
            flops = torch.zeros(b, dtype=torch.float64, device=dev)
            flops[pad.active] = flops_active
        return Decision(gate, removed, remove, flops, removed_host=k_host.tolist())  # host copy: no sync to compact


class _Padded:
    """The rows of the images that prune at this block, scattered into ``[A, S]`` (``S``: the
    longest of their sequences, prefix included)."""

    def __init__(self, ctx: BlockContext, active_host: List[int]):
        packed = ctx.packed
        dev = ctx.keys.device
        lengths = [packed.lengths_host[i] for i in active_host]
        self.active = torch.tensor(active_host, dtype=torch.long, device=dev)
        rank = torch.full((packed.batch_size,), -1, dtype=torch.long, device=dev)
        rank[self.active] = torch.arange(len(active_host), device=dev)
        self.rows = rows_where(rank[packed.seg] >= 0, sum(lengths))
        self.a = rank[packed.seg[self.rows]]
        self.col = packed.pos[self.rows]
        self.width = max(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=dev)
        self.valid = torch.zeros(len(active_host), self.width, dtype=torch.bool, device=dev)
        self.valid[self.a, self.col] = True

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` packed values -> ``[A, S, ...]`` (zeros where invalid)."""
        out = values.new_zeros((self.valid.shape[0], self.width) + tuple(values.shape[1:]))
        out[self.a, self.col] = values[self.rows]
        return out


def _num_heads(model: Optional[nn.Module], block: int) -> int:
    return 1 if model is None else int(model.blocks[block].attn.num_heads)


class RandomSelector(RecordedSelector):
    """Uniformly random ``k_l`` visual tokens (``generator``: a CPU ``torch.Generator`` or seed)."""

    name = "random"

    def __init__(self, removed, gate=None, *, model=None, generator=None):
        super().__init__(removed, gate, model=model)
        if generator is None or isinstance(generator, int):
            generator = torch.Generator().manual_seed(0 if generator is None else generator)
        self.generator = generator

    def scores(self, ctx, pad):
        p = ctx.packed.num_prefix
        u = torch.rand((pad.valid.shape[0], pad.width - p), generator=self.generator)
        return u.to(ctx.keys.device), None


class SimilaritySelector(RecordedSelector):
    """Remove the ``k_l`` visual tokens whose head-averaged key is most cosine-similar to another
    visual token of the same image (ToMe's metric). Needs ``model`` for the number of heads
    (without it the concatenated keys are used)."""

    name = "similarity"

    def scores(self, ctx, pad):
        p, h = ctx.packed.num_prefix, _num_heads(self.model, ctx.block)
        t, d = ctx.keys.shape
        metric = ctx.keys.view(t, h, d // h).float().mean(1)
        metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        m = pad.pad(metric)[:, p:]  # [A, Sv, d_h]
        vis = pad.valid[:, p:]
        sim = m @ m.transpose(1, 2)  # [A, Sv, Sv]
        eye = torch.eye(sim.shape[1], dtype=torch.bool, device=sim.device)
        sim = sim.masked_fill(eye[None] | ~vis[:, None, :], float("-inf"))
        nv = (pad.lengths - p).double()
        return sim.max(dim=-1).values, 2.0 * nv * nv * (d // h)


class AttentionWPRSelector(RecordedSelector):
    """Remove the ``k_l`` visual tokens of lowest weighted-PageRank importance on the block's
    head-averaged attention graph (``iters`` propagation steps). Needs ``model``."""

    name = "attention-wpr"

    def __init__(self, removed, gate=None, *, model=None, iters: int = 30):
        if model is None:
            raise ValueError("AttentionWPRSelector needs model= (it recomputes the block's queries)")
        super().__init__(removed, gate, model=model)
        self.iters = int(iters)

    def scores(self, ctx, pad):
        blk = self.model.blocks[ctx.block]
        attn = blk.attn
        h, hd, dim = attn.num_heads, attn.head_dim, attn.num_heads * attn.head_dim
        p = ctx.packed.num_prefix
        x = ctx.packed.x[pad.rows]  # block input rows of the active images
        wq = attn.qkv.weight[:dim]
        bq = None if attn.qkv.bias is None else attn.qkv.bias[:dim]
        q = attn.q_norm(torch.nn.functional.linear(blk.norm1(x), wq, bq).view(-1, h, hd))
        k = ctx.keys[pad.rows].view(-1, h, hd)
        a_n, s = pad.valid.shape
        qp = q.new_zeros(a_n, s, h, hd)
        kp = k.new_zeros(a_n, s, h, hd)
        qp[pad.a, pad.col] = q
        kp[pad.a, pad.col] = k
        logits = (qp.transpose(1, 2).float() @ kp.permute(0, 2, 3, 1).float()) * attn.scale  # [A, H, S, S]
        logits = logits.masked_fill(~pad.valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).mean(1)  # [A, S, S] head-averaged, row-stochastic
        probs = probs * pad.valid[:, :, None]  # padded queries attend nowhere
        score = pad.valid.float() / pad.lengths[:, None].float()  # uniform start
        score = weighted_pagerank(probs, score, self.iters)  # s <- A^T s, iters times
        n = pad.lengths.double()
        flops = 2.0 * (n * attn.qkv.in_features * dim + n * n * dim + self.iters * n * n)
        return -score[:, p:], flops


SELECTORS: Dict[str, Type[RecordedSelector]] = {
    "random": RandomSelector,
    "similarity": SimilaritySelector,
    "attention-wpr": AttentionWPRSelector,
}
