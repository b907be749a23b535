"""`DSparkConfig`: the configuration of a DSpark drafter.

A DSpark drafter (arXiv 2607.05147) is a small parallel transformer conditioned on hidden states of a frozen
target model, plus a light sequential head and a confidence head. This file holds its typed configuration:

* backbone sizes (`hidden_size` must equal the target's, because the drafter shares the target's embedding and
  LM head at run time and stores neither),
* `block_size`: the number of drafts one forward yields; `block_layout` says how the block input is laid out:
  "dspark" (default): the anchor slot plus `block_size - 1` mask slots, slot k predicting anchor position + k + 1;
  "dflash" (z-lab / transformers / SpecForge DFlash checkpoints): the anchor slot plus `block_size` mask slots, the
  anchor slot predicting nothing and mask slot k (1..block_size) predicting anchor position + k,
* `rope_parameters`: any RoPE transformers supports (`rope_type` "default", "linear", "llama3", "yarn", ...), built
  with transformers' own RoPE initialisation; `rope_theta` mirrors its base,
* `target_layer_ids`: the target decoder layers whose raw outputs (HF `hidden_states[i + 1]`) are concatenated
  into the context features; -1 names the embedding output (`hidden_states[0]`); the target's last layer is refused
  (HF's last hidden state is post-norm),
* `sequential_head` in {"markov", "gated_markov", "rnn", "none"} and `markov_rank`,
* `draft_vocab_size`: `None` (the full vocabulary) or Vd < V: the drafter proposes only Vd target ids, kept in its
  `d2t` buffer (see `DSparkDrafter.set_draft_vocab`); its LM-head rows and Markov matrices live in that vocabulary,
* `confidence_head` (reading `[h_k; W1[x_{k-1}]]`, or only h_k with `confidence_head_with_markov=False`), the
  training loss position decay `loss_decay` and the Sequential Temperature Scaling
  temperatures `sts_temperatures` (empty until calibrated),
* a fingerprint of the target (`target_name_or_path`, `target_vocab_size`, `target_hidden_size`,
  `target_num_hidden_layers`, `target_model_type`) checked when the drafter is bound to a target,
* which target that is, like an adapter's base model: `target_name_or_path` is the target's Hub id when it has one
  (`org/name`, from the target config's `_name_or_path`, a Hub-cache snapshot path, or the `dspark_target.json`
  manifest of a converted test-bed target), a local path only as a fallback; `target_revision` its Hub commit
  (`_commit_hash`) and `target_aliases` other names that load it (the offline registry name of a test-bed target).
  `portable_target_fields()` drops machine-specific paths before a drafter is shipped.

Invalid values raise `ValueError` naming the field. This module imports nothing from `dspark_hf` so that it can be
copied next to a checkpoint and loaded with `trust_remote_code=True`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

SEQUENTIAL_HEADS = ("markov", "gated_markov", "rnn", "none")
BLOCK_LAYOUTS = ("dspark", "dflash")
# RoPE types whose frequencies transformers computes from the config (`ROPE_INIT_FUNCTIONS`) plus "default".
# "dynamic" and "longrope" also change with the sequence length at run time; the drafter mirrors transformers' own
# update rule for them (`transformers.modeling_rope_utils.dynamic_rope_update`).


def supported_rope_types() -> tuple[str, ...]:
    """The `rope_parameters["rope_type"]` values the drafter can build (those of the installed transformers)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default", *sorted(ROPE_INIT_FUNCTIONS))


@strict
class DSparkConfig(PreTrainedConfig):
    r"""Configuration of a [`DSparkDrafter`].

    Args:
        vocab_size: the target's vocabulary size (the Markov / RNN heads index it, unless `draft_vocab_size`).
        hidden_size: width of the drafter; must equal the target's hidden size.
        intermediate_size: width of the SwiGLU MLP of each draft layer.
        num_hidden_layers: number of draft decoder layers (paper: 5; 1-2 suffice for small targets).
        num_attention_heads / num_key_value_heads / head_dim: attention sizes of the draft layers.
        block_size: draft tokens one forward proposes (K).
        block_layout: "dspark" (default): the block input is the anchor slot + `block_size - 1` mask slots and slot k
            (0-based) predicts anchor position + k + 1. "dflash" (z-lab's layout): the block input is the anchor slot +
            `block_size` mask slots; the anchor slot predicts nothing and mask slot k (1-based) predicts anchor
            position + k. Either way one forward yields `block_size` drafts.
        rope_parameters: transformers' RoPE dict (`rope_type`, `rope_theta`, and the type's own keys); `None` means
            `{"rope_type": "default", "rope_theta": rope_theta}`. Built with `transformers.modeling_rope_utils`.
        rope_theta: the RoPE base (10000 if neither it nor `rope_parameters` is given); kept equal to
            `rope_parameters["rope_theta"]`, and an error if the two disagree.
        target_layer_ids: target decoder layers whose outputs form the context features (-1: the embedding output).
        sequential_head: "markov" (default), "gated_markov", "rnn" or "none" (the DFlash baseline).
        markov_rank: rank r of the low-rank transition W1 (V x r) W2 (r x V).
        confidence_head: whether the drafter predicts per-position survival probabilities.
        confidence_head_with_markov: whether the confidence head reads the sequential head's W1[x_{k-1}] next to h_k
            (DeepSpec's `confidence_head_with_markov`); ignored (no such input) without a sequential head.
        loss_decay: position weight decay gamma in w_k = exp(-(k - 1) / gamma); `None` means `block_size`.
        sts_temperatures: one temperature per block position applied to the confidence logit (STS).
        mask_token_id: optional target token whose embedding fills the mask slots; `None` (default) uses a
            learned mask embedding, so targets without a spare id work.
        draft_candidates: if set (M), the sequential loop scores only the M highest base logits of each slot, so
            each step reads M rows of the Markov W2 instead of all V (on a CPU the full-vocabulary loop costs as
            much as the parallel forward). The draft distribution is then the softmax over those M candidates;
            verification uses exactly it, so decoding stays lossless. `None` scores the full vocabulary.
        draft_vocab_size: if set (Vd), the drafter proposes only Vd target tokens (EAGLE-3's reduced draft vocabulary).
            Their sorted target ids are the drafter's `d2t` buffer, stored in the checkpoint; its base logits are the
            target LM head's rows for them (a Vd x d product instead of V x d) and the Markov head's W1 ((Vd + 1) x r,
            the extra row for a previous token outside the draft vocabulary) and W2 (r x Vd) are indexed by draft id.
            Draft distributions are zero outside the draft vocabulary, so verification stays exact. `None` = full.
        target_*: fingerprint of the target the drafter was built for.
        converted_from: the checkpoint format the weights were converted from ("deepspec", "zlab-dflash", ...;
            see `dspark_hf.convert`), or `None` for a drafter trained here. Provenance only.
    """

    model_type = "dspark"

    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    initializer_range: float = 0.02
    block_size: int = 7
    block_layout: str = "dspark"
    target_layer_ids: list[int] | None = None
    sequential_head: str = "markov"
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    loss_decay: float | None = None
    sts_temperatures: list[float] | None = None
    mask_token_id: int | None = None
    draft_candidates: int | None = None
    draft_vocab_size: int | None = None
    target_name_or_path: str | None = None
    target_revision: str | None = None
    target_aliases: list[str] | None = None
    target_vocab_size: int | None = None
    target_hidden_size: int | None = None
    target_num_hidden_layers: int | None = None
    target_model_type: str | None = None
    converted_from: str | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.target_layer_ids is None:
            self.target_layer_ids = []
        if self.sts_temperatures is None:
            self.sts_temperatures = []
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.sts_temperatures = [float(t) for t in self.sts_temperatures]
        self.target_aliases = [str(a) for a in (self.target_aliases or [])]
        self._normalize_rope(kwargs)
        super().__post_init__(**kwargs)
        self.validate_dspark()

    def _normalize_rope(self, kwargs: dict) -> None:
        """`rope_parameters` is the source of truth; `rope_theta` mirrors its base. Legacy `rope_scaling` is refused
        (give `rope_parameters`), so no RoPE setting can be dropped silently."""
        if kwargs.get("rope_scaling") is not None:
            raise ValueError("DSparkConfig.rope_scaling is not read: give the RoPE as rope_parameters "
                             "(transformers' format: rope_type, rope_theta and the type's keys).")
        kwargs.pop("rope_scaling", None)
        params = self.rope_parameters
        if params is None:
            theta = 10000.0 if self.rope_theta is None else float(self.rope_theta)
            params = {"rope_type": "default", "rope_theta": theta}
        elif not isinstance(params, dict):
            raise ValueError(f"DSparkConfig.rope_parameters must be a dict, got {type(params).__name__}.")
        else:
            params = dict(params)
            if "type" in params and "rope_type" not in params:  # transformers' legacy spelling
                params["rope_type"] = params.pop("type")
            params.setdefault("rope_type", "default")
            if "rope_theta" not in params or params["rope_theta"] is None:
                params["rope_theta"] = 10000.0 if self.rope_theta is None else float(self.rope_theta)
            elif self.rope_theta is not None and float(self.rope_theta) != float(params["rope_theta"]):
                raise ValueError(
                    f"DSparkConfig.rope_theta ({self.rope_theta}) disagrees with rope_parameters['rope_theta'] "
                    f"({params['rope_theta']}); give one of them."
                )
            params["rope_theta"] = float(params["rope_theta"])
        self.rope_parameters = params
        self.rope_theta = float(params["rope_theta"])

    # ------------------------------------------------------------------ validation
    def validate_dspark(self) -> None:
        """Raises `ValueError` naming the first invalid field."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DSparkConfig.{name} must be a positive integer, got {value!r}.")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "max_position_embeddings"):
            positive(name)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"DSparkConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"DSparkConfig.head_dim must be even for rotary embeddings, got {self.head_dim}.")
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(
                f"DSparkConfig.sequential_head must be one of {SEQUENTIAL_HEADS}, got {self.sequential_head!r}."
            )
        if self.sequential_head != "none" and (not isinstance(self.markov_rank, int) or self.markov_rank < 1):
            raise ValueError(
                f"DSparkConfig.markov_rank must be a positive integer when sequential_head="
                f"{self.sequential_head!r}, got {self.markov_rank!r}."
            )
        if self.loss_decay is not None and not self.loss_decay > 0:
            raise ValueError(f"DSparkConfig.loss_decay must be > 0 (or None for block_size), got {self.loss_decay}.")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"DSparkConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}.")
        if self.rope_theta <= 0:
            raise ValueError(f"DSparkConfig.rope_theta must be > 0, got {self.rope_theta}.")
        self._validate_rope_parameters()
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ValueError(f"DSparkConfig.block_layout must be one of {BLOCK_LAYOUTS}, got {self.block_layout!r}.")
        if self.sts_temperatures:
            if len(self.sts_temperatures) != self.block_size:
                raise ValueError(
                    f"DSparkConfig.sts_temperatures must hold one temperature per block position "
                    f"({self.block_size}), got {len(self.sts_temperatures)}."
                )
            if any(not t > 0 for t in self.sts_temperatures):
                raise ValueError(f"DSparkConfig.sts_temperatures must all be > 0, got {self.sts_temperatures}.")
        if self.draft_candidates is not None and self.draft_candidates < 1:
            raise ValueError(f"DSparkConfig.draft_candidates must be >= 1 or None, got {self.draft_candidates}.")
        if self.draft_vocab_size is not None and (
            not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool)
            or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise ValueError(
                f"DSparkConfig.draft_vocab_size must be an integer in [1, vocab_size={self.vocab_size}] or None (full "
                f"vocabulary), got {self.draft_vocab_size!r}."
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DSparkConfig.mask_token_id must lie in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}."
            )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"DSparkConfig.target_layer_ids has duplicates: {self.target_layer_ids}.")
        if any(i < -1 for i in self.target_layer_ids):
            raise ValueError(f"DSparkConfig.target_layer_ids must be >= -1 (-1: the embedding output), got "
                             f"{self.target_layer_ids}.")
        if self.target_num_hidden_layers is not None:
            bad = [i for i in self.target_layer_ids if i >= self.target_num_hidden_layers - 1]
            if bad:
                raise ValueError(
                    f"DSparkConfig.target_layer_ids {bad} out of range: the target has "
                    f"{self.target_num_hidden_layers} layers and its last layer "
                    f"({self.target_num_hidden_layers - 1}) is never used (HF's last hidden state is post-norm); "
                    f"valid ids are 0..{self.target_num_hidden_layers - 2}."
                )
        if self.target_hidden_size is not None and self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"DSparkConfig.hidden_size ({self.hidden_size}) must equal the target's hidden size "
                f"({self.target_hidden_size}): the drafter shares the target's embedding and LM head."
            )
        if self.target_vocab_size is not None and self.target_vocab_size != self.vocab_size:
            raise ValueError(
                f"DSparkConfig.vocab_size ({self.vocab_size}) must equal the target's vocab size "
                f"({self.target_vocab_size})."
            )

    def _validate_rope_parameters(self) -> None:
        params = self.rope_parameters
        rope_type = params.get("rope_type")
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                f"DSparkConfig.rope_parameters holds per-layer-type RoPE dicts ({sorted(params)}); the drafter has one "
                "RoPE for all its layers: give a single rope_parameters dict."
            )
        supported = supported_rope_types()
        if rope_type not in supported:
            raise ValueError(
                f"DSparkConfig.rope_parameters['rope_type'] = {rope_type!r} is not supported; the installed "
                f"transformers builds {list(supported)}."
            )
        factor = params.get("partial_rotary_factor")
        if factor is not None and float(factor) != 1.0:
            raise ValueError(
                f"DSparkConfig.rope_parameters['partial_rotary_factor'] = {factor} is not supported: the drafter "
                "rotates the whole head dimension."
            )

    @property
    def num_block_slots(self) -> int:
        """Rows of the block input: `block_size` ("dspark" layout) or `block_size + 1` ("dflash": anchor + K masks)."""
        return self.block_size + (1 if self.block_layout == "dflash" else 0)

    @property
    def first_draft_slot(self) -> int:
        """Index of the block row that predicts the first draft (0 in the "dspark" layout, 1 in "dflash")."""
        return 1 if self.block_layout == "dflash" else 0

    @property
    def target_hub_id(self) -> str | None:
        """The target's Hub id (`org/name`) when `target_name_or_path` is one (not a local path), else `None`."""
        name = self.target_name_or_path
        return name if is_hub_repo_id(name) and not _looks_local(name) else None

    def portable_target_fields(self) -> dict[str, Any]:
        """`target_name_or_path` / `target_revision` / `target_aliases` as a shipped drafter should record them: a
        Hub-cache snapshot path becomes its Hub id and commit, a converted test-bed folder its manifest's Hub id, and
        any other local path is dropped (`None`), so no machine-specific path leaves the machine."""
        return portable_target_reference(self.target_name_or_path, self.target_revision, self.target_aliases)

    @property
    def num_target_features(self) -> int:
        """Number of target layers concatenated into the context features (m)."""
        return len(self.target_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        """Whether the drafter proposes a reduced draft vocabulary (`draft_vocab_size` set)."""
        return self.draft_vocab_size is not None

    @property
    def num_draft_tokens(self) -> int:
        """Vd: the size of the vocabulary the drafter proposes (the full vocabulary unless `draft_vocab_size`)."""
        return int(self.draft_vocab_size) if self.draft_vocab_size is not None else int(self.vocab_size)

    @property
    def effective_loss_decay(self) -> float:
        """gamma of the position weights exp(-(k-1)/gamma); defaults to the block size as in the paper."""
        return float(self.loss_decay) if self.loss_decay is not None else float(self.block_size)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
        """Spreads `num_features` layer ids evenly from 1 to L-3 (Qwen3-4B, L=36: [1, 9, 17, 25, 33]).

        Never returns the last layer. Small targets get fewer, distinct ids.
        """
        if num_target_layers < 2:
            raise ValueError(f"the target must have at least 2 layers to draft from, got {num_target_layers}.")
        lo = 1 if num_target_layers > 2 else 0
        # L-3 as in the reference; small targets (< 8 layers) may also use L-2 (still never the last layer).
        hi = max(lo, num_target_layers - 3 if num_target_layers >= 8 else num_target_layers - 2)
        count = max(1, min(num_features, hi - lo + 1))
        if count == 1:
            return [lo]
        step = (hi - lo) / (count - 1)
        return sorted({int(round(lo + step * i)) for i in range(count)})

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "DSparkConfig":
        """Builds a drafter config fitted to `target_config` (any HF causal-LM config).

        Defaults: the target's hidden size, vocab, head layout and rope theta; 2 draft layers; context features from
        up to 5 layers spread over the target's depth (never its last); a Markov head of rank 256 and a confidence
        head. Any field can be overridden by keyword.
        """
        text = target_config.get_text_config()
        num_layers = int(text.num_hidden_layers)
        heads = int(getattr(text, "num_attention_heads", 0) or max(1, text.hidden_size // 64))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        rope_theta = getattr(text, "rope_theta", None)
        rope_parameters = getattr(text, "rope_parameters", None)
        if rope_theta is None and isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta")
        # The target's whole RoPE (type and scaling keys) when transformers describes it as one flat dict.
        rope = None
        if isinstance(rope_parameters, dict) and rope_parameters and not any(
                isinstance(v, dict) for v in rope_parameters.values()):
            rope = {k: v for k, v in rope_parameters.items() if v is not None}
            rope.setdefault("rope_theta", float(rope_theta or 10000.0))
        values: dict[str, Any] = dict(
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
            rope_theta=float(rope_theta or 10000.0) if rope is None else None,
            rope_parameters=rope,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768) or 32768),
            target_layer_ids=cls.default_target_layer_ids(num_layers),
            **target_reference(target_config),
            target_vocab_size=int(text.vocab_size),
            target_hidden_size=int(text.hidden_size),
            target_num_hidden_layers=num_layers,
            target_model_type=getattr(text, "model_type", None),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        if "rope_theta" in overrides and "rope_parameters" not in overrides:
            values["rope_parameters"] = None  # an explicit base replaces the target's RoPE
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------------------------- target reference
TARGET_MANIFEST = "dspark_target.json"  # written by dspark_hf.testbed.targets into a converted target folder
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_SNAPSHOT = re.compile(r"(?:^|[\\/])models--(?P<repo>[^\\/]+)[\\/]snapshots[\\/](?P<rev>[0-9a-fA-F]{40})(?:[\\/]|$)")


def is_hub_repo_id(name: Any) -> bool:
    """Whether `name` has the form of a Hub model id `org/name` (no `--` or `..`, no leading path characters)."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name


def _looks_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith(("~", ".")) or os.path.isdir(name)


def hub_cache_snapshot(path: Any) -> tuple[str, str] | None:
    """`(repo_id, commit)` of a path inside huggingface_hub's cache (`.../models--org--name/snapshots/<commit>/`)."""
    match = _SNAPSHOT.search(str(path)) if path else None
    if match is None or "--" not in match.group("repo"):
        return None
    org, _, name = match.group("repo").partition("--")
    return f"{org}/{name}", match.group("rev")


def _manifest(folder: str) -> dict:
    try:
        with open(os.path.join(folder, TARGET_MANIFEST)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def target_reference(target_config: Any) -> dict[str, Any]:
    """`target_name_or_path`, `target_revision` and `target_aliases` for a loaded target's config.

    The Hub id when the target has one: `_name_or_path` itself when it is an `org/name` id (revision: the config's
    `_commit_hash`), the id and commit of a Hub-cache snapshot folder, or the `hub_id` of a converted test-bed folder's
    `dspark_target.json` (its registry name becomes an alias). Otherwise the local path, as a fallback."""
    name = getattr(target_config, "_name_or_path", None) or None
    revision = getattr(target_config, "_commit_hash", None) or None
    if name is None:
        return {"target_name_or_path": None, "target_revision": None, "target_aliases": []}
    name = os.fspath(name)
    snapshot = hub_cache_snapshot(name)
    if snapshot is not None:
        return {"target_name_or_path": snapshot[0], "target_revision": snapshot[1], "target_aliases": []}
    if os.path.isdir(name):
        manifest = _manifest(name)
        aliases = [str(manifest["name"])] if manifest.get("name") else []
        if is_hub_repo_id(manifest.get("hub_id")):
            return {"target_name_or_path": manifest["hub_id"], "target_revision": manifest.get("hub_revision"),
                    "target_aliases": aliases}
        return {"target_name_or_path": name, "target_revision": None, "target_aliases": aliases}
    return {"target_name_or_path": name, "target_revision": revision if is_hub_repo_id(name) else None,
            "target_aliases": []}


def portable_target_reference(name: str | None, revision: str | None = None,
                              aliases: list[str] | None = None) -> dict[str, Any]:
    """The machine-independent form of a recorded target (see `DSparkConfig.portable_target_fields`)."""
    aliases = list(aliases or [])
    if not name or (is_hub_repo_id(name) and not _looks_local(name)):
        return {"target_name_or_path": name or None, "target_revision": revision, "target_aliases": aliases}
    snapshot = hub_cache_snapshot(name)
    if snapshot is not None:
        return {"target_name_or_path": snapshot[0], "target_revision": snapshot[1], "target_aliases": aliases}
    manifest = _manifest(name) if os.path.isdir(name) else {}
    if manifest.get("name") and manifest["name"] not in aliases:
        aliases.append(str(manifest["name"]))
    if is_hub_repo_id(manifest.get("hub_id")):
        return {"target_name_or_path": manifest["hub_id"], "target_revision": manifest.get("hub_revision"),
                "target_aliases": aliases}
    return {"target_name_or_path": None, "target_revision": None, "target_aliases": aliases}


__all__ = ["BLOCK_LAYOUTS", "DSparkConfig", "SEQUENTIAL_HEADS", "TARGET_MANIFEST", "hub_cache_snapshot",
           "is_hub_repo_id", "portable_target_reference", "supported_rope_types", "target_reference"]
