"""`DSparkTrainingConfig`: every knob of drafter training, with help text that becomes a CLI flag.

Sources, in increasing priority: the dataclass defaults, a YAML file (`--config`), `key=value` overrides and
`--key value` flags. Unknown keys are errors that name the key (a typo must never be silently ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["LR_SCHEDULES", "VARIANTS", "DSparkTrainingConfig", "load_training_config", "parse_override"]

VARIANTS = ("dspark", "dflash")
LR_SCHEDULES = ("cosine", "wsd", "constant")


@dataclass
class DSparkTrainingConfig:
    # ---- what to train
    target: str = field(default="", metadata={"help": "target model: a registry name (see dspark_hf.testbed.targets) or a local folder"})
    data_dir: str = field(default="", metadata={"help": "folder written by `dspark-hf data` (data-*.jsonl shards), or several comma-separated (newest first: an id in two folders is read from the first); `folder@N` takes at most N examples of that folder (a fixed sample spread over its sources), e.g. `data/new,data/old@2000`"})
    output_dir: str = field(default="outputs/drafter", metadata={"help": "checkpoints, logs and the final drafter go here"})
    feature_cache: str | None = field(default=None, metadata={"help": "offline target-feature cache folder (built on first use); empty = online features"})
    feature_cache_dtype: str = field(default="bfloat16", metadata={"help": "storage dtype of the feature cache: 'bfloat16' (half the disk and memory) or 'float32'"})
    variant: str = field(default="dspark", metadata={"help": "'dspark' (sequential + confidence heads, CE+TV+conf loss) or 'dflash' (no heads, CE only)"})
    init_from: str | None = field(default=None, metadata={"help": "start from this drafter folder instead of a random init"})
    init_layers_from_target: list[int] | None = field(default=None, metadata={"help": "initialise draft layer i from the target's decoder layer ids[i] (negative ids count from the end): attention, MLP and norms are copied where the shapes match"})
    # ---- drafter architecture
    block_size: int = field(default=7, metadata={"help": "tokens per draft block"})
    num_hidden_layers: int = field(default=1, metadata={"help": "draft decoder layers"})
    intermediate_size: int | None = field(default=None, metadata={"help": "draft MLP width (default: the target's)"})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": "target layers feeding the drafter (default: spread over depth)"})
    sequential_head: str = field(default="markov", metadata={"help": "markov | gated_markov | rnn | none"})
    markov_rank: int = field(default=256, metadata={"help": "rank of the Markov / RNN head"})
    draft_candidates: int | None = field(default=64, metadata={"help": "inference: score only the top-M base logits per slot (None = full vocab)"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "reduced draft vocabulary: the drafter proposes only the N most frequent answer tokens of the training data (EOS always included); None = the full vocabulary"})
    cache_teacher_normalizer: bool = field(default=True, metadata={"help": "with a reduced draft vocabulary: compute the target's full-vocabulary log-normalizer once per example and keep it (in <feature_cache>/teacher-lse with a feature cache), so steps multiply by the draft rows of the LM head only; the loss is unchanged"})
    teacher_topk: int | None = field(default=None, metadata={"help": "sparse teacher: keep only the target's k most probable draft ids per answer position, computed once per example (in <feature_cache>/teacher-topk<k>-<draft vocabulary hash> with a feature cache), so steps skip the teacher's product with the draft rows of the LM head; TV and c* become an upper / lower bound that is exact where the teacher's mass lies in its top k (see training/losses.py); needs draft_vocab_size and cache_teacher_normalizer; None = the exact dense teacher"})
    # ---- loss
    alpha_ce: float = field(default=0.1, metadata={"help": "weight of the cross-entropy term"})
    alpha_tv: float = field(default=0.9, metadata={"help": "weight of the total-variation term"})
    alpha_conf: float = field(default=1.0, metadata={"help": "weight of the confidence BCE term"})
    detach_confidence_inputs: bool = field(default=False, metadata={"help": "train the confidence head on detached inputs: its BCE fits the head alone and never reaches the backbone or the Markov head's W1 (the paper trains end to end: False)"})
    loss_decay: float | None = field(default=None, metadata={"help": "gamma of w_k = exp(-(k-1)/gamma); default: block_size"})
    # ---- optimisation
    learning_rate: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps, then the lr_schedule"})
    lr_schedule: str = field(default="cosine", metadata={"help": "'cosine' (decay to 0 over max_steps), 'wsd' (warmup-stable-decay: peak until the last decay_fraction of max_steps, then linear to min_lr_ratio; raising max_steps on resume extends the stable phase, so a long run can grow session by session) or 'constant'"})
    decay_fraction: float = field(default=0.2, metadata={"help": "wsd: share of max_steps spent decaying"})
    min_lr_ratio: float = field(default=0.0, metadata={"help": "wsd: final learning rate as a fraction of the peak"})
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    time_budget_seconds: float | None = field(default=None, metadata={"help": "train for about this many seconds of wall time (steps, held-out evaluations and checkpoints of this session): max_steps is re-planned from the measured pace while the schedule is still before its decay, so a wsd decay ends at the budget (lr_schedule 'wsd' or 'constant'; max_steps stays the upper limit); None = max_steps decides"})
    stop_at_step: int | None = field(default=None, metadata={"help": "end this run at this optimizer step (held-out evaluation, checkpoint and final drafter written) without changing the learning-rate schedule, which still spans max_steps: an ablation stopped early under a long run's schedule; None = max_steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch (per process)"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    num_anchors: int = field(default=64, metadata={"help": "anchors (blocks) sampled per sequence"})
    max_length: int = field(default=768, metadata={"help": "truncate sequences to this many tokens"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    mixed_precision: str = field(default="no", metadata={"help": "'no' (fp32) or 'bf16'"})
    seed: int = field(default=0, metadata={"help": "data order and anchor sampling seed"})
    heldout_fraction: float = field(default=0.02, metadata={"help": "examples kept out of training (for calibration / eval)"})
    max_examples: int | None = field(default=None, metadata={"help": "train on at most this many examples: a fixed subset chosen by a hash of the example ids (so every source is represented, whatever the order of the data), taken after the held-out split; None = all"})
    # ---- bookkeeping
    save_every: int = field(default=200, metadata={"help": "checkpoint every N optimizer steps"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many recent checkpoints to keep"})
    log_every: int = field(default=10, metadata={"help": "log every N optimizer steps"})
    resume: bool = field(default=True, metadata={"help": "resume from the latest checkpoint in output_dir if there is one"})
    eval_every: int = field(default=0, metadata={"help": "every N optimizer steps (and at the end), measure held-out tau: greedy speculative decoding (policy fixed) of held-out prompts, written to output_dir/heldout.jsonl; 0 = off"})
    eval_prompts: str | None = field(default=None, metadata={"help": "JSONL of held-out prompts for eval_every (chat messages, e.g. data/heldout_prompts.jsonl); default: the prompts of the held-out split of data_dir"})
    eval_num_prompts: int = field(default=8, metadata={"help": "held-out prompts per evaluation"})
    eval_prompt_order: str = field(default="spread", metadata={"help": "which eval_num_prompts prompts: 'spread' (over the sources, by a hash of the prompt ids: the same in every run) or 'file' (the first ones; held-out files are sorted by source, so these are mostly one source: how runs before 2026-12-06 measured)"})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per held-out prompt"})

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.feature_cache_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"feature_cache_dtype must be 'bfloat16' or 'float32', got {self.feature_cache_dtype!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        for name in ("block_size", "num_hidden_layers", "max_steps", "batch_size", "gradient_accumulation_steps",
                     "num_anchors", "max_length", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 or None, got {self.draft_vocab_size}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("eval_every",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_prompt_order not in ("spread", "file"):
            raise ValueError(f"eval_prompt_order must be 'spread' or 'file', got {self.eval_prompt_order!r}")
        for name in ("eval_num_prompts", "eval_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stop_at_step is not None and self.stop_at_step < 1:
            raise ValueError(f"stop_at_step must be >= 1 or None, got {self.stop_at_step}")
        if self.time_budget_seconds is not None:
            if not self.time_budget_seconds > 0:
                raise ValueError(f"time_budget_seconds must be > 0 or None, got {self.time_budget_seconds}")
            if self.lr_schedule == "cosine":
                raise ValueError("time_budget_seconds re-plans max_steps during training, which would bend a cosine "
                                 "schedule already under way; use lr_schedule='wsd' (or 'constant')")
        if self.teacher_topk is not None:
            if self.teacher_topk < 1:
                raise ValueError(f"teacher_topk must be >= 1 or None, got {self.teacher_topk}")
            if self.draft_vocab_size is None or not self.cache_teacher_normalizer:
                raise ValueError("teacher_topk (the sparse teacher) needs a reduced draft vocabulary "
                                 "(draft_vocab_size) and cache_teacher_normalizer: true, whose cached normalizer turns "
                                 "the draft rows' logits into the target's probabilities")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples must be >= 1 or None, got {self.max_examples}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.variant == "dflash":  # the baseline: same backbone, no heads, CE only
            self.sequential_head = "none"
            self.alpha_tv = 0.0
            self.alpha_conf = 0.0

    @property
    def confidence_head(self) -> bool:
        return self.variant == "dspark"


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _string_fields() -> set[str]:
    return {f.name for f in fields(DSparkTrainingConfig) if f.type in ("str", "str | None", str)}


def parse_override(token: str) -> tuple[str, Any]:
    """`key=value` as a config key and its value: YAML for most fields, the text as written for str-typed ones (YAML
    would read `mixed_precision=no` as False)."""
    key, _, text = token.partition("=")
    key, text = key.strip(), text.strip()
    return key, (text if key in _string_fields() and text else _parse_value(text))


def load_training_config(argv: list[str] | None = None, prog: str = "dspark-hf train") -> DSparkTrainingConfig:
    """Builds the config from `--config FILE.yaml`, `key=value` overrides and `--key value` flags (`--help` lists
    them under the program name `prog`)."""
    import yaml
    from transformers import HfArgumentParser

    argv = list(argv or [])
    known = {f.name for f in fields(DSparkTrainingConfig)}
    string_fields = _string_fields()
    values: dict[str, Any] = {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a YAML file")
        path = Path(argv[i + 1])
        del argv[i: i + 2]
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"could not read training config {path}: {err}") from err
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a mapping of config keys")
        values.update(loaded)
    flags = []
    for token in argv:
        if "=" in token and not token.startswith("-"):
            key, value = parse_override(token)
            values[key] = value
        else:
            flags.append(token)
    for key in string_fields & set(values):  # YAML files: `no` / `off` read as booleans, `1e-3` as numbers
        if isinstance(values[key], bool):
            values[key] = "yes" if values[key] else "no"
        elif isinstance(values[key], (int, float)):
            values[key] = str(values[key])
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown training config key(s) {unknown}; valid keys: {sorted(known)}")
    parser = HfArgumentParser(DSparkTrainingConfig, prog=prog,
                              description="train a drafter: --config FILE.yaml, key=value overrides, --key value flags")
    parser.set_defaults(**values)
    (config,) = parser.parse_args_into_dataclasses(args=flags)
    return config
