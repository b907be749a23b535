"""Release drafters shipped inside the package (the embedded default of `dspark-hf demo`).

A release drafter is a trained, STS-calibrated DSpark drafter stored in bfloat16 under `dspark_hf/release/<name>/`
(`config.json` + `model.safetensors`, without the target's embedding and LM head), at most `MAX_RELEASE_BYTES`.
Its model card lives in the repository's `model_cards/`. `export_release` writes one atomically; git history keeps
every earlier copy, so replace it rarely.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

RELEASE_DIR = Path(__file__).resolve().parent / "release"
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


def load_release_drafter(target_name: str, target):
    """The release drafter for `target_name`, bound to `target` and cast to its dtype."""
    from .modeling_dspark import DSparkDrafter

    return DSparkDrafter.from_pretrained(release_path(target_name), target=target, dtype=target.dtype).eval()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def export_release(drafter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                   max_bytes: int = MAX_RELEASE_BYTES) -> Path:
    """Writes the drafter at `drafter_dir` to `out_dir` in `dtype`; refuses (and leaves `out_dir` untouched) when the
    result would exceed `max_bytes`. The old release, if any, is replaced only after the new one is complete."""
    from .modeling_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(drafter_dir, dtype=dtype)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
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
