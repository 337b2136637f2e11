#!/usr/bin/env bash
# Train (or resume) the published actors, four runs side by side on one GPU (issue #7).
#
#   MINUTES=8.5 RUNS=.runs7 CARRY=.carry7 OUT=/tmp/out bash benchmarks/train_actors.sh
#
# CARRY holds the backbone weights (bf16 safetensors: the backbone runs in bf16, so casting before
# or after the transfer gives the same tensors) and data/labels.csv with the rollout/qc/dev rows of
# ../shared/data/imagenet-mini (no test rows) plus data/sample1000. Each run resumes from
# RUNS/<name>/state.pt when it exists. The PPO update is host-bound (small kernels), so four
# processes share one GPU at little cost to each.
#
# Resuming across GPU calls (nothing on the device survives a call): SAVE_STATE=1 returns each run's
# state.pt in parts of < 16 MB (OUT/<name>.state.part.*) next to <name>.tgz (metrics, selection,
# the selected and the last checkpoint). Put them back under CARRY/resume/<name>/ (tgz unpacked
# there: metrics.jsonl, checkpoints/...; the parts as they are) and the next call continues the run
# exactly (e.g. `tar -xzf <name>.tgz -C CARRY/resume; cp <name>.state.part.* CARRY/resume/<name>/`).
# Only the selected checkpoint needs to travel: a later selection picks it or a newer one.
# One backbone per call fits the 64 MiB carry (bf16 weights 11 MB + data 30 MB + state 18.5 MB +
# one checkpoint 0.8 MB, with the repository's own files): gzip the weights
# (CARRY/<m>.bf16.safetensors.gz, 9.2 MB) and the state (CARRY/resume/<name>/state.pt.gz) when it
# is tight; both are unpacked here. RUNS itself did not survive between two calls to a warm machine
# (tried: the second call found neither RUNS nor CARRY), so every call carries what it resumes.
#
# AUGMENT=light|strong|none picks --augment (default light; strong adds RandAugment, a wider crop and
# label-free patch CutMix, see timm_dora/train/pool.py).
#
# Choices beyond the paper's recipe (said in the model cards): --augment (700-image pool), one QC
# shard of all 150 QC images (--qc-shards 1: 8 shards of 19 images would move d_u in 5.3 pp steps,
# coarser than the 1 pp target), training stopped by wall time rather than at 1,171 updates.
set -u
MINUTES=${MINUTES:-8.5}
RUNS=${RUNS:-.runs7}
CARRY=${CARRY:-.carry7}
OUT=${OUT:-/tmp/train_actors}
mkdir -p "$RUNS" "$OUT"
VIT=vit_tiny_patch16_224.augreg_in21k_ft_in1k
DEIT=deit_tiny_patch16_224.fb_in1k-approx
declare -A MODEL=([vit_tiny_t1.0]=$VIT [vit_tiny_t0.5]=$VIT [vit_tiny_t1.5]=$VIT [deit_tiny_t1.0]=$DEIT)
declare -A TARGET=([vit_tiny_t1.0]=0.01 [vit_tiny_t0.5]=0.005 [vit_tiny_t1.5]=0.015 [deit_tiny_t1.0]=0.01)
NAMES=${NAMES:-"vit_tiny_t1.0 deit_tiny_t1.0 vit_tiny_t0.5 vit_tiny_t1.5"}
# A name may carry a tag, NAME@TAG (e.g. vit_tiny_t1.0@ent05): same backbone and target as NAME, its
# own run folder and outputs (named NAME_TAG), for variants started with other flags (EXTRA, e.g.
# --init-actor).

(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 10 > "$OUT/gpu_util.csv" 2>/dev/null &)
pids=()
for name in $NAMES; do
  base=${name%%@*}
  m=${MODEL[$base]}
  [ -f "$CARRY/$m.bf16.safetensors.gz" ] && [ ! -f "$CARRY/$m.bf16.safetensors" ] && gunzip -k "$CARRY/$m.bf16.safetensors.gz"
  if [ -d "$CARRY/resume/$name" ] && [ ! -f "$RUNS/$name/state.pt" ]; then
    mkdir -p "$RUNS/$name"
    if [ -f "$CARRY/resume/$name/state.pt.gz" ]; then
      gunzip -c "$CARRY/resume/$name/state.pt.gz" > "$RUNS/$name/state.pt"
    else
      cat "$CARRY/resume/$name"/*state.part.* > "$RUNS/$name/state.pt"
    fi
    cp -r "$CARRY/resume/$name/metrics.jsonl" "$CARRY/resume/$name/checkpoints" "$RUNS/$name/"
  fi
  resume=""
  [ -f "$RUNS/$name/state.pt" ] && resume="--resume"
  OMP_NUM_THREADS=3 PYTHONUNBUFFERED=1 python3 -m timm_dora.train \
    --model "${m%%-approx}" --weights "$CARRY/$m.bf16.safetensors" --data "$CARRY/data/labels.csv" \
    --out "$RUNS/$name" --target-drop "${TARGET[$base]}" --augment "${AUGMENT:-light}" --qc-shards 1 \
    --checkpoint-every ${EVERY:-25} --max-minutes "$MINUTES" --no-progress --recipe paper --actor-width 128 $resume ${EXTRA:-} \
    > "$RUNS/$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for name in $NAMES; do
  tail -n 3 "$RUNS/$name.log"
  keep=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['selected']['name'])" "$RUNS/$name/selection.json")
  last=$(ls "$RUNS/$name/checkpoints" | tail -n 1)
  o=${name//@/_}  # the device tool does not return file names with '@'
  tar -czf "$OUT/$o.tgz" -C "$RUNS" "$name.log" "$name/metrics.jsonl" "$name/selection.json" "$name/selected" \
    "$name/checkpoints/$keep" "$name/checkpoints/$last" "$name/config.json" 2>/dev/null
  if [ "${SAVE_STATE:-0}" = 1 ]; then
    split -b 15000000 "$RUNS/$name/state.pt" "$OUT/$o.state.part."
  fi
done
exit $rc
