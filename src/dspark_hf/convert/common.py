"""Shared pieces of the checkpoint converters: strict field reading, the Qwen3-shaped backbone, weights, writing.

Every converter reads its source `config.json` through a `Fields` object: each field is either *mapped* (taken into
the `DSparkConfig`), *checked* (allowed only at a value that needs no mapping, e.g. `use_sliding_window: false`),
*ignored* with a stated reason (e.g. `transformers_version`), or *refused*; `Fields.finish()` raises for any field
left over, so a field no converter knows about is an error naming it and the format, never silently dropped. Weights
go the same way: a converter maps, drops (with a reason) or refuses every tensor, and the result is loaded strictly
into a `DSparkDrafter` before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models.configuration_dspark import DSparkConfig

__all__ = [
    "ConversionError",
    "Converted",
    "Fields",
    "GEMMA4_FIELDS",
    "GENERIC_IGNORED",
    "backbone_kwargs",
    "build_config",
    "check_weights",
    "read_config",
    "read_weights",
    "write_native",
]

_MISSING = object()


class ConversionError(ValueError):
    """A checkpoint that cannot be converted faithfully; the message names the format and the field or tensor."""


@dataclass
class Converted:
    """A foreign checkpoint converted in memory.

    Attributes:
        config: the native `DSparkConfig`.
        state_dict: the drafter's tensors under our names (loads strictly into `DSparkDrafter(config)`).
        source_format: the format it came from ("deepspec", "zlab-dflash", ...).
        notes: what was dropped or ignored, with the reason (logged by `convert_checkpoint`).
        dropped: the source tensors left out (e.g. DeepSpec's copies of the target's embedding / LM head), by name.
    """

    config: DSparkConfig
    state_dict: dict[str, torch.Tensor]
    source_format: str
    notes: list[str] = field(default_factory=list)
    dropped: dict[str, torch.Tensor] = field(default_factory=dict)


# Fields of a transformers config.json that have no effect on a drafter's forward, with the reason.
GENERIC_IGNORED: dict[str, str] = {
    "architectures": "the source's model class name (the format is detected from it)",
    "dtype": "the storage dtype; the converted weights keep the dtype they are stored in",
    "torch_dtype": "the storage dtype; the converted weights keep the dtype they are stored in",
    "transformers_version": "the transformers version that wrote the file",
    "use_cache": "a KV-cache switch of the source's own generation loop",
    "auto_map": "remote-code pointers of the source implementation (the converted folder ships ours)",
    "_name_or_path": "where the source config was loaded from",
    "name_or_path": "where the source config was loaded from",
    "tie_word_embeddings": "the drafter stores no embedding or LM head (both are the target's, bound at run time)",
    "attention_dropout": "dropout acts in training only",
    "initializer_range": "initialisation of untrained weights; every converted weight is trained",
    "output_hidden_states": "a generic transformers output switch",
    "output_attentions": "a generic transformers output switch",
    "return_dict": "a generic transformers output switch",
    "torchscript": "a generic transformers export switch",
    "chunk_size_feed_forward": "a generic transformers memory setting (same outputs)",
    "is_encoder_decoder": "a generic transformers flag (the drafter is decoder-only)",
    "id2label": "classification labels (unused by a drafter)",
    "label2id": "classification labels (unused by a drafter)",
    "problem_type": "classification setting (unused by a drafter)",
    "tokenizer_class": "tokenizer metadata (the target's tokenizer is used)",
    "task_specific_params": "generation presets of the source",
    "finetuning_task": "training metadata",
    "pruned_heads": "empty in every drafter checkpoint (checked: must be empty)",
    "pretraining_tp": "Llama's tensor-parallel slicing of the linear layers during pre-training (same outputs)",
}

# DeepSpec's Gemma-4 drafter (`Gemma4DSparkModel`) and Gemma-4 text configs: fields of an architecture the drafter
# does not have (a value norm and pre/post feed-forward norms per layer, a sqrt(d)-scaled embedding, logit
# soft-capping, global / local head layouts, per-layer inputs, MoE blocks).
GEMMA4_FIELDS = (
    "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "hidden_size_per_layer_input",
    "num_global_key_value_heads", "global_head_dim", "attention_k_eq_v", "enable_moe_block", "num_kv_shared_layers",
    "use_double_wide_mlp", "query_pre_attn_scalar", "sliding_window_pattern", "vocab_size_per_layer_input",
    "target_text_model_type",
)


class Fields:
    """Strict reader of one config dict: every key must be taken, checked or ignored before `finish()`."""

    def __init__(self, data: dict[str, Any], fmt: str, where: str = "config.json") -> None:
        if not isinstance(data, dict):
            raise ConversionError(f"{fmt}: {where} must be a JSON object, got {type(data).__name__}")
        self.data = dict(data)
        self.fmt = fmt
        self.where = where
        self.used: set[str] = set()
        self.notes: list[str] = []

    def has(self, key: str) -> bool:
        return key in self.data

    def name(self, key: str) -> str:
        return f"{self.where} field {key!r}"

    def take(self, key: str, default: Any = _MISSING) -> Any:
        """The value of `key` (marked as mapped); `default` when absent, an error when absent without a default."""
        self.used.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise ConversionError(f"{self.fmt}: {self.name(key)} is missing and has no default")
        return default

    def require(self, key: str, why: str) -> Any:
        """Like `take` without default, but also refuses `null`."""
        self.used.add(key)
        value = self.data.get(key)
        if value is None:
            raise ConversionError(f"{self.fmt}: {self.name(key)} is {'null' if key in self.data else 'missing'}: {why}")
        return value

    def expect(self, key: str, allowed: tuple, why: str) -> Any:
        """A field accepted only at one of the `allowed` values (absent counts as allowed)."""
        self.used.add(key)
        value = self.data.get(key, allowed[0])
        if value not in allowed:
            raise ConversionError(f"{self.fmt}: {self.name(key)} = {value!r} is not supported: {why}")
        return value

    def ignore(self, key: str, reason: str) -> None:
        self.used.add(key)
        if key in self.data:
            self.notes.append(f"ignored {self.name(key)} = {_short(self.data[key])}: {reason}")

    def ignore_generic(self) -> None:
        for key, reason in GENERIC_IGNORED.items():
            if key == "pruned_heads" and self.data.get(key):
                raise ConversionError(f"{self.fmt}: {self.name(key)} = {self.data[key]!r}: pruned attention heads "
                                      "are not supported")
            self.ignore(key, reason)

    def refuse(self, key: str, why: str) -> None:
        if key in self.data:
            raise ConversionError(f"{self.fmt}: {self.name(key)} = {_short(self.data[key])} is not supported: {why}")

    def refuse_gemma4(self) -> None:
        present = [k for k in GEMMA4_FIELDS if k in self.data]
        model_type = str(self.data.get("model_type", ""))
        if present or model_type.startswith("gemma"):
            raise ConversionError(
                f"{self.fmt}: {self.where} describes a Gemma-4 drafter (model_type={model_type!r}"
                + (f", fields {present}" if present else "") + "): its extra norms (v_norm, pre/post feed-forward "
                "norms), sqrt(hidden_size)-scaled embedding and logit soft-capping are not part of the DSpark drafter; "
                "only Qwen3-shaped drafters convert")

    def finish(self) -> list[str]:
        left = sorted(set(self.data) - self.used)
        if left:
            raise ConversionError(
                f"{self.fmt}: {self.where} fields {left} are not understood by the converter; refusing to drop them "
                "silently (if one is harmless, add it to the converter's ignore list with the reason)")
        return self.notes


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------------------------- backbone fields

def backbone_kwargs(fields: Fields, *, sliding_supported: bool = False) -> dict[str, Any]:
    """DSparkConfig kwargs of a Qwen3-shaped backbone config (DeepSpec, z-lab, SpecForge, speculators'
    `transformer_layer_config`): sizes, norm, RoPE, attention layout. Refuses what the drafter does not have."""
    fmt = fields.fmt
    kwargs: dict[str, Any] = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        kwargs[key] = int(fields.require(key, "the drafter's size must be given"))
    kv = fields.take("num_key_value_heads", None)
    kwargs["num_key_value_heads"] = int(kv) if kv is not None else kwargs["num_attention_heads"]
    head_dim = fields.take("head_dim", None)
    kwargs["head_dim"] = int(head_dim) if head_dim is not None else kwargs["hidden_size"] // kwargs["num_attention_heads"]
    kwargs["rms_norm_eps"] = float(fields.take("rms_norm_eps", 1e-6))
    kwargs["max_position_embeddings"] = int(fields.take("max_position_embeddings", 32768))
    kwargs["attention_bias"] = bool(fields.take("attention_bias", False))
    fields.expect("mlp_bias", (False,), "the drafter's MLP has no biases")
    act = fields.take("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{fmt}: {fields.name('hidden_act')} = {act!r} is not supported: the drafter's MLP is "
                              "SwiGLU (silu)")
    kwargs["hidden_act"] = act
    kwargs.update(rope_kwargs(fields))
    # attention layout: full attention only
    layer_types = fields.take("layer_types", None)
    sliding = [i for i, t in enumerate(layer_types or []) if t != "full_attention"]
    use_sliding = bool(fields.take("use_sliding_window", False))
    if layer_types is not None and len(layer_types) != kwargs["num_hidden_layers"]:
        raise ConversionError(f"{fmt}: {fields.name('layer_types')} has {len(layer_types)} entries for "
                              f"{kwargs['num_hidden_layers']} layers")
    if sliding or (use_sliding and layer_types is None):
        kinds = sorted({layer_types[i] for i in sliding}) if sliding else ["sliding_attention"]
        raise ConversionError(
            f"{fmt}: layers {sliding or 'all'} are {kinds} ({fields.name('layer_types')} / use_sliding_window / "
            f"sliding_window = {fields.data.get('sliding_window')!r}); sliding-window drafter layers are not "
            "supported: the DSpark drafter's block attends to the whole context")
    fields.ignore("sliding_window", "read only by sliding_attention layers, and every layer is full_attention")
    fields.ignore("max_window_layers", "Qwen's sliding-window layer count, read only with use_sliding_window")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if fields.has(key):
            kwargs[key] = fields.take(key)
    fields.refuse_gemma4()
    return kwargs


def rope_kwargs(fields: Fields) -> dict[str, Any]:
    """`rope_parameters` from a config's `rope_parameters` (transformers >= 5), legacy `rope_scaling` + `rope_theta`
    or a bare `rope_theta`. The base is never left at a default when the source states it."""
    fmt = fields.fmt
    params = fields.take("rope_parameters", None)
    scaling = fields.take("rope_scaling", None)
    theta = fields.take("rope_theta", None)
    partial = fields.take("partial_rotary_factor", None)
    if params is not None and scaling is not None and params != scaling:
        raise ConversionError(f"{fmt}: {fields.name('rope_parameters')} and {fields.name('rope_scaling')} disagree")
    params = dict(params if params is not None else (scaling or {}))
    if not isinstance(params, dict):
        raise ConversionError(f"{fmt}: {fields.name('rope_parameters')} must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(f"{fmt}: {fields.name('rope_parameters')} holds per-layer-type RoPE dicts "
                              f"({sorted(params)}); the drafter has one RoPE for all its layers")
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if theta is not None:
        if "rope_theta" in params and float(params["rope_theta"]) != float(theta):
            raise ConversionError(f"{fmt}: {fields.name('rope_theta')} = {theta} disagrees with "
                                  f"rope_parameters['rope_theta'] = {params['rope_theta']}")
        params["rope_theta"] = float(theta)
    if "rope_theta" not in params:
        raise ConversionError(f"{fmt}: {fields.where} gives no RoPE base (rope_parameters.rope_theta or rope_theta); "
                              "refusing to assume a default")
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    from ..models.configuration_dspark import supported_rope_types

    if params["rope_type"] not in supported_rope_types():
        raise ConversionError(f"{fmt}: {fields.name('rope_parameters')}['rope_type'] = {params['rope_type']!r} is not "
                              f"supported (the installed transformers builds {list(supported_rope_types())})")
    return {"rope_parameters": {k: v for k, v in params.items() if v is not None}}


def build_config(fmt: str, **kwargs: Any) -> DSparkConfig:
    """`DSparkConfig(**kwargs)` with its validation errors re-raised naming the format."""
    kwargs.setdefault("converted_from", fmt)
    try:
        return DSparkConfig(**kwargs)
    except (ValueError, TypeError) as err:
        raise ConversionError(f"{fmt}: the converted configuration is invalid: {err}") from err


# ------------------------------------------------------------------------------------------------------- reading

def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from err


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint (one file or a sharded index). Pickled weights are refused."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if single.is_file():
        files = [single]
    elif index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        files = [folder / n for n in names]
    else:
        others = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(others) == 1:
            files = [folder / others[0]]
        elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ConversionError(f"{folder} holds pickled weights (*.bin / *.pt); only safetensors are read "
                                  "(pickles can run code)")
        else:
            raise ConversionError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            part = load_file(str(path))
        except Exception as err:  # safetensors raises its own error type for truncated files
            raise ConversionError(f"could not read {path} (corrupted?): {err}") from err
        overlap = set(part) & set(weights)
        if overlap:
            raise ConversionError(f"{path} repeats tensors {sorted(overlap)[:4]}")
        weights.update(part)
    return weights


def check_weights(fmt: str, config: DSparkConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raises unless `state_dict` covers `DSparkDrafter(config)` exactly (names and shapes)."""
    from ..models.modeling_dspark import DSparkDrafter

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DSparkDrafter(config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(f"{k}: {got[k]} vs {expected[k]}" for k in set(got) & set(expected) if got[k] != expected[k])
    if missing or unexpected or shapes:
        parts = []
        if unexpected:
            parts.append(f"tensors the DSpark drafter has no place for: {unexpected[:8]}")
        if missing:
            parts.append(f"tensors missing: {missing[:8]}")
        if shapes:
            parts.append(f"shape mismatches (checkpoint vs config): {shapes[:8]}")
        raise ConversionError(f"{fmt}: the weights do not match the converted configuration: " + "; ".join(parts))


# ------------------------------------------------------------------------------------------------------- writing

def write_native(converted: Converted, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Writes `converted` as a native drafter folder at `out`, atomically: everything goes to a temporary folder next
    to `out`, which is renamed into place only once complete. An interrupted conversion leaves no `out` (and no
    temporary folder: it is removed on any error)."""
    from ..models.modeling_dspark import DSparkDrafter

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.converting-", dir=out.parent))
    try:
        drafter = DSparkDrafter(converted.config)
        drafter.load_state_dict(converted.state_dict, strict=True)
        dtypes = {t.dtype for t in converted.state_dict.values() if t.is_floating_point()}
        if len(dtypes) == 1:
            drafter.to(dtype=dtypes.pop())
        drafter.save_pretrained(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
