"""Sharing drafters the Hub way: `load_pair` (a drafter and the target it records, offline from the HF cache when the
Hub is unreachable) and generated model cards (`card`: what `save_pretrained` / `push_to_hub` / `dspark-hf release`
write as README.md)."""

from __future__ import annotations

from .card import build_model_card, load_results, write_model_card
from .pair import NotCachedError, load_pair, resolve_pretrained

__all__ = ["NotCachedError", "build_model_card", "load_pair", "load_results", "resolve_pretrained", "write_model_card"]
