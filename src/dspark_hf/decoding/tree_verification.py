"""Lossless verification of draft trees: pure tensor math, no model calls.

Inputs are a `DraftTree` (per row, nodes in creation order: a parent and an earlier sibling precede a node) and the
target's logits of one forward over [anchor, node_1 .. node_N] with the tree mask: column 0 is the target's
distribution after the anchor, column 1 + n the one after node n (the distribution its children are checked against).

* `tree_greedy_verify`: from the anchor, step to the child whose token equals the target's argmax, while there is
  one (the first such child if several share a token). The correction / bonus token is the target's argmax after the
  deepest matched node, so the output equals the target's own greedy output whatever the tree.
* `tree_rejection_verify`: **multi-candidate recursive rejection sampling** — SpecInfer's multi-step speculative
  sampling (Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference
  and Verification", ASPLOS 2024, Algorithm 2 / Theorem 4.2), in the form of recursive rejection sampling with
  per-candidate proposals (Jeon et al., "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling
  Without Replacement", 2024; Chen et al., "Sequoia", 2024). At the current node, with p the target's distribution
  there, the children x_1, x_2, .. are tried in order, child i against its own proposal q_i (the exact distribution it
  was drawn from: the parent's draft q for the first child, q without the earlier siblings' tokens for the next):
  accept x_i with probability min(1, p(x_i) / q_i(x_i)) and move to it (p becomes the target's distribution after
  x_i); otherwise p <- normalize(max(p - q_i, 0)) and try the next child. When every child is rejected, or the node
  has none, the emitted token is drawn from the current p.

  Why it is lossless (induction on the number of children m): m = 0 samples p. For m >= 1, x_1 ~ q_1 is accepted
  and emitted with probability min(p, q_1)(y); with the remaining probability 1 - sum min(p, q_1) =
  sum max(p - q_1, 0) the procedure continues with target r = normalize(max(p - q_1, 0)) and children x_2.. ; by
  induction it emits a token distributed as r whatever the proposals of x_2.. are, even when they depend on x_1
  (a rejected x_1 = a has p(a) < q_1(a), so r(a) = 0 and excluding a from q_2 loses nothing). Total:
  min(p, q_1) + (1 - sum min(p, q_1)) r = p. So the first emitted token at every node follows p, and by induction
  on depth the whole emitted sequence follows the target — provided the *set* of children verified at a node is
  decided without looking at those children's values or their subtrees (see `scheduler.schedule_tree`). For a
  chain (one child per node) this is exactly `verification.rejection_verify`, and it draws the same random numbers:
  one uniform per node column (`torch.rand(R, N)`), then one multinomial per row.

`kept` marks the forward's columns to keep in both caches: the anchor and the accepted path; the rest become holes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafting import valid_first_order
from .tree import DraftTree
from .verification import SamplingParams, VerificationResult

__all__ = ["TreeVerificationResult", "tree_greedy_verify", "tree_rejection_verify", "tree_verify"]


@dataclass
class TreeVerificationResult(VerificationResult):
    """`VerificationResult` (accepted path length, next token, tokens `[B, D + 1]` with D the tree's depth) plus:

    Attributes:
        path: `[B, D]` the accepted nodes by depth (node indices), -1 past `num_accepted`.
        kept: `[B, 1 + N]` bool over the verification forward's columns: the anchor and the accepted path.
    """

    path: torch.LongTensor | None = None
    kept: torch.Tensor | None = None


def _finish(tree: DraftTree, reached: torch.Tensor, next_tokens: torch.LongTensor, pad: int) -> TreeVerificationResult:
    """Builds the result from the accepted nodes `reached` `[B, N]` (one per depth, ancestors first)."""
    b, n = reached.shape
    depth = max(tree.max_depth, 1)
    num_accepted = reached.sum(dim=1)
    if n and bool(reached.any()):
        order = valid_first_order(reached)  # path nodes in index order = depth order
    else:
        order = torch.zeros(b, 0, dtype=torch.long, device=reached.device)
    slots = torch.arange(order.shape[1], device=reached.device)[None, :]
    on_path = slots < num_accepted[:, None]
    path = torch.where(on_path, order, torch.full_like(order, -1))
    path_tokens = torch.where(on_path, tree.tokens.gather(1, order), torch.full_like(order, pad))
    tokens = torch.full((b, depth + 1), pad, dtype=torch.long, device=reached.device)
    tokens[:, : path_tokens.shape[1]] = path_tokens
    tokens = tokens.scatter(1, num_accepted[:, None], next_tokens[:, None])
    path_full = torch.full((b, depth), -1, dtype=torch.long, device=reached.device)
    path_full[:, : path.shape[1]] = path[:, :depth]
    kept = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=reached.device), reached], dim=1)
    return TreeVerificationResult(num_accepted=num_accepted, next_tokens=next_tokens, tokens=tokens, path=path_full,
                                  kept=kept)


def tree_greedy_verify(tree: DraftTree, target_logits: torch.Tensor, pad_token_id: int = 0) -> TreeVerificationResult:
    """Greedy verification of a tree.

    Args:
        tree: `DraftTree` with `N` node slots (invalid nodes are never accepted).
        target_logits: `[B, 1 + N, V]` the target's logits at the anchor and after each node (any processing that
            keeps the argmax).
    """
    b, n = tree.tokens.shape
    device = tree.tokens.device
    target_ids = target_logits.argmax(dim=-1).to(device)  # [B, 1 + N]
    parent_col = tree.parents + 1  # the column of each node's parent (0 = the anchor)
    match = tree.valid & (tree.tokens == target_ids.gather(1, parent_col))
    # at most one child per node: the first matching one (siblings drafted without replacement never tie)
    same_parent = tree.parents[:, :, None] == tree.parents[:, None, :]  # [B, N, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)
    match = match & ~(same_parent & earlier & match[:, None, :]).any(dim=2)
    reached = match
    for _ in range(tree.max_depth):  # a node is accepted when it matches and its parent was accepted
        with_anchor = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=device), reached], 1)  # [B, 1 + N]
        reached = match & with_anchor.gather(1, parent_col)
    last = torch.where(reached, tree.depths, torch.zeros_like(tree.depths)).argmax(dim=1)  # the deepest accepted
    last_col = torch.where(reached.any(dim=1), last + 1, torch.zeros_like(last))
    next_tokens = target_ids.gather(1, last_col[:, None]).squeeze(1)
    return _finish(tree, reached, next_tokens, pad_token_id)


def tree_rejection_verify(tree: DraftTree, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                          generator: torch.Generator | None = None, pad_token_id: int = 0) -> TreeVerificationResult:
    """Lossless multi-candidate speculative sampling over a tree (the algorithm and its proof: module docstring).

    Args:
        tree: `DraftTree`, node n drawn from `draft_probs[:, n]` (given its path and earlier siblings).
        draft_probs: `[B, N, V]` the nodes' exact proposal distributions (after the target side's processing).
        target_probs: `[B, 1 + N, V]` target distributions at the anchor and after each node (same processing).
        generator: RNG for the acceptance tests and the emitted token.
    """
    b, n = tree.tokens.shape
    device = tree.tokens.device
    draft_probs, target_probs = draft_probs.float().to(device), target_probs.float().to(device)
    u = torch.rand(b, n, device=device, generator=generator)  # one uniform per node column
    rows = torch.arange(b, device=device)
    current = torch.full((b,), -1, dtype=torch.long, device=device)  # the accepted node, -1 = the anchor
    p = target_probs[:, 0]  # [B, V] the distribution the next token must follow (residual after rejections)
    reached = torch.zeros(b, n, dtype=torch.bool, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    untried = tree.valid.clone()
    for _ in range(tree.max_depth):
        children = untried & (tree.parents == current[:, None]) & ~done[:, None]  # [B, N]
        moved = torch.zeros(b, dtype=torch.bool, device=device)
        while True:
            has = children.any(dim=1) & ~moved
            if not bool(has.any()):
                break
            child = children.int().argmax(dim=1)  # the first untried child, in creation order
            x = tree.tokens[rows, child]
            q = draft_probs[rows, child]  # [B, V]
            p_x = p.gather(1, x[:, None]).squeeze(1)
            q_x = q.gather(1, x[:, None]).squeeze(1)
            accept = has & (u[rows, child] * q_x <= p_x)  # u <= p / q without dividing by q
            reject = has & ~accept
            residual = (p - q).clamp(min=0)
            mass = residual.sum(dim=-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), p)
            p = torch.where(reject[:, None], residual, p)
            children[rows[has], child[has]] = False
            moved |= accept
            reached[rows[accept], child[accept]] = True
            current = torch.where(accept, child, current)
            p = torch.where(accept[:, None], target_probs[rows, child + 1], p)
        done |= ~moved  # every child rejected (or none): the token comes from p
        if bool(done.all()):
            break
    next_tokens = torch.multinomial(p, 1, generator=generator).squeeze(1)
    return _finish(tree, reached, next_tokens, pad_token_id)


def tree_verify(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None = None, pad_token_id: int = 0) -> TreeVerificationResult:
    """Greedy or rejection verification of a tree from the raw target logits `[B, 1 + N, V]`; the nodes' logits are
    already processed (as `DraftTree.logits` are)."""
    if not sampling.do_sample:
        return tree_greedy_verify(tree, target_logits, pad_token_id)
    target_probs = torch.softmax(sampling.warp(target_logits), dim=-1)
    return tree_rejection_verify(tree, tree.probs, target_probs, generator, pad_token_id)
