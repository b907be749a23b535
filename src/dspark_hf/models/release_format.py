"""Reading the int8 release format of a DSpark drafter (one implementation for `DSparkDrafter.from_pretrained` and
`dspark_hf.testbed.release.load_release`).

A release `model.safetensors` stores the vocabulary-sized Markov matrices as symmetric int8 rows with one float32
scale per row (`<name>.int8`, `<name>.scale`) and everything else in a smaller float dtype; its safetensors metadata
says `{"dspark_release": "int8-rows"}`. `is_int8_release` recognises the format by that metadata or, failing it, by
its `.int8` / `.scale` key pairs; `dequantize_release_state` turns the stored tensors back into an ordinary state dict.
The writing side (`quantize_rows`, `export_release`) lives in `dspark_hf.testbed.release`.

Imports nothing from `dspark_hf`, so it travels with `modeling_dspark.py` into a `trust_remote_code` folder.
"""

from __future__ import annotations

import os

import torch

RELEASE_METADATA_KEY = "dspark_release"
INT8_ROWS = "int8-rows"
INT8_SUFFIX, SCALE_SUFFIX = ".int8", ".scale"

__all__ = ["INT8_ROWS", "RELEASE_METADATA_KEY", "dequantize_release_state", "is_int8_release"]


def is_int8_release(weights_file: str | os.PathLike) -> bool:
    """Whether the safetensors file is in the int8 release format (metadata, else `.int8` + `.scale` key pairs).
    An unreadable file is not (the regular loading path reports it)."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(weights_file), framework="pt") as handle:
            if (handle.metadata() or {}).get(RELEASE_METADATA_KEY) == INT8_ROWS:
                return True
            keys = set(handle.keys())
    except Exception:  # safetensors raises its own error type on a truncated file
        return False
    return any(k.endswith(INT8_SUFFIX) and k[: -len(INT8_SUFFIX)] + SCALE_SUFFIX in keys for k in keys)


def dequantize_release_state(stored: dict[str, torch.Tensor], where: str = "") -> dict[str, torch.Tensor]:
    """`name.int8` x `name.scale` -> `name` (float32); every other tensor unchanged. `ValueError` for an int8 tensor
    without its scale (or a scale of the wrong shape)."""
    state = {}
    for name, tensor in stored.items():
        if name.endswith(INT8_SUFFIX):
            base = name[: -len(INT8_SUFFIX)]
            scale = stored.get(base + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"release drafter {where}: {name} has no {base}{SCALE_SUFFIX}")
            if scale.dim() != 2 or scale.shape[0] != tensor.shape[0] or scale.shape[1] != 1:
                raise ValueError(f"release drafter {where}: {base}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, "
                                 f"expected ({tensor.shape[0]}, 1)")
            state[base] = tensor.float() * scale.float()
        elif not name.endswith(SCALE_SUFFIX):
            state[name] = tensor
    return state
