"""Release drafters shipped inside the package (the embedded default of `dspark-hf demo`).

A release drafter is a trained, STS-calibrated DSpark drafter under `dspark_hf/release/<name>/`: `config.json` and
`model.safetensors` without the target's embedding and LM head, at most `MAX_RELEASE_BYTES`. To fit, the two
vocabulary-sized Markov matrices (V x r each; 25M parameters for SmolLM2 at r = 256) are stored as int8 with one
float32 scale per row (`<name>.int8`, `<name>.scale`; symmetric, round to nearest), everything else in bfloat16.
`load_release` dequantizes into an ordinary `DSparkDrafter` (strict: every tensor present and shaped right).
Its model card lives in the repository's `model_cards/`. `export_release` writes one atomically; git history keeps
every earlier copy, so replace it rarely.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

__all__ = [
    "MAX_RELEASE_BYTES",
    "QUANTIZED",
    "RELEASES",
    "RELEASE_DIR",
    "export_release",
    "export_target_release",
    "folder_bytes",
    "load_release",
    "load_release_drafter",
    "quantize_rows",
    "release_path",
]

RELEASE_DIR = Path(__file__).resolve().parent / "releases"
MAX_RELEASE_BYTES = 40_000_000
# registered target name -> release folder name
RELEASES: dict[str, str] = {"smollm2-135m-instruct": "smollm2-135m-instruct-dspark"}


def release_path(target_name: str) -> Path:
    """Folder of the release drafter for a registered target; a clear error when there is none."""
    if target_name not in RELEASES:
        raise KeyError(f"no release drafter for target {target_name!r}; releases exist for {sorted(RELEASES)}")
    path = RELEASE_DIR / RELEASES[target_name]
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the release drafter for {target_name!r} is missing from {path} (a broken install?); "
                                "reinstall dspark-hf or pass a drafter folder explicitly")
    return path


QUANTIZED = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: `weight ~= int8 * scale`, scale `[rows, 1]` float32 (max |w| / 127)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def load_release(path: str | Path, target=None, dtype: torch.dtype = torch.float32):
    """A `DSparkDrafter` from a release folder (int8 Markov rows dequantized), in `dtype`, bound to `target` if given."""
    from safetensors.torch import load_file

    from ..models.configuration_dspark import DSparkConfig
    from ..models.modeling_dspark import DSparkDrafter

    path = Path(path)
    try:
        config = DSparkConfig.from_pretrained(path)
        stored = load_file(path / "model.safetensors")
    except Exception as err:  # safetensors raises its own error type on a truncated file
        raise OSError(f"could not read the release drafter at {path}: {err}") from err
    drafter = DSparkDrafter(config)
    state = {}
    for name, tensor in stored.items():
        if name.endswith(".int8"):
            base = name[: -len(".int8")]
            scale = stored.get(f"{base}.scale")
            if scale is None:
                raise ValueError(f"release drafter {path}: {name} has no {base}.scale")
            state[base] = tensor.float() * scale
        elif not name.endswith(".scale"):
            state[name] = tensor
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"the release drafter at {path} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, mis-shaped {shapes[:5]}")
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    if drafter.d2t is not None:  # a reduced draft vocabulary: its stored mapping must be valid
        from ..models.modeling_dspark import validate_draft_vocab

        validate_draft_vocab(drafter.d2t, config.draft_vocab_size, config.vocab_size)
    drafter = drafter.to(dtype).eval()
    if target is not None:
        drafter.bind_target(target)
    return drafter


def load_release_drafter(target_name: str, target):
    """The release drafter for `target_name`, bound to `target` and cast to its dtype."""
    return load_release(release_path(target_name), target=target, dtype=target.dtype)


def folder_bytes(path: Path) -> int:
    """Total size of the files under `path`, in bytes."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def export_release(drafter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                   max_bytes: int = MAX_RELEASE_BYTES, quantized: tuple[str, ...] = QUANTIZED) -> Path:
    """Writes the drafter at `drafter_dir` to `out_dir`: `quantized` tensors as int8 rows, the rest in `dtype`.
    Refuses (and leaves `out_dir` untouched) when the result would exceed `max_bytes`. The old release, if any, is
    replaced only after the new one is complete."""
    from safetensors.torch import save_file

    from ..models.modeling_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(drafter_dir, dtype=torch.float32)
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if name in quantized:
            tensors[f"{name}.int8"], tensors[f"{name}.scale"] = quantize_rows(tensor)
        else:
            # integer tensors (a reduced draft vocabulary's d2t ids) keep their dtype: a float cast would corrupt ids
            tensors[name] = (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()).contiguous()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    drafter.config.save_pretrained(tmp)
    for code in tmp.glob("*.py"):  # trust_remote_code files: the int8 release loads only through load_release
        code.unlink()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt", "dspark_release": "int8-rows"})
    size = folder_bytes(tmp)
    if size > max_bytes:
        shutil.rmtree(tmp)
        raise ValueError(f"the release drafter would take {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB limit; "
                         "train a smaller one (e.g. a lower markov_rank)")
    old = out_dir.parent / f".{out_dir.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_target_release(drafter_dir: str | Path, target_name: str) -> Path:
    """`dspark-hf release`: `export_release` of `drafter_dir` into the package's release folder of the registered
    target `target_name` (one of `RELEASES`; `KeyError` otherwise). Returns that folder."""
    if target_name not in RELEASES:
        raise KeyError(f"no release folder for target {target_name!r}; releases exist for {sorted(RELEASES)}")
    return export_release(drafter_dir, RELEASE_DIR / RELEASES[target_name])
