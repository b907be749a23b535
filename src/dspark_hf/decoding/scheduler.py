"""Verification-length policies: how many drafts each request of a batch verifies (paper 3.2.2, 5.2, Appendix A).

Pure functions from a `[R, K]` tensor of per-position confidences c_{r,j} (the probability that draft j survives given
that drafts < j did) and a cost curve SPS(B) (target forward steps per second at a verification batch of B tokens) to
per-request lengths `[R]` in 0..K.

* `prefix_survival`: a_{r,j} = prod_{i<=j} c_{r,i}.
* `fixed_lengths`: verify the whole block.
* `threshold_lengths`: a static cut, l_r = #{j : a_{r,j} >= threshold}.
* `schedule_prefix` (Algorithm 1): admit candidates (r, j) globally in descending a_{r,j}; the batch is
  B = sum_r (1 + l_r) tokens and the expected emitted tokens tau = sum_r (1 + sum_{j<=l_r} a_{r,j}); keep an admission
  while Theta = tau * SPS(B) improves and **stop at the first non-improvement**. The break is what keeps decoding
  lossless: the admission of x_j must not depend on x_j, and a_{r,j+1} does (the confidence head reads x_j).
  `early_stop=False` gives the global search, which is NOT lossless on live confidences (Appendix A) and exists for
  tests and for `async_lengths`.
* `async_lengths` (section 5.2): the token budget K comes from a global search over confidences two steps old (no
  break needed: they cannot depend on the current drafts), then the current candidates are admitted top-K by their
  current survival. Ties are broken by position then request, so (r, j) always precedes (r, j + 1) and a decision on
  x_j never reads x_j.

Trees (`tree.DraftTree`): the same objective over nodes instead of prefixes. `schedule_tree`, `threshold_tree`,
`async_tree` and `expected_tree_throughput` take each node's survival s_{r,n} (the prefix survival along its path:
the product of its ancestors' and its own conditional estimates) and a `[R, N]` validity mask, and return the nodes to
verify `[R, N]`: B = sum_r (1 + #admitted_r), tau = sum_r (1 + sum of admitted s_{r,n}). On a chain they equal the
prefix functions above exactly (node n = position n + 1, the same tie-break). Under load the admission threshold
rises, so the alternatives (lower survival than the chain's head) go first: trees shrink to chains, chains to nothing.

Every function runs on a few thousand candidates in well under a millisecond (R = 256, K = 16 is 4096).
"""

from __future__ import annotations

from typing import Callable, Union

import numpy as np
import torch

__all__ = [
    "POLICIES",
    "SPSLike",
    "WithRoundOverhead",
    "async_lengths",
    "async_tree",
    "expected_throughput",
    "expected_tree_throughput",
    "fixed_lengths",
    "prefix_survival",
    "schedule_prefix",
    "schedule_tree",
    "sps_values",
    "threshold_lengths",
    "threshold_tree",
    "token_budget",
]

SPSLike = Union[Callable[[torch.Tensor], torch.Tensor], Callable[[int], float], "object"]


def _check_confidences(confidences: torch.Tensor) -> torch.Tensor:
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, K], got shape {tuple(confidences.shape)}")
    confidences = confidences.detach().float()
    if torch.isnan(confidences).any():
        raise ValueError("confidences contain NaN; check the drafter's confidence head (and its STS temperatures)")
    if ((confidences < 0) | (confidences > 1)).any():
        raise ValueError("confidences must lie in [0, 1]")
    return confidences


def prefix_survival(confidences: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}: `[R, K]` -> `[R, K]`."""
    return torch.cumprod(_check_confidences(confidences), dim=1)


def sps_values(sps: SPSLike, batch_tokens: torch.Tensor) -> torch.Tensor:
    """SPS(B) for every B in `batch_tokens` (1-D long tensor), as float64.

    `sps` is an `SPSTable` (anything with `.steps_per_second(tensor)`), a vectorised callable on a tensor, or a plain
    callable on ints (e.g. the paper's toy curves `lambda b: {1: 1.0, 2: 0.5}[b]`)."""
    if hasattr(sps, "steps_per_second"):
        values = sps.steps_per_second(batch_tokens)
    elif callable(sps):
        try:
            values = sps(batch_tokens)
            if not isinstance(values, torch.Tensor) or values.shape != batch_tokens.shape:
                raise TypeError
        except (TypeError, KeyError, ValueError, RuntimeError, IndexError):
            values = torch.tensor([float(sps(int(b))) for b in batch_tokens.tolist()])
    else:
        raise TypeError(f"sps must be an SPSTable or a callable B -> steps/s, got {type(sps).__name__}")
    values = torch.as_tensor(values, dtype=torch.float64)
    if torch.isnan(values).any() or (values <= 0).any():
        raise ValueError("SPS(B) must be positive for every batch size the scheduler considers")
    return values


_TIE_BREAK = 2.0**-40  # far below the float32 spacing of survivals near 1, far above float64 rounding there


def _sorted_candidates(survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened candidates sorted by survival descending, ties by position j then request r.

    Returns (values [R*K] float64, row index [R*K]). The order is a deterministic function of (a, j, r) in which
    (r, j + 1) always comes after (r, j), so whether (r, j) is admitted never depends on a_{r, j+1} (which reads x_j).
    Ties are broken by a tiny position-major offset, which lets a fast unstable sort do the work (numpy's quicksort
    on 4096 keys takes tens of microseconds; a stable sort takes several times longer)."""
    r, k = survival.shape
    flat = survival.t().reshape(-1).double().numpy()  # position-major: index = j * R + r
    keys = flat - np.arange(flat.size) * _TIE_BREAK
    order = np.argsort(-keys, kind="quicksort")
    rows = np.tile(np.arange(r), k)[order]
    return torch.from_numpy(flat[order]), torch.from_numpy(rows)


def _throughput_curve(sorted_values: torch.Tensor, num_requests: int, sps: SPSLike) -> torch.Tensor:
    """Theta_n for n = 0..N admitted candidates: (R + sum of the first n) * SPS(R + n). float64 `[N + 1]`."""
    tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), sorted_values.double().cumsum(0)])
    batch = num_requests + torch.arange(len(sorted_values) + 1)
    return tau * sps_values(sps, batch)


def _lengths_from_admitted(rows: torch.Tensor, admitted: int, num_requests: int) -> torch.Tensor:
    return torch.bincount(rows[:admitted], minlength=num_requests).long()


class WithRoundOverhead:
    """SPS(B) of a whole decoding round: 1 / (1 / SPS_target(B) + overhead_s).

    Algorithm 1 prices only the target's verification forward. When a round also pays a fixed cost that does not
    grow with B (the drafter's forward and sequential loop, bookkeeping) — large on a CPU or with a small target —
    shortening verification saves less than the bare curve promises, because more rounds are needed. The overhead is
    measured on past rounds, so it never depends on the current drafts (the admission rule stays non-anticipating).
    """

    def __init__(self, sps: SPSLike, overhead_s: float) -> None:
        if not overhead_s >= 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
        self.sps, self.overhead_s = sps, float(overhead_s)

    def steps_per_second(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 / sps_values(self.sps, batch_tokens) + self.overhead_s)


def fixed_lengths(confidences_or_shape: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """Every request verifies its whole block."""
    r, k = confidences_or_shape.shape if isinstance(confidences_or_shape, torch.Tensor) else confidences_or_shape
    return torch.full((r,), k, dtype=torch.long)


def threshold_lengths(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """l_r = #{j : a_{r,j} >= threshold} (a prefix, since a_{r,j} is non-increasing in j)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return (prefix_survival(confidences) >= threshold).sum(dim=1).long()


def schedule_prefix(confidences: torch.Tensor, sps: SPSLike, early_stop: bool = True) -> torch.Tensor:
    """Algorithm 1: per-request verification lengths `[R]` maximising Theta = tau * SPS(B).

    Args:
        confidences: `[R, K]` per-position confidences c_{r,j} in [0, 1].
        sps: cost curve (an `SPSTable` or a callable B -> steps/s).
        early_stop: stop at the first admission that does not improve Theta (lossless). `False` searches the whole
            curve: optimal on jagged curves but NOT lossless on live confidences (Appendix A).
    """
    survival = prefix_survival(confidences)
    r = survival.shape[0]
    if r == 0:
        raise ValueError("schedule_prefix needs at least one request")
    values, rows = _sorted_candidates(survival)
    theta = _throughput_curve(values, r, sps)
    if early_stop:
        improves = theta[1:] > theta[:-1]
        admitted = int(torch.cumprod(improves.long(), 0).sum()) if len(improves) else 0
    else:
        admitted = int(torch.argmax(theta))  # first maximum: the smallest batch among ties
    return _lengths_from_admitted(rows, admitted, r)


def token_budget(confidences: torch.Tensor, sps: SPSLike) -> int:
    """The number of draft tokens a global (no-break) search admits: sum_r l_r of `schedule_prefix(.., False)`."""
    return int(schedule_prefix(confidences, sps, early_stop=False).sum())


def async_lengths(current: torch.Tensor, stale: torch.Tensor, sps: SPSLike) -> torch.Tensor:
    """Section 5.2: budget K from `stale` confidences (two steps old, `[R, K]`, rows aligned with `current`), then the
    top-K current candidates by current prefix survival."""
    if stale.shape[0] != current.shape[0]:
        raise ValueError(f"stale confidences have {stale.shape[0]} rows, current have {current.shape[0]}")
    budget = token_budget(stale, sps)
    values, rows = _sorted_candidates(prefix_survival(current))
    return _lengths_from_admitted(rows, min(budget, len(values)), current.shape[0])


def expected_throughput(confidences: torch.Tensor, lengths: torch.Tensor, sps: SPSLike) -> float:
    """Theta = tau * SPS(B) for given lengths: tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), B = sum_r (1 + l_r)."""
    survival = prefix_survival(confidences)
    r, k = survival.shape
    admitted = torch.arange(k)[None, :] < lengths[:, None]
    tau = r + float((survival * admitted).sum())
    batch = int(r + lengths.sum())
    return tau * float(sps_values(sps, torch.tensor([batch]))[0])


# ---------------------------------------------------------------------------------------------- trees
def _check_survival(survival: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if survival.dim() != 2 or valid.shape != survival.shape:
        raise ValueError(f"survival and valid must both be [R, N], got {tuple(survival.shape)} and "
                         f"{tuple(valid.shape)}")
    survival, valid = survival.detach().float().cpu(), valid.detach().bool().cpu()
    live = survival[valid]
    if torch.isnan(live).any():
        raise ValueError("node survivals contain NaN; check the drafter's confidence head (and its STS temperatures)")
    if ((live < 0) | (live > 1)).any():
        raise ValueError("node survivals must lie in [0, 1]")
    return survival, valid


def _sorted_nodes(survival: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The valid nodes sorted by survival descending, ties by node index then request (node-major, as
    `_sorted_candidates` is position-major). Returns (values float64, rows, nodes), each `[#valid]`.

    Node indices follow creation order, in which a node's parent and earlier siblings come first; survival never
    increases from parent to child (and, for sampled trees, from sibling to next sibling), so a node comes after its
    parent (and earlier siblings) whatever the ties."""
    r, n = survival.shape
    flat = survival.t().reshape(-1).double().numpy()  # index = node * R + row
    index = np.flatnonzero(valid.t().reshape(-1).numpy())
    keys = flat[index] - index * _TIE_BREAK
    order = index[np.argsort(-keys, kind="quicksort")]
    return torch.from_numpy(flat[order]), torch.from_numpy(order % r), torch.from_numpy(order // r)


def _admitted_nodes(rows: torch.Tensor, nodes: torch.Tensor, admitted: int, shape: torch.Size) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[rows[:admitted], nodes[:admitted]] = True
    return mask


def schedule_tree(survival: torch.Tensor, valid: torch.Tensor, sps: SPSLike, early_stop: bool = True) -> torch.Tensor:
    """Algorithm 1 over tree nodes: the `[R, N]` mask of nodes to verify, maximising Theta = tau * SPS(B).

    Candidates (r, n) are admitted in descending survival s_{r,n} (ties: node index, then request) while Theta
    improves; `early_stop` stops at the first non-improvement.

    Appendix A's non-anticipation argument, for trees: the admission of node n must not depend on n's own token or on
    anything drawn after it from n's point of view — its descendants, its later siblings and their descendants
    (what the rejection rule at n's parent has not yet looked at). s_{r,n} reads only n's ancestors and earlier
    siblings (the confidence head reads the parent's token; a sibling's estimate reads the earlier siblings'), and in
    a sampled tree (`tree.draft_tree`) it never increases along parent -> first child and sibling -> next sibling
    edges, which are also creation order. So every node that could depend on n ranks after n, and with the break n's
    admission is decided by the candidates ranked before it alone, none of which depend on n: the same argument as for
    (r, j) before (r, j + 1) on a chain. (With `early_stop=False` the argmax over the whole curve reads them: not
    lossless on live survivals.) Greedy output does not depend on what is verified, so greedy trees need only the
    parent -> child order, which keeps the admitted set a tree per row (closed under parents).
    """
    survival, valid = _check_survival(survival, valid)
    r = survival.shape[0]
    if r == 0:
        raise ValueError("schedule_tree needs at least one request")
    values, rows, nodes = _sorted_nodes(survival, valid)
    theta = _throughput_curve(values, r, sps)
    if early_stop:
        improves = theta[1:] > theta[:-1]
        admitted = int(torch.cumprod(improves.long(), 0).sum()) if len(improves) else 0
    else:
        admitted = int(torch.argmax(theta))
    return _admitted_nodes(rows, nodes, admitted, survival.shape)


def threshold_tree(survival: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """The valid nodes with s_{r,n} >= threshold (closed under parents: survival never increases down a path)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    survival, valid = _check_survival(survival, valid)
    return valid & (survival >= threshold)


def async_tree(survival: torch.Tensor, valid: torch.Tensor, stale_survival: torch.Tensor, stale_valid: torch.Tensor,
               sps: SPSLike) -> torch.Tensor:
    """Section 5.2 for trees: the token budget from a global search over the node survivals of two rounds ago
    (`stale_*`, rows aligned with the current ones), then the current nodes top-budget by current survival (the
    ranking puts a node after its parent and earlier siblings, so the admitted set is a tree per row)."""
    if stale_survival.shape[0] != survival.shape[0]:
        raise ValueError(f"stale survivals have {stale_survival.shape[0]} rows, current have {survival.shape[0]}")
    budget = int(schedule_tree(stale_survival, stale_valid, sps, early_stop=False).sum())
    survival, valid = _check_survival(survival, valid)
    values, rows, nodes = _sorted_nodes(survival, valid)
    return _admitted_nodes(rows, nodes, min(budget, len(values)), survival.shape)


def expected_tree_throughput(survival: torch.Tensor, admitted: torch.Tensor, sps: SPSLike) -> float:
    """Theta = tau * SPS(B) for the admitted nodes `[R, N]`: tau = R + sum of their survivals, B = R + their count."""
    survival = survival.detach().float().cpu()
    admitted = admitted.cpu()
    r = survival.shape[0]
    tau = r + float((survival * admitted).sum())
    batch = int(r + admitted.sum())
    return tau * float(sps_values(sps, torch.tensor([batch]))[0])


POLICIES = ("fixed", "threshold", "scheduled", "async")
