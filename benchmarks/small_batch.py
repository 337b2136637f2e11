"""Small batches: the whole-forward graphs against the per-block executor and native (not a test).

For each configuration of ``benchmarks.default_speed`` (``deit_tiny_published`` with ``--deit-weights``: the
merging DeiT-Ti actor) and each batch size of ``--batches``, in one process
on one GPU (bf16, the timing protocol of :func:`timm_dora.evaluate.bench.time_forward`):
``native_compiled_ips`` and ``native_compiled_ro_ips`` (the timm model under ``torch.compile``,
default mode and ``mode="reduce-overhead"``, which replays CUDA graphs), and the wrapped model with
default options run by each captured executor (:mod:`timm_dora.engine.whole`): ``whole_ips`` (the
forward as one graph at ``B*S`` rows), ``planned_ips`` (one graph per plan, checked after each
forward) and ``per_block_ips`` (:mod:`timm_dora.engine.graphs`), with ``same_decisions_pct``, the
images whose per-block removals agree between the whole graph and the per-block executor
(``planned_same_decisions_pct``: the planned graph and the per-block executor). The crossovers set
``EngineOptions.whole_max_batch`` and ``planned_max_batch``.

    python -m benchmarks.small_batch --vit-weights W.safetensors --data labels.csv --out <json>
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List

import torch

import timm_dora
from timm_dora import EngineOptions
from timm_dora.evaluate import inference_device, loader_for, write_json
from benchmarks.common import add_common_args, deit_forced, header, published, timed


def rows(model, actor, inputs: List[torch.Tensor], args) -> Dict[str, Any]:
    torch._dynamo.reset()
    row: Dict[str, Any] = {"native_compiled_ips": timed(torch.compile(model), inputs, args)}
    torch._dynamo.reset()
    row["native_compiled_ro_ips"] = timed(torch.compile(model, mode="reduce-overhead"), inputs, args)
    removed = {}
    for name, (whole, planned) in (("whole", (True, False)), ("planned", (False, True)), ("per_block", (False, False))):
        timm_dora.wrap(model, actor, options=EngineOptions(whole=whole, planned=planned))
        row[f"{name}_ips"] = timed(model, inputs, args)
        with torch.inference_mode():
            model(inputs[0])
        removed[name] = model.dora_stats.removed.clone()
        timm_dora.unwrap(model)
    same = lambda a: 100.0 * float((removed[a] == removed["per_block"]).all(1).float().mean())
    row["same_decisions_pct"], row["planned_same_decisions_pct"] = same("whole"), same("planned")
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--configs", nargs="+", default=["deit_base_forced_369", "vit_tiny_published"],
                    choices=["deit_base_forced_369", "vit_tiny_published", "deit_tiny_published"])
    ap.add_argument("--deit-weights", default=None, help="DeiT-Ti weights (deit_tiny_published)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device("cuda", "bf16")
    res: Dict[str, Any] = header(dev, "small_batch", argv, args)
    for config in args.configs:
        if config == "deit_base_forced_369":
            model, actor, make = deit_forced(dev, dtype)
        else:
            model, actor = published(ap, config, args, dev, dtype)
            pool = torch.cat([x for x, *_ in loader_for(model, args.data, "test", batch=64, workers=4,
                                                        limit=2 * max(args.batches))]).to(dev, dtype)
            make = lambda b: [pool[:b], pool[b:2 * b]]
        res[config] = {}
        for b in args.batches:
            res[config][str(b)] = rows(model, actor, make(b), args)
            print(config, b, {k: round(v) for k, v in res[config][str(b)].items()}, flush=True)
            write_json(args.out, res)
        del model


if __name__ == "__main__":
    main()
