"""Batched decoding with the prefill timed apart: transformers' plain `generate()` vs `dspark_hf.generate` (scheduled,
lookup drafts), as `dspark-hf bench` runs them, on the real SmolLM2-135M-Instruct target (issue 14, 16 requests).

    OMP_NUM_THREADS=1 python scripts/bench_decode_only.py --concurrency 16 --repeats 3 \
        --sps results/bench_smollm2_realized_gsm/sps-rows16.json [--out results/decode_only]

At 16 requests the prefill of the prompts is about half of a call and moves between runs of the same work by more
than the whole difference in decoding, so end-to-end ratios cannot say where a few percent go. A forward hook on the
target times its first forward of each call (the prefill, the same work for both); decode = call - prefill. Both
methods run `--repeats` times, interleaved (order alternating), medians reported; outputs checked identical.
Decode time is further split into the target's decode forwards (timed by the same hooks) and the rest (drafting,
lookup proposals, verification, bookkeeping, cache copies). `--methods` adds the loop without drafts and variants of
the scheduled call (see `--help`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.decoding.sps import SPSTable
from dspark_hf.evaluation.throughput import _prompts
from dspark_hf.models.modeling_dspark import DSparkDrafter
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import resolve_lookup
from dspark_hf.testbed.targets import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-set", default="gsm_symbolic")
    p.add_argument("--drafter", default="results/training_smollm2_bf16/drafter")
    p.add_argument("--sps", required=True, help="SPS table in the rounds' layout (sps-rows<C>.json)")
    p.add_argument("--methods", default="hf plain,scheduled",
                   help="comma list from: hf plain, none (dspark_hf's loop, no drafts), scheduled (drafter + lookup), "
                        "scheduled-nolookup (drafter only), scheduled-dropall (finished rows dropped at once), "
                        "scheduled-padded (the padding of each verification forward multiplied too, priced as the "
                        "rectangle: the loop before ragged verification), scheduled-ragged-pricing (ragged "
                        "forwards priced by their real tokens, Algorithm 1's sum: padded_pricing=False), "
                        "scheduled-old (padded, dropped at once and holes compacted past 2 verification widths: the "
                        "loop before `Riders` / `compaction_pays`), scheduled-warm (with a PolicyMemory learned in "
                        "one untimed call on the next C prompts, kept across the repeats), scheduled-warm-skip32 "
                        "(the same with the drafter's skips capped at 32 rounds, as within one call: "
                        "PolicyMemory(max_skip=32))")
    p.add_argument("--out", help="folder for decode_only.json / .md")
    args = p.parse_args()
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct")
    prepack_linears(target)
    dspark_hf.use_gqa_attention(target)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target).eval()
    lookup = resolve_lookup("release", "smollm2-135m-instruct")
    c = args.concurrency
    sps = SPSTable.load(args.sps, target=target, reprofile=True, max_tokens=c * (drafter.config.block_size + 1))
    ids, mask = _prompts(target, tok, c, 0, args.prompt_set)
    width = ids.shape[1]
    first: list[float] = []
    forwards: list[tuple[int, int, float]] = []  # (rows, new tokens per row, seconds) of each decode forward

    def pre(module, a, k):
        first.append(time.perf_counter())

    def post(module, a, k, out):
        if len(first) == 1:
            first.append(time.perf_counter())
        else:
            x = k.get("input_ids") if k.get("input_ids") is not None else k.get("inputs_embeds")
            forwards.append((int(x.shape[0]), int(x.shape[1]), time.perf_counter() - first[-1]))
            first.pop()
    target.register_forward_pre_hook(pre, with_kwargs=True)
    target.register_forward_hook(post, with_kwargs=True)

    def run(method: str):
        first.clear()
        forwards.clear()
        start = time.perf_counter()
        with torch.no_grad():
            if method == "hf plain":
                out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                      do_sample=False, eos_token_id=int(target.config.vocab_size))
            elif method == "none":
                out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                         speculate=False, eos_token_id=[])
            else:
                kwargs = dict(lookup=None) if method == "scheduled-nolookup" else dict(lookup=lookup)
                if method in ("scheduled-dropall", "scheduled-old"):
                    kwargs["drop_finished"] = "always"
                if method == "scheduled-old":
                    kwargs["hole_budget"] = 2 * (drafter.config.block_size + 1)
                if method in ("scheduled-padded", "scheduled-old"):
                    kwargs["ragged_verification"] = False
                if method == "scheduled-ragged-pricing":
                    kwargs["padded_pricing"] = False
                if method in memories:
                    kwargs["policy_memory"] = memories[method]
                out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                         policy="scheduled", sps=sps, eos_token_id=[], **kwargs)
        total = time.perf_counter() - start
        return total, first[1] - first[0], out[:, width:], list(forwards)

    methods = [m.strip() for m in args.methods.split(",")]
    memories = {m: dspark_hf.PolicyMemory(**({"max_skip": 32} if m.endswith("skip32") else {}))
                for m in methods if m.startswith("scheduled-warm")}
    for memory in memories.values():  # learned on other prompts of the set, as `dspark-hf bench` does
        warm_ids, warm_mask = _prompts(target, tok, c, 0, args.prompt_set, offset=c)
        dspark_hf.generate(target, drafter, warm_ids, warm_mask, max_new_tokens=args.max_new_tokens,
                           policy="scheduled", sps=sps, eos_token_id=[], lookup=lookup, policy_memory=memory)
    for m in methods:
        run(m)  # warm-up
    times = {m: [] for m in methods}
    fwd = {m: [] for m in methods}
    outs = {}
    for rep in range(args.repeats):
        for m in (methods if rep % 2 == 0 else methods[::-1]):
            total, prefill, outs[m], f = run(m)
            times[m].append((total, prefill))
            fwd[m].append(f)
            in_fwd = sum(s for _, _, s in f)
            print(f"[{rep}] {m:9s} total {total:6.2f} s  prefill {prefill:6.2f} s  decode {total - prefill:6.2f} s "
                  f"(forwards {len(f)}: {in_fwd:6.2f} s, outside {total - prefill - in_fwd:5.2f} s; widths "
                  f"{sorted(set(w for _, w, _ in f))})", flush=True)
    identical = all(torch.equal(outs[methods[0]], outs[m]) for m in methods)
    rows = []
    for m in methods:
        total = statistics.median(t for t, _ in times[m])
        prefill = statistics.median(p for _, p in times[m])
        decode = statistics.median(t - p for t, p in times[m])
        in_fwd = statistics.median(sum(s for _, _, s in f) for f in fwd[m])
        rows.append(dict(method=m, total_s=total, prefill_s=prefill, decode_s=decode, forwards=len(fwd[m][-1]),
                         forward_s=in_fwd, outside_s=decode - in_fwd))
    base = rows[0]
    for r in rows:
        r["total_ratio"] = base["total_s"] / r["total_s"]
        r["decode_ratio"] = base["decode_s"] / r["decode_s"]
        print(f"{r['method']:9s} total {r['total_s']:6.2f} s ({r['total_ratio']:.2f}x)  prefill {r['prefill_s']:6.2f} s"
              f"  decode {r['decode_s']:6.2f} s ({r['decode_ratio']:.2f}x; forwards {r['forwards']} in "
              f"{r['forward_s']:.2f} s, outside them {r['outside_s']:.2f} s)", flush=True)
    for m in methods:  # the decode forwards by width: mean seconds (count) over all repeats
        by_width: dict[int, list[float]] = {}
        for f in fwd[m]:
            for _, w, sec in f:
                by_width.setdefault(w, []).append(sec)
        rows_by_m = next(r for r in rows if r["method"] == m)
        rows_by_m["forward_by_width"] = {w: dict(mean_s=statistics.fmean(v), count=len(v))
                                         for w, v in sorted(by_width.items())}
        print(f"{m:9s} decode forwards by width: " + ", ".join(
            f"{w}: {statistics.fmean(v) * 1000:.0f} ms x{len(v)}" for w, v in sorted(by_width.items())), flush=True)
    print(f"identical outputs: {identical}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prov = provenance()
        atomic_write_json(out / f"decode_only_c{c}.json",
                          dict(provenance=prov, args=vars(args), rows=rows, identical=identical,
                               repeats={m: times[m] for m in methods}))
        lines = [f"# Decode-only: transformers' plain generate vs scheduled + lookup, {c} requests", "",
                 f"Device: {prov['device']}; commit `{prov['git_commit']}`. {args.prompt_set} prompts, "
                 f"{args.max_new_tokens} new tokens, median of {args.repeats} interleaved repeats, identical outputs: "
                 f"{'yes' if identical else 'NO'}. Ratios > 1: faster than transformers.", "",
                 "| method | total s | prefill s | decode s | decode forwards | in them s | outside them s | "
                 "total ratio | decode ratio |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['total_s']:.2f} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} | "
                  f"{r['forwards']} | {r['forward_s']:.2f} | {r['outside_s']:.2f} | "
                  f"{r['total_ratio']:.2f}x | {r['decode_ratio']:.2f}x |" for r in rows]
        lines += ["", "Decode forwards by width (tokens per row): mean ms (count), all repeats.", ""]
        lines += [f"* {r['method']}: " + ", ".join(f"{w}: {v['mean_s'] * 1000:.0f} ms ({v['count']})"
                                                 for w, v in r["forward_by_width"].items()) for r in rows]
        atomic_write_text(out / f"decode_only_c{c}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
