"""Would a tree of lookup drafts beat the lookup's chain? An offline answer from recorded target greedy output (issue 13).

    python scripts/sim_lookup_trees.py --prompts 12 --max-new-tokens 128 --out results/lookup_tree_sim
    python scripts/sim_lookup_trees.py --out results/lookup_tree_sim --tables shipped=release new=/path/new.safetensors

Step 1 (`refs.json` in `--out`, reused when present): the target's own greedy continuation of the first `--prompts`
prompts of each evaluation set. Step 2: replays decoding rounds against it with no target forward at all. At each
round's position the shipped n-gram lookup (`NgramLookup`, the table `dspark-hf demo` uses) drafts

* its chain (`propose`: at every step the better-estimated of the corpus and the context candidate), up to `--depth`;
* a tree: that chain plus, at every step where the two sources disagree, the losing source's token continued by the
  chain rule (one level of alternatives), each node with its estimated prefix survival (the product of the
  calibrated estimates along its path).

For node budgets N, a round keeps the chain's first N drafts (a chain's survival only falls, so these are its N
most likely) or the tree's N nodes of highest survival (a set closed under parents), and accepts the longest kept
path that equals the target's continuation, plus the bonus token: the greedy rule, exactly. Tau is new tokens per
round. Wall clock is not simulated: a tree pays only if its tau gain at N nodes beats what the N nodes cost, read
against the target's cost curve (a forward of N + 1 new tokens after 300 cached ones against one of 1, measured in the
same run), which the script prints for the same budgets.

`--tables LABEL=FILE ...` instead replays the chain alone with each table (same recorded continuations, same
budgets) and writes `tables.md`: how a table's construction (orders, pruning, data) moves tau, with no timing noise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.testbed.release import LOOKUPS, RELEASE_DIR, resolve_lookup
from dspark_hf.testbed.targets import load_target

SETS = ("humaneval", "mt_bench", "math500", "aime", "gsm_symbolic")


def record(target_name: str, prompts: int, max_new_tokens: int) -> list[dict]:
    target, tokenizer = load_target(target_name)
    out = []
    for name in SETS:
        for p in load_prompt_set(name, limit=prompts):
            ids = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            with torch.no_grad():
                g = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            out.append({"set": name, "id": p.id, "prompt": ids[0].tolist(), "gen": g[0, ids.shape[1]:].tolist()})
            print(f"recorded {name} {p.id}: {len(out[-1]['gen'])} tokens", file=sys.stderr, flush=True)
    return out


class Drafts:
    """The chain and the one-level alternative tree of one lookup at one position."""

    def __init__(self, table) -> None:
        self.table = table

    def step(self, seq: list[int]):
        """((token, estimate) of the chain's pick, (token, estimate) of the other source's differing pick or None)."""
        t = self.table
        cands = (t._corpus_candidate(seq), t._context_candidate(seq))
        best = t._best(*cands)  # (the chain's rule, `NgramLookup.propose`'s)
        if best is None:
            return None, None
        other = next(((c[0], t.estimate(s, c[1], c[2], c[3])) for s, c in enumerate(cands)
                      if c is not None and c[0] != best[1]), None)
        return (best[1], best[0]), other

    def chain(self, seq: list[int], depth: int) -> tuple[list[int], list[float], list]:
        s, toks, surv, alts, p = list(seq), [], [], [], 1.0
        for _ in range(depth):
            pick, other = self.step(s)
            if pick is None:
                break
            p *= pick[1]
            toks.append(pick[0]); surv.append(p); alts.append(other)  # noqa: E702
            s.append(pick[0])
        return toks, surv, alts

    def tree(self, seq: list[int], depth: int) -> list[tuple[list[int], float]]:
        """Every node as (its path of tokens, its survival): the chain's, then each alternative's branch."""
        toks, surv, alts = self.chain(seq, depth)
        nodes = [(toks[: j + 1], surv[j]) for j in range(len(toks))]
        for j, other in enumerate(alts):
            if other is None:
                continue
            base = surv[j - 1] if j else 1.0
            head = toks[:j] + [other[0]]
            nodes.append((head, base * other[1]))
            rest, rsurv, _ = self.chain(seq + head, depth - j - 1)
            for k in range(len(rest)):
                nodes.append((head + rest[: k + 1], base * other[1] * rsurv[k]))
        return nodes


def accepted(paths: list[list[int]], truth: list[int]) -> int:
    best = 0
    for path in paths:
        k = 0
        for a, b in zip(path, truth):
            if a != b:
                break
            k += 1
        best = max(best, k)
    return best


def simulate(refs: list[dict], table, depth: int, budgets: list[int], trees: bool = True) -> dict:
    """Per set, per method (`chainN`, and `treeN` with `trees`): the mean over continuations of new tokens per round."""
    drafts = Drafts(table)
    methods = [f"chain{n}" for n in budgets] + ([f"tree{n}" for n in budgets] if trees else [])
    tau: dict[str, dict[str, list[float]]] = {}
    for ref in refs:
        prompt, gen = ref["prompt"], ref["gen"]
        for m in methods:
            n = int(m[5:] if m.startswith("chain") else m[4:])
            t, rounds = 0, 0
            while t < len(gen):
                seq = prompt + gen[:t]
                if m.startswith("chain"):
                    toks, _, _ = drafts.chain(seq, min(n, depth))
                    paths = [toks]
                else:
                    nodes = sorted(drafts.tree(seq, depth), key=lambda x: -x[1])[:n]
                    paths = [p for p, _ in nodes]
                a = accepted(paths, gen[t:])
                rounds += 1
                t += a + 1
            tau.setdefault(ref["set"], {}).setdefault(m, []).append(len(gen) / rounds)
    return {s: {m: float(np.mean(v)) for m, v in d.items()} for s, d in tau.items()}


def cost_curve(target_name: str, widths: list[int], context: int = 300, repeats: int = 9) -> dict[int, float]:
    """Median seconds of one target forward of w new tokens after `context` cached ones (prepacked, GQA path)."""
    from dspark_hf.models.gqa_attention import use_gqa_attention
    from dspark_hf.models.prepacked import prepack_linears

    target, _ = load_target(target_name)
    prepack_linears(target)
    use_gqa_attention(target)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, context), generator=gen)
    out = {}
    with torch.no_grad():
        cache = target(ids, use_cache=True).past_key_values
        for w in widths:
            times = []
            for _ in range(repeats):
                x = torch.randint(100, 1000, (1, w), generator=gen)
                start = time.perf_counter()
                target(x, cache=cache, use_cache=True)
                times.append(time.perf_counter() - start)
                cache.crop(-w)
            out[w] = float(np.median(times))
    return out


def compare_tables(refs: list[dict], tables: list[tuple[str, str]], args: argparse.Namespace) -> None:
    """`--tables`: the chain's tau per table and budget, one row per table."""
    rows = []
    for label, path in tables:
        table = resolve_lookup(path, args.target)
        tau = simulate(refs, table, max(args.budgets), args.budgets, trees=False)
        macro = {f"chain{n}": float(np.mean([tau[s][f"chain{n}"] for s in tau])) for n in args.budgets}
        file = RELEASE_DIR / LOOKUPS[args.target] / "lookup.safetensors" if path == "release" else Path(path)
        size = file.stat().st_size / 1e6
        rows.append({"label": label, "file": path, "ngrams": len(table), "max_order": table.max_order, "mb": size, "meta": table.meta, "tau": tau,
                     "macro": macro})
        print(f"{label}: {len(table):,} n-grams, macro {macro}", file=sys.stderr, flush=True)
    sets = list(rows[0]["tau"])
    n_last = max(args.budgets)
    lines = ["# Lookup tables replayed offline: the chain's tau (greedy, batch 1)", "",
             f"Command: `python scripts/sim_lookup_trees.py --out {args.out} --budgets "
             f"{' '.join(map(str, args.budgets))} --tables {' '.join(args.tables)}`. {len(refs)} recorded target "
             f"continuations (`refs.json`); per table (built with `dspark-hf lookup --data ... --max-order O --min-total M`; "
             f"its data below): n-grams, file size, the chain's macro tau at each budget and "
             f"per set at {n_last} drafts. Deterministic: no timing, so differences of 0.01 are real for these prompts.",
             "", "| table | max order | min total | n-grams | MB | " + " | ".join(f"macro@{n}" for n in args.budgets) + " | "
             + " | ".join(f"{s}@{n_last}" for s in sets) + " |",
             "|---|---|---|---|---|" + "---|" * (len(args.budgets) + len(sets))]
    for r in rows:
        lines.append(f"| {r['label']} | {r['max_order']} | {r['meta'].get('min_total', '?')} | {r['ngrams']:,} | "
                     f"{r['mb']:.1f} | "
                     + " | ".join(f"{r['macro'][f'chain{n}']:.3f}" for n in args.budgets) + " | "
                     + " | ".join(f"{r['tau'][s][f'chain{n_last}']:.2f}" for s in sets) + " |")
    lines += ["", "Tables:", ""] + [f"- `{r['label']}`: {r['file']} ({json.dumps(r['meta'])})" for r in rows]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    (out / "tables.md").write_text(text)
    (out / "tables.json").write_text(json.dumps({"settings": vars(args), "tables": rows}, indent=1))
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--lookup", default="release", help="lookup table file, or `release` (the shipped one)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 12, 16])
    p.add_argument("--tables", nargs="+", metavar="LABEL=FILE", default=None,
                   help="replay the chain with each table instead (FILE `release`: the shipped one); writes tables.md")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tables = None
    if args.tables:
        tables = [tuple(t.split("=", 1)) for t in args.tables]
        if any(len(t) != 2 or not all(t) for t in tables):
            p.error(f"--tables takes LABEL=FILE entries, got {args.tables}")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refs_file = out / "refs.json"
    if refs_file.exists():
        refs = json.loads(refs_file.read_text())
    else:
        refs = record(args.target, args.prompts, args.max_new_tokens)
        tmp = refs_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(refs))
        tmp.replace(refs_file)
    if tables is not None:
        return compare_tables(refs, tables, args)
    table = resolve_lookup(args.lookup, args.target)
    tau = simulate(refs, table, args.depth, args.budgets)
    curve = cost_curve(args.target, [1] + sorted({n + 1 for n in args.budgets}))
    methods = [f"chain{n}" for n in args.budgets] + [f"tree{n}" for n in args.budgets]
    lines = ["# Lookup chain vs lookup tree, replayed offline (greedy, batch 1)", "",
             f"Command: `python scripts/sim_lookup_trees.py --prompts {args.prompts} --max-new-tokens "
             f"{args.max_new_tokens} --depth {args.depth} --budgets {' '.join(map(str, args.budgets))} "
             f"--lookup {args.lookup} --out {args.out}`. {len(refs)} recorded continuations; table: "
             f"{len(table):,} n-grams. `chainN`: the lookup's first N drafts; `treeN`: the N nodes of highest "
             "estimated survival among the chain and its alternatives (the other source's token wherever the "
             "corpus and the context disagree, continued by the chain rule). Tau = new tokens per round.", "",
             "| set | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for s, d in tau.items():
        lines.append(f"| {s} | " + " | ".join(f"{d[m]:.2f}" for m in methods) + " |")
    macro = {m: float(np.mean([tau[s][m] for s in tau])) for m in methods}
    lines.append("| **macro** | " + " | ".join(f"**{macro[m]:.2f}**" for m in methods) + " |")
    lines += ["", "| nodes N | tree / chain tau | forward of N+1 tokens / of 1 (this machine) |", "|---|---|---|"]
    for n in args.budgets:
        lines.append(f"| {n} | {macro[f'tree{n}'] / macro[f'chain{n}']:.3f} | {curve[n + 1] / curve[1]:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "tau": tau, "macro": macro,
                                                  "forward_seconds": curve}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
