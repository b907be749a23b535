"""Is bf16 autocast worth it on this CPU? The target's feature-cache pass in fp32 vs under bf16 autocast.

    OMP_NUM_THREADS=1 python scripts/bench_cpu_bf16.py [--target smollm2-135m-instruct] [--lengths 256 768] \
        [--repeats 3] [--out results/cpu_bf16]

What `dspark-hf train ... mixed_precision=bf16` does to the one pass of the target that fills a feature cache (and
to every training forward): one forward of a `length`-token sequence with the drafter's target layers' hidden states
requested, as `build_feature_cache` runs it, in fp32 and under `torch.autocast("cpu", torch.bfloat16)`, interleaved
so both see the same machine load; the median of `--repeats` each. CPUs with AVX-512 BF16 or AMX compute bf16
natively; elsewhere every bf16 product is converted, and the trainer warns (`provenance.cpu_has_native_bf16`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark_hf.provenance import atomic_write_json, atomic_write_text, cpu_has_native_bf16, provenance
from dspark_hf.testbed.targets import load_target


def _forward(target, ids: torch.Tensor, bf16: bool) -> float:
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        target(input_ids=ids, output_hidden_states=[2, 9, 15, 21, 28], logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="folder for cpu_bf16.json / .md")
    args = p.parse_args()
    target, _ = load_target(args.target)
    target.eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, target.config.vocab_size, (1, length), generator=g)
        _forward(target, ids, False), _forward(target, ids, True)  # warm-up, both paths
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for bf16 in (False, True):
                times[bf16].append(_forward(target, ids, bf16))
        fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
        rows.append(dict(length=length, fp32_s=fp32, bf16_autocast_s=bf16, bf16_over_fp32=bf16 / fp32))
        print(f"{length:5d} tokens  fp32 {fp32:7.3f}s  bf16 autocast {bf16:7.3f}s  bf16/fp32 {bf16 / fp32:5.2f}x",
              flush=True)
    prov = provenance(native_bf16=cpu_has_native_bf16())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "cpu_bf16.json", dict(provenance=prov, target=args.target, rows=rows))
        lines = [f"# bf16 autocast vs fp32: one target pass ({args.target})", "",
                 f"{prov['device']}; native bf16 (AVX-512 BF16 / AMX): {prov['native_bf16']}; "
                 f"median of {args.repeats}, interleaved.", "",
                 "| tokens | fp32 s | bf16 autocast s | bf16 / fp32 |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['length']} | {r['fp32_s']:.3f} | {r['bf16_autocast_s']:.3f} | {r['bf16_over_fp32']:.2f}x |"
                  for r in rows]
        atomic_write_text(out / "cpu_bf16.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
