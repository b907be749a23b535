"""z-lab/dflash drafters (`DFlashDraftModel`, e.g. `z-lab/Qwen3-8B-DFlash-b16`; SpecForge's plain DFlash exports
use the same format).

Format (read from z-lab/dflash at commit 44947fb, `dflash/model.py`, checked against recorded outputs in
tests/fixtures/reference-drafters/zlab-dflash/): `config.json` is a Qwen3 config plus `block_size`,
`num_target_layers` and `dflash_config` {`mask_token_id`, `target_layer_ids`}; `model.safetensors` holds the backbone
under our names and no embedding / LM head (the target's are used).

Layout: z-lab's block is `[anchor, mask x (block_size - 1)]` and mask slot k predicts anchor position + k: the anchor
slot is not a prediction slot, so there are `block_size - 1` drafts. That is our "dflash" layout with
`block_size = z-lab's block_size - 1` (our `block_size` counts drafts). There is no sequential or confidence head.

Config fields: mapped: the Qwen3 backbone fields (as in `deepspec.py`, RoPE included), `block_size`,
`dflash_config.mask_token_id` (required), `dflash_config.target_layer_ids` (when absent: z-lab's own default from
`num_target_layers` and the number of draft layers), `num_target_layers` -> `target_num_hidden_layers`,
`vocab_size` / `hidden_size` -> the target fingerprint. Checked: `layer_types`, `use_sliding_window`.
Ignored: `model_type` (the draft layers' family, not the target's), `sliding_window`,
`max_window_layers`, generic transformers fields. Refused: anything else (also in
`dflash_config`). Weights: all by name.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import ConversionError, Converted, Fields, backbone_kwargs, build_config, check_weights

__all__ = ["ARCHITECTURES", "FORMAT", "convert", "default_target_layer_ids", "dflash_block_size", "matches"]

FORMAT = "zlab-dflash"
ARCHITECTURES = ("DFlashDraftModel",)
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "block_size"}


def matches(config: dict[str, Any]) -> bool:
    dflash = config.get("dflash_config")
    archs = config.get("architectures") or []
    return isinstance(dflash, dict) and set(dflash) <= DFLASH_CONFIG_KEYS and (
        not archs or any(a in ARCHITECTURES for a in archs))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default when a checkpoint names no layers: the middle layer for one draft layer, else draft-layer
    count ids spread evenly from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_block_size(fields: Fields, dflash: Fields) -> int:
    """The source block (rows of the block input, anchor included), top-level or inside dflash_config."""
    top = fields.take("block_size", None)
    inner = dflash.take("block_size", None)
    if top is not None and inner is not None and int(top) != int(inner):
        raise ConversionError(f"{fields.fmt}: config.json field 'block_size' = {top} disagrees with "
                              f"dflash_config.block_size = {inner}")
    size = top if top is not None else inner
    if size is None:
        raise ConversionError(f"{fields.fmt}: config.json has no 'block_size' (top level or in dflash_config)")
    if int(size) < 2:
        raise ConversionError(f"{fields.fmt}: config.json field 'block_size' = {size}: a DFlash block needs the anchor "
                              "and at least one mask slot")
    return int(size)


def convert(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Converted:
    fields = Fields(config, FORMAT)
    dflash = Fields(fields.require("dflash_config", "it holds the mask id and target layers"), FORMAT,
                    "config.json dflash_config")
    kwargs = backbone_kwargs(fields)
    block = dflash_block_size(fields, dflash)
    kwargs.update(block_size=block - 1, block_layout="dflash", sequential_head="none", markov_rank=0,
                  confidence_head=False)
    kwargs["mask_token_id"] = int(dflash.require("mask_token_id", "the mask slots are this token's embedding; an "
                                                 "unset id would give wrong drafts"))
    num_target_layers = fields.take("num_target_layers", None)
    notes = []
    ids = dflash.take("target_layer_ids", None)
    if ids is None:
        if num_target_layers is None:
            raise ConversionError(f"{FORMAT}: config.json has neither dflash_config.target_layer_ids nor "
                                  "num_target_layers")
        ids = default_target_layer_ids(int(num_target_layers), kwargs["num_hidden_layers"])
        notes.append(f"dflash_config.target_layer_ids absent: z-lab's default {ids}")
    kwargs["target_layer_ids"] = [int(i) for i in ids]
    kwargs.update(
        target_num_hidden_layers=int(num_target_layers) if num_target_layers is not None else None,
        target_vocab_size=kwargs["vocab_size"], target_hidden_size=kwargs["hidden_size"],
    )
    # The drafter's own layer family (z-lab drafts Llama targets with Qwen3 layers too): not the target's.
    fields.ignore("model_type", "the draft layers' family (always Qwen3-shaped), not necessarily the target's")
    fields.ignore_generic()
    notes = fields.finish() + dflash.finish() + notes
    dspark_config = build_config(FORMAT, **kwargs)
    state_dict = dict(weights)
    check_weights(FORMAT, dspark_config, state_dict)
    return Converted(dspark_config, state_dict, FORMAT, notes)
