"""Which checkpoint format a folder holds, from its `config.json` (and, for ambiguous cases, its tensor names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import deepspec, specforge, speculators, transformers_dflash, zlab
from .common import ConversionError, read_config

NATIVE = "dspark"

# Checked in this order: the first format whose `matches(config)` holds.
CONVERTERS = {
    speculators.FORMAT: speculators,
    transformers_dflash.FORMAT: transformers_dflash,
    deepspec.FORMAT: deepspec,
    specforge.FORMAT: specforge,
    zlab.FORMAT: zlab,
}
FORMATS = tuple(CONVERTERS)

__all__ = ["CONVERTERS", "FORMATS", "NATIVE", "detect_config_format", "detect_format"]


def detect_config_format(config: dict[str, Any], where: str = "config.json") -> str:
    """The format of a parsed `config.json`: `"dspark"` for a native drafter, else one of `FORMATS`."""
    if config.get("model_type") == NATIVE:
        return NATIVE
    for name, module in CONVERTERS.items():
        if module.matches(config):
            return name
    hint = {k: config[k] for k in ("model_type", "architectures") if k in config}
    raise ConversionError(f"{where} is not a known drafter format ({hint}); known formats: {list(FORMATS)} "
                          f"(give the format explicitly if it is one of them)")


def detect_format(folder: str | os.PathLike) -> str:
    """The format of the checkpoint folder `folder`: `"dspark"` (native) or one of `FORMATS`."""
    return detect_config_format(read_config(Path(folder)), str(Path(folder) / "config.json"))
