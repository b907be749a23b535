#!/usr/bin/env bash
# Issue 14, part 3: continue a finished DSpark run on more data. The 1,200-step drafter of
# scripts/train_dspark_vs_dflash.sh (1,024 examples) is trained on 2,560 examples for another 1,200 steps (warm start:
# `init_from`, fresh optimizer and wsd schedule), then compared on 24 held-out prompts with the release drafter and
# the drafter it started from.
#   RUNS=/work/runs bash scripts/train_warm_more_data.sh
# From the release drafter instead (the next run, started in the background, resumable across sessions):
#   FROM=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark OUTDIR=/work/runs/release-2560-warm STEPS=2400 \
#     HELDOUT=results/heldout_tau/smollm2_release_2560_warm.json RUNS=/work/runs bash scripts/train_warm_more_data.sh
# Needs $RUNS/dspark-1024-1200/final (scripts/train_dspark_vs_dflash.sh makes it). Resumable: re-running continues
# from the newest checkpoint in $RUNS/dspark-2560-warm. The feature cache grows to the new examples first (target
# forwards, about 25 minutes on one core). fp32 (AVX2-only CPUs convert bf16 slowly; MIXED=bf16 on AMX machines).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs}
EXAMPLES=${EXAMPLES:-2560}
STEPS=${STEPS:-1200}
FROM=${FROM:-$RUNS/dspark-1024-1200/final}
OUTDIR=${OUTDIR:-$RUNS/dspark-$EXAMPLES-warm}
MIXED=${MIXED:-no}
HELDOUT=${HELDOUT:-results/heldout_tau/smollm2_dspark_2560_warm.json}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$(basename "$FROM")" = final ]; then START_LABEL=$(basename "$(dirname "$FROM")"); else START_LABEL=$(basename "$FROM"); fi
dspark-hf train --config examples/configs/smollm2-135m-dspark-long.yaml \
    "feature_cache=$RUNS/features/smollm2-135m-bf16" feature_cache_dtype=bfloat16 "max_examples=$EXAMPLES" \
    "max_steps=$STEPS" eval_every=400 save_every=100 "mixed_precision=$MIXED" "init_from=$FROM" "output_dir=$OUTDIR" \
    > "$OUTDIR.log" 2>&1
python scripts/heldout_tau.py --target smollm2-135m-instruct --num-prompts 24 --threads 1 \
    --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark \
    --drafter "$START_LABEL=$FROM" --drafter "$(basename "$OUTDIR")=$OUTDIR/final" --out "$HELDOUT"
