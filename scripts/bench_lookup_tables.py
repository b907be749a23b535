"""Lookup tables side by side (issue 14): does a table built from more of the target's own answers draft better?

    python scripts/bench_lookup_tables.py --table release=release --table all=/path/to/all.safetensors \
        --out results/lookup_tables_smollm2 [--sets humaneval mt_bench ...] [--prompts 4] [--max-new-tokens 64] \
        [--branches 4 8 12] [--branch-policies fixed scheduled] [--branch-lookup-max 0 16] [--assist] [--drafter-chain]

Batch 1, greedy, one run: per prompt, target-only first, then for every table (in the order given) the lookup alone
(`LookupAssistant`, round lengths from the batch-1 cost curve profiled in the run) and the release configuration
(`<table>+branches`: the release drafter's chain and the lookup's continuation verified as one tree, the batched loop
at batch 1, `tree_budget=0, tree_max_nodes=W`, one method per W given), plus transformers' prompt lookup as the training-free reference.
`--assist` adds, per table, `release+lookup[<table>]`: the same drafter and lookup as one *chain* per round (lookup
drafts when they pay, else the drafter's; `drafter.set_assist(lookup, sps=...)` through `target.generate(assistant_model=
drafter)`, what `dspark-hf demo --branches 0` runs), the chain the `+branches` tree is measured against (issue 13).
`--branch-lookup-max N` gives the `+branches` methods `lookup_max_tokens=N` (suffix `-LN`): the rounds the drafter gate
gives to the lookup alone propose up to N drafts, free of the node cap, their length chosen on the batch-1 cost curve.
`--assist-gated` adds the same chain (and, with `--drafter-chain`, the drafter alone) with `set_assist(realized_gate=
True)`, suffix `/gated`: the drafter runs only while its rounds emit tokens faster than plain steps, both timed.
`--drafter-chain` adds `release`: the release drafter alone through `target.generate(assistant_model=drafter)`.
`--drafter LABEL=FOLDER` (repeatable) runs every drafter method once per drafter named so, under its label instead of
`release` (FOLDER `release` = the shipped drafter; default: the release alone), e.g. a fine-tuned drafter next to it.
The target runs prepacked with the GQA attention path, as in `dspark-hf compare --prepack --gqa-attention`. Every
output is checked token for token against target-only; tau is new tokens per target forward (prefill included).
Writes `results.json`, `results.md` (tau and speedup per set, macro / geometric means) and `speedup.png`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from dspark_hf.decoding.batched import SPSCache
from dspark_hf.decoding.sps import profile_batch1_sps
from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.evaluation.side_by_side import assisted_runner, batched_runner, greedy_runner, prompt_lookup_runner, time_methods
from dspark_hf.models.candidate_generator import LookupAssistant
from dspark_hf.models.gqa_attention import use_gqa_attention
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import load_release, load_release_drafter, resolve_lookup
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids

SETS = ["humaneval", "mt_bench", "math500", "aime", "gsm_symbolic"]


def _parse_table(value: str) -> tuple[str, str]:
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--table takes LABEL=FILE (or LABEL=release), got {value!r}")
    return label, path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--table", type=_parse_table, action="append", required=True, metavar="LABEL=FILE",
                   help="a lookup table to time (repeatable; FILE `release` = the shipped table)")
    p.add_argument("--sets", nargs="+", default=SETS)
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (the first N of each)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--branches", type=int, nargs="+", default=[8],
                   help="tree_max_nodes of the `+branches` methods, one method per value (0: skip them)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens (0: skip)")
    p.add_argument("--branch-policies", nargs="+", default=["fixed"], choices=["fixed", "scheduled"],
                   help="policy of the `+branches` methods, one method per value (scheduled: each round's nodes "
                        "chosen from the confidences and the cost curve, `dspark_hf.SPSCache` profiled once)")
    p.add_argument("--branch-lookup-max", type=int, nargs="+", default=[0], metavar="N",
                   help="lookup_max_tokens of the `+branches` methods, one method per value: rounds that verify the "
                        "lookup alone propose up to N drafts and, under `fixed`, choose their length on the batch-1 "
                        "cost curve (the one the chain uses); 0: a block, capped by the node count (the default)")
    p.add_argument("--assist", action="store_true",
                   help="also `release+lookup[<table>]`: lookup, then drafter, as one chain per round (set_assist)")
    p.add_argument("--assist-gated", action="store_true",
                   help="also the `--assist` / `--drafter-chain` methods with `set_assist(realized_gate=True)` (suffix "
                        "`/gated`): the drafter runs only while its rounds emit faster than plain steps, timed")
    p.add_argument("--drafter-chain", action="store_true",
                   help="also `release`: the release drafter alone (target.generate(assistant_model=drafter))")
    p.add_argument("--drafter", type=_parse_table, action="append", metavar="LABEL=FOLDER",
                   help="a drafter for the drafter methods (repeatable; FOLDER `release` = the shipped drafter; "
                        "default: release=release)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.drafter = args.drafter or [("release", "release")]
    labels = [label for label, _ in args.table]
    if len(set(labels)) != len(labels):
        p.error(f"--table labels must differ, got {labels}")
    names = [label for label, _ in args.drafter]
    if len(set(names)) != len(names):
        p.error(f"--drafter labels must differ, got {names}")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    target, tokenizer = load_target(args.target)
    prepack_linears(target)
    use_gqa_attention(target)
    widths = [w for w in args.branches if w > 0]
    if any(n < 0 for n in args.branch_lookup_max):
        p.error(f"--branch-lookup-max takes draft counts >= 1 (0: a block), got {args.branch_lookup_max}")
    if any(w < 0 for w in args.branches):
        p.error(f"--branches takes node counts >= 1 (0: skip), got {args.branches}")
    drafters = {}
    if widths or args.assist or args.drafter_chain:
        for name, folder in args.drafter:
            drafters[name] = (load_release_drafter(args.target, target) if folder == "release"
                              else load_release(folder, target=target, dtype=target.dtype)).eval()
    tables = {label: resolve_lookup(path, args.target) for label, path in args.table}
    sps = profile_batch1_sps(target)
    sps_cache = SPSCache()  # the batched loop's cost curve, profiled on the first scheduled call (the warm-up)
    runners = {}
    if args.prompt_lookup:
        runners["prompt-lookup"] = prompt_lookup_runner(target, args.max_new_tokens, args.prompt_lookup)
    if args.drafter_chain:
        for d, drafter in drafters.items():
            runners[d] = greedy_runner(target, args.max_new_tokens, assistant_model=drafter)
            if args.assist_gated:
                runners[f"{d}/gated"] = assisted_runner(target, args.max_new_tokens, drafter, realized_gate=True)
    for label, table in tables.items():
        runners[f"lookup[{label}]"] = greedy_runner(target, args.max_new_tokens,
                                                    assistant_model=LookupAssistant(table, target, sps=sps))
        for d, drafter in drafters.items() if args.assist else ():
            runners[f"{d}+lookup[{label}]"] = assisted_runner(target, args.max_new_tokens, drafter, lookup=table,
                                                              sps=sps)
            if args.assist_gated:
                runners[f"{d}+lookup/gated[{label}]"] = assisted_runner(target, args.max_new_tokens, drafter,
                                                                        lookup=table, sps=sps, realized_gate=True)
        for d, drafter in drafters.items() if widths else ():
            for w in widths:
                for policy in args.branch_policies:
                    for lookup_max in args.branch_lookup_max:
                        name = f"{d}+branches" + (str(w) if len(widths) > 1 else "")
                        name += "-" + policy if len(args.branch_policies) > 1 else ""
                        name += f"-L{lookup_max}" if lookup_max else ""
                        extra = {"sps": sps_cache} if policy == "scheduled" else {}
                        if lookup_max:
                            extra.update(lookup_max_tokens=lookup_max, sps=extra.get("sps", sps))
                        runners[name + f"[{label}]"] = batched_runner(target, args.max_new_tokens, drafter,
                                                                      lookup=table, tree_budget=0, tree_max_nodes=w,
                                                                      policy=policy, **extra)
    methods = list(runners)
    rows: dict[str, dict[str, dict]] = {}
    for i, name in enumerate(args.sets):
        items = load_prompt_set(name, limit=args.prompts)
        prompts = [chat_prompt_ids(tokenizer, it.messages) for it in items]
        print(f"[{name}] {len(prompts)} prompts: target-only, {', '.join(methods)}", flush=True)
        _, records = time_methods(prompts, target.device, greedy_runner(target, args.max_new_tokens), runners,
                                  count_model=target, warmup=i == 0)
        rows[name] = {m: r.to_dict() for m, r in records.items()}
        print("  " + "  ".join(f"{m} tau {r.tau:.2f} {r.speedup:.2f}x{'' if r.identical else ' DIFFERS'}"
                               for m, r in records.items()), flush=True)

    def macro(m: str) -> float:
        return sum(rows[s][m]["tau"] for s in rows) / len(rows)

    def geo(m: str) -> float:
        return math.exp(sum(math.log(rows[s][m]["speedup"]) for s in rows) / len(rows))

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {m: {"macro_tau": macro(m), "geo_speedup": geo(m),
                   "identical": all(rows[s][m]["identical"] for s in rows)} for m in methods}
    atomic_write_json(args.out / "results.json", {
        "provenance": provenance(), "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "drafters": dict(args.drafter),
        "tables": {label: {"file": path, "ngrams": len(tables[label]), **tables[label].meta} for label, path in args.table},
        "results": rows, "summary": summary})
    prov = provenance()
    lines = ["# Lookup tables side by side (batch 1, greedy)", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`. Command: `python scripts/bench_lookup_tables.py "
             + " ".join(f"--table {label}={path}" for label, path in args.table)
             + f" --sets {' '.join(args.sets)} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
             f"--branches {' '.join(map(str, args.branches))} --branch-policies {' '.join(args.branch_policies)} "
             f"--branch-lookup-max {' '.join(map(str, args.branch_lookup_max))} "
             f"--prompt-lookup {args.prompt_lookup}"
             + (" --assist" if args.assist else "") + (" --assist-gated" if args.assist_gated else "")
             + (" --drafter-chain" if args.drafter_chain else "")
             + "".join(f" --drafter {name}={folder}" for name, folder in args.drafter
                       if (name, folder) != ("release", "release"))
             + f" --out {args.out}`.",
             "", "Tables:", ""]
    for label, path in args.table:
        meta = tables[label].meta
        lines.append(f"- `{label}` ({path}): {len(tables[label]):,} n-grams from {meta.get('sequences', 0):,} "
                     f"examples, {meta.get('answer_tokens', 0):,} answer tokens")
    for title, key, fmt in (("tau (new tokens per target forward)", "tau", "{:.2f}"),
                            ("wall-clock speedup over target-only", "speedup", "{:.2f}x")):
        lines += ["", f"### {title}", "", "| set | " + " | ".join(methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for s in rows:
            lines.append(f"| {s} | " + " | ".join(fmt.format(rows[s][m][key]) for m in methods) + " |")
        agg = macro if key == "tau" else geo
        lines.append(f"| **{'macro' if key == 'tau' else 'geo-mean'}** | "
                     + " | ".join("**" + fmt.format(agg(m)) + "**" for m in methods) + " |")
    same = all(v["identical"] for v in summary.values())
    lines += ["", "Every output identical to the target's own greedy output." if same else
              "Some outputs DIFFER from the target's greedy output (a losslessness bug): see results.json.", ""]
    atomic_write_text(args.out / "results.md", "\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            ax.bar([i + j * width for i in range(len(rows))], [rows[s][m]["speedup"] for s in rows], width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], list(rows))
        ax.set_ylabel("speedup over target-only")
        ax.set_title("Lookup tables, batch 1, greedy")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / "speedup.png", dpi=110)
    except ImportError:
        pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
