#!/usr/bin/env bash
# Issue 14 part 3 ablations of the long SmolLM2-135M-Instruct DSpark run (scripts/train_long.sh), one setting changed
# each, on the same feature cache, seed and data, so step by step they see the same batches:
#   base     the long run's recipe unchanged (the control: the long run itself began on less data)
#   layers2  two draft layers (initialised from the target's last two but one)
#   noinit   draft layer randomly initialised instead of from the target's second-to-last layer
#   decay7   loss decay constant 7 (the paper: the block size) instead of DeepSpec's 4
#   fullvocab the full 49,152-token vocabulary instead of the 8,192 draft ids (part 1; compared at equal CPU hours)
# Every ablation keeps the long run's schedule (wsd over 20,000 steps: the peak rate after warmup) and stops at
# STOP steps (stop_at_step), so it is the long run's first STOP steps with one thing changed; held-out tau every EVERY
# steps on 8 prompts, then the final drafter on FINAL_PROMPTS prompts (heldout<N>.json in the run folder).
#   RUNS=/work/runs STOP=120 bash scripts/train_ablations.sh base noinit decay7    # in turn, in the foreground
#   dspark-hf training-report --run base=$RUNS/smollm2-135m-ablation-base --run noinit=$RUNS/smollm2-135m-ablation-noinit \
#       ... --out results/training_smollm2_ablations     # the "At equal steps" table compares them
#   python scripts/heldout_tau.py --merge $RUNS/smollm2-135m-ablation-*/heldout24.json \
#       --out results/training_smollm2_ablations/heldout24.json   # the final drafters' table
# Resumable (re-running continues each from its newest checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs}
STOP=${STOP:-120}
EVERY=${EVERY:-60}
FINAL_PROMPTS=${FINAL_PROMPTS:-24}
DATA=${DATA:-data/smollm2-135m-12k,data/smollm2-135m}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ $# -gt 0 ] || { echo "usage: $0 {base|layers2|noinit|decay7|fullvocab} ..." >&2; exit 2; }
for name in "$@"; do
  case "$name" in
    base) extra=() ;;
    layers2) extra=(num_hidden_layers=2 "init_layers_from_target=[-3, -2]") ;;
    noinit) extra=(init_layers_from_target=null) ;;
    decay7) extra=(loss_decay=7.0) ;;
    fullvocab) extra=(draft_vocab_size=null eval_every=25 save_every=25) ;;  # STOP=100: what part 1 ran
    *) echo "unknown ablation $name (base, layers2, noinit, decay7, fullvocab)" >&2; exit 2 ;;
  esac
  out=$RUNS/smollm2-135m-ablation-$name
  [ "$name" = fullvocab ] && out=$RUNS/smollm2-135m-dspark-fullvocab
  echo "== $name -> $out"
  dspark-hf train --config examples/configs/smollm2-135m-dspark-long.yaml "data_dir=$DATA" \
      "feature_cache=$RUNS/features/smollm2-135m" "output_dir=$out" "stop_at_step=$STOP" eval_every=$EVERY ${extra[@]+"${extra[@]}"} \
      > "$RUNS/train_ablation_$name.log" 2>&1
  # the final drafter on 3x the held-out prompts of the in-run evaluations (less noise at equal steps)
  [ -f "$out/heldout$FINAL_PROMPTS.json" ] || python scripts/heldout_tau.py --target smollm2-135m-instruct \
      --num-prompts "$FINAL_PROMPTS" --drafter "$name=$out/final" --out "$out/heldout$FINAL_PROMPTS.json" \
      >> "$RUNS/train_ablation_$name.log" 2>&1
done
