"""Tree verification and tree scheduling: pure math (`dspark_hf.decoding.tree_verification`, `scheduler.*_tree`).

* a chain as a tree verifies exactly as `greedy_verify` / `rejection_verify` (same tokens, same random numbers);
* greedy: the accepted path may leave the chain, the kept columns are the anchor and that path;
* sampling: over 200k independent trees, the first two emitted tokens follow the enumerated target joint (a verifier
  given the wrong proposals fails the same bound);
* scheduling: on chains the tree policies equal the prefix policies; under load trees shrink to chains, then to
  nothing; a node's admission never depends on its own subtree (Appendix A's non-anticipation, for trees);
* priced growth: a free growth cost admits exactly as today, a prohibitive one the chain alone; the growth plan
  grows exactly the branches the priced schedule admits (batch 1); pricing keeps non-anticipation.
"""

from __future__ import annotations

import math

import torch

from dspark_hf import DraftBlock, greedy_verify, rejection_verify
import pytest

from dspark_hf.decoding.scheduler import (GrowthCost, async_lengths, async_tree, cap_tree, schedule_growth,
                                          schedule_prefix, schedule_tree, threshold_lengths, threshold_tree)
from dspark_hf.decoding.tree import DraftTree
from dspark_hf.decoding.tree_verification import tree_greedy_verify, tree_rejection_verify


def _tree(tokens, parents, logits=None, survival=None, vocab=8) -> DraftTree:
    tokens, parents = torch.tensor(tokens), torch.tensor(parents)
    depths = torch.zeros_like(tokens)
    for n in range(tokens.shape[1]):  # parents precede children
        depths[:, n] = torch.where(parents[:, n] >= 0, depths.gather(1, parents[:, n: n + 1].clamp(min=0))[:, 0] + 1, 1)
    b, n = tokens.shape
    return DraftTree(tokens=tokens, parents=parents, depths=depths,
                     logits=torch.zeros(b, n, vocab) if logits is None else logits,
                     valid=torch.ones(b, n, dtype=torch.bool), survival=survival,
                     node_ids=torch.arange(n).expand(b, n), num_chain=n)


# ---------------------------------------------------------------------------------------------- chains
def test_a_chain_tree_verifies_exactly_as_the_chain_rules():
    """Ragged chains (l_r drafts of K = 5): greedy and rejection tree verification give the chain rules' accepted
    counts and tokens, bit for bit, with the same generator state."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 5, 6
    tokens = torch.randint(0, v, (b, k), generator=g)
    draft_logits = torch.randn(b, k, v, generator=g) * 2
    target_logits = torch.randn(b, k + 1, v, generator=g) * 2
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    block = DraftBlock(tokens=tokens, logits=draft_logits, confidences=torch.full((b, k), 0.5))
    tree = DraftTree.from_block(block).select(torch.arange(k)[None, :] < lengths[:, None])
    w = int(lengths.max())
    assert tree.is_chain() and tree.tokens.shape == (b, w)
    # greedy (with the drafts sometimes right)
    right = torch.rand(b, k, generator=g) < 0.6
    tokens_g = torch.where(right, target_logits[:, :k].argmax(-1), tokens)
    tree_g = DraftTree.from_block(DraftBlock(tokens=tokens_g, logits=draft_logits)).select(
        torch.arange(k)[None, :] < lengths[:, None])
    ours = tree_greedy_verify(tree_g, target_logits[:, : w + 1])
    theirs = greedy_verify(tokens_g[:, :w], target_logits[:, : w + 1], num_drafts=lengths)
    assert torch.equal(ours.num_accepted, theirs.num_accepted) and torch.equal(ours.next_tokens, theirs.next_tokens)
    assert (ours.num_accepted > 0).any()
    # rejection sampling
    target_probs = torch.softmax(target_logits[:, : w + 1], -1)
    ours = tree_rejection_verify(tree, tree.probs, target_probs, generator=torch.Generator().manual_seed(5))
    theirs = rejection_verify(tokens[:, :w], torch.softmax(draft_logits[:, :w], -1), target_probs, num_drafts=lengths,
                              generator=torch.Generator().manual_seed(5))
    assert torch.equal(ours.num_accepted, theirs.num_accepted) and torch.equal(ours.next_tokens, theirs.next_tokens)
    assert torch.equal(ours.tokens[:, : w + 1], theirs.tokens)
    assert torch.equal(ours.kept, torch.arange(w + 1)[None, :] < (1 + ours.num_accepted)[:, None])


# ---------------------------------------------------------------------------------------------- greedy
def test_greedy_accepts_a_path_that_leaves_the_chain():
    """Row 0: chain [1, 2, 3] is wrong at depth 2; node 3 (a sibling of node 1) matches and its child node 4 too.
    Row 1: the chain is right. The kept columns are the anchor and the path."""
    #            node: 0  1  2  3  4
    tokens = [[1, 2, 3, 5, 6], [1, 2, 3, 5, 6]]
    parents = [[-1, 0, 1, 0, 3], [-1, 0, 1, 0, 3]]
    tree = _tree(tokens, parents)
    v = 8
    argmax = torch.tensor([[1, 5, 0, 0, 6, 7],   # col 0: after the anchor -> 1; col 1: after node 0 -> 5 (not 2)
                           [1, 2, 3, 4, 0, 0]])  # row 1: 1 2 3 then bonus 4
    logits = torch.nn.functional.one_hot(argmax, v).float()
    result = tree_greedy_verify(tree, logits)
    assert result.num_accepted.tolist() == [3, 3]
    assert result.tokens[0].tolist()[:4] == [1, 5, 6, 7] and result.tokens[1].tolist()[:4] == [1, 2, 3, 4]
    assert result.path.tolist() == [[0, 3, 4], [0, 1, 2]]
    assert result.kept.tolist() == [[True, True, False, False, True, True], [True, True, True, True, False, False]]


# ---------------------------------------------------------------------------------------------- sampling
V = 5
TRIALS = 200_000


def _sampling_setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)            # target after the anchor
    p1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)         # target after x1 = a: p1[a]
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)            # draft at depth 1
    q1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)         # draft at depth 2 after a
    return p0, p1, q0, q1


def _draw_trees(q0, q1, generator):
    """Per trial: chain x1 ~ q0, then siblings y ~ q0 \\ {x1}, z ~ q0 \\ {x1, y} (without replacement), and a child
    under x1 and under y drawn from q1[parent]. Nodes: 0 = x1, 1 = child of x1, 2 = y, 3 = z, 4 = child of y."""
    n = TRIALS
    logits0 = q0.log().expand(n, V).clone()
    x1 = torch.multinomial(logits0.softmax(-1), 1, generator=generator).squeeze(1)
    l_y = logits0.scatter(1, x1[:, None], float("-inf"))
    y = torch.multinomial(l_y.softmax(-1), 1, generator=generator).squeeze(1)
    l_z = l_y.scatter(1, y[:, None], float("-inf"))
    z = torch.multinomial(l_z.softmax(-1), 1, generator=generator).squeeze(1)
    l_c1, l_c2 = q1[x1].log(), q1[y].log()
    c1 = torch.multinomial(l_c1.softmax(-1), 1, generator=generator).squeeze(1)
    c2 = torch.multinomial(l_c2.softmax(-1), 1, generator=generator).squeeze(1)
    tokens = torch.stack([x1, c1, y, z, c2], 1)
    parents = torch.tensor([-1, 0, -1, -1, 2]).expand(n, 5)
    logits = torch.stack([logits0, l_c1, l_y, l_z, l_c2], 1)
    tree = DraftTree(tokens=tokens, parents=parents, depths=torch.tensor([1, 2, 1, 1, 2]).expand(n, 5),
                     logits=logits, valid=torch.ones(n, 5, dtype=torch.bool), survival=None,
                     node_ids=torch.arange(5).expand(n, 5), num_chain=2)
    return tree


def _target_columns(tree, p0, p1):
    """[n, 1 + N, V]: p0 after the anchor, p1[token] after a depth-1 node, anything after a depth-2 node."""
    n = tree.tokens.shape[0]
    after = p1[tree.tokens]  # [n, N, V]
    return torch.cat([p0.expand(n, 1, V), after], dim=1)


def _tv_and_expected(codes, exact):
    n = len(codes)
    empirical = torch.bincount(codes, minlength=len(exact)).double() / n
    expected = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n)).sum().item()
    return 0.5 * (empirical - exact).abs().sum().item(), expected


def test_tree_rejection_sampling_follows_the_target_joint():
    """200k independent trees of 5 nodes (3 candidates at depth 1 drawn without replacement, one continuation under
    two of them). The first two emitted tokens' joint over V^2 = 25 cells: TV < 3x the TV expected from exact
    sampling with as many samples (~0.006 here). Power: the same verifier told that every sibling was drawn from the
    parent's full q (not q without the earlier siblings) is off by more than 4x the bound; branching matters: the
    accepted path runs through a sibling in a large share of trials."""
    p0, p1, q0, q1 = _sampling_setup()
    tree = _draw_trees(q0, q1, torch.Generator().manual_seed(1))
    target = _target_columns(tree, p0, p1)
    result = tree_rejection_verify(tree, tree.probs, target, generator=torch.Generator().manual_seed(2))
    exact = (p0[:, None] * p1).reshape(-1).double()
    tv, expected = _tv_and_expected(_first_two(result, p1), exact)
    assert tv < 3 * expected, (tv, expected)
    via_sibling = (result.path[:, 0] >= 2).float().mean().item()
    assert via_sibling > 0.15, via_sibling
    assert (result.num_accepted == 2).float().mean() > 0.05  # depth-2 nodes are accepted too
    # power: wrong proposals for the siblings (their parent's q) bias the output
    wrong = tree.logits.clone()
    wrong[:, 2] = wrong[:, 3] = q0.log()
    lossy = tree_rejection_verify(tree, torch.softmax(wrong, -1), target, generator=torch.Generator().manual_seed(2))
    tv_wrong, _ = _tv_and_expected(_first_two(lossy, p1), exact)
    assert tv_wrong > 4 * 3 * expected, (tv_wrong, expected)


def _first_two(result, p1) -> torch.Tensor:
    """Cell index first * V + second of the first two tokens; where a round emitted only one, the second is drawn
    from the target (as the next round would, exactly): the joint is the target's iff the tree round is lossless."""
    first = result.tokens[:, 0]
    fill = torch.multinomial(p1[first], 1, generator=torch.Generator().manual_seed(3)).squeeze(1)
    second = torch.where(result.num_accepted >= 1, result.tokens[:, 1], fill)
    return first * V + second


# ---------------------------------------------------------------------------------------------- scheduling
def _sps(slope):
    return lambda b: 1.0 / (1.0 + slope * b)


def test_tree_policies_on_chains_equal_the_prefix_policies():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(32, 6, generator=g)
    survival, valid = torch.cumprod(conf, 1), torch.ones(32, 6, dtype=torch.bool)
    for slope in (0.0005, 0.01, 0.05):
        lengths = schedule_prefix(conf, _sps(slope))
        assert torch.equal(schedule_tree(survival, valid, _sps(slope)).sum(1), lengths)
        assert torch.equal(schedule_tree(survival, valid, _sps(slope)), torch.arange(6)[None] < lengths[:, None])
    assert torch.equal(threshold_tree(survival, valid, 0.3).sum(1), threshold_lengths(conf, 0.3))
    stale = torch.rand(32, 6, generator=g)
    assert torch.equal(async_tree(survival, valid, torch.cumprod(stale, 1), valid, _sps(0.01)).sum(1),
                       async_lengths(conf, stale, _sps(0.01)))


def test_under_load_trees_shrink_to_chains_then_to_nothing():
    """16 rows, each a chain of 4 (c = 0.8) plus 4 alternatives of lower survival. As the cost per verified token
    grows, the scheduler first drops alternatives, then chain drafts, and finally verifies nothing."""
    r = 16
    chain = torch.cumprod(torch.full((r, 4), 0.8), 1)
    alternatives = torch.tensor([0.12, 0.06, 0.05, 0.02]).expand(r, 4)  # siblings / continuations, all below a_4
    survival = torch.cat([chain, alternatives], 1)
    valid = torch.ones(r, 8, dtype=torch.bool)
    alt_counts, chain_counts = [], []
    for slope in (0.0, 0.001, 0.01, 0.03, 0.08, 0.3, 3.0):
        admitted = schedule_tree(survival, valid, _sps(slope))
        alt_counts.append(int(admitted[:, 4:].sum()))
        chain_counts.append(int(admitted[:, :4].sum()))
        assert not (admitted[:, 4:].any() and not admitted[:, :4].all())  # alternatives only once chains are whole
    assert alt_counts[0] == 4 * r and chain_counts[0] == 4 * r  # free verification: the whole trees
    assert alt_counts == sorted(alt_counts, reverse=True) and chain_counts == sorted(chain_counts, reverse=True)
    assert any(a == 0 and c == 4 * r for a, c in zip(alt_counts, chain_counts))  # chains only
    assert alt_counts[-1] == 0 and chain_counts[-1] == 0  # nothing


def _monotone_random_trees(g: torch.Generator, r: int, n: int, chain: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`r` random trees of `n` nodes (the first `chain` a chain) whose survival keys never increase along
    first-child / next-sibling edges (creation order): parents and survival `[r, n]`."""
    parents = torch.full((r, n), -1)
    survival = torch.zeros(r, n)
    for row in range(r):
        for node in range(n):
            parent = node - 1 if node < chain else (int(torch.randint(-1, node, (1,), generator=g)) if node else -1)
            parents[row, node] = parent
            earlier = [m for m in range(node) if int(parents[row, m]) == parent]
            cap = float(survival[row, earlier[-1]]) if earlier else (
                1.0 if parent < 0 else float(survival[row, parent]))
            survival[row, node] = cap * float(torch.rand(1, generator=g)) ** 0.3
    return parents, survival


def _subtree_of(parents: torch.Tensor, node: int) -> set[int]:
    """Node's subtree in the left-child right-sibling view (itself excluded): its later siblings, its descendants and
    theirs."""
    sub: set[int] = set()
    for m in range(node + 1, parents.shape[0]):
        p = int(parents[m])
        if p == int(parents[node]) or p == node or p in sub:
            sub.add(m)
    return sub


def test_a_nodes_admission_never_depends_on_its_own_subtree():
    """Random trees with keys that never increase along first-child / next-sibling edges (creation order). Changing
    the survivals inside node n's subtree (itself excluded; its descendants, later siblings and theirs), keeping that
    invariant, never changes whether n is admitted, under Algorithm 1 with the break."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        r, n = 3, 7
        parents, survival = _monotone_random_trees(g, r, n)
        valid = torch.ones(r, n, dtype=torch.bool)
        sps = _sps(float(torch.rand(1, generator=g)) * 0.2)
        base = schedule_tree(survival, valid, sps)
        row, node = int(torch.randint(0, r, (1,), generator=g)), int(torch.randint(0, n, (1,), generator=g))
        # node's subtree in the left-child right-sibling view: later siblings, descendants of node and of them
        sub = _subtree_of(parents[row], node)
        changed = survival.clone()
        for m in sorted(sub):  # shrink the subtree's keys (keeps the invariant)
            changed[row, m] = changed[row, m] * float(torch.rand(1, generator=g))
        assert bool(schedule_tree(changed, valid, sps)[row, node]) == bool(base[row, node]), trial


def test_cap_tree_keeps_each_rows_most_likely_admitted_nodes_as_a_tree():
    """`cap_tree`: per row the `max_nodes` admitted nodes of highest survival (ties: the earlier node), never a node
    the policy did not admit, always closed under parents; a cap at or above the admitted count changes nothing."""
    survival = torch.tensor([[0.6, 0.3, 0.1, 0.5, 0.3, 0.05],
                             [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    admitted = torch.tensor([[True, True, True, True, True, True],
                             [True, True, True, False, False, False]])
    capped = cap_tree(survival, admitted, 3)
    assert capped.tolist() == [[True, True, False, True, False, False],  # 0.6, 0.5, then of the tied 0.3 node 1
                               [True, True, True, False, False, False]]  # row 1 admits only 3: unchanged
    assert torch.equal(cap_tree(survival, admitted, 6), admitted)
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        parents, surv = _monotone_random_trees(g, 3, 9, chain=4)
        allowed = schedule_tree(surv, torch.ones(3, 9, dtype=torch.bool), _sps(0.01))
        width = int(torch.randint(1, 6, (1,), generator=g))
        kept = cap_tree(surv, allowed, width)
        assert bool((kept <= allowed).all()) and bool((kept.sum(1) <= width).all()), trial
        assert torch.equal(kept.sum(1), allowed.sum(1).clamp(max=width)), trial
        for row in range(3):  # closed under parents, and nothing dropped outranks what was kept
            for node in kept[row].nonzero().flatten().tolist():
                p = int(parents[row, node])
                assert p < 0 or bool(kept[row, p]), (trial, row, node)
            dropped = surv[row][allowed[row] & ~kept[row]]
            if dropped.numel() and kept[row].any():
                assert float(dropped.max()) <= float(surv[row][kept[row]].min()), trial


def test_a_capped_nodes_admission_never_depends_on_its_own_subtree():
    """As for Algorithm 1: shrinking the keys inside node n's left-child right-sibling subtree (keeping keys
    non-increasing along creation order) never changes whether `cap_tree` keeps n."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        parents, survival = _monotone_random_trees(g, 2, 8)
        valid = torch.ones(2, 8, dtype=torch.bool)
        width = int(torch.randint(1, 8, (1,), generator=g))
        base = cap_tree(survival, valid, width)
        row, node = int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(0, 8, (1,), generator=g))
        changed = survival.clone()
        for m in sorted(_subtree_of(parents[row], node)):
            changed[row, m] = changed[row, m] * float(torch.rand(1, generator=g))
        assert bool(cap_tree(changed, valid, width)[row, node]) == bool(base[row, node]), trial


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_cap_tree_refuses_a_width_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_nodes"):
        cap_tree(torch.full((1, 3), 0.5), torch.ones(1, 3, dtype=torch.bool), bad)


# ---------------------------------------------------------------------------------------------- priced growth
def _chain_and_branches(g, r, k, extra, monotone=True):
    """`[R, K + extra]` survivals: a chain (cumulative products) then branches whose keys never increase with creation
    order (what best-first growth of a sampled tree produces), all below the chain's head."""
    conf = torch.rand(r, k, generator=g) ** 0.4
    chain = torch.cumprod(conf, 1)
    branches = torch.rand(r, extra, generator=g) * 0.6 * chain[:, :1]
    if monotone:
        branches = branches.sort(dim=1, descending=True).values
    return conf, torch.cat([chain, branches], 1)


def test_free_growth_prices_exactly_as_today_and_a_prohibitive_one_verifies_the_chain_alone():
    """`schedule_tree(..., growth=)`: a free `GrowthCost` gives today's admission bit for bit (every policy entry
    point); a growth step (or tree round) that costs far more than a round verifies no branch, and then the chain
    nodes exactly as `schedule_prefix` on the chain's confidences. A moderate cost admits fewer branches than none."""
    g = torch.Generator().manual_seed(5)
    r, k, extra = 8, 5, 6
    free, step_only, tree_only = GrowthCost(), GrowthCost(step_seconds=1e3), GrowthCost(tree_seconds=1e3)
    fewer = 0
    for trial in range(30):
        conf, survival = _chain_and_branches(g, r, k, extra)
        valid = torch.ones_like(survival, dtype=torch.bool)
        sps = _sps(float(torch.rand(1, generator=g)) * 0.03)
        today = schedule_tree(survival, valid, sps)
        assert torch.equal(schedule_tree(survival, valid, sps, growth=free, num_chain=k), today)
        assert torch.equal(schedule_tree(survival, valid, sps, early_stop=False, growth=free, num_chain=k),
                           schedule_tree(survival, valid, sps, early_stop=False))
        stale = _chain_and_branches(g, r, k, extra)[1]
        assert torch.equal(async_tree(survival, valid, stale, valid, sps, growth=free, num_chain=k),
                           async_tree(survival, valid, stale, valid, sps))
        chain_only = torch.arange(k)[None] < schedule_prefix(conf, sps)[:, None]
        for cost in (step_only, tree_only):
            priced = schedule_tree(survival, valid, sps, growth=cost, num_chain=k)
            assert not priced[:, k:].any(), trial
            assert torch.equal(priced[:, :k], chain_only), trial
        # one growth step costs a tenth of a verified token's share of the round: some branches stop paying
        moderate = schedule_tree(survival, valid, sps, growth=GrowthCost(step_seconds=0.02), num_chain=k)
        fewer += int(moderate[:, k:].sum()) < int(today[:, k:].sum())
    assert fewer > 0


def test_the_growth_plan_grows_exactly_the_branches_the_priced_schedule_admits():
    """Batch 1, branches in best-first order (keys never increasing): asking `schedule_growth` before each step
    (known: the chain, the branches so far, the next candidate's estimate) and stopping at its first no grows exactly
    the branches `schedule_tree` admits on the fully grown tree, free or priced. So nothing is grown that is not
    verified, and when the first branch does not pay, nothing is grown at all."""
    g = torch.Generator().manual_seed(6)
    k, extra = 5, 8
    none_grown = some_grown = 0
    for trial in range(60):
        _, survival = _chain_and_branches(g, 1, k, extra)
        valid = torch.ones_like(survival, dtype=torch.bool)
        sps = _sps(float(torch.rand(1, generator=g)) * 0.05)
        cost = GrowthCost(step_seconds=float(torch.rand(1, generator=g)) * 0.05,
                          tree_seconds=float(torch.rand(1, generator=g)) * 0.05) if trial % 3 else GrowthCost()
        grown = 0
        for m in range(extra):
            n = k + m
            go = schedule_growth(survival[:, :n], valid[:, :n], survival[:, n], valid[:, n], sps, cost, k)
            if not bool(go[0]):
                break
            grown += 1
        admitted = schedule_tree(survival, valid, sps, growth=cost, num_chain=k)
        assert int(admitted[0, k:].sum()) == grown and bool(admitted[0, k: k + grown].all()), trial
        none_grown += grown == 0
        some_grown += 0 < grown < extra
    assert none_grown and some_grown


def test_priced_admission_never_depends_on_a_nodes_own_subtree():
    """As `test_a_nodes_admission_never_depends_on_its_own_subtree`, with growth priced (random step and tree costs,
    the first 2 nodes of each row a chain): the price of a position is a function of the sorted prefix before it."""
    g = torch.Generator().manual_seed(7)
    for trial in range(60):
        r, n = 3, 7
        parents, survival = _monotone_random_trees(g, r, n, chain=2)
        valid = torch.ones(r, n, dtype=torch.bool)
        sps = _sps(float(torch.rand(1, generator=g)) * 0.2)
        cost = GrowthCost(step_seconds=float(torch.rand(1, generator=g)) * 0.1,
                          tree_seconds=float(torch.rand(1, generator=g)) * 0.1)
        base = schedule_tree(survival, valid, sps, growth=cost, num_chain=2)
        row, node = int(torch.randint(0, r, (1,), generator=g)), int(torch.randint(0, n, (1,), generator=g))
        sub = _subtree_of(parents[row], node)
        changed = survival.clone()
        for m in sorted(sub):
            changed[row, m] = changed[row, m] * float(torch.rand(1, generator=g))
        assert bool(schedule_tree(changed, valid, sps, growth=cost, num_chain=2)[row, node]) == bool(
            base[row, node]), trial
