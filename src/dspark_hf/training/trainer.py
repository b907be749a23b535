"""`DSparkTrainer`: trains a drafter on target-regenerated data (paper 3.3), on accelerate.

* CPU or one GPU by default; DDP through `accelerate launch -m dspark_hf.cli train ...` (each process takes its slice
  of every global batch of `batch_size * num_processes` sequences; gradients are averaged across processes). On CPUs
  start the processes with `accelerate launch --multi_gpu --num_processes N` (torchrun; with no GPU the trainer runs
  on gloo): `accelerate launch --cpu --num_processes N` starts ONE process unless an mpirun hostfile is given.
  fp32 or bf16 autocast; gradient accumulation; linear warmup then cosine decay; gradient clipping. Only the
  drafter's own parameters train: the target, its embedding and LM head stay frozen.
* Deterministic data: the example order of epoch e is a permutation seeded by (seed, e) and the anchors of the
  sequence at position j of global micro-batch g are sampled with a generator seeded by (seed, g, j), so a run on N
  processes sees the same examples and anchors as a one-process run with an N times larger `batch_size`. The
  checkpoint needs the weights, the optimizer and scheduler states and the step to resume exactly (the processes'
  RNG states are stored too, for anything that draws from the global generators).
* Only the main process writes (checkpoints, `log.jsonl`, `training_config.json`, `final/`); the logged metrics are
  the mean over processes (`supervised_slots`: the sum).
* Checkpoints `output_dir/checkpoint-XXXXXX/` are written to a temporary folder and renamed. They hold no pickle:
  a loadable drafter folder (`config.json`, `model.safetensors`) plus `trainer_state.json` (format name and
  version, step, config, world size, the optimizer's hyper-parameters and scalars, the scheduler state, the Python
  and numpy RNG states of every process) and `trainer_state.safetensors` (the optimizer's tensors and the torch RNG
  states, under structured keys such as `optimizer/state/3/exp_avg` that the JSON refers to). Loading reads JSON and
  safetensors only; an older `trainer_state.pt` checkpoint is refused (see `load_checkpoint`).
  `output_dir/final/` holds the finished drafter; `output_dir/log.jsonl` every loss term, accept_rate@k and the
  expected accepted length from c*.
* The held-out split is a fixed hash of the example id, so it never changes between runs.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import zlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers.utils import logging

from ..models.configuration_dspark import DSparkConfig
from .data import TokenizedExample, read_examples, sample_anchors
from .features import FeatureBatch, FeatureCache, OnlineFeatures, build_feature_cache
from .losses import LossOutput, LossWeights, dspark_loss
from .teacher import TeacherNormalizer, TeacherTopK, draft_vocab_hash
from ..decoding.sps import target_fingerprint
from ..models.modeling_dspark import DSparkDrafter
from ..provenance import atomic_write_json, atomic_write_text, cpu_has_native_bf16, provenance
from .config import DSparkTrainingConfig

__all__ = ["DSparkTrainer", "build_drafter", "build_lr_scheduler", "heldout_prompt_ids", "heldout_tau",
           "init_layers_from_target", "wsd_decay_start", "is_heldout", "split_examples", "subset_examples", "train_from_config",
           "trainer_from_config", "read_trainer_state", "write_trainer_state", "STATE_FORMAT", "STATE_VERSION"]

logger = logging.get_logger(__name__)

# ---------------------------------------------------------------------------------------------- pickle-free state
STATE_FORMAT = "dspark-trainer-state"
STATE_VERSION = 1
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"
_MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")


def _encode(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able copy of `obj` (nested dicts / lists / tuples of tensors, numpy arrays and JSON scalars): each tensor
    goes to `tensors[key]` and is replaced by `{"__tensor__": key}`; tuples, dicts with non-string keys and numpy
    arrays get their own one-key markers so that decoding restores the exact types."""
    def sub(part: Any) -> str:
        return f"{key}/{part}" if key else str(part)

    if isinstance(obj, torch.Tensor):
        if key in tensors:
            raise ValueError(f"two tensors would be stored under the key {key!r}")
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, sub(i), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, sub(i), tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: _encode(v, sub(k), tensors) for k, v in obj.items()}
        for k in obj:
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"cannot store a dict key of type {type(k).__name__} at {key!r} in a checkpoint")
        return {"__items__": [[k, _encode(v, sub(k), tensors)] for k, v in obj.items()]}
    if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"cannot store a numpy array of dtype {obj.dtype} at {key!r} in a checkpoint")
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if hasattr(obj, "item") and type(obj).__module__ == "numpy":  # numpy scalars
        return obj.item()
    raise TypeError(f"cannot store a {type(obj).__name__} at {key!r} in a checkpoint (JSON / safetensors only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], used: set[str], where: str) -> Any:
    """The inverse of `_encode`; every referenced tensor must exist. Raises ValueError naming `where` otherwise."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, tensors, used, where) for v in obj]
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: unexpected JSON value {obj!r}")
    if not set(obj) & set(_MARKERS):
        return {k: _decode(v, tensors, used, where) for k, v in obj.items()}
    marker = next(iter(obj))
    if marker == "__tensor__" and len(obj) == 1:
        key = obj["__tensor__"]
        if not isinstance(key, str) or key not in tensors:
            raise ValueError(f"{where}: the tensor {key!r} it refers to is missing from {STATE_TENSORS}; the "
                             "checkpoint is damaged or was edited")
        used.add(key)
        return tensors[key]
    if marker == "__tuple__" and len(obj) == 1:
        if not isinstance(obj["__tuple__"], list):
            raise ValueError(f"{where}: malformed tuple {obj!r}")
        return tuple(_decode(v, tensors, used, where) for v in obj["__tuple__"])
    if marker == "__items__" and len(obj) == 1:
        items = obj["__items__"]
        if not isinstance(items, list) or not all(
                isinstance(i, list) and len(i) == 2 and (i[0] is None or isinstance(i[0], (bool, int, float, str)))
                for i in items):
            raise ValueError(f"{where}: malformed mapping {str(obj)[:200]}")
        return {k: _decode(v, tensors, used, where) for k, v in items}
    if marker == "__ndarray__" and set(obj) == {"__ndarray__", "dtype"}:
        import numpy as np

        dtype = np.dtype(str(obj["dtype"]))
        if dtype.kind not in "biuf":
            raise ValueError(f"{where}: numpy dtype {obj['dtype']!r} is not numeric")
        return np.asarray(obj["__ndarray__"], dtype=dtype)
    raise ValueError(f"{where}: malformed entry {str(obj)[:200]}; the checkpoint is damaged or was edited")


def _rng_state() -> dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with transformers
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    """`state` as `trainer_state.json` + `trainer_state.safetensors` in `folder` (no pickle anywhere)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, "", tensors)
    save_file(tensors, str(folder / STATE_TENSORS), metadata={"format": STATE_FORMAT, "version": str(STATE_VERSION)})
    (folder / STATE_JSON).write_text(json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, **encoded},
                                                indent=1) + "\n")


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """Reads what `write_trainer_state` wrote, with JSON and safetensors only; a clear ValueError on anything else."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / LEGACY_STATE).exists():
        raise ValueError(
            f"{folder} is a checkpoint of an older dspark_hf in the pickle format ({LEGACY_STATE}), which is no longer "
            "loaded because unpickling can run arbitrary code. To proceed: start a new run (resume=False, or a new "
            f"output_dir, or move {folder.name} out of {folder.parent}); to keep its weights, pass the folder as "
            f"init_from={folder} (its model.safetensors is a loadable drafter; the optimizer state is not kept).")
    json_path, tensor_path = folder / STATE_JSON, folder / STATE_TENSORS
    for path in (json_path, tensor_path):
        if not path.is_file():
            raise ValueError(f"{folder} is not a complete checkpoint: {path.name} is missing")
    try:
        raw = json.loads(json_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{json_path} is not valid JSON ({err}); the checkpoint is damaged or was edited") from err
    if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
        raise ValueError(f"{json_path} is not a {STATE_FORMAT} file (format {raw.get('format') if isinstance(raw, dict) else None!r})")
    if raw.get("version") != STATE_VERSION:
        raise ValueError(f"{json_path} has format version {raw.get('version')!r}; this dspark_hf reads version "
                         f"{STATE_VERSION}")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{tensor_path} is not a readable safetensors file ({err})") from err
    used: set[str] = set()
    state = _decode({k: v for k, v in raw.items() if k not in ("format", "version")}, tensors, used, str(json_path))
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"{tensor_path} holds tensors that {STATE_JSON} does not refer to ({unused[:5]}); the "
                         "checkpoint is damaged or was edited")
    for name in ("step", "optimizer", "scheduler", "rng"):
        if name not in state:
            raise ValueError(f"{json_path} has no {name!r} entry; the checkpoint is damaged or was edited")
    if not isinstance(state["step"], int) or state["step"] < 0:
        raise ValueError(f"{json_path}: step must be a non-negative integer, got {state['step']!r}")
    return state


def is_heldout(example_id: str, fraction: float) -> bool:
    """A fixed, id-based split: the same examples are held out in every run."""
    return fraction > 0 and (zlib.crc32(example_id.encode()) % 10_000) < fraction * 10_000


def split_examples(examples: Sequence[TokenizedExample], fraction: float):
    train = [e for e in examples if not is_heldout(e.id, fraction)]
    heldout = [e for e in examples if is_heldout(e.id, fraction)]
    return train, heldout


def spread_subset(items: Sequence[Any], count: int | None, id_of: Callable[[Any], str]) -> list[Any]:
    """At most `count` of `items`: those whose ids (`id_of(item)`) hash lowest (crc32, ties broken by id), kept in
    their order.

    The subset is fixed by the ids alone, so it is the same in every run and spread over every source even when the
    items are ordered by source (prompt files and the data are: the first 24 of `data/heldout_prompts.jsonl` are 16
    chatterbot dialogs); growing `count` only adds items."""
    if count is None or count >= len(items):
        return list(items)
    keep = set(spread_ranks(items, id_of)[:count])
    return [e for i, e in enumerate(items) if i in keep]


def spread_ranks(items: Sequence[Any], id_of: Callable[[Any], str]) -> list[int]:
    """Indices of `items` ranked by a crc32 of their ids (ties broken by id): any prefix of the ranking is a sample
    spread over every source, fixed by the ids alone (`spread_subset` keeps the first `count`)."""
    return sorted(range(len(items)), key=lambda i: (zlib.crc32(str(id_of(items[i])).encode()), str(id_of(items[i]))))


def subset_examples(examples: Sequence[TokenizedExample], count: int | None) -> list[TokenizedExample]:
    """At most `count` of `examples`, spread over every source (`spread_subset` by example id), in data order."""
    return spread_subset(examples, count, lambda e: e.id)


def ordered_subset(items: Sequence[Any], count: int, order: str, id_of: Callable[[Any], str]) -> list[Any]:
    """`count` of `items` for a held-out evaluation: `order="spread"` over their sources (`spread_subset`), `"file"`
    the first `count` (how held-out tau was measured before 2026-12-06: on the source-sorted held-out file mostly
    chatterbot dialogs, the hardest source)."""
    if order not in ("spread", "file"):
        raise ValueError(f"held-out prompt order must be 'spread' or 'file', got {order!r}")
    return spread_subset(items, count, id_of) if order == "spread" else list(items[:count])


def eval_prompts(prompts: Sequence[dict[str, Any]], count: int, order: str = "spread") -> list[dict[str, Any]]:
    """The `count` prompts a held-out evaluation decodes (`ordered_subset` by prompt id; rows without one by line)."""
    indexed = list(enumerate(prompts))
    return [p for _, p in ordered_subset(indexed, count, order, lambda ip: ip[1].get("id") or f"line{ip[0]}")]


def build_drafter(config: DSparkTrainingConfig, target, examples: Sequence[TokenizedExample] | None = None) -> DSparkDrafter:
    """A drafter for `target` as the training config describes (or loaded from `init_from`). With
    `config.draft_vocab_size`, its reduced draft vocabulary is chosen from the answer-token frequencies of `examples`
    (the training split), EOS ids always included."""
    if config.init_from:
        drafter = DSparkDrafter.from_pretrained(config.init_from, target=target)
        wanted = config.draft_vocab_size
        if wanted is not None and wanted >= drafter.config.vocab_size:
            wanted = None  # the full vocabulary
        if config.draft_vocab_size is not None and drafter.config.draft_vocab_size != wanted:
            raise ValueError(f"init_from={config.init_from} has draft_vocab_size={drafter.config.draft_vocab_size}, "
                             f"the training config asks for {config.draft_vocab_size}")
        return drafter
    overrides = dict(
        block_size=config.block_size, num_hidden_layers=config.num_hidden_layers,
        sequential_head=config.sequential_head, markov_rank=config.markov_rank,
        confidence_head=config.confidence_head, loss_decay=config.loss_decay,
        draft_candidates=config.draft_candidates,
    )
    if config.intermediate_size:
        overrides["intermediate_size"] = config.intermediate_size
    if config.target_layer_ids:
        overrides["target_layer_ids"] = list(config.target_layer_ids)
    draft_vocab = None
    vocab = int(target.config.get_text_config().vocab_size)
    if config.draft_vocab_size is not None and config.draft_vocab_size < vocab:  # >= V: the full vocabulary
        if not examples:
            raise ValueError("draft_vocab_size is set: build_drafter needs the training examples to choose the vocabulary")
        from .vocab import build_draft_vocab

        eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
        draft_vocab = build_draft_vocab(examples, config.draft_vocab_size, always_include=eos, vocab_size=vocab)
    drafter = DSparkDrafter.from_target(target, draft_vocab=draft_vocab, **overrides)
    if config.init_layers_from_target:
        init_layers_from_target(drafter, target, config.init_layers_from_target)
    return drafter.float() if config.mixed_precision == "no" else drafter


def init_layers_from_target(drafter: DSparkDrafter, target, layer_ids: Sequence[int]) -> dict[int, list[str]]:
    """Copies the target's decoder layer `layer_ids[i]` into draft layer i: every parameter whose name and shape
    match (attention projections, MLP, the two norms; Qwen3-style q/k norms when the target has them). The draft
    layer's own extras (e.g. q/k norms a Llama target lacks) keep their initialisation. Returns, per draft layer,
    the names copied. A target layer id out of range, or a list longer than the drafter's layers, is an error."""
    layers = _decoder_layers(target)
    if len(layer_ids) > len(drafter.layers):
        raise ValueError(f"init_layers_from_target lists {len(layer_ids)} layers, the drafter has {len(drafter.layers)}")
    copied: dict[int, list[str]] = {}
    with torch.no_grad():
        for i, lid in enumerate(layer_ids):
            if not -len(layers) <= lid < len(layers):
                raise ValueError(f"init_layers_from_target: target layer {lid} out of range (the target has "
                                 f"{len(layers)} layers)")
            source = dict(layers[lid].named_parameters())
            names = []
            for name, param in drafter.layers[i].named_parameters():
                src = source.get(name)
                if src is not None and src.shape == param.shape:
                    param.copy_(src.to(param.dtype))
                    names.append(name)
            if not names:
                raise ValueError(f"init_layers_from_target: no parameter of target layer {lid} fits draft layer {i}")
            copied[i] = names
    return copied


def _decoder_layers(target) -> Sequence[torch.nn.Module]:
    base = getattr(target, "base_model", target)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} exposes no decoder layers (base_model.layers)")
    return layers


def wsd_decay_start(config: DSparkTrainingConfig, max_steps: int | None = None) -> int:
    """The step at which a wsd schedule over `max_steps` (default `config.max_steps`) starts decaying."""
    total = config.max_steps if max_steps is None else max_steps
    return total - max(1, round(config.decay_fraction * total))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: DSparkTrainingConfig, last_step: int = 0):
    """Linear warmup over `warmup_steps`, then `config.lr_schedule`: "cosine" (transformers' cosine decay to 0 at
    `max_steps`), "wsd" (constant peak, then a linear decay over the last `decay_fraction` of `max_steps` down to
    `min_lr_ratio`) or "constant". The multiplier depends on the step and the config only, so a resumed run with a
    larger `max_steps` continues a wsd schedule in its stable phase. `last_step` > 0: a schedule that has already
    taken that many steps (the optimizer's learning rates are set for the next one), for a re-planned run."""
    previous = last_step - 1 if last_step > 0 else -1
    if config.lr_schedule == "cosine":
        from transformers import get_cosine_schedule_with_warmup

        return get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps, last_epoch=previous)
    warmup, total = config.warmup_steps, config.max_steps
    decay_start = wsd_decay_start(config)

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if config.lr_schedule == "constant" or step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return 1.0 - (1.0 - config.min_lr_ratio) * progress

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier, last_epoch=previous)


class DSparkTrainer:
    """Trains `drafter` on `examples` against `target` (see module docstring)."""

    def __init__(self, config: DSparkTrainingConfig, target, examples: Sequence[TokenizedExample],
                 drafter: DSparkDrafter | None = None, accelerator=None, progress: bool = True,
                 eval_prompt_ids: Sequence[Sequence[int]] | None = None) -> None:
        from accelerate import Accelerator

        self.config = config
        self.accelerator = accelerator or Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available(),
        )
        if config.mixed_precision == "bf16" and self.accelerator.device.type == "cpu" and cpu_has_native_bf16() is False:
            logger.warning("mixed_precision='bf16' on a CPU without AVX-512 BF16 or AMX: every bf16 product is "
                           "converted to fp32 and back (a SmolLM2-135M forward took 5.6-7.2x as long as in fp32 on an "
                           "AVX2-only EPYC); mixed_precision=no is usually faster here")
        self.target = target.eval().requires_grad_(False)
        self.train_examples, self.heldout = split_examples(examples, config.heldout_fraction)
        self.train_examples = subset_examples(self.train_examples, config.max_examples)
        if not self.train_examples:
            raise ValueError("no training examples left after the held-out split")
        self.drafter = drafter if drafter is not None else build_drafter(config, target, self.train_examples)
        self.drafter.check_target(target)
        self.progress = progress
        self.output_dir = Path(config.output_dir)
        self.weights = LossWeights(ce=config.alpha_ce, tv=config.alpha_tv, conf=config.alpha_conf,
                                   decay=self.drafter.config.effective_loss_decay)
        layer_ids = self.drafter.config.target_layer_ids
        if config.feature_cache:
            with self.accelerator.autocast():  # bf16 mixed precision also speeds up the one pass of the target
                build_feature_cache(target, self.train_examples, config.feature_cache, layer_ids,
                                    max_length=config.max_length, dtype=getattr(torch, config.feature_cache_dtype),
                                    progress=progress)
            self.features = FeatureCache(config.feature_cache, target, layer_ids, max_shards_in_memory=None)
        else:
            self.features = OnlineFeatures(target, layer_ids)
        self.teacher: TeacherNormalizer | None = None
        if self.drafter.d2t is not None and config.cache_teacher_normalizer:
            drafter_ = self.drafter
            self.teacher = TeacherNormalizer(
                lambda h: drafter_.lm_head(h.to(drafter_.dtype)),
                folder=Path(config.feature_cache) / "teacher-lse" if config.feature_cache else None,
                fingerprint=target_fingerprint(target))
        self.teacher_topk: TeacherTopK | None = None
        if config.teacher_topk is not None and self.teacher is None:
            raise ValueError("teacher_topk needs a drafter with a reduced draft vocabulary (its d2t) and the cached "
                             "teacher normalizer; this drafter has neither (a full-vocabulary init_from?)")
        if config.teacher_topk is not None and self.teacher is not None:
            drafter_, k_top, d2t = self.drafter, config.teacher_topk, self.drafter.d2t
            self.teacher_topk = TeacherTopK(
                lambda h: drafter_.draft_lm_head(h.to(drafter_.dtype)), k_top, d2t,
                folder=(Path(config.feature_cache) / f"teacher-topk{k_top}-{draft_vocab_hash(d2t)[:12]}"
                        if config.feature_cache else None),
                fingerprint=target_fingerprint(target))
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        self.scheduler = build_lr_scheduler(self.optimizer, config)
        # The scheduler is stepped here once per optimizer step, not through accelerate: its prepared scheduler steps
        # `num_processes` times per optimizer step (it assumes a dataloader that shrinks with the world size), which
        # would run the schedule N times too fast on N processes since `max_steps` counts optimizer steps.
        self.model, self.optimizer = self.accelerator.prepare(self.drafter, self.optimizer)
        self.step = 0
        self.train_seconds = 0.0  # optimizer-step wall time over all sessions (restored on resume; eval excluded)
        # the same steps' CPU time of this process (all its threads): unlike wall time it does not grow when other
        # jobs share the cores, so runs made under different loads compare; None once resumed from a checkpoint
        # written before it was kept
        self.train_cpu_seconds: float | None = 0.0
        self.eval_prompt_ids = ([list(p) for p in eval_prompt_ids] if eval_prompt_ids is not None
                                else heldout_prompt_ids(self.heldout, config.eval_num_prompts,
                                                         config.eval_prompt_order))

    # ------------------------------------------------------------------ data
    def micro_batch(self, index: int) -> list[TokenizedExample]:
        """The examples of global micro-batch `index` for this process (deterministic)."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per = self.config.batch_size * world
        n = len(self.train_examples)
        out = []
        for j in range(per * index, per * (index + 1)):
            epoch, pos = divmod(j, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 100_003 + epoch))
            out.append(self.train_examples[int(perm[pos])])
        return out[rank::world]

    def blocks(self, feats: FeatureBatch, index: int) -> dict[str, torch.Tensor]:
        """Samples anchors per sequence and gathers their labels: anchor ids/positions `[B, A]`, valid `[B, A]`,
        labels and label mask `[B, A, K]`."""
        k = self.drafter.config.block_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_seq = []
        for i in range(feats.input_ids.shape[0]):
            length = int(feats.attention_mask[i].sum())
            # seeded by the sequence's position in the global micro-batch (see micro_batch), not by the process: the
            # same anchors whatever the number of processes
            slot = rank + i * world
            gen = torch.Generator().manual_seed(((self.config.seed * 1_000_003 + index) * 1_000_033 + slot) % 2**63)
            per_seq.append(sample_anchors(feats.loss_mask[i, :length], self.config.num_anchors, k, gen))
        a = max(1, max(len(p[0]) for p in per_seq))
        b = len(per_seq)
        pos = torch.zeros(b, a, dtype=torch.long)
        valid = torch.zeros(b, a, dtype=torch.bool)
        label_mask = torch.zeros(b, a, k, dtype=torch.bool)
        for i, (anchors, lm) in enumerate(per_seq):
            pos[i, : len(anchors)] = anchors
            valid[i, : len(anchors)] = True
            label_mask[i, : len(anchors)] = lm
        t = feats.input_ids.shape[1]
        label_pos = (pos[..., None] + 1 + torch.arange(k)).clamp(max=t - 1)
        labels = feats.input_ids.gather(1, label_pos.reshape(b, -1)).reshape(b, a, k)
        anchor_ids = feats.input_ids.gather(1, pos)
        return {"anchor_ids": anchor_ids, "anchor_pos": pos, "valid": valid, "labels": labels,
                "label_mask": label_mask & valid[..., None]}

    # ------------------------------------------------------------------ step
    def compute_loss(self, examples: Sequence[TokenizedExample], index: int) -> LossOutput:
        feats = self.features(examples, self.config.max_length)
        blk = self.blocks(feats, index)
        device = self.accelerator.device
        drafter = self.accelerator.unwrap_model(self.model)
        k = drafter.config.block_size
        out = self.model(blk["anchor_ids"].to(device), blk["anchor_pos"].to(device), feats.context.to(device),
                         context_mask=feats.attention_mask.bool().to(device), return_logits=False)
        sel = blk["valid"].to(device)
        hidden = out.hidden_states[sel]  # [N, K, d]
        labels = blk["labels"].to(device)[sel]
        mask = blk["label_mask"].to(device)[sel]
        anchors = blk["anchor_ids"].to(device)[sel]
        logits = drafter.draft_lm_head(hidden).float()  # [N, K, Vd]: the draft vocabulary's rows only
        prev = torch.cat([anchors[:, None], labels[:, :-1]], dim=1)  # teacher forcing: [anchor, ground truth]
        features = None
        if drafter.markov_head is not None:
            bias, features = drafter.markov_head.teacher_forced(drafter.to_draft_inputs(prev), hidden)
            logits = logits.add_(bias.float())  # in place: no second [N, K, Vd] tensor (the product's backward needs
            # its inputs, not its output, so autograd allows it; the same values as an out-of-place add)
        conf_hidden, conf_features = hidden, features
        if self.config.detach_confidence_inputs:  # the BCE fits the head only, the drafts see none of it
            conf_hidden, conf_features = hidden.detach(), None if features is None else features.detach()
        conf_logits = (drafter.confidence_head(conf_hidden, conf_features)
                       if drafter.confidence_head is not None else None)
        with torch.no_grad():
            b_idx = sel.nonzero()[:, 0]
            t = feats.final_hidden.shape[1]
            tpos = (blk["anchor_pos"].to(device)[sel][:, None] + torch.arange(k, device=device)).clamp(max=t - 1)
            final_all = feats.final_hidden.to(device)
            target_lse, target_topk = None, None
            if self.teacher is not None:  # the draft rows and the cached full-vocabulary normalizer: exact, cheaper
                lse_all = self.teacher(examples, final_all, feats.attention_mask, feats.loss_mask)
                target_lse = lse_all[b_idx[:, None], tpos]
                missing = torch.isnan(target_lse)  # positions outside the answers: only unsupervised slots
                if bool((missing & mask).any()):
                    raise RuntimeError("a supervised slot predicts from a position without a teacher normalizer "
                                       "(outside the loss mask); this is a bug in anchor sampling")
                if self.teacher_topk is not None:  # the sparse teacher: no product with the LM head this step
                    top_ids, top_logp = self.teacher_topk(examples, final_all, feats.attention_mask,
                                                          feats.loss_mask, lse_all)
                    target_topk = (top_ids[b_idx[:, None], tpos], top_logp[b_idx[:, None], tpos])
                    target_logits, target_lse = None, None
                else:
                    final = final_all[b_idx[:, None], tpos]  # [N, K, d]: predicts the label at p+k+1
                    target_logits = drafter.draft_lm_head(final.to(drafter.dtype)).float()
                    target_lse = torch.where(missing, torch.logsumexp(target_logits, dim=-1), target_lse)  # finite
            else:
                final = final_all[b_idx[:, None], tpos]
                target_logits = drafter.lm_head(final.to(drafter.dtype)).float()  # full vocabulary: the outside mass
        return dspark_loss(logits, target_logits, labels, mask, conf_logits, self.weights, draft_vocab=drafter.d2t,
                           target_lse=target_lse, target_topk=target_topk)

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[Path]:
        return sorted(self.output_dir.glob("checkpoint-[0-9]*"))

    def save_checkpoint(self) -> Path:
        """Writes `checkpoint-{step}` (see the module docstring for its files). Every process must call it: the
        processes' RNG states are gathered to the main process, which alone writes."""
        from accelerate.utils import gather_object

        final = self.output_dir / f"checkpoint-{self.step:06d}"
        rng = gather_object([_rng_state()])  # collective: one entry per process, in rank order
        for store in (self.teacher, self.teacher_topk):  # every process keeps what it computed (its own file names)
            if store is not None:
                store.save(tag=f"r{self.accelerator.process_index}")
        if not self.accelerator.is_main_process:
            return final
        tmp = self.output_dir / f".tmp-checkpoint-{self.step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        drafter = self.accelerator.unwrap_model(self.model)
        drafter.save_pretrained(tmp, model_card=False)  # a resumable checkpoint: the final drafter gets the card
        write_trainer_state(tmp, {
            "step": self.step, "num_processes": self.accelerator.num_processes, "config": asdict(self.config),
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": list(rng),
            "train_seconds": self.train_seconds, "train_cpu_seconds": self.train_cpu_seconds,
        })
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Restores weights, optimizer, scheduler, step and this process's RNG state from `path` (JSON and
        safetensors only: nothing is unpickled). A damaged, edited or old-format checkpoint raises ValueError."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        state = read_trainer_state(path)
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"{path} is not a complete checkpoint: model.safetensors is missing")
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{weights} is not a readable safetensors file ({err})") from err
        drafter = self.accelerator.unwrap_model(self.model)
        try:
            drafter.load_state_dict(tensors, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{weights} does not fit this drafter: {err}") from err
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        opt = state["optimizer"]
        if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
            raise ValueError(f"{path / STATE_JSON}: the optimizer entry is malformed")
        for pid, entry in opt["state"].items():
            if not isinstance(pid, int) or not 0 <= pid < len(params) or not isinstance(entry, dict):
                raise ValueError(f"{path / STATE_JSON}: optimizer state for unknown parameter {pid!r}")
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                    raise ValueError(f"{path / STATE_TENSORS}: optimizer/state/{pid}/{name} has shape "
                                     f"{tuple(value.shape)}, the parameter {tuple(params[pid].shape)}")
        try:
            self.optimizer.load_state_dict(opt)
            self.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path / STATE_JSON}: the optimizer / scheduler state does not fit this run: {err}") from err
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        saved_world = state.get("num_processes")
        if saved_world != world:
            logger.warning(f"{path} was written by {saved_world} process(es), this run has {world}: the global batch "
                           "changes, so the resumed run is not identical to an uninterrupted one")
        if isinstance(state["rng"], list) and rank < len(state["rng"]):
            try:
                _set_rng_state(state["rng"][rank])
            except (KeyError, TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"{path / STATE_JSON}: the RNG state of process {rank} is malformed: {err}") from err
        self.step = state["step"]
        self.train_seconds = float(state.get("train_seconds", 0.0))
        cpu = state.get("train_cpu_seconds")
        self.train_cpu_seconds = float(cpu) if cpu is not None else (0.0 if self.step == 0 else None)
        logger.info(f"resumed from {path} at step {self.step}")

    def _drop_records_after(self, step: int) -> None:
        """Removes the `log.jsonl` / `heldout.jsonl` records of steps after `step` (the checkpoint resumed from):
        a run stopped between checkpoints logged steps it now trains again, and its log must describe the weights
        it ends with, one record per step. Rewritten atomically."""
        for name in ("log.jsonl", "heldout.jsonl"):
            path = self.output_dir / name
            if not path.exists():
                continue
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if int(json.loads(line).get("step", 0)) <= step]
            if len(kept) != len(lines):
                atomic_write_text(path, "".join(line + "\n" for line in kept))
                logger.info(f"{path}: dropped {len(lines) - len(kept)} record(s) after step {step}, trained again")

    # ------------------------------------------------------------------ loop
    def train(self) -> Path:
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume and self.checkpoints():
            self.load_checkpoint(self.checkpoints()[-1])
            if self.accelerator.is_main_process:
                self._drop_records_after(self.step)
        if self.accelerator.is_main_process:
            atomic_write_json(self.output_dir / "training_config.json",
                              {"config": asdict(cfg), "provenance": provenance(self.accelerator.device),
                               "num_processes": self.accelerator.num_processes,
                               "train_examples": len(self.train_examples), "heldout_examples": len(self.heldout)})
        self._begin_session()
        end = self._end_step()
        bar = None
        if self.progress and self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=end, initial=self.step, desc="training drafter", unit="step")
        self.model.train()
        log_path = self.output_dir / "log.jsonl"
        while self.step < end:
            step_start, cpu_start = time.perf_counter(), time.process_time()
            for micro in range(cfg.gradient_accumulation_steps):
                index = self.step * cfg.gradient_accumulation_steps + micro
                with self.accelerator.accumulate(self.model), self.accelerator.autocast():
                    out = self.compute_loss(self.micro_batch(index), index)
                    self.accelerator.backward(out.total)
                    if self.accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()  # (the prepared optimizer only steps when gradients are synced)
                    if self.accelerator.sync_gradients:
                        self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.train_seconds += time.perf_counter() - step_start
            if self.train_cpu_seconds is not None:
                self.train_cpu_seconds += time.process_time() - cpu_start
            metrics = self.reduced_metrics(out)  # every process takes part, so all of them stop together on NaN
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"loss became {metrics['loss']} at step {self.step}; lower the learning rate")
            if self.step % cfg.log_every == 0 or self.step == end:
                record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], "train_seconds": self.train_seconds,
                          **self._cpu_record(), **metrics}
                if self.accelerator.is_main_process:
                    with open(log_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}")
            if bar is not None:
                bar.update(1)
            if cfg.time_budget_seconds is not None:
                end = self._follow_budget(end)
                if bar is not None and bar.total != end:
                    bar.total = end
                    bar.refresh()
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == end):
                began = time.perf_counter()
                self.evaluate_heldout()
                self._last_eval_seconds = time.perf_counter() - began
            if self.step % cfg.save_every == 0 or self.step == end:
                began = time.perf_counter()
                self.accelerator.wait_for_everyone()
                self.save_checkpoint()
                self._last_save_seconds = time.perf_counter() - began
        if bar is not None:
            bar.close()
        final = self.output_dir / "final"
        if self.accelerator.is_main_process:
            tmp = self.output_dir / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            self.accelerator.unwrap_model(self.model).save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        self.accelerator.wait_for_everyone()  # `final` exists for every process once train() returns
        return final

    # ------------------------------------------------------------------ time budget
    def _begin_session(self) -> None:
        self._session_start = time.perf_counter()
        self._session_first_step = self.step
        self._step_limit = self.config.max_steps  # the user's max_steps: a re-planned run never goes past it
        self._last_eval_seconds = 0.0
        self._last_save_seconds = 0.0
        self._next_replan = self.step + 3
        self.budget_plans: list[dict[str, float]] = []

    def _end_step(self) -> int:
        cfg = self.config
        return min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)

    def _follow_budget(self, end: int) -> int:
        """With `time_budget_seconds`: re-plans `max_steps` from this session's pace (wall seconds per step, the
        evaluations and checkpoints so far included; the last evaluation and checkpoint kept in reserve for the end)
        while the schedule has not started decaying, and ends the run early once the budget is overrun by 10%.
        Returns the (new) last step. Every process reaches the same plan from the main process's clock."""
        cfg = self.config
        elapsed = time.perf_counter() - self._session_start
        if self.accelerator.num_processes > 1:  # one clock for every process, or they would stop at different steps
            from accelerate.utils import broadcast_object_list

            elapsed = broadcast_object_list([elapsed])[0]
        budget = float(cfg.time_budget_seconds)
        if elapsed > 1.1 * budget and self.step < end:
            logger.warning(f"time budget {budget:.0f} s overrun ({elapsed:.0f} s): ending at step {self.step}")
            self.config = replace(cfg, stop_at_step=self.step)
            return self.step
        decaying = cfg.lr_schedule == "wsd" and self.step >= wsd_decay_start(cfg)
        if decaying or self.step < self._next_replan:
            return end
        done = self.step - self._session_first_step
        pace = elapsed / done
        remaining = budget - elapsed - self._last_eval_seconds - self._last_save_seconds
        planned = self.step + max(1, int(remaining / pace))
        if cfg.lr_schedule == "wsd":  # the decay must still be ahead: at least one stable step left
            while wsd_decay_start(cfg, planned) <= self.step:
                planned += 1
        planned = min(planned, self._step_limit)
        self._next_replan = self.step + max(3, min(50, (planned - self.step) // 20))
        if planned != cfg.max_steps:
            self.config = replace(cfg, max_steps=planned)
            self.scheduler = build_lr_scheduler(self.optimizer, self.config, last_step=self.step)
            self.budget_plans.append({"step": self.step, "elapsed": elapsed, "pace": pace, "max_steps": planned})
        return self._end_step()

    def _cpu_record(self) -> dict[str, float]:
        return {} if self.train_cpu_seconds is None else {"train_cpu_seconds": self.train_cpu_seconds}

    def evaluate_heldout(self) -> dict[str, float] | None:
        """Held-out tau now (`heldout_tau` on `eval_prompt_ids`), appended to `output_dir/heldout.jsonl` with the
        step and the training seconds so far. Main process only; the others wait."""
        result = None
        if self.accelerator.is_main_process and self.eval_prompt_ids:
            drafter = self.accelerator.unwrap_model(self.model)
            was_training = drafter.training
            drafter.eval()
            with self.accelerator.autocast():
                result = heldout_tau(self.target, drafter, self.eval_prompt_ids, self.config.eval_max_new_tokens)
            drafter.train(was_training)
            result = {"step": self.step, "train_seconds": self.train_seconds, **self._cpu_record(), **result}
            with open(self.output_dir / "heldout.jsonl", "a") as handle:
                handle.write(json.dumps(result) + "\n")
            logger.info(f"step {self.step}: held-out tau {result['heldout_tau']:.3f}")
        self.accelerator.wait_for_everyone()
        return result

    def reduced_metrics(self, out: LossOutput) -> dict[str, float]:
        """`out.as_dict()` averaged over the processes (`supervised_slots` summed); with one process, unchanged."""
        local = out.as_dict()
        world = self.accelerator.num_processes
        if world == 1:
            return local
        keys = list(local)
        values = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=self.accelerator.device)
        total = self.accelerator.reduce(values, reduction="sum").tolist()
        return {k: (int(v) if k == "supervised_slots" else v / world) for k, v in zip(keys, total)}


def heldout_prompt_ids(examples: Sequence[TokenizedExample], count: int, order: str = "spread") -> list[list[int]]:
    """The prompt part (tokens before the first answer token) of `count` held-out examples (`ordered_subset`):
    held-out prompts in the training data's own chat template."""
    out = []
    for ex in ordered_subset(examples, count, order, lambda e: e.id):
        start = ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.loss_mask)
        if start > 0:
            out.append(list(ex.input_ids[:start]))
    return out


@torch.no_grad()
def heldout_tau(target, drafter: DSparkDrafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                batch_size: int = 8) -> dict[str, float]:
    """Greedy speculative decoding of `prompt_ids` (batches of `batch_size`, left-padded, every draft verified:
    policy "fixed", no EOS stop so every row contributes `max_new_tokens`): tau = tokens emitted per round (bonus
    included) over all rows, and the share of rounds verifying a draft that accepted the first one."""
    from ..decoding.batched import generate

    pad = target.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
    emitted = rounds = first = verified = 0
    for start in range(0, len(prompt_ids), batch_size):
        rows = [list(p) for p in prompt_ids[start: start + batch_size]]
        width = max(map(len, rows))
        device = target.device
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        out = generate(target, drafter, ids, mask, max_new_tokens=max_new_tokens, policy="fixed", eos_token_id=[],
                       pad_token_id=pad, return_dict_in_generate=True)
        for stats in out.stats:
            emitted += sum(stats.accepted_lengths)
            rounds += len(stats.accepted_lengths)
            # rounds cut to no draft by max_new_tokens verified nothing: not counted for the first draft's acceptance
            first += sum(n > 1 for n, v in zip(stats.accepted_lengths, stats.verify_lengths) if v > 0)
            verified += sum(v > 0 for v in stats.verify_lengths)
    return {"heldout_tau": emitted / max(1, rounds), "heldout_accept@1": first / max(1, verified),
            "heldout_prompts": len(prompt_ids), "heldout_rounds": rounds, "heldout_verified": verified}


def trainer_from_config(config: DSparkTrainingConfig, progress: bool = True) -> DSparkTrainer:
    """The trainer `dspark-hf train` runs: the target and the data named in `config`, a drafter initialised from
    `config.seed` (the same initial weights in every run and on every process)."""
    from ..testbed.targets import load_target

    target, tokenizer = load_target(config.target)
    examples = read_examples(config.data_dir)
    eval_ids = None
    if config.eval_every and config.eval_prompts:
        from .data import chat_prompt_ids
        from .prompts import read_prompts_jsonl

        prompts, _ = read_prompts_jsonl(config.eval_prompts)
        eval_ids = [chat_prompt_ids(tokenizer, p["messages"])
                    for p in eval_prompts(prompts, config.eval_num_prompts, config.eval_prompt_order)]
    torch.manual_seed(config.seed)
    return DSparkTrainer(config, target, examples, progress=progress, eval_prompt_ids=eval_ids)


def train_from_config(config: DSparkTrainingConfig, progress: bool = True) -> Path:
    """Loads the target and the data named in `config` and trains (what `dspark-hf train` runs)."""
    return trainer_from_config(config, progress=progress).train()
