"""The training-only privileged critic (paper Sec. 3.5, App. D.1).

At block ``l`` the critic reads the pre-action residual tokens ``H_l`` (CLS and surviving visual
tokens, width ``d``), the Native logits ``z^N`` of the same image and the scalar state ``q_l``:

- ``phi^N = [p^N_(1), m^N, H(p^N), 1[m^N <= tau_b]]`` with ``p^N = softmax(z^N)`` (no temperature),
  ``m^N = p^N_(1) - p^N_(2)`` and ``tau_b`` a fixed backbone-specific low-margin threshold;
- ``q_l = [N_l/N0, l/(L-1), C_<l, E_<l/(L-1), D_{l-1}, phi^N, a_u/300]`` (Eq. app-critic-scalars):
  5 + 4 + 1 = **10** numbers.

Architecture (App. D.1): the token branch projects ``H_l`` to width 256, adds a learned block
embedding (``L x 256``) and a CLS/visual-type embedding (``2 x 256``), prepends a learned value
token and runs two pre-LN Transformer blocks (width 256, 4 heads, FFN 512, GELU). The value-token
output (256) is concatenated with separate 64-d linear projections of ``q_l`` and ``z^N`` into
``u_l`` (384). ``V^G`` and ``V^B`` are independent ``384 -> 128 -> 1`` MLPs on ``u_l``; ``V^S`` is a
``417 -> 128 -> 1`` MLP on ``[u_l; e(k_l); k_l/N_l]`` with ``e`` a learned 32-d embedding of the
budget's grid index. ``V^G``/``V^B`` never see ``k_l``; no head sees selected tokens, post-action
states or labels.

Choices where the paper is silent (ours):

- Variable-length sequences are attended **without padding**: the value token is inserted at the
  start of each sequence of a :class:`~timm_dora.engine.packing.Packed` batch and attention runs through
  :func:`~timm_dora.engine.attention.varlen_attention` (the ``sdpa_loop`` reference path on CPU/fp32;
  flash/varlen kernels on CUDA half precision). No mask, so padding can never leak.
- Prefix tokens other than CLS (registers, distillation token; absent from the paper's
  backbones) get the CLS-type embedding; patch tokens get the visual-type embedding.
- A final LayerNorm is applied to the value-token output (standard for pre-LN stacks, whose
  residual stream is otherwise unnormalised); ``final_norm=False`` drops it.
- Head MLPs use GELU (the activation of the critic's own FFN); the entropy in ``phi^N`` uses the
  natural logarithm; ``l/(L-1)`` and ``E_<l/(L-1)`` use ``max(L-1, 1)`` (as the actor's history).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from ..engine.attention import select_backend
from ..engine.packing import Packed, lookup
from ..policy.encoder import PackedTransformerBlock
from ..policy.actor import budget_grid
from .rewards import compression_before

__all__ = [
    "SCALAR_DIM",
    "NATIVE_FEATURE_DIM",
    "A_MAX",
    "Critic",
    "CriticOutput",
    "native_features",
    "scalar_state",
    "trajectory_scalar_states",
]

NATIVE_FEATURE_DIM = 4  # phi^N
SCALAR_DIM = 5 + NATIVE_FEATURE_DIM + 1  # q_l, Eq. app-critic-scalars
A_MAX = 300.0  # upper bound of the fidelity coefficient; q_l carries a_u / 300

Scalar = Union[float, int, torch.Tensor]


def native_features(z_native: torch.Tensor, tau_b: float) -> torch.Tensor:
    """``phi^N = [p_(1), m, H(p), 1[m <= tau_b]]`` of ``p = softmax(z^N)`` (App. D.1), ``[B, 4]`` float32.

    ``p_(1)``, ``p_(2)``: the two largest Native probabilities; ``m = p_(1) - p_(2)``; ``H`` the
    entropy in nats; ``tau_b`` the backbone's fixed low-margin threshold.
    """
    if z_native.dim() != 2 or z_native.shape[1] < 2:
        raise ValueError(f"z_native must be [B, C] with C >= 2, got {tuple(z_native.shape)}")
    dtype = torch.float64 if z_native.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(z_native.to(dtype), dim=-1)
    p = logp.exp()
    top2 = p.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    low = (margin <= tau_b).to(dtype)
    return torch.stack([top2[:, 0], margin, entropy, low], dim=-1).float()


def _column(value: Scalar, batch: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    return t.expand(batch) if t.dim() == 0 else t.float()


def scalar_state(
    n_visual: torch.Tensor,
    block: Scalar,
    depth: int,
    num_patches: int,
    c_before: torch.Tensor,
    interventions: torch.Tensor,
    d_prev: torch.Tensor,
    phi_native: torch.Tensor,
    a_u: Scalar,
) -> torch.Tensor:
    """``q_l = [N_l/N0, l/(L-1), C_<l, E_<l/(L-1), D_{l-1}, phi^N, a_u/300]`` (Eq. app-critic-scalars).

    Args (``[B]`` per image unless noted): ``n_visual`` ``N_l``; ``block`` ``l`` (int or ``[B]``);
    ``c_before`` ``C_<l``; ``interventions`` ``E_<l`` (earlier gate-on steps); ``d_prev``
    ``D_{l-1}`` (0 at ``l = 0``); ``phi_native`` ``[B, 4]`` from :func:`native_features`;
    ``a_u`` the update's fidelity coefficient (scalar or ``[B]``). Returns ``[B, 10]`` float32.
    """
    b, dev = n_visual.shape[0], n_visual.device
    denom = float(max(depth - 1, 1))
    cols = [
        n_visual.float() / num_patches,
        _column(block, b, dev) / denom,
        c_before.float(),
        interventions.float() / denom,
        d_prev.float(),
    ]
    if phi_native.shape != (b, NATIVE_FEATURE_DIM):
        raise ValueError(f"phi_native must be [B={b}, {NATIVE_FEATURE_DIM}], got {tuple(phi_native.shape)}")
    q = torch.cat([torch.stack(cols, -1), phi_native.float(), (_column(a_u, b, dev) / A_MAX)[:, None]], dim=-1)
    return q


def trajectory_scalar_states(
    k: torch.Tensor, d: torch.Tensor, phi_native: torch.Tensor, a_u: Scalar, num_patches: int
) -> torch.Tensor:
    """``q_l`` for every block of whole rollouts: ``[B, L, 10]``.

    ``k``: ``[B, L]`` removal counts (0 at gate-off steps); ``d``: ``[B, L]`` fidelity costs with
    gate-off steps carried forward (:func:`timm_dora.train.rewards.fill_gate_off`); ``phi_native``:
    ``[B, 4]``. Derives ``N_l = N0 - sum_{j<l} k_j`` (Eq. app-reward-counts), ``C_<l``,
    ``E_<l = #{j < l : k_j > 0}`` and ``D_{l-1}`` (``D_{-1} = 0``).
    """
    if k.shape != d.shape or k.dim() != 2:
        raise ValueError(f"k and d must both be [B, L], got {tuple(k.shape)} and {tuple(d.shape)}")
    b, depth = k.shape
    kf = k.to(torch.float64)
    n_visual = num_patches - (torch.cumsum(kf, 1) - kf)
    on = (k > 0).to(torch.float64)
    interventions = torch.cumsum(on, 1) - on
    c_before = compression_before(k, num_patches, torch.float64)
    d_prev = torch.cat([torch.zeros_like(d[:, :1]), d[:, :-1]], dim=1)
    a = torch.as_tensor(a_u, dtype=torch.float32, device=k.device)
    steps = [
        scalar_state(
            n_visual[:, l], l, depth, num_patches, c_before[:, l], interventions[:, l], d_prev[:, l],
            phi_native, a,
        )
        for l in range(depth)
    ]
    return torch.stack(steps, dim=1)


def _mlp(inp: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.GELU(), nn.Linear(hidden, 1))


@dataclass
class CriticOutput:
    """Values per sequence (``[S]``): ``gate`` ``V^G``, ``budget`` ``V^B``, ``selector`` ``V^S``
    (``None`` when no budget was given), and the shared representation ``u`` (``[S, 384]``)."""

    gate: torch.Tensor
    budget: torch.Tensor
    selector: Optional[torch.Tensor]
    u: torch.Tensor


class Critic(nn.Module):
    """Privileged critic of App. D.1 for one backbone.

    Args:
        embed_dim: residual width ``d`` of the backbone (``H_l`` rows).
        depth: ``L`` (size of the block embedding).
        num_budgets: ``M``, size of the budget grid (rows of ``e(k)``).
        num_classes: logit width of ``z^N`` (1000 for ImageNet-1K).
        width, num_heads, ffn_dim, num_layers: token branch (256, 4, 512, 2).
        proj_dim: width of each of the ``q_l`` and ``z^N`` projections (64).
        head_hidden: hidden width of the value MLPs (128).
        budget_embed_dim: ``e(k)`` width (32).
        final_norm: LayerNorm on the value-token output (our choice, see module docstring).
        backend: attention backend for :func:`~timm_dora.engine.attention.varlen_attention` (``"auto"``:
            :func:`~timm_dora.engine.attention.select_backend` for the input's device and dtype).
    """

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_budgets: int,
        num_classes: int = 1000,
        *,
        width: int = 256,
        num_heads: int = 4,
        ffn_dim: int = 512,
        num_layers: int = 2,
        proj_dim: int = 64,
        head_hidden: int = 128,
        budget_embed_dim: int = 32,
        final_norm: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.embed_dim, self.depth, self.num_budgets, self.num_classes = embed_dim, depth, num_budgets, num_classes
        self.width, self.proj_dim, self.backend = width, proj_dim, backend
        self.token_proj = nn.Linear(embed_dim, width)
        self.block_embed = nn.Parameter(torch.zeros(depth, width))
        self.type_embed = nn.Parameter(torch.zeros(2, width))  # 0: CLS (prefix), 1: visual
        self.value_token = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList(PackedTransformerBlock(width, num_heads, ffn_dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width) if final_norm else nn.Identity()
        self.scalar_proj = nn.Linear(SCALAR_DIM, proj_dim)
        self.logit_proj = nn.Linear(num_classes, proj_dim)
        self.u_dim = width + 2 * proj_dim  # 384
        self.gate_head = _mlp(self.u_dim, head_hidden)
        self.budget_head = _mlp(self.u_dim, head_hidden)
        self.budget_embed = nn.Embedding(num_budgets, budget_embed_dim)
        self.selector_head = _mlp(self.u_dim + budget_embed_dim + 1, head_hidden)  # 417
        for p in (self.block_embed, self.type_embed, self.value_token):
            nn.init.trunc_normal_(p, std=0.02)
        nn.init.trunc_normal_(self.budget_embed.weight, std=0.02)

    @classmethod
    def for_model(cls, model: nn.Module, budget_step: int = 2, min_keep: int = 4, **kwargs) -> "Critic":
        """A fresh critic sized for a timm ViT (``d``, ``L``, the budget grid of ``N0``, classes)."""
        n0 = model.patch_embed.num_patches
        return cls(
            model.embed_dim, len(model.blocks), int(budget_grid(n0, budget_step, min_keep).numel()),
            model.num_classes, **kwargs,
        )

    # ---------------------------------------------------------------------------------------
    def encode(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        block: Union[int, torch.Tensor],
        q: torch.Tensor,
        z_native: torch.Tensor,
        num_prefix: int = 1,
        device_lengths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``u_l`` (``[S, 384]``) for ``S`` packed sequences.

        Args:
            tokens: ``[T, d]`` rows of ``H_l`` for all sequences back to back; each sequence is
                its prefix tokens (CLS first) then its surviving visual tokens, in order.
            lengths: ``S`` host ints, rows per sequence (prefix included).
            block: ``l`` per sequence (int or ``[S]`` long); sequences may come from different
                blocks. An index outside ``[0, L)`` raises ``ValueError`` for an int; for a tensor it
                fails an asynchronous device assertion (``RuntimeError``; no host synchronisation).
            q: ``[S, 10]`` scalar states; ``z_native``: ``[S, num_classes]`` Native logits.
            num_prefix: leading prefix tokens of each sequence (type CLS).
            device_lengths: ``lengths`` as an int64 tensor on ``tokens``' device when the caller
                has it (saves a host-to-device copy, which waits for the device).
        """
        lengths = [int(n) for n in lengths]
        s, dev = len(lengths), tokens.device
        if sum(lengths) != tokens.shape[0] or min(lengths, default=1) < 1:
            raise ValueError(f"lengths {lengths} do not partition {tokens.shape[0]} token rows")
        self._check_per_sequence(s, q, z_native)
        range_msg = f"block index out of range [0, {self.depth})"
        if isinstance(block, torch.Tensor):
            torch._assert_async(((block >= 0) & (block < self.depth)).all(), range_msg)
        elif not 0 <= block < self.depth:
            raise ValueError(range_msg)
        dtype = self.token_proj.weight.dtype
        n = torch.tensor(lengths, dtype=torch.long, device=dev) if device_lengths is None else device_lengths
        layout = Packed(tokens, n, lengths, num_prefix)
        seg, pos = layout.seg, layout.pos
        blk = torch.as_tensor(block, dtype=torch.long, device=dev).expand(s)
        x = self.token_proj(tokens.to(dtype))
        x = x + lookup(self.block_embed, blk[seg]) + lookup(self.type_embed, (pos >= num_prefix).long())
        # prepend the value token: sequence i occupies rows starts[i] + i .. starts[i] + i + n_i
        seq = x.new_zeros(tokens.shape[0] + s, self.width)
        packed = Packed(seq, n + 1, [m + 1 for m in lengths], num_prefix=1)
        value_rows = packed.starts
        seq = seq.index_copy(0, layout.seg + torch.arange(tokens.shape[0], device=dev) + 1, x)
        seq = seq.index_copy(0, value_rows, self.value_token.expand(s, -1))
        packed = packed.with_x(seq)
        backend = select_backend(dev.type, dtype, self.backend)
        for blk_mod in self.blocks:
            seq = blk_mod(seq, packed, backend)
        return self._u(self.norm(seq[value_rows]), q, z_native)

    def encode_padded(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        block: torch.Tensor,
        q: torch.Tensor,
        z_native: torch.Tensor,
        num_prefix: int = 1,
    ) -> torch.Tensor:
        """:meth:`encode` on a padded batch: ``tokens`` ``[S, N, d]``, sequence ``i`` in rows
        ``0..lengths[i]-1`` (prefix first), padding after; ``lengths`` ``[S]`` int64 and ``block``
        ``[S]`` on the tokens' device. The same ``u_l`` up to float rounding (padded keys are
        masked out of attention); every shape is fixed by ``S`` and ``N``, so PPO minibatches need
        no host reads. The last block computes only the value token's row, the one row read
        (:meth:`~timm_dora.policy.encoder.PackedTransformerBlock.forward_padded_first`). Returns ``[S, 384]``."""
        s, n, _ = tokens.shape
        self._check_per_sequence(s, q, z_native)
        torch._assert_async(((block >= 0) & (block < self.depth)).all(), f"block index out of range [0, {self.depth})")
        dtype, dev = self.token_proj.weight.dtype, tokens.device
        pos = torch.arange(n, device=dev)
        x = self.token_proj(tokens.to(dtype))
        x = x + lookup(self.block_embed, block)[:, None] + lookup(self.type_embed, (pos >= num_prefix).long())[None]
        seq = torch.cat([self.value_token.to(dtype).expand(s, 1, -1), x], dim=1)  # the value token first
        valid = torch.arange(n + 1, device=dev)[None, :] <= lengths[:, None]  # value token + the sequence
        for blk_mod in self.blocks[:-1]:
            seq = blk_mod.forward_padded(seq, valid)
        return self._u(self.norm(self.blocks[-1].forward_padded_first(seq, valid)), q, z_native)  # only the value token is read

    def _check_per_sequence(self, s: int, q: torch.Tensor, z_native: torch.Tensor) -> None:
        if q.shape != (s, SCALAR_DIM):
            raise ValueError(f"q must be [S={s}, {SCALAR_DIM}], got {tuple(q.shape)}")
        if z_native.shape != (s, self.num_classes):
            raise ValueError(f"z_native must be [S={s}, {self.num_classes}], got {tuple(z_native.shape)}")

    def _u(self, value: torch.Tensor, q: torch.Tensor, z_native: torch.Tensor) -> torch.Tensor:
        """``u_l = [value-token output; W_q q_l; W_z z^N]`` (``[S, 384]``)."""
        dtype = self.token_proj.weight.dtype
        return torch.cat([value, self.scalar_proj(q.to(dtype)), self.logit_proj(z_native.to(dtype))], dim=-1)

    def gate_value(self, u: torch.Tensor) -> torch.Tensor:
        """``V^G_l`` (``[S]``): does not depend on the budget."""
        return self.gate_head(u).squeeze(-1)

    def budget_value(self, u: torch.Tensor) -> torch.Tensor:
        """``V^B_l`` (``[S]``): does not depend on the budget."""
        return self.budget_head(u).squeeze(-1)

    def selector_value(self, u: torch.Tensor, budget_index: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
        """``V^S_l = f_S([u; e(k_l); k_l/N_l])`` (``[S]``); ``budget_index`` is ``k_l``'s grid index,
        ``fraction`` is ``k_l / N_l``."""
        e = self.budget_embed(budget_index.long())
        return self.selector_head(torch.cat([u, e.to(u.dtype), fraction.to(u.dtype)[:, None]], dim=-1)).squeeze(-1)

    def forward(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        block: Union[int, torch.Tensor],
        q: torch.Tensor,
        z_native: torch.Tensor,
        budget_index: Optional[torch.Tensor] = None,
        fraction: Optional[torch.Tensor] = None,
        num_prefix: int = 1,
    ) -> CriticOutput:
        """All three values; ``V^S`` only when ``budget_index`` and ``fraction`` are given
        (gate-on transitions). See :meth:`encode` for the inputs."""
        u = self.encode(tokens, lengths, block, q, z_native, num_prefix)
        sel = None
        if budget_index is not None:
            if fraction is None:
                raise ValueError("selector value needs both budget_index and fraction (k_l / N_l)")
            sel = self.selector_value(u, budget_index, fraction)
        return CriticOutput(self.gate_value(u), self.budget_value(u), sel, u)
