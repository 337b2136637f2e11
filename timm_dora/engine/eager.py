"""The eager executor: the block program run directly, module call by module call.

:func:`timm_dora.engine.patch.run` drives an executor block by block through one interface, the
same for this one and the captured one (:class:`~timm_dora.engine.graphs.GraphRunner`):

- ``start(images, run_ahead)``: embed the batch; then ``batch``, ``num_patches`` and ``backend``;
- ``block(l, n_visual, rho, interventions, consts) -> (decision, mlp_done)``: block ``l``'s
  attention residual (the rows and their layout as ``attended``) and the policy's decision;
- ``mlp(l, done)``: the MLP residual where nothing was removed (unless ``done``);
- ``delete(l, decision, history) -> rows``: the deletion and the survivors' MLP residual;
- ``leave_dense()``: a gate opened without a removal (the history changed);
- ``finish() -> (logits, None)`` or ``(None, rows)``: the readout, or the final rows for the
  caller's readout.

Here everything runs on the caller's stream as it comes: the only host reads are the policy's
own (its gate vector). With a speculating policy (``ActorPolicy(actor, speculate=True)``) the
policy enqueues its gate and an asynchronous copy of the gate vector to the host, the MLP of the
unpruned batch is enqueued, and only then does the host wait (for the gate copy, not the MLP):
that MLP is the block's output where nothing is removed, else it is discarded. With ``skip_dead``
the last block's MLP runs on the prefix rows only (the CLS-token readout reads nothing else). With
``merge`` each removed row is folded into its most similar survivor before the deletion
(:func:`~timm_dora.engine.packing.merge_removed`), which keeps the block's keys until then.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.profiler import record_function

from .blocks import attention_residual, embed, final_norm, mlp_residual
from .attention import select_backend
from .packing import Packed, delete_rows, merge_removed
from .protocol import BlockContext, Decision, ForwardConstants, Policy

__all__ = ["EagerExecutor", "scope"]


def scope(name: str):
    """A profiler scope, only while a profiler runs (each costs two dispatcher calls otherwise)."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class EagerExecutor:
    """One eager forward of a wrapped ``model`` with ``policy`` (see the module)."""

    def __init__(self, model: nn.Module, policy: Policy, attn_backend: str, skip_dead: bool, merge: bool = False):
        self.model, self.policy, self.attn_backend, self.skip_dead = model, policy, attn_backend, skip_dead
        self.merge = merge
        self.keys: Optional[torch.Tensor] = None  # (merge) the block's keys, until its deletion
        self.speculate = bool(getattr(policy, "speculate", False))
        self.depth = len(model.blocks)
        self.packed: Optional[Packed] = None  # the current rows
        self.attended: Optional[Packed] = None  # the attention residual's rows, until the MLP
        self.final: Optional[torch.Tensor] = None  # (skip_dead) the prefix rows after the last block
        self._speculative: Optional[torch.Tensor] = None  # the MLP of the unpruned rows, enqueued early

    def start(self, x: torch.Tensor, run_ahead: bool = True) -> None:
        p = self.model.num_prefix_tokens
        x = embed(self.model, x)
        self.batch, s, _ = x.shape
        self.num_patches = s - p
        dtype = x.dtype
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")  # attention inputs come out of autocast linears
        self.backend = select_backend(x.device.type, dtype, self.attn_backend)
        # the packed view is the only reference: freed once block 0 replaces it (as native does)
        self.packed = Packed.from_dense(x, p, track_ids=True)

    def _dead(self, l: int) -> bool:
        return self.skip_dead and l == self.depth - 1  # the readout reads the prefix rows only

    def block(self, l: int, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
              consts: ForwardConstants) -> Tuple[Decision, Packed, bool]:
        blk, dead = self.model.blocks[l], self._dead(l)
        with scope("dora.attention"):
            x_attn, keys = attention_residual(blk, self.packed, self.backend)
        ctx = BlockContext(l, keys, self.packed, n_visual, rho, interventions, self.depth, self.num_patches,
                           self.backend, consts, releasable=True, dead=dead)
        self.keys = keys if self.merge else None
        del keys
        if self.speculate and not dead:
            with scope("dora.policy"):
                finish = self.policy.begin(ctx)  # enqueues the gate and its copy to the host
            del ctx
            with scope("dora.mlp_speculative"):
                self._speculative = mlp_residual(blk, x_attn)
            with scope("dora.policy"):
                dec = finish()  # waits for the gate copy, not for the MLP
            del finish  # frees the keys and the pre-attention rows
        else:
            with scope("dora.policy"):
                dec = self.policy(ctx)
            del ctx
        # no extra activation may outlive its use: the keys (possibly a view of the whole qkv
        # output) are dead before the MLP (before the non-speculative one), the pre-deletion rows
        # before the next attention
        self.attended = self.packed = self.packed.with_x(x_attn)
        return dec, False

    def mlp(self, l: int, done: bool) -> None:
        self.keys = None
        self._mlp(l, self.attended)

    def _mlp(self, l: int, attended: Packed) -> None:
        self.attended = None  # (the next attention must not find these rows alive)
        speculative, self._speculative = self._speculative, None
        blk = self.model.blocks[l]
        if self._dead(l):  # the last block's MLP on the prefix rows: the others never reach the logits
            with scope("dora.mlp"):
                rows = attended.prefix_rows()
                self.final = mlp_residual(blk, rows.reshape(-1, rows.shape[-1])).view(rows.shape)
        elif speculative is not None:
            self.packed = attended.with_x(speculative)
        else:
            with scope("dora.mlp"):
                self.packed = attended.with_x(mlp_residual(blk, attended.x))

    def delete(self, l: int, dec: Decision, history=None) -> int:
        self._speculative = None  # some gate opened: the speculative MLP is discarded
        attended, self.attended = self.attended, None
        with scope("dora.compact"):
            if self.merge:
                attended = merge_removed(attended, self.keys, dec.remove, self.model.blocks[l].attn.num_heads)
                self.keys = None
            self.packed = delete_rows(attended, dec.remove, dec.removed, dec.removed_host)
        del attended  # the pre-deletion rows: freed before the survivors' MLP
        total = self.packed.total
        self._mlp(l, self.packed)
        return total

    def leave_dense(self) -> None:
        pass  # (the packed rows need no change)

    def finish(self) -> Tuple[Optional[torch.Tensor], Optional[Packed]]:
        if self.final is not None:
            with scope("dora.readout"):
                return self.model.forward_head(final_norm(self.model, self.final)), None
        return None, self.packed
