"""Where a drafter's acceptance is lost: teacher-forced on training answers, on held-out answers, and while decoding.

    python scripts/teacher_forced_acceptance.py --target smollm2-135m-instruct \
        --drafter src/dspark_hf/testbed/releases/smollm2-135m-instruct-dspark --data data/smollm2-135m-12k \
        --examples 8 --out results/teacher_forced/smollm2_release

For `--examples` training examples and as many of the data's held-out split (`trainer.split_examples`, never trained
on), every answer position is an anchor: the drafter drafts its block with the ground truth before it (teacher
forcing, as in training), and per slot k we report c*@k = 1 - TV(p_draft, p_target) (the training metric) and the
share of anchors whose k-th draft equals the target's token (greedy acceptance given a correct prefix). Then the
held-out prompts are decoded greedily (`trainer.heldout_tau`, the first `--max-new-tokens` tokens, every draft
verified): the share of rounds that accept their first draft. The data's answers are the target's own greedy answers,
so with no train / decode mismatch the decoded first-draft acceptance equals the teacher-forced one over the same
positions; "first N answer tokens" restricts the teacher-forced anchors to those positions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_hf import DSparkDrafter
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import read_examples
from dspark_hf.training.features import OnlineFeatures
from dspark_hf.training.trainer import heldout_prompt_ids, heldout_tau, split_examples


@torch.no_grad()
def teacher_forced(drafter, features, examples, first: int | None = None) -> dict[str, list[float]]:
    """Per slot: mean c* and greedy match over every answer anchor of `examples` (the first `first` answer tokens
    only, when given)."""
    k = drafter.config.block_size
    c_sum, m_sum, n = torch.zeros(k), torch.zeros(k), 0
    for ex in examples:
        f = features([ex], 1024)
        ids = f.input_ids[0]
        start = int(f.loss_mask[0].nonzero()[0])
        end = f.input_ids.shape[1] - k - 1
        if first is not None:
            end = min(end, start - 1 + first)
        pos = torch.arange(start - 1, end)
        if len(pos) == 0:
            continue
        out = drafter(ids[pos][None], pos[None], f.context, context_mask=f.attention_mask.bool(), return_logits=False)
        hidden = out.hidden_states[0]
        labels = ids[pos[:, None] + 1 + torch.arange(k)]
        logits = drafter.draft_lm_head(hidden).float()
        if drafter.markov_head is not None:
            prev = torch.cat([ids[pos][:, None], labels[:, :-1]], dim=1)
            bias, _ = drafter.markov_head.teacher_forced(drafter.to_draft_inputs(prev), hidden)
            logits = logits + bias.float()
        p_draft = F.softmax(logits, dim=-1)
        target_logits = drafter.lm_head(f.final_hidden[0][pos[:, None] + torch.arange(k)].to(drafter.dtype)).float()
        if drafter.d2t is not None:
            p_in = torch.exp(target_logits.index_select(-1, drafter.d2t)
                             - torch.logsumexp(target_logits, dim=-1, keepdim=True))
            c_star = 1 - 0.5 * ((p_draft - p_in).abs().sum(-1) + (1 - p_in.sum(-1)))
            drafts = drafter.d2t[logits.argmax(-1)]
        else:
            c_star = 1 - 0.5 * (p_draft - F.softmax(target_logits, dim=-1)).abs().sum(-1)
            drafts = logits.argmax(-1)
        c_sum += c_star.sum(0)
        m_sum += (drafts == labels).float().sum(0)
        n += len(pos)
    return {"anchors": n, "c_star": (c_sum / max(1, n)).tolist(), "greedy_match": (m_sum / max(1, n)).tolist()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="scripts/teacher_forced_acceptance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="a `dspark-hf data` folder of the target's own answers")
    parser.add_argument("--heldout-fraction", type=float, default=0.02, help="the training config's heldout_fraction")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.target)
    drafter = DSparkDrafter.from_pretrained(args.drafter).eval()
    drafter.bind_target(target)
    train, held = split_examples(read_examples(args.data), args.heldout_fraction)
    train, held = train[: args.examples], held[: args.examples]
    features = OnlineFeatures(target, drafter.config.target_layer_ids)
    rows = {"training answers": teacher_forced(drafter, features, train),
            "held-out answers": teacher_forced(drafter, features, held),
            f"held-out, first {args.max_new_tokens} answer tokens": teacher_forced(drafter, features, held,
                                                                                  first=args.max_new_tokens)}
    decoded = heldout_tau(target, drafter, heldout_prompt_ids(held, args.examples), args.max_new_tokens)
    data = {"target": args.target, "drafter": args.drafter, "data": args.data, "examples": args.examples,
            "max_new_tokens": args.max_new_tokens, "teacher_forced": rows, "decoded": decoded,
            "provenance": provenance(command=" ".join(["python", "scripts/teacher_forced_acceptance.py",
                                                        *(argv if argv is not None else __import__("sys").argv[1:])]),
                                     threads=torch.get_num_threads())}
    k = drafter.config.block_size
    lines = [f"Teacher-forced acceptance per slot, {args.examples} examples each (drafter `{args.drafter}`, data "
             f"`{args.data}`); device {data['provenance']['device']}.", "",
             "| anchors | positions | metric | " + " | ".join(f"@{j + 1}" for j in range(k)) + " |",
             "|---|---|---|" + "---|" * k]
    for name, r in rows.items():
        for metric in ("greedy_match", "c_star"):
            label = "greedy match" if metric == "greedy_match" else "c* = 1 - TV"
            lines.append(f"| {name} | {r['anchors']} | {label} | " + " | ".join(f"{v:.3f}" for v in r[metric]) + " |")
    lines += ["", f"Decoded greedily (held-out prompts, first {args.max_new_tokens} tokens, every draft verified): tau "
              f"{decoded['heldout_tau']:.3f}, first draft accepted in {decoded['heldout_accept@1']:.3f} of "
              f"{decoded['heldout_rounds']} rounds."]
    text = "\n".join(lines) + "\n"
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out.with_suffix(".json"), data)
        atomic_write_text(out.with_suffix(".md"), text)
    print(text)
    return data


if __name__ == "__main__":
    main()
