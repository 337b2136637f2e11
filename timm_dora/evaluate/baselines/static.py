"""Dense static pruning schedules: remove ``k_l`` visual tokens after the attention of fixed blocks.

The same counts for every image (so the batch stays a dense ``[B, N, d]`` tensor and runs timm's
fused attention), with the *identity* of the removed tokens chosen per image by a simple rule:

- ``"cls_sim"``: keep the ``N_l - k_l`` visual tokens whose key is most cosine-similar to the CLS
  key of the same block (keys after ``k_norm``, heads concatenated; the survivors keep their
  order). One matrix-vector product per image and pruning block, ``N_l * d`` MACs, counted in
  GFLOPs. A cheap attention-free proxy for "what CLS attends to" (our choice: the DORA paper's
  baselines are learned or attention-based; this is a simple, deterministic reference).
- ``"slice"``: keep the first ``N_l - k_l`` visual tokens (``x[:, :P + N_l - k_l]``). Zero selection
  overhead: the speed reference (the dense "oracle" of ``benchmarks/throughput.py``); its
  accuracy is that of dropping the bottom rows of the image.

Deletion happens where DORA deletes (after the attention residual, before the MLP), so the GFLOPs
follow the App. E.4 rule exactly as for DORA: attention on ``P + N_l`` tokens, MLP on
``P + N_l - k_l``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Union

import torch
import torch.nn as nn

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import backbone_cost
from ...engine.patch import check_skip_dead, check_supported
from .tome import attention_with_keys, head

__all__ = ["RULES", "StaticPrune", "parse_schedule", "schedule_for_reduction", "static_forward", "static_gflops"]

RULES = ("cls_sim", "slice")
Schedule = Mapping[int, int]


def parse_schedule(spec: Union[str, Schedule]) -> Dict[int, int]:
    """``"3:40,6:40,9:40"`` (block:count) or a mapping -> ``{3: 40, 6: 40, 9: 40}``."""
    if isinstance(spec, Mapping):
        return {int(b): int(k) for b, k in spec.items()}
    out: Dict[int, int] = {}
    for item in str(spec).split(","):
        item = item.strip()
        if not item:
            continue
        try:
            b, k = item.split(":")
            out[int(b)] = int(k)
        except ValueError:
            raise ValueError(f"static schedule entries are block:count, got {item!r} in {spec!r}") from None
    return out


def _check(model: nn.Module, schedule: Schedule, min_keep: int = 1) -> List[int]:
    depth, n = len(model.blocks), model.patch_embed.num_patches
    ks = [0] * depth
    for b, k in schedule.items():
        if not 0 <= b < depth:
            raise ValueError(f"static schedule names block {b}; the model has blocks 0..{depth - 1}")
        if k < 0:
            raise ValueError(f"static schedule removes a negative count at block {b}")
        ks[b] = k
    for b, k in enumerate(ks):
        if n - k < min_keep:
            raise ValueError(f"static schedule removes {k} of {n} visual tokens at block {b}; keep at least {min_keep}")
        n -= k
    return ks


def static_gflops(model: nn.Module, schedule: Schedule, rule: str = "cls_sim", skip_dead: bool = False) -> float:
    """GFLOPs per image (the same for every image) of :func:`static_forward`."""
    cost = backbone_cost(model)
    p, n = cost.num_prefix, cost.num_patches
    macs = float(cost.patch_macs + cost.head_macs)
    ks = _check(model, schedule)
    for l, k in enumerate(ks):
        n_mlp = p if skip_dead and l == len(ks) - 1 else n + p - k
        macs += float(cost.block_macs(l, torch.tensor([n + p]), torch.tensor([n_mlp])))
        if k and rule == "cls_sim":
            macs += n * cost.attn_dim[l]  # cosine of every visual key with the CLS key
        n -= k
    return 2 * macs / 1e9


def static_forward(model: nn.Module, x: torch.Tensor, schedule: Schedule, rule: str = "cls_sim",
                   skip_dead: bool = False) -> torch.Tensor:
    """Logits of ``model`` (not wrapped) with ``schedule[l]`` visual tokens removed after block ``l``'s
    attention residual, chosen by ``rule`` (see the module docstring); ``skip_dead``: the last
    block's MLP on the prefix tokens only."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    ks = _check(model, schedule)
    p = model.num_prefix_tokens
    x = embed(model, x)
    for blk, k in zip(model.blocks, ks):
        x, keys = attention_with_keys(blk, x)
        if k:
            n = x.shape[1]
            keep = n - p - k
            if rule == "slice":
                x = x[:, : p + keep]
            else:
                kf = keys.transpose(1, 2).reshape(x.shape[0], n, -1).float()  # heads concatenated
                kf = kf / kf.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                sim = (kf[:, p:] @ kf[:, :1].transpose(1, 2)).squeeze(-1)  # [B, N_l]: the counted matvec
                idx = sim.topk(keep, dim=1, sorted=False).indices.sort(dim=1).values + p
                x = torch.cat([x[:, :p], x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))], dim=1)
        if skip_dead and blk is model.blocks[-1]:
            x = x[:, :p]
        x = mlp_residual(blk, x)
    return head(model, x)


def schedule_for_reduction(model: nn.Module, target: float, blocks: Sequence[int], min_keep: int = 4) -> Dict[int, int]:
    """Equal removal counts at ``blocks`` whose GFLOPs reduction (slice rule) is closest to ``target``
    (a fraction of the native GFLOPs, e.g. ``0.3``)."""
    cost = backbone_cost(model)
    native = 2 * cost.native_macs() / 1e9
    n0 = cost.num_patches
    best = None
    for k in range(0, n0 + 1):
        n, sched = n0, {}
        for b in sorted(blocks):
            kk = min(k, n - min_keep)
            if kk > 0:
                sched[b] = kk
                n -= kk
        red = 1 - static_gflops(model, sched, "slice") / native
        if best is None or abs(red - target) < abs(best[0] - target):
            best = (red, sched)
    return best[1]


@dataclass
class StaticPrune:
    """A static schedule as a callable: ``StaticPrune(model, {3: 40, 6: 40}, "cls_sim")(images)``."""

    model: nn.Module
    schedule: Dict[int, int]
    rule: str = "cls_sim"
    skip_dead: bool = False

    def __post_init__(self):
        check_supported(self.model)
        check_skip_dead(self.model, "model", self.skip_dead, False)
        self.schedule = parse_schedule(self.schedule)
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.rule == "cls_sim" and getattr(self.model, "cls_token", None) is None:
            raise ValueError("rule 'cls_sim' ranks tokens by similarity to the CLS key; this model has no class token "
                             "(use rule 'slice')")
        self.gflops = static_gflops(self.model, self.schedule, self.rule, self.skip_dead)

    @property
    def name(self) -> str:
        spec = ",".join(f"{b}:{k}" for b, k in sorted(self.schedule.items()))
        return f"static-{self.rule}({spec})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return static_forward(self.model, x, self.schedule, self.rule, self.skip_dead)
