"""Where a small request's time goes: the planned whole graph against the request around it (not a test).

For each configuration (as in :mod:`benchmarks.serving_latency`), request size and variant of
``EngineOptions`` (``VARIANTS``-style JSON, ``--variants``), after 30 warm-up forwards, medians of
``--requests``:

- ``launch_us``: the host time of the whole graph's replay call (the GPU idle before it);
- ``replay_sync_us``: the replay and a device synchronisation;
- ``request_us``: a wrapped forward and ``logits.float().cpu()``, as a server sees it;
- ``gpu_us``: ``--requests`` replays back to back, timed with CUDA events: the graph's GPU time.

``request_us - replay_sync_us`` is the host's path around the graph (the images' copy, the plan's
check, the caller's copy to the host). Each variant is measured ``--rounds`` times, in turns.

    python -m benchmarks.request_path --vit-weights W --deit-weights W2 --data labels.csv \\
        --variants '{"aside": {}, "inline": {"aside_gates": false}}' --out request_path.json
"""
import argparse
import json
import statistics
import time

import torch

import timm_dora
from benchmarks.common import command_line
from benchmarks.serving_latency import CONFIGS, config_and_pool
from timm_dora.engine.options import EngineOptions
from timm_dora.evaluate import environment, inference_device


def measure(model, x: torch.Tensor, n: int) -> dict:
    """The four times of a wrapped ``model`` on batch ``x`` (its planned whole graph)."""
    with torch.inference_mode():
        for _ in range(30):
            model(x)
        runner = next(iter(model._dora.graphs.values()))
        key = next((k for k in runner.graphs if k[0] == "whole"), None)
        if key is None:
            raise RuntimeError(f"no whole graph: {timm_dora.engine_info(model)['graph_reason']}")
        graph = runner.graphs[key]
        launch, replay = [], []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            launch.append(1e6 * (t1 - t))
            replay.append(1e6 * (time.perf_counter() - t))
        request = []
        for _ in range(n):
            t = time.perf_counter()
            model(x).float().cpu()
            request.append(1e6 * (time.perf_counter() - t))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
    med = lambda v: round(statistics.median(v), 1)  # noqa: E731
    return {"launch_us": med(launch), "replay_sync_us": med(replay), "request_us": med(request),
            "gpu_us": round(start.elapsed_time(end) * 1000 / n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vit-weights", default=None)
    ap.add_argument("--deit-weights", default=None)
    ap.add_argument("--data", default=None, help="labels CSV with a test split (the published configs)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variants", default='{"default": {}}', help="JSON: name -> EngineOptions fields")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = json.loads(args.variants)
    dev, dtype, _ = inference_device("cuda", "bf16")
    res = {**environment(dev, command_line("request_path")), "variants": variants}
    for config in args.configs:
        model, actor, pool = config_and_pool(ap, config, args, dev, dtype, 16)
        for b in args.batches:
            row: dict = {}
            for _ in range(args.rounds):
                for name, options in variants.items():
                    timm_dora.wrap(model, actor, options=EngineOptions(**options))
                    try:
                        for k, v in measure(model, pool[:b], args.requests).items():
                            row.setdefault(name, {}).setdefault(k, []).append(v)
                    finally:
                        timm_dora.unwrap(model)
            res[f"{config}/{b}"] = row
            print(config, b, json.dumps(row), flush=True)
            json.dump(res, open(args.out, "w"), indent=1)
        del model, actor, pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
