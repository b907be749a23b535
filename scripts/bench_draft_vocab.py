"""Reduced draft vocabulary (`draft_vocab_size`): answer-token coverage, drafting-round time and training-step time.

    python scripts/bench_draft_vocab.py --out results/draft_vocab

1. Coverage: share of the target's own answer tokens (`loss_mask == 1`) inside the `size` most frequent answer tokens
   (EOS ids always included), for the committed SmolLM2 and Qwen2.5-Coder-0.5B data sets, in-sample (chosen and
   measured on all examples) and held-out (chosen on the examples outside a 10% id-hash split, measured on it).
2. Drafting round: `drafter.draft(...)` of a random-init SmolLM2 drafter (block 7, 1 layer, Markov rank 256) on real
   context (the target's states over data examples), full vocabulary vs a reduced one, batch 1 and batch 16, greedy,
   the sequential loop over the whole (draft) vocabulary and over the top-64 candidates; the two drafters alternate
   call by call, median of several calls.
3. Training step: `DSparkTrainer.compute_loss` + backward + optimizer step on precomputed real features (the target's
   forward is excluded: the same for both), full vs reduced vs reduced with the cached teacher log-normalizer
   (`cache_teacher_normalizer`, `training/teacher.py`: after an example's first visit the teacher's logits come from
   the draft rows only), the three trainers alternating step by step, median of several steps.

`--parts training` re-measures only the training step and keeps the other parts of an existing `results.json`.

Prints a Markdown table and writes `results.json` and `results.md` under `--out`. A random-init drafter is fine for
timing; acceptance (tau) needs trained drafters and is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.targets import fetch_target, load_target
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.data import read_examples
from dspark_hf.training.features import FeatureBatch, OnlineFeatures
from dspark_hf.training.trainer import DSparkTrainer, split_examples
from dspark_hf.training.vocab import answer_token_counts, coverage, draft_vocab_from_counts

DATASETS = {"smollm2-135m-instruct": "data/smollm2-135m", "qwen2.5-coder-0.5b-instruct": "data/qwen2.5-coder-0.5b"}


def eos_ids(folder: Path) -> list[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id
    except OSError:
        return []
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def coverage_rows(sizes: list[int], heldout_fraction: float) -> list[dict]:
    from transformers import AutoConfig

    rows = []
    for name, data_dir in DATASETS.items():
        folder = fetch_target(name)
        vocab = int(AutoConfig.from_pretrained(folder, local_files_only=True).get_text_config().vocab_size)
        eos = eos_ids(folder)
        examples = read_examples(data_dir)
        train, heldout = split_examples(examples, heldout_fraction)
        counts = answer_token_counts(examples, vocab)
        train_counts, held_counts = answer_token_counts(train, vocab), answer_token_counts(heldout, vocab)
        for size in sizes:
            in_sample = coverage(counts, draft_vocab_from_counts(counts, min(size, vocab), eos))
            held = coverage(held_counts, draft_vocab_from_counts(train_counts, min(size, vocab), eos))
            rows.append({"target": name, "vocab_size": vocab, "size": size, "examples": len(examples),
                         "answer_tokens": int(counts.sum()), "distinct_answer_tokens": int((counts > 0).sum()),
                         "coverage_in_sample": in_sample, "coverage_heldout": held,
                         "heldout_examples": len(heldout), "heldout_answer_tokens": int(held_counts.sum())})
    return rows


def real_context(target, examples, batch: int, length: int):
    """The target's states over the first `length` tokens of `batch` data examples (long enough ones)."""
    rows = [e for e in examples if len(e.input_ids) >= length][:batch]
    if len(rows) < batch:
        raise ValueError(f"only {len(rows)} examples have >= {length} tokens")
    ids = torch.tensor([e.input_ids[:length] for e in rows])
    return ids


@torch.no_grad()
def time_drafting(target, drafters: dict[str, DSparkDrafter], examples, batch_sizes, length, repeats,
                  candidates_list) -> list[dict]:
    out = []
    for batch in batch_sizes:
        ids = real_context(target, examples, batch, length)
        hs = target(ids, output_hidden_states=True).hidden_states
        caches = {}
        for name, drafter in drafters.items():
            cache = drafter.new_cache()
            feats = drafter.context_features(hs)[:, : length - 1]
            drafter.append_context(cache, feats, torch.arange(length - 1).expand(batch, -1))
            caches[name] = cache
        anchors = ids[:, length - 1]
        for candidates in candidates_list:
            times = {name: [] for name in drafters}
            for name, drafter in drafters.items():  # warm-up (lazy head copies, allocator)
                drafter.draft(caches[name], anchors, candidates=candidates)
            for _ in range(repeats):
                for name, drafter in drafters.items():  # alternate: both see the same machine load
                    start = time.perf_counter()
                    block = drafter.draft(caches[name], anchors, candidates=candidates)
                    times[name].append(time.perf_counter() - start)
                    assert block.logits.shape[-1] == drafter.config.vocab_size
            for name, drafter in drafters.items():
                out.append({"batch": batch, "candidates": candidates, "drafter": name,
                            "draft_vocab": drafter.config.num_draft_tokens, "context_tokens": length - 1,
                            "median_ms": 1e3 * statistics.median(times[name]), "runs": repeats,
                            "min_ms": 1e3 * min(times[name])})
    return out


def time_training(target, examples, vocab_sizes: dict[str, tuple[int | None, bool]], steps: int, batch_size: int,
                  num_anchors: int, max_length: int, out_dir: Path) -> list[dict]:
    """`vocab_sizes`: name -> (draft_vocab_size, cache_teacher_normalizer)."""
    train, _ = split_examples(examples, 0.02)
    batch = [e for e in train if len(e.input_ids) >= 128][:batch_size]
    layer_ids = None
    trainers = {}
    for name, (size, cache_normalizer) in vocab_sizes.items():
        config = DSparkTrainingConfig(output_dir=str(out_dir / f"run-{name}"), block_size=7, num_hidden_layers=1,
                                      markov_rank=256, batch_size=batch_size, num_anchors=num_anchors,
                                      max_length=max_length, max_steps=steps + 1, warmup_steps=0, heldout_fraction=0.02,
                                      draft_vocab_size=size, resume=False, cache_teacher_normalizer=cache_normalizer)
        torch.manual_seed(0)
        trainer = DSparkTrainer(config, target, examples, progress=False)
        trainers[name] = trainer
        layer_ids = trainer.drafter.config.target_layer_ids
    with torch.no_grad():
        feats = OnlineFeatures(target, layer_ids)(batch, max_length)
    fixed = FeatureBatch(input_ids=feats.input_ids, loss_mask=feats.loss_mask, attention_mask=feats.attention_mask,
                         context=feats.context.float(), final_hidden=feats.final_hidden.float())
    times = {name: [] for name in trainers}
    losses = {name: [] for name in trainers}
    for step in range(steps + 1):  # step 0 is a warm-up
        for name, trainer in trainers.items():
            trainer.features = lambda examples_, max_length_=None: fixed  # noqa: E731  (real features, precomputed)
            trainer.model.train()
            start = time.perf_counter()
            out = trainer.compute_loss(batch, step)
            out.total.backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if step:
                times[name].append(elapsed)
                losses[name].append(float(out.total.detach()))
    rows = []
    for name, trainer in trainers.items():
        rows.append({"drafter": name, "draft_vocab": trainer.drafter.config.num_draft_tokens,
                     "cached_normalizer": trainer.teacher is not None,
                     "batch_size": batch_size, "num_anchors": num_anchors, "tokens": int(fixed.attention_mask.sum()),
                     "median_s": statistics.median(times[name]), "steps": steps, "last_loss": losses[name][-1]})
    return rows


def to_markdown(result: dict) -> str:
    lines = ["### Answer-token coverage of the frequency-chosen draft vocabulary", "",
             "| target | V | answer tokens (distinct) | size | coverage in-sample | coverage held-out |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["coverage"]:
        lines.append(f"| {r['target']} | {r['vocab_size']} | {r['answer_tokens']} ({r['distinct_answer_tokens']}) | "
                     f"{r['size']} | {100 * r['coverage_in_sample']:.2f}% | {100 * r['coverage_heldout']:.2f}% |")
    lines += ["", "### Drafting round `drafter.draft(...)` (SmolLM2 drafter, block 7, 1 layer, rank 256, greedy)", "",
              "| batch | loop over | full V (ms) | reduced (ms) | speed-up |", "|---:|---|---:|---:|---:|"]
    rows = result["drafting"]
    for batch in sorted({r["batch"] for r in rows}):
        for cand in sorted({r["candidates"] for r in rows}):
            pair = {r["drafter"]: r for r in rows if r["batch"] == batch and r["candidates"] == cand}
            full, red = pair["full"], pair["reduced"]
            what = "whole vocabulary" if not cand else f"top-{cand} candidates"
            lines.append(f"| {batch} | {what} | {full['median_ms']:.1f} | {red['median_ms']:.1f} "
                         f"({red['draft_vocab']}) | {full['median_ms'] / red['median_ms']:.2f}x |")
    lines += ["", "### Training step (compute_loss + backward + AdamW step, precomputed real features)", "",
              "| drafter | draft vocab | teacher logits | sequences x anchors | median step (s) | speed-up |",
              "|---|---:|---|---:|---:|---:|"]
    train = {r["drafter"]: r for r in result["training"]}
    for name, r in train.items():
        teacher = "draft rows + cached normalizer" if r.get("cached_normalizer") else "full vocabulary"
        lines.append(f"| {name} | {r['draft_vocab']} | {teacher} | {r['batch_size']} x {r['num_anchors']} | "
                     f"{r['median_s']:.2f} | {train['full']['median_s'] / r['median_s']:.2f}x |")
    lines += ["", f"threads: {result['threads']}; {result['provenance'].get('device', '')}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--reduced", type=int, default=8192, help="draft vocabulary size timed against the full one")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=256, help="context tokens before the anchor (+1)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--candidates", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--train-anchors", type=int, default=64)
    parser.add_argument("--train-max-length", type=int, default=512)
    parser.add_argument("--heldout-fraction", type=float, default=0.1,
                        help="coverage: examples held out (by the trainer's id hash) to measure out-of-sample coverage")
    parser.add_argument("--out", default="results/draft_vocab")
    parser.add_argument("--parts", nargs="+", choices=["coverage", "drafting", "training"],
                        default=["coverage", "drafting", "training"],
                        help="what to measure; the other parts are kept from an existing results.json in --out")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict = {}
    if set(args.parts) != {"coverage", "drafting", "training"}:
        import json

        previous = out_dir / "results.json"
        if not previous.exists():
            parser.error(f"--parts {' '.join(args.parts)} keeps the other parts from {previous}, which does not exist")
        result = json.loads(previous.read_text())
    result.update({"threads": torch.get_num_threads(), "args": vars(args)})
    if "coverage" in args.parts:
        result["coverage"] = coverage_rows(args.sizes, args.heldout_fraction)
        print(f"coverage done ({time.perf_counter() - started:.0f}s)", flush=True)

    target, _ = load_target("smollm2-135m-instruct")
    target.requires_grad_(False)
    examples = read_examples(DATASETS["smollm2-135m-instruct"])
    folder = fetch_target("smollm2-135m-instruct")
    vocab = int(target.config.vocab_size)
    train, _ = split_examples(examples, 0.02)
    d2t = draft_vocab_from_counts(answer_token_counts(train, vocab), args.reduced, eos_ids(folder))
    torch.manual_seed(0)
    full = DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=1, markov_rank=256).eval()
    torch.manual_seed(0)
    reduced = DSparkDrafter.from_target(target, draft_vocab=d2t, block_size=7, num_hidden_layers=1,
                                        markov_rank=256).eval()
    for drafter in (full, reduced):  # untrained heads start at zero; give them a real (timed) effect
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.normal_(0.0, 0.02)
    if "drafting" in args.parts:
        result["drafting"] = time_drafting(target, {"full": full, "reduced": reduced}, examples, args.batch_sizes,
                                           args.context + 1, args.repeats, args.candidates)
        print(f"drafting done ({time.perf_counter() - started:.0f}s)", flush=True)
    if "training" in args.parts:
        result["training"] = time_training(
            target, examples, {"full": (None, False), "reduced": (args.reduced, False),
                               "reduced, cached normalizer": (args.reduced, True)},
            args.train_steps, args.train_batch, args.train_anchors, args.train_max_length, out_dir / "tmp")
        print(f"training done ({time.perf_counter() - started:.0f}s)", flush=True)
    import shutil

    shutil.rmtree(out_dir / "tmp", ignore_errors=True)
    result["provenance"] = provenance("cpu")
    result["seconds"] = time.perf_counter() - started  # of this invocation (the parts it measured)
    atomic_write_json(out_dir / "results.json", result)
    text = to_markdown(result)
    atomic_write_text(out_dir / "results.md", text)
    print(text)


if __name__ == "__main__":
    main()
