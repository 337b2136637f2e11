"""``timm-dora bench``: throughput with the paper's App. E.5 timing protocol, for any callable.

Protocol (:func:`time_forward`): GPU-resident, preprocessed input batches (data loading, decoding,
preprocessing and host-to-device copies are excluded); per repeat, ``warmup`` forwards then
``iters`` timed forwards cycling through the batches, with a CUDA synchronisation immediately
before and after the timed loop; ``repeats`` repeats; ``t_r = 1000 T_r / iters`` ms/batch and
``q_r = batch * iters / T_r`` images/s; the medians are reported. Defaults are the paper's: batch
320, 200 + 200 forwards, 5 repeats, bf16 weights and activations, TF32 off, no ``torch.compile``,
all under ``torch.inference_mode``. The timed callable includes everything a method does online
(DORA: actor, selection, packing, compaction; ToMe, PiToMe, MCTF, DiffRate, Representation Shift,
Zero-TPrune: their scoring, matching, merging or pruning).

Inputs (:func:`bench_inputs`): real images of a dataset split when ``data`` is given (the
model's eval preprocessing, then moved to the device in the timing dtype): as many full batches as
the split holds, at most ``batches`` (the paper: 8,000 ImageNet validation images in 25 batches;
the 1,300-image ``test`` split gives 4), tiled when the split is smaller than one batch; otherwise
``batches`` batches of standard-normal noise (throughput of the dense methods does not depend on
pixel values; DORA's does, through its decisions, so prefer real images for DORA).

The JSON records device, torch, CUDA, timm, the protocol and, per row, the attention operators the
forward actually dispatched (one profiled forward: e.g. ``aten::_scaled_dot_product_flash_attention``
for native timm, ``..._efficient_attention`` for ToMe's and PiToMe's biased SDPA) and, for DORA,
its varlen backend.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ..data import eval_transform, open_split, preload
from .cli import add_method_args, add_model_args, count, method_from_args, positive_int, run_header, setup
from .methods import NativeMethod
from .setup import write_json

__all__ = ["PROTOCOL", "attention_ops", "bench", "bench_inputs", "time_forward"]

PROTOCOL = {"batch": 320, "batches": 25, "warmup": 200, "iters": 200, "repeats": 5}
# ours: the default on a CPU, where the paper's protocol would take hours (ViT-Ti, 2 cores: about
# 70 ms an image); a smoke test of the protocol in well under a minute, not a measurement
CPU_PROTOCOL = {"batch": 8, "batches": 2, "warmup": 2, "iters": 5, "repeats": 3}
_ATTN_OP = re.compile(r"(attention|attn|sdp|fmha|varlen)", re.IGNORECASE)


def _sync(device: Optional[torch.device] = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


def time_forward(
    fn: Callable[[torch.Tensor], Any],
    inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    warmup: int = 200,
    iters: int = 200,
    repeats: int = 5,
    progress: Optional[Callable[[], None]] = None,
) -> Dict[str, Any]:
    """Time ``fn`` on GPU-resident ``inputs`` (a list of batches, or one batch) by the App. E.5 protocol.

    Returns ``ms_per_batch`` and ``images_per_s`` (medians over repeats), the per-repeat values
    (``repeats_ms_per_batch``, ``repeats_images_per_s``) and the protocol used. On CUDA also the
    peak allocated memory in two phases: ``warmup_peak_memory_mib``, from the call's start (the
    caller may reset the peak statistics before it) to the end of the first warm-up, where first
    calls capture CUDA graphs and compile kernels, and ``steady_peak_memory_mib``, over everything
    after it (with enough warm-up to see every batch, no first-time work is left there). To
    separate the two it resets the device's peak memory statistics after the first warm-up.
    ``progress``: called after each repeat, outside the timed region.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = [inputs]
    inputs = list(inputs)
    if not inputs or iters < 1 or repeats < 1 or warmup < 0:
        raise ValueError("need at least one input batch, iters >= 1, repeats >= 1 and warmup >= 0")
    batch = inputs[0].shape[0]
    if any(x.shape[0] != batch for x in inputs):
        raise ValueError("all input batches must have the same size")
    device = inputs[0].device
    ms, ips = [], []
    memory: Dict[str, float] = {}
    with torch.inference_mode():
        for r in range(repeats):
            for i in range(warmup):
                fn(inputs[i % len(inputs)])
            _sync(device)
            if r == 0 and device.type == "cuda":
                memory["warmup_peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            for i in range(iters):
                fn(inputs[i % len(inputs)])
            _sync(device)
            t = time.perf_counter() - t0
            ms.append(1000.0 * t / iters)
            ips.append(batch * iters / t)
            if progress is not None:  # (outside the timed loop)
                progress()
    if device.type == "cuda":
        memory["steady_peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return {
        "ms_per_batch": statistics.median(ms),
        "images_per_s": statistics.median(ips),
        "repeats_ms_per_batch": ms,
        "repeats_images_per_s": ips,
        "batch": batch,
        "batches": len(inputs),
        "warmup": warmup,
        "iters": iters,
        "repeats": repeats,
        **memory,
    }


@contextlib.contextmanager
def _native_stderr_silenced():
    """The process's stderr (file descriptor 2) sent to the null device: the profiler's C++ side
    prints its own start/stop lines there, and on a machine without a GPU a CUDA probe failure."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def attention_ops(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> List[str]:
    """Names of the attention operators one forward of ``fn`` dispatches (CPU-side profiler)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with _native_stderr_silenced(), torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(x)
    except Exception as e:  # the profiler is a nicety: never fail a benchmark on it
        return [f"unknown ({type(e).__name__})"]
    names = {e.key for e in prof.events()}
    keep = sorted(n for n in names if _ATTN_OP.search(n) and not n.startswith("aten::scaled_dot_product_attention"))
    return keep or sorted(n for n in names if n.startswith("aten::scaled_dot_product_attention"))


def bench_inputs(
    model: nn.Module,
    *,
    batch: int = 320,
    batches: int = 25,
    device: Union[str, torch.device] = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    data: Optional[str] = None,
    split: str = "test",
    images: Optional[torch.Tensor] = None,
    workers: int = 4,
    seed: int = 0,
    input_size: Optional[int] = None,
) -> Tuple[List[torch.Tensor], Dict[str, Any]]:
    """GPU-resident input batches and a description of them.

    ``images``: already preprocessed images ``[N, 3, H, W]`` (e.g. :func:`timm_dora.data.preload`);
    ``data``/``split``: load and preprocess them here; neither: random normal batches.
    ``input_size``: square inputs of this size instead of the model's own.
    """
    device = torch.device(device)
    if images is None and data is not None:
        ds = open_split(data, split, eval_transform(model, img_size=input_size))
        images, _ = preload(ds, device=device, dtype=dtype, num_workers=workers)
    if images is not None:
        n = images.shape[0]
        if n < batch:
            reps = -(-batch // n)
            images = images.repeat(reps, 1, 1, 1)[:batch]
            used, tiled = batch, True
        else:
            used, tiled = min(batches, n // batch) * batch, False
        images = images[:used].to(device, dtype)
        out = [images[s:s + batch] for s in range(0, used, batch)]
        info = {"inputs": "real", "data": data, "split": split if data else None, "images_available": n,
                "images_used": min(n, used), "tiled": tiled}
    else:
        g = torch.Generator().manual_seed(seed)
        h, w = model.patch_embed.img_size if input_size is None else (input_size, input_size)
        out = [torch.randn(batch, 3, h, w, generator=g).to(device, dtype) for _ in range(batches)]
        info = {"inputs": "random", "data": None, "split": None}
    info.update({"batch": batch, "batches": len(out), "dtype": str(dtype).replace("torch.", "")})
    return out, info


def bench(
    fn: Callable[[torch.Tensor], Any],
    inputs: Sequence[torch.Tensor],
    *,
    warmup: int = 200,
    iters: int = 200,
    repeats: int = 5,
    autocast: bool = False,
    record_ops: bool = True,
    progress: Optional[Callable[[], None]] = None,
) -> Dict[str, Any]:
    """:func:`time_forward` plus the attention operators ``fn`` dispatches (``attention_ops``)."""
    if autocast:
        inner = fn

        def fn(x):  # noqa: F811
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return inner(x)

    ops = attention_ops(fn, inputs[0]) if record_ops else None
    res = time_forward(fn, inputs, warmup=warmup, iters=iters, repeats=repeats, progress=progress)
    if ops is not None:
        res["attention_ops"] = ops
    return res


# --------------------------------------------------------------------------------------------
# command line


def _run(args) -> int:
    model, device, dtype, autocast = setup(args)
    defaults = PROTOCOL if device.type == "cuda" else CPU_PROTOCOL
    chosen = {k: v for k, v in defaults.items() if getattr(args, k) is None}
    for k, v in chosen.items():
        setattr(args, k, v)
    if device.type != "cuda":
        small = (f" (defaults for a CPU: {', '.join(f'--{k} {v}' for k, v in chosen.items())}; the paper's are "
                 f"{', '.join(f'--{k} {v}' for k, v in PROTOCOL.items() if k in chosen)})") if chosen else ""
        print(f"warning: timing on the CPU only smoke-tests the protocol; the paper's numbers are CUDA{small}",
              file=sys.stderr)
    inputs, info = bench_inputs(model, batch=args.batch, batches=args.batches, device=device,
                                dtype=torch.float32 if autocast else dtype, data=args.data, split=args.split,
                                workers=args.workers, seed=args.seed, input_size=args.input_size)
    methods = [NativeMethod(model, args.skip_dead)]
    if args.method != "native":
        methods.append(method_from_args(model, args))
    rows = []
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else None
    bar = tqdm(total=len(methods) * args.repeats, desc="bench", unit="repeat", file=sys.stderr, dynamic_ncols=True)
    try:
        for m in methods:
            with torch.inference_mode():
                if amp is not None:
                    with amp:
                        outs = m.outputs(inputs[0])
                else:
                    outs = m.outputs(inputs[0])
            out = outs[m.name]
            bar.set_description(f"bench {m.name}")
            res = bench(m.timing_fn(), inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats, autocast=autocast,
                        progress=lambda: bar.update(1))
            row = {"method": m.name, "config": m.config, "gflops": float(out.gflops.mean()),
                   "gflops_min": float(out.gflops.min()), "gflops_max": float(out.gflops.max()), **res}
            if out.backend is not None:
                row["attn_backend"] = out.backend
            rows.append(row)
            bar.write(f"{m.name:34s} {row['gflops']:8.3f} GFLOPs {row['images_per_s']:10.1f} img/s "
                      f"{row['ms_per_batch']:8.3f} ms/batch  {', '.join(res.get('attention_ops') or [])}", file=sys.stdout)
    finally:
        bar.close()
        for m in methods:
            m.close()
    payload = {
        **run_header(args, device, dtype, autocast),
        "protocol": {"batch": args.batch, "batches": info["batches"], "warmup": args.warmup, "iters": args.iters,
                     "repeats": args.repeats, "statistic": "median over repeats"},
        "inputs": info,
        "rows": rows,
    }
    write_json(args.out, payload)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("bench", help="throughput with the paper's App. E.5 timing protocol",
                               description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add_model_args(ap)
    add_method_args(ap, default="native")
    ap.add_argument("--data", default=None, help="labels CSV or image folder: time on real images of --split (default: random)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--workers", type=count, default=4, help="data loading processes (at most one per CPU)")
    for k, v in PROTOCOL.items():
        ap.add_argument(f"--{k}", type=count if k == "warmup" else positive_int, default=None,
                        help=f"default: {v} on CUDA (App. E.5), {CPU_PROTOCOL[k]} on a CPU")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.set_defaults(func=_run, _parser=ap)
    return ap
