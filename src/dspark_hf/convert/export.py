"""Export a DSpark drafter for the serving engines: vLLM / speculators, SGLang, DeepSpec.

`export_drafter(drafter, out, to=...)` writes a folder (`config.json` + `model.safetensors`, atomically) that the
named engine loads; `dspark-hf export --to FORMAT DRAFTER OUT [--target TARGET]` is the command for it. The three
layouts, and where each was read from:

**"speculators"**: vllm-project/speculators' DSpark format (`speculators_model_type: "dspark"`, `DSparkSpeculator`),
read from speculators at commit c05b95b3 (2026-08-20; the DSpark model is in release v0.7.0.1):
`src/speculators/models/dspark/{config,core,model_definitions}.py`, `models/dflash/{config,core}.py`, `model.py`
(`DraftVocabMixin`), `convert/dflash/converter.py`, `config.py`, `proposals/greedy.py`. vLLM reads it through
`vllm/transformers_utils/configs/speculators/{base,algos}.py` (`update_dspark`) and loads `Qwen3DSparkModel`
(`vllm/model_executor/models/qwen3_dspark.py`, vllm-project/vllm at commit 0302ff40, DSpark support added in
f5a8d733 on 2026-07-01). Config: `speculators_config` {algorithm "dspark", one greedy proposal of `block_size`
speculative tokens, verifier {name_or_path, architectures}}, `transformer_layer_config` (a Qwen3 config of the draft
layers: the drafter's backbone is Qwen3-shaped whatever the target family), `draft_vocab_size`, `block_size`
(rows of the block input), `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1 (speculators / vLLM index the
hidden state *before* layer i; z-lab / DeepSpec / we index HF `hidden_states[i + 1]`, the output of layer i; see
speculators' DFlash converter and vLLM's `update_dspark`, which maps back with `i - 1`), `mask_token_id`,
`sample_from_anchor` (True for our "dspark" block layout, False for "dflash"), `markov_rank` (0 without a sequential
head), `markov_head_type` ("vanilla" / "gated" / "rnn"), `enable_confidence_head`, `confidence_head_with_markov`.
Weights: `embed_tokens.weight` [V, d] and `lm_head.weight` [Vd, d] (copies of the target's; `lm_head` only its
draft-vocabulary rows), `t2d` [V] bool and `d2t` [Vd] int64 *offsets* (target id = draft id + d2t[draft id]) with a
reduced vocabulary, the backbone under our names (`fc`, `hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`.{q,k}_norm`, `.mlp.{gate,up,down}_proj`, `.{input,post_attention}_layernorm`, `norm`), `markov_head.markov_w1`
[V, r] (speculators' W1 indexes the *verifier* vocabulary: a reduced-vocabulary drafter's W1 ((Vd + 1) x r, one
"unknown" row) is expanded exactly, every target id outside the draft vocabulary reading the unknown row),
`markov_head.markov_w2` [Vd, r], `markov_head.gate_proj.*` (gated) or `markov_head.joint_proj.*` (rnn; our
`rnn_proj`, same [state; W1[x]; h] input order), `confidence_head.proj.*`.

**"deepspec"**: deepseek-ai/DeepSpec's format (`Qwen3DSparkModel`, the format of the published
`deepseek-ai/dspark_qwen3_*_block7` drafters), read from DeepSpec at commit afdfa7c
(`deepspec/modeling/dspark/{qwen3/config,qwen3/modeling,markov_head}.py`) and checked against the recorded fixture
checkpoints (tests/fixtures/export/). A Qwen3 config (`model_type: "qwen3"`, `architectures: ["Qwen3DSparkModel"]`,
`rope_parameters`, `layer_types`) plus `block_size`, `target_layer_ids` (our indexing), `num_target_layers`,
`mask_token_id`, `num_anchors` (a training setting DeepSpec requires; 512 as its configs), `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`. Weights: our names plus
`embed_tokens.weight` and `lm_head.weight` (full copies of the target's), `markov_head.joint_proj.*` for the RNN head.
vLLM's `"method": "dspark"` loads this layout directly (`Qwen3DSparkForCausalLM.load_weights`; it shares the target's
embedding / LM head when the copies equal them).

**"sglang"**: the DeepSpec layout without the `embed_tokens` / `lm_head` copies, which SGLang's DSpark loader skips
(it always uses the live target's modules): sgl-project/sglang `python/sglang/srt/models/dspark.py`
(`DSparkDraftMixin.load_weights`, `_DSPARK_SKIPPED_WEIGHT_PREFIXES`, `build_markov_head`, `build_confidence_head`)
and `python/sglang/srt/speculative/dspark_components/dspark_config.py` (`parse_dspark_draft_config`,
`resolve_runtime_config`), at commit 01f47623. vLLM's DSpark path also takes this folder (embedding / LM head are
then shared from the target).

What each layout cannot hold (refused with a `ValueError` naming the way out):

* a learned mask embedding (`mask_token_id=None`): every engine fills the mask slots with the embedding of a token id.
  For "speculators" / "deepspec" pass `mask_token_id=ID`, a token the target never reads or writes (e.g. a padding row
  of the embedding past the tokenizer's vocabulary; DeepSpec uses 151669 for Qwen3): the exported drafter-owned
  `embed_tokens` carries the learned vector in that row, so drafts are unchanged as long as that id never occurs.
  SGLang uses the target's own embedding: no way to export a learned mask there.
* a reduced draft vocabulary in "deepspec" / "sglang" (their Markov head and LM head cover the full vocabulary; a
  zero-padded W2 would let the drafter propose tokens it never could); use "speculators".
* the "dflash" block layout in "deepspec" / "sglang" (DeepSpec trains slot k to predict anchor + k + 1; SGLang refuses
  other conventions); "speculators" carries it as `sample_from_anchor: false`.
* no sequential head in "sglang" (its DSpark path requires `markov_rank > 0`); `target_layer_ids` with -1 (the
  embedding output; DeepSpec and, as aux layer 0, speculators take it) in "sglang"; `target_layer_ids` that are not
  strictly increasing (the engines capture hidden states in layer order); a target LM head with a bias.

Uncertain (not checkable here: no engine runs on this machine, and none of the engines' packages is installed):

* vLLM's `update_dspark` as read sets `dspark_bonus_anchor = True` for every speculators checkpoint, i.e. serves the
  block as anchor + N masks with drafts from slots 1..N: right for our "dflash" layout (`sample_from_anchor: false`),
  one position off for the "dspark" layout (`sample_from_anchor: true`, speculators' own DSpark default) unless the
  installed vLLM honours `sample_from_anchor` (a fix reported downstream). SGLang refuses speculators-format DSpark
  checkpoints outright (`speculators_convention`). For the default "dspark" layout serve the "deepspec" / "sglang"
  export in vLLM.
* vLLM's `qwen3_dspark.py` as read builds only the vanilla Markov head (`markov_w1`, `markov_w2`): gated / RNN heads
  load in speculators, DeepSpec and SGLang (all three implement them) but not in that vLLM.
* `sliding_window_non_causal` is written True: speculators reads it only for sliding-window layers (the drafter has
  none), while vLLM's DFlash config updater maps it to `dflash_config.causal = not value` for all layers, and the
  drafter's block attention is bidirectional.
* SGLang's `build_confidence_head` (as read) builds the confidence head whatever `enable_confidence_head` says and
  then requires its weights: a drafter without a confidence head may need `SGLANG_RAGGED_VERIFY_MODE=static` there.
* STS temperatures are not part of any layout (SGLang takes them from `--speculative-dspark-confidence-sts-path`);
  they are kept, with the rest of our config, in a side file `dspark_hf_export.json` (the engines read only
  config.json and the weights; config.json holds only the layout's own fields) for a lossless way back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["EXPORT_FORMATS", "SIDE_FILE", "ExportedCheckpoint", "build_export", "export_drafter", "serve_command"]

EXPORT_FORMATS = ("speculators", "sglang", "deepspec")
SPECULATORS_VERSION = "0.7.0.1"  # the speculators release whose DSpark layout this writes
DEEPSPEC_NUM_ANCHORS = 512  # DeepSpec's configs (config/dspark/*.py); a training setting, required in the config
_HEAD_TYPES = {"markov": "vanilla", "gated_markov": "gated", "rnn": "rnn"}
SIDE_FILE = "dspark_hf_export.json"  # our own config fields, beside the engine's config.json


@dataclass
class ExportedCheckpoint:
    """What an export writes: `config` (config.json), `tensors` (model.safetensors) and `ours` (our own config
    fields and the export's format, `dspark_hf_export.json`)."""

    format: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    ours: dict[str, Any]


# ----------------------------------------------------------------------------------------------- building blocks
def _drafter_of(drafter: Any):
    from ..models.modeling_dspark import DSparkDrafter

    if isinstance(drafter, DSparkDrafter):
        return drafter
    return DSparkDrafter.from_pretrained(drafter)


def _target_of(target: Any, dtype: torch.dtype | None):
    """A loaded target model: the model itself, a registered target name, or a local folder / Hub id."""
    if target is None or isinstance(target, torch.nn.Module):
        return target
    from ..testbed.targets import TARGETS, load_target

    if isinstance(target, str) and target in TARGETS:
        return load_target(target, dtype or torch.float32)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=dtype or "auto").eval()


def _target_weights(target, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if embed is None or head is None:
        raise ValueError("the target must expose input embeddings and an LM head (get_output_embeddings())")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the target's LM head has a bias, which none of the export layouts can hold")
    e, h = embed.weight.detach(), head.weight.detach()
    if e.shape[0] != vocab_size or h.shape[0] != vocab_size:
        raise ValueError(f"the target's embedding ({tuple(e.shape)}) / LM head ({tuple(h.shape)}) do not have the "
                         f"drafter's vocab_size={vocab_size} rows: is this the drafter's target?")
    return e, h


def _verifier(target, drafter, name: str | None) -> tuple[str | None, list[str]]:
    cfg = getattr(target, "config", None)
    name = name or (getattr(cfg, "_name_or_path", None) if cfg is not None else None) or \
        drafter.config.target_name_or_path
    archs = list(getattr(cfg, "architectures", None) or []) if cfg is not None else []
    if not archs and target is not None:  # an in-memory model: what save_pretrained would write
        archs = [type(target).__name__]
    return (str(name) if name else None), archs


def _mask_id(drafter, mask_token_id: int | None, fmt: str) -> int:
    cfg = drafter.config
    if cfg.mask_token_id is not None:
        if mask_token_id is not None and int(mask_token_id) != int(cfg.mask_token_id):
            raise ValueError(f"the drafter fills its mask slots with token {cfg.mask_token_id}; mask_token_id="
                             f"{mask_token_id} would change its drafts")
        return int(cfg.mask_token_id)
    if fmt == "sglang":
        raise ValueError("this drafter uses a learned mask embedding (mask_token_id=None); SGLang fills the mask slots "
                         "with the target's own embedding of a token id, so it cannot be exported for SGLang. Export "
                         "it with to='deepspec' (vLLM's dspark method) or to='speculators' and a mask_token_id")
    if mask_token_id is None:
        raise ValueError("this drafter uses a learned mask embedding (mask_token_id=None), which the serving formats "
                         "cannot hold: pass mask_token_id=ID (`--mask-token-id`), a token id the target never reads "
                         "or writes (e.g. an embedding row past the tokenizer's vocabulary); the exported embedding "
                         "carries the learned vector in that row")
    if not 0 <= int(mask_token_id) < cfg.vocab_size:
        raise ValueError(f"mask_token_id must lie in [0, {cfg.vocab_size}), got {mask_token_id}")
    return int(mask_token_id)


def _layer_types(n: int) -> list[str]:
    return ["full_attention"] * n


def _rope(cfg) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return {k: v for k, v in params.items() if v is not None}
    return {"rope_theta": float(cfg.rope_theta or 10000.0), "rope_type": "default"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _our_config(drafter) -> dict[str, Any]:
    """Our own config fields (JSON-safe), written to `dspark_hf_export.json` beside config.json."""
    from .. import __version__

    keep = {k: v for k, v in drafter.config.to_dict().items()
            if k in ("sequential_head", "confidence_head", "confidence_head_with_markov", "block_layout",
                     "sts_temperatures", "loss_decay", "draft_candidates", "draft_vocab_size", "mask_token_id",
                     "target_name_or_path", "target_vocab_size", "target_hidden_size", "target_num_hidden_layers",
                     "target_model_type", "target_layer_ids", "block_size")}
    return {"exported_by": f"dspark_hf {__version__}", **json.loads(json.dumps(keep))}


# Every tensor a layout has a place for (our names); anything else in a drafter is refused, never dropped.
_KNOWN = re.compile(
    r"(fc\.weight|hidden_norm\.weight|norm\.weight|mask_embedding|d2t"
    r"|layers\.\d+\.(self_attn\.(q|k|v|o)_proj\.(weight|bias)|self_attn\.(q|k)_norm\.weight"
    r"|mlp\.(gate|up|down)_proj\.weight|input_layernorm\.weight|post_attention_layernorm\.weight)"
    r"|markov_head\.(markov_w1|markov_w2)\.weight|markov_head\.(gate_proj|rnn_proj)\.(weight|bias)"
    r"|confidence_head\.proj\.(weight|bias))")


def _backbone(drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in drafter.state_dict().items():
        if not _KNOWN.fullmatch(name):
            raise ValueError(f"the drafter holds {name!r}, which the export layouts have no place for")
        if name in ("mask_embedding", "d2t") or name.startswith(("markov_head.", "confidence_head.")):
            continue
        out[name] = tensor.detach().to("cpu", dtype)
    return out


def _heads(drafter, dtype: torch.dtype, full_w1: bool) -> dict[str, torch.Tensor]:
    """The sequential and confidence heads; W1 over the full target vocabulary when `full_w1`."""
    out: dict[str, torch.Tensor] = {}
    head = drafter.markov_head
    if head is not None:
        w1 = head.markov_w1.weight.detach()
        if full_w1 and drafter.d2t is not None:  # [Vd + 1, r] by draft id (+ unknown) -> [V, r] by target id
            ids = torch.arange(drafter.config.vocab_size, device=w1.device)
            w1 = w1[drafter.to_draft_inputs(ids.to(drafter.d2t.device)).to(w1.device)]
        out["markov_head.markov_w1.weight"] = w1
        out["markov_head.markov_w2.weight"] = head.markov_w2.weight.detach()
        for name, tensor in head.state_dict().items():
            if name.startswith(("gate_proj.", "rnn_proj.")):
                out["markov_head." + name.replace("rnn_proj.", "joint_proj.")] = tensor.detach()
    if drafter.confidence_head is not None:
        for name, tensor in drafter.confidence_head.state_dict().items():
            out["confidence_head." + name] = tensor.detach()
    return {k: v.to("cpu", dtype) for k, v in out.items()}


def _embedding(drafter, target_embed: torch.Tensor, mask_id: int, dtype: torch.dtype) -> torch.Tensor:
    embed = target_embed.detach().to("cpu", dtype).clone()
    if drafter.mask_embedding is not None:  # the learned mask vector goes into the chosen row
        embed[mask_id] = drafter.mask_embedding.detach().to("cpu", dtype)
    return embed


def _confidence_flags(cfg) -> tuple[bool, bool]:
    enabled = bool(cfg.confidence_head)
    with_markov = enabled and cfg.sequential_head != "none" and bool(getattr(cfg, "confidence_head_with_markov", True))
    return enabled, with_markov


# ---------------------------------------------------------------------------------------------------- layouts
def _check_layout(drafter, fmt: str) -> None:
    cfg = drafter.config
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {EXPORT_FORMATS}")
    layout = getattr(cfg, "block_layout", "dspark")
    if fmt in ("deepspec", "sglang"):
        if layout != "dspark":
            raise ValueError(f"the {layout!r} block layout (anchor slot predicting nothing) cannot be written as "
                             f"{fmt!r}: DeepSpec / SGLang read slot k as predicting anchor + k + 1. Use "
                             "to='speculators' (sample_from_anchor=false)")
        if cfg.draft_vocab_size is not None:
            raise ValueError(f"a reduced draft vocabulary cannot be written as {fmt!r} (its Markov and LM heads cover "
                             "the full vocabulary); use to='speculators' (d2t / t2d)")
    ids = [int(i) for i in cfg.target_layer_ids]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"target_layer_ids {ids} are not strictly increasing: the engines capture the target's "
                         "hidden states in layer order (DeepSpec also asserts it), so the drafter's feature order "
                         "would be lost")
    if fmt == "sglang" and any(i < 0 for i in ids):
        raise ValueError(f"target_layer_ids {ids} name the embedding output (-1), which SGLang refuses; use "
                         "to='deepspec' or to='speculators'")
    if fmt == "sglang" and cfg.sequential_head == "none":
        raise ValueError("SGLang's DSpark path requires a sequential head (markov_rank > 0); a drafter without one "
                         "cannot be exported for it (to='deepspec' keeps it as markov_rank 0)")


def _qwen3_fields(cfg, dtype: torch.dtype, text=None) -> dict[str, Any]:
    """The Qwen3 config fields of the draft layers (`text`: the target's text config, for the fields DeepSpec copies
    from it and nothing reads with sliding windows off)."""
    import transformers

    return {
        "attention_bias": bool(cfg.attention_bias),
        "attention_dropout": 0.0,
        "dtype": _dtype_name(dtype),
        "head_dim": int(cfg.head_dim),
        "hidden_act": cfg.hidden_act,
        "hidden_size": int(cfg.hidden_size),
        "initializer_range": float(cfg.initializer_range),
        "intermediate_size": int(cfg.intermediate_size),
        "layer_types": _layer_types(cfg.num_hidden_layers),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "max_window_layers": int(getattr(text, "max_window_layers", None) or cfg.num_hidden_layers),
        "model_type": "qwen3",
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "num_key_value_heads": int(cfg.num_key_value_heads),
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "rope_parameters": _rope(cfg),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(cfg.vocab_size),
    }


def _deepspec(drafter, fmt: str, target, mask_id: int, dtype: torch.dtype) -> ExportedCheckpoint:
    cfg = drafter.config
    enabled, with_markov = _confidence_flags(cfg)
    tcfg = getattr(target, "config", None)
    text = tcfg.get_text_config() if tcfg is not None else None
    config: dict[str, Any] = {
        "architectures": ["Qwen3DSparkModel"],
        **_qwen3_fields(cfg, dtype, text),
        "block_size": int(cfg.block_size),
        "bos_token_id": getattr(text, "bos_token_id", None),
        "eos_token_id": getattr(text, "eos_token_id", None),
        "pad_token_id": getattr(text, "pad_token_id", None),
        "enable_confidence_head": enabled,
        "markov_rank": int(cfg.markov_rank) if cfg.sequential_head != "none" else 0,
        "mask_token_id": mask_id,
        "num_anchors": DEEPSPEC_NUM_ANCHORS,
        "num_target_layers": int(cfg.target_num_hidden_layers or getattr(text, "num_hidden_layers", 0) or 0) or None,
        "target_layer_ids": [int(i) for i in cfg.target_layer_ids],
    }
    if enabled:
        config["confidence_head_with_markov"] = with_markov
    if cfg.sequential_head != "none":
        config["markov_head_type"] = _HEAD_TYPES[cfg.sequential_head]
    if config["num_target_layers"] is None:
        raise ValueError("the drafter's config has no target_num_hidden_layers and no target was given: DeepSpec's "
                         "config needs num_target_layers (pass target=)")
    config = dict(sorted(config.items()))
    tensors = _backbone(drafter, dtype)
    tensors.update(_heads(drafter, dtype, full_w1=False))
    if fmt == "deepspec":
        if target is None:
            raise ValueError("to='deepspec' carries copies of the target's embedding and LM head: pass target=")
        embed, head = _target_weights(target, cfg.vocab_size)
        tensors["embed_tokens.weight"] = _embedding(drafter, embed, mask_id, dtype)
        tensors["lm_head.weight"] = head.to("cpu", dtype).clone()
    return ExportedCheckpoint(fmt, config, tensors, {**_our_config(drafter), "format": fmt})


def _speculators(drafter, target, mask_id: int, dtype: torch.dtype, verifier: str | None) -> ExportedCheckpoint:
    cfg = drafter.config
    if target is None:
        raise ValueError("to='speculators' carries copies of the target's embedding and LM head: pass target=")
    embed, head = _target_weights(target, cfg.vocab_size)
    enabled, with_markov = _confidence_flags(cfg)
    layout = getattr(cfg, "block_layout", "dspark")
    slots = int(getattr(cfg, "num_block_slots", cfg.block_size))
    name, archs = _verifier(target, drafter, verifier)
    vd = int(cfg.draft_vocab_size or cfg.vocab_size)
    import transformers

    tl = _qwen3_fields(cfg, dtype)
    for key in ("dtype", "transformers_version"):
        tl.pop(key)
    config: dict[str, Any] = {
        "architectures": ["DSparkSpeculator"],
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.target_layer_ids],
        "block_size": slots,
        "confidence_head_with_markov": with_markov,
        "draft_vocab_size": vd,
        "dtype": _dtype_name(dtype),
        "enable_confidence_head": enabled,
        "markov_head_type": _HEAD_TYPES.get(cfg.sequential_head, "vanilla"),
        "markov_rank": int(cfg.markov_rank) if cfg.sequential_head != "none" else 0,
        "mask_token_id": mask_id,
        "sample_from_anchor": layout == "dspark",
        "sliding_window_non_causal": True,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": int(cfg.block_size), "verifier_accept_k": 1}],
            "verifier": {"architectures": archs, "name_or_path": name},
        },
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": tl,
        "transformers_version": transformers.__version__,
    }
    tensors = _backbone(drafter, dtype)
    tensors.update(_heads(drafter, dtype, full_w1=True))
    tensors["embed_tokens.weight"] = _embedding(drafter, embed, mask_id, dtype)
    if drafter.d2t is not None:
        d2t = drafter.d2t.detach().to("cpu", torch.long)
        tensors["lm_head.weight"] = head.to("cpu", dtype)[d2t].clone()
        tensors["d2t"] = (d2t - torch.arange(d2t.shape[0])).contiguous()
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, d2t, True)
    else:
        tensors["lm_head.weight"] = head.to("cpu", dtype).clone()
    return ExportedCheckpoint("speculators", config, tensors, {**_our_config(drafter), "format": "speculators"})


def build_export(drafter, to: str, *, target=None, mask_token_id: int | None = None, dtype: torch.dtype | None = None,
                 verifier_name_or_path: str | None = None) -> ExportedCheckpoint:
    """The config and tensors of `drafter` in layout `to` (see the module docstring), without writing anything.

    `target` (a loaded model) supplies the embedding / LM head copies ("speculators", "deepspec") and the verifier
    name; `mask_token_id` places a learned mask embedding; `dtype` casts the floating-point weights (default: the
    drafter's)."""
    drafter = _drafter_of(drafter)
    _check_layout(drafter, to)
    dtype = dtype or drafter.dtype
    mask_id = _mask_id(drafter, mask_token_id, to)
    if to == "speculators":
        return _speculators(drafter, target, mask_id, dtype, verifier_name_or_path)
    return _deepspec(drafter, to, target, mask_id, dtype)


# ---------------------------------------------------------------------------------------------------- writing
def _write_folder(exported: ExportedCheckpoint, out: Path, overwrite: bool) -> Path:
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (`--overwrite`) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        tensors = {k: v.detach().contiguous() for k, v in exported.tensors.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(exported.config, indent=2) + "\n")
        (tmp / SIDE_FILE).write_text(json.dumps(exported.ours, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_drafter(drafter, out: str | os.PathLike, to: str = "speculators", *, target=None,
                   mask_token_id: int | None = None, dtype: torch.dtype | None = None,
                   verifier_name_or_path: str | None = None, overwrite: bool = False) -> Path:
    """Writes `drafter` (a `DSparkDrafter` or its folder) to the folder `out` in layout `to` ("speculators",
    "sglang" or "deepspec"; see the module docstring), atomically: a temporary folder beside `out`, renamed into place
    once complete (an existing `out` only with `overwrite=True`).

    `target`: the target model, a registered target name or a folder / Hub id; required by "speculators" and
    "deepspec" (they carry copies of its embedding and LM head) and used for the verifier name. Returns `out`."""
    drafter = _drafter_of(drafter)
    target = _target_of(target, dtype)
    exported = build_export(drafter, to, target=target, mask_token_id=mask_token_id, dtype=dtype,
                            verifier_name_or_path=verifier_name_or_path)
    return _write_folder(exported, Path(out), overwrite)


def serve_command(to: str, out: str | os.PathLike, target: str, block_size: int) -> str:
    """The serving command line for an exported folder (vLLM for "speculators" / "deepspec", SGLang for "sglang")."""
    if to == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DSPARK "
                f"--speculative-draft-model-path {out} --speculative-dspark-block-size {block_size}")
    spec = json.dumps({"model": str(out), "method": "dspark", "num_speculative_tokens": int(block_size)})
    return f"vllm serve {target} --speculative-config '{spec}'"
