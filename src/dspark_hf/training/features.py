"""Target features for drafter training: online (the frozen target runs inside the step) or offline (a cache).

Both produce a `FeatureBatch`: the concatenated outputs of the drafter's target layers (`context`, `[B, T, m*d]`) and
the target's final normed hidden state (`final_hidden`, `[B, T, d]`, which the frozen LM head turns into the target's
distributions at the supervised positions only), for right-padded sequences.

The offline cache is a folder of safetensors shards (`features-00000.safetensors`, tensors `<id>.context` and
`<id>.final`) plus `manifest.json` (target fingerprint, layer ids, dtype, example ids per shard). Shards are written to
a temporary name and renamed when complete, and the manifest is rewritten after each shard, so an interrupted build
resumes where it stopped. A cache built for another target or other layers is refused. Entries are keyed by the
example id *and* a checksum of its tokens (`feature_key`): an example whose answer changed (regenerated data under the
same id) is a cache miss and gets new features, never the stale ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from .data import TokenizedExample
from ..provenance import atomic_write_json
from ..decoding.sps import target_fingerprint

__all__ = ["FeatureBatch", "FeatureCache", "OnlineFeatures", "build_feature_cache", "feature_key", "pad_examples"]

CACHE_FORMAT = "id#crc32"  # manifest "key_format": how entries are named (older caches without it are refused)


def feature_key(example: TokenizedExample) -> str:
    """The cache entry name of an example: its id plus a CRC-32 of its token ids (so changed tokens miss)."""
    import zlib

    crc = zlib.crc32(torch.tensor(example.input_ids, dtype=torch.int64).numpy().tobytes())
    return f"{example.id}#{crc:08x}"


@dataclass
class FeatureBatch:
    """Right-padded batch. `input_ids`, `loss_mask`, `attention_mask` `[B, T]`; `context` `[B, T, m*d]`;
    `final_hidden` `[B, T, d]`."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    context: torch.Tensor
    final_hidden: torch.Tensor


def pad_examples(examples: Sequence[TokenizedExample], max_length: int | None = None,
                 pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pads (and truncates to `max_length`) -> input_ids, loss_mask, attention_mask `[B, T]`."""
    rows = [(e.input_ids[:max_length], e.loss_mask[:max_length]) for e in examples]
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r_ids, r_mask) in enumerate(rows):
        ids[i, : len(r_ids)] = torch.tensor(r_ids)
        loss[i, : len(r_mask)] = torch.tensor(r_mask)
        attn[i, : len(r_ids)] = 1
    return ids, loss, attn


class OnlineFeatures:
    """Runs the frozen target on each batch and captures the drafter's layers and the final normed state."""

    def __init__(self, target, target_layer_ids: Sequence[int]) -> None:
        self.target = target.eval().requires_grad_(False)
        self.layer_ids = list(target_layer_ids)
        self.num_layers = target.config.get_text_config().num_hidden_layers

    @torch.no_grad()
    def __call__(self, examples: Sequence[TokenizedExample], max_length: int | None = None) -> FeatureBatch:
        ids, loss, attn = pad_examples(examples, max_length)
        device = self.target.device
        wanted = [i + 1 for i in self.layer_ids] + [self.num_layers]
        out = self.target(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=wanted,
                          logits_to_keep=1)
        hs = out.hidden_states
        context = torch.cat([hs[i + 1] for i in self.layer_ids], dim=-1)
        return FeatureBatch(input_ids=ids, loss_mask=loss, attention_mask=attn, context=context,
                            final_hidden=hs[self.num_layers])


class FeatureCache:
    """Reads an offline feature cache; `__call__` gives the same `FeatureBatch` as `OnlineFeatures`."""

    def __init__(self, cache_dir: str | Path, target=None, target_layer_ids: Sequence[int] | None = None,
                 max_shards_in_memory: int | None = 4) -> None:
        """`max_shards_in_memory`: shards kept loaded (least recently loaded dropped first); None keeps all, which
        makes random-order training read each shard from disk once."""
        self.dir = Path(cache_dir)
        self.max_shards_in_memory = max_shards_in_memory
        manifest_path = self.dir / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"{cache_dir} is not a feature cache (no manifest.json); build one with "
                                    "dspark_hf.training.features.build_feature_cache")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("key_format") != CACHE_FORMAT:
            raise ValueError(f"{cache_dir} is a feature cache of an older format (entries keyed by id only, which "
                             "cannot tell regenerated answers apart); rebuild it in an empty folder")
        if target is not None and self.manifest["target_fingerprint"] != target_fingerprint(target):
            raise ValueError(f"feature cache {cache_dir} was built for target {self.manifest['target_fingerprint']}, "
                             f"not {target_fingerprint(target)}")
        if target_layer_ids is not None and list(target_layer_ids) != self.manifest["target_layer_ids"]:
            raise ValueError(f"feature cache {cache_dir} holds layers {self.manifest['target_layer_ids']}, the drafter "
                             f"reads {list(target_layer_ids)}")
        self.shard_of = {ex_id: shard for shard, ids in self.manifest["shards"].items() for ex_id in ids}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}

    def __contains__(self, example: TokenizedExample) -> bool:
        return feature_key(example) in self.shard_of

    def _tensors(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.shard_of[key]
        if shard not in self._loaded:
            if self.max_shards_in_memory is not None and len(self._loaded) >= self.max_shards_in_memory:
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[shard] = load_file(self.dir / shard)
        data = self._loaded[shard]
        return data[f"{key}.context"], data[f"{key}.final"]

    def __call__(self, examples: Sequence[TokenizedExample], max_length: int | None = None) -> FeatureBatch:
        keys = [feature_key(e) for e in examples]
        missing = [e.id for e, k in zip(examples, keys) if k not in self.shard_of]
        if missing:
            raise KeyError(f"examples {missing[:5]} are not in the feature cache {self.dir} (or their tokens changed "
                           "since it was built); run build_feature_cache over them")
        ids, loss, attn = pad_examples(examples, max_length)
        b, t = ids.shape
        tensors = [self._tensors(k) for k in keys]
        context = torch.zeros(b, t, tensors[0][0].shape[-1], dtype=torch.float32)
        final = torch.zeros(b, t, tensors[0][1].shape[-1], dtype=torch.float32)
        for i, (c, f) in enumerate(tensors):
            n = min(t, c.shape[0])
            context[i, :n] = c[:n].float()
            final[i, :n] = f[:n].float()
        return FeatureBatch(input_ids=ids, loss_mask=loss, attention_mask=attn, context=context, final_hidden=final)


@torch.no_grad()
def build_feature_cache(target, examples: Sequence[TokenizedExample], cache_dir: str | Path,
                        target_layer_ids: Sequence[int], batch_size: int = 8, max_length: int | None = None,
                        dtype: torch.dtype = torch.float32, shard_examples: int = 64, progress: bool = True) -> Path:
    """Runs the target once over `examples` and stores their features; resumes an interrupted build."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = cache_dir / "manifest.json"
    manifest = {"target_fingerprint": target_fingerprint(target), "target_layer_ids": list(target_layer_ids),
                "dtype": str(dtype).replace("torch.", ""), "max_length": max_length, "key_format": CACHE_FORMAT,
                "shards": {}}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        settings = ("target_fingerprint", "target_layer_ids", "dtype", "max_length", "key_format")
        differ = [f"{k}: cached {old.get(k)!r}, asked {manifest[k]!r}" for k in settings if old.get(k) != manifest[k]]
        if differ:
            raise ValueError(f"{cache_dir} holds a feature cache with other settings ({'; '.join(differ)}): use an "
                             "empty folder, or the cached settings (e.g. the training config's max_length)")
        manifest["shards"] = old["shards"]
    done = {i for ids in manifest["shards"].values() for i in ids}
    todo = [e for e in examples if feature_key(e) not in done]
    # Batches of similar length: each batch is padded to its longest sequence, so a random mix of 40- and 700-token
    # examples would spend a large share of the (dominant) target forward on padding. Stable: ties keep data order.
    todo.sort(key=lambda e: min(len(e.input_ids), max_length or len(e.input_ids)))
    online = OnlineFeatures(target, target_layer_ids)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc="target features", unit="seq")
    for start in range(0, len(todo), shard_examples):
        chunk = todo[start: start + shard_examples]
        tensors: dict[str, torch.Tensor] = {}
        for b in range(0, len(chunk), batch_size):
            part = chunk[b: b + batch_size]
            feats = online(part, max_length)
            for i, e in enumerate(part):
                n = int(feats.attention_mask[i].sum())
                key = feature_key(e)
                tensors[f"{key}.context"] = feats.context[i, :n].to(dtype).contiguous().cpu()
                tensors[f"{key}.final"] = feats.final_hidden[i, :n].to(dtype).contiguous().cpu()
            if bar is not None:
                bar.update(len(part))
        name = f"features-{len(manifest['shards']):05d}.safetensors"
        tmp = cache_dir / f".{name}.tmp"
        save_file(tensors, tmp)
        tmp.replace(cache_dir / name)
        manifest["shards"][name] = [feature_key(e) for e in chunk]
        atomic_write_json(manifest_path, manifest)
    if bar is not None:
        bar.close()
    return cache_dir
