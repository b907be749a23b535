"""Data passed between drafting and verification: the drafter's context cache and the draft block.

`DSparkContextCache` holds, per draft layer, the keys and values of the *context rows* (target hidden states projected
by `fc` + RMSNorm, then by that layer's k/v projections, RoPE at the rows' true positions). Block rows are recomputed
every round and never cached. Rows are appended right-padded per batch row: a row that verified fewer tokens than
another leaves masked *holes* (`valid == False`), which attention ignores; `compact()` removes columns that are holes
in every row. Positions are tracked per row, so holes never shift RoPE.

`DraftBlock` is what one drafting round returns; `SparseLogits` the draft distribution of a drafter restricted to a
few ids per slot, kept compact until someone reads the full-vocabulary logits. Imports nothing from `dspark_hf`
(trust_remote_code copies it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DSparkContextCache", "DraftBlock", "SparseLogits", "valid_first_order"]


def valid_first_order(valid: torch.Tensor) -> torch.Tensor:
    """For a `[B, T]` validity mask: per row, the column order that puts valid columns first (in their order),
    cut to the widest row's number of valid columns. Gathering keys, values, masks and positions with it compacts a
    cache that has holes, exactly (attention over context rows is permutation-invariant given their positions)."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return order[:, : int(valid.sum(dim=1).max())]


@dataclass
class SparseLogits:
    """Logits that are -inf outside a few target ids per slot: what a drafter restricted to candidates or to a reduced
    draft vocabulary produces. `dense()` is the full-vocabulary tensor it stands for.

    Attributes:
        values: `[B, K, M]` float32 logits of the ids that can be drawn.
        ids: `[B, K, M]` their target ids (distinct within a slot).
        vocab_size: V, the full vocabulary.
    """

    values: torch.Tensor
    ids: torch.LongTensor
    vocab_size: int

    def dense(self) -> torch.Tensor:
        """`[B, K, V]` float32: `values` at `ids`, -inf (probability zero) everywhere else."""
        b, k, _ = self.values.shape
        full = self.values.new_full((b, k, self.vocab_size), float("-inf"), dtype=torch.float32)
        return full.scatter(2, self.ids, self.values.float())

    def truncate(self, num_tokens: int) -> "SparseLogits":
        return SparseLogits(self.values[:, :num_tokens], self.ids[:, :num_tokens], self.vocab_size)


@dataclass(init=False)
class DraftBlock:
    """One round of drafts for a batch.

    Attributes:
        tokens: `[B, K]` draft tokens x_1..x_K (slot k predicts anchor position + k + 1).
        logits: `[B, K, V]` float32 logits of the exact distribution each draft was drawn from (Markov-corrected, after
            the same logits processing as the target side: temperature / top-k / top-p). Greedy drafts are their argmax.
            Given as `sparse_logits` instead, the `[B, K, V]` tensor is built on first access only (greedy
            verification compares tokens and never reads it; at batch 64 and V = 49,152 it is 88 MB per round).
        confidences: `[B, K]` c_k in (0, 1), STS temperatures applied, or `None` without a confidence head.
        confidence_logits: `[B, K]` raw confidence logits before STS (what calibration fits), or `None`.
        sparse_logits: the same distribution as `SparseLogits` (values at a few ids per slot), or `None`.
    """

    tokens: torch.LongTensor
    confidences: torch.Tensor | None
    confidence_logits: torch.Tensor | None
    sparse_logits: SparseLogits | None

    def __init__(
        self,
        tokens: torch.LongTensor,
        logits: torch.Tensor | None = None,
        confidences: torch.Tensor | None = None,
        confidence_logits: torch.Tensor | None = None,
        sparse_logits: SparseLogits | None = None,
    ) -> None:
        if (logits is None) == (sparse_logits is None):
            raise ValueError("a DraftBlock takes exactly one of logits [B, K, V] and sparse_logits")
        self.tokens, self.confidences, self.confidence_logits = tokens, confidences, confidence_logits
        self.sparse_logits = sparse_logits
        self._logits = logits

    @property
    def logits(self) -> torch.Tensor:
        """`[B, K, V]` float32 draft logits (built once from `sparse_logits` when given that way)."""
        if self._logits is None:
            self._logits = self.sparse_logits.dense()
        return self._logits

    @property
    def probs(self) -> torch.Tensor:
        """`[B, K, V]` draft probabilities (float32)."""
        return torch.softmax(self.logits.float(), dim=-1)

    @property
    def survival(self) -> torch.Tensor | None:
        """`[B, K]` prefix survival a_j = prod_{i<=j} c_i, or `None` without confidences."""
        return None if self.confidences is None else torch.cumprod(self.confidences.float(), dim=-1)

    def truncate(self, num_tokens: int) -> "DraftBlock":
        """The first `num_tokens` drafts of every row."""
        dense = self._logits is not None
        return DraftBlock(
            tokens=self.tokens[:, :num_tokens],
            logits=self._logits[:, :num_tokens] if dense else None,
            confidences=None if self.confidences is None else self.confidences[:, :num_tokens],
            confidence_logits=None if self.confidence_logits is None else self.confidence_logits[:, :num_tokens],
            sparse_logits=None if dense else self.sparse_logits.truncate(num_tokens),
        )


@dataclass
class DSparkContextCache:
    """Keys / values of the context rows for every draft layer, with per-row validity and positions.

    Attributes:
        keys, values: one `[B, H_kv, T, D]` tensor per draft layer (empty list before the first append).
        valid: `[B, T]` bool, False for holes and padding.
        positions: `[B, T]` long, the true position of every row (meaningless where not valid).
        next_position: `[B]` long, position of the next context row of each batch row (= its anchor's position).
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    valid: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    next_position: torch.Tensor | None = None

    @property
    def num_columns(self) -> int:
        """T: allocated context columns, holes included."""
        return 0 if self.valid is None else int(self.valid.shape[1])

    @property
    def num_holes(self) -> int:
        """Columns that are masked in some row (holes and padding)."""
        return 0 if self.valid is None else int((~self.valid).sum())

    def append(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Appends `N` columns: per-layer `[B, H_kv, N, D]` keys/values, `valid` and `positions` `[B, N]`."""
        if self.valid is None:
            self.keys, self.values = list(keys), list(values)
            self.valid, self.positions = valid.clone(), positions.clone()
        else:
            if valid.shape[0] != self.valid.shape[0]:
                raise ValueError(
                    f"context batch size changed from {self.valid.shape[0]} to {valid.shape[0]}; "
                    "use select_rows() to drop finished rows"
                )
            self.keys = [torch.cat([a, b], dim=2) for a, b in zip(self.keys, keys)]
            self.values = [torch.cat([a, b], dim=2) for a, b in zip(self.values, values)]
            self.valid = torch.cat([self.valid, valid], dim=1)
            self.positions = torch.cat([self.positions, positions], dim=1)
        counts_end = torch.where(valid, positions + 1, torch.zeros_like(positions)).amax(dim=1)
        if self.next_position is None:
            self.next_position = counts_end
        else:
            self.next_position = torch.maximum(self.next_position, counts_end)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keeps only batch rows `index` (e.g. to drop finished requests)."""
        if self.valid is None:
            return
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.valid = self.valid.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)

    def compact(self) -> None:
        """Moves every row's valid columns to the front and drops columns that are then empty in all rows.

        Exact: attention over the context is permutation-invariant given the positions baked into the keys.
        """
        if self.valid is None:
            return
        order = valid_first_order(self.valid)
        gather = order[:, None, :, None]
        self.keys = [k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[3])) for k in self.keys]
        self.values = [v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[3])) for v in self.values]
        self.valid = self.valid.gather(1, order)
        self.positions = self.positions.gather(1, order)
