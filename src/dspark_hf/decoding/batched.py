"""Batched DSpark speculative decoding with confidence-scheduled verification.

    out = dspark_hf.generate(target, drafter, input_ids=ids, attention_mask=mask, max_new_tokens=256,
                             do_sample=True, temperature=0.7, policy="scheduled")
    out = target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, drafter=drafter)

One round, for all active rows at once:
1. the drafter drafts a block for every row in one forward (anchor = the row's last emitted token);
2. a policy picks each row's verification length l_r (`fixed`, `threshold`, `scheduled` = Algorithm 1, `async`);
3. the target verifies all rows in ONE forward: row r feeds [anchor, d_1..d_{l_r}] right-padded to the round's width,
   with explicit per-row positions and a 2-D mask over the cached columns + the new ones;
4. each row accepts its longest valid prefix (greedy match or lossless rejection sampling) plus one target token;
5. cache columns of rejected drafts and padding stay as masked *holes*; the drafter receives the target hidden
   states of each row's verified tokens; finished rows (EOS, stopping criteria, `max_new_tokens`) are dropped;
   holes are compacted once they exceed `hole_budget` columns.

Memory bound: after every round each row's KV cache holds at most prompt + generated + `hole_budget` + (block + 1)
columns (the widest row's, since rows share one cache tensor; left padding of short prompts counts as holes and is
compacted away too).

Exactness needs a target whose cache is a plain `DynamicCache` (no sliding window: holes would shift the window).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import ModelOutput

from ..models.drafting import valid_first_order
from ..models.modeling_dspark import DSparkDrafter
from .scheduler import (POLICIES, WithRoundOverhead, async_lengths, expected_throughput, fixed_lengths, schedule_prefix,
                        threshold_lengths)
from .sps import SPSTable, profile_sps, target_fingerprint
from .verification import SamplingParams, verify


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
        return sum(self.verify_lengths) / max(1, len(self.verify_lengths))

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


@dataclass
class RoundRecord:
    """One verification round (recorded with `record_rounds=True`): the rows' original indices `[R]`, raw confidence
    logits `[R, K]` (before STS; None without a confidence head), verify lengths `[R]` and accepted drafts `[R]`."""

    rows: torch.Tensor
    confidence_logits: torch.Tensor | None
    lengths: torch.Tensor
    accepted: torch.Tensor


@dataclass
class DSparkGenerateOutput(ModelOutput):
    """`sequences` `[R, L + new]` (prompts as given, generated tokens right-padded with `pad_token_id`), per-row
    `stats`, the number of generated tokens per row, the policy used, and the peak KV-cache width in columns."""

    sequences: torch.LongTensor | None = None
    stats: list[RowStats] | None = None
    num_generated: torch.LongTensor | None = None
    policy: str | None = None
    peak_cache_columns: int | None = None
    rounds: list[RoundRecord] | None = None


_SPS_CACHE: dict[tuple, SPSTable] = {}


def resolve_sps(target: PreTrainedModel, sps: Any, max_tokens: int) -> Any:
    """An SPS curve for the scheduler: the given table / callable, a JSON path (checked against `target`), or — for
    `None` — a table profiled once per process for this target, device and dtype."""
    if sps is None:
        key = (id(target), target_fingerprint(target), str(target.device), str(target.dtype))
        table = _SPS_CACHE.get(key)
        if table is None or table.batch_tokens[-1] < max_tokens:
            table = profile_sps(target, max_tokens=max(8, max_tokens), context_lengths=(128,), repeats=2,
                                progress=False)
            _SPS_CACHE[key] = table
        return table
    if isinstance(sps, (str, bytes)) or hasattr(sps, "__fspath__"):
        return SPSTable.load(sps, target=target)
    if isinstance(sps, SPSTable):
        sps.check(target)
        return sps
    if callable(sps):
        return sps
    raise TypeError(f"sps must be an SPSTable, a path to one, a callable B -> steps/s or None; got {type(sps).__name__}")


def _check_inputs(target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  max_new_tokens: int, policy: str, drafter: DSparkDrafter) -> torch.Tensor:
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got "
                         f"{None if input_ids is None else tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    empty = (attention_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of the batch are empty (attention_mask is all zeros): give every row a prompt")
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("prompts must be left-padded (attention_mask of the form 0..0 1..1); "
                         "set tokenizer.padding_side = 'left'")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy != "fixed" and drafter.confidence_head is None:
        raise ValueError(f"policy={policy!r} needs a drafter with a confidence head; this one has none "
                         f"(a DFlash-style drafter): use policy='fixed'")
    text = target.config.get_text_config()
    if getattr(text, "sliding_window", None) and (
        getattr(text, "use_sliding_window", True) is not False
        and any(t == "sliding_attention" for t in (getattr(text, "layer_types", None) or ["sliding_attention"]))
    ):
        raise ValueError(f"{type(target).__name__} uses sliding-window attention, whose cache breaks with the masked "
                         "holes of batched verification; use batch size 1 through target.generate(assistant_model=...)")
    return attention_mask.to(input_ids.device).long()


def _compact_target_cache(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Moves every row's valid columns to the front of each layer and drops all-empty columns. Returns the new mask."""
    order = valid_first_order(valid)
    for layer in cache.layers:
        index = order[:, None, :, None].to(layer.keys.device)
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
    return valid.gather(1, order)


def _choose_lengths(policy: str, confidences: torch.Tensor | None, num_slots: int, rows: int, sps: Any,
                    threshold: float, stale: torch.Tensor | None) -> torch.Tensor:
    if policy == "fixed":
        return fixed_lengths((rows, num_slots))
    conf = confidences.detach().float().cpu()
    if policy == "threshold":
        return threshold_lengths(conf, threshold)
    if policy == "scheduled" or stale is None:
        return schedule_prefix(conf, sps)
    return async_lengths(conf, stale, sps)


@torch.no_grad()
def generate(
    target: PreTrainedModel,
    drafter: DSparkDrafter,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    policy: str = "scheduled",
    sps: Any = None,
    threshold: float = 0.5,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stopping_criteria: Callable[..., Any] | None = None,
    streamer: Any = None,
    return_dict_in_generate: bool = False,
    generator: torch.Generator | None = None,
    hole_budget: int | None = None,
    record_rounds: bool = False,
    count_round_overhead: bool = True,
    idle_backoff: bool = True,
    **unused: Any,
) -> torch.LongTensor | DSparkGenerateOutput:
    """Speculative decoding of a left-padded batch with a DSpark drafter. Lossless: greedy output equals each row's
    own `target.generate(do_sample=False)`; sampled output follows the target's distribution.

    Args:
        target, drafter: a causal LM and a `DSparkDrafter` built for it (bound here if needed).
        input_ids, attention_mask: `[R, L]` left-padded prompts.
        max_new_tokens: tokens to generate per row (at most).
        do_sample, temperature, top_k, top_p: sampling, applied identically to target and draft distributions.
        policy: "fixed", "threshold", "scheduled" (Algorithm 1) or "async" (section 5.2).
        sps: cost curve for "scheduled" / "async": an `SPSTable`, a JSON path, a callable B -> steps/s, or None to
            profile this target once per process.
        threshold: prefix-survival cut for "threshold".
        eos_token_id, pad_token_id: default to the target's generation config.
        stopping_criteria: a transformers `StoppingCriteriaList` (checked after every emitted token of every row).
        streamer: receives tokens as they are accepted (batch size 1 only).
        return_dict_in_generate: return a `DSparkGenerateOutput` with per-row statistics.
        generator: RNG for drafting and verification (sampling).
        hole_budget: compact the KV caches once the widest row carries more than this many masked columns
            (default 2 * (block_size + 1)).
        record_rounds: keep a `RoundRecord` per round in the output (for calibration and evaluation).
        count_round_overhead: for "scheduled" / "async", add the measured per-round cost outside the target's forward
            (drafting, bookkeeping; a running mean over past rounds) to the cost curve (see
            `scheduler.WithRoundOverhead`). False prices the target forward alone, as the paper's Algorithm 1 does.
        idle_backoff: for "scheduled" / "async": after 2 consecutive rounds that did not pay for drafting, skip the
            drafter for the next rounds (plain decoding through the same loop; the drafter's context is still
            updated), then draft again to probe; the skip doubles (2, 4, ... 32 rounds) while probes keep not paying
            and resets when one pays. A round does not pay when the policy verified no draft in any row or, with
            `count_round_overhead`, when its expected throughput (calibrated confidences, cost curve plus the
            measured per-round overhead) is below plain decoding's (cost curve plus the overhead without the
            drafter's measured time). Decided from past rounds only, so the output is exactly the same as without it
            (lossless either way); it only saves the drafter's cost under load.
    """
    started = time.perf_counter()
    attention_mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens, policy, drafter)
    if not drafter.bound_to(target):
        drafter.bind_target(target)
    gen_cfg = target.generation_config
    if eos_token_id is None:
        eos_token_id = gen_cfg.eos_token_id
    eos = torch.tensor([] if eos_token_id is None else
                       ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)), dtype=torch.long)
    if pad_token_id is None:
        pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer is supported for batch size 1 only")
    sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    block_size = drafter.config.block_size
    hole_budget = 2 * (block_size + 1) if hole_budget is None else int(hole_budget)
    rows_total, prompt_len = input_ids.shape
    device = input_ids.device
    if policy in ("scheduled", "async"):
        sps = resolve_sps(target, sps, max_tokens=rows_total * (block_size + 1))
    layer_ids = [i + 1 for i in drafter.config.target_layer_ids]

    # ---------------------------------------------------------------- prefill
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                 use_cache=True, output_hidden_states=layer_ids, logits_to_keep=1)
    first = sampling.warp(out.logits[:, -1].float())
    if do_sample:
        first_tokens = torch.multinomial(torch.softmax(first, -1), 1, generator=generator).squeeze(1)
    else:
        first_tokens = first.argmax(-1)
    dcache = drafter.new_cache()
    drafter.append_context(dcache, drafter.context_features(out.hidden_states).to(drafter.device),
                           positions.to(drafter.device), attention_mask.bool().to(drafter.device))
    kv_valid = attention_mask.bool()                 # [R_active, T] over the target cache columns
    next_pos = attention_mask.sum(dim=1)             # [R_active] position of each row's anchor
    anchors = first_tokens                           # [R_active] last emitted token, not yet in the target cache

    generated = torch.full((rows_total, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    num_generated = torch.zeros(rows_total, dtype=torch.long, device=device)
    stats = [RowStats() for _ in range(rows_total)]
    active = torch.arange(rows_total, device=device)  # original row index of every active row
    history: list[torch.Tensor] = []                 # confidences of past rounds, for the async policy
    history_rows: list[torch.Tensor] = []
    peak_columns = kv_valid.shape[1]
    rounds: list[RoundRecord] = []
    overhead_total, overhead_rounds = 0.0, 0
    draft_total = 0.0  # seconds inside drafter.draft over the overhead_rounds
    if streamer is not None:
        streamer.put(input_ids.cpu())

    eos_set = set(eos.tolist())

    def emit(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Appends `counts[i]` tokens of `tokens[i]` to active row i, cut at the first EOS, the first token on which
        a stopping criterion fires, or `max_new_tokens`. Returns which active rows are finished."""
        finished = torch.zeros(len(active), dtype=torch.bool)
        for i, row in enumerate(active.tolist()):
            start = int(num_generated[row])
            new = tokens[i, : int(counts[i])].tolist()[: max_new_tokens - start]
            stop = False
            for j, tok in enumerate(new):
                if tok in eos_set or (stopping_criteria is not None and _criteria_fire(row, start, new[: j + 1])):
                    new, stop = new[: j + 1], True
                    break
            generated[row, start: start + len(new)] = torch.tensor(new, dtype=torch.long, device=device)
            num_generated[row] = start + len(new)
            finished[i] = stop or start + len(new) >= max_new_tokens
            if finished[i]:
                stats[row].seconds = time.perf_counter() - started
            if streamer is not None:
                streamer.put(torch.tensor(new))
        return finished

    def _criteria_fire(row: int, start: int, new: list[int]) -> bool:
        seq = torch.cat([input_ids[row, attention_mask[row].bool()], generated[row, :start],
                         torch.tensor(new, dtype=torch.long, device=device)])[None]
        return bool(torch.as_tensor(stopping_criteria(seq, None)).any())

    finished = emit(first_tokens[:, None], torch.ones(len(active), dtype=torch.long))

    def _round_cost(with_drafter: bool = True):
        """The cost curve the policies price: SPS(B) plus the mean measured per-round overhead of past drafting
        rounds (`with_drafter=False`: less the drafter's own mean time, i.e. what a plain decoding round pays)."""
        if not (count_round_overhead and overhead_rounds and policy in ("scheduled", "async")):
            return sps
        overhead = overhead_total / overhead_rounds
        if not with_drafter:
            overhead = max(overhead - draft_total / overhead_rounds, 0.0)
        return WithRoundOverhead(sps, overhead)

    def _policy_lengths(block):
        """The policy's verification lengths for this round's drafts (reads past rounds only)."""
        nonlocal history, history_rows
        confidences = block.confidences
        stale = None
        if policy == "async" and len(history) >= 2:
            # confidences two rounds old, aligned with the rows still active (finished rows dropped since)
            old, old_rows = history[-2], history_rows[-2]
            where = {int(r): i for i, r in enumerate(old_rows.tolist())}
            stale = old[[where[int(r)] for r in active.tolist()]]
        lengths = _choose_lengths(policy, confidences, block_size, rows, sps=_round_cost(), threshold=threshold,
                                  stale=stale)
        if policy == "async" and confidences is not None:  # only async reads past confidences
            history = (history + [confidences.float().cpu()])[-2:]
            history_rows = (history_rows + [active.clone().cpu()])[-2:]
        return lengths

    def _round_pays(block, lengths: torch.Tensor) -> bool:
        """Whether drafting this round is expected to beat plain decoding once the drafter's own time is priced."""
        if int(lengths.max()) == 0:
            return False
        if not (count_round_overhead and overhead_rounds) or block.confidences is None:
            return True
        conf, lengths = block.confidences.detach().float().cpu(), lengths.cpu()
        return (expected_throughput(conf, lengths, _round_cost())
                > expected_throughput(conf, torch.zeros_like(lengths), _round_cost(with_drafter=False)))

    # ---------------------------------------------------------------- rounds
    backoff = idle_backoff and policy in ("scheduled", "async")
    idle_streak, skip_left, skip_len = 0, 0, 2
    while True:
        if finished.any():
            keep = (~finished).nonzero().flatten()
            if len(keep) == 0:
                break
            cache.batch_select_indices(keep.to(device))
            dcache.select_rows(keep.to(drafter.device))
            kv_valid, next_pos, anchors, active = kv_valid[keep], next_pos[keep], anchors[keep], active[keep]
        if kv_valid.shape[1] - int(kv_valid.sum(dim=1).max()) > hole_budget:
            kv_valid = _compact_target_cache(cache, kv_valid)
            dcache.compact()
        rows = len(active)
        round_start = time.perf_counter()
        skipping = backoff and skip_left > 0
        if skipping:  # plain decoding round: no drafts, nothing for the policy to choose
            skip_left -= 1
            block = None
            lengths = torch.zeros(rows, dtype=torch.long, device=device)
        else:
            draft_start = time.perf_counter()
            block = drafter.draft(dcache, anchors.to(drafter.device), anchor_positions=next_pos.to(drafter.device),
                                  sampling=sampling, generator=generator)
            draft_seconds = time.perf_counter() - draft_start
            lengths = _policy_lengths(block)
            if backoff:
                if not _round_pays(block, lengths):
                    idle_streak += 1
                    if idle_streak >= 2:
                        skip_left, skip_len = skip_len, min(2 * skip_len, 32)
                else:
                    idle_streak, skip_len = 0, 2
        budget = (max_new_tokens - 1 - num_generated[active]).clamp(min=0).cpu()
        lengths = torch.minimum(lengths.cpu(), budget).to(device)
        width = 1 + int(lengths.max())
        if block is None:
            drafts = torch.zeros(rows, 0, dtype=torch.long, device=device)
            draft_logits = None
        else:
            drafts = block.tokens[:, : width - 1].to(device)
            draft_logits = block.logits[:, : width - 1].to(device)
        tokens = torch.cat([anchors[:, None], drafts], dim=1)  # [R, width]; slots past 1 + l_r are padding
        slots = torch.arange(width, device=device)
        step_valid = slots[None, :] < (1 + lengths)[:, None]
        tokens = torch.where(step_valid, tokens, anchors[:, None])
        pos = next_pos[:, None] + slots[None, :]
        verify_start = time.perf_counter()
        out = target(input_ids=tokens, attention_mask=torch.cat([kv_valid, step_valid], dim=1).long(),
                     position_ids=pos, cache=cache, use_cache=True, output_hidden_states=layer_ids)
        verify_end = time.perf_counter()
        if draft_logits is None:
            draft_logits = out.logits.new_zeros(rows, 0, out.logits.shape[-1])
        result = verify(drafts, draft_logits, out.logits.float(), sampling, num_drafts=lengths, generator=generator,
                        pad_token_id=pad_token_id)
        kept = slots[None, :] < (1 + result.num_accepted)[:, None]  # anchor + accepted drafts are now context
        kv_valid = torch.cat([kv_valid, kept], dim=1)
        peak_columns = max(peak_columns, kv_valid.shape[1])
        drafter.append_context(dcache, drafter.context_features(out.hidden_states).to(drafter.device),
                               pos.to(drafter.device), kept.to(drafter.device))
        next_pos = next_pos + 1 + result.num_accepted
        anchors = result.next_tokens
        if record_rounds:
            rounds.append(RoundRecord(
                rows=active.cpu().clone(),
                confidence_logits=None if block is None or block.confidence_logits is None
                else block.confidence_logits.float().cpu(),
                lengths=lengths.cpu().clone(), accepted=result.num_accepted.cpu().clone()))
        for i, row in enumerate(active.tolist()):
            s = stats[row]
            s.rounds += 1
            s.verified += int(lengths[i])
            s.accepted += int(result.num_accepted[i])
            s.accepted_lengths.append(int(result.num_new[i]))
            s.verify_lengths.append(int(lengths[i]))
        finished = emit(result.tokens, result.num_new)
        if not skipping:
            # everything in this round but the target's forward: the per-round overhead the cost curve does not see
            overhead_total += (time.perf_counter() - round_start) - (verify_end - verify_start)
            overhead_rounds += 1
            draft_total += draft_seconds
    if streamer is not None:
        streamer.end()
    longest = int(num_generated.max())
    sequences = torch.cat([input_ids, generated[:, :longest]], dim=1)
    if not return_dict_in_generate:
        return sequences
    return DSparkGenerateOutput(sequences=sequences, stats=stats, num_generated=num_generated, policy=policy,
                                peak_cache_columns=peak_columns, rounds=rounds if record_rounds else None)


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    synced_gpus: bool = False,
    streamer: Any = None,
    drafter: DSparkDrafter | None = None,
    policy: str = "scheduled",
    sps: Any = None,
    threshold: float = 0.5,
    generator: torch.Generator | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | DSparkGenerateOutput:
    """The same loop behind `target.generate(**inputs, custom_generate=dspark_hf.speculative_generate,
    drafter=drafter, policy=...)`: sampling settings, `max_new_tokens`, EOS and pad ids come from the generation
    config that generate() prepared. transformers drops `streamer` on this path; pass it to `dspark_hf.generate`."""
    if drafter is None:
        raise ValueError("speculative_generate needs drafter=<DSparkDrafter> (pass it to target.generate)")
    supported = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
    unsupported = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in supported]
    if unsupported:
        raise NotImplementedError(
            f"dspark_hf's batched loop applies temperature / top-k / top-p only; generate() also asked for "
            f"{unsupported}. Drop those settings, or use batch size 1 through target.generate(assistant_model=...)"
        )
    builtin = {"MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria"}
    custom = [c for c in (stopping_criteria or []) if type(c).__name__ not in builtin]
    cfg = generation_config
    max_new_tokens = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - input_ids.shape[1]
    return generate(
        model, drafter, input_ids, model_kwargs.get("attention_mask"),
        max_new_tokens=int(max_new_tokens), do_sample=bool(cfg.do_sample),
        temperature=float(cfg.temperature if cfg.temperature is not None else 1.0),
        top_k=cfg.top_k if cfg.do_sample else None, top_p=cfg.top_p if cfg.do_sample else None,
        policy=policy, sps=sps, threshold=threshold, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        stopping_criteria=StoppingCriteriaList(custom) if custom else None, streamer=streamer, return_dict_in_generate=bool(cfg.return_dict_in_generate), generator=generator,
    )
