"""Lanes: a large batch run as a few independent forwards that the GPU runs side by side
(``EngineOptions.lanes``, ``lanes_min_batch``).

A planned forward of many images (:mod:`~timm_dora.engine.whole`) is one chain of kernels of two
kinds: the blocks' GEMMs and attention, which fill every SM, and the short kernels between them
that do not (the actor's decision, the fold's match, the deletion's compaction and gather: a few
hundred programs each, latency-bound), which the chain waits for with most SMs idle. Split into
lanes, each lane's images are a batch of their own with their own runner (buffers, plan and graphs,
captured on a stream of their own: :func:`~timm_dora.engine.graphs.capture_stream`), and each
lane's graph replays on a stream of its own. The host enqueues every lane before it waits for any
plan's check, so one lane's short kernels run beside the other's GEMMs.

One H200, 320 `test` images, ms a forward enqueued without waiting for the check (the host read
aside, `benchmarks/results/lanes_h200.json`): merging DeiT-Ti 3.61 as one batch, 3.32 as two lanes
of 160, 3.77 as four of 80; ViT-Ti 3.18, 2.98, 3.25 (the graph of the compiled slicing oracle:
2.91 and 3.00).

What a forward returns is each lane's forward of its images, concatenated: equal to the batch's up
to rounding (other batch shapes pick other GEMM kernels, so near-tied decisions may go the other
way, as between any two batch sizes). A lane whose plan did not hold runs again as
:func:`~timm_dora.engine.patch` runs any planned batch that missed (eagerly, its plan grown).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import nn

from .flops import native_gflops
from .options import active

__all__ = ["lane_sizes", "on_lane", "join", "concat_statistics"]

_LANE_STREAMS: Dict[tuple, "torch.cuda.Stream"] = {}


def _patches(model: nn.Module, images: torch.Tensor) -> int:
    """The patch count of ``images`` (another input size of a ``dynamic_img_size`` model too)."""
    pe = model.patch_embed
    if hasattr(pe, "dynamic_feat_size"):
        h, w = pe.dynamic_feat_size(tuple(images.shape[-2:]))
        return int(h) * int(w)
    return int(pe.num_patches)


def lane_sizes(model: nn.Module, images: torch.Tensor) -> Optional[List[int]]:
    """The images of each lane of a captured batch ``images`` (``None``: one lane): with
    ``EngineOptions.lanes`` of 2 or more and at least ``lanes_min_batch`` images, where a lane's
    share would run as a planned graph (``planned`` not False, and at most ``planned_max_batch``
    images or ``planned_max_gflops`` dense GFLOPs a lane); the lanes as equal as can be."""
    options = active()
    batch, n = images.shape[0], options.lanes
    if n < 2 or batch < max(options.lanes_min_batch, n) or options.planned is False:
        return None
    share = -(-batch // n)
    if options.planned is not True and share > options.planned_max_batch and \
            share * native_gflops(model, _patches(model, images)) > options.planned_max_gflops:
        return None
    sizes = [share] * (batch // share) + ([batch % share] if batch % share else [])
    return sizes


def _lane_stream(device: torch.device, lane: int) -> "torch.cuda.Stream":
    """The stream lane ``lane`` replays on (one per device and lane, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, lane) not in _LANE_STREAMS:
        _LANE_STREAMS[(index, lane)] = torch.cuda.Stream(device=index)
    return _LANE_STREAMS[(index, lane)]


@contextlib.contextmanager
def on_lane(device: torch.device, lane: int) -> Iterator[None]:
    """Inside, work is enqueued on lane ``lane``'s stream, behind what the current stream has
    enqueued so far (CUDA; elsewhere in line)."""
    if device.type != "cuda":
        yield
        return
    stream = _lane_stream(device, lane)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def join(device: torch.device, lanes: Iterable[int]) -> None:
    """The current stream waits for all that ``lanes``' streams have enqueued (CUDA)."""
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        for lane in lanes:
            current.wait_stream(_lane_stream(device, lane))


def concat_statistics(parts: Sequence[object], sizes: Sequence[int]) -> Callable[[], Dict[str, object]]:
    """The fields of one :class:`~timm_dora.engine.patch.DoraStats` of the lanes' images in order,
    from each lane's (``parts``, of ``sizes`` images: a removed patch's image index is offset by
    the images of the lanes before), computed when first read."""
    def fields() -> Dict[str, object]:
        out: Dict[str, object] = {name: torch.cat([getattr(p, name) for p in parts])
                                  for name in ("tokens", "gate", "removed", "gflops", "policy_gflops")}
        out["backend"] = parts[0].backend
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        patches = []
        for block in zip(*(p.removed_patches for p in parts)):
            got = [(image + o, patch) for entry, o in zip(block, offsets) if entry is not None
                   for image, patch in (entry,)]
            patches.append(None if not got else (torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])))
        out["removed_patches"] = patches
        return out
    return fields
