"""What a lookup proposal costs: the whole sequence re-hashed per call vs an incremental `LookupContext`.

    OMP_NUM_THREADS=1 python scripts/bench_lookup_context.py [--data data/smollm2-135m-12k] [--sequences 64] \
        [--tokens 7] [--repeats 3] [--out results/lookup_context]

The batched loop asks the n-gram lookup for every active row's continuation in every drafting and lookup-only round
(64 rows: 64 calls per round). `NgramLookup.propose(ids, ...)` re-hashes every window of the whole sequence for each
draft it proposes; `NgramLookup.propose(context, ...)` reads a `LookupContext` that indexed the sequence once and is
extended by the tokens generated since (what the loop and the batch-1 candidate generator now keep per row). On the
release lookup table and self-distilled answers (`--data`, sequences of at least `--min-length` tokens), at every
20th position of each sequence's last 200 tokens: both ways of proposing `--tokens` drafts (the loop's
`min_survival`), interleaved, median of `--repeats`; the context's own cost of indexing the 20 tokens since the last
position is timed apart. Both must propose exactly the same drafts (checked on every call).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import load_release_lookup


def _sequences(data: Path, count: int, min_length: int) -> list[list[int]]:
    seqs: list[list[int]] = []
    for shard in sorted(data.glob("data-*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            for line in f:
                ids = json.loads(line)["input_ids"]
                if len(ids) >= min_length:
                    seqs.append(ids)
                if len(seqs) == count:
                    return seqs
    if not seqs:
        raise SystemExit(f"no sequence of at least {min_length} tokens in {data}/data-*.jsonl.gz")
    return seqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default="data/smollm2-135m-12k")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--min-length", type=int, default=260)
    p.add_argument("--tokens", type=int, default=7, help="drafts per proposal (the loop's block size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="folder for lookup_context.json / .md")
    args = p.parse_args()
    lookup = load_release_lookup(args.target)
    seqs = _sequences(Path(args.data), args.sequences, args.min_length)
    cut = lookup.negligible_survival
    stateless: list[float] = []
    incremental: list[float] = []
    extend: list[float] = []
    calls = 0
    for _ in range(args.repeats):
        t_stateless = t_incremental = t_extend = 0.0
        calls = 0
        for seq in seqs:
            context = lookup.context(seq[: len(seq) - 200])
            for end in range(len(seq) - 200, len(seq), 20):
                start = time.perf_counter()
                context.extend(seq[len(context):end])
                t_extend += time.perf_counter() - start
                start = time.perf_counter()
                fast = lookup.propose(context, args.tokens, min_survival=cut)
                t_incremental += time.perf_counter() - start
                start = time.perf_counter()
                slow = lookup.propose(seq[:end], args.tokens, min_survival=cut)
                t_stateless += time.perf_counter() - start
                if fast != slow:
                    raise SystemExit(f"the incremental context proposed {fast.tokens}, the whole sequence "
                                     f"{slow.tokens} (sequence of {len(seq)} tokens, position {end})")
                calls += 1
        stateless.append(t_stateless / calls)
        incremental.append(t_incremental / calls)
        extend.append(t_extend / calls)
    row = dict(sequences=len(seqs), calls=calls, tokens=args.tokens,
               mean_length=statistics.mean(len(s) for s in seqs) - 110,
               stateless_ms=1e3 * statistics.median(stateless), incremental_ms=1e3 * statistics.median(incremental),
               extend_ms=1e3 * statistics.median(extend))
    row["speedup"] = row["stateless_ms"] / (row["incremental_ms"] + row["extend_ms"])
    print(f"{calls} proposals per repeat: whole sequence {row['stateless_ms']:.3f} ms, context "
          f"{row['incremental_ms']:.3f} ms + {row['extend_ms']:.3f} ms indexing 20 new tokens: "
          f"{row['speedup']:.2f}x, identical drafts", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prov = provenance()
        atomic_write_json(out / "lookup_context.json", dict(provenance=prov, args=vars(args), result=row))
        lines = [f"# Lookup proposal cost: whole sequence vs incremental context ({args.target} release table)", "",
                 f"Device: {prov['device']}; commit `{prov['git_commit']}`. {row['sequences']} self-distilled "
                 f"sequences from `{args.data}`, {row['calls']} proposals of up to {args.tokens} drafts each (mean "
                 f"sequence length at the call about {row['mean_length']:.0f} tokens), median of {args.repeats} "
                 "interleaved repeats; the drafts were identical on every call.", "",
                 "| whole sequence (ms / call) | context (ms / call) | indexing 20 new tokens (ms) | speedup |",
                 "|---|---|---|---|",
                 f"| {row['stateless_ms']:.3f} | {row['incremental_ms']:.3f} | {row['extend_ms']:.3f} | "
                 f"{row['speedup']:.2f}x |", ""]
        atomic_write_text(out / "lookup_context.md", "\n".join(lines))


if __name__ == "__main__":
    main()
