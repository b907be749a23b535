"""What `repeat_kv` costs a verification forward under load: transformers' SDPA attention vs `use_gqa_attention`.

    OMP_NUM_THREADS=1 python scripts/bench_gqa_attention.py [--rows 64] [--widths 1 2 3 4 8] [--repeats 5] \
        [--no-prepack] [--out results/gqa_attention]

SmolLM2-135M-Instruct (9 query heads over 3 key/value heads), `--rows` GSM-symbolic prompts left-padded and
prefilled once; then, per width w, a forward of w new tokens per row over that cache with the padding mask, as a
verification round does (the cache is cropped back after every forward). The same forwards run on the same model
with transformers' `"sdpa"` attention and with `"sdpa_gqa"` (`dspark_hf.models.gqa_attention`), interleaved, so
both see the same machine load; the median of `--repeats` forwards each. Also prints the largest logit difference
between the two (float rounding; a different kernel) and whether their argmax tokens agree. The target's linears are
prepacked (`prepack_linears`, as the benchmarks run it) unless `--no-prepack`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf.evaluation.throughput import _prompts
from dspark_hf.models.gqa_attention import GQA_ATTENTION, restore_attention, use_gqa_attention
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-set", default="gsm_symbolic")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-prepack", action="store_true")
    p.add_argument("--out", help="folder for gqa_attention.json / .md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_target("smollm2-135m-instruct")
    if not args.no_prepack:
        prepack_linears(target)
    ids, mask = _prompts(target, tok, args.rows, 0, args.prompt_set)
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        out = target(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    context = ids.shape[1]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for width in args.widths:
        new = torch.randint(0, target.config.vocab_size, (args.rows, width), generator=gen)
        full_mask = torch.cat([mask, torch.ones(args.rows, width, dtype=mask.dtype)], dim=1)
        position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        times = {"sdpa": [], GQA_ATTENTION: []}
        logits = {}
        for rep in range(args.repeats + 1):  # the first forward of each is a warm-up, not timed
            for impl in ("sdpa", GQA_ATTENTION):
                use_gqa_attention(target) if impl == GQA_ATTENTION else restore_attention(target)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = target(input_ids=new, attention_mask=full_mask, position_ids=position_ids,
                                 cache=cache, use_cache=True)
                elapsed = time.perf_counter() - start
                cache.crop(-width)
                if rep:
                    times[impl].append(elapsed)
                logits[impl] = out.logits.float()
        restore_attention(target)
        stock, gqa = statistics.median(times["sdpa"]), statistics.median(times[GQA_ATTENTION])
        rows.append({"width": width, "sdpa_s": stock, "sdpa_gqa_s": gqa, "speedup": stock / gqa,
                     "max_abs_logit_diff": float((logits["sdpa"] - logits[GQA_ATTENTION]).abs().max()),
                     "argmax_agree": float((logits["sdpa"].argmax(-1) == logits[GQA_ATTENTION].argmax(-1))
                                           .float().mean())})
        r = rows[-1]
        print(f"width {width}: sdpa {stock:.3f} s, sdpa_gqa {gqa:.3f} s, {r['speedup']:.2f}x; "
              f"max |logit diff| {r['max_abs_logit_diff']:.2e}, argmax agree {r['argmax_agree']:.3f}", flush=True)
    base = {impl: rows[0][f"{impl}_s"] for impl in ("sdpa", "sdpa_gqa")} if rows and rows[0]["width"] == 1 else None
    data = {"rows": args.rows, "context": context, "prompt_set": args.prompt_set, "threads": args.threads,
            "prepacked": not args.no_prepack, "provenance": provenance(), "results": rows}
    lines = ["# Verification forwards under load: transformers' SDPA vs `sdpa_gqa`", "",
             f"SmolLM2-135M-Instruct, {args.rows} rows of {args.prompt_set} prompts (padded context {context}), "
             f"one forward of w new tokens per row over the cache; median of {args.repeats}, interleaved. "
             f"{'Prepacked linears. ' if not args.no_prepack else ''}Device: {data['provenance']['device']}; torch {torch.__version__}.",
             "", "| new tokens per row | sdpa (s) | sdpa_gqa (s) | speedup | sdpa / its 1-token | sdpa_gqa / its 1-token "
             "| max abs logit diff | argmax agree |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = (f"{r['sdpa_s'] / base['sdpa']:.2f}x | {r['sdpa_gqa_s'] / base['sdpa_gqa']:.2f}x" if base else "n/a | n/a")
        lines.append(f"| {r['width']} | {r['sdpa_s']:.3f} | {r['sdpa_gqa_s']:.3f} | {r['speedup']:.2f}x | {rel} | "
                     f"{r['max_abs_logit_diff']:.1e} | {r['argmax_agree']:.3f} |")
    lines += ["", "Command: `OMP_NUM_THREADS=1 python scripts/bench_gqa_attention.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in (("rows", args.rows), ("widths", args.widths), ("repeats", args.repeats)))
        + (" --no-prepack" if args.no_prepack else "") + (f" --out {args.out}`" if args.out else "`")]
    print("\n".join(lines))
    if args.out:
        atomic_write_json(Path(args.out) / "gqa_attention.json", data)
        atomic_write_text(Path(args.out) / "gqa_attention.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
