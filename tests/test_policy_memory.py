"""`PolicyMemory`: what the priced policies learned in one call carried into the next (`generate(policy_memory=)`).
The output stays the target's own; a warm call starts where the last call of its kind ended (a drafter that never
pays is not probed again at once); kinds of calls keep their own state; bad use raises a clear error."""

import pytest
import torch

import dspark_hf
from conftest import fixed_confidence_drafter, greedy_reference, left_pad, make_drafter, make_target
from dspark_hf.decoding.policy_memory import LearnedState, PolicyMemory
from dspark_hf.decoding.round_state import IdleBackoff, OnlineCalibration, RealizedGain, RoundClock

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]
# a cost curve of forwards that cost little more per token (verifying pays where drafts survive), priced as given
# (no timed corrections, no measured overhead): the policy's choices do not depend on the machine
COST = dict(sps=lambda b: 1.0 / (1.0 + 0.01 * b), count_round_overhead=False, measured_cost=False, eos_token_id=[],
            record_rounds=True, return_dict_in_generate=True, policy="scheduled")


def _drafter_rounds(out) -> list[bool]:
    """Per round: whether the drafter drafted it (a skipped round records no confidences)."""
    return [r.confidence_logits is not None for r in out.rounds]


def test_a_warm_call_starts_where_the_last_one_ended_and_stays_lossless():
    """A drafter that never pays (confidence ~0): cold, every call probes it in its first rounds; warm, the second call
    starts from the first call's backoff (longer skips), so it drafts in fewer rounds, and both emit the target's
    own greedy tokens."""
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids, mask = left_pad(PROMPTS)
    reference = [greedy_reference(target, p, 40) for p in PROMPTS]
    width = ids.shape[1]
    memory = PolicyMemory()
    cold = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, **COST)
    first = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy_memory=memory,
                               **{k: v for k, v in COST.items() if k != "policy"}, policy="scheduled")
    learned = memory.recall(("scheduled", 4, False, None))
    assert learned is not None and len(memory) == 1
    assert learned.backoff.skip_len > 2  # the first call ended backed off more than a fresh backoff starts
    second = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy_memory=memory, **COST)
    for out in (cold, first, second):
        assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == reference
    assert _drafter_rounds(first) == _drafter_rounds(cold)  # an empty memory is a cold start (skips < max_skip here)
    assert _drafter_rounds(cold)[:2] == [True, True]  # cold: the drafter is probed at once
    assert sum(_drafter_rounds(second)) < sum(_drafter_rounds(cold))
    # the second call started inside the skip the first one ended in, if it ended in one
    assert _drafter_rounds(second)[0] == (learned.backoff.skip_left == 0)


def test_a_drafter_that_pays_keeps_drafting_from_the_first_round():
    """Confident drafts the target accepts (the target's own greedy continuation is what an exact drafter proposes):
    a warm call drafts from its first round on, like a cold one, and its calibration starts from what the first call
    saw."""
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, 3.0, block_size=4)
    ids, mask = left_pad(PROMPTS)
    memory = PolicyMemory()
    dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=24, policy_memory=memory, idle_backoff=False,
                       **COST)
    learned = memory.recall(("scheduled", 4, False, None))
    assert learned.calibration is not None and learned.calibration.history  # what the first call's rounds saw
    second = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=24, policy_memory=memory,
                                idle_backoff=False, **COST)
    assert all(_drafter_rounds(second))  # no backoff asked for: every round drafts
    assert sum(int(r.lengths.sum()) for r in second.rounds) > 0  # and verifies
    width = ids.shape[1]
    assert [second.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == [
        greedy_reference(target, p, 24) for p in PROMPTS]


def test_kinds_of_calls_keep_their_own_state():
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    memory = PolicyMemory()
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[:2] + PROMPTS[:1]):
        ids, mask = left_pad(prompts)
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=8, policy_memory=memory, **COST)
    # 4 rows, 1 row, and 3 rows (bucket 2)
    assert {key[1] for key in memory._states} == {4, 1, 2}
    assert [PolicyMemory.bucket(n) for n in (1, 2, 3, 4, 15, 16, 31, 64)] == [1, 2, 2, 4, 8, 16, 16, 64]
    with pytest.raises(ValueError, match="rows must be >= 1"):
        PolicyMemory.bucket(0)
    memory.clear()
    assert len(memory) == 0


def test_one_memory_per_target_and_drafter_and_priced_policies_only():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids, mask = left_pad(PROMPTS[:2])
    memory = PolicyMemory()
    dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=4, policy_memory=memory, **COST)
    other = make_drafter(target, seed=3)
    with pytest.raises(ValueError, match="another target or drafter"):
        dspark_hf.generate(target, other, ids, mask, max_new_tokens=4, policy_memory=memory, **COST)
    other_target = make_target("llama", vocab_size=96, layers=2)
    with pytest.raises(ValueError, match="another target or drafter"):
        dspark_hf.generate(other_target, make_drafter(other_target), ids, mask, max_new_tokens=4,
                           policy_memory=memory, **COST)
    for kwargs in (dict(policy="fixed"), dict(policy="threshold"), dict(policy="scheduled", speculate=False)):
        with pytest.raises(ValueError, match="policy_memory carries what the priced policies learn"):
            dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=4, policy_memory=PolicyMemory(),
                               eos_token_id=[], **kwargs)


def test_a_restored_state_is_a_copy_with_this_calls_switches():
    state = LearnedState(IdleBackoff(enabled=True, streak=1, skip_left=3, skip_len=8), IdleBackoff(enabled=True),
                         RealizedGain(plain_seconds_per_token=0.01, gains={"drafter": [-0.1]}),
                         RoundClock(priced=True, overhead=0.5, drafting=0.2, rounds=5), OnlineCalibration(),
                         OnlineCalibration())
    off = state.restored(backoff_enabled=False, clock_priced=False, calibrate=False)
    assert not off.backoff.enabled and off.backoff.skip_len == 8 and not off.clock.priced
    assert off.calibration is None and off.lookup_calibration is None
    on = state.restored(backoff_enabled=True, clock_priced=True, calibrate=True)
    on.realized.gains["drafter"].append(1.0)
    on.backoff.skip()
    assert state.realized.gains == {"drafter": [-0.1]} and state.backoff.skip_left == 3  # the original is untouched
    memory = PolicyMemory()
    memory.remember(("scheduled", 4, False, None), state)
    state.backoff.skip_left = 0
    assert memory.recall(("scheduled", 4, False, None)).backoff.skip_left == 3  # stored as a copy


def test_the_bench_runs_the_warm_policy_side_by_side():
    from dspark_hf.evaluation.throughput import _toy_target, run_bench
    from dspark_hf.models.modeling_dspark import DSparkDrafter

    target = _toy_target(0, "toy-tiny")
    drafter = DSparkDrafter.from_target(target, block_size=3, num_hidden_layers=1).eval()
    rows = run_bench(target, drafter, [2], ["scheduled", "scheduled-warm"], 6, lambda b: 1.0 / (0.01 * b), 0.5,
                     repeats=1)
    assert [r.policy for r in rows] == ["none", "scheduled", "scheduled-warm"]
    assert all(r.identical_to_target for r in rows[1:])


def test_the_drafters_skips_run_longer_with_a_memory():
    """`IdleBackoff.max_skip` caps the doubling skips (32 within a call); a `PolicyMemory` raises the drafter's cap to
    its `max_skip`, so a drafter that never pays is probed less often over a stream of calls."""
    backoff = IdleBackoff(enabled=True)
    for _ in range(20):
        backoff.observe(False, min_skip=2)
    assert backoff.skip_len == IdleBackoff.MAX_SKIP == 32
    longer = IdleBackoff(enabled=True, max_skip=128)
    for _ in range(20):
        longer.observe(False, min_skip=2)
    assert longer.skip_len == 128
    with pytest.raises(ValueError, match="max_skip must be an integer >= 2"):
        PolicyMemory(max_skip=1)
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids, mask = left_pad(PROMPTS)
    rounds = {}
    for cap in (32, 128):
        memory = PolicyMemory(max_skip=cap)
        calls = [dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy_memory=memory, **COST)
                 for _ in range(4)]
        rounds[cap] = sum(sum(_drafter_rounds(out)) for out in calls)
        assert memory.recall(("scheduled", 4, False, None)).backoff.skip_len == cap
    assert rounds[128] < rounds[32]
