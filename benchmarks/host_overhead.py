"""Host overhead of the wrapped forward, on CPU with a micro ViT (not a test).

The H100 numbers of issue #8 are host-bound: the GPU waits for Python and the dispatcher. On a
micro model (img 32, patch 4: 64 patches, width 16, depth 12, 2 heads; batch 8, fp32, one thread)
every kernel is nearly free, so the wall time of a CPU forward is almost all host overhead: Python,
the dispatcher and the per-op fixed cost. Per configuration this reports

- ``us_median``: median wall microseconds of one forward over ``--repeats`` forwards, each timed
  alone after ``--warmup`` forwards, the configurations interleaved (``us_p10``/``us_p90`` for
  spread; ``us_over_native``: the median minus native's) and ``cpu_us_median``, the same for
  the CPU time of the (single) thread, which other processes on a shared machine do not inflate;
- ``aten_ops``: aten ops dispatched per forward (a ``TorchDispatchMode`` counts them; on CUDA
  nearly every one is a kernel launch);
- ``sync_ops``: ops that force a host-device synchronisation on CUDA:
  ``aten._local_scalar_dense`` (``.item()``, ``bool``/``int`` of a tensor), ``Tensor.tolist``,
  ``aten.nonzero``, ``aten.masked_select``, ``aten.bincount``, ``aten.unique*``, indexing with a
  boolean mask, ``repeat_interleave`` without ``output_size``;
- ``check``: the mean GFLOPs, the kept tokens after the last block and a logits checksum, which
  must not change between code versions (numerics and decisions identical).

Configurations: ``native`` (unwrapped timm), ``noprune`` (wrapped, :class:`NoPrune`),
``gate_off`` (wrapped with an actor whose gate never opens), ``fixed`` (the per-image variable
budget :class:`ReplayPolicy` of benchmarks/throughput.py at blocks 3, 6, 9, ``check=False``),
``actor`` (an untrained actor whose gate is forced open at blocks 3, 6, 9), and ``*_graphs``
variants of the last three with ``cuda_graphs=True``: on the CPU their segments run uncaptured,
so for them the row also gives ``eager_ops`` (ops outside the segments: what stays eager between
graph replays on CUDA, each a kernel launch there) and ``graph_segments`` (replays per forward).

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead_cpu_after.json
"""
from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from timm.models.vision_transformer import VisionTransformer  # noqa: E402

import timm_dora  # noqa: E402
from throughput import fixed_plan, gate_forced_actor, schedule_for_reduction  # noqa: E402
from timm_dora import Actor, NoPrune, ReplayPolicy  # noqa: E402
from timm_dora.evaluate import environment, write_json  # noqa: E402

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
        self.in_segment = 0  # inside a timm_dora.graphs segment (a CUDA graph replay on CUDA)
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
    from timm_dora.graphs import GraphRunner

    original = GraphRunner._run

    def run(runner, key):
        c.in_segment += 1
        c.segments += 1
        try:
            return original(runner, key)
        finally:
            c.in_segment -= 1

    GraphRunner._run = run
    try:
        with torch.inference_mode(), OpCounter() as c:
            fn(x)
    finally:
        GraphRunner._run = original
    return c


def wall_us(fns, x, warmup, repeats, rounds=20):
    """Per configuration of ``fns`` (a dict): median, p10 and p90 wall microseconds of one forward,
    and the median CPU time of this thread (``cpu``: unaffected by other processes taking the
    core, which wall time on a shared machine is not). The configurations are interleaved in
    ``rounds`` rounds so that slow drifts of the machine hit all alike."""
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():
            for _ in range(warmup):
                fn(x)
        for _ in range(rounds):
            for name, fn in fns.items():
                for _ in range(max(1, repeats // rounds)):
                    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                    fn(x)
                    wall[name].append((time.perf_counter_ns() - t0) / 1e3)
                    cpu[name].append((time.thread_time_ns() - c0) / 1e3)
    out = {}
    for name, t in wall.items():
        t.sort()
        out[name] = {"us_median": statistics.median(t), "us_p10": t[len(t) // 10], "us_p90": t[(9 * len(t)) // 10],
                     "cpu_us_median": statistics.median(cpu[name])}
    return out


def micro_model(depth: int = 12) -> VisionTransformer:
    return VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=depth, num_heads=2, num_classes=10).eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--reduction", type=float, default=0.38)
    ap.add_argument("--spread", type=int, default=8, help="per-image budget spread around the mean (tokens)")
    ap.add_argument("--configs", nargs="+", default=["native", "noprune", "gate_off", "fixed", "actor"],
                    help="also: gate_off_graphs fixed_graphs actor_graphs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = micro_model()
    x = torch.randn(args.batch, 3, 32, 32)
    n0 = model.patch_embed.num_patches
    mean_k = schedule_for_reduction(model, args.reduction, args.blocks)
    closed = Actor.for_model(model)
    with torch.no_grad():
        closed.gate_mlp[2].bias.fill_(-1e4)
    configs = {
        "native": None,
        "noprune": dict(policy=NoPrune()),
        "gate_off": dict(actor=closed),
        "fixed": dict(policy=ReplayPolicy(fixed_plan(args.batch, n0, args.blocks, mean_k, args.spread, 0, "cpu"), check=False)),
        "actor": dict(actor=gate_forced_actor(model, args.blocks)),
    }
    for name in ("gate_off", "fixed", "actor"):
        configs[name + "_graphs"] = dict(configs[name], cuda_graphs=True)
    res = {
        **environment(torch.device("cpu"), " ".join(["python benchmarks/host_overhead.py"] + (argv if argv is not None else sys.argv[1:]))),
        "model": "VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=12, num_heads=2, num_classes=10)",
        "protocol": {k: getattr(args, k) for k in ("batch", "warmup", "repeats", "blocks", "reduction", "spread", "threads")},
        "mean_k": mean_k,
        "rows": [],
    }
    models = {}
    for name in args.configs:
        models[name] = copy.deepcopy(model)
        if configs[name] is not None:
            timm_dora.wrap(models[name], **configs[name])
    times = wall_us(models, x, args.warmup, args.repeats)
    native = times.get("native")
    for name, m in models.items():
        t = times[name]
        c = count_ops(m, x)
        with torch.inference_mode():
            logits = m(x)
        check = {"logits_sum": float(logits.double().sum()), "logits_abs_sum": float(logits.double().abs().sum())}
        if configs[name] is not None:
            s = m.dora_stats
            check.update(gflops_mean=float(s.gflops.mean()), tokens_last=s.tokens[:, -1].tolist(),
                         gate_rate=s.gate.float().mean(0).tolist())
        over = {} if native is None else {"us_over_native": t["us_median"] - native["us_median"],
                                          "cpu_us_over_native": t["cpu_us_median"] - native["cpu_us_median"]}
        row = {"config": name, **t, **over, "aten_ops": sum(c.ops.values()),
               "sync_ops": sum(c.syncs.values()), "syncs_by_reason": dict(c.syncs),
               **({"eager_ops": sum(c.ops.values()) - c.segment_ops, "graph_segments": c.segments}
                  if name.endswith("_graphs") else {}),
               "ops_by_name": dict(c.ops.most_common()), "check": check}
        res["rows"].append(row)
        print(f"{name:9s} {t['us_median']:9.1f} us (p10 {t['us_p10']:8.1f}, p90 {t['us_p90']:8.1f}, "
              f"cpu {t['cpu_us_median']:8.1f})  aten ops {row['aten_ops']:5d}  "
              f"syncs {row['sync_ops']:3d} {dict(c.syncs)}"
              + (f"  eager ops {row['eager_ops']} in {row['graph_segments']} segments" if "eager_ops" in row else ""), flush=True)
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
