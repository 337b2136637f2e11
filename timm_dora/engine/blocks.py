"""One block of the DORA forward, composed from the timm model's own submodules.

Nothing of timm's forward is copied: the embedding is ``norm_pre(patch_drop(_pos_embed(
patch_embed(x))))``, a block is ``norm1``, ``attn.qkv``, ``attn.q_norm``/``k_norm``, attention,
``attn.norm``, ``attn.proj``, ``ls1``, ``drop_path1`` (the attention residual), then ``norm2``,
``mlp``, ``ls2``, ``drop_path2`` (the MLP residual), and the readout is the model's final ``norm``
and head (``forward_head`` for the CLS token, else the model's pooling over surviving tokens).
On CUDA in half precision the LayerNorms and the patch embedding run faster kernels with the
modules' own parameters (:mod:`~timm_dora.engine.dense_kernels`), and optionally the MLP's first
layer with its GELU (:mod:`~timm_dora.engine.mlp_kernel`).
The functions work on packed rows (:class:`~timm_dora.engine.packing.Packed`): dense
``[B, S, d]`` while every image has all its tokens, ragged after a deletion. Both executors (the
eager forward in :mod:`~timm_dora.engine.patch` and the CUDA graphs in
:mod:`~timm_dora.engine.graphs`) run exactly these functions.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dense_kernels import add_layer_norm, layer_norm, patch_embed, position_tokens
from .attention import varlen_attention
from .mlp_kernel import mlp_forward
from .packing import Packed, bucket_rows, rows_where

__all__ = ["embed", "attention_keys", "attention_residual", "mlp_residual", "final_norm", "readout"]


def embed(model: nn.Module, images: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's own token embedding: ``norm_pre(patch_drop(_pos_embed(patch_embed(x))))``;
    ``out``: written there (any shape of as many elements) and returned, by one kernel where
    :func:`~timm_dora.engine.dense_kernels.position_tokens` applies."""
    patches = patch_embed(model.patch_embed, images)
    if out is not None and position_tokens(model, patches, out):
        return out
    x = model.norm_pre(model.patch_drop(model._pos_embed(patches)))
    if out is None:
        return x
    out.copy_(x.reshape(out.shape))
    return out


def _dense(packed: Packed) -> bool:
    """The dense ``[B, H, S, hd]`` layout and timm's fused attention: a uniform batch of unmerged rows
    (merged rows attend with their sizes, :func:`~timm_dora.engine.attention.varlen_attention`)."""
    return packed.uniform and getattr(packed, "sizes", None) is None


def _qk_v(attn: nn.Module, y: torch.Tensor, packed: Packed):
    """``(q, k, v)`` after ``q_norm``/``k_norm``: dense ``[B, H, S, hd]`` views on a uniform
    batch (as timm's Attention), else ``[T, H, hd]``."""
    qkv = bucket_rows(attn.qkv, y)
    if _dense(packed):  # no per-tensor view ops
        q, k, v = qkv.view(packed.batch_size, packed.max_len, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q, k, v = qkv.view(packed.total, 3, attn.num_heads, attn.head_dim).unbind(1)
    return attn.q_norm(q), attn.k_norm(k), v


def _keys_rows(k: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Keys as ``[T, d]`` rows (heads concatenated) from :func:`_qk_v`'s layout."""
    return (k.transpose(1, 2) if _dense(packed) else k).reshape(packed.total, -1)


def attention_keys(blk: nn.Module, packed: Packed) -> torch.Tensor:
    """The keys ``[T, d]`` that :func:`attention_residual` returns, recomputed from the block input
    (``norm1``, ``qkv``, ``k_norm``: the same operations, so the same values)."""
    _, k, _ = _qk_v(blk.attn, layer_norm(blk.norm1, packed.x), packed)
    return _keys_rows(k, packed)


def attention_residual(blk: nn.Module, packed: Packed, backend: str, out: Optional[torch.Tensor] = None,
                       attend: Optional[Callable] = None, on_keys: Optional[Callable[[torch.Tensor], None]] = None,
                       keys: bool = True, normed: Optional[torch.Tensor] = None,
                       norm_into: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x + drop_path1(ls1(attn(norm1(x))))`` on packed rows; also returns the keys ``[T, d]``
    (``None`` when ``keys`` is false: on a uniform batch they are a transposed copy).
    ``out``: write the result there (a fixed buffer of a CUDA graph). ``attend``: ``(q, k, v) ->
    o`` (``[T, H, hd]``) instead of :func:`varlen_attention` on a non-uniform batch (the graphs'
    padded rows). ``on_keys``: called with the keys as soon as they exist (before the attention
    itself; ``[B, H, S, hd]`` on a uniform batch, else ``[T, H, hd]``): the CUDA graphs fork the
    actor's gate there, so that it runs beside the attention kernel. ``normed``: ``norm1(x)``,
    already computed (:func:`mlp_residual`'s ``norm_into``); ``norm_into``: also write ``norm2``
    of the result there, with the residual sum in one kernel (:func:`~timm_dora.engine.dense_kernels.add_layer_norm`;
    ``out`` required)."""
    attn = blk.attn
    t = packed.total
    y = layer_norm(blk.norm1, packed.x) if normed is None else normed
    q, k, v = _qk_v(attn, y, packed)
    if on_keys is not None:
        on_keys(k)
    if _dense(packed):
        o = F.scaled_dot_product_attention(q, k, v, scale=attn.scale).transpose(1, 2).reshape(t, -1)
    else:
        o = (varlen_attention(q, k, v, packed, attn.scale, backend) if attend is None else attend(q, k, v)).reshape(t, -1)
    o = attn.norm(o)
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(y).sigmoid()
    o = attn.proj_drop(bucket_rows(attn.proj, o))
    branch = blk.drop_path1(blk.ls1(o))
    if norm_into is not None:
        add_layer_norm(packed.x, branch, blk.norm2, out, norm_into)
    else:
        out = torch.add(packed.x, branch, out=out)
    return out, _keys_rows(k, packed) if keys else None


def mlp_residual(blk: nn.Module, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                 normed: Optional[torch.Tensor] = None, next_norm: Optional[nn.Module] = None,
                 norm_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x + drop_path2(ls2(mlp(norm2(x))))`` on packed rows (into ``out`` when given).
    ``normed``: ``norm2(x)``, already computed (:func:`attention_residual`'s ``norm_into``);
    ``next_norm``, ``norm_into``: also write ``next_norm`` of the result (the next block's
    ``norm1``) into ``norm_into``, with the residual sum in one kernel (``out`` required)."""
    branch = blk.drop_path2(blk.ls2(bucket_rows(partial(mlp_forward, blk.mlp),
                                                layer_norm(blk.norm2, x) if normed is None else normed)))
    if next_norm is not None:
        add_layer_norm(x, branch, next_norm, out, norm_into)
        return out
    return torch.add(x, branch, out=out)


def final_norm(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's final ``norm`` of rows ``x``."""
    return layer_norm(model.norm, x)


def _segment_pool(packed: Packed, pool: str, include_prefix: bool) -> torch.Tensor:
    x = packed.x
    b, p = packed.batch_size, packed.num_prefix
    if include_prefix:
        rows, counts = None, packed.lengths
    else:
        rows = rows_where(packed.pos >= p, packed.total - b * p)
        counts = packed.lengths - p
    seg = packed.seg if rows is None else packed.seg[rows]
    xs = x if rows is None else x[rows]
    out = {}
    if pool in ("avg", "avgmax"):
        total = torch.zeros(b, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, seg, xs.float())
        out["avg"] = (total / counts[:, None]).to(x.dtype)
    if pool in ("max", "avgmax"):
        init = torch.full((b, x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device)
        out["max"] = init.scatter_reduce(0, seg[:, None].expand_as(xs), xs, reduce="amax")
    if pool == "avgmax":
        return 0.5 * (out["max"] + out["avg"])
    return out[pool]


def _attention_pool(model: nn.Module, packed: Packed) -> torch.Tensor:
    """timm's attention-pool (MAP) head, ``AttentionPoolLatent``, on each image's surviving tokens:
    its latent queries attend to their own image's tokens only (the others masked out of a padded
    batch); composed from the pool's own submodules (``latent``, ``q``, ``kv``, ``q_norm``,
    ``k_norm``, ``proj``, ``norm``, ``mlp``)."""
    pool = model.attn_pool
    p, b = packed.num_prefix, packed.batch_size
    if p and not getattr(model, "pool_include_prefix", False):  # (timm's pool drops the prefix tokens)
        rows = rows_where(packed.pos >= p, packed.total - b * p)
        packed = Packed(packed.x[rows], packed.lengths - p, [n - p for n in packed.lengths_host], 0)
    n = packed.max_len
    x = packed.padded(n)
    heads, embed = pool.num_heads, pool.kv.out_features // 2
    latent = pool.latent.shape[1]
    q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, latent, heads, embed // heads).transpose(1, 2)
    k, v = pool.kv(x).reshape(b, n, 2, heads, embed // heads).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = pool.q_norm(q), pool.k_norm(k)
    padding = torch.arange(n, device=x.device)[None, :] >= packed.lengths[:, None]
    mask = torch.zeros(b, 1, 1, n, dtype=q.dtype, device=x.device).masked_fill(padding[:, None, None], float("-inf"))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=pool.scale)
    o = pool.proj_drop(pool.proj(o.transpose(1, 2).reshape(b, latent, embed)))
    if getattr(pool, "mlp", None) is not None:
        o = o + pool.mlp(pool.norm(o))
    if pool.pool == "token":
        return o[:, 0]
    return o.mean(1) if pool.pool == "avg" else o


def readout(model: nn.Module, packed: Packed, mode: str) -> torch.Tensor:
    """Logits from the final-normed packed tokens, as the model's own head would compute them."""
    if getattr(model, "attn_pool", None) is not None:
        return model.head(model.head_drop(model.fc_norm(_attention_pool(model, packed))))
    if mode == "lc1":
        cls = packed.x[packed.starts]
        feats = torch.cat([cls, _segment_pool(packed, "avg", include_prefix=False)], dim=-1)
        return model.head(model.head_drop(feats))
    if model.global_pool == "token":
        # timm's own head on the prefix rows: CLS (and the distillation token for DeiT-distilled)
        return model.forward_head(packed.prefix_rows())
    feats = _segment_pool(packed, model.global_pool, bool(getattr(model, "pool_include_prefix", False)))
    return model.head(model.head_drop(model.fc_norm(feats)))
