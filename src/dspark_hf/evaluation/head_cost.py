"""How light is the sequential head? Times one drafting round split into its two stages.

* parallel stage: the backbone forward over the block (context keys/values cached), the LM head -> base logits, and,
  with `draft_candidates` = M, the top-M selection and W2-row gather (all independent of the sampled prefix);
* sequential stage: `sample_block`, the left-to-right loop of head bias + confidence + sampling (greedy and sampled).

The paper reports the sequential stage at 0.2-1.3% of a full round; the foundation issue asks for at most 10% of the
parallel forward. Run: `dspark-hf bench-head` (writes JSON + Markdown under `--out`). Random weights: timing only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from ..models.modeling_dspark import DSparkDrafter
from ..decoding.verification import SamplingParams
from ..provenance import atomic_write_json, atomic_write_text, provenance

__all__ = ["SIZES", "HeadCost", "main", "measure", "measure_all", "to_markdown"]

logger = logging.get_logger(__name__)

# name -> (hidden, vocab, heads, kv heads, intermediate, draft layers)
SIZES = {
    "tiny": (64, 1024, 4, 2, 128, 1),
    "smollm2-135m-like": (576, 49152, 9, 3, 1536, 2),
}


@dataclass
class HeadCost:
    size: str
    head: str
    block_size: int
    batch_size: int
    context: int
    candidates: int
    parallel_ms: float
    sequential_greedy_ms: float
    sequential_sampled_ms: float
    greedy_ratio: float  # median over repeats of (loop / parallel) measured back to back
    sampled_ratio: float


def _paired_ms(fns: list, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Times each fn once per repeat, interleaved, so that load changes on a shared machine hit all of them alike.

    Returns one list of millisecond timings per fn."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            bucket.append((time.perf_counter() - start) * 1000)
    return times


def _fake_target(hidden: int, vocab: int, heads: int, kv: int, inter: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=4,
                      num_attention_heads=heads, num_key_value_heads=kv)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def measure(size: str, head: str, block_size: int, batch_size: int = 1, context: int = 256,
            repeats: int = 20, candidates: int = 0) -> HeadCost:
    hidden, vocab, heads, kv, inter, layers = SIZES[size]
    target = _fake_target(hidden, vocab, heads, kv, inter)
    drafter = DSparkDrafter.from_target(
        target, block_size=block_size, num_hidden_layers=layers, sequential_head=head,
        markov_rank=256, intermediate_size=inter,
    ).eval()
    cache = drafter.new_cache()
    feats = torch.randn(batch_size, context, hidden * len(drafter.config.target_layer_ids))
    drafter.append_context(cache, feats, torch.arange(context).expand(batch_size, -1))
    anchors = torch.randint(0, vocab, (batch_size,))
    positions = cache.next_position[:, None] + torch.arange(block_size)
    mask = torch.ones(batch_size, block_size, context + block_size, dtype=torch.bool)

    def parallel():
        h = drafter._backbone(drafter.block_embeddings(anchors), positions,
                              lambda i: (cache.keys[i], cache.values[i]), mask)
        logits = drafter.lm_head(h).float()
        return h, logits, drafter.prepare_candidates(logits, candidates)

    h, logits, prepared = parallel()
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_p=0.95)
    par, greedy, sampled = _paired_ms([
        parallel,
        lambda: drafter.sample_block(h, logits, anchors, prepared=prepared),
        lambda: drafter.sample_block(h, logits, anchors, prepared=prepared, sampling=sampling, generator=gen),
    ], repeats)
    med = statistics.median
    return HeadCost(
        size=size, head=head, block_size=block_size, batch_size=batch_size, context=context, candidates=candidates,
        parallel_ms=med(par), sequential_greedy_ms=med(greedy), sequential_sampled_ms=med(sampled),
        greedy_ratio=med(g / p for g, p in zip(greedy, par)), sampled_ratio=med(s / p for s, p in zip(sampled, par)),
    )


def to_markdown(rows: list[HeadCost], prov: dict) -> str:
    lines = [
        "# Sequential-head cost: sequential loop vs parallel forward (one drafting round)",
        "",
        f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
        f"`{prov['git_commit']}`. Medians over repeats; ratios are medians of back-to-back pairs (robust to the "
        "load of a shared machine); random weights (timing only). Sampled = temperature 0.7, "
        "top-p 0.95. Candidates: 0 = the loop scores the full vocabulary; M = only the top-M base logits per slot "
        "(`draft_candidates`).",
        "",
        "| drafter | head | block | batch | candidates | parallel fwd (ms) | seq. loop greedy (ms) | ratio | "
        "seq. loop sampled (ms) | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.head} | {r.block_size} | {r.batch_size} | {r.candidates or 'all'} | {r.parallel_ms:.2f} | "
            f"{r.sequential_greedy_ms:.2f} | {100 * r.greedy_ratio:.1f}% | {r.sequential_sampled_ms:.2f} | "
            f"{100 * r.sampled_ratio:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def measure_all(sizes: Sequence[str] = tuple(SIZES), heads: Sequence[str] = ("markov", "gated_markov", "rnn"),
                block_sizes: Sequence[int] = (7, 16), batch_size: int = 1, context: int = 256, repeats: int = 20,
                candidates: Sequence[int] = (0, 256), out: str | Path = "outputs/bench_head") -> list[HeadCost]:
    """`dspark-hf bench-head`: `measure` for every (size, head, block size, candidates) combination, written to
    `out` as `head_cost.json` (with provenance) and `head_cost.md`. Returns the rows."""
    torch.manual_seed(0)
    rows = []
    for size in sizes:
        for head in heads:
            for block, cands in [(b, c) for b in block_sizes for c in candidates]:
                row = measure(size, head, block, batch_size, context, repeats, cands)
                logger.info(f"{size:>18} {head:>12} K={block:<3} M={cands or 'all':<4} parallel {row.parallel_ms:8.2f} "
                            f"ms | loop greedy {row.sequential_greedy_ms:7.2f} ms ({100 * row.greedy_ratio:5.1f}%) | "
                            f"sampled {row.sequential_sampled_ms:7.2f} ms ({100 * row.sampled_ratio:5.1f}%)")
                rows.append(row)
    prov = provenance()
    out = Path(out)
    atomic_write_json(out / "head_cost.json", {"provenance": prov, "rows": [asdict(r) for r in rows]})
    atomic_write_text(out / "head_cost.md", to_markdown(rows, prov))
    return rows


def main(argv: list[str] | None = None) -> list[HeadCost]:
    """`dspark-hf bench-head` (its argument parser lives here, the CLI forwards to it)."""
    parser = argparse.ArgumentParser(prog="dspark-hf bench-head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--heads", nargs="+", default=["markov", "gated_markov", "rnn"])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[7, 16])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--candidates", nargs="+", type=int, default=[0, 256],
                        help="draft_candidates values to time (0 = full vocabulary)")
    parser.add_argument("--out", default="outputs/bench_head")
    args = parser.parse_args(argv)
    rows = measure_all(**vars(args))
    out = Path(args.out)
    print(f"wrote {out / 'head_cost.json'} and {out / 'head_cost.md'}")
    return rows


if __name__ == "__main__":  # `python -m dspark_hf.evaluation.head_cost`: the same as `dspark-hf ...`
    from dspark_hf.logging_utils import configure_logging
    from dspark_hf.evaluation.head_cost import main as _main  # the imported module: its logger is dspark_hf.*

    configure_logging()
    _main()
