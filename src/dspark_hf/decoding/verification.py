"""Lossless verification of draft blocks: pure tensor math, no model calls (paper section 2.1).

* `warp_logits`: temperature, top-k and top-p exactly as transformers' `TemperatureLogitsWarper`,
  `TopKLogitsWarper` and `TopPLogitsWarper` apply them (ties at the k-th value kept; top-p keeps at least one token).
  Apply it identically to the target's and the drafter's logits.
* `greedy_verify`: accept drafts while they equal the target's argmax; the first mismatch (or the bonus token after an
  all-accepted block) is the target's argmax, so the output equals the target's own greedy output.
* `rejection_verify`: accept x_k with probability min(1, p_t(x_k) / p_d(x_k)); at the first rejection sample from
  normalize(max(p_t - p_d, 0)) (p_t if that mass is 0); after an all-accepted block sample the bonus token from p_t.
  The emitted tokens are distributed exactly as the target's own samples (Leviathan et al., 2023).

Every function takes a batch in which each row verifies its own number of drafts `num_drafts[b] <= K`; slots past it
are ignored. The accepted count `num_accepted` excludes the correction/bonus token; `num_new = num_accepted + 1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "VerificationResult", "greedy_verify", "rejection_verify", "verify", "warp_logits"]


@dataclass
class SamplingParams:
    """Sampling settings applied identically to target and draft logits. `do_sample=False` means greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (identity for greedy decoding)."""
        if not self.do_sample:
            return logits.float()
        return warp_logits(logits, self.temperature, self.top_k, self.top_p)


@dataclass
class VerificationResult:
    """Outcome of verifying one block per row.

    Attributes:
        num_accepted: `[B]` drafts accepted (0..num_drafts[b]).
        next_tokens: `[B]` the token emitted after the accepted drafts (correction or bonus).
        tokens: `[B, K + 1]` accepted drafts followed by `next_tokens`, padded with `pad_token_id` after `num_new`.
    """

    num_accepted: torch.LongTensor
    next_tokens: torch.LongTensor
    tokens: torch.LongTensor

    @property
    def num_new(self) -> torch.LongTensor:
        """`[B]` tokens emitted this round (accepted drafts + 1); the paper's accepted length tau."""
        return self.num_accepted + 1


def warp_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p over the last dimension; filtered entries become -inf. Float32 out."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def _valid_slots(num_drafts: torch.Tensor | None, batch: int, k: int, device: torch.device) -> torch.Tensor:
    """`[B, K]` bool, True for slots each row actually verifies."""
    if num_drafts is None:
        return torch.ones(batch, k, dtype=torch.bool, device=device)
    num_drafts = num_drafts.to(device)
    if (num_drafts < 0).any() or (num_drafts > k).any():
        raise ValueError(f"num_drafts must lie in [0, {k}], got {num_drafts.tolist()}")
    return torch.arange(k, device=device)[None, :] < num_drafts[:, None]


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_tokens: torch.Tensor, pad: int) -> VerificationResult:
    b, k = draft_tokens.shape
    slots = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), pad)], dim=1)
    tokens = torch.where(slots < num_accepted[:, None], padded, torch.full_like(padded, pad))
    tokens = tokens.scatter(1, num_accepted[:, None], next_tokens[:, None])
    return VerificationResult(num_accepted=num_accepted, next_tokens=next_tokens, tokens=tokens)


def greedy_verify(
    draft_tokens: torch.LongTensor,
    target_logits: torch.Tensor,
    num_drafts: torch.LongTensor | None = None,
    pad_token_id: int = 0,
) -> VerificationResult:
    """Greedy verification.

    Args:
        draft_tokens: `[B, K]` drafts.
        target_logits: `[B, K + 1, V]` target logits at the anchor and after each draft (any processing that does
            not change the argmax may be applied or not).
        num_drafts: `[B]` drafts each row verifies (default K).
    """
    b, k = draft_tokens.shape
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    valid = _valid_slots(num_drafts, b, k, draft_tokens.device)
    match = (draft_tokens == target_ids[:, :k]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # leading matches
    next_tokens = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return _assemble(draft_tokens, num_accepted, next_tokens, pad_token_id)


def rejection_verify(
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_drafts: torch.LongTensor | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int = 0,
) -> VerificationResult:
    """Lossless speculative sampling with a ragged number of drafts per row.

    Args:
        draft_tokens: `[B, K]` drafts, x_k drawn from `draft_probs[:, k]`.
        draft_probs: `[B, K, V]` the exact draft distributions (after the same processing as the target's).
        target_probs: `[B, K + 1, V]` target distributions at the anchor and after each draft.
        num_drafts: `[B]` drafts each row verifies (default K).
        generator: RNG for the acceptance tests and the residual / bonus samples.
    """
    b, k = draft_tokens.shape
    device = draft_tokens.device
    valid = _valid_slots(num_drafts, b, k, device)
    draft_probs = draft_probs.float()
    target_probs = target_probs.float()
    p_target = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    p_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    u = torch.rand(b, k, device=device, generator=generator)
    accept = (u * p_draft <= p_target) & valid  # u <= p_t / p_d without dividing by p_d
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(b, device=device)
    target_next = target_probs[rows, num_accepted]  # [B, V]
    verified = num_drafts.to(device) if num_drafts is not None else torch.full_like(num_accepted, k)
    rejected = num_accepted < verified
    draft_next = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k > 0 else torch.zeros_like(target_next)
    residual = (target_next - draft_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), target_next)
    next_dist = torch.where(rejected[:, None], residual, target_next)
    next_tokens = torch.multinomial(next_dist, 1, generator=generator).squeeze(1)
    return _assemble(draft_tokens, num_accepted, next_tokens, pad_token_id)


def verify(
    draft_tokens: torch.LongTensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    num_drafts: torch.LongTensor | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int = 0,
) -> VerificationResult:
    """Greedy or rejection verification from raw target logits `[B, K + 1, V]` and processed draft logits.

    With no drafts (K = 0, a plain decoding step) this is the target's own token, argmax or one sample from its
    processed distribution: the same token (and the same draws from `generator`) as the general rules, without
    their work over the vocabulary."""
    if draft_tokens.shape[1] == 0:
        scores = target_logits[:, 0]
        if sampling.do_sample:
            next_tokens = torch.multinomial(torch.softmax(sampling.warp(scores), dim=-1), 1,
                                            generator=generator).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        return VerificationResult(num_accepted=torch.zeros_like(next_tokens), next_tokens=next_tokens,
                                  tokens=next_tokens[:, None])
    if not sampling.do_sample:
        return greedy_verify(draft_tokens, target_logits, num_drafts, pad_token_id)
    target_probs = torch.softmax(sampling.warp(target_logits), dim=-1)
    draft_probs = torch.softmax(draft_logits.float(), dim=-1)
    return rejection_verify(draft_tokens, draft_probs, target_probs, num_drafts, generator, pad_token_id)
