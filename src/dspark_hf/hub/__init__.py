"""Sharing drafters the Hub way: `load_pair` (a drafter and the target it records, offline from the HF cache when the
Hub is unreachable), generated model cards (`card`: what `save_pretrained` / `push_to_hub` / `dspark-hf release`
write as README.md) and the remote code a saved folder carries (`remote_code`: `custom_generate/`, so that
`target.generate(custom_generate=folder_or_repo, trust_remote_code=True)` runs the batched loop without dspark_hf)."""

from __future__ import annotations

from .card import build_model_card, load_results, write_model_card
from .pair import NotCachedError, load_pair, resolve_pretrained
from .remote_code import write_custom_generate

__all__ = ["NotCachedError", "build_model_card", "load_pair", "load_results", "resolve_pretrained",
           "write_custom_generate", "write_model_card"]
