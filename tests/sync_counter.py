"""Counting a wrapped forward's host work on the CPU: the aten ops it dispatches (on CUDA nearly each a
kernel launch) and the ops that would make the host wait for the device on CUDA (``.item()``,
``Tensor.tolist``, ``nonzero``, boolean-mask indexing, ...), inside and outside the CUDA-graph
segments. Used by ``test_host_overhead.py`` and ``test_graphs.py``."""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from timm.models.vision_transformer import VisionTransformer

_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2",
             "unique_consecutive", "unique_dim", "equal", "is_nonzero")


def _is_bool_index(idx) -> bool:
    return isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8)


def sync_reason(func, args, kwargs):
    """Why ``func(*args, **kwargs)`` synchronises with the host on CUDA, or ``None``."""
    packet = func.overloadpacket.__name__
    if packet in _SYNC_OPS:
        return packet
    if packet in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        if any(_is_bool_index(i) for i in (args[1] or ())):
            return f"{packet}[bool mask]"
    if packet == "repeat_interleave" and func is not torch.ops.aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
            return "repeat_interleave (no output_size)"
    return None


class OpCounter(TorchDispatchMode):
    """Counts aten ops and host-syncing ops (``Tensor.tolist`` included, which is not an aten op)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.syncs = collections.Counter()
        self.in_segment = 0  # inside a timm_dora.engine.graphs segment (a CUDA graph replay on CUDA)
        self.segment_ops = 0
        self.segments = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        self.segment_ops += bool(self.in_segment)
        why = sync_reason(func, args, kwargs)
        if why is not None:
            self.syncs[why] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        counter, original = self, torch.Tensor.tolist

        def tolist(t):
            counter.syncs["tolist"] += 1
            return original(t)

        self._tolist, torch.Tensor.tolist = original, tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def count_ops(fn, x):
    """Ops of one forward; with ``cuda_graphs=True`` also those inside the graph segments (one
    replay each on CUDA; uncaptured on the CPU, so counted here) and the segment count."""
    from timm_dora.engine.graphs import GraphRunner

    original = GraphRunner.run_segment

    def run(runner, key):
        c.in_segment += 1
        c.segments += 1
        try:
            return original(runner, key)
        finally:
            c.in_segment -= 1

    GraphRunner.run_segment = run
    try:
        with torch.inference_mode(), OpCounter() as c:
            fn(x)
    finally:
        GraphRunner.run_segment = original
    return c


def micro_model(depth: int = 12) -> VisionTransformer:
    return VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=depth, num_heads=2, num_classes=10).eval()
