"""CUDA graphs of the dense phase of a wrapped forward (``wrap(..., cuda_graphs=True)``).

Until a block deletes its first token every image keeps all its tokens, so the forward's shapes
are fixed by the batch shape alone: the embedding, each block's attention residual (with the
actor's gate), each block's MLP residual and the readout are captured once per batch shape as CUDA
graphs and replayed, one launch each instead of tens of kernel launches and module calls. That is
what a small backbone needs: ViT-Ti's eager blocks are launch-bound on an H100 at batch 320.

Per block ``l`` of the dense phase:

1. replay ``attention[l]``: the attention residual into a fixed buffer and, for a policy with a
   graph probe (a deterministic :class:`~timm_dora.policy.ActorPolicy`), the gate and an
   asynchronous copy of the gate vector into pinned host memory;
2. with a probe: record an event, replay ``mlp[l]`` (speculatively, on the unpruned batch), wait
   for the event only, and let the policy decide from the gate vector (the GPU keeps working on the
   MLP meanwhile); without one: the policy decides on the host (e.g. a replay plan);
3. nothing removed: the MLP output is the block's output (replayed now if it was not already);
   otherwise the phase ends: the speculative MLP is discarded and the ordinary (eager) path deletes
   the rows of the attention-residual buffer and continues, packed, to the end.

The block's keys are not kept by the graphs (one ``[T, d]`` tensor per block would stay alive):
a policy that reads ``ctx.keys`` (the controller, once a gate opened) gets them recomputed from the
block input with the same operations (``norm1``, ``qkv``, ``k_norm``), hence the same values.

Off CUDA the same segments run eagerly, unchanged (no capture): that is how the CPU tests check
this path against the default forward. Only inference: no autograd, no autocast, ``eval()``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from .packing import Packed
from .policy import BlockContext, Decision, ForwardConstants

__all__ = ["DenseGraphs", "LazyKeysContext", "dense_graphs", "graph_mode_reason"]

MAX_CACHED = 4  # batch shapes (and policies) whose graphs a wrapped model keeps, least recent dropped


class LazyKeysContext(BlockContext):
    """A :class:`BlockContext` whose ``keys`` are computed on first read (by ``keys_fn``)."""

    def __init__(self, keys_fn: Callable[[], torch.Tensor], **kwargs):
        self._keys_fn = keys_fn
        self._keys = None
        super().__init__(keys=None, **kwargs)

    @property
    def keys(self) -> torch.Tensor:
        if self._keys is None:
            self._keys = self._keys_fn()
        return self._keys

    @keys.setter
    def keys(self, value: Optional[torch.Tensor]) -> None:
        self._keys = value


def graph_mode_reason(model: nn.Module, images: torch.Tensor) -> Optional[str]:
    """Why this forward cannot take the dense-phase graphs (``None``: it can)."""
    if model.training:
        return "the model is in training mode"
    if torch.is_grad_enabled():
        return "autograd is enabled (run under torch.inference_mode() or torch.no_grad())"
    if images.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "autocast is enabled (cast the model to bf16/fp16 instead)"
    return None


class DenseGraphs:
    """The dense phase of one wrapped model for one batch shape and policy.

    Fixed buffers: the input images, two ``[B*S, d]`` block inputs (block ``l`` reads
    ``x[l % 2]``, its MLP writes ``x[(l + 1) % 2]``) and the attention-residual output ``xa``.
    On CUDA every segment is captured (one shared memory pool); elsewhere segments run eagerly.
    """

    def __init__(self, model: nn.Module, policy, images: torch.Tensor, backend: str, readout_mode: str):
        from .patch import attention_residual, embed, mlp_residual, readout

        self.model, self.policy, self.backend = model, policy, backend
        self.probing = bool(getattr(policy, "graph_probe", False)) and callable(getattr(policy, "probe", None))
        dev = images.device
        self.capture = dev.type == "cuda"
        self.images = torch.empty_like(images, memory_format=torch.contiguous_format)
        self.images.copy_(images)
        x0 = embed(model, self.images)
        b, s, d = x0.shape
        p = model.num_prefix_tokens
        self.depth, self.num_patches = len(model.blocks), s - p
        layout = Packed.from_dense(x0, p, track_ids=True)
        for name in ("max_len", "min_len", "cu_seqlens", "starts", "seg", "pos"):
            getattr(layout, name)  # layout tensors are made now, outside any capture
        self.x = [torch.empty((b * s, d), dtype=x0.dtype, device=dev) for _ in range(2)]
        self.xa = torch.empty_like(self.x[0])
        self.inputs = [layout.with_x(t) for t in self.x]  # block l's input layout: inputs[l % 2]
        self.attended = layout.with_x(self.xa)
        self.gate_host = torch.zeros((self.depth, b), dtype=torch.bool, pin_memory=self.capture)
        self.consts = ForwardConstants(b, dev)
        for name in ("zeros", "closed", "opened", "no_rho"):
            getattr(self.consts, name)
        self.full = torch.full((b,), self.num_patches, dtype=torch.long, device=dev)
        self.steps: List[object] = [None] * self.depth
        self.logits: Optional[torch.Tensor] = None
        del x0
        blocks = list(model.blocks)

        def run_embed():
            self.x[0].copy_(embed(model, self.images).reshape(b * s, d))

        def run_attention(l: int):
            def f():
                src = self.inputs[l % 2]
                _, keys = attention_residual(blocks[l], src, backend, out=self.xa)
                if self.probing:
                    ctx = BlockContext(l, keys, src, self.full, self.consts.no_rho, self.consts.zeros,
                                       self.depth, self.num_patches, backend, self.consts)
                    step = policy.probe(ctx)
                    self.gate_host[l].copy_(step.gate, non_blocking=self.capture)
                    self.steps[l] = step._replace(ctx=None, keys=None)  # the keys are not kept
            return f

        def run_mlp(l: int):
            return lambda: mlp_residual(blocks[l], self.xa, out=self.x[(l + 1) % 2])

        def run_readout():
            final = self.inputs[self.depth % 2]
            self.logits = readout(model, final.with_x(model.norm(final.x)), readout_mode)

        self.segments = {"embed": run_embed, "readout": run_readout}
        for l in range(self.depth):
            self.segments[("attention", l)] = run_attention(l)
            self.segments[("mlp", l)] = run_mlp(l)
        self.graphs = {}
        if self.capture:
            self._capture()

    def _capture(self) -> None:
        order = ["embed"] + [(k, l) for l in range(self.depth) for k in ("attention", "mlp")] + ["readout"]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (lazy initialisations must not happen in a capture)
            for name in order:
                self.segments[name]()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # the gate's context (history and block embeddings) is memoised per forward constants: made
        # again inside block 0's capture, so every replay recomputes it from the actor's weights
        self.consts.memo.clear()
        pool = torch.cuda.graph_pool_handle()
        for name in order:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.segments[name]()
            self.graphs[name] = g

    def replay(self, name) -> None:
        g = self.graphs.get(name)
        if g is not None:
            g.replay()
        else:
            self.segments[name]()

    # ------------------------------------------------------------------------------------------
    def start(self, images: torch.Tensor) -> Packed:
        """Copy the batch into the fixed input and embed it; returns block 0's input."""
        self.images.copy_(images)
        self.replay("embed")
        return self.inputs[0]

    def block(self, l: int, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
              consts: ForwardConstants) -> Tuple[Decision, bool]:
        """Block ``l``'s attention residual and decision; returns ``(decision, mlp_done)``:
        ``mlp_done`` says the MLP of the unpruned batch already ran (speculatively)."""
        from .patch import attention_keys

        self.replay(("attention", l))
        src, blk = self.inputs[l % 2], self.model.blocks[l]
        ctx = LazyKeysContext(lambda: attention_keys(blk, src), block=l, packed=src, n_visual=n_visual, rho=rho,
                              interventions=interventions, depth=self.depth, num_patches=self.num_patches,
                              backend=self.backend, constants=consts)
        if not self.probing:
            return self.policy(ctx), False
        done = None
        if self.capture:
            done = torch.cuda.Event()
            done.record()
        self.replay(("mlp", l))  # speculative: the GPU runs it while the host reads the gate
        if done is not None:
            done.synchronize()
        return self.policy.decide(self.steps[l], self.gate_host[l].tolist(), ctx), True

    def mlp(self, l: int) -> Packed:
        """Block ``l``'s MLP residual (if not already run); returns block ``l + 1``'s input."""
        self.replay(("mlp", l))
        return self.inputs[(l + 1) % 2]

    def next_input(self, l: int) -> Packed:
        return self.inputs[(l + 1) % 2]

    def finish(self) -> torch.Tensor:
        """The readout of a forward that stayed dense to the end (a copy: the buffer is reused)."""
        self.replay("readout")
        return self.logits.clone()


def dense_graphs(model: nn.Module, cache: "OrderedDict", policy, images: torch.Tensor, backend: str,
                 readout_mode: str) -> DenseGraphs:
    """The :class:`DenseGraphs` of ``model`` for this batch shape and policy, built (and on CUDA
    captured) on first use; ``cache`` keeps the :data:`MAX_CACHED` most recent."""
    weight = next(model.parameters())
    key = (tuple(images.shape), images.dtype, str(images.device), id(policy), backend, readout_mode,
           weight.dtype, weight.data_ptr())
    entry = cache.get(key)
    if entry is not None and entry.policy is policy:
        cache.move_to_end(key)
        return entry
    entry = DenseGraphs(model, policy, images, backend, readout_mode)
    cache[key] = entry
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)
    return entry
