#!/bin/bash
# #7 pool-size study: DeiT-Ti, published recipe (strong augmentation, 1 pp), 700 vs 350 rollout images, side by side
# (one H100 call, 8.6 minutes each: 83 / 82 updates). .carry7 held the bf16 weights and data/labels.csv
# with the rollout/qc/dev rows of ../shared/data/imagenet-mini (not committed: data); labels_pool350.csv
# is the same file with every second rollout row (in file order) renamed to split "rollout_unused"
# (350 rollout, 350 rollout_unused, 150 qc, 150 dev).
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.
M=${MINUTES:-8.6}
MINUTES=$M AUGMENT=strong EVERY=25 CARRY=.carry7 RUNS=.runsP OUT=$OUT NAMES="deit_tiny_t1.0@pool700" bash benchmarks/train_actors.sh > $OUT/p700.txt 2>&1 &
MINUTES=$M AUGMENT=strong EVERY=25 CARRY=.carry7 RUNS=.runsP OUT=$OUT NAMES="deit_tiny_t1.0@pool350" EXTRA="--data .carry7/data/labels_pool350.csv" bash benchmarks/train_actors.sh > $OUT/p350.txt 2>&1 &
wait
tail -3 $OUT/p700.txt $OUT/p350.txt
ls -la $OUT
# Second pair (another H100 call, 77 updates each): the same two lines with NAMES
# "deit_tiny_t1.0@pool700s2" / "deit_tiny_t1.0@pool350s2" and --seed 1 added to EXTRA (results
# deit_tiny_t1.0_pool{700,350}s2_*).
