"""The pure verification math: processing parity with transformers, greedy rule, lossless rejection sampling."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dspark_hf import SamplingParams, greedy_verify, rejection_verify, verify, warp_logits


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, None), (1.0, 5, None), (1.3, None, 0.8),
                                                         (0.5, 7, 0.9), (1.0, 1, None)])
def test_warp_logits_equals_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    logits[0, :4] = 2.0  # ties at the k-th value
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    expected = processors(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    got = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(got)
    assert torch.allclose(got[finite], expected[finite])


def one_hot_logits(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float() * 10


def test_greedy_verify_ragged_rows_by_hand():
    vocab = 10
    # target argmax after anchor and after each of 3 drafts, per row
    target = torch.stack([one_hot_logits(r, vocab) for r in ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4])])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 6, 7], [1, 2, 3]])
    result = greedy_verify(drafts, target, num_drafts=torch.tensor([3, 3, 2, 0]), pad_token_id=-1)
    # row0: all 3 accepted + bonus 4; row1: 1 accepted, correction 2; row2: only 2 verified, both accepted,
    # bonus = target after draft 2 = 7; row3: nothing verified, target's own token 1.
    assert result.num_accepted.tolist() == [3, 1, 2, 0]
    assert result.next_tokens.tolist() == [4, 2, 7, 1]
    assert result.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [5, 6, 7, -1], [1, -1, -1, -1]]
    assert result.num_new.tolist() == [4, 2, 3, 1]


def test_num_drafts_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="num_drafts"):
        greedy_verify(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, 5), num_drafts=torch.tensor([3]))


def _conditional_tables(vocab, seed):
    """Random target and draft conditionals: p1 [V], p2 [V, V] (given x1), p3 [V, V, V] (given x1, x2)."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape, sharp):
        return torch.softmax(torch.randn(*shape, vocab, generator=g) * sharp, dim=-1)

    return (dist(sharp=1.5), dist(vocab, sharp=1.5), dist(vocab, vocab, sharp=1.5)), \
           (dist(sharp=1.5), dist(vocab, sharp=1.5), dist(vocab, vocab, sharp=1.5))


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_rejection_verify_emits_the_target_distribution(num_drafts):
    """Two emitted tokens over V^2 outcomes match the enumerated target joint, drafts from a dependent drafter."""
    vocab, n = 4, 200_000
    (t1, t2, t3), (d1, d2, _) = _conditional_tables(vocab, seed=3)
    g = torch.Generator().manual_seed(11)
    x1 = torch.multinomial(d1.expand(n, -1), 1, generator=g).squeeze(1)
    q2 = d2[x1]
    x2 = torch.multinomial(q2, 1, generator=g).squeeze(1)
    drafts = torch.stack([x1, x2], dim=1)
    draft_probs = torch.stack([d1.expand(n, -1), q2], dim=1)
    target_probs = torch.stack([t1.expand(n, -1), t2[x1], t3[x1, x2]], dim=1)
    res = rejection_verify(drafts, draft_probs, target_probs, torch.full((n,), num_drafts), generator=g)
    # The first two emitted tokens; when only one token was emitted, the second comes from the target itself
    # (what the next round would do), so the joint is defined for every row.
    first = res.tokens[:, 0]
    second = torch.where(res.num_new >= 2, res.tokens[:, 1], torch.multinomial(t2[first], 1, generator=g).squeeze(1))
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).float() / n
    exact = (t1[:, None] * t2).reshape(-1)
    tv = 0.5 * (counts - exact).abs().sum().item()
    assert tv < 0.01, tv
    # Power: the drafter's own joint is far from the target's, so a lossy rule would fail the bound above.
    draft_joint = (d1[:, None] * d2).reshape(-1)
    assert 0.5 * (draft_joint - exact).abs().sum().item() > 0.1


def test_rejection_of_impossible_draft_and_acceptance_of_identical_distributions():
    # A draft the target never emits (p_t = 0) is always rejected; the correction follows max(p_t - p_d, 0).
    p_t = torch.tensor([[[0.0, 0.25, 0.75], [0.2, 0.3, 0.5]]]).expand(4000, -1, -1)
    p_d = torch.tensor([[[0.5, 0.5, 0.0]]]).expand(4000, -1, -1)
    res = rejection_verify(torch.zeros(4000, 1, dtype=torch.long), p_d, p_t, generator=torch.Generator().manual_seed(0))
    assert (res.num_accepted == 0).all()
    assert (res.next_tokens == 2).all()  # residual = normalize([0, 0, 0.75])
    # Identical distributions: every draft is accepted and the bonus comes from the next target distribution.
    same = torch.tensor([[[0.2, 0.3, 0.5]]])
    res = rejection_verify(torch.tensor([[2]]), same, torch.cat([same, same], 1), generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.item() == 1


def test_verify_dispatches_on_sampling_params():
    logits = torch.randn(2, 4, 12)
    drafts = logits[:, :3].argmax(-1)
    greedy = verify(drafts, torch.zeros(2, 3, 12), logits, SamplingParams(do_sample=False))
    assert greedy.num_accepted.tolist() == [3, 3]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(do_sample=True, top_p=1.5)


def test_rejection_verify_ragged_rows_match_per_row_calls():
    torch.manual_seed(0)
    b, k, v = 5, 4, 7
    drafts = torch.randint(0, v, (b, k))
    dp = torch.softmax(torch.randn(b, k, v), -1)
    tp = torch.softmax(torch.randn(b, k + 1, v), -1)
    nd = torch.tensor([4, 0, 2, 1, 3])
    res = rejection_verify(drafts, dp, tp, nd, generator=torch.Generator().manual_seed(5))
    assert (res.num_accepted <= nd).all()
    for row in range(b):
        assert res.tokens[row, : res.num_accepted[row]].tolist() == drafts[row, : res.num_accepted[row]].tolist()
