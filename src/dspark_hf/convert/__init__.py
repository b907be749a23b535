"""Converters from published drafter formats to native DSpark drafter folders, and engine exports.

    convert_checkpoint("deepspec-draft/", "drafter/")            # format detected from config.json
    drafter = DSparkDrafter.from_pretrained("deepspec-draft/")  # the same conversion, in memory (logged)

Formats read (one module each; each module's docstring lists which fields it maps, checks, ignores and refuses):

* "deepspec" (`deepspec.py`): deepseek-ai/DeepSpec `Qwen3DSparkModel` (Markov / gated / RNN / no head).
* "zlab-dflash" (`zlab.py`): z-lab/dflash `DFlashDraftModel` (anchor slot not a prediction slot: our "dflash"
  block layout, `block_size - 1` drafts).
* "specforge" (`specforge.py`): sgl-project/SpecForge `DSparkDraftModel` / `DFlashDraftModel` with SpecForge's
  `dflash_config` keys (z-lab's layout plus DeepSpec's heads).
* "speculators" (`speculators.py`): vllm-project/speculators `dflash` / `dspark` (either layout via
  `sample_from_anchor`, reduced draft vocabularies via `d2t` / `t2d`).
* "transformers-dflash" (`transformers_dflash.py`): transformers' own DFlash assistant (`muse_glimmer_assistant`).

A conversion never drops a config field or a tensor silently: each is mapped, checked, ignored for a stated reason,
or refused with a `ConversionError` (a `ValueError`) naming the field and the format. The output folder is written
atomically (temporary folder + rename). `export.py` writes the other direction (native -> engine layouts).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..models import modeling_dspark
from .common import ConversionError, Converted, read_config, read_weights, write_native
from .detect import CONVERTERS, FORMATS, NATIVE, detect_config_format, detect_format

__all__ = ["ConversionError", "Converted", "FORMATS", "check_against_target", "convert_checkpoint",
           "detect_format", "load_converted"]

logger = logging.getLogger(__name__)


def _local_folder(src: str | os.PathLike) -> Path:
    """A local folder for `src`: the folder itself, or a Hub snapshot (config and safetensors only) of a repo id."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise ConversionError(f"{src} is a file; give the checkpoint folder")
    text = os.fspath(src)
    if text.count("/") == 1 and not text.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
        except Exception as err:  # offline, unknown repo, ...
            raise ConversionError(f"{src} is neither a local folder nor a downloadable Hub repository: {err}") from err
    raise ConversionError(f"{src} is not a checkpoint folder")


def load_converted(src: str | os.PathLike, source_format: str | None = None, *,
                   target_vocab_size: int | None = None) -> Converted:
    """Converts the checkpoint at `src` (folder or Hub id) in memory. `source_format` overrides detection.
    `target_vocab_size` is needed only by formats that store no vocabulary size ("transformers-dflash")."""
    folder = _local_folder(src)
    config = read_config(folder)
    detected = detect_config_format(config, str(folder / "config.json")) if source_format is None else source_format
    if detected == NATIVE:
        raise ConversionError(f"{src} is already a native DSpark drafter (model_type 'dspark'); nothing to convert")
    if detected not in CONVERTERS:
        raise ConversionError(f"unknown source format {detected!r}; known formats: {list(FORMATS)}")
    weights = read_weights(folder)
    if detected == "transformers-dflash":
        return CONVERTERS[detected].convert(config, weights, vocab_size=target_vocab_size)
    return CONVERTERS[detected].convert(config, weights)


def _target_vocab_size(target: Any) -> int:
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(os.fspath(target)).get_text_config().vocab_size)
    return int(target.config.get_text_config().vocab_size)


def check_against_target(converted: Converted, target: Any) -> None:
    """Checks a conversion against its target (a model, or a folder / Hub id loaded with `AutoModelForCausalLM`): the
    target fingerprint (vocab, hidden size, layer count) and, where the source stored copies of the target's
    embedding / LM head (DeepSpec, speculators), that they equal the target's. Records the target's name."""
    from ..models.modeling_dspark import DSparkDrafter

    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        name = os.fspath(target)
        target = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
        converted.config.target_name_or_path = converted.config.target_name_or_path or name
    with torch.device("meta"):
        probe = DSparkDrafter(converted.config)
    if probe.d2t is not None:
        probe.d2t = converted.state_dict["d2t"]  # the real mapping, checked against the target's vocabulary
    try:
        probe.check_target(target)
    except ValueError as err:
        raise ConversionError(f"{converted.source_format}: {err}") from err
    embed_norm = getattr(target.get_input_embeddings(), "embed_norm", None)
    if converted.source_format == "transformers-dflash" and embed_norm is not None and not isinstance(
            embed_norm, torch.nn.Identity):
        raise ConversionError(
            f"{converted.source_format}: the target's input embedding carries an embed_norm, which transformers' DFlash "
            "path bypasses for the draft block and the DSpark drafter does not; this drafter would draft differently")
    text = target.config.get_text_config()
    if converted.config.target_num_hidden_layers is None:
        converted.config.target_num_hidden_layers = int(text.num_hidden_layers)
    own = {"embed": target.get_input_embeddings().weight, "lm_head": target.get_output_embeddings().weight}
    d2t = converted.state_dict.get("d2t")
    for name, tensor in converted.dropped.items():
        kind = "embed" if "embed" in name else "lm_head" if "lm_head" in name else None
        if kind is None:
            continue
        reference = own[kind].detach().to("cpu")
        if kind == "lm_head" and d2t is not None and tensor.shape[0] == d2t.shape[0]:
            reference = reference.index_select(0, d2t)
        if tensor.shape != reference.shape or not torch.equal(tensor.to(reference.dtype), reference):
            why = (f"shape {tuple(tensor.shape)} vs {tuple(reference.shape)}" if tensor.shape != reference.shape
                   else "values differ")
            raise ConversionError(
                f"{converted.source_format}: the checkpoint's {name} is not the target's ({why}); "
                "the DSpark drafter always uses the target's own embedding and LM head, so this drafter cannot be "
                "represented (was it trained with its own head, or for another target?)")


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    source_format: str | None = None,
    *,
    target: Any = None,
    overwrite: bool = False,
) -> Path:
    """Converts the drafter checkpoint at `src` (a folder or Hub id of one of `FORMATS`; detected when
    `source_format` is None) into a native DSpark drafter folder `out`, written atomically.

    `target` (a model, folder or Hub id, optional) checks the target fingerprint and the stored embedding / LM-head
    copies against it before anything is written. Returns `out`.

    Raises:
        ConversionError: unknown format, or a field / tensor the drafter cannot represent (named in the message).
        FileExistsError: `out` exists and `overwrite` is False.
    """
    converted = load_converted(src, source_format,
                               target_vocab_size=_target_vocab_size(target) if target is not None else None)
    if target is not None:
        check_against_target(converted, target)
    for note in converted.notes:
        logger.info(f"{converted.source_format}: {note}")
    return write_native(converted, out, overwrite=overwrite)


def _read_foreign(path: str) -> tuple | None:
    """`DSparkDrafter.from_pretrained`'s hook: a foreign folder converted in memory, `None` for a native one."""
    config = read_config(Path(path))
    fmt = detect_config_format(config, os.path.join(path, "config.json"))
    if fmt == NATIVE:
        return None
    converted = CONVERTERS[fmt].convert(config, read_weights(Path(path)))
    return converted.config, converted.state_dict, fmt


if _read_foreign not in modeling_dspark.FOREIGN_FORMAT_READERS:
    modeling_dspark.FOREIGN_FORMAT_READERS.append(_read_foreign)
