"""Which executor runs a wrapped model's forward, and what the captured one holds.

The block program (:mod:`~timm_dora.engine.blocks`) runs either eagerly or replayed from CUDA
graphs (:mod:`~timm_dora.engine.graphs`). ``wrap(..., cuda_graphs=None)``, the default, captures
wherever it can: on CUDA, for inference (``eval()``, no autograd, no autocast) in fp16/bf16 with a
varlen attention backend. Elsewhere (the CPU, training, fp32) it runs eagerly without a word.
``cuda_graphs=True`` insists (it warns once where it cannot, and off CUDA runs the same segments
uncaptured: how the CPU tests check that executor); ``cuda_graphs=False`` is always eager.

- **Batch buckets.** A captured forward pads the batch (with copies of its last image, whose
  outputs are dropped) up to :func:`batch_bucket`: sizes up to 8 as they are, larger ones rounded
  up to three significant bits (10, 12, 14, 16, 20, ..., 256, 320, 384, ...), so a stream of odd
  batch sizes captures at most four shapes per octave and pads by less than a quarter.
- **Bounded and releasable.** Graphs are kept for ``EngineOptions.max_cached``
  batch buckets (and policies) above ``planned_max_batch`` and, apart, for ``max_cached_small`` of
  the smaller ones (every bucket of 1-16 images), least recent dropped; :func:`engine_info` reports each one's graphs,
  capture time and the memory its buffers and captures reserved; :func:`release_graphs` frees them
  now (the next forward captures again).
- **Fallback.** If the captured forward raises (a failed capture), the same forward runs eagerly; if
  that succeeds, the model stays eager from then on, with one warning that says why (also in
  :func:`engine_info`). If the eager forward raises too, the input was at fault: its error is raised
  and the graphs stay enabled.
- **torch.compile.** Under ``torch.compile`` a forward that would be captured runs the captured
  executor as one opaque call (``torch.compiler.disable``: its graphs are already what Inductor
  would give, and Dynamo cannot trace host decisions cheaply); any other forward is traced through
  the eager executor (the varlen attention is the custom op ``torch.ops.timm_dora.varlen_attention``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from .attention import BACKEND_INFO
from .graphs import decides_in_graphs, graph_mode_reason, release_all
from .options import EngineOptions, active
from .protocol import Policy

__all__ = ["batch_bucket", "capture_reason", "pad_batch", "engine_info", "policy_of", "release_graphs", "set_options",
           "fell_back"]


def batch_bucket(batch: int) -> int:
    """The batch size a captured forward runs at: ``batch`` up to 8, else rounded up to three
    significant bits (at most four sizes per octave, less than 25 % padding): 9 -> 10, 17 -> 20,
    257 -> 320, 320 -> 320."""
    if batch <= 8:
        return batch
    step = 1 << (batch.bit_length() - 3)
    return -(-batch // step) * step


def capture_reason(model: nn.Module, images: torch.Tensor, backend: str) -> Optional[str]:
    """Why this forward of a wrapped ``model`` runs eagerly (``None``: captured)."""
    state = model._dora
    if state.cuda_graphs is False:
        return "cuda_graphs=False"
    if state.failed is not None:
        return f"an earlier capture failed ({state.failed})"
    if torch.compiler.is_compiling():
        return "traced by torch.compile (a forward that can be captured runs as one opaque call)"
    if state.cuda_graphs is None and images.device.type != "cuda":
        return f"the model is on {images.device.type}, not CUDA"
    if state.skip_dead:
        return "skip_dead=True is not captured yet"
    if not (getattr(model.patch_embed, "dynamic_img_size", False)
            or tuple(images.shape[-2:]) == tuple(model.patch_embed.img_size)):
        return "the input size is not the model's img_size"
    return graph_mode_reason(model, images, backend) or (_merge_reason(model, images, backend) if state.merge else None)


def _merge_reason(model: nn.Module, images: torch.Tensor, backend: str) -> Optional[str]:
    """Why a merging forward is not captured (``None``: it is): the fold runs in the actor's
    controller graph, and on CUDA the proportional attention in the Triton kernel."""
    if images.is_cuda and not BACKEND_INFO[backend].folds_in_graphs:
        folds = [name for name, b in BACKEND_INFO.items() if b.folds_in_graphs]
        return f"merge=True is captured on the {', '.join(map(repr, folds))} attention backend only, not {backend!r}"
    grid = [n // p for n, p in zip(images.shape[-2:], model.patch_embed.patch_size)]
    if not decides_in_graphs(model._dora.policy, grid[0] * grid[1], next(model.parameters()).dtype):
        return "merge=True is captured for a deterministic CLS actor in the model's dtype only"
    return None


def captures_under_compile(model: nn.Module, images: torch.Tensor) -> bool:
    """Whether a forward being traced by ``torch.compile`` would be captured: read at trace time
    from what Dynamo guards on (device, dtype, grad mode, the model's mode and options). A wrong
    guess costs only speed: the opaque call re-checks everything and runs eagerly where it must."""
    state = model._dora
    return (images.device.type == "cuda" and images.dtype in (torch.float16, torch.bfloat16)
            and state.cuda_graphs is not False and state.failed is None and not state.skip_dead
            and not model.training and not torch.is_grad_enabled())


def pad_batch(images: torch.Tensor, batch: int) -> torch.Tensor:
    """``images`` followed by copies of its last image, ``batch`` in all."""
    extra = batch - images.shape[0]
    if extra <= 0:
        return images
    return torch.cat([images, images[-1:].expand(extra, *images.shape[1:])])


def fell_back(model: nn.Module, error: BaseException) -> str:
    """Record that a captured forward failed (the model runs eagerly from now on; the caller has
    released its graphs); returns the reason for the one warning."""
    state = model._dora
    first = (str(error).strip().splitlines() or [""])[0]
    state.failed = f"{type(error).__name__}: {first[:300]}"
    return state.failed


def engine_info(model: nn.Module) -> Dict[str, Any]:
    """What runs a wrapped model's forward and what its captured graphs hold:

    - ``cuda_graphs``: the option (``None``: wherever possible);
    - ``executor``: ``"captured"`` or ``"eager"`` (the last forward; ``None`` before the first);
    - ``reason``: why the last forward ran eagerly (``None`` when captured);
    - ``failed``: why capturing was given up for this model, or ``None``;
    - ``graph``: how the last captured forward replayed (``None`` when eager): ``"whole"`` or
      ``"planned"`` (one graph for the whole forward: :mod:`~timm_dora.engine.whole`) or
      ``"per_block"`` (a graph per block, the host reading each block's decisions), and
      ``graph_reason``, why it was not one graph (the policy decides on the host, a pooled
      readout, a batch above ``EngineOptions.planned_max_batch``, ...);
    - ``batch_shapes``: per cached batch bucket (at most ``max_cached`` + ``max_cached_small``), ``batch``, ``graphs``,
      ``capture_s`` (warm-ups and captures, device-synchronised), ``memory_mb`` (its fixed
      buffers and the segments of its graphs' private memory pool) and ``buffers_mb`` (the fixed
      buffers alone), ``plan_misses`` (forwards whose plan did not hold and ran again eagerly:
      :mod:`~timm_dora.engine.whole`);
    - ``graphs``, ``capture_s``, ``memory_mb``: their sums.

    Free that memory with :func:`release_graphs` (and ``torch.cuda.empty_cache()`` to return it to
    the device)."""
    if not hasattr(model, "_dora"):
        raise ValueError("model is not wrapped by timm_dora")
    state = model._dora
    pools: Dict[tuple, int] = {}
    if any(r.pool is not None for r in state.graphs.values()):
        for seg in torch.cuda.memory._snapshot()["segments"]:  # the graphs' private pools' segments
            key = tuple(seg.get("segment_pool_id", ()))
            pools[key] = pools.get(key, 0) + seg["total_size"]
    shapes = [{"batch": r.batch, "graphs": len(r.graphs), "capture_s": round(r.capture_s, 3),
               "memory_mb": round((r.buffer_bytes + pools.get(tuple(r.pool or ()), 0)) / 2**20, 1),
               "buffers_mb": round(r.buffer_bytes / 2**20, 1), "plan_misses": r.plan_misses}
              for r in state.graphs.values()]
    return {"cuda_graphs": state.cuda_graphs, "executor": state.executor, "reason": state.reason,
            "failed": state.failed, "graph": state.graph, "graph_reason": state.graph_reason,
            "max_cached": (state.engine or active()).max_cached,
            "max_cached_small": (state.engine or active()).max_cached_small, "batch_shapes": shapes,
            "graphs": sum(s["graphs"] for s in shapes), "capture_s": round(sum(s["capture_s"] for s in shapes), 3),
            "memory_mb": round(sum(s["memory_mb"] for s in shapes), 1)}


def policy_of(model: nn.Module) -> Policy:
    """The policy a wrapped ``model`` runs: the one :func:`timm_dora.wrap` built from its actor (or
    was given as ``policy=``), or the last :func:`~timm_dora.engine.patch.set_policy`."""
    if not hasattr(model, "_dora"):
        raise ValueError("model is not wrapped by timm_dora")
    return model._dora.policy


def release_graphs(model: nn.Module) -> int:
    """Destroy a wrapped model's captured graphs and buffers now; returns how many batch shapes
    were released. The next captured forward captures again. The memory goes back to torch's
    caching allocator (``torch.cuda.empty_cache()`` returns it to the device)."""
    if not hasattr(model, "_dora"):
        raise ValueError("model is not wrapped by timm_dora")
    n = len(model._dora.graphs)
    release_all(model._dora.graphs)
    return n


def set_options(model: nn.Module, options: Optional[EngineOptions] = None, **changes) -> EngineOptions:
    """Change how the engine runs a wrapped model: ``options`` replaces its
    :class:`~timm_dora.engine.options.EngineOptions`, and ``changes`` (field names) are applied on top
    (``set_options(model, run_ahead=False)``). Its captured graphs are released (they were recorded
    under the old options). Returns the new options."""
    if not hasattr(model, "_dora"):
        raise ValueError("model is not wrapped by timm_dora")
    state = model._dora
    try:
        state.engine = dataclasses.replace(options or state.engine or active(), **changes)
    except TypeError as e:
        raise TypeError(f"set_options: {e} (fields: {', '.join(f.name for f in dataclasses.fields(EngineOptions))})") from None
    release_all(state.graphs)
    return state.engine
