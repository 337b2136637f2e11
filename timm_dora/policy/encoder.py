"""The pre-LN Transformer block on packed sequences that the actor's shared encoder and the critic's
token branch are made of (paper App. A, D.1)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.attention import varlen_attention
from ..engine.packing import Packed, bucket_rows

__all__ = ["PackedTransformerBlock"]


class PackedTransformerBlock(nn.Module):
    """Pre-LN Transformer block (attention + GELU FFN) on packed sequences, no padding.

    The actor's shared encoder (width 128, 4 heads, FFN 256) and the critic's token branch (width
    256, 4 heads, FFN 512) are made of it.
    """

    def __init__(self, width: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, width)

    def forward(self, x: torch.Tensor, packed: Packed, backend: str) -> torch.Tensor:
        t, w = x.shape
        hd = w // self.num_heads
        q, k, v = bucket_rows(self.qkv, self.norm1(x)).view(t, 3, self.num_heads, hd).unbind(1)
        x = x + bucket_rows(self.proj, varlen_attention(q, k, v, packed, hd ** -0.5, backend).reshape(t, w))
        return x + bucket_rows(self._ffn, self.norm2(x))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward_padded(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The same block on a padded batch ``x`` ``[S, N, w]``; ``valid`` ``[S, N]`` marks each
        sequence's real rows (a prefix of every row, at least one). Padded keys are masked out, so
        real rows get exactly the maths of :meth:`forward`; padded rows are computed and meaningless.
        Shapes do not depend on the lengths (PPO minibatches of fixed shape, no host reads)."""
        return self._padded(x, valid, x.shape[1])

    def forward_padded_first(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Row 0 of :meth:`forward_padded` (``[S, w]``) at the cost of row 0: keys and values come
        from every row, the query, attention output, projection and FFN only from row 0 (each row's
        output depends on the other rows through their keys and values alone). The critic's value
        token after its last block."""
        return self._padded(x, valid, 1)[:, 0]

    def _padded(self, x: torch.Tensor, valid: torch.Tensor, rows: int) -> torch.Tensor:
        """:meth:`forward_padded`'s output at the first ``rows`` rows."""
        s, n, w = x.shape
        hd = w // self.num_heads
        h = self.norm1(x)
        if rows == n:
            q, k, v = self.qkv(h).view(s, n, 3, self.num_heads, hd).permute(2, 0, 3, 1, 4)
        else:  # the query projection only where it is read
            q = F.linear(h[:, :rows], self.qkv.weight[:w], self.qkv.bias[:w]).view(s, rows, self.num_heads, hd).transpose(1, 2)
            k, v = F.linear(h, self.qkv.weight[w:], self.qkv.bias[w:]).view(s, n, 2, self.num_heads, hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=hd ** -0.5)
        x = x[:, :rows] + self.proj(o.transpose(1, 2).reshape(s, rows, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
