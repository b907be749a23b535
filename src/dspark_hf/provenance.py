"""Provenance for measurements: git commit, package versions, device, and atomic JSON / text writes.

Every benchmark writes its numbers together with `provenance()` so that a figure in README.md or RESULTS.md can be
traced to the code and machine that produced it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text", "device_description", "git_commit", "make_shareable",
           "provenance"]


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The current commit (with `-dirty` when the tree has changes), or None outside a git checkout."""
    try:
        cwd = cwd or Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpuinfo(path: str | os.PathLike = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of Linux `/proc/cpuinfo` ("model name", "cpu family", "model", "flags", ...), or
    an empty dict where the file cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:  # the first processor's block is enough
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux `/proc/cpuinfo`), or "" where it cannot be read."""
    return _cpuinfo(cpuinfo).get("model name", "")


def cpu_signature(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's family / model numbers and widest vector unit, e.g. "family 23 model 49, AVX2" (Linux
    `/proc/cpuinfo`), or "" where they cannot be read. Virtual machines often report a bare name ("AMD EPYC") for
    CPUs of different generations whose cost curves differ; these numbers tell them apart."""
    fields = _cpuinfo(cpuinfo)
    flags = set(fields.get("flags", "").split())
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    parts = []
    if "cpu family" in fields and "model" in fields:
        parts.append(f"family {fields['cpu family']} model {fields['model']}")
    if simd:
        parts.append(simd)
    return ", ".join(parts)


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux `/proc/cpuinfo`), or an empty set where they cannot be read."""
    return set(_cpuinfo(cpuinfo).get("flags", "").split())


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool | None:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX-BF16); None where the flags cannot be read.

    Without either, PyTorch converts every bf16 operand to fp32 and back: on an AVX2-only EPYC one SmolLM2-135M
    forward under bf16 autocast took 5.6-7.2x as long as in fp32 (`scripts/bench_cpu_bf16.py`, results/cpu_bf16)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def device_description(device: torch.device | str | None = None) -> str:
    """What a measurement ran on: the GPU's name, or the CPU's model, architecture, cores and torch threads (CPU models
    change between machines, and a cost curve measured on one does not describe another)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    model = cpu_model()
    signature = cpu_signature()
    return (f"{model + ' ' if model else ''}{'(' + signature + ') ' if signature else ''}"
            f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()} (torch threads {torch.get_num_threads()})")


def provenance(device: torch.device | str | None = None, **extra: Any) -> dict[str, Any]:
    """A dict describing where and with what a measurement was made."""
    import transformers

    try:
        from . import __version__
    except ImportError:  # a copy in a drafter's custom_generate/ folder (dspark_hf.hub.remote_code): no package
        __version__ = None

    return {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "dspark_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device_description(device),
        **extra,
    }


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8) to `path` via a temporary file and a rename, so readers never see half a file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` via a temporary file and a rename, so readers never see half a file (mode 0644 less
    the umask, as a plain `open` would give)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        make_shareable(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_shareable(path: str | os.PathLike) -> None:
    """Gives a file written through a temporary file (mkstemp and safetensors create 0600) the mode a plain `open`
    would: 0644 less the umask, so shipped or shared data is readable by others."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o644 & ~umask)


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
