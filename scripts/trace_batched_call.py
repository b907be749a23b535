"""Where one batched call's time goes: the loop's own plain decoding (`speculate=False`) against the scheduled policy
with lookup drafts and the release drafter, same prompts, SmolLM2-135M-Instruct on a prepacked target (issue 14).

    OMP_NUM_THREADS=1 python scripts/trace_batched_call.py --concurrency 64 [--repeats 2] [--sps FILE] [--drafter DIR] [--gqa-attention]
        [--modes plain scheduled scheduled-padded scheduled-warm]

Prints, per run, the total seconds and the seconds / calls of the prefill, the target forwards by width, the drafter
forwards, its context projections and the lookup's proposals (one call per row), and the rest (the loop's own
work); for the scheduled run also every verifying round (drafter or lookup-only,
drafts verified and accepted, the raw expected extra tokens of the verified drafts before calibration, the forward's
seconds). A diagnostic, not a benchmark: the timers wrap the calls they name.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import time

import torch

import dspark_hf
from dspark_hf.decoding import round_state
from dspark_hf.decoding.sps import SPSTable, profile_sps
from dspark_hf.evaluation.throughput import _prompts
from dspark_hf.models.modeling_dspark import DSparkDrafter
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.testbed.release import release_path, resolve_lookup
from dspark_hf.testbed.targets import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-set", default="gsm_symbolic")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sps", help="SPS table (default: profiled here)")
    p.add_argument("--drafter", help="drafter folder (default: the release drafter)")
    p.add_argument("--gqa-attention", action="store_true", help="dspark_hf.use_gqa_attention(target) for both runs")
    p.add_argument("--modes", nargs="+", default=["plain", "scheduled"],
                   choices=["plain", "scheduled", "scheduled-padded", "scheduled-warm"],
                   help="scheduled-padded: the padding of each verification forward multiplied too and priced "
                        "(ragged_verification=False); scheduled-warm: with a PolicyMemory learned first in one "
                        "untimed call on the next C prompts and kept across the repeats")
    args = p.parse_args()
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct")
    prepack_linears(target)
    if args.gqa_attention:
        dspark_hf.use_gqa_attention(target)
    drafter = DSparkDrafter.from_pretrained(args.drafter or release_path("smollm2-135m-instruct"), target=target).eval()
    lookup = resolve_lookup("release", "smollm2-135m-instruct")
    rows = args.concurrency
    max_b = rows * (drafter.config.block_size + 1)
    sps = (SPSTable.load(args.sps, target=target, reprofile=True, max_tokens=max_b) if args.sps
           else profile_sps(target, max_tokens=max_b, context_lengths=(128,), repeats=2, rows=rows))
    ids, mask = _prompts(target, tok, rows, 0, args.prompt_set)
    memory = None
    if "scheduled-warm" in args.modes:
        memory = dspark_hf.PolicyMemory()
        warm_ids, warm_mask = _prompts(target, tok, rows, 0, args.prompt_set, offset=rows)
        dspark_hf.generate(target, drafter, warm_ids, warm_mask, max_new_tokens=args.max_new_tokens,
                           policy="scheduled", sps=sps, eos_token_id=[], lookup=lookup, policy_memory=memory)
    times: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    verifying: list[str] = []

    def timed(obj, name, key):
        original = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            result = original(*a, **k)
            times[key] += time.perf_counter() - start
            calls[key] += 1
            return result
        setattr(obj, name, wrapper)

    timed(drafter, "draft", "drafter forward")
    timed(drafter, "append_context", "context projection")
    timed(lookup, "propose", "lookup proposals")
    forward = target.forward

    def traced_forward(*a, **k):
        start = time.perf_counter()
        out = forward(*a, **k)
        width = k["input_ids"].shape[1]
        key = "prefill" if width > 1 + drafter.config.block_size else f"target forward, width {width}"
        times[key] += time.perf_counter() - start
        calls[key] += 1
        if 1 < width <= 1 + drafter.config.block_size and verifying:
            verifying[-1] += f", forward {time.perf_counter() - start:.2f} s"
        return out
    traced_forward.__signature__ = inspect.signature(forward)  # (generate() reads it for logits_to_keep)
    target.forward = traced_forward
    lengths = round_state.LengthPolicy.lengths

    def traced_lengths(self, block, row_ids, with_drafter=True):
        out = lengths(self, block, row_ids, with_drafter=with_drafter)
        if int(out.max()) > 0:
            survival = torch.cumprod(block.confidences.float().cpu(), 1)
            expected = float(sum(survival[r, :int(n)].sum() for r, n in enumerate(out.tolist())))
            verifying.append(f"{'drafter' if with_drafter else 'lookup-only'} round: {int(out.sum())} drafts "
                             f"verified in {int((out > 0).sum())} rows, raw expected extra tokens {expected:.1f}")
        return out
    round_state.LengthPolicy.lengths = traced_lengths

    for repeat in range(args.repeats):
        for mode in args.modes:
            times.clear(), calls.clear(), verifying.clear()
            start = time.perf_counter()
            out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=args.max_new_tokens,
                                     policy="scheduled", sps=sps, eos_token_id=[], return_dict_in_generate=True,
                                     lookup=lookup, speculate=mode != "plain", record_rounds=True,
                                     ragged_verification=mode != "scheduled-padded",
                                     policy_memory=memory if mode == "scheduled-warm" else None)
            total = time.perf_counter() - start
            parts = ", ".join(f"{k} {v:.2f} s / {calls[k]}" for k, v in sorted(times.items()))
            print(f"[{repeat}] {mode:9s} {total:6.2f} s: {parts}, the rest {total - sum(times.values()):.2f} s")
            if mode != "plain":  # D: the drafter drafted, L: lookup drafts alone, .: a plain round
                print("      rounds: " + "".join("L" if r.lookup_only else "D" if r.confidence_logits is not None
                                                  else "." for r in out.rounds))
                accepted = [int(r.accepted.sum()) for r in out.rounds if int(r.lengths.sum()) > 0]
                for line, acc in zip(verifying, accepted):
                    print(f"      {line}, accepted {acc}")


if __name__ == "__main__":
    main()
