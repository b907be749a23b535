"""The state a batched speculative decoding call (`dspark_hf.decoding.batched.generate`) carries between rounds.

Each piece is a small typed object with the methods the loop calls, so that `generate` reads as the round itself:

* `ActiveRows`: the rows still decoding: their original indices, anchors (last emitted token, not yet in the target's
  cache), anchor positions, the mask over the target's cache columns, and both caches (target KV, drafter context).
  `prefill` builds it; `drop` removes finished rows, `compact_holes` squeezes masked columns out once there are more
  than the hole budget, `advance` appends a verified round. The drafter's context is lazy: the verified tokens' target
  features wait in `pending` and are projected into the drafter's cache in one call when a round drafts
  (`drafter_context`), so rounds that do not draft (idle backoff, lookup-only rounds) never pay for the drafter.
* `RowOutputs`: the generated tokens of every row. `emit` appends a round's tokens cut at the first EOS, the first
  token on which a stopping criterion fires, or `max_new_tokens`; feeds the streamer; keeps the per-row `RowStats`;
  returns the finished mask.
* `RoundClock`: the measured per-round overhead outside the target's forward (drafting, bookkeeping) and the cost
  curve the policies price with it (`scheduler.WithRoundOverhead`).
* `GrowthClock`: the measured cost of growing trees beyond their chains (seconds per growth step, fixed seconds per
  round that grows), priced by the tree policies and the growth plan (`scheduler.GrowthCost`).
* `ConfidenceHistory`: the async policy's confidences of the last two rounds, aligned with the rows still active.
* `LengthPolicy`: a round's verification lengths (`fixed`, `threshold`, `scheduled`, `async`) — or, for tree drafts,
  the nodes each row verifies (`admit`) and the plan of how far to grow them (`growth_plan`) — and whether drafting
  the round is expected to pay.
* `IdleBackoff`: skips the drafter after rounds that did not pay for it (2, 4, ... 32 rounds), probing in between.
* `BranchBackoff`: the same for tree drafts: drafts chains only after tree rounds in which no node off the chain was
  verified, probing with the full tree in between.

Everything here decides from past rounds only (the admission rule stays non-anticipating) and is tensor code: no
Python pass over the rows per round (only stopping criteria and a streamer, which need each row's tokens, take one).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..models.drafting import DraftBlock, DSparkContextCache, valid_first_order
from ..models.modeling_dspark import DSparkDrafter
from ..models.realized_gain import RealizedGain  # (lives in models/: the batch-1 candidate generator uses it too)
from .scheduler import (GrowthCost, WithRoundOverhead, async_lengths, async_tree, async_width, expected_throughput,
                        expected_tree_throughput, fixed_lengths, schedule_growth, schedule_prefix, schedule_tree,
                        schedule_width, sps_values, prefix_survival, threshold_lengths, threshold_tree)
from .tree import DraftTree, GrowthPlan, TreeSpec
from .sps import RowScaledCost
from .verification import SamplingParams

__all__ = [
    "PRICED_POLICIES",
    "MeasuredCost",
    "OnlineCalibration",
    "ActiveRows",
    "RealizedGain",
    "DrafterGate",
    "GateEvidence",
    "BranchBackoff",
    "ConfidenceHistory",
    "GrowthClock",
    "IdleBackoff",
    "LengthPolicy",
    "RoundClock",
    "RoundRecord",
    "RowOutputs",
    "RowStats",
    "compact_target_cache",
]

PRICED_POLICIES = ("scheduled", "async")
"""The policies that price a cost curve SPS(B) (and so use the round overhead and the idle backoff)."""


# ---------------------------------------------------------------------------------------------- outputs
@dataclass
class RowStats:
    """Per-request statistics of one `generate` call.

    Attributes:
        rounds: verification rounds the row took part in.
        verified: draft tokens sent to the target (sum of l_r).
        accepted: draft tokens accepted.
        accepted_lengths: tokens emitted in each round (accepted drafts + 1), i.e. the per-round tau.
        verify_lengths: l_r chosen in each round.
        seconds: wall time from the start of the call until the row finished.
    """

    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mean_verify_length(self) -> float:
        """Mean l_r over the row's rounds."""
        return sum(self.verify_lengths) / max(1, len(self.verify_lengths))

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per round (tau), the bonus / correction token included."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


@dataclass
class RoundRecord:
    """One verification round (recorded with `record_rounds=True`): the rows' original indices `[R]`, raw confidence
    logits `[R, K]` (before STS; None without a confidence head or in a round that skipped the drafter), verify
    lengths `[R]`, accepted drafts `[R]` and the draft tokens `[R, K]` the drafter proposed (target ids, the whole
    block: only the first `lengths[r]` were verified and the first `accepted[r]` were emitted; None in a round that
    skipped the drafter, e.g. by the idle backoff). `lookup_only`: a round drafted by the n-gram lookup alone while
    the drafter was backed off (`drafts` are the lookup's, `confidence_logits` None: they are not the drafter's).

    With tree drafts (`tree_budget=`) `lengths`, `accepted`, `drafts` and `confidence_logits` keep their meaning for
    the chain (verified chain drafts, chain drafts accepted before the accepted path leaves the chain: the labels
    calibration needs), and `tree_verified` / `tree_accepted` `[R]` count all verified nodes and the accepted path's
    length (tokens emitted - 1)."""

    rows: torch.Tensor
    confidence_logits: torch.Tensor | None
    lengths: torch.Tensor
    accepted: torch.Tensor
    drafts: torch.Tensor | None = None
    tree_verified: torch.Tensor | None = None
    tree_accepted: torch.Tensor | None = None
    lookup_only: bool = False


class RowOutputs:
    """The tokens generated for every row of the batch, with their stopping rules and statistics.

    Args:
        input_ids, attention_mask: the `[R, L]` left-padded prompts (read by stopping criteria only).
        max_new_tokens: tokens to generate per row (at most).
        eos_token_ids: a row finishes on (and keeps) the first of these it emits.
        stopping_criteria: called as `criteria(sequence[None], None)` after every emitted token of every row, on
            that row's prompt + generated tokens; a row finishes on the first token on which it fires.
        streamer: receives every emitted chunk (batch size 1 only; checked by the caller).
        pad_token_id: pads the rows of `sequences` past their end.
        started: `time.perf_counter()` at the start of the call (for `RowStats.seconds`).

    The tokens live in one `[R, max_new_tokens]` (CPU) buffer and `emit` is tensor code (EOS, `max_new_tokens`): no
    per-row Python unless stopping criteria or a streamer need each row's tokens. Per-round statistics are logged as
    tensors and turned into `RowStats` when `stats` is read.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 eos_token_ids: Sequence[int], stopping_criteria: Callable[..., Any] | None, streamer: Any,
                 pad_token_id: int, started: float) -> None:
        rows = input_ids.shape[0]
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self._eos = torch.tensor(sorted(self.eos), dtype=torch.long) if self.eos else None
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.pad_token_id = pad_token_id
        self.started = started
        self.buffer = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)  # generated tokens (CPU)
        self._counts = torch.zeros(rows, dtype=torch.long)  # tokens generated per row
        self._done = torch.zeros(rows, dtype=torch.bool)  # finished rows (they may still ride in the batch: `Riders`)
        self._seconds = torch.zeros(rows, dtype=torch.float64)
        self._log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, l_r, acc, emitted
        self._stats: list[RowStats] | None = None

    def remaining(self, rows: torch.Tensor) -> torch.Tensor:
        """`[R]` (CPU) drafts each of `rows` may still verify this round: its remaining tokens less the one the target
        always adds, at least 0."""
        return (self.left(rows) - 1).clamp(min=0)

    def done(self, rows: torch.Tensor) -> torch.Tensor:
        """`[R]` (CPU) whether each of `rows` has finished."""
        return self._done[rows]

    def left(self, rows: torch.Tensor) -> torch.Tensor:
        """`[R]` (CPU) tokens each of `rows` may still emit (0 once finished)."""
        return (self.max_new_tokens - self._counts[rows]).masked_fill(self._done[rows], 0)

    def emit(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, verified: torch.Tensor | None = None,
             accepted: torch.Tensor | None = None) -> torch.Tensor:
        """Appends `tokens[i, :counts[i]]` to row `rows[i]` (original index), cut at the first EOS, the first token on
        which a stopping criterion fires, or `max_new_tokens`, and streams them. With `verified` / `accepted` (the
        round's l_r and accepted drafts) the rows' `RowStats` record the round. All arguments are `[R]` / `[R, W]`
        tensors. Rows finished in an earlier round (riding along: `Riders`) take nothing and are not logged. Returns
        the `[R]` (CPU) finished mask (earlier finished rows included)."""
        tokens, counts = tokens.cpu(), counts.cpu()
        width = tokens.shape[1]
        start = self._counts[rows]
        was_done = self._done[rows]
        take = torch.minimum(counts, self.max_new_tokens - start).masked_fill(was_done, 0)  # tokens to append per row
        slots = torch.arange(width)
        stop = torch.zeros(len(rows), dtype=torch.bool)
        if self._eos is not None:
            hit = torch.isin(tokens, self._eos) & (slots[None, :] < take[:, None])
            stop = hit.any(dim=1)
            take = torch.where(stop, hit.int().argmax(dim=1) + 1, take)  # keep the first EOS itself
        if self.stopping_criteria is not None or self.streamer is not None:
            take, stop = self._per_row(rows, tokens, start, take, stop)
        keep = slots[None, :] < take[:, None]
        self.buffer[rows[:, None].expand(-1, width)[keep], (start[:, None] + slots[None, :])[keep]] = tokens[keep]
        self._counts[rows] = end = start + take
        finished = stop | (end >= self.max_new_tokens) | was_done
        newly = finished & ~was_done
        if bool(newly.any()):
            self._seconds[rows[newly]] = time.perf_counter() - self.started
            self._done[rows[newly]] = True
        if verified is not None:  # (boolean indexing copies: the log keeps its own tensors)
            live = ~was_done
            self._log.append((rows[live], verified.cpu()[live], accepted.cpu()[live], counts[live]))
        self._stats = None
        return finished

    def _per_row(self, rows: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, take: torch.Tensor,
                 stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stopping criteria (checked after every token, before the EOS cut) and the streamer, row by row."""
        take, stop = take.clone(), stop.clone()
        for i, row in enumerate(rows.tolist()):
            new = tokens[i, : int(take[i])]
            if self.stopping_criteria is not None:
                for j in range(len(new)):
                    if self._criteria_fire(row, int(start[i]), new[: j + 1]):
                        new, take[i], stop[i] = new[: j + 1], j + 1, True
                        break
            if self.streamer is not None:
                self.streamer.put(new.clone())
        return take, stop

    def _criteria_fire(self, row: int, start: int, new: torch.Tensor) -> bool:
        device = self.input_ids.device
        seq = torch.cat([self.input_ids[row, self.attention_mask[row].bool()],
                         self.buffer[row, :start].to(device), new.to(device)])[None]
        return bool(torch.as_tensor(self.stopping_criteria(seq, None)).any())

    @property
    def stats(self) -> list[RowStats]:
        """Per-row `RowStats` of the rounds so far (built from the round log)."""
        if self._stats is None:
            stats = [RowStats() for _ in range(self.buffer.shape[0])]
            for rows, verified, accepted, emitted in self._log:
                for row, v, a, e in zip(rows.tolist(), verified.tolist(), accepted.tolist(), emitted.tolist()):
                    s = stats[row]
                    s.rounds += 1
                    s.verified += v
                    s.accepted += a
                    s.accepted_lengths.append(e)
                    s.verify_lengths.append(v)
            for s, seconds in zip(stats, self._seconds.tolist()):
                s.seconds = seconds
            self._stats = stats
        return self._stats

    def count(self, row: int) -> int:
        """Tokens generated so far by row `row`."""
        return int(self._counts[row])

    def generated(self, row: int, start: int = 0) -> list[int]:
        """Row `row`'s generated tokens from index `start` on."""
        return self.buffer[row, start: int(self._counts[row])].tolist()

    def sequence(self, row: int) -> list[int]:
        """Row `row`'s prompt (padding dropped) followed by its tokens so far."""
        prompt = self.input_ids[row][self.attention_mask[row].bool()].tolist()
        return prompt + self.buffer[row, : int(self._counts[row])].tolist()

    @property
    def tokens(self) -> list[list[int]]:
        """The generated tokens of every row, as lists."""
        return [self.buffer[r, :n].tolist() for r, n in enumerate(self._counts.tolist())]

    @property
    def num_generated(self) -> torch.Tensor:
        """`[R]` tokens generated per row (on the prompts' device)."""
        return self._counts.to(self.input_ids.device)

    def sequences(self) -> torch.Tensor:
        """`[R, L + longest]`: the prompts as given, then each row's tokens right-padded with `pad_token_id`."""
        longest = int(self._counts.max())
        return torch.cat([self.input_ids, self.buffer[:, :longest].to(self.input_ids.device)], dim=1)


# ---------------------------------------------------------------------------------------------- rows and caches
def compaction_pays(holes: int, columns: int, rounds_left: int) -> bool:
    """Whether compacting a cache of `columns` columns, `holes` of them masked, saves more than it costs over the
    `rounds_left` rounds to come. A compaction copies every column once; every forward reads every column in
    attention and, with transformers' `DynamicCache`, copies it once more when it appends (`torch.cat`): measured at
    16 rows of SmolLM2-135M, a column costs a forward about 1.25x what a compaction pays for it. Counting it at 1x,
    the holes are worth removing once holes x rounds_left >= columns."""
    return holes > 0 and holes * max(0, int(rounds_left)) >= columns


def compact_target_cache(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Moves every row's valid columns to the front of each layer and drops all-empty columns. Returns the new mask."""
    order = valid_first_order(valid)
    for layer in cache.layers:
        index = order[:, None, :, None].to(layer.keys.device)
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
    return valid.gather(1, order)


@dataclass
class ActiveRows:
    """The rows still decoding, and the per-row state of their caches.

    Attributes:
        ids: `[R]` (CPU) original batch index of every active row (ascending: rows are only ever dropped).
        anchors: `[R]` each row's last emitted token, not yet in the target's cache.
        next_pos: `[R]` the position of each row's anchor.
        kv_valid: `[R, T]` which columns of the target's cache each row attends to; the others are *holes*
            (left padding, rejected drafts, padding of short rows).
        cache: the target's `DynamicCache`.
        context: the drafter's context cache (target hidden states of the verified tokens, projected into the draft
            layers' keys / values) up to the last round that drafted; None when the call never drafts
            (`speculate=False`). Read it through `drafter_context()`, which first appends what is `pending`.
        drafter: the drafter that reads `context` (None without a context).
        peak_columns: the widest the target's cache has been (columns).
        num_valid: `[R]` valid columns per row (`kv_valid.sum(1)`), kept up to date without re-reducing `kv_valid`.
        spare: columns a compaction would drop (`T - max(num_valid)`); it only changes in rounds that reject drafts
            and when rows are dropped, so most rounds never look at the mask.
        pending: the verified rounds (prompt included) not yet in `context`: `(features [R, W, m*d], positions [R, W],
            kept [R, W])` each, rows aligned with the active rows. They cost far less memory than the target's own
            cache of the same tokens (m*d numbers per token against 2 x layers x kv-heads x head-dim).
        prompt_pending: whether `pending` still holds the prompts (no round has drafted yet).
        one_time_seconds: seconds the last `drafter_context()` spent projecting the prompts (a once-per-call cost,
            like the prefill: the loop keeps it out of the per-round overhead it prices; `pop_one_time_seconds`).
    """

    ids: torch.Tensor
    anchors: torch.Tensor
    next_pos: torch.Tensor
    kv_valid: torch.Tensor
    cache: DynamicCache
    context: DSparkContextCache | None
    drafter: DSparkDrafter | None
    peak_columns: int = 0
    num_valid: torch.Tensor | None = None
    spare: int = 0
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prompt_pending: bool = False
    one_time_seconds: float = 0.0

    @classmethod
    def prefill(cls, target: PreTrainedModel, drafter: DSparkDrafter | None, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
                context: bool = True) -> tuple["ActiveRows", torch.Tensor]:
        """Runs the target over the left-padded prompts, keeps their hidden states for the drafter's context (unless
        `context` is False: a call that never drafts; projected at the first drafting round) and picks every row's
        first token (greedy or sampled). Returns the rows' state (anchors = the first tokens) and the first tokens."""
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                     use_cache=True, output_hidden_states=target_layer_ids(drafter) if context else None,
                     logits_to_keep=1)
        first = sampling.warp(out.logits[:, -1].float())
        if sampling.do_sample:
            first_tokens = torch.multinomial(torch.softmax(first, -1), 1, generator=generator).squeeze(1)
        else:
            first_tokens = first.argmax(-1)
        kv_valid = attention_mask.bool()
        num_valid = kv_valid.sum(dim=1)
        rows = cls(ids=torch.arange(input_ids.shape[0]), anchors=first_tokens, next_pos=attention_mask.sum(dim=1),
                   kv_valid=kv_valid, cache=cache, context=drafter.new_cache() if context else None,
                   drafter=drafter if context else None, peak_columns=kv_valid.shape[1], num_valid=num_valid,
                   spare=kv_valid.shape[1] - int(num_valid.max()))
        if context:
            rows.pending.append((drafter.context_features(out.hidden_states), positions, kv_valid))
            rows.prompt_pending = True
        return rows, first_tokens

    def drafter_context(self) -> DSparkContextCache:
        """The drafter's context cache with every verified token in it: appends the `pending` rounds in one
        `append_context` call (one projection over all their columns) and returns `context`."""
        if self.context is None:
            raise ValueError("this call keeps no drafter context (speculate=False)")
        if self.prompt_pending:  # the prompts alone first: their projection is timed apart (a one-time cost)
            start = time.perf_counter()
            self._project(*self.pending.pop(0))
            self.prompt_pending = False
            self.one_time_seconds += time.perf_counter() - start
        if self.pending:
            self._project(*(torch.cat(parts, dim=1) for parts in zip(*self.pending)))
            self.pending = []
        return self.context

    def _project(self, features: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor) -> None:
        device = self.drafter.device
        self.drafter.append_context(self.context, features.to(device), positions.to(device), kept.to(device))

    def pop_one_time_seconds(self) -> float:
        """The seconds of one-time work (the prompts' context projection) since the last call; resets them."""
        seconds, self.one_time_seconds = self.one_time_seconds, 0.0
        return seconds

    def __len__(self) -> int:
        return len(self.ids)

    def drop(self, finished: torch.Tensor) -> None:
        """Removes the rows marked in the `[R]` (CPU) mask `finished` from every tensor and both caches."""
        if not finished.any():
            return
        keep = (~finished).nonzero().flatten()
        if len(keep):
            self.cache.batch_select_indices(keep.to(self.kv_valid.device))
            if self.context is not None:
                self.context.select_rows(keep.to(self.drafter.device))
                self.pending = [tuple(t.index_select(0, keep.to(t.device)) for t in part) for part in self.pending]
        self.ids, self.anchors, self.next_pos = self.ids[keep], self.anchors[keep], self.next_pos[keep]
        self.kv_valid = self.kv_valid[keep]
        self.num_valid = self.num_valid[keep.to(self.num_valid.device)]
        self.spare = self.kv_valid.shape[1] - int(self.num_valid.max()) if len(keep) else 0

    def compact_holes(self, hole_budget: int, rounds_left: int | None = None, floor: int = 0) -> bool:
        """Compacts both caches once the widest row carries more than `hole_budget` masked columns, or, given
        `rounds_left`, more than `floor` where `compaction_pays`. Returns whether it did."""
        if self.spare <= hole_budget and not (
                rounds_left is not None and self.spare > floor
                and compaction_pays(self.spare, self.kv_valid.shape[1], rounds_left)):
            return False
        self.kv_valid = compact_target_cache(self.cache, self.kv_valid)
        if self.context is not None:
            self.drafter_context().compact()  # (pending columns first: compaction reorders all of them)
        self.spare = 0
        return True

    def advance(self, hidden_states: Sequence[torch.Tensor] | None, positions: torch.Tensor, kept: torch.Tensor,
                num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """After a verification forward over `positions` `[R, W]`: the columns in `kept` (anchor + accepted drafts)
        become context of the target's cache and, with their hidden states, of the drafter's (when there is a
        drafter context: `pending` until a round drafts); the rest stay holes. `next_tokens` (the correction / bonus
        token) become the anchors."""
        self.kv_valid = torch.cat([self.kv_valid, kept], dim=1)
        self.peak_columns = max(self.peak_columns, self.kv_valid.shape[1])
        if kept.shape[1] == 1:  # nothing to reject: every row keeps its anchor, `spare` is unchanged
            self.num_valid = self.num_valid + 1
        else:
            self.num_valid = self.num_valid + kept.sum(dim=1)
            self.spare = self.kv_valid.shape[1] - int(self.num_valid.max())
        if self.context is not None:
            self.pending.append((self.drafter.context_features(hidden_states), positions, kept))
        self.next_pos = self.next_pos + 1 + num_accepted
        self.anchors = next_tokens


def target_layer_ids(drafter: DSparkDrafter) -> list[int]:
    """The `output_hidden_states` indices of the target layers the drafter reads (`hidden_states[i + 1]`)."""
    return [i + 1 for i in drafter.config.target_layer_ids]


# ---------------------------------------------------------------------------------------------- cost and policy
@dataclass
class RoundClock:
    """The per-round cost outside the target's forward, measured over past drafting rounds.

    Attributes:
        priced: whether the policies price this overhead (`count_round_overhead` and a policy in `PRICED_POLICIES`).
        overhead: total seconds of the measured rounds outside the target's verification forward.
        drafting: total seconds of those rounds inside `drafter.draft`.
        rounds: measured rounds.
        recent: for the last `window` rounds of every kind, whether each was a drafter round (the kind whose
            overhead `add` measures) or not (plain, or lookup-only: no drafter forward) (`count_round`).
    """

    priced: bool
    overhead: float = 0.0
    drafting: float = 0.0
    rounds: int = 0
    recent: list[bool] = field(default_factory=list)
    window: int = 32
    tails: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})

    def add(self, overhead_seconds: float, draft_seconds: float) -> None:
        """Records one drafting round: its time outside the target's forward and its time inside the drafter."""
        self.overhead += overhead_seconds
        self.drafting += draft_seconds
        self.rounds += 1

    def add_tail(self, verified: bool, seconds: float) -> None:
        """Records a chain round's tail: its seconds after its lengths were fixed, outside the target's forward (the
        inputs, verification, cache and context updates, emission). `verified`: whether it verified a draft."""
        self.tails[bool(verified)] = (self.tails[bool(verified)] + [float(seconds)])[-self.window:]

    def tail_cost(self, sps: Any, verified: bool) -> Any:
        """SPS(B) plus the median measured tail of recent rounds that verified drafts (`verified`) or did not."""
        return WithRoundOverhead(sps, statistics.median(self.tails[bool(verified)]))

    @property
    def tails_measured(self) -> bool:
        """Whether the tails are priced and both kinds (verifying and plain rounds) have been measured."""
        return self.priced and all(self.tails.values())

    def count_round(self, drafted: bool) -> None:
        """Records that a round ran, and whether the drafter drafted it (its kind, for `drafting_share`)."""
        self.recent = (self.recent + [bool(drafted)])[-self.window:]

    @property
    def drafting_share(self) -> float:
        """The share of the last `window` rounds the drafter drafted (1.0 before any round)."""
        return sum(self.recent) / len(self.recent) if self.recent else 1.0

    @property
    def measured(self) -> bool:
        """Whether the overhead is priced and at least one round has been measured."""
        return self.priced and self.rounds > 0

    def cost(self, sps: Any, with_drafter: bool = True, amortized: bool = False) -> Any:
        """The cost curve the policies price: SPS(B) plus the mean measured per-round overhead of past drafting rounds
        (`with_drafter=False`: less the drafter's own mean time, i.e. what a plain decoding round pays).

        `amortized=True` (a round's width): the overhead times `drafting_share`. Once a round has drafted its
        overhead is spent whatever it verifies; what a shorter verification costs is the later rounds that must
        emit the tokens it did not, and those pay the overhead only as often as the drafter drafts (plain and
        lookup-only rounds do not run it). Where every round drafts (batch 1) that is the whole overhead; under load,
        where the backoff makes most rounds plain or lookup-only, the
        full overhead added to every width lowered the bar for verifying: at 64 rows, 2-token rounds that accepted
        13-40 of 64 drafts, where one costs 1.6x a plain step and pays only above about 38."""
        if not self.measured:
            return sps
        overhead = self.overhead / self.rounds
        if not with_drafter:
            overhead = max(overhead - self.drafting / self.rounds, 0.0)
        if amortized:
            overhead *= self.drafting_share
        return WithRoundOverhead(sps, overhead)


class MeasuredCost:
    """SPS(B) corrected by the verification forwards this loop has timed.

    A profiled table can be stale (measured on another machine, or while other work shared the cores) and misses
    effects of the real shapes (R rows x width over the real caches). The loop times every target forward of a round
    (`observe(B, seconds)`, B = the forward's tokens, padding included) and the policies price:

    * at a B observed at least twice (after a first, warm-up forward of that shape): the median of its last
      `window` times;
    * elsewhere: the prior's time scaled by the median ratio observed / prior over the last `ratio_window` forwards;

    then a running maximum over the queried B (a forward of more tokens never takes less time). Read from past rounds
    only, so the policies stay non-anticipating: the output is the same as with any other cost curve.

    The times are kept per number of rows (`set_rows`, which the loop calls every round): 64 rows of 2 tokens and 32
    rows of 4 are both B = 128 but not the same forward. A `RowScaledCost` prior follows the rows too.
    """

    def __init__(self, prior: Any, window: int = 5, ratio_window: int = 32) -> None:
        self.prior, self.window, self.ratio_window = prior, int(window), int(ratio_window)
        self.samples: dict[tuple[int | None, int], list[float]] = {}
        self.ratios: list[float] = []
        self.rows: int | None = None

    def set_rows(self, rows: int) -> None:
        """The rows of the coming round (its forwards are recorded and priced at this many rows)."""
        self.rows = int(rows)
        if isinstance(self.prior, RowScaledCost):
            self.prior.rows = self.rows

    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Records one timed target forward of `batch_tokens` tokens (the first at each size is a warm-up: dropped)."""
        b = int(batch_tokens)
        if b < 1 or not seconds > 0:
            return
        key = (self.rows, b)
        if key not in self.samples:
            self.samples[key] = []
            return
        self.samples[key] = (self.samples[key] + [float(seconds)])[-self.window:]
        prior = 1.0 / float(sps_values(self.prior, torch.tensor([b]))[0])
        self.ratios = (self.ratios + [float(seconds) / prior])[-self.ratio_window:]

    def seconds_per_step(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        b = torch.as_tensor(batch_tokens).long().reshape(-1)
        seconds = 1.0 / sps_values(self.prior, b)
        if self.ratios:
            seconds = seconds * statistics.median(self.ratios)
        measured = {k: statistics.median(v) for (r, k), v in self.samples.items() if r == self.rows and len(v) >= 2}
        if measured:
            seconds = torch.tensor([measured.get(int(x), float(s)) for x, s in zip(b.tolist(), seconds.tolist())],
                                   dtype=torch.float64)
        order = torch.argsort(b, stable=True)
        monotone = torch.empty_like(seconds)
        monotone[order] = torch.cummax(seconds[order], dim=0).values
        return monotone.reshape(torch.as_tensor(batch_tokens).shape)

    def steps_per_second(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        return 1.0 / self.seconds_per_step(batch_tokens)


@dataclass
class GrowthClock:
    """The measured cost of growing trees beyond their chains, over past rounds that grew (running means).

    Attributes:
        priced: whether the tree policies price growth (a priced policy with `count_round_overhead` and trees).
        step_seconds: total seconds of the measured growth steps; steps: how many (a step adds one node to every
            growing row: a sequential-head step, a projection over the slot's M candidates, the frontier update and
            the plan's check).
        tree_seconds: total fixed seconds of the measured growing rounds (the grower's set-up and the `DraftTree`,
            its selection, per-node inputs and 4-D mask, tree verification); rounds: how many.

    Until a round has grown (and been timed) growth is priced at zero, i.e. by its verification width alone, so the
    first trees are grown as the width allows and measured; the costs are then the machine's own. They are read
    from past rounds only, so the plan and the admission stay non-anticipating.
    """

    priced: bool
    step_seconds: float = 0.0
    steps: int = 0
    tree_seconds: float = 0.0
    rounds: int = 0

    def add(self, steps: int, step_seconds: float, tree_seconds: float) -> None:
        """Records one round that grew `steps` steps in `step_seconds`, plus `tree_seconds` of fixed tree work."""
        if steps <= 0:
            return
        self.steps += steps
        self.step_seconds += step_seconds
        self.tree_seconds += tree_seconds
        self.rounds += 1

    def cost(self) -> GrowthCost | None:
        """The `GrowthCost` to price: None when growth is not priced, free until a growing round was measured."""
        if not self.priced:
            return None
        if self.rounds == 0:
            return GrowthCost()
        return GrowthCost(step_seconds=max(self.step_seconds / self.steps, 0.0),
                          tree_seconds=max(self.tree_seconds / self.rounds, 0.0))


@dataclass
class ConfidenceHistory:
    """The async policy's confidences `[R, K]` (CPU) of the last two drafting rounds, with the rows they belong to
    (for tree drafts: node survivals `[R, N]` and their validity `valid`)."""

    confidences: list[torch.Tensor] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    valid: list[torch.Tensor | None] = field(default_factory=list)

    def push(self, confidences: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Records a round's confidences of `rows` (original indices); keeps the last two rounds."""
        self.confidences = (self.confidences + [confidences.float().cpu()])[-2:]
        self.rows = (self.rows + [rows.clone().cpu()])[-2:]
        self.valid = (self.valid + [None if valid is None else valid.cpu()])[-2:]

    def valid_two_rounds_ago(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The validity mask pushed with the confidences of `two_rounds_ago` (None if none was)."""
        if len(self.confidences) < 2 or self.valid[-2] is None:
            return None
        old_rows = self.rows[-2]
        where = torch.empty(int(old_rows.max()) + 1, dtype=torch.long)
        where[old_rows] = torch.arange(len(old_rows))
        return self.valid[-2][where[rows]]

    def survival_two_rounds_ago(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two drafting rounds ago as node survivals and validity `[R, N]` (for `async_tree`), whichever kind of round
        it was: a chain round's confidences become their prefix survival, every draft valid. None before two rounds."""
        stale = self.two_rounds_ago(rows)
        if stale is None:
            return None
        valid = self.valid_two_rounds_ago(rows)
        if valid is None:  # (a chain-style round: a gated lookup-only round between tree rounds)
            return prefix_survival(stale), torch.ones_like(stale, dtype=torch.bool)
        return stale, valid

    def confidences_two_rounds_ago(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Two drafting rounds ago as chain confidences `[R, K]` (for `async_lengths`), whichever kind of round it was:
        a tree round's valid node survivals, best first per row, become the confidences of the chain they would be
        (c_j = s_j / s_{j-1}; 0 past a row's last node). None before two rounds."""
        stale = self.two_rounds_ago(rows)
        valid = None if stale is None else self.valid_two_rounds_ago(rows)
        if valid is None:
            return stale
        ranked = torch.where(valid, stale, torch.zeros_like(stale)).sort(dim=1, descending=True).values
        previous = torch.cat([torch.ones_like(ranked[:, :1]), ranked[:, :-1]], dim=1)
        return torch.where(previous > 0, ranked / previous.clamp_min(1e-12), torch.zeros_like(ranked)).clamp(0.0, 1.0)

    def two_rounds_ago(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The confidences of two drafting rounds ago for `rows` (all active then: rows are only ever dropped), or
        None before there are two."""
        if len(self.confidences) < 2:
            return None
        old, old_rows = self.confidences[-2], self.rows[-2]
        where = torch.empty(int(old_rows.max()) + 1, dtype=torch.long)
        where[old_rows] = torch.arange(len(old_rows))
        return old[where[rows]]


@dataclass
class OnlineCalibration:
    """How far the survival estimates of past rounds over- or under-predicted what the target accepted.

    kappa = (accepted + prior) / (predicted + prior) over the last `window` drafting rounds, where `predicted` sums
    the estimated survival of every verified draft (node) and `accepted` counts the drafts the target accepted; the
    priced policies multiply this round's survivals by kappa (clipped to [0, 1]). The STS temperatures calibrate a
    drafter on held-out prompts; this corrects, within one call, for the prompts and the draft source at hand (lookup
    drafts and drafter drafts, in-domain or not). It reads past rounds only, so decoding stays lossless.

    Attributes:
        window: drafting rounds remembered; prior: pseudo-counts pulling kappa towards 1 while few drafts were seen.
        history: (predicted, accepted) per remembered round.
    """

    window: int = 16
    prior: float = 2.0
    history: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def kappa(self) -> float:
        predicted = sum(p for p, _, _ in self.history)
        accepted = sum(a for _, a, _ in self.history)
        return (accepted + self.prior) / (predicted + self.prior)

    @property
    def verified(self) -> int:
        """Drafts (nodes) verified in the remembered rounds: the evidence behind kappa."""
        return sum(n for _, _, n in self.history)

    def observe(self, survival: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """One round: `survival` `[R, N]` estimates (uncorrected), `verified` `[R, N]` bool, `accepted` `[R]` counts."""
        verified = verified.cpu()
        predicted = float((survival.detach().float().cpu() * verified).sum())
        if predicted <= 0:
            return
        entry = (predicted, float(accepted.sum()), int(verified.sum()))
        self.history = (self.history + [entry])[-self.window:]

    def survival(self, survival: torch.Tensor) -> torch.Tensor:
        """`survival` scaled by kappa, clipped to [0, 1]."""
        return (survival * self.kappa).clamp(0.0, 1.0) if self.history else survival

    def confidences(self, confidences: torch.Tensor) -> torch.Tensor:
        """Per-position confidences whose prefix survivals are the corrected ones (the first position scaled)."""
        if not self.history:
            return confidences
        out = confidences.clone()
        out[:, :1] = (out[:, :1] * self.kappa).clamp(0.0, 1.0)
        return out


PROBE_LENGTH = 1  # drafts per row a source verifies until it has seen a draft per row verified (`LengthPolicy`)


@dataclass
class LengthPolicy:
    """A round's verification lengths l_r.

    Attributes:
        name: "fixed" (the whole block), "threshold" (prefix survival >= `threshold`), "scheduled" (Algorithm 1) or
            "async" (section 5.2: the token budget from confidences two rounds old).
        block_size: drafts per row and round (K).
        sps: the cost curve SPS(B) ("scheduled" / "async").
        threshold: the prefix-survival cut of "threshold".
        clock: the measured round overhead, added to `sps` when priced.
        history: the async policy's past confidences.
        growth: the measured cost of growing trees, priced by `admit`, `growth_plan` and `tree_pays` when
            `growth.priced` (trees with "scheduled" / "async" and the round overhead counted).
        padded: price the verification forward as the rectangle it is (R rows x the widest row: `schedule_width`,
            `schedule_tree(padded=True)`) instead of Algorithm 1's sum of per-row lengths.
        calibration: for "scheduled" / "async": the survival estimates corrected by what past rounds accepted
            (`OnlineCalibration`; None: the estimates as the drafter gives them).
        lookup_calibration: the same for lookup-only rounds (`lookup_only=True`), kept apart: the lookup's estimates
            are calibrated on held-out answers on their own, and a drafter whose first rounds accept nothing must not
            shrink them (with one shared factor, those rounds stopped verifying anything and, verifying nothing,
            never corrected it).

    With a calibration, a source's rounds verify at most `PROBE_LENGTH` (1) draft per row until its calibration has
    seen as many verified drafts as there are rows: its estimates are uncorrected until then, and out of domain they
    can be far off (at 16 rows on gsm_symbolic prompts the release drafter's first round expected 27.8 extra tokens,
    verified 80 drafts in a 6-token forward, 2.7x a plain one, and accepted none). One draft per row bounds that bet
    to a 2-token forward and still calibrates every row. A first round in which only a few rows verified is not
    enough evidence: after one that verified 2 drafts in 2 rows (both accepted, kappa 1.3) the next verified 76
    drafts in 16 rows on 26.5 expected extra tokens and accepted none.
    """

    name: str
    block_size: int
    sps: Any
    threshold: float
    clock: RoundClock
    history: ConfidenceHistory = field(default_factory=ConfidenceHistory)
    growth: GrowthClock = field(default_factory=lambda: GrowthClock(priced=False))
    padded: bool = False
    calibration: OnlineCalibration | None = None
    lookup_calibration: OnlineCalibration | None = None

    def _conf(self, confidences: torch.Tensor, lookup_only: bool = False) -> torch.Tensor:
        conf = confidences.detach().float().cpu()
        calibration = self.lookup_calibration if lookup_only else self.calibration
        return conf if calibration is None else calibration.confidences(conf)

    def _survival(self, survival: torch.Tensor) -> torch.Tensor:
        survival = survival.detach().float().cpu()
        return survival if self.calibration is None else self.calibration.survival(survival)

    def _tree_survival(self, tree: DraftTree, lookup_from: int | None = None) -> torch.Tensor:
        """The tree's survival estimates, corrected: nodes `lookup_from..` (a lookup branch's own nodes,
        `tree.lookup_branches`) by `lookup_calibration`, the others by `calibration` (each where it exists); then made
        non-increasing from parent to child again (two sources' corrections differ), so that what a policy keeps is
        still a tree."""
        survival = tree.survival.detach().float().cpu()
        if lookup_from is None or self.lookup_calibration is None:
            return self._survival(survival)
        from_lookup = torch.arange(survival.shape[1]) >= lookup_from
        out = torch.where(from_lookup[None, :], self.lookup_calibration.survival(survival), self._survival(survival))
        parents = tree.parents.cpu()
        for node in range(lookup_from, out.shape[1]):  # (parents precede children; below lookup_from: one source)
            parent = parents[:, node]
            above = out.gather(1, parent.clamp(min=0)[:, None]).squeeze(1)
            out[:, node] = torch.where(parent >= 0, torch.minimum(out[:, node], above), out[:, node])
        return out

    def observe(self, block: Any, verified: torch.Tensor, accepted: torch.Tensor, lookup_only: bool = False,
                lookup_from: int | None = None, accepted_nodes: torch.Tensor | None = None) -> None:
        """After verification: feeds `calibration` (`lookup_calibration` for a lookup-only round) with this round's
        estimates of the verified drafts (`verified`: lengths `[R]` of a chain, or the `[R, N]` admitted nodes of a
        tree) and the accepted counts `[R]`. A tree with a lookup branch (its own nodes from `lookup_from` on) and its
        accepted nodes `accepted_nodes` `[R, N]` feeds each source's calibration with its own nodes."""
        if block is None:
            return
        if (isinstance(block, DraftTree) and block.survival is not None and lookup_from is not None
                and accepted_nodes is not None and self.lookup_calibration is not None):
            survival = block.survival.detach().float().cpu().masked_fill(~block.valid.cpu(), 0.0)
            verified, accepted_nodes = verified.cpu().bool(), accepted_nodes.cpu().bool()
            from_lookup = (torch.arange(survival.shape[1]) >= lookup_from)[None, :].expand_as(verified)
            for source, mask in ((self.calibration, ~from_lookup), (self.lookup_calibration, from_lookup)):
                if source is None:  # ("fixed" with `lookup_max_tokens` and `sps`: the lookup's calibration alone)
                    continue
                source.observe(survival.masked_fill(~mask, 0.0), verified & mask, (accepted_nodes & mask).sum(dim=1))
            return
        calibration = self.lookup_calibration if lookup_only else self.calibration
        if calibration is None:
            return
        if isinstance(block, DraftTree):
            if block.survival is not None:
                calibration.observe(block.survival.masked_fill(~block.valid, 0.0), verified, accepted)
        elif block.confidences is not None:
            survival = prefix_survival(block.confidences.detach().float().cpu())
            lengths = verified.cpu()
            mask = torch.arange(survival.shape[1])[None, :] < lengths[:, None]
            calibration.observe(survival, mask, accepted)

    def lengths(self, block: DraftBlock, rows: torch.Tensor, with_drafter: bool = True) -> torch.Tensor:
        """`[R]` (CPU) lengths for this round's drafts of `rows` (original indices); reads past rounds only.
        `with_drafter=False` is a lookup-only round (lookup drafts alone, no drafter): priced with the measured
        overhead less the drafter's mean time, its estimates corrected by `lookup_calibration`."""
        if self.name == "fixed":
            return fixed_lengths((len(rows), self.block_size))
        conf = block.confidences.detach().float().cpu()
        if self.name == "threshold":
            return threshold_lengths(conf, self.threshold)
        conf = self._conf(conf, lookup_only=not with_drafter)
        stale = self.history.confidences_two_rounds_ago(rows) if self.name == "async" else None
        cost = self.clock.cost(self.sps, with_drafter=with_drafter, amortized=True)
        if stale is None:
            lengths = schedule_width(conf, cost) if self.padded else schedule_prefix(conf, cost)
        else:
            lengths = async_width(conf, stale, cost) if self.padded else async_lengths(conf, stale, cost)
        if self.name == "async":  # only async reads past confidences
            self.history.push(conf, rows)
        calibration = self.lookup_calibration if not with_drafter else self.calibration
        if calibration is not None and calibration.verified < len(rows):  # probing: one draft per row at most
            lengths = lengths.clamp(max=PROBE_LENGTH)
        return lengths

    def admit(self, tree: DraftTree, rows: torch.Tensor, lookup_from: int | None = None) -> torch.Tensor:
        """`[R, N]` (CPU) bool: the nodes of this round's trees of `rows` to verify; reads past rounds only. The same
        policies over node survivals (`scheduler.schedule_tree` & co.); on a chain the same lengths as `lengths`."""
        valid = tree.valid.cpu()
        if self.name == "fixed":
            return valid
        survival = tree.survival.detach().float().cpu()
        if self.name == "threshold":
            return threshold_tree(survival, valid, self.threshold)
        survival = self._tree_survival(tree, lookup_from)  # (a lookup branch: corrected by its own calibration)
        stale = self.history.survival_two_rounds_ago(rows) if self.name == "async" else None
        growth = self.growth.cost()
        priced = dict(growth=growth, num_chain=tree.num_chain) if growth is not None else {}
        priced["padded"] = self.padded
        if stale is None:
            admitted = schedule_tree(survival, valid, self.clock.cost(self.sps, amortized=True), **priced)
        else:
            admitted = async_tree(survival, valid, *stale, self.clock.cost(self.sps, amortized=True), **priced)
        if self.name == "async":
            self.history.push(survival, rows, valid)
        if self.calibration is not None and self.calibration.verified < len(rows):  # probing: depth 1 only
            admitted &= tree.depths.cpu() <= PROBE_LENGTH
        return admitted

    def growth_plan(self) -> GrowthPlan:
        """The plan `tree.TreeDrafting.grow` consults before each growth step: `scheduler.schedule_growth` with this
        round's cost curve (overhead included) and the measured growth cost (the "scheduled" break, for "async" too:
        its stale budget caps what is verified, not what is worth growing)."""
        sps, growth, k, padded = (self.clock.cost(self.sps, amortized=True), self.growth.cost(), self.block_size,
                                  self.padded)

        def plan(survival: torch.Tensor, valid: torch.Tensor, next_survival: torch.Tensor,
                 next_valid: torch.Tensor) -> torch.Tensor:
            return schedule_growth(self._survival(survival), valid, self._survival(next_survival), next_valid, sps,
                                   growth, k, padded=padded)

        return plan

    def tree_pays(self, tree: DraftTree, admitted: torch.Tensor, growth_steps: int = 0,
                  lookup_from: int | None = None) -> bool:
        """`pays` for a tree round: expected throughput of the admitted nodes (with the `growth_steps` grown, priced
        when growth is) against plain decoding."""
        if not bool(admitted.any()):
            return False
        if not self.clock.measured or tree.survival is None:
            return True
        survival = self._tree_survival(tree, lookup_from).masked_fill(~tree.valid.cpu(), 0.0)
        return (expected_tree_throughput(survival, admitted, self.clock.cost(self.sps), growth=self.growth.cost(),
                                         growth_steps=growth_steps, padded=self.padded)
                > expected_tree_throughput(survival, torch.zeros_like(admitted),
                                           self.clock.cost(self.sps, with_drafter=False), padded=self.padded))

    def probe_skip(self, rows: int, probe_seconds: float | None = None, share: float = 0.05) -> int:
        """The shortest idle-backoff skip that keeps a failed probe within `share` of the time the skipped rounds
        take: floor(probe seconds / (share x a plain round's seconds at `rows` rows)), the plain round priced on the
        cost curve plus the measured overhead less the drafter; the probe is the drafter's mean measured time unless
        `probe_seconds` is given (a lookup-only round's proposals). Under load a drafter forward is a large fraction
        of a round (64 rows: its LM head over 64 x K slots), so probing every few rounds is what costs the most when
        nothing pays. 2 (the doubling schedule's start) before a round has been measured; 0 for a free probe."""
        if not self.clock.measured:
            return 2
        probe = self.clock.drafting / self.clock.rounds if probe_seconds is None else float(probe_seconds)
        if probe <= 0.0:
            return 0
        plain = self.clock.cost(self.sps, with_drafter=False)
        seconds = 1.0 / float(torch.as_tensor(plain.steps_per_second(torch.tensor([int(rows)]))).reshape(-1)[0])
        return math.floor(probe / (share * seconds))

    def worth_verifying(self, block: DraftBlock, lengths: torch.Tensor, lookup_only: bool = False) -> bool:
        """Whether this round, its drafts already made, is expected to emit faster by verifying `lengths` than as a
        plain step. The drafting is spent either way; what differs is the forward (B tokens against one per row) and
        the round's tail (`RoundClock.add_tail`): under load a round that verifies drafts costs more outside the
        forward than a plain one (verification, per-row emission of several tokens, the drafter's context), which
        the cost curve does not see, so drafts that would pay for their width alone may not pay for the round.
        Measured on past rounds and decided before the target runs: lossless either way. True where not priced or
        not yet measured."""
        if (self.name not in PRICED_POLICIES or int(lengths.max()) == 0 or not self.clock.tails_measured
                or block.confidences is None):
            return True
        conf, lengths = self._conf(block.confidences, lookup_only=lookup_only), lengths.cpu()
        plain = expected_throughput(conf, torch.zeros_like(lengths), self.clock.tail_cost(self.sps, False),
                                    padded=self.padded)
        return expected_throughput(conf, lengths, self.clock.tail_cost(self.sps, True), padded=self.padded) > plain

    def pays(self, block: DraftBlock, lengths: torch.Tensor, alternative: DraftBlock | None = None,
             lookup_seconds: float | None = None) -> bool:
        """Whether drafting this round is expected to beat plain decoding once the drafter's own time is priced: False
        when no row verifies a draft; with a measured overhead, a comparison of expected throughputs.

        `alternative`: what the round would have drafted without the drafter (the lookup's drafts alone, when the
        rounds the backoff skips are lookup-only rounds). The drafter then pays only if its round also beats that
        one, priced without the drafter's time at its own best lengths; otherwise backing it off loses nothing.
        `lookup_seconds`: this is a lookup-only round, priced without the drafter's time but with its proposals'
        measured seconds (under load, 64 rows' proposals are a sizeable share of a round)."""
        if int(lengths.max()) == 0:
            return False
        lookup_only = lookup_seconds is not None
        if not self.clock.measured or block.confidences is None:
            return True
        conf, lengths = self._conf(block.confidences, lookup_only=lookup_only), lengths.cpu()
        plain_cost = self.clock.cost(self.sps, with_drafter=False)
        baseline = expected_throughput(conf, torch.zeros_like(lengths), plain_cost, padded=self.padded)
        if alternative is not None and alternative.confidences is not None:
            other = self._conf(alternative.confidences)  # (the same correction as the round it is compared with)
            best = schedule_width(other, plain_cost) if self.padded else schedule_prefix(other, plain_cost)
            baseline = max(baseline, expected_throughput(other, best, plain_cost, padded=self.padded))
        cost = WithRoundOverhead(plain_cost, float(lookup_seconds)) if lookup_only else self.clock.cost(self.sps)
        return expected_throughput(conf, lengths, cost, padded=self.padded) > baseline


@dataclass
class GateEvidence:
    """What the rounds of one lookup-strength bin did, for `DrafterGate` (running averages; None until observed).

    Attributes:
        drafted_seconds: a round's seconds when it ran the drafter.
        lookup_seconds: a round's seconds when it verified the lookup's drafts alone.
        lookup_tokens: per row, the drafts the lookup alone gets accepted (in a drafting round: its proposal's
            longest prefix on the tokens the target emitted, which is what a lookup-only round would have accepted).
        drafter_gain: per row, the accepted drafts a drafting round added to that (its accepted drafts minus the
            lookup's alone; negative where the width cap dropped lookup nodes the target would have taken).
        drafted_rounds: drafting rounds observed.
    """

    drafted_seconds: float | None = None
    lookup_seconds: float | None = None
    lookup_tokens: float | None = None
    drafter_gain: float | None = None
    drafted_rounds: int = 0


def _lookup_alone(tokens: Sequence[int], emitted: Sequence[int], cap: int | None) -> int:
    """Accepted drafts of a lookup proposal `tokens` verified alone (greedy), given what the target emitted this round
    (`emitted`: accepted drafts then the target's next token): their longest common prefix, at most `cap`."""
    n = 0
    for proposed, actual in zip(tokens, emitted):
        if proposed != actual:
            break
        n += 1
    return n if cap is None else min(n, cap)


@dataclass
class DrafterGate:
    """Whether a round with lookup branches runs the drafter at all (`batched.generate(lookup=, tree_budget=)`).

    Next to a lookup branch the drafter's nodes add accepted tokens only where the lookup's fail, and its forward and
    wider verification cost time in every round. The gate decides from what rounds like this one *realized*: rounds
    are binned by the lookup's expected accepted drafts per row (the sum of its proposal's prefix survival, known
    before drafting from the sequence alone; bin edges `edges`), and per bin it keeps a drafting round's seconds
    T_D, a lookup-only round's seconds T_L, the lookup's accepted drafts a per row and the drafter's extra ones g
    (both measured in drafting rounds: under greedy verification the lookup alone would have accepted its
    proposal's longest prefix on the emitted tokens, so a drafting round also tells what skipping it would have
    accepted). The drafter runs iff it emits faster per row:

        (1 + a + g) / T_D  >=  (1 + a) / T_L        (T_L = T_D - the drafter's seconds until a skip is timed).

    Before a bin has `min_rounds` drafting rounds the prior decides: the drafter's typical chain survival s^D_j (its
    recent rounds' estimates) and the lookup's s^L_j give an expected gain sum_r sum_j s^D_j (1 - s^L_rj)
    (independence assumed, so it errs towards drafting) against the drafter's measured share of a round. A bin the
    gate keeps skipping drafts again after `explore_every` skips in a row, so its evidence stays current. Rounds with
    no lookup proposal at all always draft. A round that skips the drafter verifies the lookup's drafts alone (a
    lookup-only round).

    Decided from past rounds and the lookup's deterministic proposals only. Lookup branches are greedy-only, where any
    such rule leaves the output the target's own.

    Attributes:
        decay: weight of a new observation in the running averages.
        edges: bin edges on the lookup's expected accepted drafts per row.
        min_rounds: drafting rounds a bin needs before its own evidence decides.
        explore_every: a bin's consecutive skips after which the next round drafts anyway.
        cap: the most nodes a round verifies (`tree_max_nodes`; None: no cap), for the lookup-alone counterfactual.
        drafter_seconds, other_seconds: running averages (None until observed).
        survival: `[K]` running average of the drafter's chain survival estimates (None until observed).
        evidence: per bin, what its rounds realized (`GateEvidence`).
        skipped: rounds the gate took from the drafter (for records and tests).
    """

    decay: float = 0.3
    edges: tuple[float, ...] = (0.5, 1.0, 2.0, 3.5)
    min_rounds: int = 2
    explore_every: int = 8
    cap: int | None = None
    drafter_seconds: float | None = None
    other_seconds: float | None = None
    survival: torch.Tensor | None = None
    evidence: dict[int, GateEvidence] = field(default_factory=dict)
    skipped: int = 0
    _streak: dict[int, int] = field(default_factory=dict, repr=False)

    def _average(self, old: Any, new: Any) -> Any:
        return new if old is None else (1 - self.decay) * old + self.decay * new

    def bin(self, proposals: Sequence[Any]) -> int:
        """The bin of a round: where the lookup's expected accepted drafts per row fall among `edges`."""
        expected = sum(sum(p.survival) for p in proposals) / max(1, len(proposals))
        return sum(expected >= edge for edge in self.edges)

    def observe(self, round_seconds: float, drafter_seconds: float = 0.0,
                chain_survival: torch.Tensor | None = None, proposals: Sequence[Any] | None = None,
                emitted: Sequence[Sequence[int]] | None = None) -> None:
        """A verifying round's seconds (one-time work excluded), of which `drafter_seconds` were the drafter's (0 for a
        lookup-only round), and the drafter's chain survival estimates `[R, K]` when it drafted. With the round's
        lookup `proposals` and each row's `emitted` tokens (accepted drafts, then the target's next token) the bin of
        the round learns what it realized (`GateEvidence`)."""
        drafted = chain_survival is not None
        self.other_seconds = self._average(self.other_seconds, max(0.0, round_seconds - drafter_seconds))
        if drafted:
            self.drafter_seconds = self._average(self.drafter_seconds, drafter_seconds)
            mean = chain_survival.detach().float().cpu().mean(dim=0)
            self.survival = mean if self.survival is None or self.survival.shape != mean.shape else \
                self._average(self.survival, mean)
        if proposals is None or emitted is None or not proposals:
            return
        evidence = self.evidence.setdefault(self.bin(proposals), GateEvidence())
        alone = [_lookup_alone(p.tokens, e, self.cap) for p, e in zip(proposals, emitted)]
        rows = len(alone)
        if drafted:
            accepted = [max(0, len(e) - 1) for e in emitted]
            evidence.drafted_seconds = self._average(evidence.drafted_seconds, round_seconds)
            evidence.drafter_gain = self._average(evidence.drafter_gain,
                                                  sum(a - b for a, b in zip(accepted, alone)) / rows)
            evidence.drafted_rounds += 1
        else:  # (what it verified and accepted: the emitted bonus token may match the proposal beyond that)
            alone = [min(a, max(0, len(e) - 1)) for a, e in zip(alone, emitted)]
            evidence.lookup_seconds = self._average(evidence.lookup_seconds, round_seconds)
        evidence.lookup_tokens = self._average(evidence.lookup_tokens, sum(alone) / rows)

    def _prior(self, proposals: Sequence[Any]) -> bool:
        """The independence estimate (before a bin has evidence of its own)."""
        k = self.survival.shape[0]
        lookup = torch.zeros(len(proposals), k)
        for r, proposal in enumerate(proposals):
            s = list(proposal.survival)[:k]
            if s:
                lookup[r, : len(s)] = torch.tensor(s)
        gain = float((self.survival[None, :] * (1.0 - lookup)).sum())
        base = len(proposals) + float(lookup.sum())
        return gain * self.other_seconds > base * self.drafter_seconds

    def runs_drafter(self, proposals: Sequence[Any]) -> bool:
        """Whether this round should run the drafter, given each row's lookup proposal (`LookupProposal`)."""
        if self.drafter_seconds is None or self.other_seconds is None or self.survival is None:
            return True
        if not any(p.tokens for p in proposals):
            return True  # (a lookup-only round would be a plain step)
        b = self.bin(proposals)
        evidence = self.evidence.get(b)
        if evidence is not None and evidence.drafted_rounds >= self.min_rounds:
            t_draft = evidence.drafted_seconds
            t_lookup = evidence.lookup_seconds
            if t_lookup is None:
                t_lookup = max(1e-9, t_draft - self.drafter_seconds)
            a, g = evidence.lookup_tokens, evidence.drafter_gain
            runs = (1.0 + a + g) * t_lookup >= (1.0 + a) * t_draft
        else:
            runs = self._prior(proposals)
        if runs:
            self._streak[b] = 0
            return True
        self._streak[b] = self._streak.get(b, 0) + 1
        if self._streak[b] > self.explore_every:  # refresh the bin's drafting evidence
            self._streak[b] = 0
            return True
        self.skipped += 1
        return False


@dataclass
class Riders:
    """When to drop finished rows from the batch, and when to let them ride along to the end.

    Dropping a row copies every layer's K/V cache (`batch_select_indices`): at 16 rows and 600 columns of
    SmolLM2-135M about a fifth of a one-token forward. Under speculation rows reach `max_new_tokens` at different
    rounds, so a call dropped rows one by one in its last rounds and paid several such copies that plain decoding
    (which keeps finished rows to the end) never pays. A finished row that stays costs its share of each remaining
    round (its one token is computed and discarded; it gets no drafts): from the cost curve's slope, riders x
    (t(2 rows) - t(rows)) / rows over t(rows) (at 16 rows on a CPU about half of riders / rows; `batched._rider_share`),
    else riders / rows. So the rows are dropped only when

        share x rounds_left x round_seconds  >  drop_seconds,

    where rounds_left = ceil(most tokens a live row may still emit / tokens per live row-round so far), round_seconds
    is an average of this call's rounds and drop_seconds the measured seconds per cached row-column of the previous
    drops times the cache's size (before any drop: `prior_share` of a round). A row that stops early (EOS, a stopping
    criterion) with many tokens left for the others is dropped at once; rows that finish in the last rounds ride.
    Past rounds only: the output does not change (riders emit nothing, verify nothing, and are left out of the
    statistics).

    Attributes:
        mode: "auto" (the rule above), "always" (drop as soon as a row finishes) or "never" (ride to the end).
        smoothing: weight of the newest round in `round_seconds`.
        prior_share: a drop's cost, as a share of a round, until one is measured.
    """

    mode: str = "auto"
    smoothing: float = 0.3
    prior_share: float = 0.25
    round_seconds: float | None = None
    seconds_per_cell: float | None = None  # a drop's seconds per (row x cached column), measured
    emitted: int = 0  # tokens emitted by live rows
    row_rounds: int = 0  # live row-rounds

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never"):
            raise ValueError(f"drop_finished must be 'auto', 'always' or 'never', not {self.mode!r}")

    def observe_round(self, seconds: float, live_rows: int, emitted: int) -> None:
        """A round took `seconds`; its `live_rows` unfinished rows emitted `emitted` tokens in all."""
        if seconds > 0:
            old = self.round_seconds
            self.round_seconds = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        self.emitted += max(0, int(emitted))
        self.row_rounds += max(0, int(live_rows))

    def observe_drop(self, seconds: float, rows: int, columns: int) -> None:
        """A drop from a cache of `rows` x `columns` took `seconds`."""
        if rows > 0 and columns > 0 and seconds > 0:
            self.seconds_per_cell = seconds / (rows * columns)

    def rounds_left(self, tokens_left: int) -> int:
        """Rounds until the live row with `tokens_left` tokens to go finishes, at this call's pace."""
        pace = max(1.0, self.emitted / self.row_rounds) if self.row_rounds else 1.0
        return math.ceil(tokens_left / pace)

    def drop_now(self, riders: int, rows: int, columns: int, tokens_left: int, share: float | None = None) -> bool:
        """Whether to drop the `riders` finished rows of a `rows` x `columns` cache now, the live rows having at most
        `tokens_left` tokens to go. `share`: the riders' share of a round's forward (from the cost curve's slope;
        below riders / rows where a forward's cost grows slower than its rows); default riders / rows."""
        if riders <= 0:
            return False
        if riders >= rows or self.mode == "always":
            return True
        if self.mode == "never":
            return False
        if self.round_seconds is None:  # (rows that finished at their first token: nothing measured yet)
            return True
        drop = (self.seconds_per_cell * rows * columns if self.seconds_per_cell is not None
                else self.prior_share * self.round_seconds)
        share = riders / rows if share is None else min(1.0, max(0.0, float(share)))
        return share * self.rounds_left(tokens_left) * self.round_seconds > drop


@dataclass
class IdleBackoff:
    """Skips the drafter while drafting does not pay: after 2 consecutive rounds that did not (1 for a costly drafter,
    below), the next `skip_len` rounds are plain decoding; then one probe drafts again. `skip_len` doubles (2, 4, ...
    32) while probes keep not paying and resets when one pays. Decided from past rounds only, so the output does not
    change.

    Attributes:
        enabled: off for the policies that price no cost curve, or with `idle_backoff=False`.
        streak: consecutive drafting rounds that did not pay.
        skip_left: plain rounds left in the current skip.
        skip_len: the length of the next skip.
        max_skip: the longest skip (`MAX_SKIP`; a `PolicyMemory` allows the drafter's longer ones, its skips running
            on across calls).

    A probe that costs less than `LengthPolicy.probe_skip`'s share of a round (`min_skip=0`: the lookup-only rounds'
    proposals at a few rows) is never skipped; a costly one (a drafter forward under load) starts its skips at
    `min_skip` rounds. A drafter that costs half a plain round or more (`min_skip >= IMPATIENT_SKIP`: 64 rows on a
    CPU, where its LM head over 64 x K slots is most of a target forward) is backed off after one round that did not
    pay instead of two: confirming the verdict would cost another half round.
    """

    MAX_SKIP: ClassVar[int] = 32
    IMPATIENT_SKIP: ClassVar[int] = 10  # min_skip at which one failed round suffices (probe >= 10 x 5% of a round)

    enabled: bool
    streak: int = 0
    skip_left: int = 0
    skip_len: int = 2
    max_skip: int = MAX_SKIP

    def skip(self) -> bool:
        """Whether this round skips the drafter (and counts it against the current skip)."""
        if self.skip_left > 0:
            self.skip_left -= 1
            return True
        return False

    def observe(self, pays: bool, min_skip: int = 2, proven: bool = True) -> None:
        """Records whether a drafting round paid. `min_skip`: the shortest skip to start (capped at `MAX_SKIP`), so
        that a costly probe is amortised over enough skipped rounds (`LengthPolicy.probe_skip`). `proven=False`
        (`RealizedGain.pays`: the kind's recent verifying rounds lost time) counts the round as not paying and
        starts a skip of at least 2 rounds, however cheap the probe."""
        if not proven:
            pays, min_skip = False, max(int(min_skip), 2)
        if pays:
            self.streak, self.skip_len = 0, 2
            return
        self.streak += 1
        patience = 1 if int(min_skip) >= self.IMPATIENT_SKIP else 2
        if self.streak >= patience and int(min_skip) > 0:
            skip = max(self.skip_len, min(int(min_skip), self.max_skip))
            self.skip_left, self.skip_len = skip, min(2 * skip, self.max_skip)


@dataclass
class BranchBackoff(IdleBackoff):
    """`IdleBackoff`'s schedule for tree drafts: drafts chains only while the policy verifies no branch. After 2
    consecutive tree rounds in which no row verified a node off the chain (under load the scheduler drops alternatives
    first), the next `skip_len` rounds draft the chain alone (`tree_budget` 0: exactly `drafter.draft`, no
    tree-growing cost); then one round drafts the full tree again; `skip_len` doubles (2, 4, ... 32) while such probes
    verify no branch and resets when one does. Decided from past rounds only: the drafting shape never reads the
    current round's drafts, so decoding stays lossless.

    `enabled`: for the policies that price a cost curve ("scheduled", "async") with a tree budget > 0.
    """

    def spec(self, spec: TreeSpec) -> TreeSpec:
        """This round's tree spec: `spec`, or a chain-only one during a skip (counted against it)."""
        if self.enabled and self.skip():
            return TreeSpec(budget=0, max_children=spec.max_children)
        return spec

    def observe(self, branched: bool) -> None:
        """Records whether a (full) tree round verified any node off the chain."""
        if self.enabled:
            super().observe(branched)
