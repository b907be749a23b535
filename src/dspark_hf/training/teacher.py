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

__all__ = ["TeacherNormalizer", "log_normalizer"]

_PREFIX = "teacher-lse-"


@torch.no_grad()
def log_normalizer(lm_head: Callable[[torch.Tensor], torch.Tensor], final_hidden: torch.Tensor,
                   chunk: int = 256) -> torch.Tensor:
    """logsumexp of `lm_head(final_hidden)` over the vocabulary, `[T, d] -> [T]` fp32, `chunk` rows at a time (the
    `[chunk, V]` logits are the only large temporary)."""
    out = torch.empty(final_hidden.shape[0], dtype=torch.float32, device=final_hidden.device)
    for start in range(0, final_hidden.shape[0], chunk):
        out[start: start + chunk] = torch.logsumexp(lm_head(final_hidden[start: start + chunk]).float(), dim=-1)
    return out


class TeacherNormalizer:
    """Per-position full-vocabulary log-normalizers of the target, one `[T]` fp32 vector per example.

    Args:
        lm_head: the target's full LM head (`drafter.lm_head`), applied to final hidden states.
        folder: where computed normalizers persist (e.g. `<feature cache>/teacher-lse`); None keeps them in memory.
        fingerprint: what the values depend on (the target's fingerprint); a folder written for another is refused.
    """

    def __init__(self, lm_head: Callable[[torch.Tensor], torch.Tensor], folder: str | Path | None = None,
                 fingerprint: str | None = None) -> None:
        self.lm_head = lm_head
        self.folder = None if folder is None else Path(folder)
        self.fingerprint = fingerprint
        self.values: dict[str, torch.Tensor] = {}
        self._unsaved: set[str] = set()
        self.computed = 0  # examples computed by this process (not read from disk)
        if self.folder is not None and self.folder.exists():
            info = self.folder / "teacher.json"
            if info.exists():
                stored = json.loads(info.read_text()).get("target_fingerprint")
                if fingerprint is not None and stored != fingerprint:
                    raise ValueError(f"{self.folder} holds teacher normalizers of target {stored}, not "
                                     f"{fingerprint}; use another folder")
            for path in sorted(self.folder.glob(f"{_PREFIX}*.safetensors")):
                for key, value in load_file(path).items():  # the same example twice: keep the longer vector
                    if key not in self.values or value.shape[0] > self.values[key].shape[0]:
                        self.values[key] = value

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

    def save(self, tag: str = "") -> Path | None:
        """Writes the normalizers computed since the last save to a new file (atomically: a temporary name, then a
        rename; the name is unique, with `tag` in it, e.g. the process rank); returns
        it, or None when there was nothing new or no folder."""
        if self.folder is None or not self._unsaved:
            return None
        from ..provenance import atomic_write_json

        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / "teacher.json", {"target_fingerprint": self.fingerprint})
        # a unique name (several runs may share one feature cache and save at the same moment)
        path = self.folder / f"{_PREFIX}{tag}{time.time_ns()}-{os.getpid()}.safetensors"
        tmp = self.folder / f".{path.name}.tmp"
        save_file({k: self.values[k].contiguous() for k in sorted(self._unsaved)}, tmp)
        tmp.replace(path)
        self._unsaved.clear()
        return path
