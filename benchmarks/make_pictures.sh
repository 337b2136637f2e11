#!/usr/bin/env bash
# Every picture in docs/ from the committed results and the published actors (CPU, a minute or two):
#
#   bash benchmarks/make_pictures.sh            # SHARED=../shared (real ViT-Ti weights and images)
#
# tradeoff: top-1 against GFLOPs of DORA, ToMe and static schedules on `test` (compare_strong/, H100);
# training: the published actors' runs (benchmarks/results/train/*_strong_metrics.jsonl);
# trajectory and policy: the published ViT-Ti actor on the real backbone, dev images (fp32 CPU).
# Each picture is written with its numbers as JSON next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
R=benchmarks/results
V=vit_tiny_patch16_224.augreg_in21k_ft_in1k
DATA=$SHARED/data/imagenet-mini

timm-dora viz tradeoff --results $R/compare_strong/compare_*.json --format png --out docs --name tradeoff_h100 \
    --title "test split (1,300 images), H100 bf16: DORA (published actors), ToMe, static schedules"
for run in vit_tiny deit_tiny; do
    timm-dora viz training --metrics $R/train/${run}_t1.0_strong_metrics.jsonl --target 0.01 --format png --out docs \
        --name training_${run}_h100_strong --title "${run}: the published actor's run (--augment strong, 1 pp target)"
done
timm-dora viz trajectory --model $V --weights "$SHARED/weights/$V.safetensors" --format png --out docs \
    --dpi 70 --name trajectory_vit_tiny --images "$DATA/sample1000/n01580077.jpg" "$DATA/sample1000/n01582220.jpg" \
    "$DATA/sample1000/n01669191.jpg" "$DATA/sample1000/n01784675.jpg"
timm-dora viz policy --model $V --weights "$SHARED/weights/$V.safetensors" --data "$DATA/labels.csv" --split dev \
    --format png --out docs --name policy_vit_tiny
