"""The DORA actor: gate, shared encoder, budget head and selector (paper Sec. 3.2, App. A).

One actor serves every block of a backbone (parameters shared, block-specific embeddings). At
block ``l`` it reads the block's attention keys ``K_l`` (heads concatenated, after any ``k_norm``)
of CLS and the surviving visual tokens, and the history ``h_l = [N_l/N0, rho_l, E_<l/(L-1)]``.

- Gate: ``(d+19) -> 64 -> 1`` MLP (SiLU, sigmoid) on ``[K_CLS; e^G_l; h_l]``.
- Shared encoder: ``X_j = W_in K_j + b_in + e^C_l + 1[j=CLS] W_h h_l``, then one pre-LN
  Transformer block (width 128, 4 heads, FFN 128 -> 256 -> 128 GELU) giving ``Z_l``.
- Budget head: ``LayerNorm -> 128 -> 128 -> M`` (GELU) on ``Z_CLS`` over the grid
  ``{2, 4, ..., N0-4}``; budgets leaving fewer than 4 visual tokens are masked before the softmax.
- Selector: ``128 -> 64 -> 1`` SiLU MLP on ``Z_j + W_k (k/N_l)``; higher score = remove first.

Beyond the paper (ours), for the backbones timm users pick today:

- **Models without a class token** (global average pooling, registers, MAP heads): the actor reads
  the *summary key*, the mean of the keys of all tokens entering the block, where the paper reads
  the CLS key (``summary="mean"``, chosen by :meth:`Actor.for_model` for such a model): the gate
  takes it in place of ``K_CLS``, and it leads each controller sequence in place of the CLS key
  (its encoder output feeds the budget head). Nothing else changes, and the paper's CLS form
  (``summary="cls"``) is untouched for models that have one.
- **Any input size**: the budget grid is kept as removal counts for the ``N0`` the actor was built
  for and read as fractions of it: at an input of ``N0'`` patches budget ``k`` removes
  ``round(k N0' / N0)`` tokens (:meth:`Actor.grid`, the same grid at ``N0' = N0``), and the history
  divides ``N_l`` by ``N0'``. So an actor trained at one resolution runs at another.

This module holds the networks and the distributions over their outputs (Bernoulli gate, masked
categorical budget, Plackett-Luce ordered selection). Turning them into per-block decisions on a
packed batch is :mod:`timm_dora.policy`; counting their FLOPs is :mod:`timm_dora.policy.actor_flops`.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.packing import Packed, bucket_rows, lookup
from .encoder import PackedTransformerBlock

__all__ = [
    "Actor",
    "encoder_sizes",
    "auto_width",
    "AUTO_WIDTH_BUDGET",
    "budget_grid",
    "to_padded",
    "ordered_topk",
    "gumbel_like",
    "plackett_luce_log_prob",
    "selector_entropy",
    "masked_categorical",
]


def budget_grid(num_patches: int, step: int = 2, min_keep: int = 4) -> torch.Tensor:
    """The removal-count grid ``{step, 2*step, ..., N0 - min_keep}`` (App. A.2).

    For ``N0 = 196`` this is ``{2, 4, ..., 192}`` (M = 96); for ``N0 = 256``, ``{2, ..., 252}``
    (M = 126).
    """
    if step < 1:
        raise ValueError(f"budget step must be a positive number of tokens, got {step}")
    if num_patches - min_keep < step:
        raise ValueError(
            f"num_patches={num_patches} leaves no legal budget: need at least min_keep + step = "
            f"{min_keep + step} visual tokens"
        )
    return torch.arange(step, num_patches - min_keep + 1, step, dtype=torch.long)


def encoder_sizes(width: int = 128) -> Dict[str, int]:
    """The per-token parts of the actor at encoder width ``width``: ``num_heads = width / 32`` (head
    dim 32), ``ffn_dim = 2 width``, ``selector_hidden = width / 2``. ``width=128`` is the paper's
    actor (4 heads, FFN 256, selector 64). Ours: the paper sizes the actor for DeiT-B, where it costs
    under 1 % of the backbone; on a Tiny backbone the same actor costs about 0.08 GFLOPs per
    intervention (3.4 % of ViT-Ti's forward each), and 64 costs a third of that, 32 an eighth. The
    gate and budget head run once per image and keep the paper's sizes."""
    if width not in (32, 64, 128, 256):
        raise ValueError(f"actor width must be one of 32, 64, 128 (the paper), 256, got {width}")
    return {"width": width, "num_heads": width // 32, "ffn_dim": 2 * width, "selector_hidden": width // 2}


# auto_width: the most one intervention of the actor's controller may cost, as a share of the
# backbone's forward (at the full token count). 1.5 % keeps the paper's width 128 for ViT-S (1.0 %)
# and DeiT-B (0.3 %) and gives 64 for Tiny backbones (1.1 %; 128 would cost 3.4 %), where width 64
# saved 30.7 % of DeiT-Ti's GFLOPs against 24.8 % for 128 at the same drop over three seeds each
# (docs/training_rounds.md, fourth round)
AUTO_WIDTH_BUDGET = 0.015


def auto_width(model: nn.Module, budget: float = AUTO_WIDTH_BUDGET) -> int:
    """The widest encoder width of 128 (the paper's), 64 and 32 at which one intervention of the
    controller on all ``N0`` visual tokens costs at most ``budget`` of ``model``'s forward (32 when
    none does). Ours: ``timm-dora-train`` picks it unless ``--actor-width`` is given."""
    from ..engine.flops import native_gflops
    from .actor_flops import actor_controller_macs

    with torch.device("meta"):  # sizes only: no memory, no initialisation
        actors = [(w, Actor.for_model(model, **encoder_sizes(w))) for w in (128, 64)]
    n0 = torch.tensor([model.patch_embed.num_patches])
    native = native_gflops(model) * 1e9
    for w, actor in actors:
        if 2.0 * float(actor_controller_macs(actor, n0)) <= budget * native:
            return w
    return 32


class Actor(nn.Module):
    """DORA's hierarchical actor for one backbone (``d``, ``L``, ``N0``).

    Args:
        embed_dim: backbone key width ``d`` (heads concatenated).
        depth: number of backbone blocks ``L``; every block is eligible.
        num_patches: initial visual-token count ``N0`` (CLS and other prefix tokens excluded).
        width, num_heads, ffn_dim: the shared encoder (128, 4, 256 in the paper).
        gate_hidden, gate_embed_dim: gate MLP hidden width (64) and gate block embedding (16).
        budget_hidden, selector_hidden: budget-head (128) and selector (64) hidden widths.
        budget_step, min_keep: budget grid ``{step, ..., N0 - min_keep}`` and the feasibility
            rule ``k <= N_l - min_keep`` (2 and 4 in the paper).
        summary: what stands for the CLS token: ``"cls"`` (the paper: its key) or ``"mean"`` (ours,
            for models without a class token: the mean key of the block's tokens).
        merge: (ours) the tokens it removes are merged into their most similar survivors rather
            than deleted: how it was trained and how :func:`timm_dora.wrap` runs it
            (``wrap(..., merge=True)``; :func:`~timm_dora.engine.packing.merge_removed`).
    """

    SUMMARIES = ("cls", "mean")

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_patches: int,
        *,
        width: int = 128,
        num_heads: int = 4,
        ffn_dim: int = 256,
        gate_hidden: int = 64,
        gate_embed_dim: int = 16,
        budget_hidden: int = 128,
        selector_hidden: int = 64,
        budget_step: int = 2,
        min_keep: int = 4,
        summary: str = "cls",
        merge: bool = False,
    ) -> None:
        super().__init__()
        self.merge = bool(merge)
        for name, value in (("embed_dim", embed_dim), ("depth", depth), ("num_patches", num_patches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if summary not in self.SUMMARIES:
            raise ValueError(f"summary must be one of {self.SUMMARIES}, got {summary!r}")
        self.summary = summary
        self.embed_dim, self.depth, self.num_patches = embed_dim, depth, num_patches
        self.width, self.num_heads, self.ffn_dim = width, num_heads, ffn_dim
        self.gate_hidden, self.gate_embed_dim = gate_hidden, gate_embed_dim
        self.budget_hidden, self.selector_hidden = budget_hidden, selector_hidden
        self.budget_step, self.min_keep = budget_step, min_keep
        self.register_buffer("budgets", budget_grid(num_patches, budget_step, min_keep), persistent=False)

        # gate: [K_CLS (d); e^G_l (16); h_l (3)] -> 64 -> 1
        self.gate_embed = nn.Parameter(torch.zeros(depth, gate_embed_dim))
        self.gate_mlp = nn.Sequential(
            nn.Linear(embed_dim + gate_embed_dim + 3, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, 1)
        )
        # shared encoder
        self.w_in = nn.Linear(embed_dim, width)
        self.block_embed = nn.Parameter(torch.zeros(depth, width))
        self.w_h = nn.Linear(3, width, bias=False)
        self.encoder = PackedTransformerBlock(width, num_heads, ffn_dim)
        # budget head
        self.budget_head = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, budget_hidden), nn.GELU(), nn.Linear(budget_hidden, self.num_budgets)
        )
        # selector
        self.w_k = nn.Linear(1, width, bias=False)
        self.selector = nn.Sequential(nn.Linear(width, selector_hidden), nn.SiLU(), nn.Linear(selector_hidden, 1))
        nn.init.trunc_normal_(self.gate_embed, std=0.02)
        nn.init.trunc_normal_(self.block_embed, std=0.02)

    # ---------------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model: nn.Module, **kwargs) -> "Actor":
        """A freshly initialised actor sized for a timm ViT (``d`` = key width, ``L``, ``N0``); it reads
        the CLS key, or the summary key where the model has no class token."""
        kwargs.setdefault("summary", "cls" if getattr(model, "cls_token", None) is not None else "mean")
        return cls(
            model.blocks[0].attn.qkv.out_features // 3,
            len(model.blocks),
            model.patch_embed.num_patches,
            **kwargs,
        )

    @property
    def num_budgets(self) -> int:
        """``M``, the budget head's output size."""
        return int(self.budgets.numel())

    def config(self) -> Dict[str, Union[int, str]]:
        """Constructor arguments: everything needed to rebuild this actor (``summary`` only where it
        is not the paper's CLS key and ``merge`` only where true, so a paper actor's config is the
        same as before they existed)."""
        keys = (
            "embed_dim", "depth", "num_patches", "width", "num_heads", "ffn_dim", "gate_hidden",
            "gate_embed_dim", "budget_hidden", "selector_hidden", "budget_step", "min_keep",
        )
        out: Dict[str, Union[int, str]] = {k: getattr(self, k) for k in keys}
        if self.summary != "cls":
            out["summary"] = self.summary
        if self.merge:
            out["merge"] = True
        return out

    def extra_repr(self) -> str:
        return f"d={self.embed_dim}, L={self.depth}, N0={self.num_patches}, M={self.num_budgets}, summary={self.summary}"

    # ---------------------------------------------------------------------------------------
    # observations
    def grid(self, num_patches: Optional[int] = None) -> torch.Tensor:
        """The removal counts of the budget head at an input of ``num_patches`` patches: the grid
        read as fractions of ``N0``, ``round(k N0' / N0)`` (at least 1; :attr:`budgets` itself
        at ``N0' = N0``, and for ``None``)."""
        if num_patches is None or num_patches == self.num_patches:
            return self.budgets
        return self._rescaled(self.budgets, num_patches).clamp_min(1)

    def _rescaled(self, k, num_patches: int):
        """``round(k N0' / N0)`` (halves up) for an int or a long tensor ``k``: the one rounding
        rule of :meth:`grid` and :meth:`smallest_budget`."""
        return (k * num_patches + self.num_patches // 2) // self.num_patches

    def history(self, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
                num_patches: Optional[int] = None) -> torch.Tensor:
        """``h_l = [N_l / N0, rho_l, E_<l / (L-1)]`` as ``[B, 3]`` float32 (Eq. app-actor-history);
        ``num_patches``: the input's ``N0`` (default the actor's)."""
        denom = max(self.depth - 1, 1)
        n0 = self.num_patches if num_patches is None else num_patches
        return torch.stack(
            [n_visual.float() / n0, rho.float(), interventions.float() / denom], dim=-1
        )

    def has_feasible_budget(self, n_visual: torch.Tensor, num_patches: Optional[int] = None) -> torch.Tensor:
        """``[B]`` bool: the feasible set ``B_l = {k in grid : k <= N_l - 4}`` is non-empty."""
        return n_visual - self.min_keep >= self.smallest_budget(num_patches)

    def smallest_budget(self, num_patches: Optional[int] = None) -> int:
        """The grid's smallest removal count at an input of ``num_patches`` patches."""
        if num_patches is None or num_patches == self.num_patches:
            return self.budget_step
        return max(1, self._rescaled(self.budget_step, num_patches))

    def feasible_budgets(self, n_visual: torch.Tensor, num_patches: Optional[int] = None) -> torch.Tensor:
        """``[A, M]`` bool mask of feasible budgets ``k <= N_l - min_keep``."""
        return self.grid(num_patches)[None, :] <= (n_visual[:, None] - self.min_keep)

    # ---------------------------------------------------------------------------------------
    # networks
    def gate_bias(self, h: torch.Tensor, block: Union[None, int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The gate's first layer on its context plus that layer's bias, ``W1_c [e^G_l; h_l] + b1``:
        ``[B, 64]``, or ``[L, B, 64]`` for every block when ``block`` is ``None``. The layer is
        linear, so ``W1 [K_CLS; e^G_l; h_l] + b1 = W1_K K_CLS + (W1_e e^G_l + b1) + W1_h h_l``:
        this part is made once per forward while the history does not change, only the CLS part
        per block. The block part is computed for every block and indexed, so the value for one
        block is the same whichever way it is asked for."""
        first, d, g = self.gate_mlp[0], self.embed_dim, self.gate_embed_dim
        w = first.weight.to(dtype)
        per_block = F.linear(self.gate_embed.to(dtype), w[:, d : d + g], first.bias.to(dtype))  # [L, 64]
        per_image = F.linear(h.to(dtype), w[:, d + g :])  # [B, 64]
        if block is None:
            return per_block[:, None] + per_image[None]
        if isinstance(block, torch.Tensor) and block.dim() == 1:  # one block per image (PPO minibatches)
            return lookup(per_block, block) + per_image
        return per_block[block] + per_image

    def gate_logit(self, cls_key: torch.Tensor, h: torch.Tensor, block: Union[int, torch.Tensor],
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Gate logit ``[B]``; ``p^G = sigmoid(logit)``. ``block``: one index, or ``[B]`` indices.
        ``bias``: :meth:`gate_bias` of ``h`` and ``block`` when already computed (the first
        layer then costs one ``addmm``)."""
        if bias is None:
            bias = self.gate_bias(h, block, cls_key.dtype)
        w = self.gate_mlp[0].weight[:, : self.embed_dim]
        hidden = torch.addmm(bias, cls_key, w.to(cls_key.dtype).t())
        return self.gate_mlp[2](self.gate_mlp[1](hidden)).squeeze(-1)

    def encode(self, keys: torch.Tensor, packed: Packed, h: torch.Tensor, block: Union[int, torch.Tensor], backend: str) -> torch.Tensor:
        """Shared encoder ``Z_l`` on packed controller sequences.

        ``keys``: ``[T, d]`` rows of ``packed`` (one sequence per gate-active image: its CLS key
        first, then its visual keys). ``h``: ``[A, 3]`` history per sequence. ``block``: one index,
        or ``[A]`` indices (sequences from different blocks, as in PPO minibatches). Returns
        ``[T, 128]``.
        """
        if isinstance(block, torch.Tensor) and block.dim() == 1:  # one block per sequence: per row
            emb = lookup(self.block_embed, block[packed.seg])
        else:
            emb = self.block_embed[block]
        x = bucket_rows(self.w_in, keys) + emb.to(keys.dtype)
        cls_rows = packed.starts
        x = x.index_add(0, cls_rows, self.w_h(h.to(keys.dtype)).to(x.dtype))  # autocast may make them differ
        return self.encoder(x, packed, backend)

    def encode_padded(self, keys: torch.Tensor, lengths: torch.Tensor, h: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` on a padded batch: ``keys`` ``[A, N, d]`` (sequence ``a`` in rows
        ``0..lengths[a]-1``, its CLS key first, padding after), ``lengths``, ``block`` ``[A]`` and ``h``
        ``[A, 3]`` on the keys' device. The same ``Z_l`` on the real rows up to float rounding (padded
        keys are masked out of attention); every shape is fixed by ``A`` and ``N``, so PPO minibatches
        need no host reads. Returns ``[A, N, 128]`` (padded rows meaningless)."""
        x = self.w_in(keys) + lookup(self.block_embed, block)[:, None].to(keys.dtype)
        cls = x[:, :1] + self.w_h(h.to(keys.dtype))[:, None].to(x.dtype)
        x = torch.cat([cls, x[:, 1:]], dim=1)
        valid = torch.arange(keys.shape[1], device=keys.device)[None, :] < lengths[:, None]
        return self.encoder.forward_padded(x, valid)

    def budget_logits(self, z_cls: torch.Tensor, n_visual: torch.Tensor, num_patches: Optional[int] = None) -> torch.Tensor:
        """``[A, M]`` float32 budget logits with infeasible budgets set to ``-inf`` (``num_patches``:
        the input's ``N0``, for the grid it reads)."""
        logits = self.budget_head(z_cls).float()
        return logits.masked_fill(~self.feasible_budgets(n_visual, num_patches), float("-inf"))

    def tilted(self, per_token: float) -> "Actor":
        """A copy of this actor whose budget head scores every budget ``k`` (a removal count on the
        actor's own grid) ``logit_k - per_token * k`` (ours; :mod:`timm_dora.evaluate.calibrate`).

        The deterministic budget moves toward fewer removed tokens for ``per_token > 0`` and more
        for ``< 0``; the sampled one is the policy's categorical tilted by ``exp(-per_token k)``.
        Gates, encoder and selector are unchanged. The tilt lives in the last layer's bias (in its
        dtype: a bf16 actor's tilted logits are rounded to bf16), so a tilted actor saves, loads and
        runs on every executor as any other."""
        out = copy.deepcopy(self)
        last = out.budget_head[-1]
        with torch.no_grad():
            last.bias.sub_(float(per_token) * out.budgets.to(last.bias.dtype))
        return out

    def selector_scores(self, z_visual: torch.Tensor, fraction: torch.Tensor, seg: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Removal scores ``s_j = MLP_S(Z_j + W_k k/N_l)`` (float32), ``W_k`` run once per image.

        ``fraction``: ``[A]`` removal fraction ``k/N_l`` per active image. Packed rows: ``z_visual``
        ``[Tv, 128]`` with ``seg`` ``[Tv]`` the image of each row; returns ``[Tv]``. Padded rows
        (``seg=None``): ``z_visual`` ``[A, N, 128]``; returns ``[A, N]``.
        """
        cond = self.w_k(fraction[:, None].to(z_visual.dtype))
        cond = cond[:, None] if seg is None else lookup(cond, seg)
        return bucket_rows(self.selector, z_visual + cond).squeeze(-1).float()


# --------------------------------------------------------------------------------------------
# distributions and ragged selection


def masked_categorical(logits: torch.Tensor, validate_args: Optional[bool] = None) -> torch.distributions.Categorical:
    """Categorical over budgets whose masked entries (``-inf``) have probability 0.

    ``validate_args`` as in ``torch.distributions`` (``False`` skips the checks, each a host
    synchronisation on an accelerator).
    """
    return torch.distributions.Categorical(logits=logits, validate_args=validate_args)


def to_padded(values: torch.Tensor, seg: torch.Tensor, col: torch.Tensor, rows: int, width: int, fill: float) -> torch.Tensor:
    """Scatter ragged ``values`` (row ``seg``, column ``col``) into a ``[rows, width]`` matrix."""
    out = values.new_full((rows, width), fill)
    out[seg, col] = values
    return out


def gumbel_like(scores: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Standard Gumbel noise with the shape of ``scores`` (float32)."""
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=torch.float32)
    return -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))


def ordered_topk(scores: torch.Tensor, k: torch.Tensor, noise: Optional[torch.Tensor] = None,
                 kmax: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ordered selection of ``k[a]`` columns per row of a padded score matrix.

    Without ``noise`` this is the deterministic rule (the ``k`` highest scores, ties to the lower
    index). With Gumbel ``noise`` it is an exact Plackett-Luce sample without replacement (the
    Gumbel-top-k construction). Padding must be ``-inf``.

    Returns ``(order, valid)``: ``order[a, t]`` is the column chosen ``t``-th (``[A, K]``),
    ``valid[a, t] = t < k[a]``. ``K`` is ``kmax`` when given (a host-side upper bound on ``k``,
    which saves a device-to-host read), else ``max k``.
    """
    if kmax is None:
        kmax = int(k.max()) if k.numel() else 0
    kmax = min(kmax, scores.shape[1])
    keyed = scores if noise is None else scores + noise
    order = torch.sort(keyed, dim=1, descending=True, stable=True).indices[:, :kmax]
    valid = torch.arange(kmax, device=scores.device)[None, :] < k[:, None]
    return order, valid


def plackett_luce_log_prob(scores: torch.Tensor, order: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Log-probability of ordered selections under Plackett-Luce (Eq. app-actor-pl).

    ``log pi = sum_t [ s_{i_t} - log sum_{j in R_t} exp(s_j) ]`` with ``R_t`` the tokens not
    chosen before step ``t``. ``scores``: ``[A, W]`` padded with ``-inf``; ``order``/``valid`` as
    returned by :func:`ordered_topk`. Returns ``[A]``. Computed stably as
    ``logsumexp(R_t) = logaddexp(logsumexp(unchosen), logsumexp(s_{i_t}, ..., s_{i_k}))``.
    """
    a, w = scores.shape
    if order.shape[1] == 0:
        return scores.new_zeros(a)
    chosen = torch.where(valid, scores.gather(1, order), torch.full_like(order, float("-inf"), dtype=scores.dtype))
    safe = torch.where(valid, order, torch.zeros_like(order))
    taken = torch.zeros((a, w), dtype=torch.long, device=scores.device).scatter_add_(1, safe, valid.long()) > 0
    lse_rest = torch.logsumexp(scores.masked_fill(taken, float("-inf")), dim=1)  # [A]
    suffix = torch.logcumsumexp(chosen.flip(1), dim=1).flip(1)  # lse(s_{i_t..i_k})
    denom = torch.logaddexp(lse_rest[:, None], suffix)
    terms = torch.where(valid, chosen - denom, torch.zeros_like(chosen))
    return terms.sum(1)


def selector_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy of the selector's first Plackett-Luce draw, ``H(softmax(s))`` per row (``[A]``).

    The entropy of the whole ordered selection has no closed form; the first-draw entropy is the
    regulariser used for the selector (it is zero only when the ranking's head is certain).
    """
    logp = torch.log_softmax(scores, dim=1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(1)
