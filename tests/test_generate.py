"""`target.generate(**inputs, assistant_model=drafter)`: greedy equals the target's greedy output, sampling follows
the target's distribution, and stopping (EOS, max_new_tokens, stopping criteria, streamer) behaves like plain decoding.
"""

import itertools
import math

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from conftest import make_drafter, make_target
from dspark_hf import DraftBlock, DSparkDrafter, warp_logits


def greedy_continuation(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The target's own greedy next `n` tokens after `ids` [1, L] (no cache: tiny models only)."""
    out = ids
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, target(out).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return out[:, ids.shape[1]:]


class OracleDrafter(DSparkDrafter):
    """Test drafter: proposes the target's own greedy continuation for its first `correct` slots, then wrong tokens.

    With correct >= block_size every draft is accepted; otherwise each round accepts exactly `correct` drafts.
    """

    def setup(self, target, correct: int) -> "OracleDrafter":
        object.__setattr__(self, "_oracle", target)  # not a submodule
        self.correct = correct
        self.prefix_lengths: list[int] = []
        return self

    def draft(self, cache, anchor_ids, *, prefix_ids=None, num_drafts=None, **kwargs) -> DraftBlock:
        k = num_drafts or self.config.block_size
        self.prefix_lengths.append(prefix_ids.shape[1])
        tokens = greedy_continuation(self._oracle, prefix_ids, k)
        wrong = (tokens + 1) % self.config.vocab_size
        tokens = torch.where(torch.arange(k)[None] < self.correct, tokens, wrong)
        logits = torch.nn.functional.one_hot(tokens, self.config.vocab_size).float() * 20
        return DraftBlock(tokens=tokens, logits=logits, confidences=torch.full(tokens.shape, 0.9))


def oracle_for(target, correct: int, block_size: int = 4) -> OracleDrafter:
    base = make_drafter(target, block_size=block_size)
    oracle = OracleDrafter(base.config)
    oracle.load_state_dict(base.state_dict())
    oracle.bind_target(target)
    return oracle.setup(target, correct).eval()


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
    full_rounds = [a for a, p in zip(stats.accepted, stats.proposed) if p == 4]
    assert full_rounds and stats.mean_accepted_length >= 1.0


def test_all_accepted_drafter_needs_few_rounds(target):
    oracle = oracle_for(target, correct=99, block_size=4)
    ids = torch.tensor([PROMPTS[0]])
    out = target.generate(ids, assistant_model=oracle, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False))
    assert len(oracle.prefix_lengths) <= math.ceil(29 / 5)  # first token from prefill, then 5 per round


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


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


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


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


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
def exact_joint(target, prompt, n_tokens, temperature, top_k, top_p) -> torch.Tensor:
    """P(x_1..x_n | prompt) over all V^n sequences, enumerated, with the same processing as generate()."""
    v = target.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n_tokens)))  # [V^n, n]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1: -1]  # [V^n, n, V]
    probs = torch.softmax(warp_logits(logits, temperature, top_k, top_p), dim=-1)
    return probs.gather(2, seqs[..., None]).squeeze(-1).prod(dim=1)


@pytest.mark.parametrize("temperature, top_k, top_p, candidates, head_dtype",
                         [(0.8, None, None, None, None), (1.3, 3, 0.9, None, None), (1.0, None, None, 2, None),
                          (0.8, None, None, None, torch.bfloat16)])
def test_sampling_matches_the_target_distribution(temperature, top_k, top_p, candidates, head_dtype):
    """The first 3 generated tokens over V^3 = 64 outcomes: the speculative empirical distribution is within a stated
    TV bound of the enumerated target distribution; the bound is 2.5x the TV expected from exact sampling with the
    same number of runs. Drafts are far from the target (checked), so a lossy verifier would not pass. With
    `draft_candidates=2` the draft distribution is zero outside each slot's 2 candidates: still lossless."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = make_drafter(target, block_size=3, markov_rank=4, seed=4, draft_candidates=candidates)
    with torch.no_grad():  # a strong transition bias: drafts far from the target, dependent on the previous draft
        drafter.markov_head.markov_w2.weight.normal_(0.0, 8.0, generator=torch.Generator().manual_seed(0))
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
