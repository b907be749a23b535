"""transformers' own DFlash assistants (`speculation_type="dflash"`): `muse_glimmer_assistant`
(`MuseGlimmerAssistantModel`), the in-library model that `DFlashTokenCandidateGenerator` drives.

Format (read from the installed transformers: `models/muse_glimmer_assistant/{configuration,modular}_*.py`,
`generation/candidate_generator.py` `DFlashTokenCandidateGenerator`, `cache_utils.DFlashCache`): a config with
`hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
`rms_norm_eps`, `rope_parameters`, `max_position_embeddings`, `sliding_window`, `layer_types`, `attention_dropout`,
`hidden_act`, bos / eos / pad ids, `block_size`, `mask_token_id`, `target_layer_ids` (fields absent from the file
take the transformers class defaults, as transformers itself would); weights `encoder.fc`, `encoder.output_norm_enc`
(our `fc`, `hidden_norm`), `layers.*` (Qwen3-shaped pre-norm layers with q / k norms) and `norm`; no vocabulary at
all (the assistant has no embedding): the target's vocabulary size must be given (`convert_checkpoint(...,
target=...)` / `dspark-hf convert --target`).

Layout: the generator embeds `[anchor, mask x (block_size - 1)]` and drafts from `last_hidden_state[:, 1:]`: our
"dflash" layout with `block_size - 1` drafts; no sequential or confidence head.

Refused: `sliding_attention` layers (the class default is all-sliding with a 2048 window; only all-`full_attention`
checkpoints convert), unknown fields.

Not handled: transformers' generator embeds the block with the target's embedding *bypassing* an `embed_norm` the
embedding may carry (Muse-Glimmer targets); the DSpark drafter applies the target's embedding as it is. Such a target
is refused by `convert_checkpoint(..., target=...)`.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import ConversionError, Converted, Fields, backbone_kwargs, build_config, check_weights

__all__ = ["FORMAT", "MODEL_TYPES", "convert", "full_config", "matches"]

FORMAT = "transformers-dflash"
MODEL_TYPES = ("muse_glimmer_assistant",)
RENAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def matches(config: dict[str, Any]) -> bool:
    return config.get("model_type") in MODEL_TYPES


def full_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with transformers' class defaults filled in (what transformers itself would run)."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k not in ("model_type", "vocab_size")}
    try:
        full = AutoConfig.for_model(config["model_type"], **values).to_dict()
    except (ValueError, TypeError) as err:
        raise ConversionError(f"{FORMAT}: transformers refuses this config.json: {err}") from err
    for key in ("vocab_size",):
        if key in config:
            full[key] = config[key]
    return full


def convert(config: dict[str, Any], weights: dict[str, torch.Tensor], vocab_size: int | None = None) -> Converted:
    full = full_config(config)
    if vocab_size is not None:
        if "vocab_size" in full and int(full["vocab_size"]) != int(vocab_size):
            raise ConversionError(f"{FORMAT}: config.json field 'vocab_size' = {full['vocab_size']} differs from the "
                                  f"target's {vocab_size}")
        full["vocab_size"] = int(vocab_size)
    if "vocab_size" not in full:
        raise ConversionError(f"{FORMAT}: the checkpoint has no vocabulary (transformers' DFlash assistant has no "
                              "embedding); give the target: convert_checkpoint(src, out, target=TARGET) / "
                              "`dspark-hf convert SRC OUT --target TARGET`")
    fields = Fields(full, FORMAT)
    kwargs = backbone_kwargs(fields)
    block = int(fields.require("block_size", "the rows of the draft block"))
    if block < 2:
        raise ConversionError(f"{FORMAT}: config.json field 'block_size' = {block} leaves no draft")
    kwargs.update(block_size=block - 1, block_layout="dflash", sequential_head="none", markov_rank=0,
                  confidence_head=False, target_vocab_size=kwargs["vocab_size"], target_hidden_size=kwargs["hidden_size"])
    kwargs["mask_token_id"] = int(fields.require("mask_token_id", "the mask slots are this token's embedding"))
    kwargs["target_layer_ids"] = [int(i) for i in fields.require("target_layer_ids", "the target layers to read")]
    fields.ignore("model_type", "the assistant's class (the format is detected from it)")
    fields.ignore_generic()
    notes = fields.finish()
    dspark_config = build_config(FORMAT, **kwargs)
    state_dict = {}
    for name, tensor in weights.items():
        name = name[len("model."):] if name.startswith("model.") else name
        state_dict[RENAMES.get(name, name)] = tensor
    check_weights(FORMAT, dspark_config, state_dict)
    return Converted(dspark_config, state_dict, FORMAT, notes)
