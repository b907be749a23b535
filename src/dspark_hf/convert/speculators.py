"""vllm-project/speculators drafters: `speculators_model_type` "dflash" (`DFlashSpeculator`) and "dspark"
(`DSparkSpeculator`), the format vLLM loads.

Format (read from speculators at commit c05b95b3: `src/speculators/models/{dflash,dspark}/{config,core,
model_definitions}.py`, `model.py` (`DraftVocabMixin`), `config.py`, `convert/dflash/converter.py`): `config.json`
holds `transformer_layer_config` (a Qwen3-shaped config of the draft layers, with the verifier's vocabulary),
`draft_vocab_size`, `block_size` (rows of the block input), `aux_hidden_state_layer_ids`, `mask_token_id`,
`sample_from_anchor`, `target_hidden_size`, `sliding_window_non_causal`, the DSpark head fields and
`speculators_config` {`algorithm`, `proposal_methods`, `default_proposal_method`, `verifier` {`name_or_path`,
`architectures`}}; `model.safetensors` the backbone under our names, `embed_tokens.weight` / `lm_head.weight`
(copies of the verifier's; `lm_head` only its draft-vocabulary rows), `t2d` / `d2t` with a reduced vocabulary, and
the heads (`markov_head.markov_w1` [V, r] over the *verifier* vocabulary, `markov_w2` [Vd, r], `gate_proj`,
`joint_proj`, `confidence_head.proj`).

Mapping:

* `sample_from_anchor` true (the "dspark" default): our "dspark" layout, `block_size` drafts; false (the "dflash"
  default): our "dflash" layout, `block_size - 1` drafts.
* `aux_hidden_state_layer_ids` index the hidden state *before* layer i (speculators' convention; its DFlash
  converter adds 1 to z-lab's ids): `target_layer_ids = [i - 1 ...]` (0 -> -1, the embedding output).
* `draft_vocab_size` < V: `d2t` holds *offsets* (target id = draft id + d2t[draft id]); our `d2t` = the target ids,
  sorted (W2 rows follow), checked against `t2d`. Speculators' W1 has a row per target id; ours has one per draft id
  plus a single "unknown" row, so the rows of target ids outside the draft vocabulary must all be equal (as written
  by `dspark_hf.convert.export`), else the conversion is refused. With the full vocabulary, `t2d` / `d2t` (identity
  mappings) are ignored, as speculators does.
* `markov_rank` (0 = none), `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov` as in
  DeepSpec, with speculators' defaults (256, "vanilla", true, true) when absent.
* `speculators_config.verifier.name_or_path` -> `target_name_or_path`; `transformer_layer_config.vocab_size` /
  `hidden_size` -> the target fingerprint.
* ignored: `speculators_version`, the proposal settings (`proposal_methods`, `default_proposal_method`: the engine's
  proposal length, up to the block's drafts), `verifier.architectures`, `sliding_window_non_causal` (read by sliding
  layers only, which are refused), `transformer_layer_config.model_type` (the draft layers' family), generic fields.
* dropped tensors: `embed_tokens`, `lm_head`, `verifier_lm_head`, `verifier_norm` (the verifier's; checked against
  the target by `convert_checkpoint(..., target=...)`).
* refused: other algorithms (e.g. "eagle3"), `target_hidden_size` != `hidden_size`, sliding-window layers, anything
  not listed.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import ConversionError, Converted, Fields, backbone_kwargs, build_config, check_weights
from .deepspec import heads_kwargs

__all__ = ["ALGORITHMS", "FORMAT", "HEAD_DEFAULTS", "convert", "draft_vocab_ids", "matches", "reduce_w1"]

FORMAT = "speculators"
ALGORITHMS = ("dflash", "dspark")
HEAD_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                 "confidence_head_with_markov": True}
VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def matches(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config


def convert(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Converted:
    fields = Fields(config, FORMAT)
    algorithm = fields.take("speculators_model_type")
    if algorithm not in ALGORITHMS:
        raise ConversionError(f"{FORMAT}: config.json field 'speculators_model_type' = {algorithm!r} is not a DSpark "
                              f"/ DFlash drafter (supported: {list(ALGORITHMS)})")
    layer = Fields(fields.require("transformer_layer_config", "it describes the draft layers"), FORMAT,
                   "config.json transformer_layer_config")
    kwargs = backbone_kwargs(layer)
    layer.ignore("model_type", "the draft layers' family (Qwen3-shaped DFlash layers whatever it names)")
    layer.ignore_generic()
    for key in ("num_target_layers",):
        layer.ignore(key, "copied from the source checkpoint; the verifier's layer count is not needed")
    notes = layer.finish()

    vocab = kwargs["vocab_size"]
    draft_vocab = int(fields.take("draft_vocab_size", vocab))
    target_hidden = fields.take("target_hidden_size", None)
    if target_hidden is not None and int(target_hidden) != kwargs["hidden_size"]:
        raise ConversionError(f"{FORMAT}: config.json field 'target_hidden_size' = {target_hidden} differs from the "
                              f"draft hidden size {kwargs['hidden_size']}: the DSpark drafter shares the target's "
                              "embedding and LM head, so the two must be equal")
    anchor_predicts = bool(fields.take("sample_from_anchor", algorithm == "dspark"))
    rows = int(fields.require("block_size", "the rows of the draft block"))
    if rows < (1 if anchor_predicts else 2):
        raise ConversionError(f"{FORMAT}: config.json field 'block_size' = {rows} leaves no draft")
    kwargs.update(block_size=rows if anchor_predicts else rows - 1,
                  block_layout="dspark" if anchor_predicts else "dflash")
    aux = fields.require("aux_hidden_state_layer_ids", "the target layers to read")
    kwargs["target_layer_ids"] = [int(i) - 1 for i in aux]
    kwargs["mask_token_id"] = int(fields.require("mask_token_id", "the mask slots are this token's embedding; an "
                                                 "unset id would give wrong drafts"))
    fields.ignore("sliding_window_non_causal", "read by sliding_attention layers only (there are none)")
    if algorithm == "dspark":
        kwargs.update(heads_kwargs(fields, defaults=HEAD_DEFAULTS))
    else:
        kwargs.update(sequential_head="none", markov_rank=0, confidence_head=False)
    spec = Fields(fields.take("speculators_config", {}), FORMAT, "config.json speculators_config")
    declared = spec.take("algorithm", algorithm)
    if declared != algorithm:
        raise ConversionError(f"{FORMAT}: config.json speculators_config field 'algorithm' = {declared!r} disagrees "
                              f"with speculators_model_type = {algorithm!r}")
    spec.ignore("proposal_methods", "the engine's proposal settings (how many of the block's drafts it verifies)")
    spec.ignore("default_proposal_method", "the engine's proposal settings")
    verifier = Fields(spec.take("verifier", {}), FORMAT, "config.json speculators_config.verifier")
    kwargs["target_name_or_path"] = verifier.take("name_or_path", None)
    verifier.ignore("architectures", "the verifier's class names (the fingerprint checks sizes instead)")
    fields.ignore("speculators_version", "the speculators version that wrote the file")
    fields.ignore_generic()
    notes += fields.finish() + spec.finish() + verifier.finish()
    kwargs.update(target_vocab_size=vocab, target_hidden_size=kwargs["hidden_size"])

    state_dict, dropped = {}, {}
    for name, tensor in weights.items():
        if name in VERIFIER_COPIES:
            dropped[name] = tensor
        elif name in ("t2d", "d2t"):
            continue
        else:
            state_dict[name.replace("markov_head.joint_proj.", "markov_head.rnn_proj.")] = tensor
    if dropped:
        notes.append(f"dropped {sorted(dropped)}: the verifier's embedding / LM head / norm copies; the drafter binds "
                     "the target's own at run time")
    if draft_vocab != vocab:
        kwargs["draft_vocab_size"] = draft_vocab
        d2t, order = draft_vocab_ids(weights, vocab, draft_vocab)
        state_dict["d2t"] = d2t
        if "lm_head.weight" in dropped and dropped["lm_head.weight"].shape[0] == draft_vocab:
            dropped["lm_head.weight"] = dropped["lm_head.weight"][order]
        w2 = "markov_head.markov_w2.weight"
        if w2 in state_dict:
            state_dict[w2] = state_dict[w2][order]
        w1 = "markov_head.markov_w1.weight"
        if w1 in state_dict:
            state_dict[w1] = reduce_w1(state_dict[w1], d2t, vocab)
    else:
        if "t2d" in weights or "d2t" in weights:
            notes.append("ignored t2d / d2t: the draft vocabulary is the full vocabulary (identity mappings)")
    dspark_config = build_config(FORMAT, **kwargs)
    check_weights(FORMAT, dspark_config, state_dict)
    return Converted(dspark_config, state_dict, FORMAT, notes, dropped)


def draft_vocab_ids(weights: dict[str, torch.Tensor], vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculators' `d2t` offsets (and `t2d` mask) -> (our sorted target ids, the permutation of draft ids)."""
    if "d2t" not in weights or "t2d" not in weights:
        raise ConversionError(f"{FORMAT}: draft_vocab_size = {draft_vocab} < vocab_size = {vocab} but the weights lack "
                              "the t2d / d2t vocabulary mappings")
    offsets, t2d = weights["d2t"].long(), weights["t2d"].bool()
    if tuple(offsets.shape) != (draft_vocab,) or tuple(t2d.shape) != (vocab,):
        raise ConversionError(f"{FORMAT}: d2t {tuple(offsets.shape)} / t2d {tuple(t2d.shape)} do not fit "
                              f"draft_vocab_size {draft_vocab} / vocab_size {vocab}")
    ids = torch.arange(draft_vocab) + offsets
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft_vocab:
        raise ConversionError(f"{FORMAT}: d2t does not map the draft ids to distinct target ids "
                              "(expected offsets: target id = draft id + d2t[draft id])")
    if int(t2d.sum()) != draft_vocab or not bool(t2d[ids].all()):
        raise ConversionError(f"{FORMAT}: d2t and t2d disagree about the draft vocabulary")
    order = torch.argsort(ids)
    return ids[order], order


def reduce_w1(w1: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Speculators' W1 [V, r] -> ours [(Vd + 1), r]: the draft ids' rows, then the single "unknown" row shared by
    every target id outside the draft vocabulary (refused unless those rows are all equal)."""
    if w1.shape[0] != vocab:
        raise ConversionError(f"{FORMAT}: markov_head.markov_w1.weight has {w1.shape[0]} rows, expected the verifier "
                              f"vocabulary ({vocab})")
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[d2t] = False
    rest = w1[outside]
    if rest.shape[0] == 0:
        unknown = torch.zeros_like(w1[:1])
    elif bool((rest == rest[:1]).all()):
        unknown = rest[:1]
    else:
        raise ConversionError(
            f"{FORMAT}: markov_head.markov_w1.weight has distinct rows for target tokens outside the draft vocabulary; "
            "the DSpark drafter keeps one shared row for them (the anchor is the only previous token that can be one), "
            "so this Markov head cannot be represented exactly")
    return torch.cat([w1[d2t], unknown], dim=0)
