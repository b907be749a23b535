"""`LABEL=FOLDER` command-line values, shared by `dspark-hf compare --drafter` and `dspark-hf training-report --run`.

Kept apart from `dspark_hf.cli` so that a subcommand module can use it without importing the CLI (which imports
the subcommand modules: an import cycle).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

__all__ = ["labeled_folders", "parse_labeled_folders"]


def parse_labeled_folders(items: Iterable[str], flag: str = "LABEL=FOLDER") -> dict[str, str]:
    """`["a=x", "b=y"]` -> `{"a": "x", "b": "y"}`, in order; a later repeat of a label wins.

    Splits at the first `=` (a folder may contain `=`). Raises `ValueError` naming `flag` and the item when an item
    has no `=`, or an empty label or folder.
    """
    out: dict[str, str] = {}
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise ValueError(f"{flag} takes LABEL=FOLDER, got {item!r}")
        out[label] = folder
    return out


def labeled_folders(parser: argparse.ArgumentParser, flag: str, items: Iterable[str]) -> dict[str, str]:
    """`parse_labeled_folders`, with a malformed item reported as a usage error of `parser` (exit status 2)."""
    try:
        return parse_labeled_folders(items, flag)
    except ValueError as error:
        parser.error(str(error))
