"""What the priced policies learned in one batched call, carried into the next (`generate(policy_memory=...)`).

Every call of `dspark_hf.generate` starts the "scheduled" / "async" policy cold: the drafter is probed, the online
calibration of its survival estimates starts from its prior, the idle backoff has not yet seen a round that did not
pay, and the realized gain of each kind of round is unknown. Under load those first rounds are where a call loses
most: at 16 rows on gsm_symbolic prompts the release drafter's first round verified a draft in every row and accepted
none, after the prompts' context projection that only that round needed (`scripts/trace_batched_call.py`); with 48
new tokens a call runs about 35 rounds, so the probe alone costs a few percent of the call. A server decodes a stream
of similar calls: what the previous call learned is the best guess for the next one.

`PolicyMemory` keeps, per kind of call (policy, rows rounded down to a power of two, with or without lookup drafts,
tree budget), the state of the objects that decide from past rounds: the drafter's and the lookup-only rounds'
`IdleBackoff` (a call that ended backed off starts backed off: no drafter probe, no prompt projection until its skip
ends), `RealizedGain`, the `RoundClock` of per-round overheads and tails, and both `OnlineCalibration` windows. It
does not carry the cost curve's corrections (`MeasuredCost`, the forwards of a call's own context lengths) or the
tree-growth clocks. The drafter's idle-backoff skips may grow to `max_skip` rounds (128 by default; 32 within a call
without a memory) and run on across calls, so a drafter that does not pay is not probed in every call: each probe also
projects the call's prompts into its context. At 16 requests on a CPU a warm call spent 0.13 s outside the target's
forwards with skips of up to 128 rounds against 0.62 s with 32 (`scripts/bench_decode_only.py --methods
'...,scheduled-warm,scheduled-warm-skip32'`; the plain loop: 0.07 s).

Lossless either way: these objects only choose how many drafts each row verifies, never what is accepted. A memory is
for one target / drafter pair (checked: using it with another raises `ValueError`); calls of another kind (say 4 rows
after 16) keep their own state. `clear()` forgets everything, e.g. after the workload changed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from .round_state import IdleBackoff, OnlineCalibration, RealizedGain, RoundClock

__all__ = ["LearnedState", "PolicyMemory"]


@dataclass
class LearnedState:
    """The decide-from-past-rounds state of one call at its end (`PolicyMemory.remember`)."""

    backoff: IdleBackoff
    lookup_backoff: IdleBackoff
    realized: RealizedGain
    clock: RoundClock
    calibration: OnlineCalibration | None
    lookup_calibration: OnlineCalibration | None

    def restored(self, *, backoff_enabled: bool, clock_priced: bool, calibrate: bool) -> "LearnedState":
        """A deep copy with this call's switches (a call with `idle_backoff=False` gets a disabled backoff; a call
        without online calibration gets none)."""
        state = copy.deepcopy(self)
        state.backoff = dataclasses.replace(state.backoff, enabled=backoff_enabled)
        state.clock = dataclasses.replace(state.clock, priced=clock_priced)
        if not calibrate:
            state.calibration = state.lookup_calibration = None
        else:
            state.calibration = state.calibration or OnlineCalibration()
            state.lookup_calibration = state.lookup_calibration or OnlineCalibration()
        return state


class PolicyMemory:
    """Carries the priced policies' learned state from call to call. Pass the same object to every
    `dspark_hf.generate(..., policy_memory=memory)` call of one target / drafter pair.

    `max_skip`: the longest idle-backoff skip of the drafter in calls that use this memory (rounds; a call alone caps
    it at `IdleBackoff.MAX_SKIP`, 32). A skip carried into the next call runs on there, so with calls of 48 tokens a
    drafter that does not pay is probed about every 128 / 48 calls instead of once or twice in every call (each probe
    also projects the call's prompts into the drafter's context); a drafter that starts paying is noticed that much
    later.

    Example:
        >>> memory = dspark_hf.PolicyMemory()
        >>> for ids, mask in batches:  # doctest: +SKIP
        ...     out = dspark_hf.generate(target, drafter, ids, mask, policy="scheduled", policy_memory=memory)
    """

    def __init__(self, max_skip: int = 128) -> None:
        if isinstance(max_skip, bool) or not isinstance(max_skip, int) or max_skip < 2:
            raise ValueError(f"max_skip must be an integer >= 2, got {max_skip!r}")
        self.max_skip = max_skip
        self._states: dict[tuple, LearnedState] = {}
        self._pair: tuple[str, int] | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        """Rows rounded down to a power of two: calls of 16-31 rows share a state, 4-7 another."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        return 1 << (int(rows).bit_length() - 1)

    def key(self, target: Any, drafter: Any, *, policy: str, rows: int, lookup: bool, tree_budget: int | None) -> tuple:
        """The state key of a call; checks (and on first use records) the target / drafter pair."""
        from .sps import target_fingerprint

        pair = (target_fingerprint(target), id(drafter))
        if self._pair is None:
            self._pair = pair
        elif pair != self._pair:
            raise ValueError("this PolicyMemory learned with another target or drafter "
                             f"({self._pair[0]} vs {pair[0]}); use one memory per target / drafter pair")
        return (policy, self.bucket(rows), bool(lookup), tree_budget)

    def recall(self, key: tuple) -> LearnedState | None:
        """The state remembered for `key` (a copy is made by `LearnedState.restored`), or None."""
        return self._states.get(key)

    def remember(self, key: tuple, state: LearnedState) -> None:
        """Stores a deep copy of a call's final state under `key`."""
        self._states[key] = copy.deepcopy(state)

    def clear(self) -> None:
        """Forgets every learned state and the pair."""
        self._states.clear()
        self._pair = None

    def __len__(self) -> int:
        return len(self._states)

    def __repr__(self) -> str:
        return f"PolicyMemory({len(self)} learned state(s): {sorted(self._states, key=repr)})"
