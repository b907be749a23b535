"""Batched DSpark speculative decoding with confidence-scheduled verification.

    out = dspark_hf.generate(target, drafter, input_ids=ids, attention_mask=mask, max_new_tokens=256,
                             do_sample=True, temperature=0.7, policy="scheduled", sps=dspark_hf.SPSCache())
    out = dspark_hf.generate(target, drafter, **inputs, generation_config=GenerationConfig(max_new_tokens=64))
    out = target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, drafter=drafter)

One round, for all active rows at once:
1. the drafter drafts a block for every row in one forward (anchor = the row's last emitted token);
2. a policy picks each row's verification length l_r (`fixed`, `threshold`, `scheduled` = Algorithm 1, `async`);
3. the target verifies all rows in ONE forward: row r feeds [anchor, d_1..d_{l_r}] right-padded to the round's width,
   with explicit per-row positions and a 2-D mask over the cached columns + the new ones; on a prepacked CPU target
   the linears multiply each row's real tokens only (`ragged_verification`, `prepacked.ragged_tokens`), so the
   padding costs attention alone;
4. each row accepts its longest valid prefix (greedy match or lossless rejection sampling) plus one target token;
5. cache columns of rejected drafts and padding stay as masked *holes*; the drafter receives the target hidden
   states of each row's verified tokens; finished rows (EOS, stopping criteria, `max_new_tokens`) are dropped, or
   ride along while a drop's cache copy would cost more (`drop_finished`); holes are compacted where they cost more
   than the copy, and always past `hole_budget` columns.

Tree drafts (`tree_budget=N`, see `tree`): step 1 drafts the chain plus up to N alternative nodes per row where the
chain is fragile; step 2 picks the nodes each row verifies (the same policies over node survivals); step 3 feeds
[anchor, nodes] with per-node positions (anchor + depth) and a 4-D tree mask (each node sees the cache, the anchor,
its ancestors); step 4 accepts the longest matching path (greedy) or runs multi-candidate recursive rejection
sampling (`tree_verification`); step 5 keeps the anchor and the accepted path in both caches, every other node
becomes a hole. `tree_budget=0` runs this path with chains only and reproduces the default rounds exactly.
With "scheduled" / "async" and the round overhead counted (`count_round_overhead`, the default), tree growth is
priced: step 1 drafts the chain exactly as `drafter.draft` does, then before each growth step a plan
(`scheduler.schedule_growth`) asks whether each row's next node is expected to pay for its measured drafting cost
and its verification width in tokens per second; the budget is spent only as far as it pays, and a round in which
no branch pays is the chain's round (chain lengths, 2-D mask, chain verification), at the chain's cost plus the
plan's check.
`tree_budget=None` (default) is the chain loop above. Batch size 1 with trees goes through this loop too:
transformers' assisted decoding verifies a chain only (one candidate sequence, a causal mask, a cache crop to a
prefix), so `target.generate(assistant_model=drafter)` cannot take a tree.

With an n-gram `lookup=`, step 1 also proposes each row's lookup continuation and keeps whichever source is expected
to accept more; the rounds the idle backoff takes from the drafter draft from the lookup alone (lookup-only rounds:
no drafter forward, a fraction of a millisecond per row from the row's incremental `LookupContext`,
`lookup_rounds=True`), and a drafting round counts as paying only if it beats the lookup-only round it replaced, so
under load a drafter that adds nothing next to the lookup stops costing its forward while the lookup's drafts keep
being verified where they pay. With `tree_budget=` as well (greedy only), the lookup's continuation is not a
competitor but a branch: `tree.lookup_branches` merges it into each row's tree like a trie, one forward verifies the
drafter's nodes and the lookup's together, and the round accepts whichever path the target's argmax follows
(`tree_max_nodes` keeps the most likely nodes of both sources within a width).

Expected pay is checked against measured pay: `RealizedGain` times every plain round and every verifying round
(drafting, tree growth, bookkeeping and the wider forward included) and weighs the tokens each verifying round emitted
at the plain rounds' rate; a kind of round (drafter, lookup-only, tree) whose last verifying rounds lost time in sum
is backed off even where its estimates say it pays and its probes are cheap (trees: the next rounds draft chains
alone, `BranchBackoff`, and the drafter itself once its chain rounds lose too). A source verifies one draft per row at
most (`round_state.PROBE_LENGTH`) until its calibration has seen as many verified drafts as there are rows: its
estimates are not yet corrected by what rows accepted. A chain round verifies only where it beats a plain step once
the measured tails of verifying and plain rounds are priced (`LengthPolicy.worth_verifying`). Finished rows ride along
while a drop's cache copy would cost more than their share of the rounds left (`round_state.Riders`), and holes are
compacted where they cost more than the copy (`compaction_pays`). A round's width is priced with the measured
per-round overhead scaled by the share of recent rounds the drafter ran (`RoundClock.cost(amortized=True)`): once a
round has drafted its overhead is spent, and the rounds that emit what it did not verify pay that overhead only as
often.

A round that verifies no draft (the idle backoff skipped the drafter, the policy chose l_r = 0 everywhere, or
`speculate=False`) is a plain decoding step: one token per row, `verify`'s K = 0 path, no compaction check (nothing
was rejected). `speculate=False` also asks the target for no hidden states and keeps no drafter context.

The state carried between rounds (rows and caches, outputs and statistics, round overhead, policy history, idle
backoff) lives in `round_state`; `generate` is the round above, top to bottom.

Memory bound: after every round each row's KV cache holds at most prompt + generated + `hole_budget` + (block + 1)
columns (`hole_budget` by default 8 x (block + 1); trees: + (1 + block + tree_budget); the widest row's, since rows
share one cache tensor; left padding of short prompts counts as holes and is compacted away too).

Arguments: `generate` honours the keyword arguments it names and, from a `generation_config=` (a transformers
`GenerationConfig`) or transformers-style keyword arguments, `max_new_tokens` / `max_length`, `max_time`, `do_sample`,
`temperature`, `top_k`, `top_p`, `eos_token_id`, `pad_token_id` and `return_dict_in_generate`. Settings the loop cannot
honour (`repetition_penalty`, `num_beams`, `min_new_tokens`, ...) raise `NotImplementedError`; unknown keyword
arguments raise `TypeError`. Nothing is cached between calls: the SPS curve of the "scheduled" / "async" policies is
given (`sps=`), held by a caller-owned `SPSCache`, or profiled for the call.

Exactness needs a target whose cache is a plain `DynamicCache` (no sliding window: holes would shift the window).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import hashlib
import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList
from transformers.utils import ModelOutput, logging

from ..models.lookup import LookupProposal, lookup_block, merge_lookup_drafts
from ..models.modeling_dspark import DSparkDrafter
from ..models.prepacked import is_prepacked, ragged_tokens
from ..provenance import device_description
from .policy_memory import LearnedState, PolicyMemory
from .round_state import (PRICED_POLICIES, ActiveRows, BranchBackoff, DrafterGate, GrowthClock, IdleBackoff,
                          LengthPolicy, MeasuredCost, OnlineCalibration, RealizedGain, RoundClock, RoundRecord, Riders,
                          RowOutputs, RowStats, target_layer_ids)
from .scheduler import POLICIES, cap_tree, schedule_width, sps_values
from .sps import RowScaledCost, SPSTable, profile_sps, target_fingerprint
from .tree import DraftTree, TreeDrafting, TreeSpec, draft_tree_for, lookup_branches, plans_growth
from .tree_attention import check_tree_attention, verification_inputs
from .tree_verification import tree_verify
from .verification import SamplingParams, verify

HOLE_CAP = 8  # default hole budget, in verification widths (compaction where it pays below it)

__all__ = [
    "DSparkGenerateOutput",
    "GenerationSettings",
    "RoundRecord",
    "RowStats",
    "SPSCache",
    "generate",
    "resolve_sps",
    "speculative_generate",
]

logger = logging.get_logger(__name__)


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


# ---------------------------------------------------------------------------------------------- SPS curve
class SPSCache:
    """SPS tables owned by the caller: profiles each target once (per fingerprint, device, dtype and attention
    implementation) and reuses the table, so that repeated `generate(..., sps=cache)` calls do not re-profile. A table
    is re-profiled when a call needs a larger verification batch than it covers.

        cache = dspark_hf.SPSCache()
        for batch in batches:
            dspark_hf.generate(target, drafter, **batch, policy="scheduled", sps=cache)  # profiles on the first call

    With `directory`, tables also persist there as JSON (written atomically), so a new process on the same machine
    skips the profile (it saved 2.8 / 7.7 / 28.8 s of a first call at 1 / 16 / 64 rows on a 2-core CPU,
    `scripts/bench_sps_cache.py`). A file is used only for exactly this setup:
    its name and its recorded key cover the target's fingerprint (prepacked linears included), dtype, attention
    implementation, the loop's row layout, the device as `provenance.device_description` tells it (CPU model, cores,
    torch threads; the GPU's name) and the torch version. A file that is unreadable, made for another setup or too
    narrow for the call is profiled anew and replaced.

        cache = dspark_hf.SPSCache("~/.cache/dspark_hf/sps")

    Attributes:
        tables: the tables in memory, by `key(target)` (+ the row layout).
        profiles: how many times this cache has profiled a target; loaded: tables read from `directory`.
    """

    def __init__(self, directory: str | Path | None = None, *, context_lengths: Sequence[int] = (128,),
                 repeats: int = 2) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self.context_lengths = tuple(context_lengths)
        self.repeats = int(repeats)
        self.tables: dict[tuple, SPSTable] = {}
        self.profiles = 0
        self.loaded = 0

    @staticmethod
    def key(target: PreTrainedModel) -> tuple[str, str, str, str]:
        """What a table depends on: the target's fingerprint (architecture, sizes, prepacked linears), its device, its
        dtype and its attention implementation (grouped-query attention without copies changes the curve)."""
        attention = str(getattr(target.config, "_attn_implementation", None))
        return target_fingerprint(target), str(target.device), str(target.dtype), attention

    def _stored(self, target: PreTrainedModel, key: tuple) -> tuple[Path, str]:
        """The file for `key` in `directory` and the text that identifies the setup it holds."""
        described = json.dumps([*key, device_description(target.device), torch.__version__,
                                list(self.context_lengths)])
        digest = hashlib.sha256(described.encode()).hexdigest()[:20]
        return self.directory / f"sps-{digest}.json", described

    def _load(self, path: Path, described: str, max_tokens: int) -> SPSTable | None:
        if not path.exists():
            return None
        try:
            table = SPSTable.load(path)
        except ValueError as err:
            logger.warning(f"SPS cache file {path} unreadable ({err}); profiling anew")
            return None
        if table.meta.get("sps_cache_key") != described or table.batch_tokens[-1] < max_tokens:
            return None
        self.loaded += 1
        return table

    def table(self, target: PreTrainedModel, max_tokens: int, rows: int | None = None) -> SPSTable:
        """The table for `target` covering verification batches up to `max_tokens` tokens (profiled if needed);
        `rows=R`: profiled in the batched loop's layout (`profile_sps(rows=)`), R' rows of w = 1, 2, ... tokens with R'
        the power of two >= R (one table per R', priced at R rows by `RowScaledCost`), so that calls of many batch
        sizes profile a few times only."""
        if rows is not None:
            profiled = 1 << max(int(rows) - 1, 0).bit_length()
            max_tokens = -(-max_tokens * profiled // int(rows))
            rows = profiled
        key = self.key(target) + ((rows,) if rows is not None else ())
        table = self.tables.get(key)
        if table is None or table.batch_tokens[-1] < max_tokens:
            stored = self._stored(target, key) if self.directory is not None else None
            table = self._load(*stored, max_tokens) if stored is not None else None
            if table is None:
                table = profile_sps(target, max_tokens=max(8, max_tokens) if rows is None else max_tokens,
                                    context_lengths=self.context_lengths, repeats=self.repeats, progress=False,
                                    rows=rows)
                self.profiles += 1
                if stored is not None:
                    table.meta = {**(table.meta or {}), "sps_cache_key": stored[1]}
                    table.save(stored[0])
            self.tables[key] = table
        return table


def resolve_sps(target: PreTrainedModel, sps: Any, max_tokens: int, rows: int | None = None) -> Any:
    """An SPS curve for the scheduler: the given table / callable, a JSON path (checked against `target`), a table
    from an `SPSCache`, or — for `None` — a table profiled for this call only. `rows`: the call's batch size; tables
    profiled here are laid out as its rounds are (R rows of w tokens) and, like any table profiled so
    (`SPSTable.rows`), returned as a `RowScaledCost` that the loop prices at the rows each round has."""
    if sps is None:
        logger.warning_once("dspark_hf.generate(sps=None) profiles the target's SPS curve on every call; pass "
                            "sps=dspark_hf.SPSCache() (or a saved SPSTable) to profile once and reuse it")
        sps = SPSCache().table(target, max_tokens, rows=rows)
    elif isinstance(sps, SPSCache):
        sps = sps.table(target, max_tokens, rows=rows)
    elif isinstance(sps, (str, bytes)) or hasattr(sps, "__fspath__"):
        sps = SPSTable.load(sps, target=target)
    elif isinstance(sps, SPSTable):
        sps.check(target)
    if isinstance(sps, SPSTable):
        return RowScaledCost(sps) if sps.rows is not None else sps
    if callable(sps):
        return sps
    raise TypeError(f"sps must be an SPSTable, an SPSCache, a path to a table, a callable B -> steps/s or None; got "
                    f"{type(sps).__name__}")


# ---------------------------------------------------------------------------------------------- arguments
_CONFIG_FIELDS = frozenset(k for k in GenerationConfig().to_dict()
                           if not k.startswith("_") and k != "transformers_version")
"""The settings of a transformers `GenerationConfig` (also accepted as keyword arguments, as `target.generate` does)."""

_HONOURED = frozenset({"max_new_tokens", "max_length", "max_time", "do_sample", "temperature", "top_k", "top_p",
                       "eos_token_id", "pad_token_id", "return_dict_in_generate"})

_IGNORED = frozenset({
    # the loop always keeps KV caches (its own DynamicCache): the output is the same either way
    "use_cache", "cache_config", "max_cache_len",
    # a decoder-only target continuing the given prompts: never read
    "bos_token_id", "decoder_start_token_id",
    # set by transformers on its assistants' own generation configs only
    "is_assistant",
    # beam-search knobs, moot without beams (num_beams itself is checked)
    "early_stopping", "length_penalty",
    # speed knobs of transformers' loops
    "compile_config", "disable_compile", "prefill_chunk_size", "low_memory",
})

_NEUTRAL: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    # knobs of transformers' assisted decoding at the defaults its generate() fills in (policy= / threshold= here)
    "num_assistant_tokens": (20,), "num_assistant_tokens_schedule": ("constant",),
    "assistant_confidence_threshold": (0.4,), "assistant_lookbehind": (10,), "target_lookbehind": (10,),
    "num_beams": (1,), "num_beam_groups": (1,), "num_return_sequences": (1,), "diversity_penalty": (0.0,),
    "repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,), "min_length": (0,), "min_new_tokens": (0,), "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "min_p": (0.0,), "guidance_scale": (1.0,),
    "remove_invalid_values": (False,), "renormalize_logits": (False,), "token_healing": (False,),
    "output_attentions": (False,), "output_hidden_states": (False,), "output_scores": (False,),
    "output_logits": (False,), "cache_implementation": ("dynamic",),
})
"""Values of the settings the loop does not implement that change nothing (None and empty containers also do)."""

# Model keyword arguments transformers' `generate()` prepares for its own loop and hands to a `custom_generate`
# callable: harmless here, so `speculative_generate` accepts and ignores them by name.
_PREPARED_MODEL_KWARGS = (
    "position_ids",    # derived from attention_mask exactly as this loop derives its own (cumsum - 1)
    "logits_to_keep",  # transformers' prefill setting; this loop chooses per forward
    "cache",           # transformers' fresh cache object: this loop prefills the whole prompt into its own
    "past_key_values",  # (older name of the same)
    "cache_position",  # positions in that unused cache
)


def _unexpected_arguments(names: Sequence[str]) -> TypeError:
    known = set(inspect.signature(generate).parameters) | _CONFIG_FIELDS
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return TypeError(f"generate() got unexpected keyword argument(s): {', '.join(hints)}")


def _is_neutral(name: str, value: Any) -> bool:
    if value is None or (isinstance(value, (list, tuple, dict, set)) and not value):
        return True
    return any(value == neutral for neutral in _NEUTRAL.get(name, ()))


@dataclass(frozen=True)
class GenerationSettings:
    """The generation settings of one `generate` call, resolved from (highest precedence first) its explicit keyword
    arguments, its transformers-style keyword arguments, its `generation_config`, the target's generation config (EOS
    and pad ids only) and this loop's defaults (128 new tokens, greedy)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    return_dict_in_generate: bool
    max_time: float | None

    @classmethod
    def resolve(cls, target: PreTrainedModel, prompt_length: int, generation_config: GenerationConfig | None,
                config_kwargs: Mapping[str, Any], *, max_new_tokens: int | None, do_sample: bool | None,
                temperature: float | None, top_k: int | None, top_p: float | None,
                eos_token_id: int | Sequence[int] | None, pad_token_id: int | None,
                return_dict_in_generate: bool | None) -> "GenerationSettings":
        """Raises `TypeError` for keyword arguments that are no `GenerationConfig` setting and `NotImplementedError`
        for settings this loop cannot honour (at a value that would change the output)."""
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers GenerationConfig, got "
                            f"{type(generation_config).__name__}")
        unknown = sorted(k for k in config_kwargs if k not in _CONFIG_FIELDS)
        if unknown:
            raise _unexpected_arguments(unknown)
        config = {} if generation_config is None else {k: getattr(generation_config, k, None) for k in _CONFIG_FIELDS}
        config.update(config_kwargs)
        config = {k: v for k, v in config.items() if v is not None}
        unsupported_names = [k for k, v in sorted(config.items())
                             if k not in _HONOURED and k not in _IGNORED and not _is_neutral(k, v)]
        unsupported = [f"{k}={config[k]!r}" for k in unsupported_names]
        if unsupported:
            raise NotImplementedError(
                f"dspark_hf's batched loop applies temperature / top-k / top-p, EOS, max_new_tokens / max_length, "
                f"max_time and stopping criteria only; it cannot honour {', '.join(unsupported)}. Drop those "
                f"settings, or use batch size 1 through target.generate(assistant_model=...)"
                + ("; this loop's verification lengths are policy='fixed' | 'threshold' (threshold=) | 'scheduled'"
                   if any(k.startswith(("num_assistant", "assistant_")) for k in unsupported_names) else "")
            )
        if max_new_tokens is None:
            if "max_new_tokens" in config:
                max_new_tokens = int(config["max_new_tokens"])
            elif "max_length" in config:
                max_new_tokens = int(config["max_length"]) - prompt_length
            else:
                max_new_tokens = 128
        do_sample = bool(config.get("do_sample", False)) if do_sample is None else do_sample
        if eos_token_id is None:
            eos_token_id = config.get("eos_token_id", target.generation_config.eos_token_id)
        eos = torch.tensor([] if eos_token_id is None else
                           ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)),
                           dtype=torch.long).tolist()
        if pad_token_id is None:
            pad_token_id = config.get("pad_token_id", target.generation_config.pad_token_id)
        if pad_token_id is None:
            pad_token_id = int(eos[0]) if eos else 0
        return cls(
            max_new_tokens=max_new_tokens, do_sample=do_sample,
            temperature=float(config.get("temperature", 1.0)) if temperature is None else temperature,
            top_k=top_k if top_k is not None else (config.get("top_k") if do_sample else None),
            top_p=top_p if top_p is not None else (config.get("top_p") if do_sample else None),
            eos_token_ids=tuple(eos), pad_token_id=pad_token_id,
            return_dict_in_generate=(bool(config.get("return_dict_in_generate", False))
                                     if return_dict_in_generate is None else return_dict_in_generate),
            max_time=config.get("max_time"),
        )

    def sampling(self) -> SamplingParams:
        """The sampling settings, applied identically to target and draft distributions."""
        return SamplingParams(do_sample=self.do_sample, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p)

    def stopping_criteria(self, criteria: Callable[..., Any] | None) -> Callable[..., Any] | None:
        """`criteria`, with a `MaxTimeCriteria` (started now) added when `max_time` is set."""
        if self.max_time is None:
            return criteria
        timer = MaxTimeCriteria(float(self.max_time))
        return timer if criteria is None else StoppingCriteriaList([criteria, timer])


def _check_inputs(target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  max_new_tokens: int, policy: str, drafter: DSparkDrafter | None,
                  speculate: bool = True) -> torch.Tensor:
    """Refuses inputs the loop cannot decode exactly; returns the attention mask (all ones if None) as long."""
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
    if not speculate:
        if drafter is not None and not isinstance(drafter, DSparkDrafter):
            raise TypeError(f"drafter must be a DSparkDrafter or None, got {type(drafter).__name__}")
    elif drafter is None:
        raise ValueError("generate() needs a drafter (or speculate=False for plain decoding through the same loop)")
    elif policy != "fixed" and drafter.confidence_head is None:
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


# ---------------------------------------------------------------------------------------------- the loop
@torch.no_grad()
def generate(
    target: PreTrainedModel,
    drafter: DSparkDrafter,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    generation_config: GenerationConfig | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    policy: str = "scheduled",
    sps: Any = None,
    threshold: float = 0.5,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stopping_criteria: Callable[..., Any] | None = None,
    streamer: Any = None,
    return_dict_in_generate: bool | None = None,
    generator: torch.Generator | None = None,
    hole_budget: int | None = None,
    drop_finished: str = "auto",
    record_rounds: bool = False,
    count_round_overhead: bool = True,
    idle_backoff: bool = True,
    speculate: bool = True,
    tree_budget: int | None = None,
    tree_max_children: int = 4,
    tree_max_nodes: int | None = None,
    lookup: Any = None,
    lookup_rounds: bool = True,
    drafter_gate: bool = True,
    lookup_max_tokens: int | None = None,
    padded_pricing: bool = True,
    ragged_verification: bool | None = None,
    measured_cost: bool = True,
    online_calibration: bool = True,
    policy_memory: PolicyMemory | None = None,
    **config_kwargs: Any,
) -> torch.LongTensor | DSparkGenerateOutput:
    """Speculative decoding of a left-padded batch with a DSpark drafter. Lossless: greedy output equals each row's
    own `target.generate(do_sample=False)`; sampled output follows the target's distribution.

    Args:
        target, drafter: a causal LM and a `DSparkDrafter` built for it (bound here if needed).
        input_ids, attention_mask: `[R, L]` left-padded prompts.
        generation_config: a transformers `GenerationConfig`; the settings listed in the module docstring are
            honoured, the explicit keyword arguments below win over it, and its unset fields take this function's
            defaults (not transformers' top_k=50). Any other setting at a value that changes the output raises
            `NotImplementedError`.
        max_new_tokens: tokens to generate per row (at most); default the generation config's (`max_new_tokens`, else
            `max_length` less the prompt width), else 128.
        do_sample, temperature, top_k, top_p: sampling, applied identically to target and draft distributions
            (default: the generation config's, else greedy).
        policy: "fixed", "threshold", "scheduled" (Algorithm 1) or "async" (section 5.2).
        sps: cost curve for "scheduled" / "async": an `SPSTable`, a JSON path, a callable B -> steps/s, an `SPSCache`
            (profiles once per target and reuses the table across calls), or None to profile for this call only.
        threshold: prefix-survival cut for "threshold".
        eos_token_id, pad_token_id: default to the generation config's, else the target's.
        stopping_criteria: a transformers `StoppingCriteriaList` (checked after every emitted token of every row).
        streamer: receives tokens as they are accepted (batch size 1 only).
        return_dict_in_generate: return a `DSparkGenerateOutput` with per-row statistics.
        generator: RNG for drafting and verification (sampling).
        hole_budget: compact the KV caches once the widest row carries more than this many masked columns
            (rejected drafts, left padding). Default: where it pays (`round_state.compaction_pays`: holes x rounds
            left >= cache columns, more than one verification width of holes), and always above 8 verification widths
            (8 * (block_size + 1); with trees 8 * (1 + block_size + tree_budget)). At 16 rows a compaction costs
            about a third of a one-token forward, more than a few holes cost the rounds left of a short call.
        drop_finished: when finished rows leave the batch (and its caches): "auto" (default) drops them once the
            rounds they would ride along cost more than the cache copy a drop makes (`round_state.Riders`: rows that
            stop early go at once, rows that reach `max_new_tokens` in the last rounds ride to the end, as in plain
            decoding), "always" as soon as they finish, "never" at the end. The output is the same either way.
        record_rounds: keep a `RoundRecord` per round in the output (for calibration and evaluation).
        count_round_overhead: for "scheduled" / "async", add the measured per-round cost outside the target's forward
            (drafting, bookkeeping; a running mean over past rounds) to the cost curve (see
            `scheduler.WithRoundOverhead`). False prices the target forward alone, as the paper's Algorithm 1 does.
            With trees it also prices tree growth: the measured seconds per growth step and per growing round
            (`round_state.GrowthClock`), so that branches are grown, and verified, only where they pay (module
            docstring); False grows every tree to `tree_budget` as far as its candidates allow.
        idle_backoff: for "scheduled" / "async": after 2 consecutive rounds that did not pay for drafting, skip the
            drafter for the next rounds (plain decoding through the same loop; the verified tokens' target features wait
            for the drafter's next round, which projects them into its context in one call: `ActiveRows.pending`),
            then draft again to probe; the skip doubles (2, 4, ... 32 rounds) while probes keep not paying and resets
            when one pays. A skip starts no shorter than what keeps a failed probe within 5% of the skipped rounds' time
            (`LengthPolicy.probe_skip`: the drafter's measured time over a plain round's), so costly drafter forwards
            under load are probed rarely. A round does not pay when the policy verified no draft in any row or, with
            `count_round_overhead`, when its expected throughput (calibrated confidences, cost curve plus the measured
            per-round overhead) is below plain decoding's (cost curve plus the overhead without the drafter's measured
            time). Decided from past rounds only, so the output is exactly the same as without it (lossless either way);
            it only saves the drafter's cost under load. With trees the same rule also drafts chains alone after tree
            rounds that verified no node off the chain (`round_state.BranchBackoff`).
        speculate: False runs the same loop with no drafts at all: one target forward per token, no hidden states,
            no drafter context (`drafter` may be None; `policy` and `sps` are not used). The output equals plain
            decoding's; it is the speed reference of the loop itself (what the idle backoff's skipped rounds cost).
        tree_budget: draft a tree per row: the chain plus up to this many alternative nodes where the chain is
            fragile (`dspark_hf.decoding.tree`), verified in one forward with a tree attention mask; lossless for
            greedy and sampling. None (default): chains. 0: the tree path with chains only (identical rounds). Needs
            a target with SDPA or eager attention (checked, and probed once per target object) and, for > 0, a
            drafter with a confidence head. The only way to decode trees at batch size 1 too (see the module
            docstring). With "scheduled" / "async" and `count_round_overhead` it is an upper bound: nodes are grown
            only while they pay for their measured drafting cost and their verification width.
        tree_max_children: children per tree node at most, the chain's own child included.
        tree_max_nodes: with `tree_budget`, each row verifies at most this many nodes: those of highest estimated
            survival among what the policy admits (`scheduler.cap_tree`). At the block size it keeps the chain's
            verification width and lets the budget's alternatives replace the chain's unlikely tail. None: no cap.
        lookup: an `NgramLookup`: every drafting round, each row's drafts are replaced by the lookup's n-gram
            continuation of its sequence where that is expected to accept more (`lookup.merge_lookup_drafts`: a rule
            that never reads a sampled draft, point-mass draft distributions, calibrated estimates as confidences),
            then the policy picks lengths as usual. With `tree_budget` (greedy only) the lookup's continuation is
            instead merged into each row's tree as a branch (`tree.lookup_branches`): one forward verifies both
            sources and the round accepts whichever matches longer; `tree_max_nodes` keeps the width in check.
        lookup_rounds: with `lookup` and the idle backoff: the rounds the backoff takes from the drafter draft from the
            lookup alone (`lookup.lookup_block`: no drafter forward, about half a millisecond per row), priced without
            the drafter's measured time, so that lookup drafts keep paying where the drafter does not. Such rounds have
            their own backoff (`IdleBackoff`: after 2 that did not pay, their proposals' measured time priced, skip 2,
            4, ... 32 rounds, starting no shorter than what keeps the proposals within 5% of the skipped rounds' time,
            and never where they cost less than that), are not probes of the drafter, and are recorded with
            `RoundRecord.lookup_only`. A drafting round then "pays" (for the idle backoff) only if it is also expected
            to beat the lookup-only round it replaced (`LengthPolicy.pays(alternative=)`), so a drafter that adds
            nothing next to the lookup is backed off. Decided from past rounds only: lossless either way. False: skipped
            rounds are plain decoding.
        drafter_gate: with lookup branches (`lookup` and `tree_budget`): a round runs the drafter only where past
            rounds with a lookup proposal as strong as this one emitted faster with it than without (the tokens the
            drafter added beyond the lookup's, measured, against the seconds of both kinds of round:
            `round_state.DrafterGate`); otherwise it verifies the lookup's drafts alone. False: the drafter drafts in
            every round.
        lookup_max_tokens: with `lookup`, the most drafts a round that verifies the lookup's drafts alone proposes per
            row (a round the drafter gate skips, or a lookup-only round of the idle backoff), and those rounds are no
            longer held to `tree_max_nodes` (a cap on the drafter's and the lookup's nodes together): the lookup's
            long runs (a repeated identifier, a copied line) are its strength. Their lengths: the other policies
            schedule them as before; "fixed" without `sps` verifies the whole proposal. "fixed" with a cost curve
            `sps` (the batch-1 curve `set_assist`'s chain uses): such a round verifies the width that maximises
            expected tokens per second for the rows' survival on the whole curve (`scheduler.schedule_width(
            early_stop=False)`), the lookup's estimates corrected by what its past rounds accepted
            (`OnlineCalibration`). A whole-curve search reads every estimate before choosing; lookup estimates depend
            on the sequence alone, so it is lossless here. Drafting rounds still merge at most a block of the lookup's
            drafts. None (default): a block, capped by `tree_max_nodes`, as before.
        padded_pricing: for "scheduled" / "async": price each verification forward as the rectangle it runs (every
            row padded to the widest: `scheduler.schedule_width`, `schedule_tree(padded=True)`), so the policy picks
            one width per round that pays for all rows. False: Algorithm 1's ragged pricing (B = sum of per-row
            lengths), what a serving engine without padding runs and about what a ragged verification forward
            (below) costs on a CPU; here it verified more drafts that did not pay (16 rows, decode only: 0.83x of
            transformers' decoding against 0.89x priced padded, `results/decode_only_ragged`), so padded pricing
            stays the default.
        ragged_verification: multiply only each row's real tokens in the linears of a verification forward, not the
            padding up to the widest row (`prepacked.ragged_tokens`: on a CPU the linears and the LM head cost about in
            proportion to the tokens they multiply, so a row's drafts then cost about their own tokens). Needs a
            target whose linears are prepacked (`prepack_linears`). None (default): on for a prepacked target. The real
            tokens' logits equal the full forward's up to float rounding, as for any batch shape.
        measured_cost: for "scheduled" / "async": correct `sps` with the target forwards this call has timed
            (`round_state.MeasuredCost`: medians at the batch sizes seen, the prior scaled elsewhere), so a stale or
            noisy profile does not mislead the policy for long. Past rounds only: lossless either way.
        online_calibration: for "scheduled" / "async": scale this round's survival estimates by what past rounds
            accepted against what they predicted (`round_state.OnlineCalibration`, the last 16 drafting rounds), so
            over-confident estimates (another domain, another draft source) stop buying verification that does not
            pay. Past rounds only: lossless either way.
        policy_memory: for "scheduled" / "async": a `PolicyMemory` that carries what this call's policy learned (idle
            backoffs, realized gains, round overheads, online calibrations) into the next call of the same kind, and
            starts this call from what the last one learned, instead of cold (`decoding.policy_memory`: a call that
            ended with the drafter backed off starts backed off, without a drafter probe; the drafter's skips may grow
            to `PolicyMemory.max_skip` rounds and run on across calls). One memory per target / drafter pair. Past
            rounds only: lossless either way. None (default): every call starts cold.
        **config_kwargs: `GenerationConfig` settings by name (e.g. `max_length=`, `use_cache=`), as
            `target.generate` accepts them; anything else raises `TypeError`.
    """
    started = time.perf_counter()
    settings = GenerationSettings.resolve(
        target, input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0, generation_config, config_kwargs,
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, return_dict_in_generate=return_dict_in_generate)
    attention_mask = _check_inputs(target, input_ids, attention_mask, settings.max_new_tokens, policy, drafter,
                                   speculate)
    if speculate and not drafter.bound_to(target):
        drafter.bind_target(target)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer is supported for batch size 1 only")
    sampling = settings.sampling()
    block_size = drafter.config.block_size if speculate else 0
    spec = None
    if lookup is not None and tree_budget is not None and sampling.do_sample:
        raise ValueError("lookup branches in a tree (lookup= with tree_budget=) are for greedy decoding only: which "
                         "nodes exist depends on the sampled drafts; pass tree_budget=None (lookup drafts in the "
                         "chain) or do_sample=False")
    if lookup is not None:
        lookup.check_vocab(int(target.get_output_embeddings().weight.shape[0]))
    if lookup_max_tokens is not None and (lookup is None or isinstance(lookup_max_tokens, bool)
                                          or not isinstance(lookup_max_tokens, int) or lookup_max_tokens < 1):
        raise ValueError(f"lookup_max_tokens must be an integer >= 1 and needs lookup=; got lookup_max_tokens="
                         f"{lookup_max_tokens!r}, lookup={'None' if lookup is None else type(lookup).__name__}")
    if tree_max_nodes is not None and (tree_budget is None or isinstance(tree_max_nodes, bool)
                                       or not isinstance(tree_max_nodes, int) or tree_max_nodes < 1):
        raise ValueError(f"tree_max_nodes must be an integer >= 1 and needs tree_budget; got tree_max_nodes="
                         f"{tree_max_nodes!r}, tree_budget={tree_budget!r}")
    if tree_budget is not None and speculate:
        spec = TreeSpec(budget=tree_budget, max_children=tree_max_children)
        attention = check_tree_attention(target, probe=True)
    branches = spec is not None and lookup is not None  # the lookup's continuation merged into each tree
    # lookup branches: rounds where the lookup alone is expected to do better skip the drafter (`DrafterGate`)
    gate = (DrafterGate(cap=tree_max_nodes if lookup_max_tokens is None else None)
            if branches and drafter_gate else None)
    # tokens per row of a verification forward (lookup branches: up to block_size more nodes)
    width_max = 1 + block_size + (spec.budget if spec is not None else 0) + (block_size if branches else 0)
    lookup_max = block_size if lookup_max_tokens is None else lookup_max_tokens  # (rounds of the lookup alone)
    if speculate and lookup is not None:
        width_max = max(width_max, 1 + lookup_max)
    ragged = is_prepacked(target)
    if ragged_verification and not ragged:
        raise ValueError("ragged_verification=True needs a target whose linears are prepacked "
                         "(dspark_hf.prepack_linears(target), CPU only): only those skip the padding")
    if ragged_verification is not None:
        ragged = bool(ragged_verification)
    auto_holes = hole_budget is None  # compact where it pays (`compaction_pays`), at most 8 x width_max holes
    hole_budget = HOLE_CAP * width_max if auto_holes else int(hole_budget)
    device = input_ids.device
    priced = speculate and policy in PRICED_POLICIES
    if priced:
        sps = resolve_sps(target, sps, max_tokens=input_ids.shape[0] * width_max, rows=input_ids.shape[0])
    cost = MeasuredCost(sps) if priced and measured_cost else (sps if priced else None)
    lookup_cost = None  # "fixed" with `sps` and `lookup_max_tokens`: the curve its rounds are chosen on (greedy)
    if speculate and lookup_max_tokens is not None and policy == "fixed" and sps is not None:
        lookup_cost = resolve_sps(target, sps, max_tokens=input_ids.shape[0] * width_max, rows=input_ids.shape[0])
    if policy_memory is not None and not priced:
        raise ValueError(f"policy_memory carries what the priced policies learn: it needs policy 'scheduled' or "
                         f"'async' with speculate=True, got policy={policy!r}, speculate={speculate}")
    memory_key = None if policy_memory is None else policy_memory.key(
        target, drafter, policy=policy, rows=input_ids.shape[0], lookup=lookup is not None, tree_budget=tree_budget)
    learned = None if memory_key is None else policy_memory.recall(memory_key)
    if learned is not None:
        learned = learned.restored(backoff_enabled=idle_backoff and priced, clock_priced=count_round_overhead and priced,
                                   calibrate=priced and online_calibration)
    clock = learned.clock if learned is not None else RoundClock(priced=count_round_overhead and priced)
    # trees with a priced policy that counts the round overhead: growth priced too, planned before every growth step
    planned = clock.priced and spec is not None and spec.budget > 0 and plans_growth(drafter)
    growth = GrowthClock(priced=planned)
    choose = LengthPolicy(policy, block_size, cost, threshold, clock, growth=growth, padded=padded_pricing,
                          calibration=OnlineCalibration() if priced and online_calibration else None,
                          lookup_calibration=(OnlineCalibration() if (priced or lookup_cost is not None)
                                              and online_calibration else None))
    backoff = IdleBackoff(enabled=idle_backoff and priced)
    # lookup-only rounds skip their proposals while they do not pay, only where those cost > 5% of a round
    lookup_backoff = IdleBackoff(enabled=True)
    realized = RealizedGain()  # the verifying rounds' measured gains against plain rounds (backoff of each kind)
    if learned is not None:  # start where the last call of this kind ended (`policy_memory`)
        backoff, lookup_backoff, realized = learned.backoff, learned.lookup_backoff, learned.realized
        choose.calibration, choose.lookup_calibration = learned.calibration, learned.lookup_calibration
    if policy_memory is not None:  # the drafter's skips may run on across calls
        backoff.max_skip = policy_memory.max_skip
    lookup_only = lookup is not None and lookup_rounds and backoff.enabled
    riders = Riders(drop_finished)  # finished rows: dropped, or riding along while a drop would cost more
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    branching = BranchBackoff(enabled=idle_backoff and priced and spec is not None and spec.budget > 0)
    criteria = settings.stopping_criteria(stopping_criteria)
    outputs = RowOutputs(input_ids, attention_mask, max_new_tokens=settings.max_new_tokens, started=started,
                         eos_token_ids=settings.eos_token_ids, stopping_criteria=criteria, streamer=streamer,
                         pad_token_id=settings.pad_token_id)
    layer_ids = target_layer_ids(drafter) if speculate else None  # hidden states only for the drafter's context
    records: list[RoundRecord] = []

    contexts: dict[int, tuple[Any, int]] = {}  # row -> (its `LookupContext`, tokens generated when last extended)

    def lookup_proposals(width: int) -> list:  # each active row's lookup continuation of its sequence so far
        proposals = []
        done = outputs.done(rows.ids).tolist()
        for i, r in enumerate(rows.ids.tolist()):
            if done[i]:  # a finished row riding along (`Riders`): nothing to draft
                proposals.append(LookupProposal([], [], []))
                continue
            generated = outputs.count(r)
            if r in contexts:  # index only the tokens since the last proposal
                context, indexed = contexts[r]
                context.extend(outputs.generated(r, indexed))
            else:
                context = lookup.context(outputs.sequence(r))
            contexts[r] = (context, generated)
            proposals.append(lookup.propose(context, width, min_survival=lookup.negligible_survival))
        return proposals

    # ---------------------------------------------------------------- prefill: prompts -> caches + first tokens
    rows, first = ActiveRows.prefill(target, drafter, input_ids, attention_mask, sampling, generator,
                                     context=speculate)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    finished = outputs.emit(rows.ids, first[:, None], torch.ones(len(rows), dtype=torch.long))

    # ---------------------------------------------------------------- rounds
    while True:
        if len(rows) == 0 or bool(finished.all()):
            break
        riding = int(finished.sum())
        tokens_left = int(outputs.left(rows.ids).max())  # (the longest live row's; riders have none)
        if riding and riders.drop_now(riding, len(rows), rows.kv_valid.shape[1], tokens_left,
                                      share=_rider_share(cost, len(rows), riding)):
            drop_start, shape = time.perf_counter(), tuple(rows.kv_valid.shape)
            rows.drop(finished)
            riders.observe_drop(time.perf_counter() - drop_start, *shape)
            finished, riding = torch.zeros(len(rows), dtype=torch.bool), 0
        live_rows = len(rows) - riding
        if auto_holes:
            rows.compact_holes(hole_budget, riders.rounds_left(tokens_left), floor=width_max)
        else:
            rows.compact_holes(hole_budget)
        if isinstance(cost, MeasuredCost):  # priced (and recorded) at this round's rows
            cost.set_rows(len(rows))
        elif isinstance(cost, RowScaledCost):
            cost.rows = len(rows)
        round_start = time.perf_counter()
        block, tree, width, draft_seconds, tree_seconds, one_time = None, None, 1, 0.0, 0.0, 0.0
        lookup_from = None  # (set by a tree round with a lookup branch)
        chain_survival = None  # (a lookup-branch round's drafter chain survival, for `DrafterGate`)
        drafting = None  # a planned tree round's `TreeDrafting` (for its growth timing)
        skipped = speculate and backoff.skip()  # (a skipped round is plain decoding, or lookup drafts alone)
        from_lookup = skipped and lookup_only and not lookup_backoff.skip()
        proposals, gated = None, False  # lookup branches: the lookup's proposals first; the gate may skip the drafter
        if branches and not skipped:
            gate_start = time.perf_counter()
            proposals = lookup_proposals(max(block_size, lookup_max))  # (a drafting round merges a block of them)
            gated = gate is not None and not gate.runs_drafter(proposals)
            gate_seconds = time.perf_counter() - gate_start
        if gated:  # the lookup alone is expected to emit faster than with the drafter's forward (`DrafterGate`)
            from_lookup = True
            block = lookup_block(proposals, lookup_max, vocab_size, device=device)
            proposed = torch.tensor([min(len(p.tokens), lookup_max) for p in proposals])
            lengths = torch.minimum(_lookup_lengths(choose, block, rows.ids, lookup_cost), proposed)
            if tree_max_nodes is not None and lookup_max_tokens is None:
                lengths = lengths.clamp(max=tree_max_nodes)
            lengths = torch.minimum(lengths, outputs.remaining(rows.ids))
            width = 1 + int(lengths.max())
            draft_seconds = gate_seconds
        elif from_lookup:  # a lookup-only round: no drafter forward, priced without the drafter's time
            lookup_start = time.perf_counter()
            proposals = lookup_proposals(lookup_max)
            block = lookup_block(proposals, lookup_max, vocab_size, device=device)
            lengths = _lookup_lengths(choose, block, rows.ids, lookup_cost)
            lookup_seconds = time.perf_counter() - lookup_start
            # (a kind that verified at a loss is skipped even where probes are cheap)
            lookup_backoff.observe(choose.pays(block, lengths, lookup_seconds=lookup_seconds),
                                   min_skip=choose.probe_skip(len(rows), probe_seconds=lookup_seconds),
                                   proven=realized.pays("lookup"))
            if not choose.worth_verifying(block, lengths, lookup_only=True):
                lengths = torch.zeros_like(lengths)  # a plain step is expected to emit faster (the round's tail)
            lengths = torch.minimum(lengths.cpu(), outputs.remaining(rows.ids))
            width = 1 + int(lengths.max())
        elif speculate and spec is None and not skipped:
            draft_start = time.perf_counter()
            block = drafter.draft(rows.drafter_context(), rows.anchors.to(drafter.device),
                                  anchor_positions=rows.next_pos.to(drafter.device), sampling=sampling,
                                  generator=generator)
            alternative = None  # what a lookup-only round would draft instead (what the drafter must beat)
            if lookup is not None:
                width = block.tokens.shape[1]
                proposals = lookup_proposals(width)
                block, _ = merge_lookup_drafts(block, proposals, sampling.do_sample)
                if lookup_only:
                    alternative = lookup_block(proposals, width, vocab_size)
            one_time = rows.pop_one_time_seconds()  # (the prompts' context projection: once per call, not per round)
            draft_seconds = time.perf_counter() - draft_start - one_time
            lengths = choose.lengths(block, rows.ids)
            if backoff.enabled:
                backoff.observe(choose.pays(block, lengths, alternative), min_skip=choose.probe_skip(len(rows)),
                                proven=realized.pays("drafter"))
            if not choose.worth_verifying(block, lengths):
                lengths = torch.zeros_like(lengths)  # the drafts are spent, yet a plain step is expected to emit faster
            lengths = torch.minimum(lengths.cpu(), outputs.remaining(rows.ids))
            width = 1 + int(lengths.max())
        elif speculate and spec is not None and not skipped:  # tree drafts: the same round over nodes
            draft_start = time.perf_counter()
            round_spec = branching.spec(spec)  # chains only while recent trees verified no branch
            if planned:  # the chain exactly as drafter.draft, then growth while the plan says it pays
                drafting = TreeDrafting(drafter, rows.drafter_context(), rows.anchors.to(drafter.device),
                                        anchor_positions=rows.next_pos.to(drafter.device), spec=round_spec,
                                        sampling=sampling, generator=generator)
                one_time = rows.pop_one_time_seconds()
                # the chain's drafting (what plain rounds skip)
                draft_seconds = time.perf_counter() - draft_start - one_time
                drafted = drafting.grow(choose.growth_plan())  # None: no branch paid, nothing grown
            else:
                drafted = draft_tree_for(drafter, rows.drafter_context(), rows.anchors.to(drafter.device),
                                         anchor_positions=rows.next_pos.to(drafter.device), spec=round_spec,
                                         sampling=sampling, generator=generator)
                one_time = rows.pop_one_time_seconds()
                draft_seconds = time.perf_counter() - draft_start - one_time
            if branches:  # the lookup's continuation as a branch (a round that grew nothing: of the chain)
                branch_start = time.perf_counter()
                base = drafted if drafted is not None else DraftTree.from_block(drafting.chain)
                lookup_from = base.tokens.shape[1]  # the branch's own nodes start here (appended by lookup_branches)
                if base.survival is not None:
                    chain_survival = base.survival[:, : base.num_chain]
                drafted = lookup_branches(base, [p.truncate(block_size) for p in proposals])
                draft_seconds += time.perf_counter() - branch_start + gate_seconds
            if drafted is None:  # the chain's round, verified exactly as tree_budget=None verifies it (no tree mask)
                block = drafting.chain
                chain = DraftTree.from_block(block)
                admitted = choose.admit(chain, rows.ids)  # = schedule_prefix on a chain (async: one node history)
                if tree_max_nodes is not None:
                    admitted = _cap_nodes(chain, admitted, tree_max_nodes)
                if backoff.enabled:
                    backoff.observe(choose.tree_pays(chain, admitted), min_skip=choose.probe_skip(len(rows)),
                                    proven=realized.pays("drafter"))
                if round_spec.budget > 0:
                    branching.observe(False)
                lengths = torch.minimum(admitted.sum(dim=1), outputs.remaining(rows.ids))
                width = 1 + int(lengths.max())
            else:
                admitted = choose.admit(drafted, rows.ids, lookup_from=lookup_from)
                if tree_max_nodes is not None:  # the most likely nodes within the width
                    admitted = _cap_nodes(drafted, admitted, tree_max_nodes)
                steps = drafting.steps if drafting is not None else 0
                kind = "tree" if round_spec.budget > 0 or branches else "drafter"
                if backoff.enabled:  # (trees that verified at a loss: see RealizedGain; chain rounds judge "drafter")
                    backoff.observe(choose.tree_pays(drafted, admitted, growth_steps=steps, lookup_from=lookup_from),
                                    min_skip=choose.probe_skip(len(rows)), proven=realized.pays(kind))
                if round_spec.budget > 0:  # a branch verified, and trees recently gained what they cost
                    branching.observe(bool(admitted[:, drafted.num_chain:].any()) and realized.pays("tree"))
                admitted &= drafted.depths.cpu() <= outputs.remaining(rows.ids)[:, None]  # never past max_new_tokens
                block = drafted  # (for the round record and the clock)
                select_start = time.perf_counter()
                tree = drafted.select(admitted)  # (its [R, W, V] logits are built only if sampling reads them)
                lengths = tree.num_nodes.cpu()
                width = 1 + int(lengths.max()) if tree.tokens.shape[1] else 1
                tree_seconds = time.perf_counter() - select_start
                if drafting is None:
                    tree_seconds = 0.0
                else:
                    tree_seconds += drafting.fixed_seconds + drafting.step_seconds

        decided = time.perf_counter()  # (a chain round's tail starts here: `RoundClock.add_tail`)
        if width == 1:  # no draft to verify: a plain decoding step (every row feeds its anchor)
            lengths = torch.zeros(len(rows), dtype=torch.long)
            drafts = rows.anchors.new_zeros(len(rows), 0)
            tokens, positions = rows.anchors[:, None], rows.next_pos[:, None]
            step_valid = torch.ones(len(rows), 1, dtype=torch.bool, device=device)
            step_mask = torch.cat([rows.kv_valid, step_valid], dim=1).long()
        elif tree is not None:  # row r feeds [anchor, its verified nodes], right-padded, under the tree mask
            inputs_start = time.perf_counter()
            tree = tree.to(device)
            tokens, positions, step_mask = verification_inputs(tree, rows.anchors, rows.next_pos, rows.kv_valid,
                                                               implementation=attention, dtype=target.dtype)
            if drafting is not None:
                tree_seconds += time.perf_counter() - inputs_start
        else:  # row r feeds [anchor, d_1..d_{l_r}], right-padded to the round's width
            lengths = lengths.to(device)
            drafts = block.tokens[:, : width - 1].to(device)
            slots = torch.arange(width, device=device)
            step_valid = slots[None, :] < (1 + lengths)[:, None]  # slots past 1 + l_r are padding
            tokens = torch.where(step_valid, torch.cat([rows.anchors[:, None], drafts], dim=1), rows.anchors[:, None])
            positions = rows.next_pos[:, None] + slots[None, :]
            step_mask = torch.cat([rows.kv_valid, step_valid], dim=1).long()
        real = None  # a ragged forward: the rectangle's real tokens (anchor + each row's drafts or nodes)
        if ragged and width > 1:
            real = torch.arange(width, device=device)[None, :] < (1 + lengths.to(device))[:, None]
        verify_start = time.perf_counter()
        with ragged_tokens(real) if real is not None else contextlib.nullcontext():
            out = target(input_ids=tokens, attention_mask=step_mask, position_ids=positions, cache=rows.cache,
                         use_cache=True, output_hidden_states=layer_ids)
        verify_seconds = time.perf_counter() - verify_start
        if isinstance(cost, MeasuredCost):
            cost.observe(tokens.numel() if real is None else int(real.sum()), verify_seconds)

        # accept: each row's longest valid prefix (a tree: path) plus one target token (no drafts: the target's own)
        if width > 1 and tree is not None:
            check_start = time.perf_counter()
            result = tree_verify(tree, out.logits, sampling, generator=generator, pad_token_id=settings.pad_token_id)
            if drafting is not None:
                tree_seconds += time.perf_counter() - check_start
        else:
            # greedy verification compares tokens only: a sparse block's [B, K, V] draft logits are not built for it
            sampled = width > 1 and sampling.do_sample
            draft_logits = block.logits[:, : width - 1].to(device) if sampled else out.logits[:, :0]
            result = verify(drafts, draft_logits, out.logits, sampling, num_drafts=lengths, generator=generator,
                            pad_token_id=settings.pad_token_id)

        if width > 1:  # what the estimates of the verified drafts predicted against what was accepted
            if tree is not None and lookup_from is not None:  # each source's calibration sees its own nodes
                choose.observe(block, admitted, result.num_accepted, lookup_from=lookup_from,
                               accepted_nodes=_accepted_nodes(tree, result, admitted.shape))
            else:
                choose.observe(block, lengths if tree is None else admitted, result.num_accepted,
                               lookup_only=from_lookup)

        # update caches: anchor + accepted drafts (path) become context of both caches; the rest stay holes
        if width == 1:
            kept = step_valid
        elif tree is not None:
            kept = result.kept
        else:
            kept = slots[None, :] < (1 + result.num_accepted)[:, None]
        rows.advance(out.hidden_states if speculate else None, positions, kept, result.num_accepted,
                     result.next_tokens)

        # emit: cut at EOS / stopping criteria / max_new_tokens, stream, count; finished rows go next round
        if record_rounds:
            record = _round_record(rows.ids, block, tree, spec, lengths, result, from_lookup)
            records.append(_without_riders(record, ~finished) if riding else record)
        emitted = live_rows + int(result.num_accepted.sum())  # (riders verify nothing: they accept nothing)
        finished = outputs.emit(rows.ids, result.tokens, result.num_new, lengths, result.num_accepted)
        if tree is None:  # what verifying drafts adds to a round beyond its forward (`LengthPolicy.worth_verifying`)
            clock.add_tail(width > 1, time.perf_counter() - decided - verify_seconds)
        clock.count_round(drafted=block is not None and not from_lookup)  # (the rounds that pay the measured overhead)
        if block is not None and not from_lookup:  # the per-round overhead the cost curve does not see: all but the
            # target's forward (a planned round that grew: less its tree work, which the growth clock measures and
            # prices per step; a lookup-only round is not a drafting round)
            clock.add(time.perf_counter() - round_start - verify_seconds - tree_seconds - one_time, draft_seconds)
            if drafting is not None and tree is not None:
                growth.add(drafting.steps, drafting.step_seconds, tree_seconds - drafting.step_seconds)
        if gate is not None and width > 1 and (gated or chain_survival is not None):  # the gate's timings
            emitted_rows = [row[:n] for row, n in zip(result.tokens.tolist(), result.num_new.tolist())]
            gate.observe(time.perf_counter() - round_start - one_time,
                         0.0 if gated else draft_seconds - gate_seconds,  # (the proposals: both kinds pay them)
                         None if gated else chain_survival, proposals=proposals, emitted=emitted_rows)
        if backoff.enabled:  # what the round actually cost and emitted, against the plain rounds' rate
            round_seconds = time.perf_counter() - round_start - one_time
            if block is None:
                realized.plain_round(round_seconds, live_rows)
            elif width > 1 and tree is None:
                realized.verifying_round("lookup" if from_lookup else "drafter", round_seconds, emitted)
            elif width > 1:  # a tree round: "tree" when it drafted branches, else the drafter's chain as a tree
                realized.verifying_round(kind, round_seconds, emitted)
        riders.observe_round(time.perf_counter() - round_start - one_time, live_rows, emitted)

    if memory_key is not None:  # what the next call of this kind starts from
        policy_memory.remember(memory_key, LearnedState(backoff, lookup_backoff, realized, clock, choose.calibration,
                                                        choose.lookup_calibration))
    if streamer is not None:
        streamer.end()
    sequences = outputs.sequences()
    if not settings.return_dict_in_generate:
        return sequences
    return DSparkGenerateOutput(sequences=sequences, stats=outputs.stats, num_generated=outputs.num_generated,
                                policy=policy, peak_cache_columns=rows.peak_columns,
                                rounds=records if record_rounds else None)


def _lookup_lengths(choose: LengthPolicy, block: Any, rows: torch.Tensor, lookup_cost: Any) -> torch.Tensor:
    """`[R]` (CPU) lengths of a round that verifies the lookup's drafts alone: the policy's own (priced policies:
    scheduled without the drafter's time; "fixed": the whole block), or with `lookup_cost` (`lookup_max_tokens` with
    "fixed" and `sps`) the best width on the whole curve for the rows' calibrated survival, priced as the padded
    rectangle the round runs (`schedule_width(early_stop=False)`; on one row `schedule_prefix`'s whole-curve search,
    what `set_assist`'s chain runs). The whole-curve search is lossless here: lookup estimates depend on the sequence
    alone, never on a draft the target has not fixed."""
    if lookup_cost is None and choose.name == "fixed":  # the whole block of the lookup's drafts
        return torch.full((len(rows),), block.tokens.shape[1], dtype=torch.long)
    if lookup_cost is None:
        return choose.lengths(block, rows, with_drafter=False).cpu()
    if isinstance(lookup_cost, RowScaledCost):
        lookup_cost.rows = len(rows)
    return schedule_width(choose._conf(block.confidences, lookup_only=True), lookup_cost, early_stop=False).cpu()


def _round_record(ids: torch.Tensor, block: Any, tree: Any, spec: TreeSpec | None, lengths: torch.Tensor,
                  result: Any, lookup_only: bool = False) -> RoundRecord:
    """The round's `RoundRecord`; for tree drafts the chain fields count the chain's nodes (see `RoundRecord`)."""
    confidence_logits = (None if block is None or block.confidence_logits is None or lookup_only
                         else block.confidence_logits.float().cpu())
    if spec is None or block is None or not isinstance(block, DraftTree):
        record = RoundRecord(rows=ids.clone(), lengths=lengths.cpu().clone(),
                             accepted=result.num_accepted.cpu().clone(), confidence_logits=confidence_logits,
                             drafts=None if block is None else block.tokens.cpu().clone(), lookup_only=lookup_only)
        if spec is not None and block is not None:  # a tree round that grew nothing: every verified node is the chain's
            record.tree_verified, record.tree_accepted = record.lengths.clone(), record.accepted.clone()
        return record
    k = block.num_chain
    chain_verified = ((tree.node_ids < k) & tree.valid).sum(dim=1).cpu()
    path = getattr(result, "path", None)
    if path is None:  # no node verified this round
        chain_accepted = torch.zeros_like(chain_verified)
    else:
        on_path = path >= 0
        path_ids = tree.node_ids.to(path.device).gather(1, path.clamp(min=0))
        chain_accepted = (on_path & (path_ids < k)).sum(dim=1).cpu()
    return RoundRecord(rows=ids.clone(), lengths=chain_verified, accepted=chain_accepted,
                       confidence_logits=confidence_logits, drafts=block.tokens[:, :k].cpu().clone(),
                       tree_verified=lengths.cpu().clone(), tree_accepted=result.num_accepted.cpu().clone())


def _rider_share(cost: Any, rows: int, riders: int) -> float | None:
    """The share of a one-token forward of `rows` rows that its `riders` finished rows cost, from the cost curve's
    slope between `rows` and `2 * rows` tokens (profiled sizes: a curve often starts at `rows`); None without one."""
    if cost is None:
        return None
    seconds = 1.0 / sps_values(cost, torch.tensor([rows, 2 * rows]))
    return float(riders * (seconds[1] - seconds[0]) / rows / seconds[0])


def _accepted_nodes(tree: DraftTree, result: Any, shape: torch.Size) -> torch.Tensor:
    """`[R, N]` (CPU) bool over the drafted tree's nodes: those on the accepted path (`result.path` indexes the
    verified subtree `tree`, whose `node_ids` are the drafted tree's indices)."""
    out = torch.zeros(shape, dtype=torch.bool)
    path = result.path.cpu() if result.path is not None else None
    if path is None or path.numel() == 0:
        return out
    on_path = path >= 0
    ids = tree.node_ids.cpu().gather(1, path.clamp(min=0))
    rows = torch.arange(shape[0])[:, None].expand_as(ids)
    out[rows[on_path], ids[on_path]] = True
    return out


def _cap_nodes(tree: DraftTree, admitted: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """`scheduler.cap_tree` on `tree`'s survival estimates (none, without a confidence head: a chain's first nodes)."""
    survival = tree.survival if tree.survival is not None else torch.zeros(admitted.shape)
    return cap_tree(survival, admitted, max_nodes)


def _without_riders(record: RoundRecord, live: torch.Tensor) -> RoundRecord:
    """`record` restricted to the `[R]` (CPU) mask `live`: finished rows riding along are not part of the round."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[live.to(t.device)]
    return RoundRecord(rows=pick(record.rows), confidence_logits=pick(record.confidence_logits),
                       lengths=pick(record.lengths), accepted=pick(record.accepted), drafts=pick(record.drafts),
                       tree_verified=pick(record.tree_verified), tree_accepted=pick(record.tree_accepted),
                       lookup_only=record.lookup_only)


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    streamer: Any = None,
    drafter: DSparkDrafter | None = None,
    policy: str = "scheduled",
    sps: Any = None,
    threshold: float = 0.5,
    generator: torch.Generator | None = None,
    speculate: bool = True,
    tree_budget: int | None = None,
    tree_max_children: int = 4,
    tree_max_nodes: int | None = None,
    lookup: Any = None,
    lookup_max_tokens: int | None = None,
    policy_memory: PolicyMemory | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | DSparkGenerateOutput:
    """The same loop behind `target.generate(**inputs, custom_generate=dspark_hf.speculative_generate,
    drafter=drafter, policy=...)`: sampling settings, `max_new_tokens`, `max_time`, EOS and pad ids come from the
    generation config that generate() prepared, custom stopping criteria (including `stop_strings`) from its list.
    `streamer` (batch size 1) works here too: generate() streams the prompt itself and the generate() hook of
    `import dspark_hf` hands the streamer on (transformers alone drops it for callables; `_dspark_takes_streamer`).
    Pass `sps=dspark_hf.SPSCache()` (or a table) to profile the cost curve once across calls. `tree_budget=N`
    decodes tree drafts (also at batch size 1: the way to get trees through `target.generate`), `tree_max_nodes=K`
    verifies at most K of each tree's nodes, `lookup=` adds n-gram lookup drafts (`lookup_max_tokens=N`: up to N in
    the rounds they are verified alone); `policy_memory=dspark_hf.PolicyMemory()` carries what the policy learned
    from call to call."""
    if drafter is None and speculate:
        raise ValueError("speculative_generate needs drafter=<DSparkDrafter> (pass it to target.generate)")
    if synced_gpus:
        raise NotImplementedError("dspark_hf's batched loop does not keep processes in step (synced_gpus: DeepSpeed "
                                  "ZeRO-3 / FSDP across processes); generate on one process per model copy")
    supported = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
    unsupported = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in supported]
    if unsupported:
        raise NotImplementedError(
            f"dspark_hf's batched loop applies temperature / top-k / top-p only; generate() also asked for "
            f"{unsupported}. Drop those settings, or use batch size 1 through target.generate(assistant_model=...)"
        )
    # max_new_tokens / max_length, max_time and EOS are the generation config's, which the loop honours itself
    builtin = {"MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria"}
    custom = [c for c in (stopping_criteria or []) if type(c).__name__ not in builtin]
    config = GenerationConfig() if generation_config is None else copy.deepcopy(generation_config)
    config.stop_strings = None  # honoured through the StopStringCriteria that generate() built (in `custom`)
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name in _PREPARED_MODEL_KWARGS:
        model_kwargs.pop(name, None)
    # what is left (use_cache, output_attentions, ...) are GenerationConfig settings, checked like any other
    return generate(
        model, drafter, input_ids, attention_mask, generation_config=config, policy=policy, sps=sps,
        threshold=threshold, stopping_criteria=StoppingCriteriaList(custom) if custom else None,
        streamer=None if streamer is None else _PromptAlreadyStreamed(streamer), generator=generator,
        speculate=speculate, tree_budget=tree_budget, tree_max_children=tree_max_children,
        tree_max_nodes=tree_max_nodes, lookup=lookup, lookup_max_tokens=lookup_max_tokens,
        policy_memory=policy_memory, **model_kwargs,
    )


speculative_generate._dspark_takes_streamer = True  # type: ignore[attr-defined]  (see candidate_generator)


class _PromptAlreadyStreamed:
    """The streamer of a `generate(custom_generate=speculative_generate)` call, which has put the prompt already:
    drops the loop's own first `put` (the prompt), forwards the rest."""

    def __init__(self, streamer: Any) -> None:
        self.streamer, self.prompt_pending = streamer, True

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_pending:
            self.prompt_pending = False
            return
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()
