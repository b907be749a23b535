"""`RealizedGain`: what verifying rounds actually saved on the wall clock, against the loop's own plain rounds.

Both decoding paths keep one: the batched loop (`dspark_hf.decoding.batched`, backoff of each kind of round) and the
batch-1 candidate generator behind `generate(assistant_model=drafter)` (`AssistOptions.realized_gate`). It lives in
`models/` because that folder is what a `trust_remote_code` copy of a drafter ships: its files import only each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RealizedGain:
    """What the verifying rounds of each kind actually saved, measured, against the loop's own plain rounds.

    The backoff decides on *expected* pay (calibrated survival on a cost curve); under load the curve and the
    estimates can both be off by the few percent that decide it (at 64 rows a 2-token forward pays only where about
    70% of the rows accept), and a kind of round that keeps verifying at a loss costs more than its probes. This keeps
    the evidence: a plain round's seconds per row-step (an exponential average over plain rounds), and for each
    verifying round of a kind ("drafter", "lookup") its gain, tokens emitted x that rate - its seconds (drafting,
    bookkeeping and the wider forward included). `pays(kind)`: whether the last `window` verifying rounds of the kind
    gained in sum (True until there is a plain rate and such a round). Past rounds only: decoding stays lossless.

    Attributes:
        window: verifying rounds remembered per kind.
        plain_seconds_per_token: the plain rounds' average seconds per row-step (None before the first).
        gains: kind -> the realized gains (seconds; negative: lost) of its last `window` verifying rounds.
    """

    window: int = 4
    smoothing: float = 0.3
    plain_seconds_per_token: float | None = None
    gains: dict[str, list[float]] = field(default_factory=dict)

    def plain_round(self, seconds: float, rows: int) -> None:
        """A plain decoding round of `rows` rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        rate = seconds / rows
        old = self.plain_seconds_per_token
        self.plain_seconds_per_token = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate

    def verifying_round(self, kind: str, seconds: float, tokens: int) -> None:
        """A round of `kind` that verified drafts took `seconds` and emitted `tokens` row-steps (rows + accepted)."""
        if self.plain_seconds_per_token is None:
            return
        gain = tokens * self.plain_seconds_per_token - seconds
        self.gains[kind] = (self.gains.get(kind, []) + [gain])[-self.window:]

    def pays(self, kind: str) -> bool:
        """Whether the kind's recent verifying rounds gained in sum (True without evidence)."""
        gains = self.gains.get(kind)
        return not gains or sum(gains) >= 0.0
