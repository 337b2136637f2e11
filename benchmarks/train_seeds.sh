#!/usr/bin/env bash
# Train several actors side by side, one process per GPU (issue #29: the seeds of a recipe).
#
#   CARRY=.carry MINUTES=8.7 OUT=/tmp/out bash benchmarks/train_seeds.sh \
#       vit_s0=vit:0:"--target-disagreement 0.10" deit_s0=deit:0:"--target-disagreement 0.08"
#
# Each argument is NAME=BACKBONE:SEED:EXTRA (BACKBONE vit or deit, EXTRA more timm-dora-train flags).
# Every run gets RECIPE (below: the small-pool recipe of docs/training.md) and --max-minutes MINUTES,
# and GPU i % (number of GPUs). CARRY holds <model>.bf16.safetensors(.gz) for each backbone and
# data/labels.csv with the rollout/qc/dev rows of ../shared/data/imagenet-mini (no test rows) beside
# data/sample1000. What comes back, per run: OUT/NAME.tgz (log, metrics.jsonl, selection.json,
# config.json, selected/ and every checkpoint), for benchmarks/tradeoff.py and the model cards.
set -u
CARRY=${CARRY:-.carry}
MINUTES=${MINUTES:-8.7}
OUT=${OUT:-/tmp/train_seeds}
RUNS=${RUNS:-/tmp/runs}
# the third round's flags (the small-pool recipe's, and the paper's actor width, which the fourth round's
# EXTRA --actor-width overrides): the documented runs as they ran, whatever the defaults become
RECIPE=${RECIPE:-"--feedback-signal disagreement --qc-with-rollout --qc-with-dev --qc-shards 1 --selection fit --checkpoint-every 100 --actor-width 128"}
declare -A MODEL=([vit]=vit_tiny_patch16_224.augreg_in21k_ft_in1k [deit]=deit_tiny_patch16_224.fb_in1k)
declare -A WEIGHTS=([vit]=vit_tiny_patch16_224.augreg_in21k_ft_in1k [deit]=deit_tiny_patch16_224.fb_in1k-approx)
[ $# -ge 1 ] || { echo "usage: bash benchmarks/train_seeds.sh NAME=BACKBONE:SEED:EXTRA ... (BACKBONE vit or deit)" >&2; exit 2; }
names=(); bbs=(); seeds=(); extras=()
for spec in "$@"; do  # every run parsed and checked before any starts
  rest=${spec#*=}; bb=${rest%%:*}; rest=${rest#*:}; seed=${rest%%:*}; extra=${rest#*:}
  [ -n "${MODEL[$bb]:-}" ] && [ "${spec%%=*}" != "$spec" ] || { echo "train_seeds.sh: bad run '$spec': expected NAME=vit|deit:SEED[:EXTRA]" >&2; exit 2; }
  [ "$extra" = "$seed" ] && extra=""
  names+=("${spec%%=*}"); bbs+=("$bb"); seeds+=("$seed"); extras+=("$extra")
done
mkdir -p "$RUNS" "$OUT"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
(nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader -l 15 > "$OUT/gpu_util.csv" 2>/dev/null &)
pids=()
for i in "${!names[@]}"; do
  name=${names[$i]}; bb=${bbs[$i]}
  w="$CARRY/${WEIGHTS[$bb]}.bf16.safetensors"
  [ -f "$w" ] || gunzip -k "$w.gz"
  CUDA_VISIBLE_DEVICES=$((i % gpus)) OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 python3 -m timm_dora.train \
    --model "${MODEL[$bb]}" --weights "$w" --data "$CARRY/data/labels.csv" --out "$RUNS/$name" --seed "${seeds[$i]}" \
    --max-minutes "$MINUTES" --no-progress $RECIPE ${extras[$i]} > "$RUNS/$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for name in "${names[@]}"; do
  echo "== $name"; tail -n 2 "$RUNS/$name.log"
  tar -czf "$OUT/$name.tgz" -C "$RUNS" "$name.log" "$name/metrics.jsonl" "$name/selection.json" "$name/config.json" \
    "$name/selected" "$name/checkpoints" 2>/dev/null
done
exit $rc
