"""`target.generate(**inputs, assistant_model=drafter)` for a DSpark drafter (batch size 1).

`DSparkCandidateGenerator` is a transformers `CandidateGenerator` that asks the target for the hidden states of the
layers the drafter reads (`model_kwargs_overrides = {"output_hidden_states": [i + 1, ...]}`), appends the rows the
target just verified to the drafter's context cache, and drafts one block from the last (bonus) token. Transformers'
own assisted-decoding loop then verifies the block (greedy match, or its speculative-sampling rule against our exact
processed draft logits), handles EOS, stopping criteria, `max_new_tokens` and `streamer`.

transformers' assistant settings, read from the generation config of the call (`generate(..., name=value)` or
`target.generation_config`):

* `num_assistant_tokens` caps the drafts per round (`min(block_size, num_assistant_tokens)`); transformers' default
  20 leaves every block of up to 20 drafts whole. `num_assistant_tokens_schedule` other than "constant" is refused
  (the adaptive lengths of this package are the policies of `dspark_hf.generate`).
* `assistant_confidence_threshold = t` is DSpark's threshold policy: a round proposes the drafts whose calibrated
  prefix survival `prod_{i<=j} c_i` (confidence head, STS applied) is at least `t`. transformers fills in its default
  0.4 whether or not the caller set it, so exactly 0.4 (and `None` / 0) reads as "not set" and leaves the block
  whole; a drafter without a confidence head refuses any other value.

`generate()` offers no argument for a custom candidate generator, so `install_generate_hook()` wraps private
`GenerationMixin` methods: `_get_candidate_generator` returns ours when the assistant is a DSpark drafter and calls the
original otherwise; `_extract_generation_mode_kwargs` hands the `streamer` on to a `custom_generate` callable that
asks for it (transformers streams the prompt, then drops the streamer for callables). The hook is installed by
`import dspark_hf` and by the first `DSparkDrafter` built, so a drafter loaded with `trust_remote_code=True` in a
process that never imports dspark_hf generates too. Any copy of the drafter class (the package's, a remote-code
folder's, a `custom_generate/` folder's) is recognised by its config's `model_type`. Batch size > 1 raises and points
to `dspark_hf.generate`.

Imports nothing from `dspark_hf` by absolute path: it travels with `modeling_dspark.py` into trust_remote_code folders.
"""

from __future__ import annotations

import contextvars
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StoppingCriteriaList)
from transformers.generation.utils import GenerationMixin

from .modeling_dspark import DSparkDrafter
from .realized_gain import RealizedGain

__all__ = ["AssistOptions", "DSparkCandidateGenerator", "LookupAssistant", "LookupCandidateGenerator",
           "SpeculationStats", "install_generate_hook", "is_dspark_drafter"]

# Stopping criteria of the running `_assisted_decoding` call, handed to our candidate generator (see install_generate_hook).
_STOPPING_CRITERIA: contextvars.ContextVar[Any] = contextvars.ContextVar("dspark_stopping_criteria", default=None)


def is_dspark_drafter(model: Any) -> bool:
    """A `DSparkDrafter` of this file or of any copy of it (each trust_remote_code copy is its own class)."""
    if isinstance(model, DSparkDrafter):
        return True
    return getattr(getattr(model, "config", None), "model_type", None) == "dspark" and callable(
        getattr(model, "draft", None))


def _transformers_default(name: str) -> Any:
    """The value transformers' generate() fills in for an unset assistant setting."""
    return GenerationConfig._get_default_generation_params().get(name)


def assistant_settings(drafter: Any, generation_config: Any) -> tuple[int, float | None]:
    """`(max drafts per round, prefix-survival threshold or None)` from transformers' assistant settings of the call;
    `ValueError` for those this path cannot honour."""
    schedule = getattr(generation_config, "num_assistant_tokens_schedule", None)
    if schedule not in (None, "constant"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} is not supported with a DSpark drafter: it drafts up to "
            f"block_size={drafter.config.block_size} tokens per round (num_assistant_tokens caps that). For lengths "
            "that adapt per round use dspark_hf.generate(target, drafter, ..., policy='threshold' | 'scheduled').")
    cap = getattr(generation_config, "num_assistant_tokens", None)
    max_drafts = drafter.config.block_size
    if cap is not None:
        if int(cap) != cap or cap < 0:
            raise ValueError(f"num_assistant_tokens must be a non-negative integer, got {cap!r}")
        max_drafts = min(max_drafts, int(cap))
    threshold = getattr(generation_config, "assistant_confidence_threshold", None)
    if threshold is None or threshold == 0 or threshold == _transformers_default("assistant_confidence_threshold"):
        return max_drafts, None
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in (0, 1], got {threshold!r}")
    if getattr(drafter, "confidence_head", None) is None:
        raise ValueError(
            f"assistant_confidence_threshold={threshold} needs a drafter with a confidence head (it cuts each block "
            "where the predicted prefix survival drops below the threshold); this drafter has none "
            "(DSparkConfig.confidence_head=False). Leave the setting unset or at transformers' default 0.4.")
    return max_drafts, float(threshold)


@dataclass
class SpeculationStats:
    """Per-call statistics of a speculative `generate()` (batch size 1).

    Attributes:
        accepted: drafts accepted in each verification round (the round's emitted tokens are accepted + 1).
        proposed: drafts proposed in each round.
    """

    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    lookup_rounds: int = 0  # rounds whose drafts came from the n-gram lookup (`DSparkDrafter.set_assist`)
    plain_steps: int = 0  # steps that verified no draft (nothing paid): one target token, not counted in `rounds`
    drafter_skips: int = 0  # plain steps taken because drafter rounds emitted slower than plain ones (`_RealizedRates`)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def target_forwards(self) -> int:
        """Target forwards of the call: the prefill, every verification round and every plain step."""
        return 1 + self.rounds + self.plain_steps

    @property
    def mean_accepted_length(self) -> float:
        """tau: mean tokens emitted per verification round, bonus token included."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))


def _point_mass_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """`[1, K, V]` logits of the one-hot distributions a lookup draft is drawn from (0 at the token, -inf elsewhere):
    rejection sampling then accepts x with probability p_target(x) and resamples from p_target without x, exactly."""
    out = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return out.scatter_(2, tokens[..., None], 0.0)


@dataclass
class AssistOptions:
    """How `generate(assistant_model=drafter)` chooses each round's drafts (`DSparkDrafter.set_assist`).

    Attributes:
        lookup: an `NgramLookup` whose drafts are tried first, or None.
        lookup_max_tokens: the most lookup drafts per round.
        use_drafter: run the DSpark drafter in rounds where lookup drafts do not pay (False: lookup or plain step).
        sps: the target's cost curve (`SPSTable` or a callable B -> steps/s). With it, a round verifies the number of
            drafts that maximises expected tokens per second, (1 + sum_{j<=l} a_j) * SPS(1 + l), possibly none; without
            it, lookup drafts are verified while their prefix survival is at least `min_survival` and drafter blocks
            are kept whole (or cut by `assistant_confidence_threshold`).
        min_survival: the survival cut for lookup drafts without `sps`.
        drafter_backoff: with `sps`, after n drafter rounds in a row whose schedule verified nothing, skip the drafter
            for the next min(2^n - 1, 8) rounds (plain steps, or lookup drafts where they pay): the drafter's own
            cost is not paid where its drafts keep not paying. Decided from past rounds only.
        online_calibration: with `sps`, scale each source's survival estimates (lookup drafts, drafter drafts) by
            kappa = (accepted + 2) / (predicted + 2) over its last 16 verified rounds in this call (`_Kappa`, as the
            batched loop's `OnlineCalibration`), so over-confident estimates on prompts unlike the training data stop
            buying verification that does not pay. Past rounds only: lossless either way. Measured with lookup drafts
            at batch 1 (`scripts/bench_lookup.py --methods lookup lookup/uncalibrated`): geo-mean 1.18x vs 1.15x
            over target-only, MT-Bench 0.96x vs 0.89x.
        realized_gate: run the drafter (in rounds where no lookup draft pays) only while its rounds have *emitted*
            tokens at least as fast as plain steps in this call, both measured on the wall clock (`_RealizedRates`,
            the batched loop's `RealizedGain`: each round timed from one `get_candidates` call to the next, so the
            drafter's own forward, the target's wider verification and the bookkeeping all count);
            otherwise take a plain step, and try the drafter again after `_RealizedRates.explore_every` skips in a row
            so that its evidence stays current. The length rule prices the target's forward and leaves the drafter's
            time out (it is spent once the block exists); this rule is what prices it. Past rounds' timings only,
            never a draw of this round: lossless, greedy and sampled.
    """

    lookup: Any = None
    lookup_max_tokens: int = 16
    use_drafter: bool = True
    sps: Any = None
    min_survival: float = 0.3
    drafter_backoff: bool = True
    online_calibration: bool = True
    realized_gate: bool = False
    _cost_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.lookup_max_tokens < 1:
            raise ValueError(f"lookup_max_tokens must be >= 1, got {self.lookup_max_tokens}")
        if not 0.0 <= self.min_survival <= 1.0:
            raise ValueError(f"min_survival must lie in [0, 1], got {self.min_survival}")
        if not self.use_drafter and self.lookup is None:
            raise ValueError("use_drafter=False needs a lookup (otherwise no round would ever draft)")

    def _costs(self, max_len: int) -> list[float]:
        """Seconds per target step at 1 .. max_len + 1 tokens (SPS of the cost curve; computed once per length, not
        every round)."""
        if max_len not in self._cost_cache:
            sps = self.sps
            widths = torch.arange(1, max_len + 2)
            rate = sps.steps_per_second(widths) if hasattr(sps, "steps_per_second") else torch.as_tensor(
                [float(sps(int(b))) for b in widths])
            self._cost_cache[max_len] = (1.0 / rate.double()).tolist()
        return self._cost_cache[max_len]

    def _best_length(self, survival: list[float], exhaustive: bool) -> int:
        costs = self._costs(len(survival))
        best, best_theta, tau = 0, 1.0 / costs[0], 1.0
        for j, a in enumerate(survival, start=1):
            tau += a
            theta = tau / costs[j]
            if theta > best_theta:
                best, best_theta = j, theta
            elif not exhaustive:
                break
        return best

    def lookup_length(self, survival: list[float]) -> int:
        """Lookup drafts to verify: their survival is a function of the sequence alone, so a whole-curve search is
        safe for sampling too."""
        if not survival:
            return 0
        if self.sps is None:
            return sum(1 for a in survival if a >= self.min_survival)
        return self._best_length(survival, exhaustive=True)

    def drafter_length(self, confidences: torch.Tensor, exhaustive: bool) -> int:
        """Drafter drafts to verify from their confidences `[K]` (prefix survival = cumulative product)."""
        survival = torch.cumprod(confidences.float(), 0).tolist()
        return self._best_length(survival, exhaustive) if survival else 0


@dataclass
class _Kappa:
    """How far one draft source's survival estimates over- or under-predicted what the target accepted in this call:
    (accepted + prior) / (predicted + prior) over its last `window` verified rounds (1 before any)."""

    window: int = 16
    prior: float = 2.0
    history: list = field(default_factory=list)

    @property
    def value(self) -> float:
        return (sum(a for _, a in self.history) + self.prior) / (sum(p for p, _ in self.history) + self.prior)

    def observe(self, predicted: float, accepted: int) -> None:
        if predicted > 0:
            self.history = (self.history + [(float(predicted), float(accepted))])[-self.window:]


@dataclass
class _StopRules:
    """A stopping-criteria list split by how a drafted block is checked against it.

    transformers' own criteria are checked for the whole block at once: `MaxLengthCriteria` fires on a length
    (`max_length`), `EosTokenCriteria` on a token (`eos_ids`), `MaxTimeCriteria` on the clock only (`timers`, checked
    once). Any other criterion (stop strings, user criteria) is called per draft as before (`per_token`)."""

    max_length: int | None = None
    eos_ids: torch.Tensor | None = None
    timers: list[Any] = field(default_factory=list)
    per_token: StoppingCriteriaList | None = None

    @classmethod
    def split(cls, criteria: Any) -> "_StopRules":
        rules, others, eos = cls(), [], []
        pending = list(criteria)
        while pending:
            c = pending.pop(0)
            if type(c) is StoppingCriteriaList:
                pending[:0] = list(c)
            elif type(c) is MaxLengthCriteria:
                rules.max_length = c.max_length if rules.max_length is None else min(rules.max_length, c.max_length)
            elif type(c) is EosTokenCriteria:
                eos.append(torch.as_tensor(c.eos_token_id).flatten())
            elif type(c) is MaxTimeCriteria:
                rules.timers.append(c)
            else:
                others.append(c)
        rules.eos_ids = torch.cat(eos).long() if eos else None
        rules.per_token = StoppingCriteriaList(others) if others else None
        return rules


_clock = time.perf_counter  # (the realized gate's clock; tests replace it)


@dataclass
class _RealizedRates:
    """Whether the drafter runs this round (`AssistOptions.realized_gate`), from what drafter rounds and plain steps of
    this call realized on the wall clock: `RealizedGain`, as the batched loop keeps it (a plain step's seconds per
    token; each drafter round's gain, its emitted tokens x that rate - its seconds). A round is timed from one
    `get_candidates` call to the next (its drafting, the target's verification forward, transformers' bookkeeping,
    the drafter's context update) and emits its accepted drafts plus one target token. The drafter runs for its first
    `min_rounds` rounds; then, with no plain step measured yet, one plain step measures the plain rate; from then on
    it runs unless its last `window` recorded rounds (at least `min_evidence`) say it *loses*: their mean gain plus
    one standard error below zero; and once again after `explore_every` skips in a row, so that its evidence stays
    current.

    Why a standard error and not the sign of a short sum (the batched loop's `RealizedGain.pays`): one round's gain
    swings by more than a plain step (a round that accepts nothing loses its drafting and wider forward, one that
    accepts three gains two plain steps), so a drafter that pays by 20% on average shows a negative sum over four
    rounds often, and each such dip cost it 8 skipped rounds: on a Zen 4 VM where the release drafter alone ran at
    1.30x of target-only, the sign rule took it to 1.21x (results/lookup_branch_zen4_smollm2)."""

    min_rounds: int = 2
    explore_every: int = 8
    window: int = 16
    min_evidence: int = 3
    realized: RealizedGain | None = None
    drafted: int = 0
    skips: int = 0

    def __post_init__(self) -> None:
        if self.realized is None:
            self.realized = RealizedGain(window=self.window)

    def observe(self, kind: str, seconds: float, tokens: int) -> None:
        if kind == "plain":
            self.realized.plain_round(seconds, 1)
        else:
            self.drafted += 1
            self.realized.verifying_round(kind, seconds, tokens)

    def loses(self) -> bool:
        """Whether the recorded drafter rounds lose with some confidence (mean + one standard error < 0)."""
        gains = self.realized.gains.get("drafter", [])
        n = len(gains)
        if n < self.min_evidence:
            return False
        mean = sum(gains) / n
        spread = math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1) / n)
        return mean + spread < 0.0

    def runs_drafter(self) -> bool:
        if self.drafted < self.min_rounds:
            return True
        if self.realized.plain_seconds_per_token is not None and (not self.loses()
                                                                  or self.skips >= self.explore_every):
            self.skips = 0
            return True
        self.skips += 1  # (no plain rate yet: this plain step measures it)
        return False


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts DSpark blocks for transformers' assisted-decoding loop (batch size 1)."""

    requires_model_outputs: bool = True

    def __init__(
        self,
        drafter: DSparkDrafter,
        target: torch.nn.Module,
        generation_config: Any,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
    ) -> None:
        self.max_drafts, self.threshold = assistant_settings(drafter, generation_config)
        if not drafter.bound_to(target):
            drafter.bind_target(target)
        self.drafter = drafter
        self._layer_ids = [i + 1 for i in drafter.config.target_layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": list(self._layer_ids)}
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self._set_up_call(target, generation_config, stopping_criteria,
                          getattr(drafter, "assist_options", None) or AssistOptions())
        self.cache = drafter.new_cache()
        self.prefilled = False
        self._idle_rounds = 0  # consecutive drafter rounds whose schedule verified nothing
        self._skip_drafter = 0  # drafter rounds still to skip (AssistOptions.drafter_backoff)
        self._rates = _RealizedRates() if self.assist.realized_gate else None
        self._round: tuple[str, float] | None = None  # (kind, start) of the round in flight, for `_rates`
        # The latest call's statistics stay readable on the drafter (transformers creates this object per call).
        drafter.last_speculation_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts one round proposes (transformers >= 5.25 reads it to size a linear-attention cache's
        rollback history): the drafter's block or `num_assistant_tokens`, or the lookup's cap if that is longer."""
        lookup = self.assist.lookup_max_tokens if self.assist.lookup is not None else 0
        return max(int(getattr(self, "max_drafts", 0)), int(lookup))

    def _set_up_call(self, target: torch.nn.Module, generation_config: Any, stopping_criteria: Any,
                     assist: "AssistOptions") -> None:
        """The per-call state every candidate generator of this file shares (with or without a drafter)."""
        self.max_length = int(generation_config.max_length)
        self.do_sample = bool(generation_config.do_sample)
        self.stopping_criteria = stopping_criteria if stopping_criteria is not None and len(stopping_criteria) else None
        self._stop = None if self.stopping_criteria is None else _StopRules.split(self.stopping_criteria)
        # transformers reads the draft logits to verify by sampling or to mix them in (assistant_ensemble_weight); a
        # per-draft stopping criterion gets them as its scores. Greedy verification compares tokens only, so then a
        # sparse drafter's [1, K, V] logits are never built.
        ensemble = getattr(generation_config, "assistant_ensemble_weight", None)
        self._needs_logits = (self.do_sample or ensemble is not None
                              or (self._stop is not None and self._stop.per_token is not None))
        self.stats = SpeculationStats()
        self._proposed = 0
        self.assist = assist
        calibrated = assist.online_calibration and assist.sps is not None
        self._kappa = {"lookup": _Kappa(), "drafter": _Kappa()} if calibrated else None
        self._pending: tuple[str, list[float]] | None = None  # (source, uncorrected survival of the proposed drafts)
        self._vocab_size = int(target.get_output_embeddings().weight.shape[0])  # the target's logits width
        self._lookup_context = None  # the lookup's `LookupContext` of the sequence (incremental across rounds)
        if assist.lookup is not None:
            assist.lookup.check_vocab(self._vocab_size)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # The first call comes before the target has run: let it prefill and pick the first token itself.
        if is_first_iteration:
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSparkCandidateGenerator needs the target's hidden states (model_outputs.hidden_states)")
        if self._rates is not None:  # the round that just ended: its kind, seconds and emitted tokens
            now = _clock()
            if self._round is not None:
                self._rates.observe(self._round[0], now - self._round[1], n_last_matches + 1)
            self._round = None
        self._append_verified_rows(input_ids, model_kwargs or {}, model_outputs, n_last_matches)

        budget = self.max_length - input_ids.shape[1] - 1  # leave room for the target's own token
        num_drafts = min(self.max_drafts, budget)
        if num_drafts <= 0:
            return input_ids, None
        assist = self.assist
        if assist.lookup is not None:
            found = self._lookup_round(input_ids, budget)
            if found is not None:
                return found
            if not assist.use_drafter:
                self.stats.plain_steps += 1
                return input_ids, None
        if self._skip_drafter > 0:  # recent drafter rounds verified nothing: a plain step, without the drafter's cost
            self._skip_drafter -= 1
            if self._rates is not None:
                self._round = ("plain", now)
            self.stats.plain_steps += 1
            return input_ids, None
        if self._rates is not None and not self._rates.runs_drafter():  # drafter rounds emit slower than plain ones
            self._round = ("plain", now)
            self.stats.plain_steps += 1
            self.stats.drafter_skips += 1
            return input_ids, None
        device = self.drafter.device
        block = self.drafter.draft(
            self.cache,
            input_ids[:, -1].to(device),
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids.to(device),
            num_drafts=num_drafts,
        )
        tokens, logits = block.tokens.to(input_ids.device), block.logits if self._needs_logits else None
        if self.threshold is not None:  # the threshold policy: drafts whose prefix survival a_j >= t (a prefix)
            survival = block.survival
            keep = int((survival[0, : tokens.shape[1]] >= self.threshold).sum()) if survival is not None else 0
            tokens, logits = tokens[:, :keep], None if logits is None else logits[:, :keep]
        elif assist.sps is not None and block.confidences is not None:
            # Algorithm 1 on this row's confidences and the target's cost curve. Greedy output does not depend on
            # which drafts are verified, so it searches the whole curve; sampling keeps the break (Appendix A).
            conf = block.confidences[0, : tokens.shape[1]].float().cpu()
            self._pending = ("drafter", torch.cumprod(conf, 0).tolist())
            if self._kappa is not None:  # the first confidence scaled: every prefix survival scaled by kappa
                conf = conf.clone()
                conf[:1] = (conf[:1] * self._kappa["drafter"].value).clamp(0.0, 1.0)
            keep = assist.drafter_length(conf, exhaustive=not self.do_sample)
            tokens, logits = tokens[:, :keep], None if logits is None else logits[:, :keep]
            if assist.drafter_backoff:  # (decided from past rounds only: never from this round's draws)
                self._idle_rounds = self._idle_rounds + 1 if keep == 0 else 0
                self._skip_drafter = min(2 ** self._idle_rounds - 1, 8) if keep == 0 else 0
        keep = self._drafts_before_stop(input_ids, tokens, logits) if tokens.shape[1] else 0
        self._proposed = keep
        if self._rates is not None:  # (also where it verifies nothing: the drafter's time was spent)
            self._round = ("drafter", now)
        if keep == 0:
            self.stats.plain_steps += 1
            return input_ids, None
        return torch.cat([input_ids, tokens[:, :keep]], dim=-1), None if logits is None else logits[:, :keep]

    def _lookup_round(self, input_ids: torch.LongTensor, budget: int) -> tuple[torch.LongTensor, Any] | None:
        """This round's lookup drafts, or None where none pays. Lookup drafts are a deterministic function of the
        sequence, so whether they are used (and how many) never depends on a sampled draft token (models/lookup.py)."""
        assist = self.assist
        ids = input_ids[0].tolist()
        context = self._lookup_context  # kept across rounds: only the tokens accepted since are indexed
        if context is None or len(context) > len(ids) or context.ids != ids[: len(context)]:
            context = self._lookup_context = assist.lookup.context(ids)
        else:
            context.extend(ids[len(context):])
        proposal = assist.lookup.propose(context, min(assist.lookup_max_tokens, budget),
                                         min_survival=assist.lookup.negligible_survival)
        survival = proposal.survival
        if self._kappa is not None:
            kappa = self._kappa["lookup"].value
            survival = [min(1.0, a * kappa) for a in survival]
        keep = assist.lookup_length(survival)
        if keep <= 0:
            return None
        tokens = torch.tensor([proposal.tokens[:keep]], dtype=input_ids.dtype, device=input_ids.device)
        logits = _point_mass_logits(tokens, self._vocab_size) if self._needs_logits else None
        keep = self._drafts_before_stop(input_ids, tokens, logits)
        if keep <= 0:
            return None
        self._proposed = keep
        self._pending = ("lookup", proposal.survival)
        self.stats.lookup_rounds += 1
        return torch.cat([input_ids, tokens[:, :keep]], dim=-1), None if logits is None else logits[:, :keep]

    def _drafts_before_stop(self, input_ids: torch.LongTensor, tokens: torch.LongTensor,
                            logits: torch.Tensor | None) -> int:
        """Number of drafts to propose so that no stopping criterion fires *inside* the verified block.

        transformers checks stopping criteria only after a whole round; a draft that completes a stop condition would
        let the round run past it. We cut the block before such a draft: if the drafts before it are accepted, the
        target's own next token completes the stop exactly where plain decoding stops. transformers' length, EOS and
        time criteria are checked for the whole block at once (no per-draft calls); other criteria per draft.
        """
        n = tokens.shape[1]
        rules = self._stop
        if rules is None:
            return n
        length = input_ids.shape[1]  # draft j makes the sequence length + j + 1 tokens long
        if rules.max_length is not None:
            n = min(n, max(0, rules.max_length - length - 1))
        if n and any(bool(t(input_ids, None).any()) for t in rules.timers):
            return 0
        if n and rules.eos_ids is not None:
            hits = torch.isin(tokens[0, :n], rules.eos_ids.to(tokens.device)).nonzero()
            if hits.numel():
                n = int(hits[0, 0])
        if rules.per_token is not None:
            for j in range(n):
                prefix = torch.cat([input_ids, tokens[:, : j + 1]], dim=-1)
                if bool(rules.per_token(prefix, logits[:, j].to(input_ids.device)).any()):
                    return j
        return n

    def _append_verified_rows(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], outputs: Any, n_last_matches: int
    ) -> None:
        """Feeds the drafter the target states of every token the target has cached and verified."""
        # After prefill the target processed the whole prompt; after a verification round it processed the previous
        # anchor + drafts, of which anchor + n_last_matches are now verified context. The newest token (the last of
        # input_ids) is not in the target's cache yet: it is the next anchor.
        num_rows = input_ids.shape[1] - 1 if not self.prefilled else n_last_matches + 1
        if num_rows <= 0:
            return
        device = self.drafter.device
        states = outputs.hidden_states
        # slice only the layers the drafter reads (once each), then concatenate: [1, num_rows, m * d]
        picked = [None] * len(states)
        for i in self._layer_ids:
            if i < len(states) and states[i] is not None:
                picked[i] = states[i][:, :num_rows].to(device)
        features = self.drafter.context_features(picked)
        if not self.prefilled:
            mask = model_kwargs.get("attention_mask")
            if mask is not None:
                valid = mask[:, :num_rows].to(device).bool()
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            else:
                valid = torch.ones(1, num_rows, dtype=torch.bool, device=device)
                positions = torch.arange(num_rows, device=device)[None]
        else:
            start = self.cache.next_position
            positions = start[:, None] + torch.arange(num_rows, device=device)
            valid = torch.ones(1, num_rows, dtype=torch.bool, device=device)
        self.drafter.append_context(self.cache, features, positions, valid)
        self.prefilled = True

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Records the round's outcome. The block size is fixed here; verification-length policies live in the
        batched loop (`dspark_hf.generate`)."""
        if self._proposed > 0:
            self.stats.accepted.append(int(num_matches))
            self.stats.proposed.append(self._proposed)
            if self._kappa is not None and self._pending is not None:
                source, survival = self._pending
                self._kappa[source].observe(sum(survival[: self._proposed]), int(num_matches))
        self._proposed = 0
        self._pending = None


class LookupCandidateGenerator(DSparkCandidateGenerator):
    """Lookup drafts alone (`assistant_model=LookupAssistant(...)`): no drafter, no hidden states; a round with no
    lookup draft worth verifying is a plain step."""

    requires_model_outputs: bool = False

    def __init__(self, assistant: Any, target: torch.nn.Module, generation_config: Any, logits_processor: Any = None,
                 stopping_criteria: Any = None) -> None:  # (the drafter-free part of the parent's set-up)
        self._set_up_call(target, generation_config, stopping_criteria, assistant.options)
        assistant.last_speculation_stats = self.stats

    def get_candidates(self, input_ids: torch.LongTensor, *args: Any, is_first_iteration: bool = False,
                       **kwargs: Any) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:
            return input_ids, None
        budget = self.max_length - input_ids.shape[1] - 1  # leave room for the target's own token
        if budget <= 0:  # the last token: nothing to draft (as in the drafter's rounds, not counted)
            return input_ids, None
        found = self._lookup_round(input_ids, budget)
        if found is None:
            self.stats.plain_steps += 1
            return input_ids, None
        return found


class LookupAssistant:
    """Lookup drafts as transformers' assistant: `target.generate(**inputs, assistant_model=LookupAssistant(lookup,
    target, sps=...))` (batch size 1, greedy or sampling, lossless). No drafter and no training beyond counting the
    target's own answers (`NgramLookup`); `sps` (the target's cost curve) makes each round verify the number of lookup
    drafts that maximises expected tokens per second, none when none pays.

    Attributes:
        config: the target's config (transformers checks that assistant and target share a vocabulary).
        options: the `AssistOptions` each call uses.
        last_speculation_stats: `SpeculationStats` of the latest call.
    """

    def __init__(self, lookup: Any, target: torch.nn.Module, *, sps: Any = None, max_tokens: int = 16,
                 min_survival: float = 0.3) -> None:
        self.config = target.config
        self.options = AssistOptions(lookup=lookup, lookup_max_tokens=max_tokens, use_drafter=False, sps=sps,
                                     min_survival=min_survival)
        self.last_speculation_stats: SpeculationStats | None = None


def install_generate_hook() -> None:
    """Makes `generate(assistant_model=<DSparkDrafter>)` use `DSparkCandidateGenerator`, and hands `streamer` on to
    `custom_generate` callables marked `_dspark_takes_streamer`. Idempotent (also across copies of this file)."""
    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_dspark_hook", False):
        return

    @functools.wraps(original)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if isinstance(assistant_model, LookupAssistant):
            if input_ids.shape[0] != 1:
                raise ValueError(f"assistant_model=LookupAssistant runs transformers' assisted decoding, which "
                                 f"supports batch size 1 only (got {input_ids.shape[0]})")
            return LookupCandidateGenerator(assistant_model, self, generation_config, logits_processor,
                                            _STOPPING_CRITERIA.get())
        if is_dspark_drafter(assistant_model):
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"target.generate(assistant_model=<DSparkDrafter>) runs transformers' assisted decoding, which "
                    f"supports batch size 1 only (got {input_ids.shape[0]}). For batches use "
                    f"dspark_hf.generate(target, drafter, **inputs) or "
                    f"target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, drafter=drafter)."
                )
            return DSparkCandidateGenerator(
                assistant_model, self, generation_config, logits_processor, _STOPPING_CRITERIA.get()
            )
        return original(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                        assistant_model=assistant_model, target_tokenizer=target_tokenizer,
                        assistant_tokenizer=assistant_tokenizer)

    original_loop = GenerationMixin._assisted_decoding

    @functools.wraps(original_loop)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        token = _STOPPING_CRITERIA.set(stopping_criteria)
        try:
            return original_loop(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)
        finally:
            _STOPPING_CRITERIA.reset(token)

    original_validate = GenerationMixin._validate_generation_mode

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs):
        # Check the drafter's target fingerprint and assistant settings before transformers' generic checks, whose
        # message for a vocab mismatch ("different tokenizers") would point the user in the wrong direction.
        drafter = (generation_mode_kwargs or {}).get("assistant_model")
        if is_dspark_drafter(drafter):
            drafter.check_target(self)
            assistant_settings(drafter, generation_config)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs)

    original_extract = GenerationMixin._extract_generation_mode_kwargs

    @functools.wraps(original_extract)
    def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        # transformers streams the prompt itself, then passes a custom_generate callable only the arguments its
        # signature adds to `_sample`'s, so `streamer` would be lost; ours take it (knowing the prompt was streamed).
        if is_dspark_drafter(assistant_model) and kwargs.get("tree_budget") is not None:
            raise ValueError(
                "tree_budget: transformers' assisted decoding verifies chains only (one candidate sequence under a "
                "causal mask, its cache cropped to a prefix), so it cannot verify tree drafts. Trees run in "
                "dspark_hf's batched loop, batch size 1 included: dspark_hf.generate(target, drafter, **inputs, "
                "tree_budget=N) or target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, "
                "drafter=drafter, tree_budget=N)."
            )
        found = original_extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        if streamer is not None and getattr(custom_generate, "_dspark_takes_streamer", False):
            found["streamer"] = streamer
        return found

    _get_candidate_generator._dspark_hook = True  # type: ignore[attr-defined]
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._extract_generation_mode_kwargs = _extract_generation_mode_kwargs
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._assisted_decoding = _assisted_decoding
