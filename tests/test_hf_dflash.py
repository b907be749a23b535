"""Our DFlash-variant drafter through transformers' built-in DFlash path (`speculation_type="dflash"`).

Pins that the adapter (`dspark_hf.decoding.hf_dflash`) is lossless (greedy output = the target's own greedy output), that every
round HF drafts exactly the tokens (and logits) our own `drafter.draft` gives for the same context, so acceptance
through HF's path equals ours, and that drafters with a sequential head are refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

import dspark_hf
from conftest import dflash_drafter, make_drafter, make_target
from dspark_hf.decoding.hf_dflash import DFlashAdapter, dflash_adapter, hf_dflash_generate

torch.set_num_threads(1)


def prompts(count: int = 3, length: int = 9, vocab: int = 96):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, vocab, (1, length + i), generator=g) for i in range(count)]


@pytest.fixture
def captured_rounds(monkeypatch):
    """Records (input_ids, candidate tokens, candidate logits) of every drafted round of HF's DFlash generator."""
    rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            rounds.append((input_ids.clone(), ids[:, input_ids.shape[1]:].clone(), logits.clone()))
        return ids, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", spy)
    return rounds


def test_greedy_output_equals_the_targets_own(target, captured_rounds):
    drafter = dflash_drafter(target)
    adapter = dflash_adapter(drafter, target)
    assert isinstance(adapter, DFlashAdapter) and adapter.config.block_size == drafter.config.block_size + 1
    for prompt in prompts():
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        got = hf_dflash_generate(target, adapter, prompt, max_new_tokens=24)
        assert torch.equal(got, expected)
        # the plain generate() call, reusing the adapter: HF's fresh DFlashCache resets the adapter's context
        direct = target.generate(prompt, assistant_model=adapter, speculation_type="dflash", max_new_tokens=24,
                                 do_sample=False)
        assert torch.equal(direct, expected)
    # HF's own DFlash generator ran (not dspark_hf's DSparkDrafter hook), several rounds per prompt, K drafts each.
    assert len(captured_rounds) >= 3 * 5
    assert all(tokens.shape[1] == drafter.config.block_size for _, tokens, _ in captured_rounds)

    # a left-padded batch-1 prompt: padding is neither context for the drafter nor changes the output
    prompt = prompts(1)[0]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    expected = target.generate(padded, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(hf_dflash_generate(target, drafter, padded, attention_mask=mask, max_new_tokens=16), expected)


@pytest.mark.parametrize("mask_token_id", [None, 5])
def test_every_round_drafts_what_our_drafter_drafts(arch, mask_token_id, captured_rounds):
    """Each HF round's drafts = `drafter.draft` from a fresh cache holding the full verified context."""
    target = make_target(arch)
    drafter = dflash_drafter(target, mask_token_id=mask_token_id)
    hf_dflash_generate(target, drafter, prompts(1)[0], max_new_tokens=20)
    assert len(captured_rounds) >= 5
    layer_ids = [i + 1 for i in drafter.config.target_layer_ids]
    with torch.no_grad():
        for input_ids, tokens, logits in captured_rounds:
            context = input_ids[:, :-1]  # everything before the anchor is verified context
            out = target(input_ids=context, output_hidden_states=layer_ids)
            cache = drafter.new_cache()
            drafter.append_context(cache, drafter.context_features(out.hidden_states),
                                   torch.arange(context.shape[1])[None])
            block = drafter.draft(cache, input_ids[:, -1])
            assert torch.equal(tokens, block.tokens)
            torch.testing.assert_close(logits, block.logits, atol=1e-4, rtol=1e-4)


def test_acceptance_equals_our_fixed_policy_loop(arch):
    """Per-round accepted lengths (tau) through HF's path = `dspark_hf.generate(policy="fixed")` on the same prompts."""
    target = make_target(arch)
    drafter = dflash_drafter(target)
    with torch.no_grad():  # damp the random layers so slot 0 acts like the target's bigram: tau well above 1
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.zero_()
    taus = []
    for prompt in prompts():
        out, stats = hf_dflash_generate(target, drafter, prompt, max_new_tokens=24, return_stats=True)
        ours = dspark_hf.generate(target, drafter, prompt, max_new_tokens=24, policy="fixed",
                                  return_dict_in_generate=True)
        assert torch.equal(out, ours.sequences)
        assert stats.accepted_lengths == ours.stats[0].accepted_lengths
        assert stats.target_forwards == stats.rounds + 1
        assert sum(stats.accepted_lengths) == 24 - 1
        taus.append(stats.mean_accepted_length)
    assert sum(taus) / len(taus) > 1.2


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_tiny_budgets(max_new_tokens):
    target = make_target("llama")
    drafter = dflash_drafter(target)
    prompt = prompts(1)[0]
    out, stats = hf_dflash_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, return_stats=True)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False))
    ours = dspark_hf.generate(target, drafter, prompt, max_new_tokens=max_new_tokens, policy="fixed",
                              return_dict_in_generate=True)
    assert stats.accepted_lengths == ours.stats[0].accepted_lengths


def test_sequential_head_and_batches_are_refused():
    target = make_target("llama")
    markov = make_drafter(target)  # default: Markov head
    with pytest.raises(ValueError, match="cannot apply the Markov/RNN head"):
        dflash_adapter(markov, target)
    with pytest.raises(ValueError, match="only DFlash-variant weights"):
        hf_dflash_generate(target, make_drafter(target, sequential_head="rnn"), prompts(1)[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        hf_dflash_generate(target, dflash_drafter(target), torch.randint(4, 96, (2, 6)), max_new_tokens=4)
