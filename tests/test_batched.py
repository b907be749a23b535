"""Batched speculative decoding (`dspark_hf.generate`): lossless for every policy, ragged rows, memory bound."""

import math

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

import dspark_hf
from conftest import (Collect, StopAfterToken, batch_oracle, bias_markov_head, exact_joint, fixed_confidence_drafter,
                      generated_rows, greedy_reference, left_pad, make_drafter, make_target, sps_curve)
from dspark_hf.decoding.sps import SPSTable

POLICIES = ["fixed", "threshold", "scheduled", "async"]
PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]

# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("policy", POLICIES)
def test_batched_greedy_equals_each_rows_own_greedy(target, drafter, policy):
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=24, policy=policy, sps=sps_curve,
                             return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (policy, row)
    assert all(s.rounds > 0 and len(s.accepted_lengths) == s.rounds for s in out.stats)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("correct", [0, 2, 4])
def test_batched_greedy_with_accepting_drafter_and_rows_ending_at_different_rounds(policy, correct):
    target = make_target("qwen3")
    prompts = PROMPTS
    ref = {i: greedy_reference(target, p, 30) for i, p in enumerate(prompts)}
    # EOS = a token of row 1's continuation: row 1 stops early, others (likely) run to max_new_tokens
    eos = ref[1][5]
    oracle = batch_oracle(target, prompts, 30, correct)
    ids, mask = left_pad(prompts)
    out = dspark_hf.generate(target, oracle, ids, mask, max_new_tokens=30, policy=policy, sps=sps_curve,
                             eos_token_id=eos, return_dict_in_generate=True)
    rows = generated_rows(out, ids.shape[1])
    for i, p in enumerate(prompts):
        assert rows[i] == greedy_reference(target, p, 30, eos_token_id=eos), (policy, correct, i)
    assert len(rows[1]) == ref[1].index(eos) + 1
    for s in out.stats:  # every round but a row's last (cut by EOS / max_new_tokens) accepts min(correct, l) drafts
        assert all(a == min(correct, l) + 1 for a, l in zip(s.accepted_lengths[:-1], s.verify_lengths[:-1]))
    if correct == 4 and policy == "fixed":
        assert max(s.mean_accepted_length for s in out.stats) > 4


def test_batch_of_one_and_streamer(target, drafter):
    ids, mask = left_pad([PROMPTS[1]])
    streamer = Collect()
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=15, policy="scheduled", sps=sps_curve,
                             streamer=streamer)
    assert out[0, ids.shape[1]:].tolist() == greedy_reference(target, PROMPTS[1], 15)
    assert sum(streamer.chunks, []) == out[0].tolist() and streamer.ended


def test_stopping_criteria_per_row(target, drafter):
    ids, mask = left_pad(PROMPTS)
    stop = greedy_reference(target, PROMPTS[0], 20)[3]
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=20, policy="fixed",
                             stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]),
                             return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        expected = greedy_reference(target, prompt, 20, stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]))
        assert generated_rows(out, ids.shape[1])[row] == expected


def test_custom_generate_entry_matches_library_call(target, drafter):
    ids, mask = left_pad(PROMPTS)
    direct = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=12, policy="threshold", threshold=0.3)
    via_generate = target.generate(input_ids=ids, attention_mask=mask, custom_generate=dspark_hf.speculative_generate,
                                   drafter=drafter, policy="threshold", threshold=0.3, max_new_tokens=12,
                                   do_sample=False)
    assert torch.equal(direct, via_generate)
    out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=dspark_hf.speculative_generate,
                          drafter=drafter, policy="fixed", max_new_tokens=12, do_sample=False,
                          return_dict_in_generate=True)
    assert out.stats[0].rounds > 0 and out.policy == "fixed"


def test_kv_cache_stays_within_the_stated_bound(target):
    drafter = make_drafter(target, block_size=6)  # untrained: most drafts rejected, many holes
    prompts = [[3] * 2, [4] * 20, [5] * 9]
    ids, mask = left_pad(prompts)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=80, policy="fixed", hole_budget=8,
                             return_dict_in_generate=True)
    longest = max(len(p) + int(n) for p, n in zip(prompts, out.num_generated))
    assert out.peak_cache_columns <= longest + 8 + (6 + 1)
    # without compaction the holes would have grown the cache far past that
    assert sum(s.verified - s.accepted for s in out.stats) > 8 + 7


# ---------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("policy,padded,prepacked", [(p, True, False) for p in POLICIES]
                         + [("scheduled", False, False), ("async", False, False), ("scheduled", False, True)])
def test_batched_sampling_matches_the_target_distribution(policy, padded, prepacked):
    """3 tokens over V^3 outcomes from 3000 identical rows in one batch: within 2.5x the TV expected from exact
    sampling. The scheduler's lengths depend on all rows' confidences: still lossless, with the padded rule (one width
    per round from every row's survivals) and with Algorithm 1's ragged one (lengths that differ across rows), also
    where a prepacked target's verification forwards multiply only each row's real tokens (`ragged_verification`)."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = bias_markov_head(make_drafter(target, block_size=3, markov_rank=4, seed=4))
    with torch.no_grad():
        drafter.confidence_head.proj.weight.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    if prepacked:
        from dspark_hf.models.prepacked import prepack_linears, prepacked_available
        if not prepacked_available():
            pytest.skip("this PyTorch build has no oneDNN packed linear")
        prepack_linears(target)
    prompt, rows, n_tokens = [1, 2, 3, 1], 3000, 3
    ids = torch.tensor([prompt] * rows)
    # padded: a row's width costs all 3000 rows, so the curve is flatter for the policy to verify drafts at all
    slope = 0.00004 if padded else 0.0004
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                             temperature=0.9, top_k=3, policy=policy, sps=lambda b: 1.0 / (1.0 + slope * b),
                             threshold=0.3, generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                             padded_pricing=padded, measured_cost=False)
    new = out.sequences[:, len(prompt):]
    codes = (new * torch.tensor([16, 4, 1])).sum(1)
    empirical = torch.bincount(codes, minlength=64).float() / rows
    exact = exact_joint(target, prompt, n_tokens, 0.9, 3, None)
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * rows)).sum().item()
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 2.5 * expected_tv, (policy, tv, expected_tv)
    lengths = [l for s in out.stats for l in s.verify_lengths]
    assert any(l > 0 for l in lengths)  # drafts were verified (and some rejected) ...
    assert sum(s.verified - s.accepted for s in out.stats) > 0
    if policy == "threshold" or (policy in ("scheduled", "async") and not padded):
        assert len(set(lengths)) > 1  # ... with lengths that vary across rows and rounds


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_are_clear_errors(target, drafter):
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=0)
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\].*empty"):
        dspark_hf.generate(target, drafter, ids, empty, max_new_tokens=5)
    with pytest.raises(ValueError, match="left-padded"):
        dspark_hf.generate(target, drafter, ids, mask.flip(1), max_new_tokens=5)
    with pytest.raises(ValueError, match="policy"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, policy="greedy")
    with pytest.raises(ValueError, match="non-empty"):
        dspark_hf.generate(target, drafter, torch.zeros(0, 3, dtype=torch.long), max_new_tokens=5)
    with pytest.raises(ValueError, match="streamer"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, streamer=Collect())
    no_conf = make_drafter(target, confidence_head=False)
    with pytest.raises(ValueError, match="confidence head"):
        dspark_hf.generate(target, no_conf, ids, mask, max_new_tokens=5, policy="scheduled", sps=sps_curve)


def test_nan_confidences_are_refused(target):
    drafter = make_drafter(target)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.fill_(float("nan"))
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="NaN"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, policy="scheduled", sps=sps_curve)


def test_sps_table_of_another_target_is_refused(tmp_path, target, drafter):
    other = make_target("llama", layers=6)
    table = dspark_hf.profile_sps(other, max_tokens=8, context_lengths=(8,), repeats=1, progress=False)
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="Re-profile"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, policy="scheduled", sps=table)
    table.save(tmp_path / "sps.json")
    with pytest.raises(ValueError, match="Re-profile"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, policy="scheduled",
                           sps=tmp_path / "sps.json")
    refreshed = SPSTable.load(tmp_path / "sps.json", target=target, reprofile=True, max_tokens=8,
                              context_lengths=(8,), repeats=1, progress=False)
    refreshed.check(target)
    SPSTable.load(tmp_path / "sps.json", target=target)  # the file now describes this target


def test_sliding_window_targets_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    target = MistralForCausalLM(cfg).eval()
    drafter = make_drafter(target)
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="sliding-window"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=5, policy="fixed")


@pytest.mark.parametrize("policy", ["scheduled", "async"])
def test_idle_backoff_skips_the_drafter_when_the_policy_verifies_nothing(policy):
    """A drafter whose confidences are ~0: the policy verifies no draft, so after 2 such rounds the loop stops calling
    the drafter (doubling skips, probing in between). Output is unchanged: plain greedy either way."""
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids = torch.tensor([[5, 17, 33, 2], [40, 41, 42, 43]])
    mask = torch.ones_like(ids)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    calls = []
    original = drafter.draft
    drafter.draft = lambda *a, **k: calls.append(1) or original(*a, **k)
    sps = lambda b: 1.0 / (0.01 * b)  # steps/s: every verified token costs as much as a row
    runs = {}
    for backoff in (True, False):
        calls.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy=policy, sps=sps,
                                 idle_backoff=backoff, record_rounds=True, return_dict_in_generate=True,
                                 count_round_overhead=False, measured_cost=False)  # (the given curve, not timings:
        # the tiny target's forwards of 1-5 tokens time alike, which would make any draft free to verify)
        assert torch.equal(out.sequences, ref)
        rounds = len(out.rounds)
        assert all(int(r.lengths.max()) == 0 for r in out.rounds)
        runs[backoff] = (len(calls), rounds, sum(r.confidence_logits is None for r in out.rounds))
    (drafted, rounds, skipped), (drafted_off, rounds_off, skipped_off) = runs[True], runs[False]
    assert drafted_off == rounds_off and skipped_off == 0
    assert rounds == rounds_off and skipped == rounds - drafted and drafted <= 8 < rounds  # 2 + probes at 2, 4, 8, ...


def _record_contexts(drafter, calls):
    """Wraps `drafter.draft` / `append_context`: every draft records a copy of the context it was given (keys of the
    first draft layer, validity, positions); `calls` counts both."""
    draft, append = drafter.draft, drafter.append_context
    seen = []

    def recording_draft(cache, *a, **k):
        calls["draft"] += 1
        seen.append((cache.keys[0].clone(), cache.valid.clone(), cache.positions.clone()))
        return draft(cache, *a, **k)

    def counting_append(*a, **k):
        calls["append"] += 1
        return append(*a, **k)

    drafter.draft, drafter.append_context = recording_draft, counting_append
    return seen


def test_drafter_context_is_built_only_when_a_round_drafts_and_equals_the_round_by_round_context(monkeypatch):
    """The drafter's context is lazy: the verified tokens' target features wait until a round drafts, then go into
    the drafter's cache in one `append_context` call. Under idle backoff (a drafter the policy never verifies) the
    loop appends exactly once per drafting round, never in the skipped rounds; and every context a draft reads equals
    (same columns, validity, positions; keys to float rounding) the one appended after every round, also after a row
    finished (EOS) while the drafter was skipped (its pending features leave with it)."""
    from dspark_hf.decoding.round_state import ActiveRows

    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    prompts = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [9, 8, 7]]
    eos = greedy_reference(target, prompts[1], 40)[11]  # row 1 stops after ~12 tokens, while the drafter is skipped
    ids, mask = left_pad(prompts)
    ref = [greedy_reference(target, p, 40, eos_token_id=eos) for p in prompts]
    sps = lambda b: 1.0 / (0.01 * b)
    runs = {}
    for eager in (False, True):
        if eager:  # the reference: the context appended after every round (what the loop did before)
            advance = ActiveRows.advance
            monkeypatch.setattr(ActiveRows, "advance",
                                lambda self, *a, **k: (advance(self, *a, **k), self.drafter_context())[0])
        calls = {"draft": 0, "append": 0}
        seen = _record_contexts(drafter, calls)
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy="scheduled", sps=sps,
                                 eos_token_id=eos, record_rounds=True, return_dict_in_generate=True,
                                 count_round_overhead=False)
        assert generated_rows(out, ids.shape[1]) == ref
        assert any(len(r.rows) < len(prompts) and r.confidence_logits is not None for r in out.rounds)
        runs[eager] = (calls, seen, len(out.rounds))
        del drafter.draft, drafter.append_context  # the instance attributes: back to the class's methods
    (lazy_calls, lazy_seen, rounds), (eager_calls, eager_seen, _) = runs[False], runs[True]
    assert 2 <= lazy_calls["draft"] < rounds // 2  # backed off: most rounds do not draft
    assert lazy_calls["append"] == lazy_calls["draft"]  # one projection per drafting round, none in skipped rounds
    assert eager_calls["append"] == rounds + 1  # prompt + every round
    assert len(lazy_seen) == len(eager_seen) == lazy_calls["draft"]
    for (k_lazy, v_lazy, p_lazy), (k_eager, v_eager, p_eager) in zip(lazy_seen, eager_seen):
        assert torch.equal(v_lazy, v_eager) and torch.equal(p_lazy, p_eager)
        assert torch.allclose(k_lazy, k_eager, atol=1e-5)


def test_the_prompts_context_projection_is_kept_out_of_the_per_round_drafting_cost(monkeypatch):
    """The prompts' context is projected at the first drafting round (lazily), but it is a once-per-call cost like the
    prefill: the round clock the policies price must not see it. A drafter whose projection of the prompts takes
    0.3 s: the first round's measured drafting and overhead seconds stay far below that."""
    import time

    from dspark_hf.decoding.round_state import RoundClock

    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids, mask = left_pad([[5, 17, 33, 2, 9, 9, 9, 9], [40, 41, 42, 43]])
    append = drafter.append_context
    drafter.append_context = lambda cache, features, *a, **k: (
        time.sleep(0.3) if features.shape[1] == ids.shape[1] else None, append(cache, features, *a, **k))[1]
    added = []
    original = RoundClock.add
    monkeypatch.setattr(RoundClock, "add", lambda self, o, d: added.append((o, d)) or original(self, o, d))
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=6, policy="scheduled", sps=sps_curve,
                             return_dict_in_generate=True)
    del drafter.append_context
    assert out.sequences.shape[1] == ids.shape[1] + 6
    assert added and max(o for o, _ in added) < 0.15 and max(d for _, d in added) < 0.15


def test_idle_backoff_skips_a_drafter_that_costs_more_than_it_is_expected_to_save():
    """Confidences ~1 make the policy verify the whole block, but the drafter takes 0.2 s against a 20 ms target
    forward: with its measured time priced in, drafting is expected to lose to plain decoding, so the loop backs off.
    The same drafter at no extra cost keeps drafting every round. Output is plain greedy in both runs."""
    import time

    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, 30.0, block_size=4)
    ids = torch.tensor([[5, 17, 33, 2], [40, 41, 42, 43]])
    mask = torch.ones_like(ids)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    original = drafter.draft
    sps = lambda b: 1.0 / (0.02 + 0.0001 * b)  # a memory-bound target: a round costs ~20 ms whatever its width
    runs = {}
    for delay in (0.0, 0.2):
        calls = []
        drafter.draft = lambda *a, _d=delay, **k: calls.append(1) or time.sleep(_d) or original(*a, **k)
        # the overhead pricing alone: the synthetic curve as given, the (untrained) drafter's estimates uncorrected
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, policy="scheduled", sps=sps,
                                 record_rounds=True, return_dict_in_generate=True, measured_cost=False,
                                 online_calibration=False)
        assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
        drafted = [r for r in out.rounds if r.confidence_logits is not None]
        assert len(drafted) == len(calls) and int(drafted[0].lengths.min()) == 4  # the policy wants the whole block
        runs[delay] = (len(calls), len(out.rounds))
    assert runs[0.0][0] == runs[0.0][1]  # cheap drafter: drafts every round
    assert runs[0.2][0] <= runs[0.2][1] // 2  # slow drafter: first rounds, then probes only
