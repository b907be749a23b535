"""Branching drafts: a small tree of drafts per row where the chain is likely to break.

A DSpark block is cheap to branch. The parallel backbone's states h_1..h_K do not depend on the tokens chosen inside
the block; only the sequential head does, and one head step (plus one projection over the M candidates) per extra node
costs little. So next to the chain x_1..x_K (today's `DraftBlock`, unchanged), `draft_tree` proposes *alternatives*
at the positions the confidence head marks as fragile, each continued by the sequential head from its own parent.

* **`DraftTree`** holds per row `N` nodes in creation order: `tokens`, `parents` (-1 = the anchor), `depths` (node n
  predicts position anchor + depth), `logits` (the exact distribution node n was drawn from, given its path and its
  earlier siblings; kept compact over the drafter's M candidate ids, the `[B, N, V]` tensor built only when sampled
  verification reads it), `survival` (estimated probability that the node ends on the accepted path) and `valid`.
  Nodes `0..K-1` are the chain; `DraftTree.from_block` makes the tree without branches.
* **Siblings** are drawn *without replacement* from their parent's draft distribution q: the i-th child's proposal is
  q with the earlier children's tokens removed (renormalised). Greedy drafting takes its argmax, i.e. the children
  of a node are q's top-k; sampling draws from it. The first child of a chain node is the next chain node.
* **Survival estimates.** A first child has conditional estimate c (the confidence head, STS applied, read at its
  slot with the parent's token, exactly as for the chain). The (i+1)-th child of P has
  e_{i+1} = (1 - c_1) * max_{y not drafted} q_P(y) / (1 - q_P(x_1)): the chance that the first child fails, shared
  out in proportion to the draft's belief over the tokens not yet proposed; when sampling it is capped at e_i (see
  below). A node's survival is s(n) = s(parent) * e(n) (s(anchor) = 1), the path product; for the chain it is the
  familiar a_j = prod c_i.
* **Budget.** `budget` extra nodes per row, added best first: the frontier holds, for every node, its next sibling
  and (for a non-chain node above depth K) its first child; each step adds the candidate of highest survival. An
  alternative scores high exactly where the chain is fragile (a_{j-1} high, c_j low), so the budget lands where the
  chain is likely to break, and is then spent continuing the alternatives that are worth it.

**Non-anticipation** (what keeps sampled decoding lossless, see `tree_verification`): whether node n is drafted (and,
in `scheduler.schedule_tree`, verified) must never depend on n's own token, its descendants, its later siblings or
their descendants (its subtree in the left-child right-sibling view). Keys only read a node's ancestors and earlier
siblings; when sampling they never increase along first-child and next-sibling edges (the cap e_{i+1} <= e_i), and a
node's candidates enter the frontier only once it is added; so a best-first step, and any later admission by key,
ranks n before everything in that subtree and decides n from nodes outside it. Greedy decoding needs no such rule
(its output is the target's argmax sequence whatever is verified), so there an alternative may outrank the chain
draft it competes with (keys still never increase from parent to child, so verified sets stay trees).

**Priced growth** (`TreeDrafting`, used by `batched.generate` for the "scheduled" / "async" policies when they price
their round overhead). A round drafts the chain first, exactly as `drafter.draft` does; then, before each growth step,
a *plan* (`scheduler.schedule_growth`) decides from the survival estimates known at that point (the chain's, the
branches grown so far and each row's next best-first candidate, none of which reads that candidate's token) which
rows grow their next node, pricing its measured drafting cost (seconds per growth step, and a fixed cost per round
that grows at all: `round_state.GrowthClock`) next to its verification width. The budget is thus an upper bound and
the number of nodes actually grown is chosen where they pay; when the first step already does not pay, nothing is
grown and the round is the chain's. The plan is a prefix rule over the same order as the frontier's keys, so it
keeps the non-anticipation above: the decision to grow n reads only what ranks before n, and the nodes that exist
when n is decided were themselves decided by what ranked before them (`scheduler` module docstring).

**Lookup branches** (`lookup_branches`, `batched.generate(lookup=..., tree_budget=...)`, greedy only): an n-gram
lookup's continuation of the sequence is merged into the drafted tree as a branch, so one forward checks both sources
and a round accepts the longer match instead of betting on one source before verification.

The target forward over a tree (4-D mask, per-node positions) and the target check live in `tree_attention`; the
verification math in `tree_verification`.

Limits: `draft_tree` uses `SamplingParams` processing (temperature / top-k / top-p), not HF logits processors, and
needs a confidence head when `budget > 0`. A drafter class may define its own `draft_tree(cache, anchor_ids, *,
anchor_positions, spec, sampling, generator)` method returning a `DraftTree` (the test oracles do); `draft_tree_for`
dispatches to it.
"""

from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Any, Callable, Sequence

import torch

from ..models.drafting import DraftBlock, DSparkContextCache, valid_first_order
from ..models.modeling_dspark import DSparkDrafter
from .verification import SamplingParams

__all__ = ["DraftTree", "GrowthPlan", "TreeDrafting", "TreeSpec", "draft_tree", "draft_tree_for", "lookup_branches",
           "plans_growth"]


@dataclass(frozen=True)
class TreeSpec:
    """How large a tree `draft_tree` grows.

    Attributes:
        budget: extra nodes per row beyond the K chain drafts (0 = the chain alone).
        max_children: children per node at most, the first (chain) child included (>= 2 to branch at all).
    """

    budget: int
    max_children: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"tree_budget must be an integer >= 0, got {self.budget!r}")
        if not isinstance(self.max_children, int) or self.max_children < 1:
            raise ValueError(f"tree_max_children must be an integer >= 1, got {self.max_children!r}")


@dataclass(init=False)
class DraftTree:
    """A tree of drafts per row (all rows share the node count `N`; `valid` marks the nodes a row has).

    Nodes are in creation order, so a parent, and an earlier sibling, always precede a node; nodes `0..num_chain-1`
    are the chain (node j has depth j + 1 and parent j - 1) in a freshly drafted tree.

    Attributes:
        tokens: `[B, N]` draft tokens (target ids).
        parents: `[B, N]` parent node index, -1 for a child of the anchor.
        depths: `[B, N]` 1..K: node n predicts position anchor + depths[n]; its parent has depth - 1.
        valid: `[B, N]` bool.
        survival: `[B, N]` float32 estimated probability that the node is on the accepted path (prefix survival
            along its path), or `None` without a confidence head.
        node_ids: `[B, N]` the nodes' indices in the tree they were selected from (`select`); arange for a fresh tree.
        num_chain: K, the chain's length in the drafted tree (node ids below it are chain nodes).
        confidences, confidence_logits: `[B, K]` the chain's (for records and calibration), or `None`.
        candidate_ids, candidate_logits: `[B, N, M]` the distribution each node was drawn from, compactly: float32
            logits at M target ids (-inf for ids it cannot take, e.g. its earlier siblings'), zero probability
            elsewhere. `candidate_ids=None` means the M = V ids in order (a drafter scoring the full vocabulary).
        vocab_size: V.

    `logits` is the same distribution as a `[B, N, V]` tensor, built on first access (sampled verification reads it;
    greedy verification compares tokens only).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.Tensor
    survival: torch.Tensor | None
    node_ids: torch.LongTensor
    num_chain: int
    confidences: torch.Tensor | None
    confidence_logits: torch.Tensor | None
    candidate_ids: torch.LongTensor | None
    candidate_logits: torch.Tensor | None
    vocab_size: int

    def __init__(self, tokens: torch.LongTensor, parents: torch.LongTensor, depths: torch.LongTensor,
                 valid: torch.Tensor, survival: torch.Tensor | None, node_ids: torch.LongTensor, num_chain: int, *,
                 logits: torch.Tensor | None = None, candidate_ids: torch.LongTensor | None = None,
                 candidate_logits: torch.Tensor | None = None, vocab_size: int | None = None,
                 confidences: torch.Tensor | None = None, confidence_logits: torch.Tensor | None = None) -> None:
        self.tokens, self.parents, self.depths, self.valid = tokens, parents, depths, valid
        self.survival, self.node_ids, self.num_chain = survival, node_ids, num_chain
        self.confidences, self.confidence_logits = confidences, confidence_logits
        if logits is not None and candidate_logits is None and candidate_ids is None:
            candidate_logits = logits  # dense: the ids are the vocabulary in order
        self.candidate_ids, self.candidate_logits = candidate_ids, candidate_logits
        if vocab_size is None:
            if candidate_ids is not None:
                raise ValueError("DraftTree: give vocab_size with candidate_ids")
            vocab_size = 0 if candidate_logits is None else int(candidate_logits.shape[-1])
        self.vocab_size = int(vocab_size)
        self._dense = logits

    @classmethod
    def from_block(cls, block: DraftBlock) -> "DraftTree":
        """The chain as a tree without branches (node j = draft j + 1, parent j - 1)."""
        b, k = block.tokens.shape
        device = block.tokens.device
        arange = torch.arange(k, device=device).expand(b, k)
        sparse = getattr(block, "sparse_logits", None)  # a block that keeps its logits compact
        if sparse is not None:
            dist = dict(candidate_ids=sparse.ids, candidate_logits=sparse.values.float(), vocab_size=sparse.vocab_size)
        else:
            dist = dict(logits=block.logits)
        return cls(tokens=block.tokens, parents=arange - 1, depths=arange + 1,
                   valid=torch.ones(b, k, dtype=torch.bool, device=device), survival=block.survival,
                   node_ids=arange, num_chain=k, confidences=block.confidences,
                   confidence_logits=block.confidence_logits, **dist)

    @property
    def logits(self) -> torch.Tensor | None:
        """`[B, N, V]` float32 logits of the exact distribution node n's token was drawn from (given its path and its
        earlier siblings; greedy drafts are its argmax), -inf outside its candidates. Built once, on first access."""
        if self._dense is None and self.candidate_logits is not None:
            if self.candidate_ids is None:
                self._dense = self.candidate_logits
            else:
                b, n, _ = self.candidate_logits.shape
                full = self.candidate_logits.new_full((b, n, self.vocab_size), float("-inf"))
                self._dense = full.scatter(2, self.candidate_ids, self.candidate_logits)
        return self._dense

    @property
    def num_nodes(self) -> torch.LongTensor:
        """`[B]` valid nodes per row."""
        return self.valid.sum(dim=1)

    @property
    def max_depth(self) -> int:
        return int(self.depths.masked_fill(~self.valid, 0).max()) if self.valid.numel() else 0

    @property
    def probs(self) -> torch.Tensor:
        """`[B, N, V]` the nodes' draft probabilities (float32)."""
        return torch.softmax(self.logits.float(), dim=-1)

    def is_chain(self) -> bool:
        """Whether every row's valid nodes form a chain in index order (node i's parent is node i - 1)."""
        n = self.tokens.shape[1]
        expected = torch.arange(n, device=self.parents.device)[None, :] - 1
        return bool(((self.parents == expected) | ~self.valid).all()) and bool(
            (self.valid[:, 1:] <= self.valid[:, :-1]).all())

    def _replace(self, **fields: Any) -> "DraftTree":
        base = dict(tokens=self.tokens, parents=self.parents, depths=self.depths, valid=self.valid,
                    survival=self.survival, node_ids=self.node_ids, num_chain=self.num_chain,
                    candidate_ids=self.candidate_ids, candidate_logits=self.candidate_logits,
                    vocab_size=self.vocab_size, confidences=self.confidences,
                    confidence_logits=self.confidence_logits)
        base.update(fields)
        return DraftTree(**base)

    def to(self, device: torch.device | str) -> "DraftTree":
        """The tree with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._replace(tokens=move(self.tokens), parents=move(self.parents), depths=move(self.depths),
                             valid=move(self.valid), survival=move(self.survival), node_ids=move(self.node_ids),
                             candidate_ids=move(self.candidate_ids), candidate_logits=move(self.candidate_logits),
                             confidences=move(self.confidences), confidence_logits=move(self.confidence_logits))

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """The subtree of the nodes in `keep` `[B, N]` (closed under parents), compacted to the front of each row in
        their order; parents are re-indexed and `node_ids` keep the original indices."""
        keep = keep.to(self.valid.device) & self.valid
        parent_kept = torch.where(self.parents >= 0, keep.gather(1, self.parents.clamp(min=0)),
                                  torch.ones_like(keep))
        if bool((keep & ~parent_kept).any()):
            raise ValueError("DraftTree.select needs a set of nodes closed under parents")
        b = keep.shape[0]
        if keep.shape[1] == 0 or not bool(keep.any()):
            order = torch.zeros(b, 0, dtype=torch.long, device=keep.device)
        else:
            order = valid_first_order(keep)  # [B, W]: kept nodes first, in index order
        valid = keep.gather(1, order)
        new_index = torch.full_like(self.parents, -1)
        new_index.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order).clone())
        new_index = torch.where(keep, new_index, torch.full_like(new_index, -1))
        old_parents = self.parents.gather(1, order)
        parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), old_parents)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.gather(1, order[..., None].expand(-1, -1, t.shape[-1]))

        return self._replace(
            tokens=self.tokens.gather(1, order), parents=torch.where(valid, parents, torch.full_like(parents, -1)),
            depths=self.depths.gather(1, order), valid=valid,
            survival=None if self.survival is None else self.survival.gather(1, order),
            node_ids=self.node_ids.gather(1, order), candidate_ids=rows(self.candidate_ids),
            candidate_logits=rows(self.candidate_logits))

    def ancestors(self) -> torch.Tensor:
        """`[B, N, N]` bool: [b, i, j] is True when valid node j is node i itself or one of its ancestors."""
        b, n = self.tokens.shape
        eye = torch.eye(n, dtype=torch.bool, device=self.tokens.device).expand(b, n, n) & self.valid[:, :, None]
        seen = eye
        for _ in range(self.max_depth):  # one generation per pass
            up = seen.gather(1, self.parents.clamp(min=0)[:, :, None].expand(b, n, n))  # the parent's row
            seen = eye | (up & (self.parents >= 0)[:, :, None] & self.valid[:, :, None])
        return seen


# ---------------------------------------------------------------------------------------------- lookup branches
def lookup_branches(tree: DraftTree, proposals: Sequence[Any]) -> DraftTree:
    """`tree` with each row's n-gram lookup continuation merged in as a branch (greedy decoding only).

    The lookup's drafts (`models.lookup.LookupProposal`: tokens and calibrated prefix-survival estimates) are walked
    from the anchor like a trie: while a lookup draft equals an existing child of the current node (the chain's node
    at that depth, say), that node is reused and its survival becomes the larger of the two estimates; from the first
    draft that differs, the rest of the proposal becomes new nodes, appended after the tree's own (parent index below
    child index), each with the lookup's prefix survival. One target forward then checks the drafter's chain, its
    alternatives and the lookup's continuation together, and greedy verification follows whichever path the target's
    argmax takes: a round accepts the longer of the lookup's and the drafter's matches instead of betting on one
    source before verification (`lookup.merge_lookup_drafts`, the chain loop's rule).

    Survival still never increases from parent to child (a raised node's parent on the lookup path is raised to at
    least the lookup's estimate one step earlier, which is no smaller), so `scheduler.cap_tree` and the priced
    policies keep a tree per row.

    Greedy only: which nodes exist depends on the drafted tokens (a lookup draft equal to a sampled chain draft is
    merged into it), which sampled verification's non-anticipation rule forbids; `batched.generate` refuses lookup
    branches with sampling. The new nodes carry no draft distribution (greedy verification compares tokens only).

    Args:
        tree: the round's drafted tree (`DraftTree.from_block` for a chain).
        proposals: one per row, each with `tokens` (target ids) and `survival` (prefix survival per draft).
    Returns:
        a `DraftTree` with up to `max(len(p.tokens))` more node slots per row (`num_chain` unchanged); `tree` itself
        when no row has a proposal.
    """
    b, n = tree.tokens.shape
    if len(proposals) != b:
        raise ValueError(f"{len(proposals)} lookup proposals for a tree of {b} rows")
    extra = max((len(p.tokens) for p in proposals), default=0)
    if extra == 0:
        return tree
    device = tree.tokens.device
    width = n + extra
    tokens = torch.zeros(b, width, dtype=torch.long)
    parents = torch.full((b, width), -1, dtype=torch.long)
    depths = torch.ones(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    survival = torch.zeros(b, width)
    tokens[:, :n], parents[:, :n], depths[:, :n] = tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu()
    valid[:, :n] = tree.valid.cpu()
    if tree.survival is not None:
        survival[:, :n] = tree.survival.detach().float().cpu()
    tok_l, par_l, dep_l, val_l, sur_l = (tokens.tolist(), parents.tolist(), depths.tolist(), valid.tolist(),
                                         survival.tolist())
    used = n  # node slots any row uses (the rest are cut)
    for r, proposal in enumerate(proposals):
        if not proposal.tokens:
            continue
        children = {}  # (parent, token) -> node, the row's existing nodes (the first of equal siblings)
        for i in range(n):
            if val_l[r][i]:
                children.setdefault((par_l[r][i], tok_l[r][i]), i)
        parent, free = -1, n
        for depth, (token, estimate) in enumerate(zip(proposal.tokens, proposal.survival), start=1):
            node = children.get((parent, int(token)))
            if node is None:  # the lookup leaves the tree here: a new node
                node, free = free, free + 1
                tok_l[r][node], par_l[r][node], dep_l[r][node] = int(token), parent, depth
                val_l[r][node], sur_l[r][node] = True, float(estimate)
            else:
                sur_l[r][node] = max(sur_l[r][node], float(estimate))
            parent = node
        used = max(used, free)
    cut = lambda rows: torch.tensor([row[:used] for row in rows], device=device)  # noqa: E731
    node_ids = torch.arange(used, device=device).expand(b, used)
    return DraftTree(tokens=cut(tok_l), parents=cut(par_l), depths=cut(dep_l), valid=cut(val_l),
                     survival=cut(sur_l).float(), node_ids=node_ids,
                     num_chain=tree.num_chain, vocab_size=tree.vocab_size, confidences=tree.confidences,
                     confidence_logits=tree.confidence_logits)


# ---------------------------------------------------------------------------------------------- drafting
def draft_tree_for(drafter: DSparkDrafter, cache: DSparkContextCache, anchor_ids: torch.LongTensor, *,
                   anchor_positions: torch.LongTensor | None, spec: TreeSpec, sampling: SamplingParams,
                   generator: torch.Generator | None = None) -> DraftTree:
    """`drafter.draft_tree(...)` when the drafter class defines one, else `draft_tree(drafter, ...)`."""
    own = getattr(drafter, "draft_tree", None)
    if callable(own):
        return own(cache, anchor_ids, anchor_positions=anchor_positions, spec=spec, sampling=sampling,
                   generator=generator)
    return draft_tree(drafter, cache, anchor_ids, anchor_positions=anchor_positions, spec=spec, sampling=sampling,
                      generator=generator)


@torch.no_grad()
def draft_tree(drafter: DSparkDrafter, cache: DSparkContextCache, anchor_ids: torch.LongTensor, *,
               anchor_positions: torch.LongTensor | None = None, spec: TreeSpec, sampling: SamplingParams,
               generator: torch.Generator | None = None) -> DraftTree:
    """One drafting round as a tree: the chain exactly as `drafter.draft` drafts it, then `spec.budget` extra nodes
    per row, best first by estimated survival (see the module docstring).

    Args:
        drafter: any `DSparkDrafter` (Markov, gated Markov, RNN or no sequential head; a confidence head is needed
            when `spec.budget > 0`).
        cache, anchor_ids `[B]`, anchor_positions `[B]`: as for `DSparkDrafter.draft`.
        spec: the budget and the most children per node.
        sampling: processing of every node's distribution (identical to the target side), greedy or sampled.
        generator: RNG; the chain draws first, exactly as `draft`, so a budget of 0 consumes the same numbers.
    Returns:
        a `DraftTree` of up to `K + budget` node slots (rows that run out of candidates have fewer valid nodes).
    """
    if spec.budget == 0 or spec.max_children < 2:
        return DraftTree.from_block(drafter.draft(cache, anchor_ids, anchor_positions=anchor_positions,
                                                  sampling=sampling, generator=generator))
    return TreeDrafting(drafter, cache, anchor_ids, anchor_positions=anchor_positions, spec=spec, sampling=sampling,
                        generator=generator).grow()


GrowthPlan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`plan(survival [B, N], valid [B, N], next_survival [B], next_valid [B]) -> [B] bool`: before a growth step, given
the nodes so far and each row's next best-first candidate's survival estimate (not its token), which rows grow it
(`scheduler.schedule_growth`)."""


def plans_growth(drafter: DSparkDrafter) -> bool:
    """Whether `TreeDrafting` drafts this drafter's chain exactly as its `draft` does (its class keeps
    `DSparkDrafter.draft` and defines no `draft_tree` of its own), so that a round that grows nothing is the chain's."""
    return type(drafter).draft is DSparkDrafter.draft and not callable(getattr(drafter, "draft_tree", None))


class TreeDrafting:
    """One tree-drafting round in two stages: the chain on construction (`chain`: exactly `drafter.draft`'s block,
    drawing the same random numbers), then `grow(plan)`, which adds up to `spec.budget` nodes per row best first
    (`plan` may stop rows earlier, before drawing their next node).

    Timing of the last `grow` (wall clock, for `round_state.GrowthClock`): `steps` growth steps, `step_seconds`
    spent in them (the plan's checks included), `fixed_seconds` outside them (set-up, the first frontier, building
    the `DraftTree`).
    """

    def __init__(self, drafter: DSparkDrafter, cache: DSparkContextCache, anchor_ids: torch.LongTensor, *,
                 anchor_positions: torch.LongTensor | None = None, spec: TreeSpec, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> None:
        if spec.budget > 0 and spec.max_children >= 2 and drafter.confidence_head is None:
            raise ValueError("tree drafting (tree_budget > 0) spends its budget by the confidence head's survival "
                             "estimates; this drafter has no confidence head (use tree_budget=None or 0)")
        self.drafter, self.anchor_ids, self.spec, self.sampling = drafter, anchor_ids, spec, sampling
        self.generator = generator
        self.hidden = drafter.draft_slots(drafter.block_states(cache, anchor_ids, anchor_positions))  # [B, K, d]
        self.base = drafter.draft_logits(self.hidden)  # [B, K, Vd] float32
        self.prepared = drafter.prepare_candidates(self.base)
        self.chain = drafter.sample_block(self.hidden, self.base, anchor_ids, sampling=sampling, generator=generator,
                                          prepared=self.prepared)
        self.steps, self.step_seconds, self.fixed_seconds = 0, 0.0, 0.0

    @property
    def can_branch(self) -> bool:
        return self.spec.budget > 0 and self.spec.max_children >= 2

    def grow(self, plan: GrowthPlan | None = None) -> DraftTree | None:
        """The tree: the chain plus up to `spec.budget` nodes per row. With `plan`, `None` when it grows no node at
        all (the round is the chain: `chain`); without one, always a tree (`draft_tree`'s)."""
        start = time.perf_counter()
        self.steps, self.step_seconds = 0, 0.0
        if not self.can_branch:
            self.fixed_seconds = time.perf_counter() - start
            return None if plan is not None else DraftTree.from_block(self.chain)
        grower = _TreeGrower(self.drafter, self.hidden, self.base, self.prepared, self.anchor_ids, self.chain,
                             self.spec, self.sampling, self.generator, plan=plan)
        tree = grower.grow()
        self.steps, self.step_seconds = grower.steps, grower.step_seconds
        self.fixed_seconds = time.perf_counter() - start - self.step_seconds
        return None if plan is not None and grower.steps == 0 else tree


class _TreeGrower:
    """Best-first growth of a tree around a drafted chain, vectorised over rows (one new node per row per step).

    Every node's distribution is kept over its slot's M candidate ids (the drafter's `draft_candidates`, its reduced
    draft vocabulary, or the whole vocabulary): a step costs one head step and O(M) work per row."""

    def __init__(self, drafter: DSparkDrafter, hidden: torch.Tensor, base: torch.Tensor, prepared: Any,
                 anchor_ids: torch.LongTensor, chain: DraftBlock, spec: TreeSpec, sampling: SamplingParams,
                 generator: torch.Generator | None, plan: GrowthPlan | None = None) -> None:
        self.drafter, self.hidden, self.base, self.prepared = drafter, hidden, base, prepared
        self.plan = plan
        self.steps, self.step_seconds = 0, 0.0
        self.head, self.spec, self.sampling, self.generator = drafter.markov_head, spec, sampling, generator
        self.chain = chain
        b, k = chain.tokens.shape
        n = k + spec.budget
        self.b, self.k, self.n = b, k, n
        device = chain.tokens.device
        self.device = device
        self.vocab = int(drafter.config.vocab_size)
        # the candidate ids of every slot: [B, K, M] target ids, or None for the whole vocabulary in order
        if prepared is not None:
            ids = prepared[1]
            self.slot_ids = ids if drafter.d2t is None else drafter.d2t[ids]
        elif drafter.d2t is not None:
            self.slot_ids = drafter.d2t.expand(b, k, -1)
        else:
            self.slot_ids = None
        m = self.vocab if self.slot_ids is None else self.slot_ids.shape[-1]
        arange = torch.arange(k, device=device).expand(b, k)
        self.tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        self.parents = torch.full((b, n), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(b, n, dtype=torch.long, device=device)
        self.rank = torch.zeros(b, n, dtype=torch.long, device=device)
        self.valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        self.cand_logits = torch.full((b, n, m), float("-inf"), device=device)  # node n's proposal, compact
        self.cand_ids = None if self.slot_ids is None else torch.zeros(b, n, m, dtype=torch.long, device=device)
        self.position = torch.zeros(b, n, dtype=torch.long, device=device)  # index of n's token among its ids
        self.survival = torch.zeros(b, n, dtype=torch.float32, device=device)
        self.cond = torch.zeros(b, n, dtype=torch.float32, device=device)  # e(n) = s(n) / s(parent)
        self.fail = torch.zeros(b, n, dtype=torch.float32, device=device)  # (1 - c_1) / (1 - q_P(x_1)), by parent
        self.lse = torch.zeros(b, n, dtype=torch.float32, device=device)   # logsumexp of the parent's q
        neg = torch.full((b, n), float("-inf"), device=device)
        self.first_key, self.first_cond, self.sibling_key = neg.clone(), torch.zeros(b, n, device=device), neg.clone()
        self.sibling_cond = torch.zeros(b, n, device=device)
        # the chain: nodes 0..K-1, its distributions read at the slots' candidates (exactly its own: -inf elsewhere)
        conf = chain.confidences.float()
        self.tokens[:, :k], self.parents[:, :k], self.depths[:, :k] = chain.tokens, arange - 1, arange + 1
        self.valid[:, :k] = True
        self.cand_logits[:, :k] = self._chain_candidates(chain)
        if self.cand_ids is not None:
            self.cand_ids[:, :k] = self.slot_ids
            self.position[:, :k] = (self.slot_ids == chain.tokens[..., None]).int().argmax(dim=-1)
        else:
            self.position[:, :k] = chain.tokens
        self.survival[:, :k] = torch.cumprod(conf, dim=-1)
        self.cond[:, :k] = conf
        # head states: state_in[n] = the state the step that produced n's distribution returned (siblings share it);
        # state_out[n] / latent_out[n] = those of n's own step (its children's distribution). None for Markov heads.
        self.state_in = self.state_out = self.latent_out = None
        self._chain_states(anchor_ids, chain.tokens)

    def _chain_candidates(self, chain: DraftBlock) -> torch.Tensor:
        """`[B, K, M]` the chain's logits at the slots' candidate ids."""
        sparse = getattr(chain, "sparse_logits", None)
        if self.slot_ids is None:
            return chain.logits.float()
        if sparse is not None and sparse.ids.shape == self.slot_ids.shape and torch.equal(sparse.ids, self.slot_ids):
            return sparse.values.float()
        return chain.logits.float().gather(2, self.slot_ids)

    # -------------------------------------------------------------------------------------- head steps
    def _chain_states(self, anchor_ids: torch.LongTensor, tokens: torch.LongTensor) -> None:
        head = self.head
        if head is None:
            return
        state = head.init_state(self.b, self.hidden.device, self.hidden.dtype)
        if state is None:  # Markov heads carry no state
            return
        self.state_in = state.new_zeros(self.b, self.n, *state.shape[1:])
        self.state_out = state.new_zeros(self.b, self.n, *state.shape[1:])
        prev = self.drafter.to_draft_inputs(anchor_ids)
        for j in range(self.k):  # the chain's states, recomputed (the RNN cell only, no projection)
            _, _, state = head.step(prev, self.hidden[:, j], state)
            self.state_in[:, j] = state
            prev = self.drafter.to_draft_inputs(tokens[:, j])

    def _child_distribution(self, rows: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """`[R', M]` processed logits at the candidates of the first child of node `parents[i]` of row `rows[i]`
        (exactly as `sample_block` scores a slot: base logits + the head's bias from the parent's step, restricted to
        the slot's candidates, then `sampling.warp`)."""
        head = self.head
        slot = self.depths[rows, parents]
        latent = None if head is None else self.latent_out[rows, parents]
        if self.prepared is not None:
            values, _, w2 = self.prepared  # [B, K, M], [B, K, M] draft ids, [B, K, M, r]
            scores = values[rows, slot]
            if head is not None:
                scores = scores + head.project_rows(latent, w2[rows, slot]).float()
        else:
            scores = self.base[rows, slot]  # [R', Vd] (V without a reduced draft vocabulary)
            if head is not None:
                scores = scores + head.project(latent).float()
        return self.sampling.warp(scores)

    # -------------------------------------------------------------------------------------- candidates
    def _sibling_key(self, logits: torch.Tensor, position: torch.Tensor, fail: torch.Tensor, lse: torch.Tensor,
                     cond: torch.Tensor, rank: torch.Tensor,
                     s_parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e, key) of the next sibling of nodes with proposal `logits` `[R, M]` and token index `position` `[R]`:
        e = fail * max remaining q_P (capped at the node's own e when sampling), key = s(parent) * e; -inf past
        `max_children` or when no candidate is left."""
        top = logits.scatter(1, position[:, None], float("-inf")).max(dim=-1).values
        estimate = fail * (top - lse).exp()
        if self.sampling.do_sample:  # never above the previous sibling's: non-anticipation (module docstring)
            estimate = torch.minimum(estimate, cond)
        estimate = torch.nan_to_num(estimate, nan=0.0)
        ok = (rank + 1 < self.spec.max_children) & torch.isfinite(top)
        return estimate, torch.where(ok, s_parent * estimate, torch.full_like(estimate, float("-inf")))

    @staticmethod
    def _failure(logits: torch.Tensor, position: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lse, fail) of first children with proposal `logits` `[R, M]`: fail = (1 - c_1) / (1 - q_P(x_1)), the
        factor their later siblings' estimates read."""
        lse = torch.logsumexp(logits, dim=-1)
        q_own = (logits.gather(1, position[:, None]).squeeze(1) - lse).exp()
        fail = (1.0 - cond) / (1.0 - q_own).clamp(min=1e-6)
        return lse, torch.where(q_own < 1.0 - 1e-6, fail, torch.zeros_like(fail))

    def _first_child_candidates(self) -> None:
        """Initial frontier: the next sibling of every chain node (a chain node's first child is the next one)."""
        b, k = self.b, self.k
        logits = self.cand_logits[:, :k].reshape(b * k, -1)
        position, cond = self.position[:, :k].reshape(-1), self.cond[:, :k].reshape(-1)
        lse, fail = self._failure(logits, position, cond)
        s_parent = torch.cat([torch.ones(b, 1, device=self.device), self.survival[:, : k - 1]], dim=1).reshape(-1)
        estimate, key = self._sibling_key(logits, position, fail, lse, cond, self.rank[:, :k].reshape(-1), s_parent)
        self.lse[:, :k], self.fail[:, :k] = lse.view(b, k), fail.view(b, k)
        self.sibling_cond[:, :k], self.sibling_key[:, :k] = estimate.view(b, k), key.view(b, k)

    # -------------------------------------------------------------------------------------- growth
    def grow(self) -> DraftTree:
        """Adds `budget` nodes per row, one per row per step, each the frontier candidate of highest survival; with
        a `plan`, a row stops growing at the first step whose candidate the plan declines (decided from the candidate's
        survival estimate and the nodes before it, before its token is drawn). Records `steps` (steps that grew a
        node somewhere) and `step_seconds`."""
        b, n, k = self.b, self.n, self.k
        self._first_child_candidates()
        rows = torch.arange(b, device=self.device)
        neg = torch.tensor(float("-inf"), device=self.device)
        at = lambda t, index: t.gather(1, index[:, None]).squeeze(1)  # noqa: E731  [B, N] at per-row index -> [B]
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        plan = self.plan
        self.steps, self.step_seconds = 0, 0.0
        for m in range(k, n):
            step_start = time.perf_counter()
            best_key, best = torch.cat([self.first_key, self.sibling_key], dim=1).max(dim=1)  # first max on ties
            ok = torch.isfinite(best_key) & ~stopped
            if plan is not None and bool(ok.any()):
                go = plan(self.survival[:, :m], self.valid[:, :m], torch.where(ok, best_key, torch.zeros_like(
                    best_key)), ok).to(self.device)
                stopped |= ok & ~go  # its next node does not pay: the row grows no more this round
                ok = ok & go
            if not bool(ok.any()):
                self.step_seconds += time.perf_counter() - step_start
                break
            self.steps += 1
            src, first = best % n, (best < n) & ok  # the node the candidate hangs from; first child or next sibling
            parent = torch.where(first, src, at(self.parents, src))
            depth, rank = at(self.depths, src) + first.long(), torch.where(first, 0, at(self.rank, src) + 1)
            # the proposal: a sibling's is the previous one's without its token; a first child's comes from the head
            proposal = self.cand_logits[rows, src].scatter(1, at(self.position, src)[:, None], float("-inf"))
            ids = None if self.cand_ids is None else self.cand_ids[rows, src]
            lead = first.nonzero().squeeze(1)
            if len(lead):
                proposal[lead] = self._child_distribution(lead, src[lead])
                if ids is not None:
                    ids[lead] = self.slot_ids[lead, at(self.depths, src)[lead]]
            if self.sampling.do_sample:
                pick = torch.multinomial(torch.softmax(proposal, dim=-1), 1, generator=self.generator).squeeze(1)
            else:
                pick = proposal.argmax(dim=-1)
            token = pick if ids is None else ids.gather(1, pick[:, None]).squeeze(1)
            survival = torch.where(ok, best_key, torch.zeros_like(best_key))
            cond = torch.where(first, at(self.first_cond, src), at(self.sibling_cond, src))
            self.tokens[:, m], self.parents[:, m], self.depths[:, m], self.rank[:, m] = token, parent, depth, rank
            self.valid[:, m], self.survival[:, m], self.cond[:, m], self.position[:, m] = ok, survival, cond, pick
            self.cand_logits[:, m] = proposal
            if ids is not None:
                self.cand_ids[:, m] = ids
            if self.state_in is not None:
                self.state_in[:, m] = torch.where(first[:, None], self.state_out[rows, src], self.state_in[rows, src])
            # the candidate is used up
            self.first_key[rows, src] = torch.where(first, neg, self.first_key[rows, src])
            self.sibling_key[rows, src] = torch.where(ok & ~first, neg, self.sibling_key[rows, src])
            # the new node's next sibling
            lse, fail = self._failure(proposal, pick, cond)
            lse = torch.where(first, lse, at(self.lse, src))
            fail = torch.where(first, fail, at(self.fail, src))
            self.lse[:, m], self.fail[:, m] = lse, fail
            s_parent = torch.where(parent >= 0, at(self.survival, parent.clamp(min=0)), torch.ones_like(survival))
            estimate, key = self._sibling_key(proposal, pick, fail, lse, cond, rank, s_parent)
            self.sibling_cond[:, m], self.sibling_key[:, m] = estimate, torch.where(ok, key, neg)
            # the new node's first child (above depth K): its confidence from the head step from the new node
            deeper = ok & (depth < k)
            if bool(deeper.any()):
                self._expand(m, token, depth.clamp(max=k - 1), deeper)
            self.step_seconds += time.perf_counter() - step_start
        used = int(self.valid.sum(dim=0).nonzero().max()) + 1
        arange = torch.arange(used, device=self.device).expand(b, used)
        return DraftTree(tokens=self.tokens[:, :used], parents=self.parents[:, :used], depths=self.depths[:, :used],
                         valid=self.valid[:, :used], survival=self.survival[:, :used], node_ids=arange, num_chain=k,
                         candidate_ids=None if self.cand_ids is None else self.cand_ids[:, :used],
                         candidate_logits=self.cand_logits[:, :used], vocab_size=self.vocab,
                         confidences=self.chain.confidences, confidence_logits=self.chain.confidence_logits)

    def _expand(self, m: int, token: torch.Tensor, slot: torch.Tensor, deeper: torch.Tensor) -> None:
        """The head step from node m of every row (its children's slot `slot` = its depth): stores its latent and
        state, and enters its first child in the frontier with e = c, the confidence head at that slot (rows in
        `deeper` only)."""
        rows = torch.arange(self.b, device=self.device)
        hidden = self.hidden[rows, slot]  # [B, d]
        features = None
        if self.head is not None:
            prev = self.drafter.to_draft_inputs(token)
            state = None if self.state_in is None else self.state_in[:, m]
            latent, features, state = self.head.step(prev, hidden, state)
            if self.latent_out is None:
                self.latent_out = latent.new_zeros(self.b, self.n, *latent.shape[1:])
            self.latent_out[:, m] = latent
            if self.state_out is not None:
                self.state_out[:, m] = state
        raw = self.drafter.confidence_head(hidden, features).float()
        temps = self.drafter.config.sts_temperatures
        if temps:
            raw = raw / torch.tensor(temps, dtype=raw.dtype, device=raw.device)[slot]
        c = torch.sigmoid(raw)
        self.first_cond[:, m] = c
        self.first_key[:, m] = torch.where(deeper, self.survival[:, m] * c, torch.full_like(c, float("-inf")))
