"""Held-out tau of several drafters side by side: the measurement training's `eval_every` makes, for any drafter.

    python scripts/heldout_tau.py --target smollm2-135m-instruct \
        --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark \
        --drafter long400=/work/runs/smollm2-135m-dspark-long/checkpoint-000400 \
        --num-prompts 8 --out results/heldout_tau/smollm2.json

Greedy speculative decoding of the first `--num-prompts` prompts of `--prompts` (never trained on: the held-out
instruction prompts), every draft verified (policy "fixed"), no EOS stop, `--max-new-tokens` per prompt; tau =
tokens emitted per target forward (bonus included). With the defaults (8 prompts, 64 tokens) the numbers are those a
training run logs in its heldout.jsonl, so a release drafter and a run's checkpoints compare directly. Checkpoint
folders of a run load as drafters (they hold the drafter's config and weights next to the trainer state).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.provenance import atomic_write_json, provenance
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids
from dspark_hf.training.prompts import read_prompts_jsonl
from dspark_hf.training.trainer import heldout_tau


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="scripts/heldout_tau.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", required=True, metavar="LABEL=FOLDER")
    parser.add_argument("--prompts", default="data/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: unchanged)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    drafters = {}
    for item in args.drafter:
        label, sep, folder = item.partition("=")
        if not sep or not label or not Path(folder).is_dir():
            parser.error(f"--drafter needs LABEL=FOLDER with an existing folder, got {item!r}")
        drafters[label] = folder
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    prompts, _ = read_prompts_jsonl(args.prompts)
    if len(prompts) < args.num_prompts:
        parser.error(f"{args.prompts} holds {len(prompts)} prompts, fewer than --num-prompts {args.num_prompts}")
    ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts[: args.num_prompts]]
    results = {}
    print(f"| drafter | held-out tau | first draft accepted | rounds |\n|---|---|---|---|")
    for label, folder in drafters.items():
        drafter = DSparkDrafter.from_pretrained(folder, target=target).eval()
        r = heldout_tau(target, drafter, ids, args.max_new_tokens)
        results[label] = {"folder": folder, **r}
        print(f"| {label} | {r['heldout_tau']:.3f} | {r['heldout_accept@1']:.3f} | {r['heldout_rounds']} |", flush=True)
    out = {"target": args.target, "prompts": args.prompts, "num_prompts": args.num_prompts,
           "max_new_tokens": args.max_new_tokens, "results": results, "provenance": provenance(target.device)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
