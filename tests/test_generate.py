"""`target.generate(**inputs, assistant_model=drafter)`: greedy equals the target's greedy output, sampling follows
the target's distribution, and stopping (EOS, max_new_tokens, stopping criteria, streamer) behaves like plain decoding.
"""

import itertools
import math

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from conftest import (Collect, StopAfterToken, bias_markov_head, exact_joint, greedy_continuation, make_drafter,
                      make_target, oracle_for)


PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


@pytest.mark.parametrize("head, candidates", [("markov", None), ("gated_markov", None), ("rnn", None), ("none", None),
                                              ("markov", 8), ("rnn", 3)])
def test_greedy_untrained_drafter_equals_target(target, head, candidates):
    drafter = make_drafter(target, sequential_head=head, block_size=5, draft_candidates=candidates)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        assert torch.equal(ref, out), prompt


def test_greedy_with_attention_mask_and_bf16_drafter_inputs(target, drafter):
    ids = torch.tensor([PROMPTS[1]])
    mask = torch.ones_like(ids)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=25,
                          do_sample=False)
    assert torch.equal(ref, out)


@pytest.mark.parametrize("correct", [0, 1, 2, 3, 4])
def test_greedy_with_forced_acceptance_length(target, correct):
    oracle = oracle_for(target, correct=correct, block_size=4)
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=30, do_sample=False)
    assert torch.equal(ref, out)
    steps = [b - a for a, b in zip(oracle.prefix_lengths, oracle.prefix_lengths[1:])]
    # each round emits accepted drafts + 1 target token
    assert steps and all(s == min(correct, 4) + 1 for s in steps), steps
    stats = oracle.last_speculation_stats
    assert stats.rounds == len(oracle.prefix_lengths)
    assert all(a == min(correct, p) for a, p in zip(stats.accepted, stats.proposed)), stats
    # Hand count: after the prefill's token 29 remain; a round proposes min(4, remaining - 1) drafts (the budget's last
    # token is always the target's own), accepts min(correct, proposed) of them and emits one more; once nothing is
    # left to propose, the last token is a plain decoding step, not a verification round.
    accepted, proposed, remaining = [], [], 29
    while remaining > 1:
        p = min(4, remaining - 1)
        accepted.append(min(correct, p))
        proposed.append(p)
        remaining -= accepted[-1] + 1
    assert (stats.accepted, stats.proposed) == (accepted, proposed)
    assert proposed.count(4) > 0  # full-block rounds took place
    # tau exactly: always rejected -> 1.0; always accepted -> 5 per round but the last, capped one (4): 29 / 6
    expected_tau = {0: 1.0, 1: 2.0, 2: 29 / 10, 3: 4.0, 4: 29 / 6}[correct]
    assert stats.mean_accepted_length == pytest.approx(expected_tau)
    assert stats.mean_accepted_length == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))


def test_all_accepted_drafter_needs_few_rounds(target):
    oracle = oracle_for(target, correct=99, block_size=4)
    ids = torch.tensor([PROMPTS[0]])
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False))
    assert len(oracle.prefix_lengths) == math.ceil(29 / 5)  # first token from prefill, then 5 per round (last: 4)
    assert oracle.last_speculation_stats.accepted == [4, 4, 4, 4, 4, 3]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 11, 13])
def test_max_new_tokens_ending_mid_block(target, max_new_tokens):
    oracle = oracle_for(target, correct=99, block_size=4)
    ids = torch.tensor([PROMPTS[2]])
    ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=max_new_tokens, do_sample=False)
    assert out.shape[1] == ids.shape[1] + max_new_tokens
    assert torch.equal(ref, out)


@pytest.mark.parametrize("eos_index", [3, 6, 8])
def test_eos_inside_a_block(target, eos_index):
    ids = torch.tensor([PROMPTS[0]])
    continuation = greedy_continuation(target, ids, 20)[0].tolist()
    eos = continuation[eos_index]
    first = continuation.index(eos)
    oracle = oracle_for(target, correct=99, block_size=4)
    ref = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    assert ref.shape[1] == ids.shape[1] + first + 1  # plain decoding stops at the first EOS
    assert torch.equal(ref, out)


@pytest.mark.parametrize("stop_index", [2, 5, 9])
def test_custom_stopping_criteria_stop_exactly_where_plain_decoding_stops(target, stop_index):
    ids = torch.tensor([PROMPTS[1]])
    stop = greedy_continuation(target, ids, 20)[0, stop_index].item()
    oracle = oracle_for(target, correct=99, block_size=4)
    criteria = StoppingCriteriaList([StopAfterToken(stop)])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=criteria)
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=20, do_sample=False,
                          stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]))
    assert ref[0, -1].item() == stop
    assert torch.equal(ref, out)


def test_streamer_receives_every_token_once(target, drafter):
    ids = torch.tensor([PROMPTS[0]])
    streamer = Collect()
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert list(itertools.chain.from_iterable(streamer.chunks)) == out[0].tolist()


def test_batch_larger_than_one_points_to_the_batched_entry(target, drafter):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="dspark_hf.generate"):
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=5)


def test_other_assistants_are_untouched(target):
    assistant = make_target("llama" if target.config.model_type == "llama" else "qwen3", seed=5)
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ref, target.generate(ids, assistant_model=assistant, max_new_tokens=12, do_sample=False))


# --------------------------------------------------------------------------------------------- sampling is lossless
@pytest.mark.parametrize("temperature, top_k, top_p, candidates, head_dtype",
                         [(0.8, None, None, None, None), (1.3, 3, 0.9, None, None), (1.0, None, None, 2, None),
                          (0.8, None, None, None, torch.bfloat16)])
def test_sampling_matches_the_target_distribution(temperature, top_k, top_p, candidates, head_dtype):
    """The first 3 generated tokens over V^3 = 64 outcomes: the speculative empirical distribution is within a stated
    TV bound of the enumerated target distribution; the bound is 2.5x the TV expected from exact sampling with the
    same number of runs. Drafts are far from the target (checked), so a lossy verifier would not pass. With
    `draft_candidates=2` the draft distribution is zero outside each slot's 2 candidates: still lossless."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    # a strong transition bias: drafts far from the target, dependent on the previous draft
    drafter = bias_markov_head(make_drafter(target, block_size=3, markov_rank=4, seed=4, draft_candidates=candidates))
    drafter.set_draft_head_dtype(head_dtype)  # bf16: drafts from a low-precision head copy, verified against it
    prompt, n_runs, n_tokens = [1, 2, 3, 1], 2500, 3
    exact = exact_joint(target, prompt, n_tokens, temperature, top_k, top_p)
    first_drafts = []
    original_draft = drafter.draft

    def recording_draft(*args, **kwargs):
        block = original_draft(*args, **kwargs)
        if kwargs["prefix_ids"].shape[1] == len(prompt) + 1:  # first round: drafts for tokens 2..
            first_drafts.append((kwargs["prefix_ids"][0, -1].item(), block.tokens[0, 0].item()))
        return block

    drafter.draft = recording_draft
    counts = torch.zeros(4 ** n_tokens)
    ids = torch.tensor([prompt])
    for run in range(n_runs):
        torch.manual_seed(run)
        out = target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=n_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p)
        new = out[0, len(prompt):].tolist()
        counts[sum(t * 4 ** (n_tokens - 1 - i) for i, t in enumerate(new))] += 1
    empirical = counts / n_runs
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n_runs)).sum().item()
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 2.5 * expected_tv, (tv, expected_tv)
    # Power: the joint of (x1, first draft) is far from the target's joint of (x1, x2).
    pair = torch.zeros(16)
    for x1, d in first_drafts:
        pair[x1 * 4 + d] += 1
    target_pair = exact.reshape(4, 4, 4).sum(-1).reshape(-1)
    # A verifier that accepted every draft would be off by at least this much: more than the bound allows.
    assert 0.5 * (pair / pair.sum() - target_pair).abs().sum().item() > 1.4 * 2.5 * expected_tv


def test_low_precision_draft_head_stays_lossless_and_follows_the_target(target):
    """A bf16 copy of the LM head for drafting: greedy output still equals plain greedy; the copy tracks the head."""
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    drafter.set_draft_head_dtype(torch.bfloat16)
    assert torch.equal(ref, target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False))
    hidden = torch.randn(2, 4, target.config.hidden_size)
    low = drafter.draft_logits(hidden)
    assert low.dtype == torch.float32
    assert torch.allclose(low, drafter.lm_head(hidden).float(), atol=0.1) and not torch.equal(low, drafter.lm_head(hidden))
    drafter.set_draft_head_dtype(None)
    assert torch.equal(drafter.draft_logits(hidden), drafter.lm_head(hidden).float())
