"""CPU cost of a DSpark and a DFlash training step side by side, and of the paths they replaced (issue 14 part 3).

    OMP_NUM_THREADS=1 python scripts/bench_train_step.py --out results/train_step_cost \
        [--set teacher_topk=64] [--steps 12] [--warmup 3]

The trainers of `scripts/train_dspark_vs_dflash.sh` (examples/configs/smollm2-135m-dspark-long.yaml on its bf16 feature
cache, 1,024 examples; `--set key=value` adds settings to all, e.g. the sparse teacher), each stepping through the
same micro-batches (loss, backward, optimizer step; the target's forward is in the feature cache and excluded):

* `dspark`: today's step (the plain Markov head's teacher-forced bias once per distinct previous token),
* `dspark/per-slot`: the same with the bias product W2(W1[x]) per slot, as before 2026-12-07,
* `dflash`: the baseline (CE only; TV and c* reported without a gradient),
* `dflash/tv-graph`: the same with TV weighted 1e-30, so its graph is built and back-propagated as before 2026-12-07.

The settings alternate step by step; process CPU seconds per step, median over `--steps` after `--warmup`. Prints a
Markdown table with each setting's ratio to `dflash` and writes `results.json` / `results.md` under `--out`.
`--profile N` then runs N more steps of each setting under the torch profiler and adds where each setting's CPU time
goes beyond `dflash`'s: self CPU milliseconds per step by operator, the largest differences first.
The feature cache must exist (the first call of train_dspark_vs_dflash.sh builds it; so does this script, slowly).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path

import torch

from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.training.config import load_training_config
from dspark_hf.training.trainer import trainer_from_config

SETTINGS = ("dspark", "dspark/per-slot", "dflash", "dflash/tv-graph")


def per_slot_bias(head: torch.nn.Module):
    """The Markov head's teacher-forced bias as one W2 product per slot (the path before 2026-12-07)."""

    def teacher_forced(self, prev_token_ids, hidden):
        features = self.markov_w1(prev_token_ids)
        return self.markov_w2(features), features

    return types.MethodType(teacher_forced, head)


def make_trainer(setting: str, args: argparse.Namespace):
    variant = setting.split("/")[0]
    config = load_training_config([
        "--config", args.config, f"feature_cache={args.feature_cache}", "feature_cache_dtype=bfloat16",
        f"max_examples={args.examples}", "eval_every=0", "mixed_precision=no", f"variant={variant}",
        f"output_dir={args.scratch}/{setting.replace('/', '-')}", *args.set])
    trainer = trainer_from_config(config, progress=False)
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    if setting == "dspark/per-slot":
        drafter.markov_head.teacher_forced = per_slot_bias(drafter.markov_head)
    if setting == "dflash/tv-graph":
        trainer.weights.tv = 1e-30
    return trainer


def step(trainer, index: int) -> float:
    start = time.process_time()
    out = trainer.compute_loss(trainer.micro_batch(index), index)
    out.total.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.process_time() - start


def profile_ops(trainer, first: int, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step of each operator over `steps` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(first, first + steps):
            step(trainer, i)
    return {event.key: event.self_cpu_time_total / 1000.0 / steps for event in prof.key_averages()}


def profile_table(ops: dict[str, dict[str, float]], rows: int = 12) -> list[str]:
    """Markdown: per setting, the operators whose self CPU time per step exceeds `dflash`'s the most."""
    base = ops.get("dflash", {})
    lines: list[str] = []
    for setting, table in ops.items():
        if setting == "dflash":
            continue
        diff = {k: table.get(k, 0.0) - base.get(k, 0.0) for k in set(table) | set(base)}
        total = sum(table.values()) - sum(base.values())
        lines += ["", f"`{setting}` against `dflash`: {total:+.0f} ms of self CPU time per step in all; the largest "
                  f"differences by operator:", "",
                  f"| operator | {setting} ms / step | dflash ms / step | difference |", "|---|---|---|---|"]
        for key in sorted(diff, key=lambda k: -abs(diff[k]))[:rows]:
            lines.append(f"| `{key[:110]}` | {table.get(key, 0.0):.1f} | {base.get(key, 0.0):.1f} | {diff[key]:+.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/configs/smollm2-135m-dspark-long.yaml")
    parser.add_argument("--feature-cache", default="/work/runs/features/smollm2-135m-bf16")
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--set", nargs="*", default=[], help="key=value settings for every trainer")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--scratch", default="/tmp/bench_train_step")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N steps of each setting: where its CPU time goes beyond dflash's")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.profile < 0:
        parser.error("--steps must be >= 1, --warmup and --profile >= 0")
    if args.profile and "dflash" not in args.settings:
        parser.error("--profile compares with dflash: keep it in --settings")
    trainers = {s: make_trainer(s, args) for s in args.settings}
    times: dict[str, list[float]] = {s: [] for s in args.settings}
    for i in range(args.warmup + args.steps):
        for s, trainer in trainers.items():  # alternating: every setting sees the same load
            t = step(trainer, i)
            if i >= args.warmup:
                times[s].append(t)
    med = {s: statistics.median(v) for s, v in times.items()}
    base = med.get("dflash")
    lines = [f"CPU cost of one training step (loss, backward, optimizer step; the target's forward excluded), "
             f"median of {args.steps} steps after {args.warmup}, settings alternating step by step. Config "
             f"`{args.config}`, {args.examples} examples, extra settings {args.set or 'none'}; "
             f"torch threads {torch.get_num_threads()}.", "",
             "| setting | CPU s / step | vs dflash |", "|---|---|---|"]
    for s in args.settings:
        ratio = f"{med[s] / base:.2f}x" if base else "-"
        lines.append(f"| {s} | {med[s]:.3f} | {ratio} |")
    ops: dict[str, dict[str, float]] = {}
    if args.profile:
        for s, trainer in trainers.items():
            ops[s] = profile_ops(trainer, args.warmup + args.steps, args.profile)
        lines += ["", f"Profiled: {args.profile} more steps of each setting (torch profiler, one setting after the "
                  f"other; profiling slows every operator, so compare within a column pair)."]
        lines += profile_table(ops)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out / "results.json", {"settings": vars(args) | {"out": str(args.out)},
                                                      "seconds": times, "median": med, "profile_ms_per_step": ops,
                                                      "provenance": provenance()})
        prov = provenance()
        atomic_write_text(args.out / "results.md", text + f"\nDevice: {prov['device']}; torch {prov['torch']}; "
                          f"commit `{prov['git_commit']}`.\n")


if __name__ == "__main__":
    main()
