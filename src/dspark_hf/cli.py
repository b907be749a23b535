"""The `dspark-hf` command: thin subcommands over library functions.

    dspark-hf demo            speculative vs target-only generation, side by side (dspark_hf.testbed.demo)
    dspark-hf prompts         training prompts from non-evaluation sources (training.prompts.write_training_prompts)
    dspark-hf data            the target answers the prompts: training data (training.data.build_training_data)
    dspark-hf train           train a drafter (training.trainer.train_from_config; `accelerate launch` for many GPUs)
    dspark-hf training-report training runs side by side, from their logs (dspark_hf.evaluation.training_report)
    dspark-hf calibrate       STS calibration, written into the drafter (training.calibration.calibrate_drafter)
    dspark-hf eval            tau, acceptance, threshold sweep, speedup, quality (evaluation.evaluate.run_evaluation)
    dspark-hf compare         drafting methods side by side (evaluation.compare.run_comparison)
    dspark-hf bench           throughput vs concurrency per verification policy (dspark_hf.evaluation.throughput)
    dspark-hf bench-head      cost of the sequential head vs the parallel forward (dspark_hf.evaluation.head_cost)
    dspark-hf release         a trained drafter as the package's release drafter (testbed.release.export_target_release)
    dspark-hf fetch-target    download and convert a registered target model (testbed.targets.fetch_target)
    dspark-hf lookup          n-gram lookup drafts from the target's own answers (models.lookup.NgramLookup)
    dspark-hf convert         a published drafter (DeepSpec, z-lab, ...) as a native drafter (convert.convert_checkpoint)
    dspark-hf export          a drafter in a serving engine's layout: vLLM / speculators, SGLang (convert.export)
    dspark-hf --version       prints `dspark-hf <version>`

Wherever a subcommand takes a target or drafter folder (`--target`, `--drafter`), a Hub id (`org/name`) works too:
targets resolve through `testbed.targets.load_target` (registry name, folder, else the local Hugging Face cache; never
the network), drafters through `DSparkDrafter.from_pretrained` (the HF cache when `HF_HUB_OFFLINE=1`).

Each subcommand parses its arguments in one place and calls one library function. `demo`, `bench`, `bench-head`
and `training-report` keep their parser in their own module (`main(argv)`, also runnable as `python -m ...`); this
module forwards their arguments unchanged. The others are parsed here.

Output: the results a command produces (tables, the folder it wrote, a summary line) go to stdout. Progress and
diagnostics come from the library's loggers (`transformers.utils.logging.get_logger(__name__)`, i.e. plain
`logging` loggers under `dspark_hf`). transformers' default verbosity (WARNING) would hide their progress lines, so
`main` calls `dspark_hf.logging_utils.configure_logging()`: the `dspark_hf` loggers (only those; transformers keeps
its own verbosity, `TRANSFORMERS_VERBOSITY`) go to stderr as `[dspark_hf.module] message` at level INFO, so a user
sees e.g. `[dspark_hf.testbed.targets] ... ready in ...` and the per-batch progress of `eval`, `compare` and
`bench`. `DSPARK_HF_VERBOSITY` (`debug`, `info`, `warning`, `error`) changes that level. Long loops (data
generation, calibration rounds, downloads) show tqdm bars on stderr. Used as a library, nothing is configured: the
loggers follow the application's logging setup (Python's default shows warnings only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable

from .evaluation.labels import labeled_folders
from .logging_utils import VERBOSITY_ENV, configure_logging

__all__ = ["COMMANDS", "main"]


# ------------------------------------------------------------------------------ subcommands with their own parser

def _demo(argv: list[str]) -> None:
    from .testbed.demo import main

    main(argv)


def _bench(argv: list[str]) -> None:
    from .evaluation.throughput import main

    main(argv)


def _bench_head(argv: list[str]) -> None:
    from .evaluation.head_cost import main

    main(argv)


def _training_report(argv: list[str]) -> None:
    from .evaluation.training_report import main

    main(argv)


# ---------------------------------------------------------------------------------- subcommands parsed here

def _fetch_target(argv: list[str]) -> None:
    from .testbed.targets import fetch_target, list_targets

    parser = argparse.ArgumentParser(prog="dspark-hf fetch-target",
                                     description="download and convert a registered target model (once)")
    parser.add_argument("name", choices=list_targets())
    parser.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    args = parser.parse_args(argv)
    print(fetch_target(args.name, force=args.force))


def _lookup(argv: list[str]) -> None:
    from .models.lookup import NgramLookup

    parser = argparse.ArgumentParser(prog="dspark-hf lookup",
                                     description="n-gram lookup drafts from the target's own answers (a data folder)")
    parser.add_argument("--data", required=True, help="`dspark-hf data` folder(s), comma-separated, newest first")
    parser.add_argument("--out", required=True, help="safetensors file to write (atomically)")
    parser.add_argument("--max-order", type=int, default=8, help="longest n-gram context (default 8)")
    parser.add_argument("--heldout-share", type=float, default=0.05,
                        help="share of the examples that calibrate the acceptance estimates (default 0.05)")
    parser.add_argument("--min-total", type=int, default=1,
                        help="drop n-gram contexts seen fewer times (2: a file about 3x smaller)")
    args = parser.parse_args(argv)
    lookup = NgramLookup.from_data(args.data, max_order=args.max_order, heldout_share=args.heldout_share,
                                   min_total=args.min_total)
    lookup.save(args.out)
    report = lookup.calibration_report()
    print(f"{args.out}: {len(lookup):,} n-grams (orders 1-{lookup.max_order}) from {lookup.meta['sequences']:,} "
          f"examples, {lookup.meta['answer_tokens']:,} answer tokens")
    for source, r in report.items():
        print(f"  held-out first-draft acceptance, {source}: {r['rate']:.3f} measured vs {r['predicted']:.3f} "
              f"predicted over {r['trials']:,} positions")


def _prompts(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dspark-hf prompts", description="build training prompts (no eval sets)")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--limit", type=int, help="keep this many prompts: a third each from math, code and chat "
                                                  "sources, evenly across the sources of each family")
    parser.add_argument("--skip-missing", action="store_true", help="skip sources that are not installed")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="ask every source for this many times its default count (before --limit)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="JSONL of prompts to leave out (e.g. the training set, when building held-out prompts)")
    parser.add_argument(
        "--python-functions", type=int, default=0,
        help="also this many 'complete this function' stubs from the standard library (opt-in; before --scale)")
    parser.add_argument("--boxed-math", type=int, default=0,
                        help="also this many 'reason step by step, box the answer' prompts from each reasoning-gym "
                             "math generator (opt-in; before --scale)")
    parser.add_argument("--only-opt-in", action="store_true",
                        help="only the opt-in sources asked for (--python-functions, --boxed-math), not the defaults")
    args = parser.parse_args(argv)
    from .training.prompts import TrainingPromptRecipe, boxed_math_sources, count_by_source, write_training_prompts

    if args.only_opt_in and not (args.python_functions or args.boxed_math):
        parser.error("--only-opt-in needs --python-functions or --boxed-math")
    for name in ("python_functions", "boxed_math"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    recipe = TrainingPromptRecipe(seed=args.seed, skip_missing=args.skip_missing)
    gym = () if args.only_opt_in else recipe.reasoning_gym
    no_defaults = dict(codeio=0, chatterbot=0, python_docs=0, fortunes=0) if args.only_opt_in else {}
    recipe = dataclasses.replace(recipe, reasoning_gym=gym + boxed_math_sources(args.boxed_math),
                                 python_functions=args.python_functions, **no_defaults)
    prompts = write_training_prompts(args.out, recipe.scaled(args.scale), limit=args.limit or None,
                                     exclude=args.exclude)
    print(f"wrote {len(prompts)} prompts to {args.out}: {count_by_source(prompts)}")


def _data(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dspark-hf data", description="the target answers the prompts")
    parser.add_argument("--target", required=True, help="registry name, folder or cached Hub id of the target")
    parser.add_argument("--prompts", required=True, help="JSONL with 'messages' (or 'prompt') per line")
    parser.add_argument("--out", required=True, help="output folder (resumable)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--order", choices=["file", "spread"], default="file",
                        help="answer the prompts in file order, or spread: in the order of a crc32 of their ids, so "
                             "that whatever is answered when a run stops (and --limit) samples every source")
    parser.add_argument("--on-error", choices=["skip", "raise"], default="skip",
                        help="broken prompt lines: skip them (and report the count) or stop")
    for name, default in (("max_new_tokens", 256), ("batch_size", 16), ("seed", 0), ("max_prompt_tokens", 512)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit of resumption)")
    parser.add_argument("--compress", action="store_true", help="gzip the shards (data-*.jsonl.gz)")
    parser.add_argument("--report", help="also write a Markdown summary of the data folder to this file")
    parser.add_argument("--max-seconds", type=float,
                        help="stop starting new batches after this many seconds of wall time; what was answered is "
                             "kept and the same command resumes with the rest")
    parser.add_argument("--no-prepack", dest="prepack", action="store_false",
                        help="keep PyTorch's own CPU linears (by default a CPU target in float32/bfloat16 runs with "
                             "its linear weights packed once for oneDNN: 1.89x the answer tokens/s of SmolLM2 at "
                             "batch 64 in results/data_generation_prepacked, identical answers)")
    args = parser.parse_args(argv)
    from .training.data import GenerationRecipe, build_training_data

    recipe = GenerationRecipe(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                              temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
                              seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, shard_size=args.shard_size,
                              compress=args.compress)
    built = build_training_data(args.target, args.prompts, args.out, recipe, limit=args.limit,
                                on_error=args.on_error, report=args.report, prepack=args.prepack,
                                max_seconds=args.max_seconds, order=args.order)
    print(built.out_dir)
    if built.summary is not None:
        print(built.summary)


def _train(argv: list[str]) -> None:
    from .training.config import load_training_config

    config = load_training_config(argv, prog="dspark-hf train")
    from .training.trainer import train_from_config

    print(train_from_config(config))


def _calibrate(argv: list[str]) -> None:
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
    from .training.calibration import calibrate_drafter, calibration_summary

    report = calibrate_drafter(args.drafter, args.target, None, args.prompts, limit=args.limit,
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                               fit_fraction=args.fit_fraction, split_seed=args.split_seed, out=args.out,
                               report_dir=args.report_dir)
    print(calibration_summary(report, Path(args.out or args.drafter)))


def _eval(argv: list[str]) -> None:
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
    from .evaluation.evaluate import run_evaluation

    out = run_evaluation(args.drafter, args.target, args.datasets.split(","), args.limit, args.max_new_tokens,
                         args.batch_size, args.speed_prompts, not args.no_quality, args.out, settings=vars(args))
    print((out / "eval.md").read_text())


def _compare(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dspark-hf compare",
                                     description="drafting methods side by side: tau, acceptance, batch-1 speedup")
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", default=[], metavar="LABEL=FOLDER",
                        help="a drafter of --target (repeatable), e.g. dspark=outputs/x/final dflash=outputs/y/final; "
                             "none: the baselines alone")
    parser.add_argument("--prompt-lookup", type=int, default=10, metavar="N",
                        help="tokens per round of transformers' prompt-lookup decoding (prompt_lookup_num_tokens; "
                             "0 = skip it)")
    parser.add_argument("--max-matching-ngram-size", type=int, help="prompt lookup's n-gram size (default: "
                                                                     "transformers', 2)")
    parser.add_argument("--assistant", metavar="MODEL",
                        help="also time transformers' assisted generation with this draft model of --target")
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
    parser.add_argument("--draft-head-dtype", choices=["int8", "float16", "bfloat16", "float32"],
                        help="LM-head weight dtype our drafters draft with (DSparkDrafter.set_draft_head_dtype; "
                             "int8 / float16: fbgemm kernels on a CPU; default: the target's own head)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", help="e.g. cuda (default: the CPU)")
    parser.add_argument("--lookup", metavar="FILE|release",
                        help="also time n-gram lookup drafts (`dspark-hf lookup`; `release`: the target's shipped "
                             "table): alone and before each drafter's drafts")
    parser.add_argument("--lookup-branches", type=int, metavar="W",
                        help="with --lookup, also time each drafter with the lookup's continuation verified as a "
                             "branch of its chain (`<label>+branches`: the batched loop at batch 1, tree_budget=0, "
                             "at most W nodes per round)")
    parser.add_argument("--prepack", action="store_true",
                        help="run every method (target-only included) on the target with prepacked CPU linears")
    parser.add_argument("--gqa-attention", action="store_true",
                        help="run every method (target-only included) with grouped-query attention without repeat_kv "
                             "copies (dspark_hf.use_gqa_attention)")
    parser.add_argument("--out", default="outputs/compare")
    args = parser.parse_args(argv)
    drafters = labeled_folders(parser, "--drafter", args.drafter)
    if args.lookup_branches is not None and (not args.lookup or args.lookup_branches < 1):
        parser.error("--lookup-branches takes a node count >= 1 and needs --lookup")
    from .evaluation.compare import parse_stock_pair, run_comparison

    stock = None
    if args.stock:
        try:
            stock = parse_stock_pair(args.stock, "--stock")
        except ValueError as error:
            parser.error(str(error))
    out = run_comparison(args.target, drafters, args.datasets.split(","), args.out,
                         {k: v for k, v in vars(args).items() if v is not None},
                         draft_head_dtype=args.draft_head_dtype, limit=args.limit,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         speed_prompts=args.speed_prompts, hf_dflash=args.hf_dflash, stock=stock,
                         stock_prompts=args.stock_prompts, prompt_lookup=args.prompt_lookup,
                         max_matching_ngram_size=args.max_matching_ngram_size, assistant=args.assistant,
                         dtype=args.dtype, device=args.device, lookup=args.lookup, prepack=args.prepack,
                         gqa_attention=args.gqa_attention, lookup_branches=args.lookup_branches)
    print((out / "compare.md").read_text())


def _release(argv: list[str]) -> None:
    from .testbed.release import RELEASES, export_target_release, folder_bytes

    parser = argparse.ArgumentParser(prog="dspark-hf release",
                                     description="write a trained drafter as the package's release drafter (bf16)")
    parser.add_argument("--drafter", required=True, help="trained (and calibrated) drafter folder or cached Hub id")
    parser.add_argument("--target", required=True, choices=sorted(RELEASES))
    # the generated model card (README.md, dspark_hf.hub.card): numbers from results files
    parser.add_argument("--metrics", help="compare.json of `dspark-hf compare` (tau / speedup table of the card)")
    parser.add_argument("--calibration", help="calibration.json of `dspark-hf calibrate` (the card's calibration)")
    parser.add_argument("--throughput", action="append", default=[], help="bench.json of `dspark-hf bench` "
                                                                          "(repeatable)")
    args = parser.parse_args(argv)
    card = {k: v for k, v in (("metrics", args.metrics), ("calibration", args.calibration),
                              ("throughput", args.throughput)) if v}
    out = export_target_release(args.drafter, args.target, model_card=card)
    print(f"wrote {out} ({folder_bytes(out) / 1e6:.1f} MB) with its model card {out / 'README.md'}")


def _export(argv: list[str]) -> None:
    from .convert.export import EXPORT_FORMATS

    parser = argparse.ArgumentParser(
        prog="dspark-hf export",
        description="write a drafter in a serving engine's layout: 'speculators' (vllm-project/speculators, vLLM), "
                    "'sglang' (SGLang's DSpark path; also vLLM's `method: dspark`), 'deepspec' (DeepSpec's own "
                    "format, with the target's embedding / LM head copies)")
    parser.add_argument("--to", required=True, choices=EXPORT_FORMATS)
    parser.add_argument("drafter", help="drafter folder")
    parser.add_argument("out", help="folder to write (atomically)")
    parser.add_argument("--target", help="target model (registered name, folder or Hub id): needed by 'speculators' "
                                         "and 'deepspec', which carry copies of its embedding and LM head")
    parser.add_argument("--mask-token-id", type=int,
                        help="for a drafter with a learned mask embedding: a token id the target never reads or "
                             "writes, whose embedding row carries the learned vector")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the written weights (default: the drafter's)")
    parser.add_argument("--verifier", help="verifier name written into speculators_config (default: --target)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    import torch

    from .convert.export import export_drafter, serve_command

    out = export_drafter(args.drafter, args.out, to=args.to, target=args.target, mask_token_id=args.mask_token_id,
                         dtype=getattr(torch, args.dtype) if args.dtype else None,
                         verifier_name_or_path=args.verifier or args.target, overwrite=args.overwrite)
    from .convert.export import SIDE_FILE

    block_size = __import__("json").loads((out / SIDE_FILE).read_text())["block_size"]
    print(out)
    print("serve with: " + serve_command(args.to, out, args.target or "TARGET", block_size))


def _convert(argv: list[str]) -> None:
    from .convert import FORMATS, convert_checkpoint

    parser = argparse.ArgumentParser(
        prog="dspark-hf convert",
        description="convert a published drafter checkpoint (DeepSpec, z-lab DFlash, transformers' DFlash, SpecForge, "
                    "speculators) into a native DSpark drafter folder, written atomically")
    parser.add_argument("src", help="checkpoint folder or Hub id")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--from", dest="source_format", choices=FORMATS,
                        help="source format (default: detected from config.json)")
    parser.add_argument("--target", help="target model (folder or Hub id): checks the fingerprint and the stored "
                                         "embedding / LM-head copies; needed by transformers-dflash (no vocabulary)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    print(convert_checkpoint(args.src, args.out, args.source_format, target=args.target, overwrite=args.overwrite))


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
    "lookup": (_lookup, "n-gram lookup drafts from the target's own answers (a data folder)"),
    "convert": (_convert, "a published drafter checkpoint (DeepSpec, z-lab, ...) as a native drafter"),
    "export": (_export, "write a drafter for vLLM / speculators or SGLang (--to ...)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"dspark-hf {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dspark-hf COMMAND [options]\n       dspark-hf --version\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<15} {help_text}")
        print("\n`dspark-hf COMMAND --help` for a command's options. Progress goes to stderr "
              f"(${VERBOSITY_ENV}=warning to quiet it), results to stdout.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark-hf: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # Importing this module has imported `dspark_hf` (the package), which registers the generate() hook and the
    # Auto classes every command relies on.
    configure_logging()
    COMMANDS[name][0](rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
