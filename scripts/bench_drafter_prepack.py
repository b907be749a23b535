"""Does prepacking the drafter's own linears pay (issue 14 part 4, cheaper rounds)? Batch 1, greedy, one run:

    OMP_NUM_THREADS=1 python scripts/bench_drafter_prepack.py --out results/drafter_prepack_smollm2 \
        [--sets humaneval mt_bench ...] [--prompts 4] [--max-new-tokens 64]

The target runs prepacked with the GQA attention path (as in `dspark-hf demo`). Two copies of the release drafter are
bound to it: one as loaded (`nn.Linear`: PyTorch's GEMM for its few-row products), one with `prepack_linears(drafter)`
(oneDNN's packed weights; the LM-head rows it borrows from the target are the target's, already prepacked). Per
prompt, target-only first, then each method back to back: the drafter alone (`target.generate(assistant_model=...)`)
and the lookup-then-drafter chain (`set_assist(lookup, sps=...)`, the demo's default), each with both copies. Every
output is checked token for token against target-only. Writes `results.json` and `results.md`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from dspark_hf.decoding.sps import profile_batch1_sps
from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.evaluation.side_by_side import assisted_runner, greedy_runner, time_methods
from dspark_hf.models.gqa_attention import use_gqa_attention
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import load_release_drafter, resolve_lookup
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids

SETS = ["humaneval", "mt_bench", "math500", "aime", "gsm_symbolic"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--sets", nargs="+", default=SETS)
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (the first N of each)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    target, tokenizer = load_target(args.target)
    prepack_linears(target)
    use_gqa_attention(target)
    plain = load_release_drafter(args.target, target).eval()
    packed = load_release_drafter(args.target, target).eval()
    swapped = prepack_linears(packed)
    table = resolve_lookup("release", args.target)
    sps = profile_batch1_sps(target)
    runners = {
        "drafter": greedy_runner(target, args.max_new_tokens, assistant_model=plain),
        "drafter/prepacked": greedy_runner(target, args.max_new_tokens, assistant_model=packed),
        "chain": assisted_runner(target, args.max_new_tokens, plain, lookup=table, sps=sps),
        "chain/prepacked": assisted_runner(target, args.max_new_tokens, packed, lookup=table, sps=sps),
    }
    rows: dict[str, dict[str, dict]] = {}
    for i, name in enumerate(args.sets):
        items = load_prompt_set(name, limit=args.prompts)
        prompts = [chat_prompt_ids(tokenizer, it.messages) for it in items]
        print(f"[{name}] {len(prompts)} prompts: target-only, {', '.join(runners)}", flush=True)
        _, records = time_methods(prompts, target.device, greedy_runner(target, args.max_new_tokens), runners,
                                  count_model=target, warmup=i == 0)
        rows[name] = {m: r.to_dict() for m, r in records.items()}
        print("  " + "  ".join(f"{m} tau {r.tau:.2f} {r.speedup:.2f}x{'' if r.identical else ' DIFFERS'}"
                               for m, r in records.items()), flush=True)

    def geo(m: str) -> float:
        return math.exp(sum(math.log(rows[s][m]["speedup"]) for s in rows) / len(rows))

    summary = {m: {"geo_speedup": geo(m), "macro_tau": sum(rows[s][m]["tau"] for s in rows) / len(rows),
                   "identical": all(rows[s][m]["identical"] for s in rows)} for m in runners}
    ratios = {base: geo(base + "/prepacked") / geo(base) for base in ("drafter", "chain")}
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", {
        "provenance": prov, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prepacked_linears": swapped, "results": rows, "summary": summary, "prepacked_over_plain": ratios})
    methods = list(runners)
    lines = ["# The drafter's linears prepacked or not (batch 1, greedy)", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`. Command: `python scripts/bench_drafter_prepack.py --sets {' '.join(args.sets)} "
             f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --out {args.out}`. "
             f"{swapped} of the drafter's linears prepacked.", "",
             "| set | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for s in rows:
        lines.append(f"| {s} | " + " | ".join(f"{rows[s][m]['speedup']:.2f}x (tau {rows[s][m]['tau']:.2f})"
                                              for m in methods) + " |")
    lines.append("| **geo-mean** | " + " | ".join(f"**{summary[m]['geo_speedup']:.2f}x**" for m in methods) + " |")
    lines += ["", "Prepacked over plain, geo-mean speed-up: " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
              + ".", "",
              "Every output identical to the target's own greedy output." if all(v["identical"] for v in summary.values())
              else "**Some outputs differ from target-only**: see results.json."]
    atomic_write_text(args.out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
