"""The `dspark-hf` command: thin subcommands over library functions.

    dspark-hf demo        speculative vs target-only generation, side by side (dspark_hf.testbed.demo)
    dspark-hf prompts     build training prompts from non-evaluation sources (dspark_hf.training.prompts)
    dspark-hf data        the target answers the prompts: training data (dspark_hf.training.data)
    dspark-hf train       train a drafter (dspark_hf.training.trainer; `accelerate launch` for many GPUs)
    dspark-hf calibrate   STS calibration, written into the drafter's config (dspark_hf.training.calibration)
    dspark-hf eval        tau, per-position acceptance, threshold sweep, speedup, quality (dspark_hf.evaluation.evaluate)
    dspark-hf bench       throughput vs concurrency per verification policy (dspark_hf.evaluation.throughput)
    dspark-hf bench-head  cost of the sequential head vs the parallel forward (dspark_hf.evaluation.head_cost)
    dspark-hf fetch-target  download and convert a registered target model (dspark_hf.testbed.targets)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Callable


def _demo(argv: list[str]) -> None:
    from .testbed.demo import main

    main(argv)


def _bench(argv: list[str]) -> None:
    from .evaluation.throughput import main

    main(argv)


def labeled_folders(parser: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, str]:
    """`LABEL=FOLDER` arguments -> {label: folder}; a malformed one is a parser error naming the flag."""
    out = {}
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            parser.error(f"{flag} takes LABEL=FOLDER, got {item!r}")
        out[label] = folder
    return out


def _training_report(argv: list[str]) -> None:
    from .evaluation.training_report import main

    main(argv)


def _bench_head(argv: list[str]) -> None:
    from .evaluation.head_cost import main

    main(argv)


def _fetch_target(argv: list[str]) -> None:
    from .testbed.targets import fetch_target, list_targets

    parser = argparse.ArgumentParser(prog="dspark-hf fetch-target")
    parser.add_argument("name", choices=list_targets())
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    print(fetch_target(args.name, force=args.force))


def _prompts(argv: list[str]) -> None:
    from .training.prompts import TrainingPromptRecipe, build_training_prompts, count_by_source, write_jsonl

    parser = argparse.ArgumentParser(prog="dspark-hf prompts", description="build training prompts (no eval sets)")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--limit", type=int, help="keep this many prompts: a third each from math, code and chat "
                                                  "sources, evenly across the sources of each family")
    parser.add_argument("--skip-missing", action="store_true", help="skip sources that are not installed")
    parser.add_argument("--exclude", action="append", default=[],
                        help="JSONL of prompts to leave out (e.g. the training set, when building held-out prompts)")
    args = parser.parse_args(argv)
    prompts = build_training_prompts(TrainingPromptRecipe(seed=args.seed, skip_missing=args.skip_missing))
    if args.exclude:
        from .training.prompts import read_prompts_jsonl

        seen = {m["content"] for path in args.exclude for p in read_prompts_jsonl(path)[0] for m in p["messages"]}
        prompts = [p for p in prompts if not any(m["content"] in seen for m in p["messages"])]
    if args.limit and args.limit < len(prompts):
        import random

        def family(source: str) -> str:
            if source.startswith("reasoning_gym_code") or source in ("codeio", "python_docs"):
                return "code"
            return "math" if source.startswith("reasoning_gym") else "chat"

        rng = random.Random(args.seed)
        picked = []
        families = sorted({family(p["source"]) for p in prompts})
        for f_index, fam in enumerate(families):
            quota = args.limit // len(families) + (f_index < args.limit % len(families))
            by_source: dict[str, list] = {}
            for p in prompts:
                if family(p["source"]) == fam:
                    by_source.setdefault(p["source"], []).append(p)
            for rows in by_source.values():
                rng.shuffle(rows)
            taken, i = [], 0
            while len(taken) < quota and any(i < len(r) for r in by_source.values()):  # round robin
                for rows in by_source.values():
                    if i < len(rows) and len(taken) < quota:
                        taken.append(rows[i])
                i += 1
            picked += taken
        prompts = sorted(picked, key=lambda p: p["id"])
    write_jsonl(args.out, prompts)
    print(f"wrote {len(prompts)} prompts to {args.out}: {count_by_source(prompts)}")


def _data(argv: list[str]) -> None:
    from .training.data import GenerationRecipe, generate_responses
    from .testbed.targets import load_target
    from .training.prompts import read_prompts_jsonl

    parser = argparse.ArgumentParser(prog="dspark-hf data", description="the target answers the prompts")
    parser.add_argument("--target", required=True, help="registry name or folder of the target")
    parser.add_argument("--prompts", required=True, help="JSONL with 'messages' (or 'prompt') per line")
    parser.add_argument("--out", required=True, help="output folder (resumable)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--on-error", choices=["skip", "raise"], default="skip",
                        help="broken prompt lines: skip them (and report the count) or stop")
    for name, default in (("max_new_tokens", 256), ("batch_size", 16), ("seed", 0), ("max_prompt_tokens", 512)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--report", help="also write a Markdown summary of the data folder to this file")
    args = parser.parse_args(argv)
    prompts, skipped = read_prompts_jsonl(args.prompts, on_error=args.on_error)
    if skipped:
        print(f"skipped {skipped} broken line(s) of {args.prompts}")
    prompts = prompts[: args.limit] if args.limit else prompts
    target, tokenizer = load_target(args.target)
    recipe = GenerationRecipe(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                              temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
                              seed=args.seed, max_prompt_tokens=args.max_prompt_tokens)
    print(generate_responses(target, tokenizer, prompts, args.out, recipe))
    if args.report:
        from .training.data import summarize_data
        from .provenance import atomic_write_text

        summary = summarize_data(args.out)
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.report), f"# Training data\n\n{summary}\n")
        print(summary)


def _train(argv: list[str]) -> None:
    from .training.trainer import train_from_config
    from .training.config import load_training_config

    config = load_training_config(argv)
    print(train_from_config(config))


def _calibrate(argv: list[str]) -> None:
    from .training.calibration import calibrate, collect_rounds
    from .training.data import chat_prompt_ids
    from .models.modeling_dspark import DSparkDrafter
    from .testbed.targets import load_target
    from .training.prompts import read_prompts_jsonl

    parser = argparse.ArgumentParser(prog="dspark-hf calibrate", description="STS calibration of a drafter")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True, help="held-out prompts (JSONL)")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fit-fraction", type=float, default=0.5,
                        help="share of the prompts (a seeded random split) that fits STS; the rest measures it "
                             "(1 = fit and report on all)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the fit / measure split")
    parser.add_argument("--out", help="write the calibrated drafter here (default: in place)")
    parser.add_argument("--report-dir", help="calibration report folder (default: <drafter>/calibration)")
    args = parser.parse_args(argv)
    if not 0 < args.fit_fraction <= 1:
        parser.error(f"--fit-fraction must be in (0, 1], got {args.fit_fraction}")
    target, tokenizer = load_target(args.target)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target).eval()
    drafter.set_sts_temperatures([])
    prompts, _ = read_prompts_jsonl(args.prompts)
    ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts[: args.limit]]
    # Fit / measure split by a seeded shuffle: prompt files are often sorted by source, and a split by position
    # would measure on other sources than it fitted on.
    import random

    order = list(range(len(ids)))
    random.Random(args.split_seed).shuffle(order)
    n_fit = max(1, round(len(ids) * args.fit_fraction))
    fit_ids = [ids[i] for i in sorted(order[:n_fit])]
    eval_ids = [ids[i] for i in sorted(order[n_fit:])]
    data = collect_rounds(target, drafter, fit_ids, args.max_new_tokens, args.batch_size,
                          pad_id=tokenizer.pad_token_id or 0)
    heldout = None
    if eval_ids:
        heldout = collect_rounds(target, drafter, eval_ids, args.max_new_tokens, args.batch_size,
                                 pad_id=tokenizer.pad_token_id or 0)
    out = Path(args.out or args.drafter)
    report = calibrate(drafter, data, args.report_dir or out / "calibration", heldout=heldout)
    tmp = out.parent / f".{out.name}.calibrating"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    for item in tmp.iterdir():  # replace the drafter files, keep anything else in the folder
        item.replace(out / item.name)
    tmp.rmdir()
    before, after = report["pooled_before"], report["pooled_after"]
    print(f"STS temperatures {['%.3f' % t for t in report['temperatures']]}; on {report['evaluated_on']}: "
          f"ECE {before['ece']:.4f} -> "
          f"{after['ece']:.4f}, AUROC {before['auroc']:.3f} -> {after['auroc']:.3f}, Brier {before['brier']:.4f} -> "
          f"{after['brier']:.4f}; written to {out}")


def _eval(argv: list[str]) -> None:
    from .evaluation.evaluate import evaluate_drafter, write_results
    from .models.modeling_dspark import DSparkDrafter
    from .testbed.targets import load_target

    parser = argparse.ArgumentParser(prog="dspark-hf eval", description="evaluate a drafter on prompt sets")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--datasets", default="humaneval,mt_bench,math500,gsm_symbolic")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--speed-prompts", type=int, default=4, help="prompts timed at batch size 1 (0 = skip)")
    parser.add_argument("--no-quality", action="store_true", help="skip the task-accuracy guard")
    parser.add_argument("--out", default="outputs/eval")
    args = parser.parse_args(argv)
    target, tokenizer = load_target(args.target)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target).eval()
    results = evaluate_drafter(target, drafter, tokenizer, args.datasets.split(","), args.limit, args.max_new_tokens,
                               args.batch_size, args.speed_prompts, not args.no_quality)
    label = f"drafter={args.drafter}, target={args.target}, max_new_tokens={args.max_new_tokens}"
    out = write_results(results, args.out, label, target.device, {"args": vars(args)})
    print((out / "eval.md").read_text())


def _compare(argv: list[str]) -> None:
    import torch

    from .evaluation.compare import compare, write_comparison

    parser = argparse.ArgumentParser(prog="dspark-hf compare",
                                     description="drafting methods side by side: tau, acceptance, batch-1 speedup")
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", required=True, metavar="LABEL=FOLDER",
                        help="a drafter of --target (repeatable), e.g. dspark=outputs/x/final dflash=outputs/y/final")
    parser.add_argument("--hf-dflash", metavar="LABEL",
                        help="also run this DFlash-variant drafter through transformers' built-in DFlash path")
    parser.add_argument("--stock", metavar="TARGET:ASSISTANT",
                        help="also run transformers' stock assisted generation with this target / draft-model pair")
    parser.add_argument("--datasets", default="humaneval,mt_bench,math500,aime,gsm_symbolic")
    parser.add_argument("--limit", type=int, default=16, help="prompts per data set for tau and acceptance")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--speed-prompts", type=int, default=3, help="prompts timed at batch size 1")
    parser.add_argument("--stock-prompts", type=int, help="prompts for the stock pair (default: --speed-prompts)")
    parser.add_argument("--draft-head-dtype", choices=["bfloat16", "float32"],
                        help="LM-head copy our drafters draft with (default: the target's own head)")
    parser.add_argument("--out", default="outputs/compare")
    args = parser.parse_args(argv)
    drafters = labeled_folders(parser, "--drafter", args.drafter)
    stock = None
    if args.stock:
        stock_target, sep, assistant = args.stock.partition(":")
        if not sep or not stock_target or not assistant:
            parser.error(f"--stock takes TARGET:ASSISTANT, got {args.stock!r}")
        stock = (stock_target, assistant)
    comp = compare(args.target, drafters, args.datasets.split(","), args.limit, args.max_new_tokens, args.batch_size,
                   args.speed_prompts, args.hf_dflash, stock, args.stock_prompts,
                   getattr(torch, args.draft_head_dtype) if args.draft_head_dtype else None)
    out = write_comparison(comp, args.out, {k: v for k, v in vars(args).items() if v is not None})
    print((out / "compare.md").read_text())


def _release(argv: list[str]) -> None:
    from .testbed.release import RELEASE_DIR, RELEASES, export_release, folder_bytes

    parser = argparse.ArgumentParser(prog="dspark-hf release",
                                     description="write a trained drafter as the package's release drafter (bf16)")
    parser.add_argument("--drafter", required=True, help="trained (and calibrated) drafter folder")
    parser.add_argument("--target", required=True, choices=sorted(RELEASES))
    args = parser.parse_args(argv)
    out = export_release(args.drafter, RELEASE_DIR / RELEASES[args.target])
    print(f"wrote {out} ({folder_bytes(out) / 1e6:.1f} MB)")


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "demo": (_demo, "speculative vs target-only generation, side by side"),
    "prompts": (_prompts, "build training prompts from non-evaluation sources"),
    "data": (_data, "the target answers prompts: drafter training data"),
    "train": (_train, "train a drafter (--config FILE.yaml [key=value ...])"),
    "training-report": (_training_report, "training runs side by side, from their logs"),
    "calibrate": (_calibrate, "STS calibration of a drafter's confidence head"),
    "eval": (_eval, "evaluate a drafter: tau, acceptance, speedup, quality"),
    "compare": (_compare, "drafting methods side by side on the prompt sets"),
    "bench": (_bench, "throughput vs concurrency for every verification policy"),
    "bench-head": (_bench_head, "time the sequential head against the parallel forward"),
    "release": (_release, "write a trained drafter as the package's release drafter"),
    "fetch-target": (_fetch_target, "download and convert a registered target model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dspark-hf COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<13} {help_text}")
        print("\n`dspark-hf COMMAND --help` for a command's options.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark-hf: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import dspark_hf  # noqa: F401  (registers the generate() hook and Auto classes)

    COMMANDS[name][0](rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
