"""deepseek-ai/DeepSpec drafters (`Qwen3DSparkModel`), e.g. the published `dspark_qwen3_*_block7` checkpoints.

Format (read from DeepSpec at commit afdfa7c: `deepspec/modeling/dspark/{qwen3/config,qwen3/modeling,markov_head,
common}.py`, checked against recorded outputs in tests/fixtures/reference-drafters/): `config.json` is a deep copy of
the *target's* Qwen3 config with the drafter's fields set on top; `model.safetensors` holds the drafter under our names
plus `embed_tokens.weight` / `lm_head.weight` (copies of the target's, frozen in training).

Layout: DeepSpec's block is ours ("dspark"): the anchor + `block_size - 1` mask tokens, slot k predicting anchor
position + k + 1, `block_size` drafts; the first sequential-head input is the anchor.

Config fields:

* mapped: the Qwen3 backbone fields (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
  `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `max_position_embeddings`,
  `attention_bias`, `hidden_act` (silu only), `rope_parameters` / `rope_theta` / `rope_scaling` (the whole RoPE: taking
  the file as it is would silently give theta 10000), bos / eos / pad ids), `block_size`, `mask_token_id`
  (required: an unset mask id gives wrong drafts), `target_layer_ids` (-1 = the embedding output, as in DeepSpec),
  `markov_rank` (0 = DeepSpec's DFlash baseline -> `sequential_head="none"`), `markov_head_type` (vanilla / gated /
  rnn -> markov / gated_markov / rnn), `enable_confidence_head`, `confidence_head_with_markov`, and the target
  fingerprint: `num_target_layers` -> `target_num_hidden_layers`, `vocab_size` / `hidden_size` / `model_type` (the
  config is the target's) -> `target_vocab_size` / `target_hidden_size` / `target_model_type`.
* checked: `layer_types` (all `full_attention`), `use_sliding_window` (false), `mlp_bias` (false).
* ignored (reason in `IGNORED`): `num_anchors` (training), `sliding_window`, `max_window_layers`, and the generic
  transformers fields (`architectures`, `dtype`, `transformers_version`, ...).
* refused: DeepSpec's Gemma-4 variant (`Gemma4DSparkModel`: extra norms, scaled embedding, soft-capping), sliding
  window layers, anything not listed.

Weights: `embed_tokens.weight`, `lm_head.weight` dropped (the drafter binds the target's; `convert_checkpoint(...,
target=...)` checks that the copies equal the target's), `markov_head.joint_proj.*` -> `markov_head.rnn_proj.*` (same
[state; W1[x]; h] input order), everything else by name.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import ConversionError, Converted, Fields, backbone_kwargs, build_config, check_weights

__all__ = ["ARCHITECTURES", "FORMAT", "HEAD_TYPES", "IGNORED", "convert", "heads_kwargs", "map_weights", "matches"]

FORMAT = "deepspec"
ARCHITECTURES = ("Qwen3DSparkModel",)
GEMMA_ARCHITECTURES = ("Gemma4DSparkModel",)

HEAD_TYPES = {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}

IGNORED = {
    "num_anchors": "anchors sampled per training sequence (a training setting)",
}

# Tensors DeepSpec stores that the drafter does not own: copies of the target's, bound at run time.
TARGET_COPIES = {"embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}

RENAMES = (("markov_head.joint_proj.", "markov_head.rnn_proj."),)


def matches(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    if any(a in ARCHITECTURES + GEMMA_ARCHITECTURES for a in archs):
        return True
    return "dflash_config" not in config and "speculators_model_type" not in config and all(
        k in config for k in ("markov_rank", "num_anchors", "enable_confidence_head", "target_layer_ids"))


def convert(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Converted:
    archs = config.get("architectures") or []
    if any(a in GEMMA_ARCHITECTURES for a in archs):
        raise ConversionError(
            f"{FORMAT}: config.json field 'architectures' = {archs}: DeepSpec's Gemma-4 drafter has extra norms "
            "(v_norm, pre/post feed-forward norms), a sqrt(hidden_size)-scaled embedding and final-logit soft-capping "
            "that the DSpark drafter does not have; only Qwen3DSparkModel checkpoints convert")
    fields = Fields(config, FORMAT)
    kwargs = backbone_kwargs(fields)
    kwargs.update(heads_kwargs(fields))
    kwargs["block_size"] = int(fields.require("block_size", "the number of drafts per block"))
    kwargs["block_layout"] = "dspark"
    kwargs["mask_token_id"] = int(fields.require("mask_token_id", "the mask slots are this token's embedding; an "
                                                 "unset id would give wrong drafts"))
    kwargs["target_layer_ids"] = [int(i) for i in fields.require("target_layer_ids", "the target layers to read")]
    num_target_layers = fields.take("num_target_layers", None)
    kwargs.update(
        target_num_hidden_layers=int(num_target_layers) if num_target_layers is not None else None,
        target_vocab_size=kwargs["vocab_size"],
        target_hidden_size=kwargs["hidden_size"],
        target_model_type=fields.take("model_type", None),
        target_name_or_path=config.get("_name_or_path") or None,
    )
    for key, reason in IGNORED.items():
        fields.ignore(key, reason)
    fields.ignore_generic()
    notes = fields.finish()
    dspark_config = build_config(FORMAT, **kwargs)
    state_dict, dropped, weight_notes = map_weights(weights, FORMAT)
    check_weights(FORMAT, dspark_config, state_dict)
    return Converted(dspark_config, state_dict, FORMAT, notes + weight_notes, dropped)


def heads_kwargs(fields: Fields, *, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sequential / confidence head fields as DeepSpec (and SpecForge / speculators) spell them. `defaults` gives
    values for absent fields (DeepSpec requires all of them; the others have defaults)."""
    defaults = defaults or {}
    fmt = fields.fmt
    get = (lambda k: fields.take(k, defaults[k])) if defaults else (
        lambda k: fields.require(k, "DeepSpec requires it"))
    rank = int(get("markov_rank"))
    if rank < 0:
        raise ConversionError(f"{fmt}: {fields.name('markov_rank')} = {rank} must be >= 0")
    out: dict[str, Any] = {}
    if rank == 0:
        out.update(sequential_head="none", markov_rank=0)
        fields.ignore("markov_head_type", "there is no sequential head (markov_rank = 0)")
    else:
        kind = str(get("markov_head_type")).lower()
        if kind not in HEAD_TYPES:
            raise ConversionError(f"{fmt}: {fields.name('markov_head_type')} = {kind!r} is not one of "
                                  f"{sorted(HEAD_TYPES)}")
        out.update(sequential_head=HEAD_TYPES[kind], markov_rank=rank)
    enabled = bool(get("enable_confidence_head"))
    out["confidence_head"] = enabled
    if enabled:
        with_markov = bool(get("confidence_head_with_markov"))
        if with_markov and rank == 0:
            raise ConversionError(f"{fmt}: {fields.name('confidence_head_with_markov')} is true but markov_rank is 0: "
                                  "there is no W1 to read")
        out["confidence_head_with_markov"] = with_markov
    else:
        fields.ignore("confidence_head_with_markov", "there is no confidence head (enable_confidence_head = false)")
        out["confidence_head_with_markov"] = True
    return out


def map_weights(weights: dict[str, torch.Tensor], fmt: str) -> tuple[dict, dict, list[str]]:
    """-> (state_dict under our names, dropped target copies, notes)."""
    state_dict, dropped, notes = {}, {}, []
    for name, tensor in weights.items():
        if name in TARGET_COPIES:
            dropped[name] = tensor
            continue
        new = name
        for old, ours in RENAMES:
            if new.startswith(old):
                new = ours + new[len(old):]
        if new in state_dict:
            raise ConversionError(f"{fmt}: tensors {name!r} and another both map to {new!r}")
        state_dict[new] = tensor
    if dropped:
        notes.append(f"dropped {sorted(dropped)}: copies of the target's embedding / LM head; the drafter binds the "
                     "target's own at run time")
    return state_dict, dropped, notes
