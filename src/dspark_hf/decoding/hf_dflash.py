"""Run a DFlash-variant DSpark drafter through transformers' *built-in* DFlash speculative path.

Transformers ships `target.generate(..., assistant_model=M, speculation_type="dflash")`, driven by
`transformers.generation.candidate_generator.DFlashTokenCandidateGenerator`. Each round that generator calls::

    outputs = M(noise_embeds=..., context_hidden_states=..., position_ids=..., attention_mask=..., cache=DFlashCache)
    drafts  = target_lm_head(outputs.last_hidden_state[:, 1:]).argmax(-1)      # block_size - 1 drafts

where `noise_embeds` are the target's embeddings of `[anchor, mask_token_id x (block_size - 1)]`,
`context_hidden_states` are the target layer outputs `hidden_states[i + 1]` (i in `target_layer_ids`, concatenated on
the last axis) of the tokens the target verified since the previous call (the whole prompt on the first call),
`position_ids` are the true positions of those context rows followed by the `block_size` noise positions, and
`attention_mask` covers *all* context so far plus the noise block (or is `None` when the prompt has no padding).

HF's layout has slot k (k >= 1) predict anchor + k; ours (DSpark layout) has slot k (k >= 0) predict anchor + k + 1, so
copying weights into `MuseGlimmerAssistantModel` would misalign every slot. `DFlashAdapter` instead wraps the drafter
itself and speaks HF's calling convention:

* its config exposes `block_size = K + 1` (K = the drafter's block size), `mask_token_id` and `target_layer_ids`, so
  HF's generator asks for K drafts per round and the right target layers;
* it keeps its own `DSparkContextCache` across calls: every call appends the newly verified context rows at their
  true positions (from `position_ids`, validity from `attention_mask`); HF's `DFlashCache` is passed through untouched
  (it stays empty, so HF's per-round `crop` is a no-op). A new `DFlashCache` object means a new `generate()` call and
  resets the adapter's cache;
* it builds our block in the drafter's own layout (`drafter.block_states`: `[anchor embedding, mask x (K - 1)]`,
  or `[anchor, mask x K]` for a "dflash"-layout drafter such as a converted z-lab checkpoint) from
  `noise_embeds[:, :1]` (exactly `drafter.block_embeddings(anchor)`: HF bypasses an embedding's optional
  `embed_norm`, which is re-applied here) and
  runs our backbone, returning `last_hidden_state` `[1, K + 1, d]` whose rows `1..K` are the drafter's final normed
  states of its K draft slots (`drafter.draft_slots`). The target's LM head turns them into exactly our base draft
  logits; row 0 is a zero placeholder HF ignores.

Only sequential-head-free ("DFlash-variant", `sequential_head="none"`) drafters apply: HF drafts every slot
independently by argmax / sampling of `lm_head(h_k)` and cannot run a Markov / RNN head. A confidence head, if any, is
ignored (HF verifies a fixed block).

Entry points: `dflash_adapter(drafter, target)` and `hf_dflash_generate(target, drafter, input_ids, **gen_kwargs)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..models.drafting import DSparkContextCache
from ..models.modeling_dspark import DSparkDrafter

__all__ = ["DFlashAdapter", "DFlashAdapterConfig", "HFDFlashStats", "dflash_adapter", "hf_dflash_generate"]


@strict
class DFlashAdapterConfig(PreTrainedConfig):
    r"""What HF's `DFlashTokenCandidateGenerator` reads from its assistant's config.

    Args:
        block_size: HF's window = anchor + drafts, i.e. the wrapped drafter's `block_size + 1`.
        mask_token_id: id HF embeds into the noise slots. The adapter never reads those embeddings (it builds our own
            mask rows), but HF needs a valid id: the drafter's `mask_token_id`, or a placeholder (0) when the drafter
            uses a learned mask vector.
        target_layer_ids: target decoder layers whose outputs form the context (the drafter's).
        hidden_size: the drafter's (= the target's) hidden size.
        num_hidden_layers: 0: HF's `DFlashCache` is built from this config and must hold no layers of its own (the
            adapter keeps its keys / values in a `DSparkContextCache`).
    """

    model_type = "dspark_dflash_adapter"

    block_size: int = 8
    mask_token_id: int = 0
    target_layer_ids: list[int] | None = None
    hidden_size: int = 0
    num_hidden_layers: int = 0

    def __post_init__(self, **kwargs: Any) -> None:
        if self.target_layer_ids is None:
            self.target_layer_ids = []
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"DFlashAdapterConfig.block_size must be an integer >= 2, got {self.block_size!r}.")


@dataclass
class HFDFlashStats:
    """Statistics of one `hf_dflash_generate` call, comparable to `dspark_hf.RowStats` of `dspark_hf.generate`.

    Attributes:
        accepted_lengths: tokens emitted in each verification round (accepted drafts + the target's own token); the
            first token, produced by the prefill forward, belongs to no round (as in `dspark_hf.generate`).
        proposed: drafts sent to the target in each round (K, or 0 for HF's final draft-free round when a single token
            of budget is left).
        target_forwards: target forward passes, prefill included (= rounds + 1).
    """

    accepted_lengths: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    target_forwards: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """tau: mean tokens emitted per verification round, bonus token included."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


class DFlashAdapter(PreTrainedModel):
    """A `DSparkDrafter` (no sequential head) behind the calling convention of HF's built-in DFlash generator.

    Use `dflash_adapter(drafter, target)` to build one, then
    `target.generate(**inputs, assistant_model=adapter, speculation_type="dflash", do_sample=False)`, or simply
    `hf_dflash_generate(target, drafter, input_ids)`. Batch size 1 only (HF's assisted decoding is batch 1).

    The wrapped drafter is a submodule (`adapter.drafter`); the adapter adds no weights and is a runtime wrapper only:
    save and load the drafter itself.
    """

    config_class = DFlashAdapterConfig
    base_model_prefix = "dflash_adapter"
    main_input_name = "noise_embeds"
    _supports_sdpa = True

    def __init__(self, config: DFlashAdapterConfig, drafter: DSparkDrafter) -> None:
        super().__init__(config)
        # post_init() runs before the drafter is attached so that weight initialisation never touches its weights.
        self.post_init()
        self.drafter = drafter
        self.context_cache: DSparkContextCache = drafter.new_cache()
        self._hf_cache: Any = None
        #: Context rows appended by each call since the last reset (prompt rows first, then anchor + accepted drafts
        #: of every round): `context_rows[i + 1] - 1` drafts were accepted in the round drafted by call i.
        self.context_rows: list[int] = []

    def _init_weights(self, module: torch.nn.Module) -> None:  # the adapter owns no weights
        return

    def reset(self) -> None:
        """Forgets all context (a new sequence starts). Done automatically when HF passes a new `DFlashCache`."""
        self.context_cache = self.drafter.new_cache()
        self._hf_cache = None
        self.context_rows = []

    def _anchor_embedding(self, noise_embeds: torch.Tensor) -> torch.Tensor:
        """`[B, 1, d]` the anchor row of our block, from HF's first noise embedding.

        HF embeds with the target's input embedding but bypasses an optional `embed_norm` (see
        `DFlashTokenCandidateGenerator._get_noise_embeds`); our `embed_tokens` does not bypass it, so it is applied
        here, which makes the row equal to `drafter.block_embeddings(anchor)[:, 0]`.
        """
        anchor = noise_embeds[:, :1]
        embed, _ = self.drafter._require_bound()
        embed_norm = getattr(embed, "embed_norm", None)
        if embed_norm is not None and not isinstance(embed_norm, torch.nn.Identity):
            anchor = embed_norm(anchor)
        return anchor.to(self.drafter.dtype)

    @torch.no_grad()
    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """One HF DFlash round: append the new context rows, draft one block from the anchor.

        Args:
            noise_embeds: `[1, K + 1, d]` target embeddings of `[anchor, mask_token_id x K]`; only the anchor row is
                read.
            context_hidden_states: `[1, N, m*d]` concatenated target layer outputs of the N tokens verified since the
                previous call (the prompt on the first call); N may be 0 / `None`.
            position_ids: `[1, N + K + 1]` true positions of those rows, then of the anchor and the K mask slots.
            attention_mask: `[1, T_all + K + 1]` over all context so far plus the block (0 = padding), or `None`.
            cache: HF's `DFlashCache`; left untouched. Its identity marks the generate() call: a new object resets
                the adapter's own context cache.
        Returns:
            `BaseModelOutputWithPast` with `last_hidden_state` `[1, K + 1, d]`: row 0 a zero placeholder, rows 1..K
            the drafter's final normed slot states (slot k predicts anchor position + k + 1).
        """
        drafter = self.drafter
        k = drafter.config.block_size
        width = k + 1
        if noise_embeds.dim() != 3 or noise_embeds.shape[1] != width:
            raise ValueError(f"noise_embeds must be [batch, {width}, hidden] (anchor + {k} mask slots), "
                             f"got {tuple(noise_embeds.shape)}")
        b = noise_embeds.shape[0]
        if b != 1:
            raise ValueError(f"DFlashAdapter supports batch size 1 only (HF's DFlash path is batch 1), got {b}")
        if position_ids is None or position_ids.dim() != 2:
            raise ValueError("DFlashAdapter needs 2-D position_ids [1, N + block_size] (context rows, then the block)")
        if cache is not None and cache is not self._hf_cache:
            self.reset()
            self._hf_cache = cache
        device = drafter.device
        position_ids = position_ids.to(device)
        num_rows = 0 if context_hidden_states is None else int(context_hidden_states.shape[1])
        if position_ids.shape[1] != num_rows + width:
            raise ValueError(f"position_ids has {position_ids.shape[1]} columns, expected {num_rows} context rows + "
                             f"{width} block slots")

        if num_rows > 0:
            positions = position_ids[:, :num_rows]
            if attention_mask is not None:
                valid = attention_mask[:, attention_mask.shape[1] - width - num_rows: attention_mask.shape[1] - width]
                valid = valid.to(device).bool()
            else:
                valid = torch.ones(b, num_rows, dtype=torch.bool, device=device)
            expected = self.context_cache.next_position
            if expected is not None:
                first = positions[valid][:1]
                if first.numel() and int(first) != int(expected[0]):
                    raise RuntimeError(
                        f"DFlashAdapter: new context rows start at position {int(first)} but the adapter's cache ends "
                        f"at {int(expected[0])}; call adapter.reset() before starting a new sequence"
                    )
            drafter.append_context(self.context_cache, context_hidden_states.to(device), positions, valid)
            self.context_rows.append(num_rows)
        if self.context_cache.valid is None:
            raise ValueError("DFlashAdapter: no context yet; the first call must carry the prompt's context rows")

        anchor_positions = position_ids[:, num_rows]  # [B]
        # Our block (in the drafter's own layout): the mask rows exactly as `block_embeddings` builds them, the anchor
        # row from HF's embedding; then the K rows that predict drafts.
        anchor = self._anchor_embedding(noise_embeds.to(device))[:, 0]
        hidden = drafter.draft_slots(drafter.block_states(
            self.context_cache, torch.zeros(b, dtype=torch.long, device=device), anchor_positions,
            anchor_embeddings=anchor))  # [B, K, d]
        _, head = drafter._require_bound()
        hidden = hidden.to(head.weight.dtype)  # what `drafter.lm_head` feeds the head
        last = torch.cat([torch.zeros_like(hidden[:, :1]), hidden], dim=1)
        return BaseModelOutputWithPast(last_hidden_state=last)


def dflash_adapter(drafter: DSparkDrafter, target: PreTrainedModel) -> DFlashAdapter:
    """Wraps a DFlash-variant `DSparkDrafter` for `target.generate(..., speculation_type="dflash")`.

    Binds the drafter to `target` (fingerprint checked).

    Raises:
        TypeError: `drafter` is not a `DSparkDrafter`.
        ValueError: the drafter has a sequential head (Markov / gated Markov / RNN), which HF's built-in DFlash path
            cannot apply: it drafts each slot independently from `lm_head(h_k)`. Only DFlash-variant weights
            (`sequential_head="none"`) apply.
    """
    if not isinstance(drafter, DSparkDrafter):
        raise TypeError(f"dflash_adapter needs a DSparkDrafter, got {type(drafter).__name__}")
    head = drafter.config.sequential_head
    if head != "none" or drafter.markov_head is not None:
        raise ValueError(
            f"this drafter has a sequential head (sequential_head={head!r}); transformers' built-in DFlash path "
            f"drafts every slot independently from the LM head and cannot apply the Markov/RNN head, so only "
            f"DFlash-variant weights (sequential_head='none') apply. Use dspark_hf.generate or "
            f"target.generate(assistant_model=drafter) for this drafter."
        )
    if drafter.config.draft_vocab_size is not None:
        raise ValueError(
            f"this drafter proposes a reduced draft vocabulary (draft_vocab_size={drafter.config.draft_vocab_size}); "
            "transformers' built-in DFlash path drafts from the target's full LM head and cannot restrict it. Use "
            "dspark_hf.generate or target.generate(assistant_model=drafter) for this drafter."
        )
    drafter.bind_target(target)
    mask_id = drafter.config.mask_token_id
    config = DFlashAdapterConfig(
        block_size=drafter.config.block_size + 1,
        mask_token_id=int(mask_id) if mask_id is not None else 0,
        target_layer_ids=list(drafter.config.target_layer_ids),
        hidden_size=drafter.config.hidden_size,
        num_hidden_layers=0,
    )
    return DFlashAdapter(config, drafter).eval()


def hf_dflash_generate(
    target: PreTrainedModel,
    drafter: DSparkDrafter | DFlashAdapter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    return_stats: bool = False,
    **gen_kwargs: Any,
) -> Any:
    """`target.generate(input_ids, assistant_model=<adapter>, speculation_type="dflash", **gen_kwargs)`.

    Args:
        target: the causal LM the drafter was trained for.
        drafter: a DFlash-variant `DSparkDrafter` (wrapped here) or an existing `DFlashAdapter` (reused).
        input_ids, attention_mask: `[1, L]` prompt (HF's DFlash path is batch size 1).
        return_stats: also return an `HFDFlashStats` (per-round emitted tokens, tau, target forwards).
        **gen_kwargs: passed to `generate` (e.g. `max_new_tokens`, `do_sample=False`). Greedy by default.
    Returns:
        whatever `target.generate` returns, or `(that, HFDFlashStats)` with `return_stats=True`.
    """
    adapter = drafter if isinstance(drafter, DFlashAdapter) else dflash_adapter(drafter, target)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"hf_dflash_generate supports batch size 1 only (got input_ids {tuple(input_ids.shape)}); "
                         f"for batches use dspark_hf.generate")
    for key in ("assistant_model", "speculation_type"):
        if key in gen_kwargs:
            raise ValueError(f"hf_dflash_generate sets {key} itself")
    gen_kwargs.setdefault("do_sample", False)
    if attention_mask is not None:
        gen_kwargs["attention_mask"] = attention_mask
    proposed: list[int] = []

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        proposed.append(0 if ids is None else int(ids.shape[1]) - 1)

    handle = target.register_forward_pre_hook(count, with_kwargs=True)
    adapter.reset()
    try:
        out = target.generate(input_ids, assistant_model=adapter, speculation_type="dflash", **gen_kwargs)
    finally:
        handle.remove()
    if not return_stats:
        return out
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    stats = HFDFlashStats(proposed=proposed[1:], target_forwards=len(proposed))
    rounds = len(proposed) - 1
    # Call i + 1 of the adapter appends the anchor + accepted drafts of round i; the last round(s) are not reported
    # back to the adapter, so they are recovered from the number of generated tokens.
    emitted = adapter.context_rows[1:rounds + 1]
    remaining = int(sequences.shape[1] - input_ids.shape[1]) - 1 - sum(emitted)
    tail = rounds - len(emitted)
    if tail == 1:
        emitted.append(remaining)
    elif tail == 2:  # a drafted round, then HF's draft-free last round (a single token of budget left)
        emitted.extend([remaining - 1, 1])
    stats.accepted_lengths = emitted
    return out, stats
