#!/usr/bin/env bash
# Everything issue #7's report and issue #8's speed table need, in two GPU calls (H100, bf16).
#
#   CARRY=.carryE OUT=/tmp/report PART=1 bash benchmarks/report_device.sh   # compare + evals (~5 min)
#   OUT=/tmp/report PART=2 bash benchmarks/report_device.sh                  # speed (~9 min, no carry)
#
# CARRY: bf16 backbone weights (the backbone runs in bf16), data/labels.csv with the test rows of
# ../shared/data/imagenet-mini and data/val1300, actors/deit_uNNNNN (other DeiT-Ti checkpoints,
# for the trade-off). The published actors come from hub/. Reduced timing protocol (the device
# budget is 30 minutes a session): 30 + 30 forwards x 3 repeats for compare.py, 50 + 50 x 3 for
# throughput.py; the full App. E.5 protocol is their default.
set -u -o pipefail
C=${CARRY:-.carryE}
R=$OUT/r
mkdir -p "$R"
export PYTHONPATH=. PYTHONUNBUFFERED=1
V=vit_tiny_patch16_224.augreg_in21k_ft_in1k
D=deit_tiny_patch16_224.fb_in1k
WV=$C/$V.bf16.safetensors
WD=$C/deit_tiny_patch16_224.fb_in1k-approx.bf16.safetensors
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@" || echo "!! exit $? : $*"; }

PART=${PART:-all}  # 1: accuracy/compare part, 2: speed part; "all" exceeds one 10-minute GPU call
if [ "$PART" != 2 ]; then
step 270 python3 benchmarks/compare.py --models $V $D --weights "$WV" "$WD" \
  --actor hub/$V hub/$D --data "$C/data/labels.csv" --split test --cuda-graphs \
  --warmup 30 --iters 30 --repeats 3 --out "$R"
for a in $(ls "$C/actors" | grep '^deit_u'); do
  step 40 python3 -m timm_dora.cli eval --model $D --weights "$WD" --actor "$C/actors/$a" \
    --data "$C/data/labels.csv" --split test --quiet --out "$R/eval_$a.json"
done
fi
if [ "$PART" != 1 ]; then
step 340 python3 benchmarks/throughput.py --models deit_base_patch16_224 vit_tiny_patch16_224 \
  --warmup 50 --iters 50 --repeats 3 --out "$R/throughput_h100.json"
step 90 python3 benchmarks/profile_forward.py --out "$R/profile_h100.json"
step 120 python3 benchmarks/gpu_check.py --out "$R/gpu_check_h100.json"
fi
ls -la "$R"
