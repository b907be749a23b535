"""What an on-disk SPS cache saves: the first `scheduled` call of a process with an empty `SPSCache(directory)` (it
profiles the target's cost curve in the rounds' layout inside the call) against the same call from a new cache on
the same directory (it reads the table), on the real SmolLM2-135M-Instruct target with the release drafter and
lookup table, prepacked linears and GQA attention, greedy; outputs checked identical to the cold call's.

    OMP_NUM_THREADS=1 python scripts/bench_sps_cache.py --concurrency 1 16 64 --out results/sps_cache

Each concurrency gets a fresh temporary directory. The warm call is made right after the cold one; both include
the prefill and `--max-new-tokens` of decoding, so the difference is the profile (and noise).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.evaluation.throughput import _prompts
from dspark_hf.models.modeling_dspark import DSparkDrafter
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import resolve_lookup
from dspark_hf.testbed.targets import load_target

RELEASE = "src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt-set", default="gsm_symbolic")
    p.add_argument("--out", help="folder for sps_cache.json / .md")
    args = p.parse_args()
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct")
    prepack_linears(target)
    dspark_hf.use_gqa_attention(target)
    drafter = DSparkDrafter.from_pretrained(RELEASE, target=target).eval()
    lookup = resolve_lookup("release", "smollm2-135m-instruct")
    rows = []
    for c in args.concurrency:
        ids, mask = _prompts(target, tok, c, 0, args.prompt_set)
        with tempfile.TemporaryDirectory() as directory:
            timed = {}
            for kind in ("cold", "warm"):
                cache = dspark_hf.SPSCache(directory)
                start = time.perf_counter()
                with torch.no_grad():
                    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                             policy="scheduled", sps=cache, lookup=lookup)
                timed[kind] = (time.perf_counter() - start, out, cache.profiles, cache.loaded)
            files = len(list(Path(directory).glob("sps-*.json")))
        (cold, cold_out, cold_profiles, _), (warm, warm_out, warm_profiles, warm_loaded) = timed["cold"], timed["warm"]
        rows.append(dict(concurrency=c, cold_s=round(cold, 2), warm_s=round(warm, 2), saved_s=round(cold - warm, 2),
                         cold_profiles=cold_profiles, warm_profiles=warm_profiles, warm_loaded=warm_loaded,
                         files=files, identical=bool(torch.equal(cold_out, warm_out))))
        print(rows[-1], flush=True)
    lines = [f"First `scheduled` call with an empty on-disk `SPSCache` (cold: profiles inside the call) vs a new cache "
             f"on the same directory (warm: reads the table), {args.max_new_tokens} new tokens per row, greedy, "
             f"prompt set `{args.prompt_set}`, prepacked GQA SmolLM2-135M-Instruct with the release drafter and "
             "lookup table.", "",
             "| concurrency | cold s | warm s | saved s | profiles cold / warm | tables read warm | outputs identical |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['cold_s']:.2f} | {r['warm_s']:.2f} | {r['saved_s']:.2f} | "
                     f"{r['cold_profiles']} / {r['warm_profiles']} | {r['warm_loaded']} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        atomic_write_json(out / "sps_cache.json", {"rows": rows, "max_new_tokens": args.max_new_tokens,
                                                   "prompt_set": args.prompt_set, "provenance": provenance()})
        atomic_write_text(out / "sps_cache.md", text)


if __name__ == "__main__":
    main()
