"""Large batches: DORA's per-block executor against the planned whole graph and the compiled oracle.

In one process on one GPU (bf16), interleaved rounds (``--rounds`` x 15 x 2 forwards each, median ms
per batch) of: ``per_block`` (the default captured executor above ``EngineOptions.planned_max_batch``),
``planned`` (the same wrapped model under ``EngineOptions(planned=True)``: one graph per plan, no host
waits, rows bounded by the plan) and ``oracle_compiled`` (the dense slicing oracle at DORA's
realised per-block removal, ``torch.compile``), for ``vit`` (ViT-Ti, the published actor, ``test``
images: speed only) and ``deit`` (DeiT-B, random weights, the gate forced open at blocks 3/6/9),
at each ``--batches`` size. Also each plan's row bounds (``plans``) against the visual tokens the
batch kept (``seen_visual_tokens_sum``), to read the plan's padding.

    python -m benchmarks.planned_large --vit-weights W.safetensors --data labels.csv --batches 64 128 320 --out r.json
"""
import argparse
import copy
import json
from pathlib import Path

import torch

import timm_dora
from timm_dora import EngineOptions
from timm_dora.engine.options import using
from timm_dora.evaluate import environment, loader_for
from benchmarks.common import command_line, deit_forced, ms_per_batch, oracle_forward, vit_published


def planned(model):
    """``model`` run as one planned graph per forward, whatever the batch size."""
    def forward(x):
        with using(EngineOptions(planned=True)):
            return model(x)
    return forward


def plans(model) -> dict:
    return {str(r.batch): {"rows": list(r.plan.rows), "controls": list(r.plan.controls), "misses": r.plan_misses}
            for r in model._dora.graphs.values() if r.plan is not None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vit-weights", required=True)
    ap.add_argument("--data", required=True, help="labels CSV with a test split (ViT-Ti's images)")
    ap.add_argument("--configs", nargs="+", default=["vit", "deit"], choices=["vit", "deit"])
    ap.add_argument("--batches", type=int, nargs="+", default=[320])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = environment(dev, command_line("planned_large", argv))
    for cfg in args.configs:
        if cfg == "vit":
            model, actor = vit_published(args, dev, dtype)
            images = torch.cat([x for x, *_ in loader_for(model, args.data, "test", batch=320, workers=4, limit=640)])
            make = lambda b: [images[i * b:(i + 1) * b].to(dev, dtype) for i in range(2)]  # noqa: E731
        else:
            model, actor, make = deit_forced(dev, dtype)
        oracle_model = copy.deepcopy(model)
        timm_dora.wrap(model, actor)
        for b in args.batches:
            xs = make(b)
            with torch.inference_mode():
                for _ in range(5):
                    for x in xs:
                        model(x)
                st = model.dora_stats
                ks = {l: int(round(float(r))) for l, r in enumerate(st.removed.float().mean(0)) if r > 0}
                fns = {"per_block": model, "planned": planned(model),
                       "oracle_compiled": torch.compile(oracle_forward(oracle_model, ks))}
                for _ in range(5):
                    for fn in fns.values():
                        for x in xs:
                            fn(x)
                same = (fns["planned"](xs[0]).argmax(1) == fns["per_block"](xs[0]).argmax(1)).float().mean().item()
                rounds = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, fn in fns.items():
                        rounds[k].append(ms_per_batch(fn, xs, n=15))
            med = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
            r = {"median_ms": med, "rounds": rounds, "oracle_ks": ks,
                 "seen_visual_tokens_sum": [float(v) for v in st.tokens.sum(0).tolist()], "plans": plans(model),
                 "same_top1_planned_vs_perblock": same,
                 "planned_over_oracle": med["oracle_compiled"] / med["planned"],
                 "perblock_over_oracle": med["oracle_compiled"] / med["per_block"]}
            res[f"{cfg}_{b}"] = r
            print(cfg, b, json.dumps({k: r[k] for k in ("median_ms", "planned_over_oracle", "perblock_over_oracle")}),
                  flush=True)
            timm_dora.release_graphs(model)
        del model, oracle_model
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
