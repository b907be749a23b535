"""`python scripts/collect_results.py`: gathers the Markdown tables that the committed scripts wrote under `results/` into RESULTS.md.

Each section names the command that regenerates it. Nothing here measures anything; it only assembles, so every
number in RESULTS.md comes from a run of one of those commands (JSON with provenance sits next to each table).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark_hf.provenance import atomic_write_text

LEASE = ("bash scripts/gpu_wheels.sh .whl && python scripts/gpu_train_drafters.py prepare --target smollm2-135m-instruct --out .gpu --part-mb 39.5, then the two lease calls in the docstring of scripts/gpu_train_drafters.py (call 2: `PYTHONPATH=/tmp/site:src python3 scripts/gpu_train_drafters.py run --manifest .gpu/manifest.json --parts /tmp/dspark-parts .gpu --runs dspark,dflash,dspark-2l --budget 490 --hard-stop 568 --out $OUT --work /tmp/dspark-work --threads 4`), then python scripts/gpu_train_drafters.py unpack --files <returned files> --dest /work/runs/gpu-drafters")

QWEN_CPU_TRAIN = ("dspark-hf fetch-target qwen2.5-coder-0.5b-instruct && dspark-hf train --config "
                  "examples/configs/qwen2.5-coder-0.5b-dspark-cpu.yaml")
QWEN_CPU_CALIBRATE = ("OMP_NUM_THREADS=1 dspark-hf calibrate --drafter /work/runs/qwen2.5-coder-0.5b-dspark-cpu/final "
                      "--target qwen2.5-coder-0.5b-instruct --prompts data/heldout_prompts.jsonl --limit 48 "
                      "--fit-fraction 0.5 --max-new-tokens 64 --batch-size 8 --out "
                      "/work/runs/qwen2.5-coder-0.5b-dspark-cpu/calibrated --report-dir "
                      "results/calibration_qwen2.5-coder-0.5b_cpu")
QWEN_CPU_BENCH = ("python scripts/bench_lookup.py --target qwen2.5-coder-0.5b-instruct --drafter "
                  "/work/runs/qwen2.5-coder-0.5b-dspark-cpu/calibrated --gqa-attention --methods target-only/packed "
                  "prompt-lookup/packed dspark dspark+sps lookup lookup+dspark --prompts 4 --max-new-tokens 64 "
                  "--out results/lookup_qwen2.5-coder-0.5b_drafter")
QWEN_EVALFORM = "RUNS=/work/runs bash scripts/train_qwen_evalform.sh"
QWEN_EVALFORM2 = "RUNS=/work/runs ROUND=2 THREADS=1 bash scripts/train_qwen_evalform.sh"
_PAIR = "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 "
_PAIR_CACHED = _PAIR + "SEQUENTIAL=1 TAG=-topk64-v2 ARGS=teacher_topk=64 "
CHEAPER_PAIR = (_PAIR_CACHED + "OUT=results/training_smollm2_cheaper_step "
                "HELDOUT=results/heldout_tau/smollm2_cheaper_step.json bash scripts/train_dspark_vs_dflash.sh")
R512_PAIR = (CHEAPER_PAIR + " && " + _PAIR + "VARIANTS=dspark DFLASH_TAG=-topk64-v2 TAG=-topk64-r512 "
             "ARGS=teacher_topk=64 DSPARK_ARGS=markov_rank=512 OUT=results/training_smollm2_r512_vs_dflash "
             "HELDOUT=results/heldout_tau/smollm2_r512_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh")
R512_SEED1 = (_PAIR + "PREFILL=300 TAG=-s1-topk64-r512 ARGS='seed=1 teacher_topk=64' DSPARK_ARGS=markov_rank=512 "
              "OUT=results/training_smollm2_r512_seed1 HELDOUT=results/heldout_tau/smollm2_r512_seed1.json "
              "bash scripts/train_dspark_vs_dflash.sh")
def _variant(before: str, dflash_tag: str, tag: str, args: str, dspark_args: str, name: str) -> str:
    """A DSpark run against the DFlash run of an earlier pair (`before`, the command that trains it)."""
    return (before + " && " + _PAIR + f"VARIANTS=dspark DFLASH_TAG={dflash_tag} TAG={tag} ARGS={args} "
            f"DSPARK_ARGS='{dspark_args}' OUT=results/training_smollm2_loss_weights_{name} "
            f"HELDOUT=results/heldout_tau/smollm2_loss_weights_{name}.json bash scripts/train_dspark_vs_dflash.sh")


def _calibrate(before: str, run: str, name: str, size: str = "1024-1200") -> str:
    """`dspark-hf calibrate` on 48 held-out prompts (24 fit STS, 24 measure it) of the drafter in
    /work/runs/<run>-<size> (size: examples-steps)."""
    out = f"/work/runs/calibrated-{run}" + ("" if size == "1024-1200" else f"-{size}")
    return (before + f" && OMP_NUM_THREADS=1 dspark-hf calibrate --drafter /work/runs/{run}-{size}/final "
            f"--target smollm2-135m-instruct --prompts data/heldout_prompts.jsonl --limit 48 --fit-fraction 0.5 "
            f"--max-new-tokens 64 --batch-size 16 --out {out} "
            f"--report-dir results/calibration_loss_weights/{name}")


LOSS_WEIGHTS = {name: _variant(R512_SEED1, "-s1-topk64-r512", f"-s1-topk64-r512-{tag}", "'seed=1 teacher_topk=64'",
                               f"markov_rank=512 {arg}", name)
                for name, tag, arg in (("ce1", "ce1", "alpha_ce=1.0"), ("conf01", "conf01", "alpha_conf=0.1"),
                                       ("ce1_conf01", "ce1conf01", "alpha_ce=1.0 alpha_conf=0.1"),
                                       ("conf_detach", "confdetach", "detach_confidence_inputs=true"))}
CONF_DETACH_SEED0 = _variant(CHEAPER_PAIR, "-topk64-v2", "-topk64-r512-confdetach", "teacher_topk=64",
                             "markov_rank=512 detach_confidence_inputs=true", "conf_detach_seed0")
CE1_SEED0 = _variant(CHEAPER_PAIR, "-topk64-v2", "-topk64-r512-ce1", "teacher_topk=64", "markov_rank=512 alpha_ce=1.0",
                     "ce1_seed0")
LOSS_WEIGHTS_TAU2 = (
    " && ".join(LOSS_WEIGHTS[k] for k in ("ce1_conf01", "conf_detach")) + " && OMP_NUM_THREADS=1 dspark-hf compare "
    "--target smollm2-135m-instruct --drafter ce1conf01=/work/runs/dspark-s1-topk64-r512-ce1conf01-1024-1200/final "
    "--drafter confdetach=/work/runs/dspark-s1-topk64-r512-confdetach-1024-1200/final "
    "--drafter dflash=/work/runs/dflash-s1-topk64-r512-1024-1200/final --limit 16 --max-new-tokens 64 "
    "--speed-prompts 0 --prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_loss_weights_tau2")
LOSS_WEIGHTS_TAU_SEED0 = (
    CE1_SEED0 + " && " + CONF_DETACH_SEED0 + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct "
    "--drafter ce1=/work/runs/dspark-topk64-r512-ce1-1024-1200/final --drafter "
    "confdetach=/work/runs/dspark-topk64-r512-confdetach-1024-1200/final --drafter "
    "dflash=/work/runs/dflash-topk64-v2-1024-1200/final --limit 16 --max-new-tokens 64 --speed-prompts 0 "
    "--prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_loss_weights_tau_seed0 && python "
    "scripts/acceptance_decomposition.py results/compare_smollm2_loss_weights_tau_seed0/compare.json --out "
    "results/compare_smollm2_loss_weights_tau_seed0/decomposition.md")
CONF_DETACH_2400 = ("RUNS=/work/runs EXAMPLES=1024 STEPS=2400 EVERY=600 TAG=-topk64-r512-confdetach "
                    "ARGS=teacher_topk=64 DSPARK_ARGS='markov_rank=512 detach_confidence_inputs=true' "
                    "OUT=results/training_smollm2_conf_detach_2400 "
                    "HELDOUT=results/heldout_tau/smollm2_conf_detach_2400.json bash scripts/train_dspark_vs_dflash.sh")
CONF_DETACH_2400_TAU = (
    CONF_DETACH_2400 + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
    "confdetach2400=/work/runs/dspark-topk64-r512-confdetach-1024-2400/final --drafter "
    "dflash2400=/work/runs/dflash-topk64-r512-confdetach-1024-2400/final --limit 16 --max-new-tokens 64 "
    "--speed-prompts 0 --prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_conf_detach_2400_tau "
    "&& python scripts/acceptance_decomposition.py results/compare_smollm2_conf_detach_2400_tau/compare.json "
    "--baseline dflash2400 --goal 1.15 --out results/compare_smollm2_conf_detach_2400_tau/decomposition.md")
LOSS_WEIGHTS_CALIBRATION = {
    name: _calibrate(LOSS_WEIGHTS.get(key, R512_SEED1), run, name)
    for name, key, run in (("paper", "", "dspark-s1-topk64-r512"), ("ce1", "ce1", "dspark-s1-topk64-r512-ce1"),
                           ("conf01", "conf01", "dspark-s1-topk64-r512-conf01"),
                           ("ce1conf01", "ce1_conf01", "dspark-s1-topk64-r512-ce1conf01"),
                           ("confdetach", "conf_detach", "dspark-s1-topk64-r512-confdetach"))}
LOSS_WEIGHTS_CALIBRATION.update({
    f"{name}-seed0": _calibrate(command, run, f"{name}-seed0")
    for name, command, run in (("ce1", CE1_SEED0, "dspark-topk64-r512-ce1"),
                               ("confdetach", CONF_DETACH_SEED0, "dspark-topk64-r512-confdetach"))})
LOSS_WEIGHTS_TAU = (
    " && ".join(LOSS_WEIGHTS[k] for k in ("ce1", "conf01")) + " && OMP_NUM_THREADS=1 dspark-hf compare "
    "--target smollm2-135m-instruct --drafter paper=/work/runs/dspark-s1-topk64-r512-1024-1200/final "
    "--drafter ce1=/work/runs/dspark-s1-topk64-r512-ce1-1024-1200/final "
    "--drafter conf01=/work/runs/dspark-s1-topk64-r512-conf01-1024-1200/final "
    "--drafter dflash=/work/runs/dflash-s1-topk64-r512-1024-1200/final --limit 16 --max-new-tokens 64 "
    "--speed-prompts 0 --prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_loss_weights_tau")
TOPK64_SEED1 = (_PAIR + "VARIANTS=dspark DFLASH_TAG=-s1 TAG=-s1-topk64 ARGS=seed=1 DSPARK_ARGS=teacher_topk=64 "
                "OUT=results/training_smollm2_topk64_seed1 HELDOUT=results/heldout_tau/smollm2_topk64_seed1.json "
                "bash scripts/train_dspark_vs_dflash.sh")
SPARSE_DSPARK = (_PAIR + "VARIANTS=dspark DFLASH_TAG= TAG=-topk64 DSPARK_ARGS=teacher_topk=64 "
                 "OUT=results/training_smollm2_topk64_vs_dflash HELDOUT=results/heldout_tau/smollm2_topk64_vs_dflash.json "
                 "bash scripts/train_dspark_vs_dflash.sh")
DENSE_RERUN = (_PAIR + "VARIANTS=dspark DFLASH_TAG= TAG=-dense OUT=results/training_smollm2_dense_rerun_vs_dflash "
               "HELDOUT=results/heldout_tau/smollm2_dense_rerun_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh")
SPARSE_DFLASH = ("mv /work/runs/features/smollm2-135m-bf16/teacher-topk64-9c5801234eb8 /work/runs/teacher-topk64-from-"
                 "dspark-run && " + _PAIR + "VARIANTS=dflash TAG=-topk64 ARGS=teacher_topk=64 "
                 "OUT=results/training_smollm2_topk64_pair HELDOUT=results/heldout_tau/smollm2_topk64_pair.json "
                 "bash scripts/train_dspark_vs_dflash.sh")
SPARSE_ALL = ("(" + SPARSE_DSPARK + " & sleep 45; " + DENSE_RERUN + "; wait) && " + SPARSE_DFLASH)

SECTIONS = [
    ("head_cost/head_cost.md", "Sequential head vs parallel forward (issue: foundation)",
     "dspark-hf bench-head --repeats 30 --candidates 0 64 256 --out results/head_cost"),
    ("bench_toy/bench.md", "Throughput vs concurrency, random 8-layer toy target, simulated calibrated drafter",
     "dspark-hf bench --target toy --drafter simulated --concurrency 1 4 16 64 --max-new-tokens 32 --repeats 3 "
     "--sps results/bench_toy/sps.json --out results/bench_toy"),
    ("bench_smollm2_sim/bench.md", "Throughput vs concurrency, SmolLM2-135M-Instruct, simulated calibrated drafter",
     "dspark-hf bench --target smollm2-135m-instruct --drafter simulated --concurrency 1 4 16 "
     "--max-new-tokens 32 --repeats 2 --sps results/bench_smollm2_sim/sps.json --out results/bench_smollm2_sim"),
    ("training_smollm2/training.md", "Training data and drafters for SmolLM2-135M-Instruct (equal budgets)",
     "dspark-hf prompts --seed 999 --limit 96 --skip-missing --out data/heldout_prompts.jsonl && "
     "dspark-hf prompts --limit 2048 --skip-missing --exclude data/heldout_prompts.jsonl "
     "--out data/train_prompts.jsonl && dspark-hf data --target smollm2-135m-instruct --prompts "
     "data/train_prompts.jsonl --out data/smollm2-135m --max-new-tokens 128 --batch-size 32 && "
     "dspark-hf train --config examples/configs/smollm2-135m-dspark.yaml && "
     "dspark-hf train --config examples/configs/smollm2-135m-dflash.yaml && "
     "dspark-hf train --config examples/configs/smollm2-135m-dspark-rnn.yaml && "
     "dspark-hf training-report --run dspark=outputs/smollm2-135m-dspark --run dflash=outputs/smollm2-135m-dflash "
     "--run rnn=outputs/smollm2-135m-dspark-rnn --out results/training_smollm2"),
    ("data_qwen2.5-coder-0.5b/data.md", "Training data for Qwen2.5-Coder-0.5B-Instruct (a second family)",
     "dspark-hf fetch-target qwen2.5-coder-0.5b-instruct && dspark-hf data --target qwen2.5-coder-0.5b-instruct "
     "--prompts data/train_prompts.jsonl --out data/qwen2.5-coder-0.5b --max-new-tokens 128 --batch-size 32 "
     "--report results/data_qwen2.5-coder-0.5b/data.md"),
    ("data_qwen2.5-coder-0.5b-evalform/data.md",
     "Qwen2.5-Coder-0.5B-Instruct's answers to prompts in the evaluation sets' form (the first 1,024 of 4,040; "
     "45.5 minutes with two threads on a Zen 4 VM)",
     "dspark-hf data --target qwen2.5-coder-0.5b-instruct --prompts data/train_prompts_evalform.jsonl --out "
     "data/qwen2.5-coder-0.5b-evalform --max-new-tokens 256 --batch-size 32 --shard-size 128 --compress --order spread "
     "--max-seconds 2700 --report results/data_qwen2.5-coder-0.5b-evalform/data.md"),
    ("calibration_smollm2_dspark/calibration.md",
     "STS calibration of the DSpark drafter (fit on half of the held-out prompts, measured on the other half)",
     "dspark-hf calibrate --drafter outputs/smollm2-135m-dspark/final --target smollm2-135m-instruct "
     "--prompts data/heldout_prompts.jsonl --limit 96 --fit-fraction 0.5 --max-new-tokens 64 --batch-size 16 "
     "--report-dir results/calibration_smollm2_dspark && dspark-hf release --drafter "
     "outputs/smollm2-135m-dspark/final --target smollm2-135m-instruct"),
    ("compare_smollm2/compare.md",
     "DSpark vs DFlash baseline vs transformers' built-in DFlash path vs stock assisted generation",
     "dspark-hf compare --target smollm2-135m-instruct --drafter dspark=outputs/smollm2-135m-dspark/final "
     "--drafter dflash=outputs/smollm2-135m-dflash/final --hf-dflash dflash "
     "--stock qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct --limit 16 --max-new-tokens 64 "
     "--speed-prompts 3 --stock-prompts 2 --out results/compare_smollm2"),
    ("compare_smollm2_heads/compare.md", "Sequential heads side by side: Markov (DSpark) vs RNN (DSpark) vs none (DFlash)",
     "dspark-hf compare --target smollm2-135m-instruct --drafter dspark=outputs/smollm2-135m-dspark/final "
     "--drafter rnn=outputs/smollm2-135m-dspark-rnn/final --drafter dflash=outputs/smollm2-135m-dflash/final "
     "--limit 16 --max-new-tokens 64 --speed-prompts 0 --out results/compare_smollm2_heads"),
    ("bench_smollm2_dspark/bench.md", "Throughput vs concurrency, SmolLM2-135M-Instruct, trained DSpark drafter",
     "dspark-hf bench --target smollm2-135m-instruct --drafter outputs/smollm2-135m-dspark/final "
     "--concurrency 1 4 16 --max-new-tokens 32 --repeats 3 "
     "--sps results/bench_smollm2_dspark/sps.json --out results/bench_smollm2_dspark"),
    ("draft_vocab/results.md", "Reduced draft vocabulary: answer-token coverage, drafting-round and training-step time",
     "python scripts/bench_draft_vocab.py && python scripts/bench_draft_vocab.py --parts training"),
    ("training_smollm2_long/training.md",
     "Long runs on 12k-prompt data, DSpark vs the DFlash baseline at equal CPU budget (issue 14, resumable)",
     "RUNS=/work/runs bash scripts/train_long.sh (stop or resume at will) && dspark-hf training-report "
     "--run dspark=/work/runs/smollm2-135m-dspark-long --run dflash=/work/runs/smollm2-135m-dflash-long "
     "--run dspark-decay500=/work/runs/smollm2-135m-dspark-long-decay500 --out results/training_smollm2_long "
     "(after RUNS=/work/runs bash scripts/decay_branch.sh smollm2-135m-dspark-long 400 100)"),
    ("training_smollm2_bf16/training.md",
     "A 2,000-step run in bf16 mixed precision on a CPU with AMX bf16 units (2,000 of the 12k-prompt examples, "
     "wsd schedule decayed over the last 400 steps; 38 minutes of one core; issue 14 part 3)",
     "OMP_NUM_THREADS=1 dspark-hf train --config examples/configs/smollm2-135m-dspark-long.yaml "
     "feature_cache=/work/runs/features/smollm2-135m-bf16 feature_cache_dtype=bfloat16 "
     "output_dir=/work/runs/smollm2-135m-dspark-bf16 max_examples=2000 max_steps=2000 eval_every=400 save_every=200 "
     "mixed_precision=bf16 && "
     "dspark-hf training-report --run dspark-bf16=/work/runs/smollm2-135m-dspark-bf16 "
     "--out results/training_smollm2_bf16"),
    ("data_generation_prepacked/data_generation.md",
     "Data generation throughput, PyTorch's CPU linears vs prepacked oneDNN ones (what `dspark-hf data` uses by "
     "default; issue 14 part 2)",
     "OMP_NUM_THREADS=1 python scripts/bench_data_generation.py --dtypes float32 --batch-sizes 64 --linears plain "
     "prepacked --max-new-tokens 64 --out results/data_generation_prepacked"),
    ("data_generation/data_generation.md",
     "Data generation throughput (the target answering training prompts), per batch size and dtype",
     "python scripts/bench_data_generation.py --batch-sizes 16 32 64 --dtypes float32 bfloat16 --threads 1 "
     "--max-new-tokens 32 --out results/data_generation"),
    ("bench_smollm2_dspark_long/bench.md",
     "Throughput at concurrency 16 with longer outputs (128 tokens), SmolLM2-135M-Instruct, trained DSpark drafter",
     "dspark-hf bench --target smollm2-135m-instruct --drafter outputs/smollm2-135m-dspark/final "
     "--concurrency 16 --max-new-tokens 128 --repeats 2 "
     "--sps results/bench_smollm2_dspark_long/sps.json --out results/bench_smollm2_dspark_long"),
    ("round_overhead/batch1_after.md",
     "Per-round cost at batch 1 (target.generate(assistant_model=drafter)) as a share of the verification forward",
     "python scripts/bench_round_overhead.py batch1 --prompts 3 --max-new-tokens 48 --repeats 1 "
     "--drafters release random --head fp32 --label after"),
    ("round_overhead/batch1_options.md",
     "Per-round cost at batch 1 with other draft LM-head paths and thread counts (release drafter)",
     "python scripts/bench_round_overhead.py batch1 --prompts 2 --max-new-tokens 48 --repeats 1 --drafters release "
     "--head fp32 bf16 mm mm-all int8 --threads 1 2 --label options"),
    ("round_overhead/batch1_options_1thread.md",
     "Per-round cost at batch 1 with fbgemm's fp16 / int8 draft LM head (release drafter, 1 thread, 2 repeats)",
     "python scripts/bench_round_overhead.py batch1 --prompts 2 --max-new-tokens 48 --repeats 2 --drafters release "
     "--head fp32 mm fp16 int8 --threads 1 --label options_1thread"),
    ("round_overhead/batch1_head_dtypes.md",
     "Per-round cost at batch 1 with the drafter's LM-head dtypes (`set_draft_head_dtype`: None, float16, int8; "
     "release drafter, 1 thread, 2 repeats)",
     "python scripts/bench_round_overhead.py batch1 --prompts 2 --max-new-tokens 48 --repeats 2 --drafters release "
     "--head fp32 fp16 int8 --threads 1 --label head_dtypes"),
    ("round_overhead/batch1_release_bf16.md",
     "Per-round cost at batch 1 with today's release drafter (reduced draft vocabulary), fp32 vs int8 draft head "
     "(issue 14 part 4 goal: at most 15% of the verification forward)",
     "python scripts/bench_round_overhead.py batch1 --prompts 2 --max-new-tokens 48 --repeats 2 --drafters release "
     "--head fp32 int8 --threads 1 --label release_bf16"),
    ("round_overhead/batched_after.md",
     "Batched loop with drafting off (speculate=False) and with the idle backoff skipping vs transformers' plain "
     "batched generate",
     "python scripts/bench_round_overhead.py batched --concurrency 1 4 16 64 --max-new-tokens 32 "
     "--max-new-tokens-64 16 --repeats 3 --methods ours skip --max-prompt-len 24 --label after"),
    ("round_overhead/batched_recheck.md",
     "Batched loop with drafting off (speculate=False) vs transformers' plain batched generate, re-checked with the "
     "draft-head and sparse-logits changes (a heavily loaded machine)",
     "python scripts/bench_round_overhead.py batched --concurrency 1 4 16 64 --max-new-tokens 24 "
     "--max-new-tokens-64 12 --repeats 3 --methods ours --max-prompt-len 24 --label recheck"),
    ("round_overhead/batched_recheck_amd.md",
     "Batched loop with drafting off vs transformers' plain batched generate on this session's AMD EPYC VM, full "
     "MT-Bench prompts (issue 14 part 4 goal: >= 0.97x at every concurrency)",
     "python scripts/bench_round_overhead.py batched --concurrency 1 4 16 64 --max-new-tokens 24 --repeats 3 "
     "--methods ours --threads 1 --label recheck_amd"),
    ("compare_smollm2_prompt_lookup/compare.md",
     "Release drafter vs target-only vs transformers' prompt lookup at batch 1, SmolLM2-135M-Instruct (int8 draft head)",
     "dspark-hf compare --target smollm2-135m-instruct --drafter dspark=src/dspark_hf/testbed/releases/"
     "smollm2-135m-instruct-dspark --limit 4 --speed-prompts 2 --max-new-tokens 64 --draft-head-dtype int8 "
     "--out results/compare_smollm2_prompt_lookup"),
    ("tree/batch1.md", "Branching drafts (trees) vs the chain at batch 1, by node budget (issue 13)",
     "python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --repeats 1 --threads 1"),
    ("tree/load.md", "Branching drafts (trees) vs the chain under load, scheduled policy (issue 13)",
     "python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 8 --max-new-tokens 24 --repeats 1 "
     "--threads 1"),
    ("tree/load_repeat.md", "Branching drafts vs the chain under load, re-measured with 3 repeats (issue 13)",
     "python scripts/bench_tree.py load --concurrency 1 16 --budget 8 --max-new-tokens 24 --repeats 3 --threads 1 "
     "--label repeat"),
    ("tree/load_priced_r5.md", "Trees with growth priced (GrowthCost) vs the chain under load, 5 repeats (issue 13)",
     "python scripts/bench_tree.py load --concurrency 1 4 16 --budget 8 --max-new-tokens 24 --repeats 5 --threads 1 "
     "--label priced_r5"),
    ("tree/load_priced_c64_decode.md", "Trees with growth priced vs the chain at concurrency 64 (issue 13)",
     "python scripts/bench_tree.py load --concurrency 64 --budget 8 --max-new-tokens 24 --repeats 1 --threads 1 "
     "--label priced_c64_decode"),
    ("tree/load_padded.md", "Trees vs the chain under load with the padded pricing and the measured cost curve of the "
     "scheduled policy, prepacked target, prompts cut to their last 256 tokens (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 8 --max-new-tokens 32 "
     "--repeats 2 --prepack --max-prompt-len 256 --threads 1 --label padded"),
    ("tree/load_lazy.md", "The same after the drafter's context became lazy (built only when a round drafts), with "
     "probe-sized idle-backoff skips and the impatient backoff; a feature-cache build on the other core (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 8 --max-new-tokens 32 "
     "--repeats 2 --prepack --max-prompt-len 256 --threads 1 --label lazy"),
    ("tree/batch1_width_cap.md", "Trees with a verification width cap (`tree_max_nodes`) vs the chain at batch 1, "
     "prepacked target, policy fixed, 2 repeats (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --max-nodes 7 4 --repeats 2 --threads 1 --prepack --label width_cap"),
    ("tree/batch1_width_cap_r3.md", "The width cap at 4 nodes re-measured with 3 repeats, the benchmark alone on one "
     "core (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --max-nodes 4 --repeats 3 --threads 1 --prepack --label width_cap_r3"),
    ("training_smollm2_fullvocab/training.md",
     "Full vs reduced (8,192) draft vocabulary at an equal training budget, long-run recipe (issue 14 part 1)",
     "RUNS=/work/runs STOP=100 bash scripts/train_ablations.sh fullvocab && dspark-hf training-report "
     "--run full=/work/runs/smollm2-135m-dspark-fullvocab --run reduced=/work/runs/smollm2-135m-dspark-long "
     "--run reduced-base=/work/runs/smollm2-135m-ablation-base --out results/training_smollm2_fullvocab"),
    ("training_smollm2_fullvocab/heldout24.md",
     "Full vs reduced draft vocabulary after 100 steps each, 24 held-out prompts (issue 14 part 1)",
     "python scripts/heldout_tau.py --merge /work/runs/smollm2-135m-dspark-fullvocab/heldout24.json "
     "/work/runs/smollm2-135m-ablation-base/heldout24.json --out results/training_smollm2_fullvocab/heldout24.json"),
    ("training_smollm2_ablations/training.md",
     "Ablations of the long-run recipe at equal steps: 2 draft layers, no init from the target, loss decay 7 "
     "(issue 14 part 3)",
     "RUNS=/work/runs STOP=120 bash scripts/train_ablations.sh base noinit decay7 layers2 && dspark-hf "
     "training-report --run base=/work/runs/smollm2-135m-ablation-base --run noinit=/work/runs/smollm2-135m-ablation-"
     "noinit --run decay7=/work/runs/smollm2-135m-ablation-decay7 --run layers2=/work/runs/smollm2-135m-ablation-"
     "layers2 --out results/training_smollm2_ablations"),
    ("training_smollm2_ablations/heldout24.md",
     "Ablations' final drafters (step 120) on 24 held-out prompts (issue 14 part 3)",
     "python scripts/heldout_tau.py --merge /work/runs/smollm2-135m-ablation-{base,noinit,decay7,layers2}/heldout24.json "
     "--out results/training_smollm2_ablations/heldout24.json"),
    ("heldout_tau/smollm2.md",
     "Held-out tau of the release drafter vs the long run (24 held-out instruction prompts, every draft verified)",
     "RUNS=/work/runs bash scripts/decay_branch.sh smollm2-135m-dspark-long 400 100 && python scripts/heldout_tau.py "
     "--target smollm2-135m-instruct --num-prompts 24 --drafter release=src/dspark_hf/testbed/releases/"
     "smollm2-135m-instruct-dspark --drafter long400=/work/runs/smollm2-135m-dspark-long/checkpoint-000400 "
     "--out /work/runs/heldout24-release.json && python scripts/heldout_tau.py --merge "
     "/work/runs/heldout24-release.json /work/runs/smollm2-135m-dspark-long-decay500/heldout24.json "
     "--out results/heldout_tau/smollm2.json"),
    ("heldout_tau/smollm2_bf16.md",
     "Held-out tau of the release drafter vs the bf16 run's final drafter (24 held-out instruction prompts, every "
     "draft verified)",
     "OMP_NUM_THREADS=1 dspark-hf train --config examples/configs/smollm2-135m-dspark-long.yaml "
     "feature_cache=/work/runs/features/smollm2-135m-bf16 feature_cache_dtype=bfloat16 "
     "output_dir=/work/runs/smollm2-135m-dspark-bf16 max_examples=2000 max_steps=2000 eval_every=400 save_every=200 "
     "mixed_precision=bf16 && "
     "python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/"
     "smollm2-135m-instruct-dspark --drafter bf16-2000=/work/runs/smollm2-135m-dspark-bf16/final --num-prompts 24 "
     "--out results/heldout_tau/smollm2_bf16.json"),
    ("compare_smollm2_milestone/compare.md",
     "The bf16 run's final drafter (milestone) vs the release drafter on the evaluation sets, with transformers' "
     "prompt lookup, prepacked target (issue 14)",
     "dspark-hf compare --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/"
     "smollm2-135m-instruct-dspark --drafter milestone=results/training_smollm2_bf16/drafter --limit 8 "
     "--max-new-tokens 64 --speed-prompts 2 --prepack --out results/compare_smollm2_milestone"),
    ("compare_smollm2_bf16/compare.md",
     "Today's release drafter (the bf16 run's, released from this comparison) vs the release before it, alone and "
     "behind n-gram lookup drafts, with transformers' prompt lookup, on a prepacked target with GQA attention "
     "(issue 14 part 6)",
     "mkdir -p /tmp/previous-release && git archive ba6b045 src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "| tar -x -C /tmp/previous-release && dspark-hf compare --target smollm2-135m-instruct "
     "--drafter dspark=results/training_smollm2_bf16/drafter --drafter previous-release=/tmp/previous-release/src/"
     "dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "--limit 8 --max-new-tokens 64 --speed-prompts 2 --prepack --gqa-attention --lookup release "
     "--out results/compare_smollm2_bf16"),
    ("bench_smollm2_bf16_gsm/bench.md",
     "Throughput vs concurrency with today's release drafter, lookup drafts, prepacked linears and GQA attention "
     "(issue 14 goal: scheduled >= 0.97x max(none, fixed))",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled scheduled-plain-skips --concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 "
     "--lookup release --prepack --gqa-attention --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_bf16_gsm/sps.json --out results/bench_smollm2_bf16_gsm"),
    ("gqa_attention/gqa_attention.md",
     "Verification forwards under load: transformers' SDPA (repeat_kv copies) vs `use_gqa_attention` (issue 14 "
     "part 4)",
     "OMP_NUM_THREADS=1 python scripts/bench_gqa_attention.py --rows 64 --widths 1 2 3 4 8 --repeats 5 "
     "--out results/gqa_attention"),
    ("calibration_smollm2_dspark_bf16/calibration.md",
     "STS calibration of the bf16 run's final drafter (fit on half of 96 held-out prompts, measured on the other half)",
     "dspark-hf calibrate --drafter /work/runs/smollm2-135m-dspark-bf16/final --target smollm2-135m-instruct "
     "--prompts data/heldout_prompts.jsonl --limit 96 --fit-fraction 0.5 --max-new-tokens 64 --batch-size 16 "
     "--out /work/runs/smollm2-135m-dspark-bf16/calibrated --report-dir results/calibration_smollm2_dspark_bf16"),
    ("compare_qwen2.5-coder-0.5b/compare.md",
     "Qwen2.5-Coder-0.5B-Instruct at batch 1: target-only vs prompt lookup vs a CPU-trained DSpark drafter "
     "(issue 14 part 5)",
     "dspark-hf train --config examples/configs/qwen2.5-coder-0.5b-dspark-cpu.yaml max_examples=1024 "
     "feature_cache_dtype=float32 feature_cache=/work/runs/features/qwen2.5-coder-0.5b-f32 max_steps=200 "
     "time_budget_seconds=null eval_every=100 stop_at_step=100 output_dir=/work/runs/qwen2.5-coder-0.5b-dspark-cpu-100 "
     "&& dspark-hf compare --target "
     "qwen2.5-coder-0.5b-instruct --drafter dspark=/work/runs/qwen2.5-coder-0.5b-dspark-cpu-100/final --limit 4 "
     "--speed-prompts 2 --max-new-tokens 64 --draft-head-dtype int8 --out results/compare_qwen2.5-coder-0.5b"),
    ("tree/batch1_prepacked.md", "Trees vs the chain at batch 1 on a prepacked target, policy fixed (issue 13)",
     "python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --repeats 1 --threads 1 --prepack --label prepacked"),
    ("bench_smollm2_lookup/bench.md",
     "Throughput vs concurrency, SmolLM2-135M-Instruct, release drafter + n-gram lookup drafts, prepacked target "
     "(mt_bench prompts; issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled --concurrency 1 4 16 "
     "--max-new-tokens 48 --repeats 2 --lookup release --prepack "
     "--sps results/bench_smollm2_lookup/sps.json --out results/bench_smollm2_lookup"),
    ("bench_smollm2_lookup_gsm/bench.md",
     "Throughput vs concurrency, SmolLM2-135M-Instruct, release drafter + n-gram lookup drafts, prepacked target "
     "(gsm_symbolic prompts, where lookup drafts help most; issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled --concurrency 1 4 16 "
     "--max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_lookup_gsm/sps.json --out results/bench_smollm2_lookup_gsm"),
    ("bench_smollm2_lookup_rounds_gsm/bench.md",
     "Throughput vs concurrency with lookup-only rounds: the rounds the idle backoff takes from the drafter draft "
     "from the n-gram lookup alone (`lookup_rounds=True`, the default), side by side with those rounds as plain "
     "decoding (`scheduled-plain-skips`); gsm_symbolic prompts, release drafter + lookup drafts, prepacked target "
     "(issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-plain-skips "
     "--concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_lookup_rounds_gsm/sps.json --out results/bench_smollm2_lookup_rounds_gsm"),
    ("bench_smollm2_lazy_context_gsm/bench.md",
     "The same command after the drafter's context became lazy (built only when a round drafts: "
     "`ActiveRows.pending`) and a drafter costing half a plain round or more is backed off after one round that did "
     "not pay (`IdleBackoff.IMPATIENT_SKIP`); a data-generation job shared the machine (issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-plain-skips "
     "--concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_lazy_context_gsm/sps.json --out results/bench_smollm2_lazy_context_gsm"),
    ("bench_smollm2_one_time_gsm/bench.md",
     "The same command after the prompts' context projection (lazy, at the first drafting round) was kept out of the "
     "per-round drafting cost the policies price; a calibration job shared the machine for part of the run (issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-plain-skips "
     "--concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_one_time_gsm/sps.json --out results/bench_smollm2_one_time_gsm"),
    ("bench_smollm2_padded_gsm/bench.md",
     "Throughput vs concurrency with the padded pricing, the measured cost curve and the online calibration of the "
     "scheduled policy, against Algorithm 1's ragged pricing on the profiled curve (`scheduled-ragged`), same run "
     "(gsm_symbolic prompts, release drafter + lookup drafts, prepacked target; issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-ragged "
     "--concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_padded_gsm/sps.json --out results/bench_smollm2_padded_gsm"),
    ("bench_smollm2_calibrated_gsm/bench.md",
     "The same with the online calibration of survival estimates added to the scheduled policy (1, 4, 16 requests; "
     "the SPS table of the run above; the test suite shared the machine during the first half)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-ragged "
     "--concurrency 1 4 16 --max-new-tokens 48 --repeats 2 --lookup release --prepack --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_padded_gsm/sps.json --out results/bench_smollm2_calibrated_gsm"),
    ("bench_smollm2_prepacked/bench.md",
     "Throughput vs concurrency, SmolLM2-135M-Instruct, release drafter, prepacked target, no lookup (the control of "
     "the section above; mt_bench prompts)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled --concurrency 1 4 16 "
     "--max-new-tokens 48 --repeats 2 --prepack "
     "--sps results/bench_smollm2_prepacked/sps.json --out results/bench_smollm2_prepacked"),
    ("lookup_smollm2/results.md",
     "SmolLM2-135M-Instruct at batch 1: n-gram lookup drafts and prepacked linears vs target-only, prompt lookup and "
     "the release drafter (issue 14)",
     "dspark-hf lookup --data data/smollm2-135m-12k,data/smollm2-135m --min-total 2 --out "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors && python scripts/bench_lookup.py "
     "--out results/lookup_smollm2 --lookup src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/"
     "lookup.safetensors --prompts 3 --max-new-tokens 64"),
    ("lookup_smollm2_calibration/results.md",
     "Lookup drafts at batch 1 with and without the online correction of their estimates "
     "(`AssistOptions.online_calibration`), same run (issue 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup.py --lookup "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors --prompts 3 --methods lookup "
     "lookup/uncalibrated --out results/lookup_smollm2_calibration"),
    ("lookup_smollm2_one_row/results.md",
     "Prepacked linears with PyTorch's matrix-vector path for one row (`one_row_plain=True`, the default) vs packing "
     "every call (`lookup/all-packed`), lookup drafts at batch 1, same run (issue 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup.py --lookup "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors --prompts 3 --methods "
     "target-only/packed prompt-lookup/packed lookup lookup/all-packed --out results/lookup_smollm2_one_row"),
    ("lookup_smollm2_auto_rows/results.md",
     "Prepacked linears with PyTorch's own path up to the row count where this CPU's packed kernel starts winning "
     "(`plain_rows=\"auto\"`, measured on the whole model: 3 rows on this Xeon) vs one row (`target-only/packed`, "
     "`lookup`), batch 1, same run; data generation shared the machine (issue 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup.py --lookup "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors --prompts 3 --methods "
     "target-only/packed lookup target-only/auto-rows lookup/auto-rows --out results/lookup_smollm2_auto_rows"),
    ("lookup_tables_smollm2/results.md",
     "Lookup tables side by side at batch 1: the release table (1.08M answer tokens) vs tables from 3.3x more answers "
     "(3.53M; contexts seen >= 2 or >= 3 times), alone and as branches of the release drafter's chain; data "
     "generation shared the machine (issue 14)",
     "dspark-hf lookup --data data/smollm2-135m-20k,data/smollm2-135m-12k,data/smollm2-135m --min-total 2 --out "
     "/work/runs/lookup/all.safetensors (the same with --min-total 3 --out /work/runs/lookup/all_mt3.safetensors; the "
     "20k folder then held its first 8,704 answers, commit 3b99ff8) && OMP_NUM_THREADS=1 python "
     "scripts/bench_lookup_tables.py --table release=release --table all-min2=/work/runs/lookup/all.safetensors "
     "--table all-min3=/work/runs/lookup/all_mt3.safetensors --prompts 6 --out results/lookup_tables_smollm2"),
    ("lookup_branch_width_smollm2/results.md",
     "Release drafter + lookup branches at batch 1 by verification width (tree_max_nodes 4 / 8 / 12 / 16), release "
     "lookup table; data generation shared the machine (issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 8 12 16 "
     "--prompt-lookup 0 --prompts 6 --out results/lookup_branch_width_smollm2"),
    ("lookup_branch_width_smollm2_r2/results.md",
     "The same at 4 and 8 nodes, repeated, with transformers' prompt lookup in the run (issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 8 "
     "--prompt-lookup 10 --prompts 6 --out results/lookup_branch_width_smollm2_r2"),
    ("lookup_tree_vs_chain_smollm2/results.md",
     "Tree vs chain with the same drafter and lookup at batch 1, on a Zen 2 VM (AMD EPYC family 23 model 49, AVX2; a "
     "batch-1 forward of 8 tokens 1.67-1.68x one token with another job on the other core, 1.34x without): lookup branches at 4 nodes (`release+branches`, policy fixed) vs "
     "the lookup-then-drafter chain (`release+lookup`, the demo's default), the lookup alone, the drafter alone and "
     "prompt lookup (issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 --assist "
     "--drafter-chain --prompt-lookup 10 --prompts 6 --out results/lookup_tree_vs_chain_smollm2"),
    ("lookup_tree_scheduled_smollm2/results.md",
     "The same with the lookup branches under the `scheduled` policy as well, the same Zen 2 VM (the unit suite ran on "
     "the other core from MATH500 on; issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 --branch-policies "
     "fixed scheduled --assist --prompt-lookup 10 --prompts 6 --out results/lookup_tree_scheduled_smollm2"),
    ("lookup_tree_vs_chain_smollm2_idle/results.md",
     "The tree vs chain comparison again on the same Zen 2 VM with nothing else running (issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 --assist "
     "--prompt-lookup 10 --prompts 6 --out results/lookup_tree_vs_chain_smollm2_idle"),
    ("lookup_narrow_branches_smollm2/results.md",
     "Narrower lookup branches (2, 3, 4 nodes, policy fixed) against the lookup-then-drafter chain, the same Zen 2 VM "
     "with nothing else running (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 2 3 4 --assist "
     "--prompt-lookup 0 --prompts 6 --out results/lookup_narrow_branches_smollm2"),
    ("lookup_branch_lookup_max_smollm2/results.md",
     "Lookup branches whose lookup-only rounds propose up to 16 drafts free of the node cap (`lookup_max_tokens`), "
     "lengths from the batch-1 curve, against the chain, a Zen 3 VM (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 "
     "--branch-lookup-max 0 16 --assist --prompt-lookup 10 --prompts 6 --out results/lookup_branch_lookup_max_smollm2"),
    ("assist_realized_gate_smollm2/results.md",
     "The drafter alone and the lookup-then-drafter chain with and without the realized gate "
     "(`set_assist(realized_gate=True)`), a Zen 3 VM (issue 14 part 4)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 0 --assist "
     "--assist-gated --drafter-chain --prompt-lookup 0 --prompts 6 --out results/assist_realized_gate_smollm2"),
    ("lookup_branch_zen4_smollm2/results.md",
     "Every batch-1 method side by side on a Zen 4 VM (AMD EPYC family 25 model 17, AVX-512): target-only, prompt "
     "lookup, the lookup alone, lookup branches (4 nodes, lookup rounds up to 16), the lookup-then-drafter chain and "
     "the drafter alone, each with and without the realized gate; the unit suite ran on the other core (issues 13, 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 4 "
     "--branch-lookup-max 16 --assist --assist-gated --drafter-chain --prompt-lookup 10 --prompts 6 "
     "--out results/lookup_branch_zen4_smollm2"),
    ("assist_realized_gate_zen4_smollm2/results.md",
     "The realized gate after it stops the drafter only when its rounds lose with confidence (mean gain + one "
     "standard error < 0 over the last 16, commit e41d2f3): the drafter alone and the lookup-then-drafter chain with "
     "and without it, the same Zen 4 VM, nothing else running (issue 14 part 4)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release --branches 0 --assist "
     "--assist-gated --drafter-chain --prompt-lookup 0 --prompts 6 --out results/assist_realized_gate_zen4_smollm2"),
    ("drafter_prepack_smollm2/results.md",
     "The release drafter's own linears prepacked or not, the drafter alone and the lookup-then-drafter chain, a "
     "Zen 3 VM (issue 14 part 4)",
     "OMP_NUM_THREADS=1 python scripts/bench_drafter_prepack.py --prompts 6 --out results/drafter_prepack_smollm2"),
    ("lookup_branch_curve_smollm2/results.md",
     "The same with the drafting rounds' trees priced on the whole batch-1 curve too (commit 92cefad, taken out "
     "after: no gain), 4 and 8 nodes, a Zen 3 VM (issue 13)",
     "git checkout 92cefad && OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table release=release "
     "--branches 4 8 --branch-lookup-max 16 --assist --prompt-lookup 0 --prompts 6 --out "
     "results/lookup_branch_curve_smollm2"),
    ("lookup_qwen2.5-coder-0.5b/results.md",
     "Qwen2.5-Coder-0.5B-Instruct at batch 1: n-gram lookup drafts and prepacked linears vs target-only and prompt "
     "lookup (issue 14 part 5)",
     "dspark-hf fetch-target qwen2.5-coder-0.5b-instruct && python scripts/bench_lookup.py --target "
     "qwen2.5-coder-0.5b-instruct --methods target-only/packed prompt-lookup prompt-lookup/packed lookup --prompts 2 "
     "--max-new-tokens 64 --out results/lookup_qwen2.5-coder-0.5b"),
    ("tree/batch1_gqa.md", "Trees vs the chain at batch 1 with today's release drafter, prepacked linears and GQA "
     "attention, policy fixed (issue 13)",
     "python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --repeats 1 --threads 1 --prepack --gqa-attention --label gqa"),
    ("bench_smollm2_bf16_gsm_c64/bench.md",
     "64 requests again, 3 repeats: today's release drafter, lookup drafts, prepacked linears, GQA attention "
     "(issue 14's batched goal where it was missed)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled scheduled-plain-skips --concurrency 64 --max-new-tokens 48 --repeats 3 "
     "--lookup release --prepack --gqa-attention --prompt-set gsm_symbolic "
     "--sps results/bench_smollm2_bf16_gsm_c64/sps.json --out results/bench_smollm2_bf16_gsm_c64"),
    ("tree/batch1_priced_scheduled.md", "Trees with growth priced vs the chain at batch 1, scheduled policy (issue 13)",
     "python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --repeats 1 --threads 1 --policy scheduled --label priced_scheduled"),
    ("tree/batch1_priced_scheduled_realized.md",
     "The same, after tree rounds feed `RealizedGain` (trees that verified at a loss back off to chains; run while "
     "a held-out evaluation used the other core)",
     "python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 2 "
     "--max-new-tokens 64 --budgets 4 8 --repeats 1 --threads 1 --policy scheduled --label priced_scheduled_realized"),
    ("cpu_bf16/cpu_bf16.md", "bf16 autocast vs fp32 on a CPU without native bf16 (why `dspark-hf train` warns)",
     "OMP_NUM_THREADS=1 python scripts/bench_cpu_bf16.py --lengths 256 768 --repeats 3 --out results/cpu_bf16"),
    ("training_smollm2_dspark_vs_dflash/training.md",
     "DSpark vs the DFlash baseline at an equal budget on one machine (issue 14 goal: DSpark tau >= 1.15x DFlash)",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=600 bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_dspark_vs_dflash.md",
     "DSpark vs DFlash at equal steps: the final drafters on 24 held-out prompts",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=600 bash scripts/train_dspark_vs_dflash.sh"),
    ("bench_smollm2_rows_gsm/bench.md",
     "Throughput vs concurrency with the cost curve profiled in the rounds' own layout (C rows of w tokens) "
     "(issue 14 goal: scheduled >= 0.97x max(none, fixed))",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled scheduled-plain-skips --concurrency 1 4 16 64 --max-new-tokens 48 --repeats 2 "
     "--lookup release --prepack --gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_rows_gsm"),
    ("lookup_context/lookup_context.md",
     "A lookup proposal from the whole sequence vs from the row's incremental `LookupContext` (what the loop now keeps)",
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_context.py --out results/lookup_context"),
    ("bench_smollm2_incremental_gsm/bench.md",
     "Throughput vs concurrency with incremental lookup proposals and the round overhead amortized over the rounds "
     "that draft (issue 14 goal: scheduled >= 0.97x max(none, fixed)); the SPS tables of bench_smollm2_rows_gsm",
     "mkdir -p results/bench_smollm2_incremental_gsm && cp results/bench_smollm2_rows_gsm/sps-rows*.json "
     "results/bench_smollm2_incremental_gsm/ && OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct "
     "--drafter results/training_smollm2_bf16/drafter --policies fixed scheduled --concurrency 1 4 16 64 "
     "--max-new-tokens 48 --repeats 3 --lookup release --prepack --gqa-attention --prompt-set gsm_symbolic "
     "--out results/bench_smollm2_incremental_gsm"),
    ("bench_smollm2_realized_gsm/bench.md",
     "Scheduled vs no speculation at 16 and 64 requests with measured pay (`RealizedGain`) backing off rounds that "
     "verified at a loss; SPS tables profiled in this run (issue 14 goal: >= 0.97x)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled --concurrency 16 64 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_realized_gsm"),
    ("bench_smollm2_realized_gsm_low/bench.md",
     "The same code at 1 and 4 requests, with `fixed` (run while a training job used the other core)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled --concurrency 1 4 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_realized_gsm_low"),
    ("decode_only/decode_only_c16.md",
     "16 requests with the prefill timed apart, and the decode split into target forwards and the rest: "
     "transformers, the loop without drafts, scheduled (finished rows riding, holes compacted where it pays, one "
     "draft per row in a source's first round) and scheduled as the loop ran before those (`scheduled-old`)",
     "OMP_NUM_THREADS=1 python scripts/bench_decode_only.py --concurrency 16 --repeats 3 "
     "--methods 'hf plain,none,scheduled,scheduled-old' "
     "--sps results/bench_smollm2_realized_gsm/sps-rows16.json --out results/decode_only"),
    ("bench_smollm2_riders_gsm/bench.md",
     "Scheduled vs no speculation at 16 and 64 requests after the cache-copy and probe changes (riders, paid "
     "compaction, one-draft first rounds; training paused; issue 14 goal: >= 0.97x)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled --concurrency 16 64 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_riders_gsm"),
    ("bench_smollm2_riders_gsm_c16/bench.md",
     "The same code at 16 requests again, 5 repeats, training paused (is the 16-request result robust?)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled --concurrency 16 --max-new-tokens 48 --repeats 5 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_riders_gsm_c16"),
    ("bench_smollm2_riders_gsm_low/bench.md",
     "The same code at 1 and 4 requests, with `fixed` (run while a held-out evaluation used the other core)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled --concurrency 1 4 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_riders_gsm_low"),
    ("training_smollm2_dspark_vs_dflash_1200/training.md",
     "DSpark vs the DFlash baseline at an equal budget, twice the steps (1,200; issue 14 goal: >= 1.15x)",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 OUT=results/training_smollm2_dspark_vs_dflash_1200 "
     "HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_1200.json bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_dspark_vs_dflash_1200.md",
     "DSpark vs DFlash after 1,200 steps each: the final drafters on 24 held-out prompts",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 OUT=results/training_smollm2_dspark_vs_dflash_1200 "
     "HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_1200.json bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_dspark_vs_dflash_spread/training.md",
     "DSpark vs DFlash at an equal budget again, 1,200 steps each, held-out tau on 24 prompts spread over the sources "
     "(the runs above measured the first prompts of the sorted file, mostly chat dialogs; issue 14 goal: DSpark tau "
     ">= 1.15x DFlash)",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 OUT=results/training_smollm2_dspark_vs_dflash_spread "
     "HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_spread.json bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_dspark_vs_dflash_spread.md",
     "Those two final drafters on all 96 held-out prompts, per source family",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 OUT=results/training_smollm2_dspark_vs_dflash_spread "
     "HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_spread.json bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_dspark_vs_dflash_seed1/training.md",
     "The DSpark / DFlash pair of 1,200 steps again with seed 1 (other initial weights, anchors and batch order; the "
     "same examples): how much of the 1.15x is the seed",
     "RUNS=/work/runs STEPS=1200 EVERY=300 TAG=-s1 ARGS=seed=1 "
     "OUT=results/training_smollm2_dspark_vs_dflash_seed1 HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_seed1.json "
     "bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_dspark_vs_dflash_seed1.md",
     "Those two final drafters on all 96 held-out prompts, per source family",
     "RUNS=/work/runs STEPS=1200 EVERY=300 TAG=-s1 ARGS=seed=1 "
     "OUT=results/training_smollm2_dspark_vs_dflash_seed1 HELDOUT=results/heldout_tau/smollm2_dspark_vs_dflash_seed1.json "
     "bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_dspark_r128_vs_dflash/training.md",
     "The same pair with the DSpark run's Markov head at rank 128 instead of 256 (a cheaper step), against a fresh "
     "DFlash baseline trained beside it: DSpark tau at an equal budget, in steps and in CPU hours",
     "RUNS=/work/runs STEPS=1200 EVERY=300 TAG=-r128 DSPARK_ARGS=markov_rank=128 "
     "OUT=results/training_smollm2_dspark_r128_vs_dflash HELDOUT=results/heldout_tau/smollm2_dspark_r128_vs_dflash.json "
     "bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_dspark_r128_vs_dflash.md",
     "Those two final drafters on all 96 held-out prompts, per source family",
     "RUNS=/work/runs STEPS=1200 EVERY=300 TAG=-r128 DSPARK_ARGS=markov_rank=128 "
     "OUT=results/training_smollm2_dspark_r128_vs_dflash HELDOUT=results/heldout_tau/smollm2_dspark_r128_vs_dflash.json "
     "bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_dspark_2560_warm/training.md",
     "The 1,200-step DSpark drafter trained on, on 2.5x the examples (2,560) for another 1,200 steps",
     "RUNS=/work/runs bash scripts/train_warm_more_data.sh; dspark-hf training-report "
     "--run dspark-2560-warm=/work/runs/dspark-2560-warm --out results/training_smollm2_dspark_2560_warm"),
    ("heldout_tau/smollm2_dspark_2560_warm.md",
     "The continued drafter, the drafter it started from and the release on 24 held-out prompts",
     "RUNS=/work/runs bash scripts/train_warm_more_data.sh"),
    ("heldout_tau/smollm2_release_2560_warm.md",
     "The release drafter trained on for 2,400 more steps on 2,560 examples (warm start), on 24 held-out prompts",
     "FROM=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark OUTDIR=/work/runs/release-2560-warm "
     "STEPS=2400 HELDOUT=results/heldout_tau/smollm2_release_2560_warm.json RUNS=/work/runs "
     "bash scripts/train_warm_more_data.sh"),
    ("decode_only_ragged/decode_only_c16.md",
     "Decode only at 16 requests: ragged verification forwards, priced padded (the default) or per row, against "
     "padded forwards (issue 14, part 4)",
     "OMP_NUM_THREADS=1 python scripts/bench_decode_only.py --concurrency 16 --repeats 4 "
     "--methods 'hf plain,none,scheduled,scheduled-padded,scheduled-ragged-pricing' "
     "--sps results/bench_smollm2_realized_gsm/sps-rows16.json --out results/decode_only_ragged"),
    ("bench_smollm2_ragged_c16/bench.md",
     "Scheduled vs no speculation at 16 requests with ragged forwards, the round's tail priced and probes until every "
     "row is calibrated (training paused)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled --concurrency 16 --max-new-tokens 48 --repeats 5 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_ragged_c16"),
    ("bench_smollm2_ragged_low/bench.md",
     "The same code at 1 and 4 requests, with `fixed` (training paused)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled --concurrency 1 4 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_ragged_low"),
    ("bench_smollm2_ragged_c64/bench.md",
     "The same code at 64 requests (training paused)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled --concurrency 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_ragged_c64"),
    ("round_rules/round_rules.md",
     "Batch 1 through the batched loop: the tail gate and the probe rule on vs off, and `fixed`",
     "OMP_NUM_THREADS=1 python scripts/bench_round_rules.py --out results/round_rules"),
    ("bench_smollm2_warm_c16/bench.md",
     "Scheduled with a `PolicyMemory` (`scheduled-warm`: each call starts from what the previous calls learned, the "
     "first warmed by one untimed call on the next 16 prompts) vs starting every call cold, 16 requests, the "
     "benchmark alone on the machine (issue 14 goal: >= 0.97x)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 16 --max-new-tokens 48 --repeats 5 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm_c16"),
    ("bench_smollm2_warm_low/bench.md",
     "The same at 1 and 4 requests, with `fixed`",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled scheduled-warm --concurrency 1 4 --max-new-tokens 48 --repeats 3 --lookup release "
     "--prepack --gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm_low"),
    ("bench_smollm2_warm_c16_r2/bench.md",
     "The 16-request comparison of cold and warm calls run again (same command, `--out "
     "results/bench_smollm2_warm_c16_r2`)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 16 --max-new-tokens 48 --repeats 5 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm_c16_r2"),
    ("decode_only_warm/decode_only_c16.md",
     "Decode only at 16 requests: where a cold and a warm scheduled call spend their time outside the target's "
     "forwards, against transformers' and the loop's own plain decoding",
     "OMP_NUM_THREADS=1 python scripts/bench_decode_only.py --concurrency 16 --repeats 3 --methods "
     "'hf plain,none,scheduled,scheduled-warm' --sps results/bench_smollm2_warm_c16/sps-rows16.json "
     "--out results/decode_only_warm"),
    ("bench_smollm2_warm_c64/bench.md",
     "The same at 64 requests (`fixed` left out: 0.52-0.61x of none at 64 in every earlier run)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm_c64"),
    ("compare_smollm2_session/compare.md",
     "Today's release drafter alone and behind n-gram lookup drafts vs target-only and transformers' prompt lookup, "
     "batch 1, prepacked target with GQA attention, re-measured on a VM whose profiled batch-1 cost curve was flat "
     "(issue 14 goals: >= 1.8x, faster than prompt lookup on every set)",
     "OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct "
     "--drafter dspark=results/training_smollm2_bf16/drafter --limit 8 --max-new-tokens 64 --speed-prompts 2 "
     "--prepack --gqa-attention --lookup release --out results/compare_smollm2_session"),
    ("tree/batch1_session_flat.md",
     "Trees vs the chain at batch 1 re-measured on a VM whose profiled batch-1 cost curve was flat up to 8 tokens "
     "(prepacked target, GQA attention, policy fixed; issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 4 8 --repeats 2 --threads 1 --prepack --gqa-attention "
     "--label session_flat"),
    ("training_smollm2_gpu/training.md",
     "Three drafters trained side by side on one H200 in one GPU lease, 490 s of wall time each (DSpark 1 layer, the "
     "DFlash baseline, DSpark 2 layers; all 12,620 training examples, batch 32 sequences x 128 anchors, bf16 autocast; "
     "held-out tau measured on the GPU every 200 steps; issue 14 part 3)",
     LEASE + " && dspark-hf training-report --run dspark=/work/runs/gpu-drafters/dspark --run "
     "dflash=/work/runs/gpu-drafters/dflash --run dspark-2l=/work/runs/gpu-drafters/dspark-2l "
     "--out results/training_smollm2_gpu"),
    ("heldout_tau/smollm2_gpu.md",
     "Held-out tau of the GPU-trained drafters vs the release before them, measured here on the CPU (24 held-out "
     "instruction prompts, every draft verified, no EOS stop)",
     LEASE + " && OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter "
     "release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --drafter gpu-dspark=/work/runs/gpu-drafters/"
     "dspark --num-prompts 24 --threads 1 --out /work/runs/eval/heldout_a.json (and gpu-dflash, gpu-dspark-2l into "
     "heldout_b.json, on the other core) && python scripts/heldout_tau.py --merge /work/runs/eval/heldout_a.json "
     "/work/runs/eval/heldout_b.json --out results/heldout_tau/smollm2_gpu.json"),
    ("heldout_tau/smollm2_release_first24.md",
     "Held-out tau of today's release drafter on the first 24 prompts of the held-out file, as every held-out figure "
     "before 2026-12-06 was measured (the file is sorted by source: 16 of the 24 are chatterbot dialogs)",
     "OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "--num-prompts 24 --order file --out results/heldout_tau/smollm2_release_first24.json"),
    ("heldout_tau/smollm2_release_spread24.md",
     "The same drafter on 24 held-out prompts spread over the sources (`--order spread`, the default now, as "
     "training's `eval_every` picks them)",
     "OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "--num-prompts 24 --out /work/runs/tau_spread24.json && python scripts/heldout_tau.py --merge "
     "/work/runs/tau_spread24.json --out results/heldout_tau/smollm2_release_spread24.json"),
    ("heldout_tau/smollm2_release_by_source.md",
     "The same drafter on all 96 held-out prompts, per source family: acceptance depends on the kind of prompt",
     "OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "--num-prompts 96 --by-source --out results/heldout_tau/smollm2_release_by_source.json"),
    ("heldout_tau/smollm2_release_train24.md",
     "The same drafter on 24 of its own training prompts (spread over the sources), per source family: against the "
     "held-out table above, what it generalises",
     "OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark "
     "--prompts data/train_prompts_12k.jsonl --num-prompts 24 --by-source "
     "--out results/heldout_tau/smollm2_release_train24.json"),
    ("heldout_tau/smollm2_release_evalform32.md",
     "The release drafter on 32 prompts of the evaluation-form file (standard-library functions to complete, boxed "
     "math tasks; not trained on), per source: do they ask for what the evaluation sets ask?",
     "dspark-hf prompts --out data/train_prompts_evalform.jsonl --python-functions 2000 --boxed-math 120 "
     "--only-opt-in --exclude data/heldout_prompts.jsonl && OMP_NUM_THREADS=1 python scripts/heldout_tau.py --target "
     "smollm2-135m-instruct --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --prompts "
     "data/train_prompts_evalform.jsonl --num-prompts 32 --by-source "
     "--out results/heldout_tau/smollm2_release_evalform32.json"),
    ("evalform_smollm2/eval_release/eval.md",
     "The release drafter on the evaluation sets, 16 prompts each (the baseline of the eval-form fine-tune below)",
     "RUNS=/work/runs THREADS=2 BUDGET=3000 bash scripts/train_evalform.sh (the fine-tune: examples/configs/smollm2-135m-dspark-evalform.yaml on data/smollm2-135m-evalform as committed in dbc63f0, 1,280 answers, and 1,500 general ones; 1,000 steps, 35 minutes on two Zen 4 cores)"),
    ("evalform_smollm2/eval_evalform/eval.md",
     "The release drafter fine-tuned on the target's answers to eval-form prompts (1,095 boxed-math tasks, 185 "
     "function stubs) mixed with 1,500 general answers, on the same prompts: macro tau +3% (GSM-Symbolic +10%)",
     "RUNS=/work/runs THREADS=2 BUDGET=3000 bash scripts/train_evalform.sh (the fine-tune: examples/configs/smollm2-135m-dspark-evalform.yaml on data/smollm2-135m-evalform as committed in dbc63f0, 1,280 answers, and 1,500 general ones; 1,000 steps, 35 minutes on two Zen 4 cores)"),
    ("evalform_smollm2/eval_evalform2/eval.md",
     "The same fine-tune on more eval-form answers (the first 23 shards of data/smollm2-135m-evalform: 2,944 answers, "
     "mostly function stubs beyond the first run's) and 1,500 general ones, one torch thread: macro tau 1.658 against "
     "the release's 1.596 and the first fine-tune's 1.649; HumanEval unchanged (1.74); held-out tau on 8 spread "
     "general prompts along the run 1.500 / 1.509 / 1.541 / 1.509 at steps 250-1000 (release 1.537): not released",
     "mkdir -p /work/runs/snap2/smollm2-135m-evalform && cp data/smollm2-135m-evalform/data-000{00..22}.jsonl.gz "
     "data/smollm2-135m-evalform/manifest.json /work/runs/snap2/smollm2-135m-evalform/ && OMP_NUM_THREADS=1 dspark-hf "
     "train --config examples/configs/smollm2-135m-dspark-evalform.yaml "
     "data_dir=/work/runs/snap2/smollm2-135m-evalform,data/smollm2-135m-20k@1500 "
     "feature_cache=/work/runs/features/smollm2-135m-bf16 feature_cache_dtype=bfloat16 "
     "output_dir=/work/runs/smollm2-135m-dspark-evalform2 time_budget_seconds=3300 mixed_precision=no && "
     "OMP_NUM_THREADS=1 dspark-hf eval --drafter /work/runs/smollm2-135m-dspark-evalform2/final --target "
     "smollm2-135m-instruct --limit 16 --max-new-tokens 64 --speed-prompts 0 --no-quality --out "
     "results/evalform_smollm2/eval_evalform2 (49 minutes of training on one Zen 4 core)"),
    ("evalform_smollm2/heldout96.md",
     "The release and the eval-form fine-tune on all 96 general held-out prompts, per source: what the fine-tune "
     "costs off its new domain",
     "RUNS=/work/runs THREADS=2 BUDGET=3000 bash scripts/train_evalform.sh (the fine-tune: examples/configs/smollm2-135m-dspark-evalform.yaml on data/smollm2-135m-evalform as committed in dbc63f0, 1,280 answers, and 1,500 general ones; 1,000 steps, 35 minutes on two Zen 4 cores)"),
    ("evalform_smollm2/batch1/results.md",
     "Batch 1, wall clock: the release and the eval-form fine-tune, alone and behind three lookup tables (the "
     "shipped one; every general answer; the same plus the eval-form answers), prompt lookup as the reference (the "
     "unit suite shared the machine during HumanEval and MT-Bench: their later columns ran slower; tau is unaffected)",
     "RUNS=/work/runs THREADS=2 BUDGET=3000 bash scripts/train_evalform.sh (the fine-tune: examples/configs/smollm2-135m-dspark-evalform.yaml on data/smollm2-135m-evalform as committed in dbc63f0, 1,280 answers, and 1,500 general ones; 1,000 steps, 35 minutes on two Zen 4 cores)"),
    ("evalform_smollm2/batch1_tables/results.md",
     "The shipped lookup table before and after adding the eval-form answers (evalform-small, shipped since "
     "2026-12-07; evalform: every answer folder), alone and behind the release drafter, nothing else running",
     "dspark-hf lookup --data data/smollm2-135m-evalform,data/smollm2-135m-12k,data/smollm2-135m --min-total 2 --out "
     "/work/runs/lookup/evalform_small.safetensors (data/smollm2-135m-evalform as of commit dbc63f0) && the same "
     "with --data data/smollm2-135m-evalform,data/smollm2-135m-20k,data/smollm2-135m-12k,data/smollm2-135m --out "
     "/work/runs/lookup/evalform.safetensors && OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table "
     "release=release --table evalform-small=/work/runs/lookup/evalform_small.safetensors --table "
     "evalform=/work/runs/lookup/evalform.safetensors --branches 0 --assist --prompt-lookup 10 --prompts 6 --out "
     "results/evalform_smollm2/batch1_tables (release = the table shipped before)"),
    ("evalform_smollm2/batch1_branches/results.md",
     "The lookup table before 2026-12-07 and the one shipped since, alone, behind the release drafter as one chain, and "
     "as a branch of its chain (4 nodes, lookup rounds up to 16 drafts: the fastest configuration on earlier AVX-512 "
     "VMs); data generation used the other core",
     "git show cd3ba6a:src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors > "
     "/work/runs/lookup/before_20261207.safetensors && OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table "
     "before=/work/runs/lookup/before_20261207.safetensors --table shipped=release --branches 4 --branch-lookup-max 16 "
     "--assist --prompt-lookup 0 --prompts 6 --out results/evalform_smollm2/batch1_branches"),
    ("lookup_tree_sim/results.md",
     "Lookup alternatives as tree branches, replayed offline against the target's recorded greedy output: tree / chain "
     "tau at equal node budgets (issue 13), with the target's cost curve for those widths from the same run",
     "python scripts/sim_lookup_trees.py --prompts 12 --max-new-tokens 128 --out results/lookup_tree_sim (the shipped "
     "table, the one of 8745a55; --lookup FILE replays another)"),
    ("lookup_tree_sim/tables.md",
     "Lookup tables replayed offline on the same recorded output: the chain's tau per table (n-gram orders, pruning, "
     "the eval-form answers), no timing noise",
     "D=data/smollm2-135m-evalform,data/smollm2-135m-12k,data/smollm2-135m; for m in 1 2 3 4; do dspark-hf lookup "
     "--data $D --min-total $m --out /work/runs/lookup/f8m$m.safetensors; done; for o in 12 16; do dspark-hf lookup "
     "--data $D --max-order $o --min-total 2 --out /work/runs/lookup/f${o}m2.safetensors; done; git show "
     "cd3ba6a:src/dspark_hf/testbed/releases/smollm2-135m-instruct-lookup/lookup.safetensors > "
     "/work/runs/lookup/before_20261207.safetensors; git show 8745a55:<the same path> > /work/runs/lookup/shipped.safetensors "
     "&& python scripts/sim_lookup_trees.py --out results/lookup_tree_sim --budgets 4 8 16 --tables "
     "shipped=/work/runs/lookup/shipped.safetensors before=/work/runs/lookup/before_20261207.safetensors "
     "m1=/work/runs/lookup/f8m1.safetensors ... m4=/work/runs/lookup/f8m4.safetensors "
     "order12=/work/runs/lookup/f12m2.safetensors order16=/work/runs/lookup/f16m2.safetensors (the run below passed "
     "shipped=release, the 8745a55 table, still shipped)"),
    ("drafter_lookup_sim/results.md",
     "Lookup drafts and the release drafter in one round, replayed offline on the same recorded output: one source per "
     "round, spliced per position (by estimates, or by a table fit on the other half of the prompts), and the two "
     "oracles (the better chain after the fact; either source right at each position): how much tau any combination "
     "of today's two sources can reach (issue 14)",
     "python scripts/sim_drafter_lookup.py --scheduled --out results/drafter_lookup_sim"),
    ("evalform_smollm2/batch1_pruned/results.md",
     "The lookup table shipped on 2026-12-07 (1,280 eval-form answers, contexts seen 2+ times, 24 MB) against tables "
     "from all 4,040 eval-form answers with contexts seen 3+ (m3, 18 MB) or 4+ times (m4, 13 MB; neither shipped), alone "
     "and behind the release drafter; a fine-tune used the other core",
     "dspark-hf lookup --data data/smollm2-135m-evalform,data/smollm2-135m-12k,data/smollm2-135m --min-total 3 --out "
     "/work/runs/lookup/f8m3.safetensors && the same with --min-total 4 --out /work/runs/lookup/f8m4.safetensors && "
     "OMP_NUM_THREADS=1 python scripts/bench_lookup_tables.py --table shipped=release --table "
     "m3=/work/runs/lookup/f8m3.safetensors --table m4=/work/runs/lookup/f8m4.safetensors --branches 0 --assist "
     "--prompt-lookup 10 --prompts 6 --out results/evalform_smollm2/batch1_pruned (shipped = the table of 8745a55, still shipped)"),
    ("compare_smollm2_gpu_tau/compare.md",
     "The GPU-trained drafters on the evaluation sets: tau and per-position acceptance (issue 14 goals: macro tau "
     ">= 3.5; DSpark >= 1.15x the DFlash baseline at equal budget)",
     LEASE + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
     "release=results/training_smollm2_bf16/drafter --drafter gpu-dspark=/work/runs/gpu-drafters/dspark --drafter "
     "gpu-dspark-2l=/work/runs/gpu-drafters/dspark-2l --drafter gpu-dflash=/work/runs/gpu-drafters/dflash --limit 8 "
     "--max-new-tokens 64 --speed-prompts 0 --prompt-lookup 0 --prepack --gqa-attention "
     "--out /work/runs/eval/compare_tau && cp -r /work/runs/eval/compare_tau/. results/compare_smollm2_gpu_tau/"),
    ("calibration_smollm2_gpu_2l/calibration.md",
     "STS calibration of the GPU-trained 2-layer drafter (fit on half of 96 held-out prompts, measured on the other "
     "half; today's release)",
     LEASE + " && OMP_NUM_THREADS=1 dspark-hf calibrate --drafter /work/runs/gpu-drafters/dspark-2l --target "
     "smollm2-135m-instruct --prompts data/heldout_prompts.jsonl --limit 96 --fit-fraction 0.5 --max-new-tokens 64 "
     "--batch-size 16 --out /work/runs/gpu-2l-calibrated --report-dir results/calibration_smollm2_gpu_2l && "
     "dspark-hf release --drafter /work/runs/gpu-2l-calibrated --target smollm2-135m-instruct"),
    ("compare_smollm2_gpu/compare.md",
     "Today's release drafter (GPU-trained, 2 layers) vs the CPU-trained release before it, alone and behind n-gram "
     "lookup drafts, with target-only and transformers' prompt lookup, batch 1, prepacked target with GQA attention, "
     "the benchmark alone on the machine (issue 14 goals: >= 1.8x, tau >= 3.5, faster than prompt lookup on every set)",
     "OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
     "release=results/training_smollm2_bf16/drafter --drafter "
     "gpu-dspark-2l=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --limit 8 --max-new-tokens 64 "
     "--speed-prompts 2 --prepack --gqa-attention --lookup release --out results/compare_smollm2_gpu"),
    ("bench_smollm2_gpu_gsm/bench.md",
     "Throughput vs concurrency with today's release drafter (GPU-trained), lookup drafts, prepacked linears and GQA "
     "attention (issue 14 goal: scheduled >= 0.97x max(none, fixed))",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-warm "
     "--concurrency 1 4 16 --max-new-tokens 48 --repeats 2 --lookup release --prepack --gqa-attention "
     "--prompt-set gsm_symbolic --out results/bench_smollm2_gpu_gsm"),
    ("bench_smollm2_gpu_gsm_c64/bench.md",
     "The same at 64 requests (no `fixed`: 0.5-0.6x of none in every earlier run)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies scheduled scheduled-warm "
     "--concurrency 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --gqa-attention "
     "--prompt-set gsm_symbolic --out results/bench_smollm2_gpu_gsm_c64"),
    ("tree/batch1_gpu_release.md",
     "Trees vs the chain at batch 1 with today's GPU-trained release drafter (prepacked target, GQA attention, policy "
     "fixed; issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 4 8 --repeats 2 --threads 1 --prepack --gqa-attention "
     "--label gpu_release"),
    ("decode_only_warm_skip/decode_only_c16.md",
     "Decode only at 16 requests: warm calls whose drafter skips may grow to 128 rounds and run on across calls "
     "(`PolicyMemory()`, the default) vs skips capped at 32 rounds as within one call (`PolicyMemory(max_skip=32)`)",
     "OMP_NUM_THREADS=1 python scripts/bench_decode_only.py --concurrency 16 --repeats 3 --methods "
     "'hf plain,none,scheduled-warm,scheduled-warm-skip32' --sps results/bench_smollm2_warm_c16/sps-rows16.json "
     "--out results/decode_only_warm_skip"),
    ("bench_smollm2_warm128_c16/bench.md",
     "Cold vs warm calls at 16 requests with the memory's longer drafter skips (`PolicyMemory()`, max_skip 128)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 16 --max-new-tokens 48 --repeats 5 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --sps results/bench_smollm2_warm_c16/sps-rows16.json "
     "--out results/bench_smollm2_warm128_c16"),
    ("bench_smollm2_warm128_low/bench.md",
     "The same at 1 and 4 requests, with `fixed`",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies fixed scheduled scheduled-warm --concurrency 1 4 --max-new-tokens 48 --repeats 3 --lookup release "
     "--prepack --gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm128_low"),
    ("bench_smollm2_warm128_c64/bench.md",
     "The same at 64 requests",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --sps results/bench_smollm2_warm_c64/sps-rows64.json "
     "--out results/bench_smollm2_warm128_c64"),
    ("bench_smollm2_warm_c64_r3/bench.md",
     "The 64-request comparison run again with 3 repeats",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter results/training_smollm2_bf16/drafter "
     "--policies scheduled scheduled-warm --concurrency 64 --max-new-tokens 48 --repeats 3 --lookup release --prepack "
     "--gqa-attention --prompt-set gsm_symbolic --out results/bench_smollm2_warm_c64_r3"),
    ("tree/batch1_lookup_branches.md",
     "Lookup branches: the n-gram lookup's continuation verified as a branch of the drafter's tree, against the chain "
     "loop's lookup merge, batch 1, policy fixed (issues 13 and 14)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 aime gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 0 4 --max-nodes 8 --repeats 2 --threads 1 --prepack --gqa-attention "
     "--lookup release --label lookup_branches"),
    ("tree/batch1_lookup_branches_widths.md",
     "Lookup branches at verification widths 6, 8, 10 and 12 (`chain/W` is the lookup branch capped at W nodes, "
     "`tree4/W` adds 4 drafter alternatives)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 aime gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 4 --max-nodes 6 8 10 12 --repeats 2 --threads 1 --prepack "
     "--gqa-attention --lookup release --label lookup_branches_widths"),
    ("tree/batch1_lookup_branches_gated.md",
     "Lookup branches with the drafter gate (rounds where the lookup alone is expected to emit faster skip the drafter)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 aime gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 0 4 --max-nodes 8 --repeats 2 --threads 1 --prepack --gqa-attention "
     "--lookup release --label lookup_branches_gated"),
    ("tree/load_lookup_branches.md",
     "Lookup branches under load: chain with the lookup merge vs the lookup branch capped at 8 nodes, scheduled policy",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 0 --max-nodes 8 "
     "--max-new-tokens 32 --repeats 3 --prepack --gqa-attention --max-prompt-len 256 --threads 1 --lookup release "
     "--label lookup_branches"),
    ("tree/load_lookup_branches_calibrated.md",
     "The same after each source's online calibration sees only its own nodes (lookup branch vs drafter nodes)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 0 --max-nodes 8 "
     "--max-new-tokens 32 --repeats 3 --prepack --gqa-attention --max-prompt-len 256 --threads 1 --lookup release "
     "--label lookup_branches_calibrated"),
    ("tree/load_lookup_branches_gate.md",
     "The same with the drafter gate, the benchmark alone on the machine",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 0 --max-nodes 8 "
     "--max-new-tokens 32 --repeats 3 --prepack --gqa-attention --max-prompt-len 256 --threads 1 --lookup release "
     "--label lookup_branches_gate"),
    ("teacher_forced/smollm2_release.md",
     "Where the release drafter's acceptance is lost: teacher-forced on training vs held-out answers vs decoding (issue 14)",
     "OMP_NUM_THREADS=1 python scripts/teacher_forced_acceptance.py --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --data data/smollm2-135m-12k --examples 8 "
     "--threads 1 --out results/teacher_forced/smollm2_release"),
    ("compare_smollm2_branches/compare.md",
     "Release drafter with lookup branches beside target-only, prompt lookup and the release configuration, batch 1 "
     "(issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
     "release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --limit 8 --max-new-tokens 64 "
     "--speed-prompts 2 --prepack --gqa-attention --lookup release --lookup-branches 8 "
     "--out results/compare_smollm2_branches"),
    ("tree/batch1_lookup_branches_realized_gate.md",
     "Lookup branches with the drafter gate deciding from what each lookup-strength bin realized (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 aime gsm_symbolic "
     "--prompts 2 --max-new-tokens 64 --budgets 0 4 --max-nodes 8 10 --repeats 2 --threads 1 --prepack "
     "--gqa-attention --lookup release --label lookup_branches_realized_gate"),
    ("tree/load_lookup_branches_realized_gate.md",
     "Lookup branches under load with the realized drafter gate (issue 13)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 0 --max-nodes 8 "
     "--max-new-tokens 32 --repeats 3 --prepack --gqa-attention --max-prompt-len 256 --threads 1 --lookup release "
     "--label lookup_branches_realized_gate"),
    ("tree/load_lookup_branches_realized_gate_warm.md",
     "The same with the cost-curve profile out of the timed calls (`--warmup`)",
     "OMP_NUM_THREADS=1 python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 0 --max-nodes 8 "
     "--max-new-tokens 32 --repeats 3 --prepack --gqa-attention --max-prompt-len 256 --threads 1 --lookup release "
     "--warmup --label lookup_branches_realized_gate_warm"),
    ("bench_smollm2_session5_gsm/bench.md",
     "Batched goal re-measured: every policy against max(none, fixed) at 1, 4 and 16 requests (issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies fixed scheduled scheduled-warm "
     "--concurrency 1 4 16 --max-new-tokens 48 --repeats 2 --lookup release --prepack --gqa-attention "
     "--prompt-set gsm_symbolic --out results/bench_smollm2_session5_gsm"),
    ("bench_smollm2_session5_gsm_c64/bench.md",
     "The same at 64 requests (`fixed`, far below none there, left out)",
     "OMP_NUM_THREADS=1 dspark-hf bench --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --policies scheduled scheduled-warm "
     "--concurrency 64 --max-new-tokens 48 --repeats 2 --lookup release --prepack --gqa-attention "
     "--prompt-set gsm_symbolic --out results/bench_smollm2_session5_gsm_c64"),
    ("sps_cache/sps_cache.md",
     "What the on-disk SPS cache saves: a process's first scheduled call with an empty `SPSCache(directory)` vs a new "
     "cache reading the stored table",
     "OMP_NUM_THREADS=1 python scripts/bench_sps_cache.py --concurrency 1 16 64 --out results/sps_cache"),
    ("compare_smollm2_branches_gate/compare.md",
     "Lookup branches with the realized drafter gate beside target-only, prompt lookup and the release configuration, "
     "batch 1 (issue 14)",
     "OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
     "release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --limit 8 --max-new-tokens 64 "
     "--speed-prompts 2 --prepack --gqa-attention --lookup release --lookup-branches 8 "
     "--out results/compare_smollm2_branches_gate"),
    ("training_qwen2.5-coder-0.5b_cpu/training.md",
     "A DSpark drafter for Qwen2.5-Coder-0.5B-Instruct trained on the CPU: 2,016 answers, 65-minute time budget, "
     "held-out tau along the way (issue 14 part 5)",
     QWEN_CPU_TRAIN + " && dspark-hf training-report --run dspark=/work/runs/qwen2.5-coder-0.5b-dspark-cpu "
     "--out results/training_qwen2.5-coder-0.5b_cpu"),
    ("calibration_qwen2.5-coder-0.5b_cpu/calibration.md",
     "STS calibration of that Qwen2.5-Coder-0.5B drafter (fit on half of 48 held-out prompts, measured on the other "
     "half)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE),
    ("lookup_qwen2.5-coder-0.5b_drafter/results.md",
     "Qwen2.5-Coder-0.5B-Instruct at batch 1: the CPU-trained DSpark drafter beside target-only, prompt lookup and "
     "n-gram lookup drafts, prepacked target with GQA attention (issue 14 part 5)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_CPU_BENCH),
    ("qwen_evalform/training/training.md",
     "That Qwen2.5-Coder-0.5B drafter continued on 1,024 eval-form answers added to its 2,016 (30-minute time budget, "
     "warm start), its first run beside it (issue 14 parts 2, 3, 5)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM),
    ("qwen_evalform/calibration/calibration.md",
     "STS calibration of the continued Qwen2.5-Coder-0.5B drafter (fit on half of 48 held-out prompts, measured on "
     "the other half)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM),
    ("qwen_evalform/batch1/results.md",
     "Qwen2.5-Coder-0.5B-Instruct at batch 1: the continued drafter (whole block, Algorithm 1 lengths with and "
     "without the backoff, the realized gate) beside its first run, target-only, prompt lookup and lookup drafts "
     "from a table with the eval-form answers (issue 14 part 5)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM),
    ("qwen_evalform2/training/training.md",
     "The Qwen2.5-Coder-0.5B drafter's round 2: round 1 continued on all 1,824 eval-form answers and the 2,016 general "
     "ones (40-minute time budget, one thread, warm start), round 1 beside it (issue 14 parts 2, 3, 5)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM + " && " + QWEN_EVALFORM2),
    ("qwen_evalform2/calibration/calibration.md",
     "STS calibration of the round-2 Qwen2.5-Coder-0.5B drafter (fit on half of 48 held-out prompts, measured on the "
     "other half)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM + " && " + QWEN_EVALFORM2),
    ("qwen_evalform2/batch1/results.md",
     "Qwen2.5-Coder-0.5B-Instruct at batch 1: the round-2 drafter beside round 1, target-only, prompt lookup and "
     "lookup drafts from a table with all eval-form answers (issue 14 part 5)",
     QWEN_CPU_TRAIN + " && " + QWEN_CPU_CALIBRATE + " && " + QWEN_EVALFORM + " && " + QWEN_EVALFORM2),
    ("training_smollm2_rnn_vs_dflash/training.md",
     "The DSpark recipe of the spread pair with the RNN head instead of the Markov head, against that pair's DFlash "
     "run (1,200 steps; runs with one seed and data subset are deterministic at equal steps, so the DFlash run of "
     "another session compares there; its CPU hours were measured on another VM session and do not)",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 VARIANTS=dspark DFLASH_TAG= TAG=-rnn "
     "DSPARK_ARGS=sequential_head=rnn OUT=results/training_smollm2_rnn_vs_dflash "
     "HELDOUT=results/heldout_tau/smollm2_rnn_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_rnn_vs_dflash.md", "Those final drafters on all 96 held-out prompts, per source family",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 VARIANTS=dspark DFLASH_TAG= TAG=-rnn "
     "DSPARK_ARGS=sequential_head=rnn OUT=results/training_smollm2_rnn_vs_dflash "
     "HELDOUT=results/heldout_tau/smollm2_rnn_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_gated_vs_dflash/training.md",
     "The same with the gated Markov head (DeepSpec's \"gated\"), trained beside the RNN run",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 VARIANTS=dspark DFLASH_TAG= TAG=-gated "
     "DSPARK_ARGS=sequential_head=gated_markov OUT=results/training_smollm2_gated_vs_dflash "
     "HELDOUT=results/heldout_tau/smollm2_gated_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh"),
    ("heldout_tau/smollm2_gated_vs_dflash.md", "Those final drafters on all 96 held-out prompts, per source family",
     "RUNS=/work/runs EXAMPLES=1024 STEPS=1200 EVERY=300 VARIANTS=dspark DFLASH_TAG= TAG=-gated "
     "DSPARK_ARGS=sequential_head=gated_markov OUT=results/training_smollm2_gated_vs_dflash "
     "HELDOUT=results/heldout_tau/smollm2_gated_vs_dflash.json bash scripts/train_dspark_vs_dflash.sh"),
    ("training_smollm2_sparse_teacher/training.md",
     "The sparse teacher (`teacher_topk=64`) against the dense one: the seed-0 DSpark recipe twice side by side (the "
     "dense run reproduces stop 41's exactly), then the DFlash baseline with the sparse teacher for its diagnostics "
     "(its weights are the dense-teacher DFlash run's: CE only), all on one VM in one session (issue 14 part 3)",
     SPARSE_ALL + " && dspark-hf training-report --run dense=/work/runs/dspark-dense-1024-1200 --run "
     "topk64=/work/runs/dspark-topk64-1024-1200 --run dflash-topk64=/work/runs/dflash-topk64-1024-1200 "
     "--out results/training_smollm2_sparse_teacher"),
    ("heldout_tau/smollm2_sparse_teacher.md", "Those three final drafters on all 96 held-out prompts, per source family "
     "(each script call also writes its own pairwise report against a DFlash run; this table and the one above "
     "hold all three)",
     SPARSE_ALL + " && python scripts/heldout_tau.py --merge /work/runs/heldout-dspark-dense-1024-1200.json "
     "/work/runs/heldout-dspark-topk64-1024-1200.json /work/runs/heldout-dflash-topk64-1024-1200.json "
     "--out results/heldout_tau/smollm2_sparse_teacher.json"),
    ("compare_smollm2_topk64_tau/compare.md",
     "The sparse- and dense-teacher DSpark drafters and the DFlash baseline on the evaluation sets: tau and "
     "per-position acceptance (8 prompts per set)",
     SPARSE_ALL + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct --drafter "
     "topk64=/work/runs/dspark-topk64-1024-1200/final --drafter dense=/work/runs/dspark-dense-1024-1200/final "
     "--drafter dflash=/work/runs/dflash-1024-1200/final --limit 8 --max-new-tokens 64 --speed-prompts 0 "
     "--prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_topk64_tau"),
    ("training_smollm2_topk64_seed1/training.md",
     "The sparse teacher on a second seed: the seed-1 DSpark recipe with `teacher_topk=64` against the seed-1 DFlash "
     "run (equal steps; that run was trained in an earlier session, so its CPU hours do not compare; trained at "
     "the code of commit e418d79, before the cheaper Markov step)",
     TOPK64_SEED1),
    ("heldout_tau/smollm2_topk64_seed1.md", "Those final drafters on all 96 held-out prompts, per source family",
     TOPK64_SEED1),
    ("training_smollm2_cheaper_step/training.md",
     "The sparse-teacher pair again after the cheaper DSpark step (the Markov bias once per distinct previous token; "
     "TV's graph only where it is weighted): seed 0, DSpark then DFlash on one core of one VM in one session, both "
     "reading top-k entries cached earlier (issue 14 part 3)",
     CHEAPER_PAIR),
    ("heldout_tau/smollm2_cheaper_step.md", "Those final drafters on all 96 held-out prompts, per source family",
     CHEAPER_PAIR),
    ("compare_smollm2_cheaper_step_tau/compare.md",
     "The DSpark and DFlash drafters of the cheaper-step pair on the evaluation sets: tau and per-position acceptance "
     "(8 prompts per set)",
     CHEAPER_PAIR + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct "
     "--drafter cheaper=/work/runs/dspark-topk64-v2-1024-1200/final --drafter "
     "dflash=/work/runs/dflash-topk64-v2-1024-1200/final --limit 8 --max-new-tokens 64 --speed-prompts 0 "
     "--prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_cheaper_step_tau"),
    ("training_smollm2_r512_vs_dflash/training.md",
     "A Markov head of rank 512 (nearly free since the cheaper step) against the cheaper-step pair's DFlash run: same "
     "seed, data, schedule and sparse teacher, the same VM and session (issue 14 part 3)",
     R512_PAIR),
    ("heldout_tau/smollm2_r512_vs_dflash.md", "Those final drafters on all 96 held-out prompts, per source family",
     R512_PAIR),
    ("compare_smollm2_r512_tau/compare.md",
     "The rank-512 DSpark drafter and the DFlash baseline on the evaluation sets: tau and per-position acceptance "
     "(8 prompts per set)",
     R512_PAIR + " && OMP_NUM_THREADS=1 dspark-hf compare --target smollm2-135m-instruct "
     "--drafter r512=/work/runs/dspark-topk64-r512-1024-1200/final --drafter "
     "dflash=/work/runs/dflash-topk64-v2-1024-1200/final --limit 8 --max-new-tokens 64 --speed-prompts 0 "
     "--prompt-lookup 0 --prepack --gqa-attention --out results/compare_smollm2_r512_tau"),
    ("training_smollm2_r512_seed1/training.md",
     "The rank-512 recipe on a second seed: DSpark (rank 512) and DFlash with seed 1 side by side, one core each, the "
     "sparse teacher's entries cached before the pair by 300 steps of a throwaway run and read by both (issue 14 "
     "part 3)",
     R512_SEED1),
    ("heldout_tau/smollm2_r512_seed1.md", "Those final drafters on all 96 held-out prompts, per source family",
     R512_SEED1),
    ("training_smollm2_loss_weights_ce1/training.md",
     "DSpark's loss weights, one at a time (rank-512 seed-1 recipe, against its DFlash run): the CE weight 1.0 instead "
     "of the paper's 0.1 (TV 0.9 and confidence 1.0 kept), the same batches",
     LOSS_WEIGHTS["ce1"]),
    ("heldout_tau/smollm2_loss_weights_ce1.md", "That drafter and DFlash on all 96 held-out prompts",
     LOSS_WEIGHTS["ce1"]),
    ("training_smollm2_loss_weights_ce1_seed0/README.md",
     "CE weight 1.0 on seed 0: the DSpark run only, against the cheaper-step pair's seed-0 DFlash run (its held-out "
     "tau along the way and on all 96 prompts; the training report not run yet)",
     CE1_SEED0),
    ("training_smollm2_loss_weights_conf01/training.md",
     "The confidence weight 0.1 instead of 1.0 (CE 0.1 and TV 0.9 kept): how much the confidence head's BCE, which "
     "reaches the backbone, costs the drafts",
     LOSS_WEIGHTS["conf01"]),
    ("heldout_tau/smollm2_loss_weights_conf01.md", "That drafter and DFlash on all 96 held-out prompts",
     LOSS_WEIGHTS["conf01"]),
    ("compare_smollm2_loss_weights_tau/compare.md",
     "The seed-1 drafters of the loss-weight ablations and their DFlash baseline on the evaluation sets: tau and "
     "per-position acceptance, 16 prompts per set",
     LOSS_WEIGHTS_TAU),
    ("training_smollm2_loss_weights_ce1_conf01/training.md",
     "Both changes at once: CE weight 1.0 and confidence weight 0.1 (TV 0.9 kept), rank-512 seed-1 recipe, against "
     "its DFlash run (the same batches)",
     LOSS_WEIGHTS["ce1_conf01"]),
    ("heldout_tau/smollm2_loss_weights_ce1_conf01.md", "That drafter and DFlash on all 96 held-out prompts",
     LOSS_WEIGHTS["ce1_conf01"]),
    ("compare_smollm2_loss_weights_tau2/compare.md",
     "Both weight changes at once and the detached confidence head on the evaluation sets, with the same DFlash "
     "baseline (16 prompts per set)",
     LOSS_WEIGHTS_TAU2),
    ("compare_smollm2_loss_weights_tau/decomposition.md",
     "Where DSpark's gain over DFlash on the evaluation sets comes from: the first draft or the drafts after it, "
     "rebuilt from the per-position acceptance of both compare runs",
     LOSS_WEIGHTS_TAU + " && " + LOSS_WEIGHTS_TAU2 + " && python scripts/acceptance_decomposition.py "
     "results/compare_smollm2_loss_weights_tau/compare.json results/compare_smollm2_loss_weights_tau2/compare.json "
     "--baseline dflash --goal 1.15 --out results/compare_smollm2_loss_weights_tau/decomposition.md"),
    ("training_smollm2_loss_weights_conf_detach/training.md",
     "The confidence head trained on detached inputs (`detach_confidence_inputs=true`: its BCE fits the head alone and "
     "never reaches the backbone or the Markov head), the paper's weights otherwise, rank-512 seed-1 recipe, against its "
     "DFlash run",
     LOSS_WEIGHTS["conf_detach"]),
    ("heldout_tau/smollm2_loss_weights_conf_detach.md", "That drafter and DFlash on all 96 held-out prompts",
     LOSS_WEIGHTS["conf_detach"]),
    ("training_smollm2_loss_weights_conf_detach_seed0/training.md",
     "The detached confidence head on seed 0, against the seed-0 DFlash run (trained again on the same VM this "
     "session, bit for bit the earlier one)",
     CONF_DETACH_SEED0),
    ("heldout_tau/smollm2_loss_weights_conf_detach_seed0.md", "That drafter and DFlash on all 96 held-out prompts",
     CONF_DETACH_SEED0),
    ("compare_smollm2_loss_weights_tau_seed0/compare.md",
     "The seed-0 CE-1.0 and detached-confidence drafters and the seed-0 DFlash run on the evaluation sets (16 prompts "
     "a set)",
     LOSS_WEIGHTS_TAU_SEED0),
    ("compare_smollm2_loss_weights_tau_seed0/decomposition.md",
     "Seed 0: the first draft's and the later drafts' share of the gain on the evaluation sets",
     LOSS_WEIGHTS_TAU_SEED0),
    ("training_smollm2_conf_detach_2400/training.md",
     "Twice the budget: the seed-0 detached-head pair trained for 2,400 steps each (the same 1,024 examples, the WSD "
     "schedule decaying over the last 480 steps), DSpark and DFlash side by side",
     CONF_DETACH_2400),
    ("heldout_tau/smollm2_conf_detach_2400.md", "That pair's drafters on all 96 held-out prompts", CONF_DETACH_2400),
    ("compare_smollm2_conf_detach_2400_tau/compare.md",
     "That pair on the evaluation sets (16 prompts a set)", CONF_DETACH_2400_TAU),
    ("compare_smollm2_conf_detach_2400_tau/decomposition.md",
     "At 2,400 steps: the first draft's and the later drafts' share of the gain on the evaluation sets",
     CONF_DETACH_2400_TAU),
    ("calibration_loss_weights/confdetach-2400/calibration.md",
     "The confidence head of that 2,400-step detached-head drafter: STS calibration on held-out prompts (24 fit, 24 "
     "measure)",
     _calibrate(CONF_DETACH_2400, "dspark-topk64-r512-confdetach", "confdetach-2400", size="1024-2400")),
    ("training_smollm2_loss_weights_ce1_seed0/training.md",
     "CE weight 1.0 on seed 0: the training report against the seed-0 DFlash run, both on the same VM",
     CE1_SEED0 + " && dspark-hf training-report --run dspark-topk64-r512-ce1=/work/runs/dspark-topk64-r512-ce1-1024-1200 "
     "--run dflash-topk64-v2=/work/runs/dflash-topk64-v2-1024-1200 --out results/training_smollm2_loss_weights_ce1_seed0"),
    *[(f"calibration_loss_weights/{name}/calibration.md",
       f"The confidence head of the `{name.removesuffix('-seed0')}` drafter, seed {0 if name.endswith('-seed0') else 1}: "
       "STS calibration on held-out prompts (24 fit, 24 measure)",
       command) for name, command in LOSS_WEIGHTS_CALIBRATION.items()],
    ("train_step_cost/results.md",
     "The CPU cost of one training step, DSpark and DFlash, today's paths and the ones they replaced, side by side",
     "OMP_NUM_THREADS=1 python scripts/bench_train_step.py --set teacher_topk=64 --out results/train_step_cost"),
    ("train_step_cost_profile/results.md",
     "Where a DSpark training step's CPU time goes beyond a DFlash one's (after the in-place Markov bias; the DSpark "
     "run of the rank-512 seed-1 pair on the other core, so the profiled columns carry that noise)",
     "OMP_NUM_THREADS=1 python scripts/bench_train_step.py --set teacher_topk=64 --settings dspark dflash --steps 12 "
     "--warmup 3 --profile 6 --out results/train_step_cost_profile"),
    ("teacher_topk/smollm2/mass.md",
     "How much of the target's next-token mass a sparse teacher of k draft ids keeps (the slack of the sparse TV "
     "bound; issue 14 part 3)",
     "python scripts/teacher_topk_mass.py --target smollm2-135m-instruct --drafter "
     "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --data data/smollm2-135m-12k --examples 64 "
     "--out results/teacher_topk/smollm2"),
]


def collect(results_dir: str | Path = "results", out: str | Path = "RESULTS.md") -> Path:
    results_dir = Path(results_dir)
    parts = ["# Results", "",
             "Assembled by `python scripts/collect_results.py` from the tables the commands below wrote under `results/` (each with a "
             "JSON file of provenance: commit, versions, device). Machine: a shared 2-core x86_64 CPU VM with no GPU; "
             "timings are noisy there, so every speed figure is a ratio measured side by side in one run.", ""]
    for rel, title, command in SECTIONS:
        path = results_dir / rel
        parts += [f"## {title}", "", f"`{command}`", ""]
        if path.exists():
            body = path.read_text().splitlines()
            parts += [line for line in body if not line.startswith("# ")] + [""]
            pngs = sorted(path.parent.glob("*.png"))  # a folder of several tables: each shows its own plots
            own = [png for png in pngs if png.stem.startswith(path.stem)]
            for png in own if own and len(own) < len(pngs) else pngs:
                parts += [f"![{png.stem}]({results_dir.name}/{png.relative_to(results_dir).as_posix()})", ""]
        else:
            parts += ["Not measured yet.", ""]
    out = Path(out)
    atomic_write_text(out, "\n".join(parts))
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="scripts/collect_results.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--out", default="RESULTS.md")
    parser.add_argument("--rerun", action="store_true",
                        help="first run every section's command in order (data, training, measurements: hours on a "
                             "CPU; each step resumes), then assemble")
    args = parser.parse_args(argv)
    if args.rerun:
        import subprocess

        for rel, title, command in SECTIONS:
            print(f"== {title}\n$ {command}", flush=True)
            subprocess.run(command, shell=True, check=True)
    path = collect(args.results_dir, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
