"""Lanes: a large batch run as a few independent forwards that the GPU runs side by side
(``EngineOptions.lanes``, ``lanes_min_batch``).

A planned forward of many images (:mod:`~timm_dora.engine.whole`) is one chain of kernels of two
kinds: the blocks' GEMMs and attention, which fill every SM, and the short kernels between them
that do not (the actor's decision, the fold's match, the deletion's compaction and gather: a few
hundred programs each, latency-bound), which the chain waits for with most SMs idle. Split into
lanes, each lane's images are a batch of their own with their own runner (buffers, plan), and the
lanes' planned forwards are one graph (:func:`~timm_dora.engine.whole.forward_lanes`) whose
branches the GPU runs side by side: one lane's short kernels beside another's GEMMs. Each branch
is captured on its lane's stream (:func:`~timm_dora.engine.graphs.capture_stream`), so that its
GEMMs have a cuBLAS workspace of their own.

This module decides the lanes (:func:`lane_sizes`) and joins their statistics
(:func:`concat_statistics`); :func:`timm_dora.engine.patch.run` runs them. What a forward returns
is each lane's forward of its images, concatenated: equal to the batch's up to rounding (other
batch shapes pick other GEMM kernels, so near-tied decisions may go the other way, as between any
two batch sizes). A lane whose plan did not hold runs again as any planned batch that missed
(eagerly, its plan grown).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .flops import native_gflops
from .options import active

__all__ = ["lane_sizes", "concat_statistics"]

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
