"""Sequential heads and the confidence head of a DSpark drafter (paper section 3.1, 3.2.1).

The parallel backbone produces hidden states h_k and base logits U_k for every block slot at once. A sequential head
adds a prefix-dependent bias B_k to U_k, computed left to right from the previously chosen token x_{k-1} (x_{-1} is the
anchor), so that drafts inside one block depend on each other:

* `MarkovHead`:       B_k = W2(W1[x_{k-1}])                                 (low-rank V x V transition)
* `GatedMarkovHead`:  B_k = W2(sigmoid(G([h_k; W1[x_{k-1}]])) * W1[x_{k-1}])
* `RNNHead`:          g, c, o = split(L([s_{k-1}; W1[x_{k-1}]; h_k])); s_k = g s_{k-1} + (1 - g) tanh(c);
                      B_k = W2(tanh(o)), with g = sigmoid(.) and s_0 = 0.

Every head exposes the same entry points:

* `step(prev_token_ids [B], hidden [B, d], state) -> (latent [B, r], features [B, r], state)` for sampling,
* `project(latent, candidates=None)`: the bias W2(latent), over the full vocabulary `[B, V]` or, given candidate ids
  `[B, M]`, only over them `[B, M]` (reads M rows of W2 instead of all V: what keeps the loop light on a CPU), and
* `teacher_forced(prev_token_ids [B, K], hidden [B, K, d]) -> (bias [B, K, V], features [B, K, r])` for training
  (the previous tokens are [anchor, ground truth ...]); identical biases for identical prefixes.

With a reduced draft vocabulary (`DSparkConfig.draft_vocab_size` = Vd) the heads live in it: W2 is r x Vd (the bias
covers the draft ids only) and W1 has `num_inputs` = Vd + 1 rows indexed by the *draft* id of the previous token, the
last row standing for any previous token outside the draft vocabulary (only the anchor can be one at inference; the
drafter maps target ids to these rows, see `DSparkDrafter.to_draft_inputs`). With the full vocabulary W1 has V rows.

`features` is W1[x_{k-1}], which the confidence head c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b) also reads. Parameter
names follow deepseek-ai/DeepSpec (`markov_w1`, `markov_w2`, `gate_proj`, `confidence_head.proj`) so its checkpoints map
onto ours. Imports nothing from `dspark_hf` (copied next to checkpoints for trust_remote_code loading).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConfidenceHead", "GatedMarkovHead", "MarkovHead", "RNNHead", "build_sequential_head"]


class _LowRankBias(nn.Module):
    """Shared W2 projection of a rank-r latent to vocabulary logits."""

    markov_w2: nn.Linear

    def project(self, latent: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """latent `[B, r]` -> bias `[B, V]`, or `[B, M]` restricted to `candidates` `[B, M]`."""
        if candidates is None:
            return self.markov_w2(latent)
        return self.project_rows(latent, self.candidate_rows(candidates))

    def candidate_rows(self, candidates: torch.Tensor) -> torch.Tensor:
        """The W2 rows of candidate ids `[..., M]` -> `[..., M, r]` (gathered once per block, outside the loop)."""
        return self.markov_w2.weight[candidates]

    @staticmethod
    def project_rows(latent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """latent `[B, r]`, rows `[B, M, r]` -> bias `[B, M]`."""
        return torch.bmm(rows, latent.to(rows.dtype)[:, :, None]).squeeze(-1)


class MarkovHead(_LowRankBias):
    """First-order low-rank transition bias B(x_{k-1}, .) = W2 W1[x_{k-1}]."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, num_inputs: int | None = None) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(num_inputs or vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Any:
        return None

    def _latent(self, features: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return features

    def step(
        self, prev_token_ids: torch.Tensor, hidden: torch.Tensor, state: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        features = self.markov_w1(prev_token_ids)  # [B, r]
        return self._latent(features, hidden), features, state

    def teacher_forced(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.markov_w1(prev_token_ids)  # [B, K, r]
        if type(self)._latent is not MarkovHead._latent:  # the latent reads h_k (gated): one bias per slot
            return self.markov_w2(self._latent(features, hidden)), features
        # The plain Markov bias depends on the previous token only, and a training batch repeats few of them (about
        # 160 distinct ids in 1,792 SmolLM2 slots: overlapping blocks): the r x V product runs once per distinct id
        # and is gathered, 2.4x cheaper forward and backward, the same values (the gradient up to summation order).
        distinct, inverse = torch.unique(prev_token_ids, return_inverse=True)
        return F.embedding(inverse, self.markov_w2(self.markov_w1(distinct))), features


class GatedMarkovHead(MarkovHead):
    """Markov head whose transition embedding is gated by the backbone hidden state (DeepSpec's "gated" variant)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, num_inputs: int | None = None) -> None:
        super().__init__(vocab_size, rank, hidden_size, num_inputs)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def _latent(self, features: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, features.to(hidden.dtype)], dim=-1)))
        return gate.to(features.dtype) * features


class RNNHead(_LowRankBias):
    """Gated recurrent head: the state accumulates the whole in-block prefix (paper section 3.1)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, num_inputs: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(num_inputs or vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.rnn_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch_size, self.rank, device=device, dtype=dtype)

    def _cell(self, state: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (new state, latent tanh(o)), both `[B, r]`."""
        gate, candidate, output = self.rnn_proj(torch.cat([state, features, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return state, torch.tanh(output)

    def step(
        self, prev_token_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.markov_w1(prev_token_ids).to(hidden.dtype)  # [B, r]
        state, latent = self._cell(state, features, hidden)
        return latent, features, state

    def teacher_forced(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.markov_w1(prev_token_ids).to(hidden.dtype)  # [B, K, r]
        state = self.init_state(hidden.shape[0], hidden.device, hidden.dtype)
        latents = []
        for k in range(hidden.shape[1]):  # K is the block size (<= 16): a short loop of tiny matmuls
            state, latent = self._cell(state, features[:, k], hidden[:, k])
            latents.append(latent)
        return self.markov_w2(torch.stack(latents, dim=1)), features


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])): survival probability of draft k given that drafts < k survived.

    With `uses_features=False` (no sequential head, or DeepSpec's `confidence_head_with_markov: false`) it reads h_k
    only and ignores the `features` it is given."""

    def __init__(self, input_dim: int, uses_features: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)
        self.uses_features = uses_features

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None or not self.uses_features:
            x = hidden
        else:
            x = torch.cat([hidden, features.to(hidden.dtype)], dim=-1)
        return self.proj(x).squeeze(-1)  # confidence *logit*


SEQUENTIAL_HEAD_CLASSES: dict[str, type[nn.Module]] = {
    "markov": MarkovHead,
    "gated_markov": GatedMarkovHead,
    "rnn": RNNHead,
}


def build_sequential_head(
    kind: str, vocab_size: int, rank: int, hidden_size: int, num_inputs: int | None = None
) -> nn.Module | None:
    """Returns the head for `kind`, or `None` for "none" (the DFlash baseline).

    `vocab_size`: the ids the bias covers (W2 rows); `num_inputs`: W1 rows (default `vocab_size`)."""
    if kind == "none":
        return None
    try:
        cls = SEQUENTIAL_HEAD_CLASSES[kind]
    except KeyError as err:
        raise ValueError(f"unknown sequential_head {kind!r}; choose one of {sorted(SEQUENTIAL_HEAD_CLASSES)} or 'none'") from err
    return cls(vocab_size, rank, hidden_size, num_inputs)
