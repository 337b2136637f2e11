"""Engine options A/B at small batches (not a test): DORA with each variant of ``EngineOptions`` and
native ``torch.compile(mode="reduce-overhead")``, in interleaved rounds of requests timed to the
logits on the host (p50, p99, images/s, plan misses), and the kernels of one request under the
profiler by family.

    VARIANTS='{"default": {}, "off": {"fused_deletion": false}}' CONFIGS=deit_base_forced BATCHES=1,8,16 \\
        python -m benchmarks.options_ab   # reads .carry/{vit,deit}_tiny.bf16.safetensors, .carry/data/labels_test.csv
                                          # (or VIT_WEIGHTS, DEIT_WEIGHTS, DATA)
"""
import argparse, json, os
import torch
from torch.profiler import profile, ProfilerActivity
import timm_dora
from timm_dora.engine.options import EngineOptions
from timm_dora.evaluate import inference_device
from benchmarks.serving_latency import config_and_pool, stream, summary

out = os.environ.get("OUT", "/tmp")
variants = json.loads(os.environ.get("VARIANTS", '{"default": {}, "fused_deletion": {"fused_deletion": true}}'))
configs = os.environ.get("CONFIGS", "vit_tiny_published,deit_tiny_published,deit_base_forced").split(",")
batches = [int(b) for b in os.environ.get("BATCHES", "1,8,16").split(",")]
reqs, rounds = int(os.environ.get("REQS", 150)), int(os.environ.get("ROUNDS", 3))
dev, dtype, _ = inference_device("cuda", "bf16")
args = argparse.Namespace(vit_weights=os.environ.get("VIT_WEIGHTS", ".carry/vit_tiny.bf16.safetensors"),
                          deit_weights=os.environ.get("DEIT_WEIGHTS", ".carry/deit_tiny.bf16.safetensors"),
                          data=os.environ.get("DATA", ".carry/data/labels_test.csv"))
res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "variants": variants, "reqs": reqs, "rounds": rounds}

def family(n):
    n = n.lower()
    for f, pats in [("memcpy", ["memcpy"]), ("memset", ["memset"]), ("gemm", ["nvjet", "gemm", "cutlass", "splitk"]),
                    ("attention", ["sdpa", "flash", "_varlen", "fmha"]), ("layer_norm", ["layer_norm"]),
                    ("actor_triton", ["_embed_qkv", "_out_ffn", "_gate", "_select", "_scores", "_budget", "_hist"]),
                    ("deletion_triton", ["_compact", "_gather_rows", "deletion"]),
                    ("scan_nonzero_sort", ["scan", "nonzero", "sort", "flag_kernel", "write_indices"]),
                    ("index_gather", ["gather", "index", "scatter"]), ("cat", ["cat"]), ("fill", ["fill"]),
                    ("copy_kernel", ["copy"]), ("reduce", ["reduce"])]:
        if any(p in n for p in pats):
            return f
    return "elementwise_math" if "elementwise" in n else "other:" + n[:40]

def kernels(fn, pool, b):
    with torch.inference_mode():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(pool[3:3 + b]).float().cpu(); torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fam = {}
    for e in evs:
        f = family(e.name); fam[f] = fam.get(f, 0) + 1
    return {"kernels": len(evs), "kernel_us": round(sum(e.time_range.elapsed_us() for e in evs), 1),
            "families": dict(sorted(fam.items(), key=lambda kv: -kv[1]))}

for config in configs:
    model, actor, pool = config_and_pool(argparse.ArgumentParser(), config, args, dev, dtype, 320)
    for b in batches:
        fns = {}
        torch._dynamo.reset()
        fns["native_ro"] = torch.compile(model, mode="reduce-overhead", dynamic=False)
        stream(fns["native_ro"], pool, b, 0, 60)
        row = {"native_ro": {"kernels": kernels(fns["native_ro"], pool, b)}}
        times = {k: [] for k in ["native_ro", *variants]}
        for v, opts in variants.items():
            timm_dora.wrap(model, actor, options=EngineOptions(**opts))
            stream(model, pool, b, 0, 100)
            row[v] = {"kernels": kernels(model, pool, b)}
            timm_dora.unwrap(model)
        for r in range(rounds):
            times["native_ro"] += stream(fns["native_ro"], pool, b, 60 + r * reqs, reqs)
            for v, opts in variants.items():
                timm_dora.wrap(model, actor, options=EngineOptions(**opts))
                stream(model, pool, b, 0, 30)
                times[v] += stream(model, pool, b, 100 + r * reqs, reqs)
                info = timm_dora.engine_info(model)
                row[v]["plan_misses"] = sum(s["plan_misses"] for s in info["batch_shapes"])
                timm_dora.unwrap(model)
        for k, ts in times.items():
            row[k].update(summary(ts, b))
        for v in variants:
            row[v]["vs_native_ro"] = round(row[v]["images_per_s"] / row["native_ro"]["images_per_s"], 3)
        res[f"{config}/{b}"] = row
        print(config, b, {k: (v["images_per_s"], v["p50_ms"], v["p99_ms"], v["kernels"]["kernels"], v["kernels"]["kernel_us"]) for k, v in row.items()}, flush=True)
        json.dump(res, open(f"{out}/ab_small.json", "w"), indent=1)
    del model, actor, pool; torch._dynamo.reset(); torch.cuda.empty_cache()
