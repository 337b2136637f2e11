"""What a user gets by default, against what a serving engineer compares with (not a test).

For each configuration, in one process on one GPU (bf16, batch 320 unless ``by_batch``), the
timing protocol of :func:`timm_dora.evaluate.bench.time_forward` (warm-up, synchronised timed
loop, median of repeats; ``--warmup/--iters/--repeats``) on GPU-resident batches:

- ``native_eager_ips`` / ``native_compiled_ips``: the unwrapped timm model, eager and under
  ``torch.compile`` (default mode);
- ``dora_default_ips``: ``timm_dora.wrap(model, actor)`` with no flags (captured: ``capture_s``, its
  first two forwards minus two steady ones, since a planned graph is observed by the first and
  captured by the second; ``graph_memory_mb``, the memory reserved by those two forwards;
  ``engine_info``, :func:`timm_dora.engine_info` after the timing; its agreement with the eager
  executor on the first batch: ``default_same_decisions_pct``, ``default_max_abs_diff``);
- ``dora_eager_ips``: the same with ``cuda_graphs=False``, the eager executor;
- ``dora_compiled_ips`` / ``dora_compiled_ro_ips``: ``torch.compile`` of the wrapped model, default
  mode and ``mode="reduce-overhead"`` (``--compile-modes``), with ``compile_s`` (first forward),
  ``graphs`` (the graphs Dynamo compiled over the whole row: recompilations included) and the compiled
  forward's agreement with eager on the first batch: ``compiled_same_decisions_pct`` (images whose
  per-block removals equal eager's) and ``compiled_max_abs_diff`` (logits of those images);
- ``oracle_compiled_ips``: a dense model that removes DORA's realised mean count per block by
  slicing (no selection, no packing), compiled: the ceiling at DORA's per-block removal;
- references that separate the engine's dense kernels (:mod:`timm_dora.engine.dense_kernels`) from
  pruning: ``dora_default_timm_kernels_ips`` (DORA's default with them off: timm's LayerNorm and
  convolution), ``native_compiled_gemm_embed_ips`` and ``oracle_compiled_gemm_embed_ips`` (native and
  oracle compiled with the patch embedding as one matrix product, as the engine computes it);
- ``dora_gflops`` / ``native_gflops`` (App. E.4 accounting, mean over the timed batches).

Configurations: ``vit_tiny_published`` (ViT-Ti with ``--vit-weights``, the actor in hub/, the
first ``--images`` `test` images of ``--data``), ``deit_tiny_published`` (the same for DeiT-Ti with
``--deit-weights``: its actor merges, ``merge: true`` in the row; its oracle slices the same
counts, so the fold, its matching and the size-weighted attention are DORA's cost) and
``deit_base_forced_369`` (DeiT-B with random weights and random images, a random actor whose gate is forced open at blocks 3, 6 and 9), which
adds ``gate_off_default_ips`` (``NoPrune``, defaults) and ``by_batch`` (the rows at batch sizes
``--by-batch``, every field but the references; the one at ``--batch`` is the top-level row).

    python -m benchmarks.default_speed --vit-weights W.safetensors --data labels.csv \\
        --out benchmarks/results/default_speed_h100.json
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import timm_dora
from timm_dora import NoPrune
from timm_dora.engine import native_gflops
from timm_dora.engine.dense_kernels import patch_embed_gemm
from timm_dora.evaluate import inference_device, loader_for, write_json
from benchmarks.common import PUBLISHED, add_common_args, deit_forced, header, oracle_forward, published, timed


def first_call_s(fn: Callable, x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decisions(model) -> torch.Tensor:
    return model.dora_stats.removed.clone()


def dora_rows(model, actor_fn: Callable, inputs: List[torch.Tensor], args,
              row: Optional[Dict[str, Any]] = None, save: Callable[[], None] = lambda: None,
              references: bool = True) -> Dict[str, Any]:
    """The DORA rows of one configuration on ``inputs`` (``model`` unwrapped on entry and exit),
    added to ``row``; ``save()`` after each (a long compile may not finish inside a GPU job).
    ``references``: also the rows that separate the dense kernels' gain from pruning's."""
    row = {} if row is None else row
    timm_dora.wrap(model, actor_fn(), cuda_graphs=False)  # the eager executor: the reference decisions
    gflops, removed = [], []
    with torch.inference_mode():
        eager_logits = model(inputs[0]).float()
        eager_removed = decisions(model)
        for x in inputs:
            model(x)
            gflops.append(model.dora_stats.gflops)
            removed.append(model.dora_stats.removed)
    row["dora_gflops"] = float(torch.cat(gflops).mean())
    removed = torch.cat(removed).float().mean(0)  # [depth] mean removal per block
    ks = {l: int(round(float(r))) for l, r in enumerate(removed) if r > 0}
    row["realised_removal_per_block"] = {str(l): round(float(r), 2) for l, r in enumerate(removed) if r > 0}
    if not args.compiled_only:
        row["dora_eager_ips"] = timed(model, inputs, args)
    timm_dora.unwrap(model)
    if args.compiled_only:
        return _compiled_rows(model, actor_fn, inputs, args, row, save, eager_logits, eager_removed)
    save()

    timm_dora.wrap(model, actor_fn())  # no flags: what a user gets
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    first = first_call_s(model, inputs[0]) + first_call_s(model, inputs[0])  # (planned: observed, captured)
    row["graph_memory_mb"] = (torch.cuda.memory_reserved() - reserved) / 2**20
    row["first_forwards_s"] = first
    row["capture_s"] = first - first_call_s(model, inputs[0]) - first_call_s(model, inputs[0])
    with torch.inference_mode():
        out = model(inputs[0]).float()
    same = (decisions(model) == eager_removed).all(1)
    row["default_same_decisions_pct"] = 100.0 * float(same.float().mean())
    row["default_max_abs_diff"] = float((out[same] - eager_logits[same]).abs().max()) if same.any() else None
    row["dora_default_ips"] = timed(model, inputs, args)
    row["engine_info"] = timm_dora.engine_info(model)
    if references:
        # the same without the engine's LayerNorm and patch-embedding kernels (set_options releases the graphs)
        timm_dora.set_options(model, dense_kernels=False)
        row["dora_default_timm_kernels_ips"] = timed(model, inputs, args)
    timm_dora.unwrap(model)
    save()

    torch._dynamo.reset()
    row["oracle_removal_per_block"] = ks
    row["oracle_compiled_ips"] = timed(torch.compile(oracle_forward(model, ks)), inputs, args)
    if references:
        row["oracle_compiled_gemm_embed_ips"] = timed(
            torch.compile(oracle_forward(model, ks, gemm_embed(model))), inputs, args)
    save()
    return _compiled_rows(model, actor_fn, inputs, args, row, save, eager_logits, eager_removed)


def _compiled_rows(model, actor_fn, inputs, args, row, save, eager_logits, eager_removed) -> Dict[str, Any]:
    """``torch.compile`` of the wrapped model in each of ``--compile-modes``: compile time, agreement
    with the eager forward on the first batch, throughput (errors recorded in the row)."""
    modes = {"default": ("dora_compiled", None), "reduce-overhead": ("dora_compiled_ro", "reduce-overhead")}
    for key, mode in (modes[m] for m in args.compile_modes):
        timm_dora.wrap(model, actor_fn())
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fn = torch.compile(model, mode=mode)
        try:
            row[f"{key}_compile_s"] = first_call_s(fn, inputs[0])
            with torch.inference_mode():
                out = fn(inputs[0]).float()
            same = (decisions(model) == eager_removed).all(1)
            row[f"{key}_same_decisions_pct"] = 100.0 * float(same.float().mean())
            row[f"{key}_max_abs_diff"] = float((out[same] - eager_logits[same]).abs().max()) if same.any() else None
            save()
            row[f"{key}_ips"] = timed(fn, inputs, args)
        except Exception as e:  # recorded, not hidden: the row says why it has no number
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row[f"{key}_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        timm_dora.unwrap(model)
        save()
    return row


def gemm_embed(model) -> Callable:
    """The model's patch embedding as the engine computes it on CUDA (one matrix product)."""
    return lambda x: patch_embed_gemm(model.patch_embed.proj, x)


def native_rows(model, inputs: List[torch.Tensor], args, references: bool = True) -> Dict[str, Any]:
    torch._dynamo.reset()
    row = {"native_gflops": native_gflops(model), "native_eager_ips": timed(model, inputs, args),
           "native_compiled_ips": timed(torch.compile(model), inputs, args)}
    if references:
        row["native_compiled_gemm_embed_ips"] = timed(torch.compile(oracle_forward(model, {}, gemm_embed(model))),
                                                      inputs, args)
    return row


def targets(res: Dict[str, Any]) -> Dict[str, Any]:
    """Issue #30's targets, read off the rows (ratios and whether each is met)."""
    out: Dict[str, Any] = {}

    def best(r):
        return max(r.get("dora_default_ips") or 0, r.get("dora_compiled_ips") or 0)

    for name, key, floor in (("vit_tiny_published", "vit", 1.0), ("deit_base_forced_369", "deit", 1.4)):
        r = res.get(name)
        if not r or "native_compiled_ips" not in r or "dora_default_ips" not in r:
            continue
        if r.get("oracle_compiled_ips"):
            ratio = best(r) / r["oracle_compiled_ips"]
            out[f"{key}_best_over_oracle_compiled"] = {"ratio": round(ratio, 3), "target": 0.9, "met": ratio >= 0.9}
        ratio = r["dora_default_ips"] / r["native_compiled_ips"]
        out[f"{key}_default_over_native_compiled"] = {"ratio": round(ratio, 3), "target": floor, "met": ratio >= floor}
        if "gate_off_default_ips" in r:
            ratio = r["gate_off_default_ips"] / r["native_compiled_ips"]
            out["deit_gate_off_default_over_native_compiled"] = {"ratio": round(ratio, 3), "target": 0.98,
                                                                 "met": ratio >= 0.98}
        if "by_batch" in r:
            out["deit_default_over_native_compiled_by_batch"] = {
                b: {"ratio": round(v["dora_default_ips"] / v["native_compiled_ips"], 3),
                    "met": v["dora_default_ips"] >= v["native_compiled_ips"]}
                for b, v in r["by_batch"].items() if "dora_default_ips" in v}
    # issue #60: the default forward within 10 % of its strongest oracle, every published actor and DeiT-B
    for name in ("vit_tiny_published", "deit_tiny_published", "deit_base_forced_369"):
        r = res.get(name) or {}
        oracles = [r[k] for k in ("oracle_compiled_ips", "oracle_compiled_gemm_embed_ips") if r.get(k)]
        if oracles and r.get("dora_default_ips"):
            ratio = r["dora_default_ips"] / max(oracles)
            out[f"{name}_default_over_best_oracle"] = {"ratio": round(ratio, 3), "target": 0.9, "met": ratio >= 0.9}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--configs", nargs="+", default=["vit_tiny_published", "deit_base_forced_369"],
                    choices=["vit_tiny_published", "deit_tiny_published", "deit_base_forced_369"])
    ap.add_argument("--deit-weights", default=None, help="DeiT-Ti weights (deit_tiny_published)")
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--images", type=int, default=1280, help="test images for ViT-Ti (whole batches)")
    ap.add_argument("--by-batch", type=int, nargs="*", default=[1, 8, 64, 257, 320])
    ap.add_argument("--compiled-only", action="store_true", help="only the compiled DORA rows (and eager for agreement)")
    ap.add_argument("--compile-modes", nargs="*", default=["default", "reduce-overhead"], choices=["default", "reduce-overhead"])
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device("cuda", "bf16")
    res: Dict[str, Any] = header(dev, "default_speed", argv, args, batch=args.batch)

    for config in (c for c in PUBLISHED if c in args.configs):  # the published actors on real test images
        model, actor = published(ap, config, args, dev, dtype)
        name, references = PUBLISHED[config][0], True
        loader = loader_for(model, args.data, "test", batch=args.batch, workers=4, limit=args.images)
        inputs = [x.to(dev, dtype) for x, *_ in loader if x.shape[0] == args.batch]
        row = {"actor": f"timm_dora/hub/actors/{name}", "images": sum(x.shape[0] for x in inputs)}
        if actor.merge:
            row["merge"] = True
        res[config] = row
        if not args.compiled_only:
            row.update(native_rows(model, inputs, args, references=references))
        dora_rows(model, lambda: actor, inputs, args, row=row, save=lambda: write_json(args.out, res),
                  references=references)
        del model, inputs

    if "deit_base_forced_369" in args.configs:
        model, forced, make = deit_forced(dev, dtype)
        inputs = make(args.batch)
        row = {}
        res["deit_base_forced_369"] = row
        row.update(native_rows(model, inputs, args))
        dora_rows(model, lambda: forced, inputs, args, row=row, save=lambda: write_json(args.out, res))
        timm_dora.wrap(model, policy=NoPrune())
        row["gate_off_default_ips"] = timed(model, inputs, args)
        timm_dora.unwrap(model)
        write_json(args.out, res)
        row["by_batch"] = {}
        for b in args.by_batch:
            if b == args.batch:  # the rows above, measured in this run
                row["by_batch"][str(b)] = {k: v for k, v in row.items() if k != "by_batch"}
                continue
            xs = make(b)
            row["by_batch"][str(b)] = {**native_rows(model, xs, args, references=False),
                                       **dora_rows(model, lambda: forced, xs, args, references=False)}
            write_json(args.out, res)
            write_json(args.out, res)
    res["targets"] = targets(res)
    write_json(args.out, res)
    for name in ("vit_tiny_published", "deit_tiny_published", "deit_base_forced_369"):
        r = res.get(name)
        if r:
            print(name, {k: (round(v) if isinstance(v, float) and v > 100 else v) for k, v in r.items() if k.endswith("ips")})


if __name__ == "__main__":
    main()
