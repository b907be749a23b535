"""`record_rounds=True`: every `RoundRecord` carries the draft tokens the drafter proposed in that round.

The recorded drafts' first `accepted` tokens are exactly the tokens the round emitted before its bonus / correction
token; rounds that skipped the drafter (idle backoff) record `drafts=None`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import batch_oracle, fixed_confidence_drafter, generated_rows, left_pad, make_drafter, make_target

import dspark_hf


def _check_rounds_against_output(out, width: int) -> int:
    """Replays the records row by row: row r emits 1 token at prefill, then `accepted + 1` per round (cut at the
    end). Returns how many accepted drafts were checked."""
    generated = generated_rows(out, width)
    offset = {r: 1 for r in range(len(generated))}  # the prefill's first token
    checked = 0
    for record in out.rounds:
        if record.drafts is None:  # a round that skipped the drafter: one token of the target's per row
            assert int(record.accepted.sum()) == 0 and int(record.lengths.sum()) == 0
            for row in record.rows.tolist():
                offset[row] += 1
            continue
        assert record.drafts.dim() == 2 and record.drafts.shape[0] == record.rows.shape[0]
        assert record.drafts.dtype == torch.long
        for i, row in enumerate(record.rows.tolist()):
            accepted, length = int(record.accepted[i]), int(record.lengths[i])
            assert accepted <= length <= record.drafts.shape[1]
            emitted = generated[row][offset[row]: offset[row] + accepted + 1]
            proposed = record.drafts[i, :accepted].tolist()
            assert proposed == emitted[:accepted]
            checked += accepted
            offset[row] += accepted + 1
    return checked


@pytest.mark.parametrize("correct", [0, 2, 4])
def test_recorded_drafts_are_the_emitted_tokens(correct):
    """An oracle drafter right for `correct` slots per round: the accepted drafts are the emitted tokens."""
    target = make_target("llama")
    prompts = [[5, 17, 33, 2, 9], [40, 41, 42], [7, 7, 8, 9, 10, 11]]
    drafter = batch_oracle(target, prompts, max_new_tokens=20, correct=correct, block_size=4)
    ids, mask = left_pad(prompts)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=20, policy="fixed", record_rounds=True,
                             return_dict_in_generate=True)
    assert all(r.drafts is not None and r.drafts.shape[1] == 4 for r in out.rounds)  # "fixed" drafts every round
    checked = _check_rounds_against_output(out, ids.shape[1])
    if correct:
        assert checked > 0
    else:
        assert all(int(r.accepted.sum()) == 0 for r in out.rounds)


def test_recorded_drafts_of_a_real_drafter_with_sampling():
    """A random drafter, sampled decoding: drafts recorded every round, the accepted ones are what was emitted."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43]]
    ids, mask = left_pad(prompts)
    for policy in ("fixed", "scheduled"):  # "scheduled" may also skip the drafter (idle backoff): drafts=None there
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, do_sample=True, temperature=0.7,
                                 generator=torch.Generator().manual_seed(0), record_rounds=True, policy=policy,
                                 return_dict_in_generate=True)
        _check_rounds_against_output(out, ids.shape[1])


def test_rounds_that_skip_the_drafter_record_no_drafts():
    """Idle backoff (confidences ~0, the policy verifies nothing): skipped rounds record `drafts=None`, drafted rounds
    the drafter's block, exactly where the confidence logits are recorded."""
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids = torch.tensor([[5, 17, 33, 2], [40, 41, 42, 43]])
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=30, policy="scheduled",
                             sps=lambda b: 1.0 / (0.01 * b), idle_backoff=True, record_rounds=True,
                             return_dict_in_generate=True, count_round_overhead=False)
    skipped = [r for r in out.rounds if r.drafts is None]
    drafted = [r for r in out.rounds if r.drafts is not None]
    assert skipped and drafted
    assert all(r.confidence_logits is None for r in skipped)
    assert all(r.confidence_logits is not None and r.drafts.shape == r.confidence_logits.shape for r in drafted)
