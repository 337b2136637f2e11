#!/usr/bin/env bash
# Every picture in docs/ from the committed results and the published actors (CPU, a minute or two):
#
#   bash benchmarks/make_pictures.sh            # SHARED=../shared (real ViT-Ti weights and images)
#
# comparison_h200: top-1 against GFLOPs and throughput of the paper's comparison set (DORA's calibrated curve,
#   ToMe, PiToMe, MCTF, DiffRate, Representation Shift, Zero-TPrune, V-Pruner) on `test`
#   (benchmarks/results/baselines_{vit,deit}_tiny.json, H200);
# tradeoff_h100: top-1 against GFLOPs and throughput of DORA (the published actors), ToMe and static
#   schedules on `test` (benchmarks/results/compare/, H100);
# tradeoff_vit_tiny: drop against GFLOPs on `test` of DORA's seeds (the published actor's three
#   distillation seeds, width 32) and checkpoints (its teacher, a width-64 student), the static and
#   ToMe sweeps and the random selector (benchmarks/results/tradeoff_vit_tiny.json, H100);
# tradeoff_deit_tiny: the same for DeiT-Ti (benchmarks/results/tradeoff_deit_tiny.json: the fifteenth round's four
#   stage-3 seeds calibrated to -35.75 %, the published one chosen on the pool, the seeds before calibration and the
#   actor published before, H100);
# tradeoff_deit_tiny_continued: the fourth round's --actor-width 64 seeds (stage 1,
#   benchmarks/results/tradeoff_deit_tiny_w64.json) beside the fifth round (a second training stage,
#   width-32 students; benchmarks/results/tradeoff_deit_tiny_continued.json, H100);
# tradeoff_actor_width: the paper's actor against narrower ones at the same recipe and targets (issue #29's
#   fourth round: ViT-Ti 7.5 % width 128 / 32, DeiT-Ti 8 % width 128 / 64; H100);
# tradeoff_pool_disagreement: the same for the pool-wide label-free feedback (issue #29's third round:
#   ViT-Ti at 10 % and 7.5 % disagreement, DeiT-Ti at 8 %; benchmarks/results/tradeoff_*_pool_t*.json, H100);
# training: the PPO runs of the published actors (of the ViT-Ti actor's teacher) (benchmarks/results/train/*_metrics.jsonl.gz);
# trajectory and policy: the published ViT-Ti actor on the real backbone, dev images (fp32 CPU).
# Each picture is written with its numbers as JSON next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
R=benchmarks/results
V=vit_tiny_patch16_224.augreg_in21k_ft_in1k
DATA=$SHARED/data/imagenet-mini

timm-dora viz tradeoff --results $R/baselines_vit_tiny.json $R/baselines_deit_tiny.json --format png --out docs \
    --name comparison_h200
timm-dora viz tradeoff --results $R/compare/compare_*.json --format png --out docs --name tradeoff_h100 \
    --title "test split (1,300 images), H100 bf16: DORA (published actors), ToMe, static schedules"
timm-dora viz tradeoff --results $R/tradeoff_vit_tiny.json --format png --out docs --name tradeoff_vit_tiny \
    --title "ViT-Ti, test split: DORA (width-32 students of the paper-recipe actor, 3 seeds), static and ToMe sweeps"
timm-dora viz tradeoff --results $R/tradeoff_deit_tiny.json --format png --out docs --name tradeoff_deit_tiny \
    --title "DeiT-Ti, test split: DORA (stage 3 from the merging student, calibrated to -35.75 %; 4 seeds), static and ToMe sweeps"
timm-dora viz tradeoff --results $R/tradeoff_deit_tiny_w64.json $R/tradeoff_deit_tiny_continued.json --format png --out docs \
    --name tradeoff_deit_tiny_continued \
    --title "DeiT-Ti, test split: stage 1 (left) and the fifth round's second stage, width-32 students (right)"
timm-dora viz tradeoff --results $R/tradeoff_vit_tiny_pool_t075.json $R/tradeoff_vit_tiny_pool_w32.json \
    $R/tradeoff_deit_tiny_pool_t080.json $R/tradeoff_deit_tiny_w64.json --format png --out docs --name tradeoff_actor_width \
    --title "test split: the paper's actor (width 128) against narrower ones (ViT-Ti 32, DeiT-Ti 64), same recipe and targets"
timm-dora viz tradeoff --results $R/tradeoff_vit_tiny_pool_t100.json $R/tradeoff_vit_tiny_pool_t075.json \
    $R/tradeoff_deit_tiny_pool_t080.json --format png --out docs --name tradeoff_pool_disagreement \
    --title "test split: DORA with pool-wide disagreement feedback (ViT-Ti 10 %, ViT-Ti 7.5 %, DeiT-Ti 8 %), static, ToMe"
timm-dora viz training --metrics $R/train/vit_tiny_paper_full_metrics.jsonl.gz --target 0.01 --format png --out docs \
    --name training_vit_tiny_h100_paper --title "vit_tiny: the published actor's teacher's run (the paper's recipe, seed 0)"
timm-dora viz training --metrics $R/train/deit_tiny_t1.0_strong_metrics.jsonl.gz --target 0.01 --format png --out docs \
    --name training_deit_tiny_h100_strong --title "deit_tiny: the earlier published actor's run (--augment strong, 1 pp target)"
timm-dora viz trajectory --model $V --weights "$SHARED/weights/$V.safetensors" --format png --out docs \
    --dpi 70 --name trajectory_vit_tiny --images "$DATA/sample1000/n01580077.jpg" "$DATA/sample1000/n01582220.jpg" \
    "$DATA/sample1000/n01669191.jpg" "$DATA/sample1000/n01784675.jpg"
timm-dora viz policy --model $V --weights "$SHARED/weights/$V.safetensors" --data "$DATA/labels.csv" --split dev \
    --format png --out docs --name policy_vit_tiny
