"""No silent arguments (issue 12, part 6): transformers' assistant settings on `generate(assistant_model=drafter)`
(`num_assistant_tokens` caps the drafts per round, `assistant_confidence_threshold` is DSpark's threshold policy,
adaptive schedules are refused), the same settings refused by the batched loop, and streamers on every entry point
(assisted generation, `dspark_hf.generate`, `custom_generate=speculative_generate`)."""

import pytest
import torch
from transformers import TextStreamer

import dspark_hf
from conftest import (Collect, dflash_drafter, fixed_confidence_drafter, greedy_reference, make_drafter, make_target,
                      make_tokenizer)

PROMPT = [5, 17, 33, 2, 9]
IDS = torch.tensor([PROMPT])


@pytest.fixture(scope="module")
def llama():
    target = make_target("llama")
    return target, make_drafter(target)


def assisted(target, drafter, n=14, **kw):
    out = target.generate(IDS, attention_mask=torch.ones_like(IDS), assistant_model=drafter, max_new_tokens=n,
                          do_sample=False, **kw)
    return out[0, IDS.shape[1]:].tolist(), drafter.last_speculation_stats


# ---------------------------------------------------------------------------------------------- num_assistant_tokens
@pytest.mark.parametrize("cap", [0, 1, 2, 20])
def test_num_assistant_tokens_caps_the_drafts_per_round(llama, cap):
    target, drafter = llama
    tokens, stats = assisted(target, drafter, num_assistant_tokens=cap)
    assert tokens == greedy_reference(target, PROMPT, 14)
    assert all(p <= min(cap, drafter.config.block_size) for p in stats.proposed), stats
    if cap == 0:
        assert stats.rounds == 0  # no drafts at all: plain decoding through the assisted loop
    else:
        assert max(stats.proposed) == min(cap, drafter.config.block_size)


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_adaptive_schedules_are_refused(llama, schedule):
    target, drafter = llama
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule.*policy="):
        assisted(target, drafter, num_assistant_tokens_schedule=schedule)
    target.generation_config.num_assistant_tokens_schedule = schedule  # also from the target's own config
    try:
        with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
            assisted(target, drafter)
    finally:
        target.generation_config.num_assistant_tokens_schedule = None


# ---------------------------------------------------------------------------------------------- confidence threshold
@pytest.mark.parametrize("threshold, expected", [(0.6, 1), (0.45, 2), (0.3, 3), (0.8, 0), (0.4, 4)])
def test_confidence_threshold_is_the_threshold_policy(threshold, expected):
    target = make_target("llama")
    # c = sigmoid(0.847) = 0.7 everywhere, so the prefix survival of draft j is 0.7^j: 0.7, 0.49, 0.34, 0.24
    drafter = fixed_confidence_drafter(target, 0.8473)
    tokens, stats = assisted(target, drafter, assistant_confidence_threshold=threshold)
    assert tokens == greedy_reference(target, PROMPT, 14)
    if expected == 0:
        assert stats.rounds == 0
    else:  # 0.4 is transformers' default, which generate() fills in unasked: the whole block
        assert max(stats.proposed) == expected and all(p <= expected for p in stats.proposed)
    batched = dspark_hf.generate(target, drafter, IDS, max_new_tokens=14, policy="threshold", threshold=threshold,
                                 return_dict_in_generate=True)
    if 0 < expected < 4:  # the batched loop's threshold policy verifies the same number of drafts per round
        assert max(s for row in batched.stats for s in row.verify_lengths) == expected


def test_confidence_threshold_needs_a_confidence_head():
    target = make_target("llama")
    drafter = dflash_drafter(target)
    with pytest.raises(ValueError, match="confidence head"):
        assisted(target, drafter, assistant_confidence_threshold=0.7)
    tokens, _ = assisted(target, drafter)  # transformers' default 0.4 is "not set"
    assert tokens == greedy_reference(target, PROMPT, 14)


@pytest.mark.parametrize("name, value", [("num_assistant_tokens", 5), ("assistant_confidence_threshold", 0.7),
                                         ("num_assistant_tokens_schedule", "heuristic")])
def test_batched_loop_refuses_assistant_settings_it_cannot_honour(llama, name, value):
    target, drafter = llama
    with pytest.raises(NotImplementedError, match=rf"{name}=.*policy="):
        dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="fixed", **{name: value})
    with pytest.raises(NotImplementedError, match=name):
        target.generate(IDS, custom_generate=dspark_hf.speculative_generate, drafter=drafter, policy="fixed",
                        max_new_tokens=4, **{name: value})


# ---------------------------------------------------------------------------------------------- streamers
def test_streamers_on_every_entry_point(llama, capsys):
    target, drafter = llama
    ref = greedy_reference(target, PROMPT, 10)
    entries = {
        "assisted": lambda s: target.generate(IDS, assistant_model=drafter, max_new_tokens=10, do_sample=False,
                                              streamer=s),
        "dspark_hf.generate": lambda s: dspark_hf.generate(target, drafter, IDS, max_new_tokens=10, policy="fixed",
                                                           streamer=s),
        "custom_generate": lambda s: target.generate(IDS, custom_generate=dspark_hf.speculative_generate,
                                                     drafter=drafter, policy="fixed", max_new_tokens=10, streamer=s),
    }
    for name, run in entries.items():
        streamer = Collect()
        out = run(streamer)
        assert streamer.ended, name
        assert streamer.chunks[0] == PROMPT, name  # the prompt once, first
        assert sum(streamer.chunks[1:], []) == ref == out[0, len(PROMPT):].tolist(), name

    tokenizer = make_tokenizer()  # a TextStreamer prints the prompt and then the generated text
    capsys.readouterr()
    out = target.generate(IDS, custom_generate=dspark_hf.speculative_generate, drafter=drafter, policy="fixed",
                          max_new_tokens=10, streamer=TextStreamer(tokenizer))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0]).strip()
    assert tokenizer.decode(ref).strip() in printed


def test_streamer_with_a_batch_is_refused(llama):
    target, drafter = llama
    with pytest.raises(ValueError, match="batch size 1"):
        dspark_hf.generate(target, drafter, torch.tensor([PROMPT, PROMPT]), max_new_tokens=4, policy="fixed",
                           streamer=Collect())


# ---------------------------------------------------------------------------------------------- num_drafting_tokens
@pytest.mark.parametrize("cap", [1, 3, 20])
def test_num_drafting_tokens_is_the_most_drafts_a_round_proposes(llama, cap):
    """transformers >= 5.25 reads `candidate_generator.num_drafting_tokens` before its assisted loop starts (to size a
    linear-attention cache's rollback history); it is the drafts-per-round cap, or the lookup's if that is longer."""
    import copy

    from dspark_hf.models.candidate_generator import AssistOptions, DSparkCandidateGenerator

    target, drafter = llama
    config = copy.deepcopy(target.generation_config)
    config.num_assistant_tokens, config.max_length = cap, 30
    generator = DSparkCandidateGenerator(drafter, target, config)
    assert generator.num_drafting_tokens == min(cap, drafter.config.block_size)
    _, stats = assisted(target, drafter, num_assistant_tokens=cap)
    assert max(stats.proposed) <= generator.num_drafting_tokens
    seq = PROMPT * 3
    lookup = dspark_hf.NgramLookup.build([(seq, [1] * len(seq))], max_order=4, heldout_share=0.0)
    drafter.assist_options = AssistOptions(lookup=lookup, lookup_max_tokens=9)
    try:
        with_lookup = DSparkCandidateGenerator(drafter, target, config)
    finally:
        drafter.assist_options = None
    assert with_lookup.num_drafting_tokens == max(9, min(cap, drafter.config.block_size))
