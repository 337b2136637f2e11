#!/usr/bin/env bash
# Data-parallel training throughput: the same short ViT-Ti run on 1 GPU and on 2 GPUs (torchrun,
# NCCL with NVLink multicast left off). Needs the weights and a labels CSV:
#   bash benchmarks/ddp_rollout.sh WEIGHTS.safetensors LABELS.csv OUT_DIR
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-}:$(cd "$(dirname "$0")/.." && pwd)" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$1; DATA=$2; OUT=$3
common=(--model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights "$W" --data "$DATA" --updates 6
        --checkpoint-every 6 --no-progress --recipe paper --actor-width 128)
python3 -m timm_dora.train "${common[@]}" --out "$OUT/gpu1"
torchrun --standalone --nproc_per_node 2 -m timm_dora.train "${common[@]}" --out "$OUT/gpu2"
python3 - "$OUT" <<'PY'
import json, statistics, sys, torch
out = sys.argv[1]
res = {"command": "bash benchmarks/ddp_rollout.sh", "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
for n in (1, 2):
    rows = [json.loads(l) for l in open(f"{out}/gpu{n}/metrics.jsonl")]
    res[f"gpus_{n}"] = {
        "median_rollout_images_per_s": statistics.median(r["rollout_images_per_s"] for r in rows[1:]),
        "median_update_s": statistics.median(r["update_s"] for r in rows[1:]),
        "metrics": rows,
    }
    print(n, "GPU(s): rollout", round(res[f"gpus_{n}"]["median_rollout_images_per_s"]), "img/s, update",
          round(res[f"gpus_{n}"]["median_update_s"], 2), "s")
json.dump(res, open(f"{out}/ddp_rollout.json", "w"), indent=1)
PY
