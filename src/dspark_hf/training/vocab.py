"""Reduced draft vocabulary (EAGLE-3's idea): which target tokens the drafter may propose.

The target's own answers (the self-distilled training data, `loss_mask == 1`) say which tokens the drafter has to
propose: `build_draft_vocab` keeps the `size` most frequent answer tokens plus the ids that must always be
proposable (EOS / end-of-turn), as sorted target ids: the drafter's `d2t` buffer (`DSparkDrafter.set_draft_vocab`).
`coverage_report` gives the share of answer tokens such a vocabulary covers at several sizes, the upper bound on the
per-token acceptance a drafter restricted to it can reach (a token outside it is never accepted as a draft).

Ties in frequency are broken by the smaller id, so the mapping depends on the data only. Tokens that never occur in
the answers fill the vocabulary last, in id order, when `size` exceeds the distinct answer tokens.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .data import TokenizedExample


def answer_token_counts(examples: Iterable[TokenizedExample], vocab_size: int) -> torch.Tensor:
    """`[vocab_size]` int64 counts of the answer tokens (`loss_mask == 1`) of `examples`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)[: len(ids)]
        picked = ids[: len(mask)][mask]
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= vocab_size):
            raise ValueError(f"example {e.id} has answer token ids outside [0, {vocab_size})")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts


def _special_ids(always_include: Iterable[int] | int | None) -> list[int]:
    if always_include is None:
        return []
    if isinstance(always_include, int):
        return [always_include]
    out: list[int] = []
    for x in always_include:
        if x is None:
            continue
        out.extend(_special_ids(x) if isinstance(x, (list, tuple)) else [int(x)])
    return out


def draft_vocab_from_counts(counts: torch.Tensor, size: int, always_include: Iterable[int] | int | None = ()) \
        -> torch.LongTensor:
    """The `size` most frequent ids of `counts` `[V]` (ties: smaller id first), always containing `always_include`;
    sorted target ids `[size]`."""
    vocab_size = int(counts.shape[0])
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must lie in [1, {vocab_size}], got {size}")
    forced = sorted(set(_special_ids(always_include)))
    bad = [i for i in forced if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"always_include ids {bad} are outside the vocabulary [0, {vocab_size})")
    if len(forced) > size:
        raise ValueError(f"always_include has {len(forced)} ids, more than the draft vocabulary size {size}")
    # Sort by (-count, id): a stable sort of ids (already in id order) by descending count.
    order = torch.sort(-counts.long(), stable=True).indices
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    if forced:
        keep[torch.tensor(forced)] = True
    free = order[~keep[order]][: size - len(forced)]
    keep[free] = True
    return keep.nonzero().squeeze(1)


def build_draft_vocab(examples: Sequence[TokenizedExample], size: int,
                      always_include: Iterable[int] | int | None = (), vocab_size: int | None = None) -> torch.LongTensor:
    """The reduced draft vocabulary (`d2t`, sorted target ids `[size]`) from the answer-token frequencies of
    `examples`, e.g. `always_include=target.generation_config.eos_token_id`. `vocab_size`: the target's (default:
    1 + the largest id seen; pass it so that a vocabulary larger than the distinct answer tokens can be filled)."""
    if vocab_size is None:
        seen = [max(e.input_ids) for e in examples if e.input_ids] + _special_ids(always_include)
        vocab_size = 1 + max(seen, default=-1)
    return draft_vocab_from_counts(answer_token_counts(examples, vocab_size), size, always_include)


def coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    """Share of the counted answer tokens whose id is in `d2t`."""
    total = int(counts.sum())
    return float(counts[d2t].sum()) / total if total else float("nan")


def coverage_report(examples: Sequence[TokenizedExample], vocab_size: int, sizes: Sequence[int] = (4096, 8192, 16384, 32768),
                    always_include: Iterable[int] | int | None = ()) -> dict:
    """Answer-token coverage of the frequency-chosen draft vocabulary at each of `sizes` (sizes >= V are the full
    vocabulary, coverage 1). In-sample: the vocabulary is chosen on the same examples it is measured on."""
    counts = answer_token_counts(examples, vocab_size)
    rows = []
    for size in sizes:
        size = int(size)
        if size >= vocab_size:
            rows.append({"size": size, "coverage": 1.0, "full_vocabulary": True})
            continue
        d2t = draft_vocab_from_counts(counts, size, always_include)
        rows.append({"size": size, "coverage": coverage(counts, d2t), "full_vocabulary": False})
    return {"vocab_size": vocab_size, "answer_tokens": int(counts.sum()), "distinct_answer_tokens": int((counts > 0).sum()),
            "examples": len(examples), "sizes": rows}


__all__ = ["answer_token_counts", "draft_vocab_from_counts", "build_draft_vocab", "coverage", "coverage_report"]
