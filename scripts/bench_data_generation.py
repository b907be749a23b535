"""Throughput of the target answering training prompts (`dspark-hf data`), per batch size / dtype / threads.

    python scripts/bench_data_generation.py --target smollm2-135m-instruct --batch-sizes 16 32 64 --out results/data_generation
    python scripts/bench_data_generation.py --dtypes float32 --batch-sizes 64 --linears plain prepacked \
        --out results/data_generation_prepacked     # `dspark-hf data` prepacks by default (--no-prepack)

Times `target.generate` on real training prompts (length-sorted as `generate_responses` does) and prints answer
tokens per second for each setting, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids
from dspark_hf.training.prompts import read_prompts_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="data/train_prompts.jsonl")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--linears", nargs="+", default=["plain"], choices=["plain", "prepacked"],
                        help="PyTorch's own CPU linears and/or oneDNN prepacked ones (models.prepacked)")
    parser.add_argument("--out", default="results/data_generation")
    args = parser.parse_args()
    prompts, _ = read_prompts_jsonl(args.prompts)
    rows = []
    from dspark_hf.models.prepacked import prepack_linears

    outputs = {}
    for dtype, linears in ((d, k) for d in args.dtypes for k in args.linears):
        target, tok = load_target(args.target, dtype=getattr(torch, dtype))
        if linears == "prepacked":
            prepack_linears(target)
        ids = sorted((chat_prompt_ids(tok, p["messages"], 512) for p in prompts[:512]), key=len)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for threads in args.threads:
            torch.set_num_threads(threads)
            for bs in args.batch_sizes:
                batch = ids[len(ids) // 2: len(ids) // 2 + bs]  # median-length prompts
                width = max(map(len, batch))
                x = torch.tensor([[pad] * (width - len(r)) + r for r in batch])
                m = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
                # no EOS: every row generates max_new_tokens, so tokens/s is comparable across settings
                start = time.perf_counter()
                out = target.generate(input_ids=x, attention_mask=m, max_new_tokens=args.max_new_tokens,
                                      do_sample=False, eos_token_id=target.config.vocab_size + 1, pad_token_id=pad)
                seconds = time.perf_counter() - start
                first = outputs.setdefault((dtype, threads, bs), out)
                rows.append({"dtype": dtype, "linears": linears, "threads": threads, "batch_size": bs,
                             "seconds": seconds, "tokens_per_s": bs * args.max_new_tokens / seconds,
                             "answers_equal_first_run": bool(torch.equal(first, out))})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "data_generation.json", {"rows": rows, "args": vars(args), "provenance": provenance()})
    lines = [f"# Data generation throughput ({args.target}, {args.max_new_tokens} new tokens, median-length prompts)",
             "", "| dtype | linears | threads | batch | s | answer tokens/s | answers = the first setting's |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['linears']} | {r['threads']} | {r['batch_size']} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {'yes' if r['answers_equal_first_run'] else 'no'} |" for r in rows]
    atomic_write_text(out / "data_generation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
