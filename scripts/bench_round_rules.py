"""Batch 1 through the batched loop: this session's round rules on vs off, and `fixed`, side by side (issue 14).

    OMP_NUM_THREADS=1 python scripts/bench_round_rules.py [--prompts 8] [--repeats 3] [--out results/round_rules]

"new" is the loop as it is: a chain round verifies only where it beats a plain step once the measured tails of
verifying and plain rounds are priced (`LengthPolicy.worth_verifying`), and a draft source probes with one draft per
row until its calibration has seen as many verified drafts as there are rows. "old" switches both off (every priced
length verified; the probe cap lifted after the source's first observed round), by patching the two rules. "fixed"
verifies whole blocks. Each method decodes the same `--prompts` gsm_symbolic prompts one at a time (prepacked GQA
SmolLM2-135M-Instruct, the bf16 drafter with the release lookup), interleaved over `--repeats`; medians of the
totals, outputs checked identical.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.decoding import round_state
from dspark_hf.decoding.sps import profile_sps
from dspark_hf.evaluation.throughput import _prompts
from dspark_hf.models.modeling_dspark import DSparkDrafter
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import resolve_lookup
from dspark_hf.testbed.targets import load_target

METHODS = ("new", "old", "fixed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--drafter", default="results/training_smollm2_bf16/drafter")
    p.add_argument("--out", help="folder for round_rules.json / .md")
    args = p.parse_args()
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct")
    prepack_linears(target)
    dspark_hf.use_gqa_attention(target)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target).eval()
    lookup = resolve_lookup("release", "smollm2-135m-instruct")
    sps = profile_sps(target, max_tokens=drafter.config.block_size + 1, context_lengths=(128,), repeats=2, rows=1)
    ids, mask = _prompts(target, tok, args.prompts, 0, "gsm_symbolic")
    prompts = [ids[i:i + 1, -int(mask[i].sum()):] for i in range(ids.shape[0])]
    gate = round_state.LengthPolicy.worth_verifying
    verified = round_state.OnlineCalibration.verified

    def run(method: str) -> tuple[float, list[torch.Tensor]]:
        new = method != "old"
        round_state.LengthPolicy.worth_verifying = gate if new else (lambda self, *a, **k: True)
        round_state.OnlineCalibration.verified = verified if new else property(
            lambda self: 10 ** 9 if self.history else 0)  # the cap lifted after the first observed round
        try:
            start, outs = time.perf_counter(), []
            for x in prompts:
                out = dspark_hf.generate(target, drafter, x, torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                         policy="fixed" if method == "fixed" else "scheduled", sps=sps,
                                         eos_token_id=[], lookup=lookup)
                outs.append(out[0, x.shape[1]:])
            return time.perf_counter() - start, outs
        finally:
            round_state.LengthPolicy.worth_verifying, round_state.OnlineCalibration.verified = gate, verified

    for m in METHODS:
        run(m)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    outs = {}
    for rep in range(args.repeats):
        for m in (METHODS if rep % 2 == 0 else METHODS[::-1]):
            seconds, outs[m] = run(m)
            times[m].append(seconds)
            print(f"[{rep}] {m:5s} {seconds:6.2f} s", flush=True)
    identical = all(all(torch.equal(a, b) for a, b in zip(outs["new"], outs[m])) for m in METHODS)
    medians = {m: statistics.median(v) for m, v in times.items()}
    for m in METHODS:
        print(f"{m:5s} median {medians[m]:6.2f} s  (new is {medians[m] / medians['new']:.2f}x as fast)")
    print(f"identical outputs: {identical}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prov = provenance()
        atomic_write_json(out / "round_rules.json", dict(provenance=prov, args=vars(args), times=times,
                                                         medians=medians, identical=identical))
        lines = ["# Round rules at batch 1: new (tail gate + probe until every row calibrated) vs old vs fixed", "",
                 f"Device: {prov['device']}; commit `{prov['git_commit']}`. {args.prompts} gsm_symbolic prompts one "
                 f"at a time, {args.max_new_tokens} new tokens, median of {args.repeats} interleaved repeats, "
                 f"identical outputs: {'yes' if identical else 'NO'}.", "",
                 "| method | median s | repeats s | new's speedup over it |", "|---|---|---|---|"]
        lines += [f"| {m} | {medians[m]:.2f} | {' / '.join(f'{x:.2f}' for x in times[m])} | "
                  f"{medians[m] / medians['new']:.2f}x |" for m in METHODS]
        atomic_write_text(out / "round_rules.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
