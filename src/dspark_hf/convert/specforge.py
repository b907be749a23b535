"""sgl-project/SpecForge drafters: `DSparkDraftModel` (DFlash backbone + DeepSpec's heads) and `DFlashDraftModel`
exports that carry SpecForge's own `dflash_config` keys.

Format (read from SpecForge at commit a6b6b023: `specforge/modeling/draft/{dflash,dspark}.py`, `configs/*-dspark.json`,
`configs/*-dflash.json`): a Qwen3 `config.json` (top-level `rope_theta` / `rope_scaling`) plus `block_size`,
`num_target_layers` and `dflash_config` {`mask_token_id`, `target_layer_ids`, `projector_type`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_alpha`, `confidence_head_with_markov`,
`attention_mode`, `pure_draft_prefix_len`, `shift_label`, `block_size`}.

Layout: z-lab's (`[anchor, mask x (block_size - 1)]`, drafts from the mask slots: `draft_hidden[:, 1 - block_size:]`),
i.e. our "dflash" layout with `block_size - 1` drafts; the sequential head's first input is the anchor. Heads as in
DeepSpec (`markov_w1`, `markov_w2`, `gate_proj`, `joint_proj`, `confidence_head.proj`).

Config fields: the backbone and `block_size` / `mask_token_id` / `target_layer_ids` / `num_target_layers` as in
`zlab.py`; `projector_type` "dspark" (or architectures `DSparkDraftModel`) reads the head fields with SpecForge's
defaults (`markov_rank` 0, `markov_head_type` "vanilla", `enable_confidence_head` = `confidence_head_alpha > 0`,
`confidence_head_with_markov` false); a plain DFlash export builds no heads (their fields, if any, are ignored as
SpecForge ignores them). Checked: `pure_draft_prefix_len` (0) and `shift_label` (false), which change which slot
predicts what. Ignored: `attention_mode` (a check of the head counts), `confidence_head_alpha` (a loss weight; only
its sign is read). Weights: early checkpoints' `logit_head.{markov_head,confidence_head}.*` are moved up as SpecForge's
own loader does; `logit_head.prefix_gru.*` / `embed_proj.*` (heads of other variants) are refused; `joint_proj` ->
`rnn_proj`; stored `embed_tokens` / `lm_head` copies dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from . import zlab
from .common import ConversionError, Converted, Fields, backbone_kwargs, build_config, check_weights
from .deepspec import heads_kwargs, map_weights

__all__ = ["ARCHITECTURES", "FORMAT", "convert", "matches", "normalize_names"]

FORMAT = "specforge"
ARCHITECTURES = ("DSparkDraftModel", "DFlashDraftModel")
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
OLD_PREFIXES = (("logit_head.markov_head.", "markov_head."), ("logit_head.confidence_head.", "confidence_head."))
FOREIGN_HEADS = ("logit_head.prefix_gru.", "logit_head.embed_proj.", "prefix_gru.", "embed_proj.")


def matches(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    dflash = config.get("dflash_config")
    return "speculators_model_type" not in config and isinstance(dflash, dict) and (
        "DSparkDraftModel" in archs or not set(dflash) <= zlab.DFLASH_CONFIG_KEYS)


def convert(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Converted:
    fields = Fields(config, FORMAT)
    dflash = Fields(fields.require("dflash_config", "it holds the mask id and target layers"), FORMAT,
                    "config.json dflash_config")
    kwargs = backbone_kwargs(fields)
    block = zlab.dflash_block_size(fields, dflash)
    kwargs.update(block_size=block - 1, block_layout="dflash")
    archs = config.get("architectures") or []
    projector = dflash.take("projector_type", None)
    if projector not in (None, "dspark"):
        raise ConversionError(f"{FORMAT}: config.json dflash_config field 'projector_type' = {projector!r} is not "
                              "supported (only SpecForge's 'dspark' heads, or none)")
    if projector == "dspark" or "DSparkDraftModel" in archs:
        alpha = float(dflash.take("confidence_head_alpha", 0.0) or 0.0)
        dflash.ignore("confidence_head_alpha", "the confidence loss weight in training (its sign gives the default "
                      "of enable_confidence_head)")
        kwargs.update(heads_kwargs(dflash, defaults={
            "markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": alpha > 0.0,
            "confidence_head_with_markov": False}))
    else:
        kwargs.update(sequential_head="none", markov_rank=0, confidence_head=False)
        for key in HEAD_KEYS + ("confidence_head_alpha",):
            dflash.ignore(key, "SpecForge's DFlashDraftModel builds no heads (projector_type is not 'dspark')")
    dflash.ignore("attention_mode", "SpecForge's check of the head counts (gqa / mha); no effect on the computation")
    dflash.expect("pure_draft_prefix_len", (0,), "a pure-draft prefix changes which block rows predict drafts")
    dflash.expect("shift_label", (False,), "shifted labels change which token each slot predicts")
    kwargs["mask_token_id"] = int(dflash.require("mask_token_id", "the mask slots are this token's embedding; an "
                                                 "unset id would give wrong drafts"))
    num_target_layers = fields.take("num_target_layers", None)
    ids = dflash.take("target_layer_ids", None)
    notes = []
    if ids is None:
        if num_target_layers is None:
            raise ConversionError(f"{FORMAT}: config.json has neither dflash_config.target_layer_ids nor "
                                  "num_target_layers")
        ids = zlab.default_target_layer_ids(int(num_target_layers), kwargs["num_hidden_layers"])
        notes.append(f"dflash_config.target_layer_ids absent: SpecForge's default {ids}")
    kwargs["target_layer_ids"] = [int(i) for i in ids]
    kwargs.update(target_num_hidden_layers=int(num_target_layers) if num_target_layers is not None else None,
                  target_vocab_size=kwargs["vocab_size"], target_hidden_size=kwargs["hidden_size"])
    fields.ignore("model_type", "the draft layers' family (always Qwen3-shaped), not necessarily the target's")
    fields.ignore_generic()
    notes = fields.finish() + dflash.finish() + notes
    dspark_config = build_config(FORMAT, **kwargs)
    state_dict, dropped, weight_notes = map_weights(normalize_names(weights), FORMAT)
    check_weights(FORMAT, dspark_config, state_dict)
    return Converted(dspark_config, state_dict, FORMAT, notes + weight_notes, dropped)


def normalize_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(FOREIGN_HEADS):
            raise ConversionError(f"{FORMAT}: tensor {name!r} belongs to a head the DSpark drafter does not have "
                                  "(a prefix GRU / embedding projection of another SpecForge variant)")
        new = name
        for old, ours in OLD_PREFIXES:
            if new.startswith(old):
                new = ours + new[len(old):]
        if new in out:
            raise ConversionError(f"{FORMAT}: tensors {name!r} and {new!r} are both present")
        out[new] = tensor
    return out
