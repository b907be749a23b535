"""Held-out tau of several drafters side by side: the measurement training's `eval_every` makes, for any drafter.

    python scripts/heldout_tau.py --target smollm2-135m-instruct \
        --drafter release=src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark \
        --drafter long400=/work/runs/smollm2-135m-dspark-long/checkpoint-000400 \
        --num-prompts 8 --out results/heldout_tau/smollm2.json

Greedy speculative decoding of `--num-prompts` prompts of `--prompts` (never trained on: the held-out instruction
prompts), spread over the file's sources (`--order spread`, by a hash of the prompt ids, as training's `eval_every`
picks them; `--order file`: the first ones, how tables before 2026-12-06 were measured: mostly chatterbot dialogs),
every draft verified (policy "fixed"), no EOS stop, `--max-new-tokens` per prompt; tau =
tokens emitted per target forward (bonus included). With the defaults (8 prompts, 64 tokens) the numbers are those a
training run logs in its heldout.jsonl, so a release drafter and a run's checkpoints compare directly. Checkpoint
folders of a run load as drafters (they hold the drafter's config and weights next to the trainer state).

    python scripts/heldout_tau.py --merge run1/heldout24.json run2/heldout24.json --out results/x/heldout24.json

merges results measured separately with the same prompts and settings into one table (`.json` and `.md`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids
from dspark_hf.training.prompts import read_prompts_jsonl
from dspark_hf.training.trainer import eval_prompts, heldout_tau


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="scripts/heldout_tau.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter", action="append", metavar="LABEL=FOLDER")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge results written by --out into one table")
    parser.add_argument("--prompts", default="data/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--order", choices=("spread", "file"), default="spread",
                        help="which prompts: spread over the sources (default) or the first --num-prompts of the file")
    parser.add_argument("--by-source", action="store_true",
                        help="also a row per source family (the part of each prompt's 'source' before '/'); the "
                             "drafter's row pools them")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: unchanged)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(parser, args.merge, args.out)
    if not args.target or not args.drafter:
        parser.error("--target and at least one --drafter are needed (or --merge)")
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
    chosen = eval_prompts(prompts, args.num_prompts, args.order)
    groups: dict[str, list[list[int]]] = {}
    for p in chosen:
        family = str(p.get("source") or "unknown").split("/")[0] if args.by_source else ""
        groups.setdefault(family, []).append(chat_prompt_ids(tokenizer, p["messages"]))
    results = {}
    print(HEADER, flush=True)
    for label, folder in drafters.items():
        drafter = DSparkDrafter.from_pretrained(folder, target=target).eval()
        parts = {family: heldout_tau(target, drafter, ids, args.max_new_tokens) for family, ids in groups.items()}
        r = pool(list(parts.values()))
        results[label] = {"folder": folder, **r}
        if args.by_source:
            results[label]["by_source"] = parts
            for family, part in parts.items():
                print(row(f"{label} / {family} ({part['heldout_prompts']})", part), flush=True)
        print(row(label, r), flush=True)
    out = {"target": args.target, "prompts": args.prompts, "num_prompts": args.num_prompts, "order": args.order,
           "max_new_tokens": args.max_new_tokens, "results": results, "provenance": provenance(target.device)}
    if args.out:
        write(out, args.out)
    return out


HEADER = "| drafter | held-out tau | first draft accepted | rounds |\n|---|---|---|---|"
SETTINGS = ("target", "prompts", "num_prompts", "order", "max_new_tokens")


def pool(parts: list[dict]) -> dict:
    """One result from results on disjoint prompt sets: tau over all their rounds, first-draft acceptance over all
    their verifying rounds (exactly what one call on every prompt counts)."""
    if len(parts) == 1:
        return dict(parts[0])
    rounds = sum(p["heldout_rounds"] for p in parts)
    verified = sum(p["heldout_verified"] for p in parts)
    return {"heldout_tau": sum(p["heldout_tau"] * p["heldout_rounds"] for p in parts) / max(1, rounds),
            "heldout_accept@1": sum(p["heldout_accept@1"] * p["heldout_verified"] for p in parts) / max(1, verified),
            "heldout_prompts": sum(p["heldout_prompts"] for p in parts), "heldout_rounds": rounds,
            "heldout_verified": verified}


def row(label: str, r: dict) -> str:
    return f"| {label} | {r['heldout_tau']:.3f} | {r['heldout_accept@1']:.3f} | {r['heldout_rounds']} |"


def write(out: dict, path: str) -> None:
    """`path` (JSON) and the same name with `.md` (the table, with its settings and machine)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, out)
    settings = ", ".join(f"{k}={out[k]}" for k in SETTINGS)
    lines = [f"Held-out tau (greedy, every draft verified, no EOS stop): {settings}. Device: "
             f"{out['provenance']['device']}; torch {out['provenance']['torch']}.", "", HEADER]
    for label, r in out["results"].items():
        lines += [row(f"{label} / {family} ({part['heldout_prompts']})", part)
                  for family, part in r.get("by_source", {}).items()]
        lines.append(row(label, r))
    atomic_write_text(path.with_suffix(".md"), "\n".join(lines) + "\n")


def merge(parser: argparse.ArgumentParser, paths: list[str], out_path: str | None) -> dict:
    """One table from results measured separately; they must share the prompts and settings."""
    import json

    parts = [json.loads(Path(p).read_text()) for p in paths]
    for part in parts:  # results written before --order existed took the file's first prompts
        part.setdefault("order", "file")
    for p, part in zip(paths, parts):
        differs = [k for k in SETTINGS if part.get(k) != parts[0].get(k)]
        if differs:
            parser.error(f"{p} was measured with other settings than {paths[0]}: {differs}")
    merged = {**{k: parts[0][k] for k in SETTINGS}, "results": {}, "provenance": parts[0]["provenance"]}
    for p, part in zip(paths, parts):
        for label, r in part["results"].items():
            if label in merged["results"]:
                parser.error(f"label {label!r} appears twice ({p})")
            merged["results"][label] = r
    print(HEADER)
    for label, r in merged["results"].items():
        print(row(label, r))
    if out_path:
        write(merged, out_path)
    return merged


if __name__ == "__main__":
    main()
