"""Where the peak allocated memory is (a diagnostic, CUDA only): replay the allocator trace of two
forwards of batch 320 after two untraced ones, and list the blocks live at the traced peak by their
innermost timm_dora/timm frame (blocks allocated before the trace, such as the graphs' pools,
count in "allocated before" only).

    python benchmarks/memory_peak.py vit_tiny_patch16_224 native|actor|actor_graphs

``actor``: an untrained actor whose gate opens at blocks 3, 6 and 9 (``throughput.gate_forced_actor``).
"""
import sys, json, collections
import torch, timm
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import timm_dora
from throughput import gate_forced_actor
name = sys.argv[1]; mode = sys.argv[2]
torch.manual_seed(0)
dev, dt = torch.device("cuda"), torch.bfloat16
model = timm.create_model(name, pretrained=False).eval().to(dev, dt)
x = torch.randn(320, 3, 224, 224, device=dev, dtype=dt)
if mode != "native":
    graphs = mode.endswith("graphs")
    timm_dora.wrap(model, gate_forced_actor(model, [3, 6, 9]).to(dev, dt), cuda_graphs=graphs)
with torch.inference_mode():
    for _ in range(2):
        model(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    model(x); model(x)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
peak = torch.cuda.max_memory_allocated()
print(f"{name} {mode}: allocated before {base/2**20:.1f} MiB, peak {peak/2**20:.1f} MiB, peak over base {(peak-base)/2**20:.1f} MiB")
events = [e for t in snap["device_traces"] for e in t]
live, cur, best, best_live = {}, 0, -1, None
def where(e):
    fr = e.get("frames", [])
    for f in fr:
        fn = f.get("filename", "")
        if "timm_dora" in fn or "/timm/" in fn:
            return f"{fn.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return fr[0].get("name") if fr else "?"
for e in events:
    if e["action"] == "alloc":
        live[e["addr"]] = (e["size"], where(e)); cur += e["size"]
        if cur > best:
            best, best_live = cur, dict(live)
    elif e["action"] in ("free_requested",):
        if e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
print(f"traced peak over the blocks live before tracing: {best/2**20:.1f} MiB")
agg = collections.Counter()
for size, w in best_live.values():
    agg[w] += size
for w, s in agg.most_common(14):
    print(f"  {s/2**20:8.1f} MiB  {w}")
