"""Verification-length policies: the paper's worked examples, Appendix A, optimality, losslessness, bad input."""

import itertools

import pytest
import torch

from dspark_hf.decoding.scheduler import (
    async_lengths,
    async_tree,
    async_width,
    expected_throughput,
    fixed_lengths,
    prefix_survival,
    schedule_prefix,
    schedule_tree,
    schedule_width,
    threshold_lengths,
    token_budget,
)
from dspark_hf.decoding.verification import rejection_verify


def table(values: dict[int, float]):
    return lambda b: values[b]


def test_review_notes_two_request_example():
    # dspark-review-notes-zh.txt: c = [[0.9, 0.5], [0.6, 0.6]], SPS(2..6) = 1.0, 0.8, 0.55, 0.5, 0.3
    conf = torch.tensor([[0.9, 0.5], [0.6, 0.6]])
    sps = table({2: 1.0, 3: 0.8, 4: 0.55, 5: 0.5, 6: 0.3})
    assert torch.allclose(prefix_survival(conf), torch.tensor([[0.9, 0.45], [0.6, 0.36]]))
    lengths = schedule_prefix(conf, sps)
    assert lengths.tolist() == [1, 0]
    assert expected_throughput(conf, lengths, sps) == pytest.approx(2.32)
    # the full Theta(B) curve of the notes' table
    for ls, theta in [((0, 0), 2.0), ((1, 0), 2.32), ((1, 1), 1.925), ((2, 1), 1.975), ((2, 2), 1.293)]:
        assert expected_throughput(conf, torch.tensor(ls), sps) == pytest.approx(theta, abs=1e-3)
    assert schedule_prefix(conf, sps, early_stop=False).tolist() == [1, 0]  # unimodal: same answer


def test_review_notes_three_request_example():
    conf = torch.tensor([[0.95, 0.85, 0.70], [0.80, 0.55, 0.30], [0.65, 0.25, 0.10]])
    sps = table({3: 1.0, 4: 0.85, 5: 0.70, 6: 0.60, 7: 0.42, 8: 0.30, 9: 0.20, 10: 0.12, 11: 0.07, 12: 0.04})
    survival = prefix_survival(conf)
    assert torch.allclose(survival, torch.tensor([[0.950, 0.8075, 0.5653], [0.800, 0.440, 0.132],
                                                  [0.650, 0.1625, 0.01625]]), atol=1e-3)
    lengths = schedule_prefix(conf, sps)
    assert lengths.tolist() == [1, 0, 0]
    assert expected_throughput(conf, lengths, sps) == pytest.approx(3.358, abs=1e-3)
    assert expected_throughput(conf, torch.tensor([2, 0, 0]), sps) == pytest.approx(3.331, abs=1e-3)
    assert expected_throughput(conf, torch.tensor([2, 1, 0]), sps) == pytest.approx(3.335, abs=1e-3)
    assert expected_throughput(conf, torch.tensor([2, 1, 1]), sps) == pytest.approx(2.607, abs=1e-3)


APPENDIX_SPS = table({1: 1.0, 2: 0.5, 3: 0.45})


def test_appendix_a_throughputs():
    # R = 1, gamma = 2, a_1 = 0.8: Theta_0 = 1.0, Theta_1 = 0.9; c_2 = 0.9 -> Theta_2 = 1.134, c_2 = 0 -> 0.81
    high, low = torch.tensor([[0.8, 0.9]]), torch.tensor([[0.8, 0.0]])
    assert expected_throughput(high, torch.tensor([0]), APPENDIX_SPS) == pytest.approx(1.0)
    assert expected_throughput(high, torch.tensor([1]), APPENDIX_SPS) == pytest.approx(0.9)
    assert expected_throughput(high, torch.tensor([2]), APPENDIX_SPS) == pytest.approx(1.134)
    assert expected_throughput(low, torch.tensor([2]), APPENDIX_SPS) == pytest.approx(0.81)
    # Algorithm 1 stops before looking at c_2; the global search does not
    assert schedule_prefix(high, APPENDIX_SPS).tolist() == [0] == schedule_prefix(low, APPENDIX_SPS).tolist()
    assert schedule_prefix(high, APPENDIX_SPS, early_stop=False).tolist() == [2]
    assert schedule_prefix(low, APPENDIX_SPS, early_stop=False).tolist() == [0]


@pytest.mark.parametrize("early_stop, expected_a", [(True, 0.70), (False, 0.85)])
def test_appendix_a_selection_bias(early_stop, expected_a):
    """p_t = (0.7, 0.3), p_d = (0.5, 0.5); x_1 = A makes c_2 = 0.9, x_1 = B makes c_2 = 0. Without the early stop
    the first emitted token is biased to (0.85, 0.15); Algorithm 1 keeps the target's (0.7, 0.3)."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    p_t = torch.tensor([0.7, 0.3])
    p_d = torch.tensor([0.5, 0.5])
    x1 = torch.multinomial(p_d.expand(n, -1), 1, generator=g)  # [n, 1]
    # the schedule for each realisation of x_1 (the confidence of slot 2 reads x_1)
    length_if = {tok: int(schedule_prefix(torch.tensor([[0.8, c2]]), APPENDIX_SPS, early_stop=early_stop)[0])
                 for tok, c2 in ((0, 0.9), (1, 0.0))}
    num_drafts = torch.where(x1[:, 0] == 0, length_if[0], length_if[1]).clamp(max=1)  # only x_1 matters here
    res = rejection_verify(x1, p_d.expand(n, 1, -1), p_t.expand(n, 2, -1), num_drafts, generator=g)
    share_a = (res.tokens[:, 0] == 0).float().mean().item()
    assert share_a == pytest.approx(expected_a, abs=0.005)


def brute_force(conf: torch.Tensor, sps) -> float:
    r, k = conf.shape
    return max(expected_throughput(conf, torch.tensor(ls), sps) for ls in itertools.product(range(k + 1), repeat=r))


@pytest.mark.parametrize("seed", range(12))
def test_global_search_is_optimal_and_early_stop_is_optimal_on_unimodal_curves(seed):
    g = torch.Generator().manual_seed(seed)
    r, k = 3, 3
    conf = torch.rand(r, k, generator=g) ** 0.5
    # a smooth decreasing cost curve (steps/s falls as 1 / (1 + alpha * B)): Theta is unimodal
    alpha = float(torch.rand(1, generator=g)) * 0.5
    smooth = lambda b: 1.0 / (1.0 + alpha * b)  # noqa: E731
    best = brute_force(conf, smooth)
    assert expected_throughput(conf, schedule_prefix(conf, smooth), smooth) == pytest.approx(best)
    # a jagged curve: the global search still finds the optimum, the early stop may not
    jag = torch.rand(r * (k + 1) + 1, generator=g) + 0.1
    jagged = lambda b: float(jag[b])  # noqa: E731
    assert expected_throughput(conf, schedule_prefix(conf, jagged, early_stop=False), jagged) == pytest.approx(
        brute_force(conf, jagged))
    assert expected_throughput(conf, schedule_prefix(conf, jagged), jagged) <= brute_force(conf, jagged) + 1e-9


def test_load_shortens_verification():
    """The same confidences under a cheap and an expensive marginal token: the scheduler verifies less under load."""
    conf = torch.full((8, 7), 0.8)
    flat = lambda b: 1.0  # noqa: E731  (verification tokens are free: verify everything)
    steep = lambda b: 1.0 / b  # noqa: E731  (every token costs a full step: verify nothing)
    assert schedule_prefix(conf, flat).tolist() == [7] * 8
    assert schedule_prefix(conf, steep).tolist() == [0] * 8
    mid = lambda b: 1.0 / (1.0 + 0.02 * b)  # noqa: E731
    small, large = schedule_prefix(conf[:1], mid), schedule_prefix(conf, mid)
    assert large.float().mean() <= small.float().mean()


def test_threshold_fixed_and_async():
    conf = torch.tensor([[0.9, 0.9, 0.2], [0.5, 0.9, 0.9]])
    assert threshold_lengths(conf, 0.6).tolist() == [2, 0]
    assert threshold_lengths(conf, 0.0).tolist() == [3, 3]
    assert fixed_lengths(conf).tolist() == [3, 3]
    sps = lambda b: 1.0 / (1.0 + 0.1 * b)  # noqa: E731
    budget = token_budget(conf, sps)
    # stale == current: async equals the global search with the same budget
    assert async_lengths(conf, conf, sps).sum().item() == budget
    assert async_lengths(conf, conf, sps).tolist() == schedule_prefix(conf, sps, early_stop=False).tolist()
    # the budget comes from the stale confidences, the admission order from the current ones
    stale = torch.tensor([[0.99, 0.99, 0.99], [0.99, 0.99, 0.99]])
    lengths = async_lengths(conf, stale, sps)
    assert lengths.sum().item() == token_budget(stale, sps)
    a = prefix_survival(conf)
    admitted = torch.arange(3)[None] < lengths[:, None]
    rejected = ~admitted
    if admitted.any() and rejected.any():
        assert a[admitted].min() >= a[rejected].max()


def test_ties_never_admit_a_later_position_first():
    conf = torch.ones(4, 5)  # all survivals tie at 1.0
    for n in range(21):
        lengths = async_lengths(conf, conf, lambda b, n=n: 1.0 if b <= 4 + n else 1e-6)
        assert lengths.sum().item() == n
        assert lengths.max() - lengths.min() <= 1  # filled position by position across requests


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0.5, float("nan")]]), "NaN"),
    (torch.tensor([[1.5, 0.5]]), r"\[0, 1\]"),
    (torch.tensor([0.5, 0.5]), r"\[R, K\]"),
])
def test_bad_confidences_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        schedule_prefix(bad, lambda b: 1.0)


def test_bad_sps_is_refused():
    with pytest.raises(ValueError, match="positive"):
        schedule_prefix(torch.tensor([[0.5]]), lambda b: 0.0)
    with pytest.raises(TypeError, match="callable"):
        schedule_prefix(torch.tensor([[0.5]]), 3.0)
    with pytest.raises(ValueError, match="threshold"):
        threshold_lengths(torch.tensor([[0.5]]), 1.5)


def test_round_overhead_lengthens_verification():
    """A fixed per-round cost (drafting) makes extra verified tokens relatively cheaper: never shorter lengths."""
    from dspark_hf.decoding.scheduler import WithRoundOverhead

    g = torch.Generator().manual_seed(0)
    conf = torch.rand(16, 7, generator=g) ** 0.3
    steep = lambda b: 1.0 / (0.01 * b)  # noqa: E731  (seconds per step proportional to tokens)
    bare = schedule_prefix(conf, steep)
    loaded = schedule_prefix(conf, WithRoundOverhead(steep, overhead_s=2.0))
    assert (loaded >= bare).all() and loaded.sum() > bare.sum()
    assert WithRoundOverhead(steep, 0.0).steps_per_second(torch.tensor([4])).item() == pytest.approx(25.0)
    with pytest.raises(ValueError, match="overhead_s"):
        WithRoundOverhead(steep, -1.0)


# ---------------------------------------------------------------------------------------------- padded batches
def test_padded_rule_prices_the_rectangle_and_refuses_what_ragged_pricing_admits():
    # row 0 is confident, row 1 is not; SPS falls with the tokens of the forward
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]])

    def sps(b):
        return 1.0 / (1.0 + 0.2 * (b - 2))

    # ragged (Algorithm 1): B = 2 + 3 for row 0's three drafts: Theta = (2 + 2.439) / 1.6 = 2.77 > 2
    assert schedule_prefix(conf, sps).tolist() == [3, 0]
    # padded: one draft of row 0 makes the forward 2 x 2 tokens: Theta(1) = (2 + 0.9 + 0.1) / 1.4 = 2.14 > 2,
    # Theta(2) = (3 + 0.81 + 0.01) / 1.8 = 2.12 < 2.14: the break at width 1, for both rows
    assert schedule_width(conf, sps).tolist() == [1, 1]
    for width, theta in [(0, 2.0), (1, 3.0 / 1.4), (2, 3.82 / 1.8)]:
        lengths = torch.full((2,), width)
        assert expected_throughput(conf, lengths, sps, padded=True) == pytest.approx(theta, rel=1e-6)
    # what ragged pricing admits costs, as the forward really runs, 2 x 4 tokens
    assert expected_throughput(conf, torch.tensor([3, 0]), sps, padded=True) == pytest.approx(
        (2 + 0.9 + 0.81 + 0.729) / 2.2, rel=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_padded_rule_equals_algorithm_1_on_one_request_and_on_a_chain_tree(seed):
    g = torch.Generator().manual_seed(seed)
    slope = float(torch.rand(1, generator=g)) * 0.5

    def sps(b):
        return 1.0 / (1.0 + slope * b) if isinstance(b, int) else 1.0 / (1.0 + slope * b.double())

    one = torch.rand(1, 6, generator=g)
    assert torch.equal(schedule_width(one, sps), schedule_prefix(one, sps))
    many = torch.rand(5, 6, generator=g)
    widths = schedule_width(many, sps)
    chain = schedule_tree(prefix_survival(many), torch.ones(5, 6, dtype=torch.bool), sps, padded=True)
    assert torch.equal(chain.sum(dim=1), widths)
    assert torch.equal(chain, torch.arange(6)[None, :] < widths[:, None])


@pytest.mark.parametrize("seed", range(30))
def test_padded_rule_never_reads_the_drafts_past_its_width(seed):
    """Non-anticipation (Appendix A) for the width scan: whatever the confidences of drafts past width m + 1 (they
    read drafts the rule admitted or refused), the width is the same; level m + 1 is read only to stop."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(4, 7, generator=g) * 0.6 + 0.4

    def sps(b):
        return 1.0 / (1.0 + 0.05 * b.double()) if isinstance(b, torch.Tensor) else 1.0 / (1.0 + 0.05 * b)

    width = int(schedule_width(conf, sps)[0])
    changed = conf.clone()
    changed[:, width + 1:] = torch.rand(4, 7 - width - 1, generator=g) if width + 1 < 7 else changed[:, width + 1:]
    assert int(schedule_width(changed, sps)[0]) == width
    # the global search is the optimum over widths
    best = max(range(8), key=lambda m: (expected_throughput(conf, torch.full((4,), m), sps, padded=True), -m))
    assert int(schedule_width(conf, sps, early_stop=False)[0]) == best


def test_padded_tree_admits_each_rows_best_nodes_up_to_one_width():
    # two rows, nodes 0..2 = chain (0 -> 1 -> 2), node 3 = a sibling of node 0
    survival = torch.tensor([[0.9, 0.8, 0.7, 0.05], [0.3, 0.1, 0.05, 0.25]])
    valid = torch.ones(2, 4, dtype=torch.bool)

    def sps(b):
        return 1.0 / (1.0 + 0.05 * b.double()) if isinstance(b, torch.Tensor) else 1.0 / (1.0 + 0.05 * b)

    # levels 1.2, 1.05, 0.8, 0.1: Theta(m) = (2 + their sum) / (1 + 0.1 (1 + m)) = 1.82, 2.67, 3.27, 3.61, 3.43
    mask = schedule_tree(survival, valid, sps, padded=True)
    # width 3 for both rows, each its own 3 best nodes: row 1's sibling (0.25) before its chain's second node (0.1)
    assert mask.tolist() == [[True, True, True, False], [True, True, False, True]]
    assert torch.equal(schedule_tree(survival, valid, sps, padded=True, early_stop=False), mask)
    stale = async_tree(survival, valid, survival, valid, sps, padded=True)
    assert torch.equal(stale, mask)  # the stale width from the same survivals
    assert async_width(torch.rand(2, 4), torch.rand(2, 4), sps).unique().numel() == 1
