"""How much of the target's next-token mass the sparse teacher (`teacher_topk`) keeps: per answer position of training
examples, the target's probability mass on its k most probable draft ids, for several k, and the mass outside the draft
vocabulary (which no k recovers). The sparse TV term over-estimates the exact one by at most the rest,
r = 1 - top-k mass, so this table is the bound's slack (`training/losses.py`).

    python scripts/teacher_topk_mass.py --target smollm2-135m-instruct \
        --drafter src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --data data/smollm2-135m-12k \
        --examples 64 --out results/teacher_topk/smollm2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import read_examples


@torch.no_grad()
def topk_mass(target, d2t: torch.Tensor, examples, ks: list[int]) -> dict[str, list[float]]:
    """Per example's answer positions: mean and 10th percentile of the top-k draft mass for each k, and mean
    mass outside the draft vocabulary."""
    masses: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    outside = []
    for ex in examples:
        ids = torch.tensor([ex.input_ids])
        logits = target(input_ids=ids).logits[0].float()
        rows = torch.tensor(ex.loss_mask).nonzero().squeeze(-1)
        rows = rows[rows < ids.shape[1] - 1]  # positions predicting an answer token
        p = logits[rows].softmax(-1)
        p_draft = p[:, d2t]
        outside.append(1.0 - p_draft.sum(-1))
        sorted_p = p_draft.sort(dim=-1, descending=True).values.cumsum(-1)
        for k in ks:
            masses[k].append(sorted_p[:, min(k, sorted_p.shape[1]) - 1])
    out = {"outside_mean": float(torch.cat(outside).mean())}
    for k in ks:
        m = torch.cat(masses[k])
        out[f"top{k}_mean"], out[f"top{k}_p10"] = float(m.mean()), float(m.quantile(0.1))
        out[f"top{k}_below_0.95"] = float((m < 0.95).float().mean())
    out["positions"] = int(torch.cat(outside).numel())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="a drafter with a reduced draft vocabulary (its d2t)")
    p.add_argument("--data", required=True)
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target)
    drafter = DSparkDrafter.from_pretrained(args.drafter)
    if drafter.d2t is None:
        raise SystemExit(f"{args.drafter} has no reduced draft vocabulary: the sparse teacher needs one")
    examples = read_examples(args.data)
    step = max(1, len(examples) // args.examples)
    chosen = examples[::step][: args.examples]  # spread over the folder's sources
    stats = topk_mass(target, drafter.d2t, chosen, args.ks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "mass.json", {"args": vars(args), "stats": stats, "provenance": provenance()})
    lines = [f"Target mass kept by the sparse teacher: {stats['positions']} answer positions of {len(chosen)} "
             f"examples of `{args.data}`, draft vocabulary of `{args.drafter}` ({drafter.d2t.shape[0]} ids). "
             f"Mass outside the draft vocabulary (in every k's rest): {stats['outside_mean']:.4f}.", "",
             "| k | mean top-k mass | 10th percentile | positions below 0.95 |", "|---|---|---|---|"]
    for k in args.ks:
        lines.append(f"| {k} | {stats[f'top{k}_mean']:.4f} | {stats[f'top{k}_p10']:.4f} | "
                     f"{stats[f'top{k}_below_0.95']:.3f} |")
    atomic_write_text(out / "mass.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
