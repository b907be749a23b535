"""SPS(B): the target's forward steps per second at a verification batch of B tokens (paper 3.2.2).

`profile_sps(target)` measures it once on the current device and dtype, at representative context lengths, by timing
target forwards of B new tokens spread over ceil(B / tokens_per_row) rows on top of a cached context. The result is an
`SPSTable`, saved as JSON keyed by device, target and dtype; `SPSTable.load(path, target=...)` refuses a table made
for another target, device or dtype (or re-profiles when asked). The scheduler reads it through
`steps_per_second(B)`: linear interpolation of the measured seconds per step over B, averaged over the profiled
context lengths and made non-decreasing in B (timing noise must not create dips), cost proportional to B past the
largest measured B.

`profile_sps(target, rows=R)` lays B out as the batched loop's padded rounds do, R rows of w tokens; `RowScaledCost`
prices such a table at the rows a round really has (the loop's default curve, `dspark_hf.SPSCache`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from ..provenance import atomic_write_json, device_description, provenance

__all__ = ["RowScaledCost", "SPSTable", "profile_batch1_sps", "profile_sps", "target_fingerprint"]


def target_fingerprint(target: PreTrainedModel) -> str:
    """Identifies a target well enough to refuse another model's table: type, sizes, parameter count, and
    ":prepacked" when its linears run on prepacked oneDNN kernels (`models.prepacked`), whose cost curve differs."""
    from ..models.prepacked import PrepackedLinear

    text = target.config.get_text_config()
    params = sum(p.numel() for p in target.parameters())
    packed = any(isinstance(m, PrepackedLinear) for m in target.modules())
    return (f"{getattr(text, 'model_type', type(target).__name__)}:L{text.num_hidden_layers}:d{text.hidden_size}:"
            f"V{text.vocab_size}:P{params}" + (":prepacked" if packed else ""))


def _default_grid(max_tokens: int) -> list[int]:
    grid = {1, 2, 3, 4, 6, 8}
    b = 8
    while b < max_tokens:
        b = int(math.ceil(b * 1.5))
        grid.add(min(b, max_tokens))
    return sorted(x for x in grid if x <= max_tokens)


@dataclass
class SPSTable:
    """Measured seconds per target forward against verification batch size B (tokens).

    Attributes:
        target: name or path of the target; target_fingerprint: see `target_fingerprint`.
        device: description of the device; dtype: the target's dtype.
        context_lengths: cached context per row during the measurements.
        batch_tokens: the measured B values (ascending).
        seconds: `[len(context_lengths)][len(batch_tokens)]` median seconds per forward.
        meta: provenance of the measurement.
    """

    target: str
    target_fingerprint: str
    device: str
    dtype: str
    context_lengths: list[int]
    batch_tokens: list[int]
    seconds: list[list[float]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.batch_tokens or sorted(self.batch_tokens) != list(self.batch_tokens):
            raise ValueError("SPSTable.batch_tokens must be a non-empty ascending list")
        if len(self.seconds) != len(self.context_lengths) or any(len(r) != len(self.batch_tokens) for r in self.seconds):
            raise ValueError("SPSTable.seconds must be [len(context_lengths)][len(batch_tokens)]")
        if any(not s > 0 for row in self.seconds for s in row):
            raise ValueError("SPSTable.seconds must be positive")
        self._grid = torch.tensor(self.batch_tokens, dtype=torch.float64)
        # Average over contexts, then a running maximum: a forward of more tokens never takes less time, and timing
        # noise must not turn into spurious dips that the scheduler would chase.
        self._time = torch.cummax(torch.tensor(self.seconds, dtype=torch.float64).mean(dim=0), dim=0).values

    def seconds_per_step(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        b = torch.as_tensor(batch_tokens, dtype=torch.float64)
        grid, secs = self._grid, self._time
        if len(grid) == 1:
            return secs[0] * torch.clamp(b / grid[0], min=1.0)
        idx = torch.searchsorted(grid, b).clamp(1, len(grid) - 1)
        lo, hi = grid[idx - 1], grid[idx]
        frac = (b - lo) / (hi - lo)
        out = secs[idx - 1] + frac * (secs[idx] - secs[idx - 1])
        out = torch.where(b > grid[-1], secs[-1] * b / grid[-1], out)  # past the table: cost linear in tokens
        return torch.where(b < grid[0], secs[0], out).clamp(min=1e-9)

    def steps_per_second(self, batch_tokens: torch.Tensor | int) -> torch.Tensor:
        """SPS(B) for a tensor (or int) of batch sizes."""
        return 1.0 / self.seconds_per_step(torch.as_tensor(batch_tokens))

    @property
    def rows(self) -> int | None:
        """R for a table profiled as R rows of w tokens (`profile_sps(rows=R)`), None for the tokens-per-row layout."""
        rows = self.meta.get("rows") if isinstance(self.meta, dict) else None
        return int(rows) if rows else None

    def __call__(self, batch_tokens):
        return self.steps_per_second(batch_tokens)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    def check(self, target: PreTrainedModel | None = None, device: str | None = None, dtype: str | None = None) -> None:
        """Raises `ValueError` if this table was made for another target, device or dtype."""
        problems = []
        if target is not None and target_fingerprint(target) != self.target_fingerprint:
            problems.append(f"target {self.target_fingerprint} (table) vs {target_fingerprint(target)} (this run)")
        if device is not None and device != self.device:
            problems.append(f"device {self.device!r} (table) vs {device!r} (this run)")
        if dtype is not None and dtype != self.dtype:
            problems.append(f"dtype {self.dtype} (table) vs {dtype} (this run)")
        if problems:
            raise ValueError(
                "this SPS table does not describe the current setup: " + "; ".join(problems)
                + ". Re-profile with dspark_hf.profile_sps(target) or load with reprofile=True."
            )

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel | None = None, reprofile: bool = False,
             **profile_kwargs: Any) -> "SPSTable":
        """Loads a table; with `target`, checks it was made for this target, device and dtype.

        A mismatch raises `ValueError`, or, with `reprofile=True`, profiles anew and overwrites `path`."""
        try:
            data = json.loads(Path(path).read_text())
            table = cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as err:
            if reprofile and target is not None:
                table = None
            else:
                raise ValueError(f"could not read an SPS table from {path}: {err}") from err
        if target is not None:
            device, dtype = device_description(target.device), str(target.dtype).replace("torch.", "")
            try:
                if table is None:
                    raise ValueError("unreadable table")
                table.check(target, device, dtype)
            except ValueError:
                if not reprofile:
                    raise
                table = profile_sps(target, **profile_kwargs)
                table.save(path)
        return table


class RowScaledCost:
    """A table profiled as R0 rows of w tokens (`profile_sps(rows=R0)`), priced at a round of R rows.

    The batched loop's padded round over R rows verifies B = R x w tokens. Where R = R0 that is a measured point. When
    rows have finished (R < R0) the forward of R rows of w tokens is priced as R / R0 of the measured R0-row forward
    of the same width: the width's cost relative to the plain step stays as measured at R0 rows (an upper bound on
    these CPUs, where a wider forward is relatively cheaper with fewer rows: 8 tokens cost 5.1x one at 64 rows of
    SmolLM2-135M, 1.7x at one row), so the policy errs towards verifying less; `MeasuredCost` replaces the prior by
    the real times once it has seen them. The loop sets `rows` before every round."""

    def __init__(self, table: SPSTable, rows: int | None = None) -> None:
        if table.rows is None:
            raise ValueError("RowScaledCost needs a table profiled with profile_sps(rows=R)")
        self.table, self.profiled_rows = table, table.rows
        self.rows = table.rows if rows is None else int(rows)

    def seconds_per_step(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        scale = self.profiled_rows / max(self.rows, 1)
        return self.table.seconds_per_step(torch.as_tensor(batch_tokens, dtype=torch.float64) * scale) / scale

    def steps_per_second(self, batch_tokens: torch.Tensor | int) -> torch.Tensor:
        return 1.0 / self.seconds_per_step(torch.as_tensor(batch_tokens))

    def __call__(self, batch_tokens):
        return self.steps_per_second(batch_tokens)


@torch.no_grad()
def profile_sps(
    target: PreTrainedModel,
    max_tokens: int = 512,
    context_lengths: tuple[int, ...] = (128, 512),
    tokens_per_row: int = 4,
    batch_tokens: list[int] | None = None,
    repeats: int = 3,
    progress: bool = True,
    rows: int | None = None,
) -> SPSTable:
    """Times target forwards of B new tokens (B in a grid up to `max_tokens`) over cached contexts.

    B tokens are laid out as ceil(B / tokens_per_row) rows, as verification batches are (each request sends its anchor
    and a few drafts). Each row sees `context` cached tokens (one prefill, repeated across rows).

    `rows=R`: the layout of the batched loop's padded rounds over R requests instead: B = R x w for w = 1, 2, ...
    up to `max_tokens`, each forward R rows of w tokens (w = 1: the plain decoding step, which takes the one-token
    attention path that no multi-token layout measures). At 64 rows of SmolLM2-135M on a 2-core EPYC, the 4-per-row
    layout priced a 2-token round at 1.56x the plain step and a 3-token one at 1.71x; the rounds took 1.72x and
    2.44x (results/gqa_attention), so a policy reading it verified drafts that could not pay."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if rows is not None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if batch_tokens:
            raise ValueError("pass either rows= (the grid is rows x 1, 2, ...) or batch_tokens=, not both")
        grid = [rows * w for w in range(1, max(1, max_tokens // rows) + 1)]
    else:
        grid = sorted(set(batch_tokens)) if batch_tokens else _default_grid(max_tokens)
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    seconds: list[list[float]] = []
    total = len(grid) * len(context_lengths)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="profiling SPS(B)", unit="B")
    for context in context_lengths:
        row_times = []
        prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        base = DynamicCache()
        target(input_ids=prompt, cache=base, use_cache=True, logits_to_keep=1)
        for b in grid:
            if rows is None:
                num_rows = math.ceil(b / tokens_per_row)
                width = min(tokens_per_row, b)
            else:
                num_rows, width = rows, b // rows
            ids = torch.randint(0, vocab, (num_rows, width), generator=gen).to(device)
            new_mask = (torch.arange(num_rows * width).reshape(num_rows, width) < b).to(device)
            mask = torch.cat([torch.ones(num_rows, context, dtype=torch.long, device=device), new_mask.long()], dim=1)
            positions = (context + torch.arange(width, device=device)).expand(num_rows, -1)
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                cache = DynamicCache()
                for layer_idx, layer in enumerate(base.layers):
                    cache.update(layer.keys.expand(num_rows, -1, -1, -1).contiguous(),
                                 layer.values.expand(num_rows, -1, -1, -1).contiguous(), layer_idx)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            row_times.append(statistics.median(times[1:]))
            if bar is not None:
                bar.update(1)
        seconds.append(row_times)
    if bar is not None:
        bar.close()
    return SPSTable(
        target=str(getattr(target.config, "_name_or_path", "") or type(target).__name__),
        target_fingerprint=target_fingerprint(target),
        device=device_description(device),
        dtype=str(target.dtype).replace("torch.", ""),
        context_lengths=list(context_lengths),
        batch_tokens=grid,
        seconds=seconds,
        meta=provenance(device, repeats=repeats,
                        **({"tokens_per_row": tokens_per_row} if rows is None else {"rows": rows})),
    )


def profile_batch1_sps(target: PreTrainedModel, max_drafts: int = 16, repeats: int = 3, context: int = 256,
                       progress: bool = False) -> SPSTable:
    """The cost curve of batch-1 rounds: one row of B = 1 .. max_drafts + 1 new tokens over a `context`-token cache
    (what `LookupAssistant(..., sps=)` and `DSparkDrafter.set_assist(sps=)` read). A few seconds on a CPU."""
    return profile_sps(target, max_tokens=max_drafts + 1, tokens_per_row=max_drafts + 1, context_lengths=(context,),
                       repeats=repeats, progress=progress)
