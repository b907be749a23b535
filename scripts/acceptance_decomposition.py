"""Where a drafter's tau gain over a baseline comes from: the first draft or the drafts after it.

Reads the per-position conditional acceptance p_k of every method in one or more `dspark-hf compare` runs
(`compare.json`) and rebuilds tau per data set as 1 + p1 (1 + p2 + p2 p3 + ...) (every draft verified, no length cap),
then prints, macro-averaged over the data sets, for each method against `--baseline`:

* the measured and the rebuilt tau ratio (the rebuild is checked against the measurement);
* the ratio with the baseline's first-draft acceptance and the method's later drafts (what the later drafts alone give);
* the factor by which the tokens accepted after the first draft would have to grow for the ratio to reach `--goal`.

    python scripts/acceptance_decomposition.py results/compare_smollm2_loss_weights_tau/compare.json \\
        results/compare_smollm2_loss_weights_tau2/compare.json --baseline dflash --goal 1.15 \\
        --out results/compare_smollm2_loss_weights_tau/decomposition.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def continuation(p: list[float]) -> float:
    """1 + p2 + p2 p3 + ...: the expected tokens from the second draft on, given the first was accepted."""
    total, survive = 1.0, 1.0
    for value in p[1:]:
        if value is None or math.isnan(value):
            break
        survive *= value
        total += survive
    return total


def rebuilt_tau(p: list[float]) -> float:
    return 1.0 + p[0] * continuation(p)


def decompose(runs: list[dict], baseline: str, goal: float) -> list[dict]:
    rows = []
    for run in runs:
        results = {(r["method"], r["dataset"]): r for r in run["results"]}
        datasets = run["datasets"]
        if not all((baseline, ds) in results for ds in datasets):
            raise SystemExit(f"error: baseline {baseline!r} is not in every data set of a compare run "
                             f"(methods: {run['methods']})")
        base = [results[(baseline, ds)] for ds in datasets]
        base_measured = sum(r["tau"] for r in base) / len(base)
        base_rebuilt = sum(rebuilt_tau(r["conditional_acceptance"]) for r in base) / len(base)
        for method in run["methods"]:
            if method == baseline:
                continue
            own = [results[(method, ds)]["conditional_acceptance"] for ds in datasets]
            n = len(own)
            measured = sum(results[(method, ds)]["tau"] for ds in datasets) / n
            rebuilt = sum(rebuilt_tau(p) for p in own) / n
            swapped = sum(1.0 + b["conditional_acceptance"][0] * continuation(p) for p, b in zip(own, base)) / n
            first = sum(1.0 + p[0] for p in own) / n
            later = sum(p[0] * (continuation(p) - 1.0) for p in own) / n
            needed = (goal * base_rebuilt - first) / later if later > 0 else float("inf")
            rows.append(dict(method=method, measured=measured / base_measured, rebuilt=rebuilt / base_rebuilt,
                             later_only=swapped / base_rebuilt, p1=first - 1.0,
                             baseline_p1=sum(b["conditional_acceptance"][0] for b in base) / n,
                             later_factor_for_goal=needed))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare_json", nargs="+", type=Path)
    ap.add_argument("--baseline", default="dflash")
    ap.add_argument("--goal", type=float, default=1.15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    runs = []
    for path in args.compare_json:
        if not path.is_file():
            print(f"error: {path} not found", file=sys.stderr)
            return 2
        runs.append(json.loads(path.read_text()))
    rows = decompose(runs, args.baseline, args.goal)
    lines = [f"Macro over the data sets, against `{args.baseline}` ({', '.join(str(p) for p in args.compare_json)}); "
             "tau rebuilt as 1 + p1 (1 + p2 + p2 p3 + ...).", "",
             f"| method | tau ratio measured | rebuilt | {args.baseline}'s first draft, the method's later drafts | "
             f"first draft accepted (method / {args.baseline}) | later tokens x needed for {args.goal:g}x |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['measured']:.3f}x | {r['rebuilt']:.3f}x | {r['later_only']:.3f}x | "
                     f"{r['p1']:.3f} / {r['baseline_p1']:.3f} | {r['later_factor_for_goal']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
