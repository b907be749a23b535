"""The teacher's log-normalizer, cached: exact reduced-vocabulary teacher distributions from the draft rows alone.

With a reduced draft vocabulary (`draft_vocab_size` = Vd, the drafter's `d2t`), the DSpark loss needs the target's
distribution on the Vd draft tokens and the mass it puts outside them (which the drafter can never propose). Both
follow from the draft rows' logits z_v and one number per position, the log-partition over the *full* vocabulary:

    p_t(v) = exp(z_v - lse),  outside = 1 - sum_v p_t(v),  lse = logsumexp over all V target logits.

lse depends only on the target's final hidden state at that position, which the feature cache holds and which never
changes during training. So `TeacherNormalizer` computes it once per example (one full-vocabulary product over the
example's answer positions, the only ones a block is supervised from; NaN elsewhere), keeps it in memory and, given a folder, in `teacher-lse-*.safetensors` files written atomically
at every checkpoint: later steps, epochs and sessions multiply by the Vd draft rows of the LM head instead of all V
rows (for SmolLM2: 8,192 instead of 49,152, the largest product of a step). The loss is the same function as with the
full teacher logits (equal up to float rounding; `tests/test_teacher.py`).

`TeacherTopK` goes one step further, at a price in exactness (`teacher_topk`, off by default): per answer position
it keeps the target's k most probable draft ids and their log-probabilities (normalised with the cached lse), computed
the first time an example is seen, so later steps skip the teacher's `[N, K, Vd]` product altogether and the loss uses
the sparse upper bound of `losses.py`. Both caches share `_ExampleStore`: per-example tensors in memory, appended to
the folder in new, atomically written safetensors files at every checkpoint, refused when written for another target.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from .data import TokenizedExample
from .features import feature_key

__all__ = ["TeacherNormalizer", "TeacherTopK", "log_normalizer"]


@torch.no_grad()
def log_normalizer(lm_head: Callable[[torch.Tensor], torch.Tensor], final_hidden: torch.Tensor,
                   chunk: int = 256) -> torch.Tensor:
    """logsumexp of `lm_head(final_hidden)` over the vocabulary, `[T, d] -> [T]` fp32, `chunk` rows at a time (the
    `[chunk, V]` logits are the only large temporary)."""
    out = torch.empty(final_hidden.shape[0], dtype=torch.float32, device=final_hidden.device)
    for start in range(0, final_hidden.shape[0], chunk):
        out[start: start + chunk] = torch.logsumexp(lm_head(final_hidden[start: start + chunk]).float(), dim=-1)
    return out


class _ExampleStore:
    """Per-example tensors keyed by `feature_key`, kept in memory and persisted to `folder` (see the module docstring).

    Subclasses name their files (`prefix`), say what the folder's values depend on (`info`: checked on load, a
    mismatch is a ValueError naming what differs) and map an example's entry to and from flat safetensors tensors."""

    prefix = "store-"
    what = "per-example tensors"  # named in the error for a folder of another setting

    def __init__(self, folder: str | Path | None, info: dict) -> None:
        self.folder = None if folder is None else Path(folder)
        self.info = info
        self._unsaved: set[str] = set()
        self.computed = 0  # examples computed by this process (not read from disk)
        flat: dict[str, torch.Tensor] = {}
        if self.folder is not None and self.folder.exists():
            path = self.folder / "teacher.json"
            if path.exists():
                stored = json.loads(path.read_text())
                differ = [f"{k}: stored {stored.get(k)!r}, asked {v!r}" for k, v in info.items()
                          if v is not None and stored.get(k) != v]
                if differ:
                    raise ValueError(f"{self.folder} holds {self.what} of another setting ({'; '.join(differ)}); use "
                                     "another folder")
            for file in sorted(self.folder.glob(f"{self.prefix}*.safetensors")):
                for key, value in load_file(file).items():  # the same example twice: keep the longer entry
                    if key not in flat or value.shape[0] > flat[key].shape[0]:
                        flat[key] = value
        self._load(flat)

    def _load(self, flat: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _flat(self, key: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def save(self, tag: str = "") -> Path | None:
        """Writes the entries computed since the last save to a new file (atomically: a temporary name, then a
        rename; the name is unique, with `tag` in it, e.g. the process rank); returns it, or None when there was
        nothing new or no folder."""
        if self.folder is None or not self._unsaved:
            return None
        from ..provenance import atomic_write_json

        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / "teacher.json", self.info)
        # a unique name (several runs may share one feature cache and save at the same moment)
        path = self.folder / f"{self.prefix}{tag}{time.time_ns()}-{os.getpid()}.safetensors"
        tmp = self.folder / f".{path.name}.tmp"
        flat: dict[str, torch.Tensor] = {}
        for key in sorted(self._unsaved):
            flat.update({name: value.contiguous() for name, value in self._flat(key).items()})
        save_file(flat, tmp)
        tmp.replace(path)
        self._unsaved.clear()
        return path


class TeacherNormalizer(_ExampleStore):
    """Per-position full-vocabulary log-normalizers of the target, one `[T]` fp32 vector per example.

    Args:
        lm_head: the target's full LM head (`drafter.lm_head`), applied to final hidden states.
        folder: where computed normalizers persist (e.g. `<feature cache>/teacher-lse`); None keeps them in memory.
        fingerprint: what the values depend on (the target's fingerprint); a folder written for another is refused.
    """

    prefix = "teacher-lse-"
    what = "teacher normalizers"

    def __init__(self, lm_head: Callable[[torch.Tensor], torch.Tensor], folder: str | Path | None = None,
                 fingerprint: str | None = None) -> None:
        self.lm_head = lm_head
        self.fingerprint = fingerprint
        self.values: dict[str, torch.Tensor] = {}
        super().__init__(folder, {"target_fingerprint": fingerprint})

    def _load(self, flat: dict[str, torch.Tensor]) -> None:
        self.values = flat

    def _flat(self, key: str) -> dict[str, torch.Tensor]:
        return {key: self.values[key]}

    def __len__(self) -> int:
        return len(self.values)

    def __call__(self, examples: Sequence[TokenizedExample], final_hidden: torch.Tensor,
                 attention_mask: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, T]` log-normalizers for a right-padded batch (`final_hidden` `[B, T, d]`).

        With `loss_mask`, only its positions are computed (every supervised slot of a block predicts from an answer
        position: its anchor and the labels before it are loss-masked) and the others are NaN; padding is NaN."""
        b, t = attention_mask.shape
        out = torch.full((b, t), float("nan"), dtype=torch.float32, device=final_hidden.device)
        for i, example in enumerate(examples):
            n = int(attention_mask[i].sum())
            key = feature_key(example)
            stored = self.values.get(key)
            if stored is None or stored.shape[0] < n:  # new, or seen before under a shorter max_length
                rows = (torch.arange(n, device=final_hidden.device) if loss_mask is None
                        else loss_mask[i, :n].nonzero().squeeze(-1).to(final_hidden.device))
                stored = torch.full((n,), float("nan"), dtype=torch.float32)
                if rows.numel():
                    stored[rows.cpu()] = log_normalizer(self.lm_head, final_hidden[i, rows]).cpu()
                self.values[key] = stored
                self._unsaved.add(key)
                self.computed += 1
            out[i, :n] = stored[:n].to(out.device)
        return out


class TeacherTopK(_ExampleStore):
    """The sparse teacher: per position, the target's `k` most probable draft ids and their log-probabilities.

    One example's entry is `ids [T, k]` int32 (indices into the draft vocabulary) and `logp [T, k]` float16
    (log p_t over the target's *full* vocabulary: the draft rows' logits minus the cached lse), computed on the
    example's loss-masked positions the first time it is seen; other positions hold id 0 and log-probability -inf
    (probability 0: unsupervised slots only).

    Args:
        draft_lm_head: the draft vocabulary's rows of the target's LM head (`drafter.draft_lm_head`).
        k: how many draft ids per position.
        folder: where entries persist (e.g. `<feature cache>/teacher-topk64-<d2t hash>`); None keeps them in memory.
        fingerprint: the target's fingerprint; `draft_vocab`: the drafter's `d2t` (entries are draft ids, so a folder
            written for another draft vocabulary, k or target is refused).
    """

    prefix = "teacher-topk-"
    what = "sparse teacher targets"

    def __init__(self, draft_lm_head: Callable[[torch.Tensor], torch.Tensor], k: int, draft_vocab: torch.Tensor,
                 folder: str | Path | None = None, fingerprint: str | None = None) -> None:
        if k < 1 or k > draft_vocab.shape[0]:
            raise ValueError(f"teacher_topk must be in [1, draft vocabulary size {draft_vocab.shape[0]}], got {k}")
        self.draft_lm_head = draft_lm_head
        self.k = k
        self.values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(folder, {"target_fingerprint": fingerprint, "k": k,
                                  "draft_vocab_sha256": draft_vocab_hash(draft_vocab)})

    def _load(self, flat: dict[str, torch.Tensor]) -> None:
        for name, ids in flat.items():
            if name.endswith("::ids") and name[:-5] + "::logp" in flat:
                self.values[name[:-5]] = (ids, flat[name[:-5] + "::logp"])

    def _flat(self, key: str) -> dict[str, torch.Tensor]:
        ids, logp = self.values[key]
        return {f"{key}::ids": ids, f"{key}::logp": logp}

    def __len__(self) -> int:
        return len(self.values)

    @torch.no_grad()
    def __call__(self, examples: Sequence[TokenizedExample], final_hidden: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor, lse: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """`(ids [B, T, k] int64, logp [B, T, k] fp32)` for a right-padded batch; `lse` `[B, T]` is the teacher
        normalizer of the same positions (`TeacherNormalizer`)."""
        b, t = attention_mask.shape
        device = final_hidden.device
        ids_out = torch.zeros((b, t, self.k), dtype=torch.long, device=device)
        logp_out = torch.full((b, t, self.k), float("-inf"), dtype=torch.float32, device=device)
        for i, example in enumerate(examples):
            n = int(attention_mask[i].sum())
            key = feature_key(example)
            stored = self.values.get(key)
            if stored is None or stored[0].shape[0] < n:  # new, or seen before under a shorter max_length
                rows = loss_mask[i, :n].nonzero().squeeze(-1).to(device)
                ids = torch.zeros((n, self.k), dtype=torch.int32)
                logp = torch.full((n, self.k), float("-inf"), dtype=torch.float16)
                for start in range(0, rows.numel(), chunk):
                    r = rows[start: start + chunk]
                    z = self.draft_lm_head(final_hidden[i, r]).float() - lse[i, r].float()[:, None]
                    top = z.topk(self.k, dim=-1)
                    ids[r.cpu()] = top.indices.to(torch.int32).cpu()
                    logp[r.cpu()] = top.values.to(torch.float16).cpu()
                stored = (ids, logp)
                self.values[key] = stored
                self._unsaved.add(key)
                self.computed += 1
            ids_out[i, :n] = stored[0][:n].to(device=device, dtype=torch.long)
            logp_out[i, :n] = stored[1][:n].to(device=device, dtype=torch.float32)
        return ids_out, logp_out


def draft_vocab_hash(draft_vocab: torch.Tensor) -> str:
    """sha256 of a draft vocabulary's sorted target ids (what a sparse teacher's draft ids refer to)."""
    import hashlib

    return hashlib.sha256(draft_vocab.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
