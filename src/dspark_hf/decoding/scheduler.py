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

**Padded verification** (`schedule_width`, `schedule_tree(..., padded=True)`). Algorithm 1 prices B = sum_r (1 + l_r),
what a serving engine runs with ragged batches. A transformers forward is a rectangle: every row feeds
1 + max_r l_r tokens (shorter rows are padded), so the forward costs SPS(R * (1 + max_r l_r)) whatever the shorter
rows verify, and once the widest row has paid for a width every other row verifies up to it for free. The padded rule
scans widths instead of candidates: level m holds every row's m-th best candidate (on a chain, draft m), and

    Theta(m) = (R + sum_{i<=m} sum_r v_{r,i}) * SPS(R * (1 + m)),

admitting level after level while Theta improves and stopping at the first non-improvement; every row then verifies
its m best candidates. Non-anticipation holds as for Algorithm 1: whether level m is admitted reads the values of
levels <= m, and a row's candidate at level m never depends on its own token or on anything that ranks after it (on a
chain draft m's survival reads drafts < m only; in a tree a node's descendants and later siblings rank after it). On
one request both rules are the same; `batched.generate` uses the padded one (`padded_pricing`).

Trees (`tree.DraftTree`): the same objective over nodes instead of prefixes. `schedule_tree`, `threshold_tree`,
`async_tree` and `expected_tree_throughput` take each node's survival s_{r,n} (the prefix survival along its path:
the product of its ancestors' and its own conditional estimates) and a `[R, N]` validity mask, and return the nodes to
verify `[R, N]`: B = sum_r (1 + #admitted_r), tau = sum_r (1 + sum of admitted s_{r,n}). On a chain they equal the
prefix functions above exactly (node n = position n + 1, the same tie-break). Under load the admission threshold
rises, so the alternatives (lower survival than the chain's head) go first: trees shrink to chains, chains to nothing.

**Pricing tree growth** (`GrowthCost`). The chain is drafted whatever is verified, but every node off it (a *branch*,
node index >= `num_chain`) first has to be grown: one growth step of `tree._TreeGrower` (a sequential-head step, a
projection over the slot's M candidates, the frontier update; vectorised, so one step adds a node to every growing
row) costs `step_seconds`, and a round that grows at all pays `tree_seconds` once (the grower's set-up, the tree's
selection, per-node inputs and 4-D mask, tree verification). Both are measured on the machine, on past rounds
(`round_state.GrowthClock`). With `growth=`, the tree functions price them in the same objective: in the sorted
order, the first n candidates need g_n = max over rows of the branches among them growth steps, and

    Theta_n = tau_n / (1 / SPS(B_n) + tree_seconds * [g_n > 0] + step_seconds * g_n).

A branch whose admission does not improve Theta is skipped, and its row admits no further branch (they rank lower
and need at least as much growth), instead of ending the admission: a chain node ranked after it needs no growth and
may still pay. A chain node that does not improve Theta ends it, as in Algorithm 1. `growth=None` (or a free
`GrowthCost`) is Theta_n = tau_n * SPS(B_n) with the plain break, bit for bit today's. `schedule_growth` runs the
same break *before* each growth step, over the candidates known then (every chain node, the branches grown so far,
and each row's next best-first candidate, whose survival estimate is known before its token is drawn): it says which
rows grow their next node. Its first call reads the chain's survivals and the estimates of the chain nodes' first
siblings only, so when no branch pays nothing is grown and the round is the chain's (`batched.generate` then
verifies it exactly as `tree_budget=None` does: no tree, no 4-D mask).

Why the pricing keeps non-anticipation: the priced break is a prefix rule. Whether candidate n is admitted (or
grown) is decided by a scan of the sorted order that has looked only at the positions before n and at n's own
estimate, never at n's token; skipping a branch, stopping its row's branches and the price of a position (its width
and the growth steps the admitted prefix needs) are all functions of that prefix. Candidates ranked before n are
outside n's subtree (see `schedule_tree`); a branch grown by an earlier step was itself decided by the prefix above
it, and each row's next candidate is its best-first frontier key (ancestors and earlier siblings only), so the set of
nodes that exist when n is decided never depends on n's subtree either. The chain is drafted before any of this and
is never dropped from the tree, only from verification, by the same prefix rule.

Every function runs on a few thousand candidates in well under a millisecond (R = 256, K = 16 is 4096), except the
priced scan (a Python loop over the sorted candidates: about a millisecond per thousand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import torch

__all__ = [
    "POLICIES",
    "GrowthCost",
    "SPSLike",
    "WithRoundOverhead",
    "async_lengths",
    "async_tree",
    "async_width",
    "cap_tree",
    "expected_throughput",
    "expected_tree_throughput",
    "fixed_lengths",
    "prefix_survival",
    "schedule_growth",
    "schedule_prefix",
    "schedule_tree",
    "schedule_width",
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


def _level_theta(levels: torch.Tensor, num_requests: int, sps: SPSLike, steps: torch.Tensor | None = None,
                 growth: GrowthCost | None = None) -> torch.Tensor:
    """Theta(m) for m = 0..M admitted levels of a padded batch: `levels` `[M]` is each level's summed value (expected
    accepted tokens), a level costs `num_requests` tokens of width; with `growth`, `steps` `[M + 1]` growth steps."""
    tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), levels.double().cumsum(0)])
    batch = num_requests * (1 + torch.arange(len(levels) + 1))
    if growth is None or growth.free or steps is None:
        return tau * sps_values(sps, batch)
    seconds = 1.0 / sps_values(sps, batch) + growth.tree_seconds * (steps > 0).double() + growth.step_seconds * steps
    return tau / seconds


def schedule_width(confidences: torch.Tensor, sps: SPSLike, early_stop: bool = True) -> torch.Tensor:
    """Algorithm 1 for a padded verification batch (module docstring): lengths `[R]`, all equal to the width m
    maximising Theta(m) = (R + sum_r sum_{j<=m} a_{r,j}) * SPS(R * (1 + m)), with the break (`early_stop`) or the
    global argmax (not lossless on live confidences). On one request it equals `schedule_prefix`."""
    survival = prefix_survival(confidences)
    r = survival.shape[0]
    if r == 0:
        raise ValueError("schedule_width needs at least one request")
    width = _break(_level_theta(survival.double().sum(dim=0), r, sps), early_stop)
    return torch.full((r,), width, dtype=torch.long)


def async_width(current: torch.Tensor, stale: torch.Tensor, sps: SPSLike) -> torch.Tensor:
    """Section 5.2 on a padded batch: the width from a global search over confidences two rounds old, applied to every
    row of the current block (it never reads the current drafts)."""
    if stale.shape[0] != current.shape[0]:
        raise ValueError(f"stale confidences have {stale.shape[0]} rows, current have {current.shape[0]}")
    width = int(schedule_width(stale, sps, early_stop=False)[0])
    return torch.full((current.shape[0],), min(width, current.shape[1]), dtype=torch.long)


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


def expected_throughput(confidences: torch.Tensor, lengths: torch.Tensor, sps: SPSLike, padded: bool = False) -> float:
    """Theta = tau * SPS(B) for given lengths: tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), B = sum_r (1 + l_r)
    (`padded`: B = R * (1 + max_r l_r), the rectangle a transformers forward runs)."""
    survival = prefix_survival(confidences)
    r, k = survival.shape
    admitted = torch.arange(k)[None, :] < lengths[:, None]
    tau = r + float((survival * admitted).sum())
    batch = int(r * (1 + lengths.max())) if padded and r else int(r + lengths.sum())
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


@dataclass(frozen=True)
class GrowthCost:
    """What growing a tree beyond its chain costs, in seconds (measured on the machine: `round_state.GrowthClock`).

    Attributes:
        step_seconds: one growth step: one more node in every growing row (a sequential-head step, a projection over
            the slot's M candidates, the frontier update, the growth plan's own check).
        tree_seconds: once per round that grows at all: the grower's set-up, the tree's selection, its per-node
            inputs and 4-D attention mask, and tree verification.
    """

    step_seconds: float = 0.0
    tree_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (self.step_seconds >= 0 and self.tree_seconds >= 0):
            raise ValueError(f"GrowthCost needs seconds >= 0, got {self.step_seconds}, {self.tree_seconds}")

    @property
    def free(self) -> bool:
        """Whether growth costs nothing (the tree functions then price verification width alone)."""
        return self.step_seconds == 0 and self.tree_seconds == 0


def _growth_steps(rows: torch.Tensor, branch: np.ndarray, num_requests: int) -> np.ndarray:
    """g_n for n = 1..L sorted candidates: the growth steps the first n need, max over rows of their branches."""
    steps = np.zeros(len(branch), dtype=np.float64)
    where = np.flatnonzero(branch)
    if len(where):
        owner = rows.numpy()[where]
        order = np.argsort(owner, kind="stable")  # by row, each row's branches in sorted order
        grouped = owner[order]
        rank = np.arange(len(grouped)) - np.searchsorted(grouped, grouped, side="left") + 1
        steps[where[order]] = rank  # the k-th branch of its row needs k steps
    return np.maximum.accumulate(steps)


def _tree_throughput_curve(values: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor, num_requests: int,
                           sps: SPSLike, growth: GrowthCost | None, num_chain: int | None) -> torch.Tensor:
    """Theta_n for n = 0..L sorted candidates, growth priced (module docstring). float64 `[L + 1]`."""
    if growth is None or growth.free:
        return _throughput_curve(values, num_requests, sps)
    if num_chain is None:
        raise ValueError("pricing growth needs num_chain (node indices >= num_chain are the branches to grow)")
    tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), values.double().cumsum(0)])
    batch = num_requests + torch.arange(len(values) + 1)
    steps = torch.from_numpy(np.concatenate([[0.0], _growth_steps(rows, (nodes >= num_chain).numpy(),
                                                                  num_requests)]))
    seconds = (1.0 / sps_values(sps, batch) + growth.tree_seconds * (steps > 0).double()
               + growth.step_seconds * steps)
    return tau / seconds


def _priced_scan(values: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor, num_requests: int, sps: SPSLike,
                 growth: GrowthCost, num_chain: int) -> list[int]:
    """Algorithm 1's break with growth priced: the sorted positions admitted. A branch that does not improve Theta
    is skipped and its row verifies no further branch this round (its later branches rank lower and need at least
    the same growth); a chain node that does not improve Theta ends the admission (the break). Every decision reads
    the sorted prefix before it only."""
    curve = sps_values(sps, num_requests + torch.arange(len(values) + 1))  # SPS(B) for B = R .. R + L
    steps_per_second, inverse = curve.tolist(), (1.0 / curve).tolist()
    counts = [0] * num_requests
    stopped = [False] * num_requests
    acc, admitted, steps, theta = 0.0, 0, 0, float(num_requests) * steps_per_second[0]
    chosen = []
    step_s, tree_s = growth.step_seconds, growth.tree_seconds
    for position, (value, row, node) in enumerate(zip(values.tolist(), rows.tolist(), nodes.tolist())):
        branch = node >= num_chain
        if branch and stopped[row]:
            continue
        g = max(steps, counts[row] + 1) if branch else steps
        tau = num_requests + (acc + value)
        if g == 0:  # no growth yet: exactly the unpriced Theta
            candidate = tau * steps_per_second[admitted + 1]
        else:
            candidate = tau / (inverse[admitted + 1] + tree_s + step_s * g)
        if candidate > theta:
            chosen.append(position)
            acc, admitted, steps, theta = acc + value, admitted + 1, g, candidate
            if branch:
                counts[row] += 1
        elif branch:
            stopped[row] = True
        else:
            break
    return chosen


def _break(theta: torch.Tensor, early_stop: bool) -> int:
    if early_stop:
        improves = theta[1:] > theta[:-1]
        return int(torch.cumprod(improves.long(), 0).sum()) if len(improves) else 0
    return int(torch.argmax(theta))  # first maximum: the smallest batch among ties


def _ranked_per_row(survival: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's valid nodes by survival descending, ties by node index (a node after its parent and earlier
    siblings, as in `_sorted_nodes`). Returns (values `[R, N]` float64, 0 past a row's valid nodes; node indices
    `[R, N]`; live `[R, N]` bool)."""
    n = survival.shape[1]
    keys = survival.double() - torch.arange(n, dtype=torch.float64)[None, :] * _TIE_BREAK
    keys = keys.masked_fill(~valid, -math.inf)
    order = torch.argsort(keys, dim=1, descending=True)
    live = valid.gather(1, order)
    values = survival.double().gather(1, order).masked_fill(~live, 0.0)
    return values, order, live


def _padded_tree(survival: torch.Tensor, valid: torch.Tensor, sps: SPSLike, early_stop: bool,
                 growth: GrowthCost | None, num_chain: int | None) -> torch.Tensor:
    """`schedule_tree(..., padded=True)`: the level scan over each row's ranked nodes (module docstring), growth
    priced per level as the most branches any row's admitted nodes hold."""
    values, order, live = _ranked_per_row(survival, valid)
    r = survival.shape[0]
    steps = None
    if growth is not None and not growth.free:
        branches = ((order >= num_chain) & live).long().cumsum(dim=1).max(dim=0).values.double()
        steps = torch.cat([torch.zeros(1, dtype=torch.float64), branches])
    return _best_per_row(order, live, _break(_level_theta(values.sum(dim=0), r, sps, steps, growth), early_stop))


def _best_per_row(order: torch.Tensor, live: torch.Tensor, width: int) -> torch.Tensor:
    """`[R, N]` mask of each row's first `width` ranked nodes (`_ranked_per_row`'s order and liveness)."""
    mask = torch.zeros(order.shape, dtype=torch.bool)
    mask.scatter_(1, order[:, :width], live[:, :width])
    return mask


def schedule_tree(survival: torch.Tensor, valid: torch.Tensor, sps: SPSLike, early_stop: bool = True, *,
                  growth: GrowthCost | None = None, num_chain: int | None = None,
                  padded: bool = False) -> torch.Tensor:
    """Algorithm 1 over tree nodes: the `[R, N]` mask of nodes to verify, maximising Theta = tau * SPS(B).

    Candidates (r, n) are admitted in descending survival s_{r,n} (ties: node index, then request) while Theta
    improves; `early_stop` stops at the first non-improvement. With `growth` (and `num_chain`: nodes at index >=
    `num_chain` are branches) Theta also prices the growth steps and the per-round tree cost the admitted branches
    need (module docstring): a branch is verified only when it pays for its width *and* its growth, and one that does
    not is skipped with its row's later branches while chain nodes ranked after it are still considered; with a free
    `GrowthCost` (or None) the result is exactly the unpriced one.

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

    `padded=True` prices the rectangle a transformers forward runs (module docstring): levels of every row's m-th
    best node, each costing R tokens, with the break; growth is priced per level (a level whose branches do not pay
    ends the admission, as a chain node does). On a chain it equals `schedule_width`.
    """
    survival, valid = _check_survival(survival, valid)
    r = survival.shape[0]
    if r == 0:
        raise ValueError("schedule_tree needs at least one request")
    priced = growth is not None and not growth.free
    if priced and num_chain is None:
        raise ValueError("pricing growth needs num_chain (node indices >= num_chain are the branches to grow)")
    if padded:
        return _padded_tree(survival, valid, sps, early_stop, growth if priced else None, num_chain)
    values, rows, nodes = _sorted_nodes(survival, valid)
    if priced and early_stop and bool((nodes >= num_chain).any()):
        chosen = torch.tensor(_priced_scan(values, rows, nodes, r, sps, growth, num_chain), dtype=torch.long)
        mask = torch.zeros(survival.shape, dtype=torch.bool)
        mask[rows[chosen], nodes[chosen]] = True
        return mask
    theta = _tree_throughput_curve(values, rows, nodes, r, sps, growth if priced else None, num_chain)
    return _admitted_nodes(rows, nodes, _break(theta, early_stop), survival.shape)


def schedule_growth(survival: torch.Tensor, valid: torch.Tensor, next_survival: torch.Tensor,
                    next_valid: torch.Tensor, sps: SPSLike, growth: GrowthCost | None,
                    num_chain: int, padded: bool = False) -> torch.Tensor:
    """`[R]` bool: which rows grow their next node, decided before it is drawn.

    Args:
        survival, valid: `[R, N]` the nodes known now (the chain at indices < `num_chain`, then the branches grown so
            far, in creation order).
        next_survival, next_valid: `[R]` each row's next best-first candidate: its survival estimate (known before
            its token is drawn) and whether it has one. It will become node N.
        sps, growth, num_chain: as for `schedule_tree`.

    The candidate is grown iff the priced break (`schedule_tree(..., growth=growth)`) over the known nodes plus the
    candidates admits it: a prefix rule, so the decision reads only the candidates ranked before it and its own
    estimate (module docstring). With a free `growth` only verification width is priced.
    """
    survival, valid = _check_survival(survival, valid)
    known = torch.cat([survival, next_survival.detach().float().cpu()[:, None].clamp(0.0, 1.0)], dim=1)
    live = torch.cat([valid, next_valid.detach().bool().cpu()[:, None]], dim=1)
    known = known.masked_fill(~live, 0.0)  # (-inf keys of rows without a candidate)
    return schedule_tree(known, live, sps, growth=growth, num_chain=num_chain, padded=padded)[:, -1] & live[:, -1]


def threshold_tree(survival: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """The valid nodes with s_{r,n} >= threshold (closed under parents: survival never increases down a path)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    survival, valid = _check_survival(survival, valid)
    return valid & (survival >= threshold)


def cap_tree(survival: torch.Tensor, admitted: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """Each row's `max_nodes` admitted nodes of highest survival (ties: node index): a verification width per row, so
    that a tree's alternatives replace the chain's unlikely tail instead of widening the forward.

    The result stays a tree per row: survival never increases from parent to child, and a tie ranks the parent
    (created first) before its child. Non-anticipation (Appendix A, as for `schedule_tree`): node n is kept iff fewer
    than `max_nodes` kept-able nodes rank before it; its later siblings and all their descendants and its own
    descendants rank after it (keys never increase along first-child and next-sibling edges when sampling, and those
    nodes are created after n), so the decision reads only nodes outside n's subtree in the left-child right-sibling
    view, and n's own key, which reads its ancestors and earlier siblings only.
    """
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
    survival, admitted = _check_survival(survival, admitted)
    _, order, live = _ranked_per_row(survival, admitted)
    return _best_per_row(order, live, max_nodes)


def async_tree(survival: torch.Tensor, valid: torch.Tensor, stale_survival: torch.Tensor, stale_valid: torch.Tensor,
               sps: SPSLike, *, growth: GrowthCost | None = None, num_chain: int | None = None,
               padded: bool = False) -> torch.Tensor:
    """Section 5.2 for trees: the token budget from a global search over the node survivals of two rounds ago
    (`stale_*`, rows aligned with the current ones; growth priced as in `schedule_tree` when given), then the current
    nodes top-budget by current survival (the ranking puts a node after its parent and earlier siblings, so the
    admitted set is a tree per row)."""
    if stale_survival.shape[0] != survival.shape[0]:
        raise ValueError(f"stale survivals have {stale_survival.shape[0]} rows, current have {survival.shape[0]}")
    stale = schedule_tree(stale_survival, stale_valid, sps, early_stop=False, growth=growth, num_chain=num_chain,
                          padded=padded)
    survival, valid = _check_survival(survival, valid)
    if padded:  # the stale width, each current row's best nodes up to it
        _, order, live = _ranked_per_row(survival, valid)
        return _best_per_row(order, live, int(stale.sum(dim=1).max()) if stale.numel() else 0)
    budget = int(stale.sum())
    values, rows, nodes = _sorted_nodes(survival, valid)
    return _admitted_nodes(rows, nodes, min(budget, len(values)), survival.shape)


def expected_tree_throughput(survival: torch.Tensor, admitted: torch.Tensor, sps: SPSLike, *,
                             growth: GrowthCost | None = None, growth_steps: int = 0, padded: bool = False) -> float:
    """Theta = tau * SPS(B) for the admitted nodes `[R, N]`: tau = R + sum of their survivals, B = R + their count
    (`padded`: R * (1 + the most any row admits)); with `growth`, the round's time also counts `growth_steps` growth
    steps (and the tree cost when > 0)."""
    survival = survival.detach().float().cpu()
    admitted = admitted.cpu()
    r = survival.shape[0]
    tau = r + float((survival * admitted).sum())
    batch = int(r * (1 + admitted.sum(dim=1).max())) if padded and r else int(r + admitted.sum())
    steps_per_second = float(sps_values(sps, torch.tensor([batch]))[0])
    if growth is None or growth.free or growth_steps <= 0:
        return tau * steps_per_second
    return tau / (1.0 / steps_per_second + growth.tree_seconds + growth.step_seconds * growth_steps)


POLICIES = ("fixed", "threshold", "scheduled", "async")
