"""Showing the library's progress and diagnostics on stderr, for command-line use.

Library modules log through `transformers.utils.logging.get_logger(__name__)` (transformers' convention; these are
plain `logging` loggers under `dspark_hf`, not under transformers' root logger) and never configure logging
themselves: used as a library, the loggers follow the application's setup (Python's default shows warnings only).
Commands (`dspark-hf ...`, `python -m dspark_hf.evaluation.throughput`, ...) call `configure_logging()`, which shows
the `dspark_hf` loggers on stderr as `[dspark_hf.module] message` (warnings as `[...] WARNING: message`) at INFO, or
at the level named by `$DSPARK_HF_VERBOSITY` (`debug`, `info`, `warning`, `error`). transformers' own verbosity
(`TRANSFORMERS_VERBOSITY`) is left alone.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["VERBOSITY_ENV", "configure_logging"]

VERBOSITY_ENV = "DSPARK_HF_VERBOSITY"


class _StderrHandler(logging.Handler):
    """Writes to the current `sys.stderr` (looked up per record, so a replaced stream, e.g. under pytest, works)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001  (logging's own convention)
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        return f"[{record.name}] {level}{record.getMessage()}"


def configure_logging(level: str | int | None = None) -> None:
    """Shows the `dspark_hf` loggers on stderr at `level` (default `$DSPARK_HF_VERBOSITY`, else INFO; an unknown
    name means INFO). Idempotent: one handler, however often it is called."""
    if level is None:
        level = os.environ.get(VERBOSITY_ENV) or "info"
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    logger = logging.getLogger("dspark_hf")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
    logger.setLevel(level)
