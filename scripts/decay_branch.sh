#!/usr/bin/env bash
# Branch a wsd run off at one checkpoint and decay it: the usual way to read a warmup-stable-decay run mid-way
# (its stable phase keeps the peak learning rate, so its checkpoints are not at their best until decayed).
#   RUNS=/work/runs bash scripts/decay_branch.sh smollm2-135m-dspark-long 400 100
# copies $RUNS/<run>/checkpoint-000400 (and the run's logs up to step 400) into $RUNS/<run>-decay500 and trains steps
# 401..500 with the learning rate falling linearly to 0 (max_steps=500, decay_fraction=100/500), the rest of the
# recipe unchanged (examples/configs/smollm2-135m-dspark-long.yaml; extra key=value arguments override it). The
# original run is not touched and can keep going. Held-out tau is measured at the end (heldout.jsonl, 8 prompts) and
# the final drafter on FINAL_PROMPTS held-out prompts (heldout<N>.json, scripts/heldout_tau.py). Resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs}
FINAL_PROMPTS=${FINAL_PROMPTS:-24}
[ $# -ge 3 ] || { echo "usage: $0 RUN STEP DECAY_STEPS [key=value ...]" >&2; exit 2; }
run=$1 step=$2 steps=$3
shift 3
src=$RUNS/$run
ckpt=$src/checkpoint-$(printf %06d "$step")
total=$((step + steps))
out=$RUNS/$run-decay$total
[ -d "$ckpt" ] || { echo "no checkpoint $ckpt" >&2; exit 1; }
if [ ! -d "$out" ]; then
  mkdir -p "$out.tmp"
  cp -r "$ckpt" "$out.tmp/"
  for log in log.jsonl heldout.jsonl; do  # the history up to the branch point, so training-report shows one curve
    [ -f "$src/$log" ] && python -c "import json,sys; [print(l, end='') for l in open(sys.argv[1]) if l.strip() and json.loads(l)['step'] <= int(sys.argv[2])]" "$src/$log" "$step" > "$out.tmp/$log"
  done
  mv "$out.tmp" "$out"
fi
fraction=$(python -c "print($steps / $total)")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
dspark-hf train --config examples/configs/smollm2-135m-dspark-long.yaml \
    "data_dir=${DATA:-data/smollm2-135m-12k,data/smollm2-135m}" "feature_cache=$RUNS/features/smollm2-135m" \
    "output_dir=$out" "max_steps=$total" "decay_fraction=$fraction" eval_every=50 "$@" > "$out.log" 2>&1
[ -f "$out/heldout$FINAL_PROMPTS.json" ] || python scripts/heldout_tau.py --target smollm2-135m-instruct \
    --num-prompts "$FINAL_PROMPTS" --drafter "$run-decay$total=$out/final" --out "$out/heldout$FINAL_PROMPTS.json" \
    >> "$out.log" 2>&1
echo "done: $out"
