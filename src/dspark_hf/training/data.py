"""Training data for a drafter: the target answers the prompts itself; anchors are sampled inside its answers.

* `generate_responses`: prompts (chat messages) -> the target's own answers, through its chat template, in batches,
  with recorded sampling settings; resumable (finished prompt ids are skipped on restart), written as JSONL shards
  that are each renamed into place only when complete, with a manifest of the recipe; prompts may come as token ids
  (`prompt_ids`) for a machine without the tokenizer, and `max_seconds` bounds one call's wall time.
* `TokenizedExample`: `input_ids` = prompt + answer, `loss_mask` = 1 on the answer's tokens (EOS included).
* `sample_anchors`: anchor positions p where token p and p+1 are both inside the loss mask; slot k of the block
  anchored at p predicts token p + k + 1 and is supervised while every label up to it is inside the mask
  (cumulative-product mask).
* `build_training_data` (`dspark-hf data`): a prompt file + a target -> `generate_responses` (+ a Markdown summary).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from transformers.utils import logging

from ..provenance import atomic_write_json, atomic_write_text, provenance

__all__ = [
    "DataBuild",
    "GenerationRecipe",
    "TokenizedExample",
    "build_training_data",
    "chat_prompt_ids",
    "data_folders",
    "generate_responses",
    "read_examples",
    "sample_anchors",
    "summarize_data",
]

logger = logging.get_logger(__name__)


@dataclass
class GenerationRecipe:
    """How the target answers the training prompts (recorded in the data manifest)."""

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0
    max_prompt_tokens: int = 512
    shard_size: int = 256
    compress: bool = False  # gzip the shards (data-*.jsonl.gz): about 4x smaller, for committing data at scale


@dataclass
class TokenizedExample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], max_prompt_tokens: int | None = None) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of this target ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; the drafter "
            "must be trained on the same template used at inference. Set tokenizer.chat_template first."
        )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    return ids


def _shard_path(out_dir: Path, index: int, compress: bool = False) -> Path:
    return out_dir / f"data-{index:05d}.jsonl{'.gz' if compress else ''}"


def _shards(data_dir: Path) -> list[Path]:
    """Finished shards, plain or gzipped, in index order (temporary files start with a dot and never match)."""
    return sorted([*data_dir.glob("data-*.jsonl"), *data_dir.glob("data-*.jsonl.gz")],
                  key=lambda p: p.name.split(".")[0])


def _read_shard(shard: Path) -> list[str]:
    if shard.suffix == ".gz":
        import gzip

        return gzip.decompress(shard.read_bytes()).decode("utf-8").splitlines()
    return shard.read_text().splitlines()


def _write_shard(path: Path, examples: list["TokenizedExample"]) -> None:
    text = "\n".join(e.to_json() for e in examples) + "\n"
    if path.suffix == ".gz":
        import gzip

        from ..provenance import atomic_write_bytes

        atomic_write_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    else:
        atomic_write_text(path, text)


def data_folders(data_dir: str | Path | Sequence[str | Path]) -> list[Path]:
    """`data_dir` as a list of folders: one folder, a sequence of folders, or a comma-separated string of them (an
    `@N` cap after a folder, see `data_sources`, is dropped here)."""
    return [folder for folder, _ in data_sources(data_dir)]


def data_sources(data_dir: str | Path | Sequence[str | Path]) -> list[tuple[Path, int | None]]:
    """`data_dir` as (folder, cap) pairs: `data/new,data/old@2000` reads every example of `data/new` and at most
    2,000 of `data/old` (cap None: all)."""
    if isinstance(data_dir, (str, Path)):
        parts = [p.strip() for p in str(data_dir).split(",")] if isinstance(data_dir, str) else [data_dir]
    else:
        parts = list(data_dir)
    sources: list[tuple[Path, int | None]] = []
    for part in (str(p) for p in parts if str(p)):
        folder, at, cap = part.rpartition("@")
        if not at:
            sources.append((Path(part), None))
            continue
        if not cap.isdigit() or int(cap) < 1 or not folder:
            raise ValueError(f"data folder {part!r}: a cap after '@' must be a positive number of examples, "
                             "e.g. data/smollm2-135m-20k@2000")
        sources.append((Path(folder), int(cap)))
    if not sources:
        raise ValueError("no data folder given")
    return sources


def read_examples(data_dir: str | Path | Sequence[str | Path]) -> list[TokenizedExample]:
    """All examples of one or more data folders (finished shards only).

    Several folders (a sequence, or one comma-separated string such as `data/new,data/old`) are read in order; an id
    that two folders both hold is taken from the first that has it, so list the newer answers first (e.g. 256-token
    answers before an older 128-token run over some of the same prompts). A folder written `folder@N` gives at most N
    of its examples: a fixed sample spread over its sources (`trainer.spread_subset` by id), e.g. a new kind of data
    mixed with an equal share of the old; its other ids are still taken as read (no later folder supplies them)."""
    out: list[TokenizedExample] = []
    seen: set[str] = set()
    for folder, cap in data_sources(data_dir):
        shards = _shards(folder)
        if not shards:
            raise FileNotFoundError(f"no data shards (data-*.jsonl[.gz]) in {folder}; run `dspark-hf data` first")
        fresh: list[TokenizedExample] = []
        for shard in shards:
            for line in _read_shard(shard):
                if line.strip():
                    example = TokenizedExample(**json.loads(line))
                    if example.id not in seen:
                        seen.add(example.id)
                        fresh.append(example)
        if cap is not None:
            from .trainer import spread_subset

            fresh = spread_subset(fresh, cap, lambda e: e.id)
        out.extend(fresh)
    return out


def summarize_data(data_dir: str | Path) -> str:
    """One Markdown paragraph on a data folder: answered prompts out of those asked, tokens, answer tokens, the
    recipe, and examples per source family. Reads the manifest and the finished shards only."""
    data_dir = Path(data_dir)
    manifest = data_dir / "manifest.json"
    if not manifest.exists():
        raise FileNotFoundError(f"{data_dir} has no manifest.json; run `dspark-hf data` first")
    m = json.loads(manifest.read_text())
    examples = read_examples(data_dir)
    sources: dict[str, int] = {}
    for ex in examples:
        family = ex.source.split("/")[0] or "?"
        sources[family] = sources.get(family, 0) + 1
    tokens = sum(len(ex.input_ids) for ex in examples)
    answers = sum(sum(ex.loss_mask) for ex in examples)
    recipe = ", ".join(f"{k}={v}" for k, v in m["recipe"].items())
    asked = m.get("num_prompts")
    of = f" (of {asked} prompts)" if asked is not None else ""
    return (f"Data `{data_dir.as_posix()}`: {len(examples)} examples{of}, {tokens} tokens of which {answers} answer "
            f"tokens (the target's own answers; recipe: {recipe}). By source: "
            + ", ".join(f"{k} {v}" for k, v in sorted(sources.items())) + ".")


def _done_ids(out_dir: Path) -> set[str]:
    done = set()
    for shard in _shards(out_dir):
        for line in _read_shard(shard):
            if line.strip():
                done.add(json.loads(line)["id"])
    return done


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


@torch.no_grad()
def generate_responses(
    target,
    tokenizer,
    prompts: Iterable[dict[str, Any]],
    out_dir: str | Path,
    recipe: GenerationRecipe | None = None,
    progress: bool = True,
    max_seconds: float | None = None,
    sort_window: int | None = None,
) -> Path:
    """Lets `target` answer `prompts` ({"id", "messages", "source"?}) and writes tokenized examples to `out_dir`.

    Resumable: ids already present in finished shards are skipped. Each shard is written to a temporary file and
    renamed when complete; the manifest records the recipe, the target and provenance.

    A prompt may carry `prompt_ids` instead of `messages`: token ids already through the chat template (a machine
    without the tokenizer, e.g. a GPU lease, answers prompts tokenized elsewhere); `tokenizer` may then be None, and
    the padding id comes from the target's generation config (its EOS when it has none). `max_seconds` stops
    starting new batches once that much wall time has passed; what was answered is written (the last shard may be
    short) and a re-run resumes with the rest.

    Prompts are answered in batches of similar length (sorted by prompt length); `sort_window=N` sorts only within
    consecutive groups of N prompts, so the order given survives at that scale (a run stopped early has answered a
    prefix of it, not the shortest prompts of the whole file); None sorts them all.
    """
    if sort_window is not None and sort_window < 1:
        raise ValueError(f"sort_window must be >= 1 or None, got {sort_window}")
    began = time.perf_counter()
    recipe = recipe or GenerationRecipe()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(prompts)
    ids = [str(p["id"]) for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("prompt ids must be unique")
    done = _done_ids(out_dir)
    todo = [p for p in prompts if str(p["id"]) not in done]
    shard_index = len(_shards(out_dir))
    atomic_write_json(out_dir / "manifest.json", {
        "recipe": asdict(recipe), "target": getattr(target.config, "_name_or_path", ""),
        "num_prompts": len(prompts), "provenance": provenance(target.device),
    })
    eos_ids = target.generation_config.eos_token_id
    eos_list = [] if eos_ids is None else (list(eos_ids) if isinstance(eos_ids, (list, tuple)) else [eos_ids])
    if tokenizer is not None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    else:
        if any("prompt_ids" not in p for p in todo):
            raise ValueError("generate_responses needs the target's tokenizer for prompts given as `messages`; "
                             "only prompts carrying `prompt_ids` can be answered without one")
        pad_id = target.generation_config.pad_token_id
        pad_id = pad_id if pad_id is not None else (eos_list[0] if eos_list else None)
        if pad_id is None:
            raise ValueError("the target's generation config names neither a pad nor an EOS token id, and no "
                             "tokenizer was given to take the padding id from")

    def ids_of(p: dict[str, Any]) -> list[int]:
        if "prompt_ids" in p:
            ids = [int(t) for t in p["prompt_ids"]]
            if not ids:
                raise ValueError(f"prompt {p['id']!r} has empty prompt_ids")
            return ids[-recipe.max_prompt_tokens:] if recipe.max_prompt_tokens else ids
        return chat_prompt_ids(tokenizer, p["messages"], recipe.max_prompt_tokens)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="target answers", unit="prompt")
    pending: list[TokenizedExample] = []
    # Batches of similar prompt length: a batch is left-padded to its longest prompt, so mixing 30-token chat
    # prompts with 500-token code listings would multiply the prefill cost. Stable sort: ties keep the file order.
    ids_by_id = {str(p["id"]): ids_of(p) for p in todo}  # through the chat template once per prompt
    window = sort_window or max(1, len(todo))
    todo = [p for start in range(0, len(todo), window)
            for p in sorted(todo[start:start + window], key=lambda p: len(ids_by_id[str(p["id"])]))]
    answered = 0
    for batch in _batches(todo, recipe.batch_size):
        if max_seconds is not None and time.perf_counter() - began >= max_seconds:
            logger.warning(f"stopped after {time.perf_counter() - began:.0f} s (max_seconds={max_seconds}): "
                           f"{answered} of {len(todo)} prompts answered in this call, the rest left for a re-run")
            break
        rows = [ids_by_id[str(p["id"])] for p in batch]
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        # Seeded by the batch's first prompt id: a resumed run samples the same answers as an uninterrupted one.
        torch.manual_seed(recipe.seed + zlib.crc32(str(batch[0]["id"]).encode()))
        kwargs = dict(do_sample=recipe.do_sample)
        if recipe.do_sample:
            kwargs.update(temperature=recipe.temperature, top_p=recipe.top_p, top_k=None)
        out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=recipe.max_new_tokens,
                              pad_token_id=pad_id, **kwargs)
        for p, prompt_ids, seq in zip(batch, rows, out[:, width:].tolist()):
            answer = []
            for tok in seq:
                answer.append(tok)
                if tok in eos_list:
                    break
            while answer and answer[-1] == pad_id and pad_id not in eos_list:
                answer.pop()
            pending.append(TokenizedExample(id=str(p["id"]), input_ids=prompt_ids + answer,
                                            loss_mask=[0] * len(prompt_ids) + [1] * len(answer),
                                            source=str(p.get("source", ""))))
        answered += len(batch)
        if bar is not None:
            bar.update(len(batch))
        while len(pending) >= recipe.shard_size:
            _write_shard(_shard_path(out_dir, shard_index, recipe.compress), pending[: recipe.shard_size])
            pending, shard_index = pending[recipe.shard_size:], shard_index + 1
    if pending:
        _write_shard(_shard_path(out_dir, shard_index, recipe.compress), pending)
    if bar is not None:
        bar.close()
    return out_dir


@dataclass
class DataBuild:
    """What `build_training_data` did: the data folder, the broken prompt lines it skipped, and the Markdown summary
    it wrote (None without `report`)."""

    out_dir: Path
    skipped_lines: int = 0
    summary: str | None = None


SPREAD_SORT_BATCHES = 4
"""`build_training_data(order="spread")` sorts prompts by length within groups of this many batches: enough to batch
similar lengths, few enough that a stopped run has answered a sample of every source (before 2026-12-06 the whole
file was sorted, so a run stopped early had answered the shortest prompts: 1,095 boxed-math tasks and 185 function
stubs of data/train_prompts_evalform.jsonl's first 1,280)."""


def build_training_data(
    target: Any,
    prompts: str | os.PathLike,
    out_dir: str | Path,
    recipe: GenerationRecipe | None = None,
    *,
    tokenizer: Any = None,
    limit: int | None = None,
    on_error: str = "skip",
    report: str | Path | None = None,
    progress: bool = True,
    prepack: bool = False,
    max_seconds: float | None = None,
    order: str = "file",
) -> DataBuild:
    """`dspark-hf data`: the target answers the prompts of a JSONL file (`generate_responses`, resumable).

    Args:
        target: the target model (with `tokenizer`), or its registry name / folder (loaded with `load_target`).
        prompts: JSONL with `messages` (or `prompt`) per line; broken lines are skipped with a warning
            (`on_error="skip"`) or raise (`"raise"`), see `read_prompts_jsonl`.
        limit: answer only the first `limit` prompts (in `order`).
        report: also write a Markdown summary of the data folder (`summarize_data`) to this file.
        prepack: run a CPU target (float32/bfloat16) with its linear weights packed once for oneDNN
            (`models.prepacked.prepack_linears`; PyTorch's own CPU GEMM repacks them on every batched call). Skipped,
            with a log line, where the target or the PyTorch build cannot; the model is restored afterwards.
        max_seconds: stop starting new batches after this much wall time (a re-run resumes with the rest).
        order: `"file"` answers the prompts in file order (batches of similar length drawn from the whole file);
            `"spread"` in the order of a crc32 of their ids (`trainer.spread_ranks`), length-sorted only within
            groups of `SPREAD_SORT_BATCHES` batches, so that the part answered when a run stops (`max_seconds`, a
            session's end) is a sample spread over every source of a source-sorted file, and `limit` takes such a
            sample.
    """
    from .prompts import read_prompts_jsonl

    if order not in ("file", "spread"):
        raise ValueError(f"prompt order must be 'file' or 'spread', got {order!r}")

    rows, skipped = read_prompts_jsonl(prompts, on_error=on_error)
    if skipped:
        logger.warning(f"skipped {skipped} broken line(s) of {prompts}")
    if order == "spread":
        from .trainer import spread_ranks

        rows = [rows[i] for i in spread_ranks(rows, lambda p: p["id"])]
    rows = rows[:limit] if limit else rows
    if isinstance(target, (str, os.PathLike)):
        from ..testbed.targets import load_target

        target, loaded_tokenizer = load_target(target)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    if tokenizer is None:
        raise ValueError("build_training_data needs the target's tokenizer when given a target model")
    packed = 0
    if prepack:
        from ..models.prepacked import prepack_linears, unpack_linears

        try:
            packed = prepack_linears(target)
        except ValueError as err:
            logger.info(f"answering without prepacked linears: {err}")
    try:
        window = (recipe or GenerationRecipe()).batch_size * SPREAD_SORT_BATCHES if order == "spread" else None
        out = Path(generate_responses(target, tokenizer, rows, out_dir, recipe, progress=progress,
                                     max_seconds=max_seconds, sort_window=window))
    finally:
        if packed:
            unpack_linears(target)
    summary = None
    if report is not None:
        summary = summarize_data(out)
        atomic_write_text(Path(report), f"# Training data\n\n{summary}\n")
    return DataBuild(out, skipped, summary)


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors for one sequence.

    Args:
        loss_mask: `[T]` 1 on supervised (answer) tokens.
        num_anchors: at most this many anchors (fewer if the sequence has fewer valid positions).
        block_size: K.
    Returns:
        anchors `[A]` (sorted positions p) and `label_mask` `[A, K]`: slot k (predicting token p + k + 1) is
        supervised iff tokens p + 1 .. p + k + 1 all lie inside the mask and the sequence.
    """
    mask = loss_mask.bool()
    t = mask.shape[0]
    valid = torch.zeros(t, dtype=torch.bool)
    if t >= 2:
        valid[:-1] = mask[:-1] & mask[1:]
    candidates = valid.nonzero().flatten()
    if len(candidates) > num_anchors:
        pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
        candidates = candidates[pick].sort().values
    positions = candidates[:, None] + 1 + torch.arange(block_size)[None, :]  # labels' positions [A, K]
    inside = positions < t
    label_in_mask = torch.zeros_like(inside)
    label_in_mask[inside] = mask[positions[inside]]
    return candidates, label_in_mask.long().cumprod(dim=1).bool()
