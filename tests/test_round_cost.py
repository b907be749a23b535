"""What a decoding round costs outside the target's forward (issue 14, part 4), and that the cheaper rounds decode
exactly as before: the drafting-off mode (`speculate=False`), no compaction when nothing was rejected, the K = 0
fast path of `verify`, the tensor `RowOutputs.emit`, the block-wise stop checks of the batch-1 candidate generator,
and a drafter context that stays complete through the idle backoff's skipped rounds."""

import pytest
import torch
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria,
                                                       StoppingCriteriaList)

import dspark_hf
from conftest import (StopAfterToken, batch_oracle, fixed_confidence_drafter, greedy_reference, left_pad,
                      make_drafter, make_target)
from dspark_hf.decoding import round_state
from dspark_hf.models.candidate_generator import DSparkCandidateGenerator, _StopRules
from dspark_hf.decoding.round_state import RowOutputs
from dspark_hf.decoding.verification import SamplingParams, greedy_verify, rejection_verify, verify


PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]


def _plain_rows(target, prompts, n, **kw):
    return [greedy_reference(target, p, n, **kw) for p in prompts]


# ---------------------------------------------------------------------------------------------- speculate=False
def test_drafting_off_equals_plain_greedy_and_never_touches_the_drafter(target):
    drafter = make_drafter(target)
    calls = []
    for name in ("draft", "append_context", "context_features"):
        original = getattr(drafter, name)
        setattr(drafter, name, lambda *a, _n=name, _o=original, **k: calls.append(_n) or _o(*a, **k))
    asked = []
    hook = target.register_forward_pre_hook(lambda m, a, k: asked.append(k.get("output_hidden_states")),
                                            with_kwargs=True)
    try:
        ids, mask = left_pad(PROMPTS)
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=12, speculate=False, eos_token_id=[],
                                 return_dict_in_generate=True)
        none = dspark_hf.generate(target, None, ids, mask, max_new_tokens=12, speculate=False, eos_token_id=[])
    finally:
        hook.remove()
    assert calls == []
    assert asked and all(not a for a in asked)  # no hidden states asked of the target
    width = ids.shape[1]
    assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 12)
    assert torch.equal(none, out.sequences)
    assert all(s.rounds == 11 and s.verified == 0 and s.accepted_lengths == [1] * 11 for s in out.stats)


def test_drafting_off_matches_transformers_batched_generate_with_eos():
    target = make_target("llama")
    ids, mask = left_pad(PROMPTS)
    eos = int(_plain_rows(target, PROMPTS[:1], 6)[0][3])  # a token the first row emits
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    out = dspark_hf.generate(target, None, ids, mask, max_new_tokens=10, speculate=False, eos_token_id=eos,
                             pad_token_id=0)
    assert torch.equal(out, ref[:, : out.shape[1]])


def test_drafting_off_sampling_draws_the_targets_own_tokens_from_the_generator():
    """One row, sampled: each token is one draw from the target's processed distribution, from `generator`, in order
    (a step-by-step reference with its own cache and the same generator)."""
    from transformers import DynamicCache

    target = make_target("llama")
    sampling = SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    ids = torch.tensor([PROMPTS[1]])
    out = dspark_hf.generate(target, None, ids, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20,
                             top_p=0.9, eos_token_id=[], speculate=False, generator=torch.Generator().manual_seed(3))
    g, cache, seq = torch.Generator().manual_seed(3), DynamicCache(), ids
    with torch.no_grad():
        logits = target(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(10):
            tok = torch.multinomial(torch.softmax(sampling.warp(logits), -1), 1, generator=g)
            seq = torch.cat([seq, tok], dim=1)
            logits = target(input_ids=tok, cache=cache, use_cache=True).logits[:, -1]
    assert torch.equal(out, seq)


def test_drafting_off_needs_no_drafter_but_drafting_does(target):
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="needs a drafter"):
        dspark_hf.generate(target, None, ids, mask, max_new_tokens=3)
    out = target.generate(ids, attention_mask=mask, custom_generate=dspark_hf.speculative_generate, drafter=None,
                          speculate=False, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, dspark_hf.generate(target, None, ids, mask, max_new_tokens=5, speculate=False,
                                               eos_token_id=[]))


# ---------------------------------------------------------------------------------------------- compaction
def _count_compactions(monkeypatch):
    calls = []
    original = round_state.compact_target_cache
    monkeypatch.setattr(round_state, "compact_target_cache", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("speculate", [True, False])
def test_no_compaction_when_nothing_is_rejected(monkeypatch, target, speculate):
    calls = _count_compactions(monkeypatch)
    ids, mask = left_pad(PROMPTS)
    drafter = batch_oracle(target, PROMPTS, 24, correct=99)  # every draft accepted
    out = dspark_hf.generate(target, drafter if speculate else None, ids, mask, max_new_tokens=24, policy="fixed",
                             speculate=speculate, hole_budget=0, eos_token_id=[], return_dict_in_generate=True)
    assert calls == []
    if speculate:
        assert all(a > 1 for s in out.stats for a in s.accepted_lengths[:-1])  # drafts were verified and kept
    width = ids.shape[1]
    assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 24)


def test_rejections_still_compact_and_stay_exact(monkeypatch, target):
    calls = _count_compactions(monkeypatch)
    ids, mask = left_pad(PROMPTS)
    drafter = batch_oracle(target, PROMPTS, 24, correct=1)  # one draft accepted, the rest rejected: holes
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=24, policy="fixed", hole_budget=3,
                             eos_token_id=[], return_dict_in_generate=True)
    assert calls  # holes past the budget are compacted
    assert out.peak_cache_columns <= ids.shape[1] + 24 + 3 + drafter.config.block_size + 1
    width = ids.shape[1]
    assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 24)


# ---------------------------------------------------------------------------------------------- verify, K = 0
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True),
                                      SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.8)])
def test_verify_without_drafts_is_the_general_rule(sampling):
    logits = torch.randn(6, 1, 50, generator=torch.Generator().manual_seed(0)) * 3
    drafts = torch.zeros(6, 0, dtype=torch.long)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    fast = verify(drafts, logits[:, :0], logits, sampling, num_drafts=torch.zeros(6, dtype=torch.long), generator=g1)
    if sampling.do_sample:
        probs = torch.softmax(sampling.warp(logits), dim=-1)
        ref = rejection_verify(drafts, probs[:, :0], probs, torch.zeros(6, dtype=torch.long), generator=g2)
    else:
        ref = greedy_verify(drafts, logits, torch.zeros(6, dtype=torch.long))
    for name in ("num_accepted", "next_tokens", "tokens"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert torch.equal(g1.get_state(), g2.get_state())  # the same draws from the generator


# ---------------------------------------------------------------------------------------------- RowOutputs.emit
def _outputs(rows=3, max_new=6, eos=(7,), criteria=None):
    ids = torch.ones(rows, 2, dtype=torch.long)
    return RowOutputs(ids, torch.ones_like(ids), max_new_tokens=max_new, eos_token_ids=eos,
                      stopping_criteria=criteria, streamer=None, pad_token_id=0, started=0.0)


def test_emit_cuts_at_eos_and_max_new_tokens_and_logs_stats():
    out = _outputs()
    rows = torch.tensor([0, 1, 2])
    done = out.emit(rows, torch.tensor([[1], [2], [3]]), torch.ones(3, dtype=torch.long))
    assert not done.any()
    tokens = torch.tensor([[4, 7, 5, 0], [5, 6, 8, 9], [9, 9, 9, 9]])
    done = out.emit(rows, tokens, torch.tensor([3, 4, 2]), torch.tensor([3, 3, 1]), torch.tensor([2, 3, 1]))
    assert done.tolist() == [True, False, False]  # row 0 emitted EOS (and keeps it)
    done = out.emit(rows[1:], torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([4, 4]),
                    torch.tensor([3, 3]), torch.tensor([3, 3]))
    assert done.tolist() == [True, True]  # max_new_tokens; row 2 also reaches EOS (7) exactly at its end
    assert out.tokens == [[1, 4, 7], [2, 5, 6, 8, 9, 1], [3, 9, 9, 5, 6, 7]]
    assert out.num_generated.tolist() == [3, 6, 6]
    assert out.sequences()[:, 2:].tolist() == [[1, 4, 7, 0, 0, 0], [2, 5, 6, 8, 9, 1], [3, 9, 9, 5, 6, 7]]
    s = out.stats
    assert [x.rounds for x in s] == [1, 2, 2]
    assert s[1].accepted_lengths == [4, 4] and s[1].verify_lengths == [3, 3] and s[1].accepted == 6
    assert s[2].accepted_lengths == [2, 4] and s[2].verified == 4


def test_emit_with_stopping_criteria_checks_every_token():
    out = _outputs(eos=(), criteria=StoppingCriteriaList([StopAfterToken(5)]))
    rows = torch.tensor([0, 1, 2])
    out.emit(rows, torch.tensor([[1], [2], [3]]), torch.ones(3, dtype=torch.long))
    done = out.emit(rows, torch.tensor([[4, 5, 6], [6, 6, 6], [5, 1, 1]]), torch.tensor([3, 3, 1]),
                    torch.tensor([2, 2, 0]), torch.tensor([2, 2, 0]))
    assert done.tolist() == [True, False, True]
    assert out.tokens == [[1, 4, 5], [2, 6, 6, 6], [3, 5]]


# ---------------------------------------------------------------------------------------------- batch-1 stop checks
class _Fires(StoppingCriteria):
    """A user criterion: fires once the sequence holds `count` copies of `token`."""

    def __init__(self, token, count):
        self.token, self.count, self.calls = token, count, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return ((input_ids == self.token).sum(-1) >= self.count)


def _reference_cut(criteria, input_ids, tokens, logits):
    for j in range(tokens.shape[1]):
        prefix = torch.cat([input_ids, tokens[:, : j + 1]], dim=-1)
        if bool(criteria(prefix, logits[:, j]).any()):
            return j
    return tokens.shape[1]


def test_block_stop_checks_equal_the_per_draft_loop(monkeypatch):
    calls = []
    original = EosTokenCriteria.__call__
    monkeypatch.setattr(EosTokenCriteria, "__call__", lambda *a, **k: calls.append(1) or original(*a, **k))
    g = torch.Generator().manual_seed(0)
    gen = DSparkCandidateGenerator.__new__(DSparkCandidateGenerator)
    for trial in range(200):
        length = int(torch.randint(3, 12, (1,), generator=g))
        input_ids = torch.randint(0, 9, (1, length), generator=g)
        tokens = torch.randint(0, 9, (1, 6), generator=g)
        logits = torch.randn(1, 6, 9, generator=g)
        user = _Fires(int(torch.randint(0, 9, (1,), generator=g)), 3) if trial % 2 else None
        criteria = StoppingCriteriaList([MaxLengthCriteria(int(torch.randint(4, 20, (1,), generator=g))),
                                         EosTokenCriteria([int(torch.randint(0, 9, (1,), generator=g)), 11])]
                                        + ([user] if user else []))
        expected = _reference_cut(criteria, input_ids, tokens, logits)
        calls.clear()
        gen._stop = _StopRules.split(criteria)
        assert gen._drafts_before_stop(input_ids, tokens, logits) == expected, trial
        assert calls == []  # EOS checked for the whole block at once, never per draft
    assert _StopRules.split(StoppingCriteriaList([MaxLengthCriteria(5)])).per_token is None


# ---------------------------------------------------------------------------------------------- backoff context
def test_skipped_rounds_keep_the_drafter_context_complete():
    """The idle backoff skips the drafter for whole stretches of rounds; every probe must still find the context of
    every verified token (positions 0 .. anchor - 1, nothing missing)."""
    target = make_target("llama")
    drafter = fixed_confidence_drafter(target, -30.0, block_size=4)
    ids, mask = left_pad(PROMPTS)
    seen = []
    original = drafter.draft

    def draft(cache, anchors, *, anchor_positions, **kw):
        for r in range(len(anchors)):
            valid = cache.valid[r]
            positions = sorted(cache.positions[r][valid].tolist())
            seen.append(positions == list(range(int(anchor_positions[r]))))
        return original(cache, anchors, anchor_positions=anchor_positions, **kw)

    drafter.draft = draft
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy="scheduled",
                             sps=lambda b: 1.0 / (0.01 * b), count_round_overhead=False, eos_token_id=[],
                             record_rounds=True, return_dict_in_generate=True)
    skipped = sum(r.confidence_logits is None for r in out.rounds)
    assert skipped > 10 and len(seen) > 2 * len(PROMPTS) and all(seen)
    width = ids.shape[1]
    assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 40)


# ---------------------------------------------------------------------------------------------- measured cost curve
def test_measured_cost_drops_warm_ups_uses_medians_scales_the_prior_and_stays_monotone():
    from dspark_hf.decoding.round_state import MeasuredCost

    prior = lambda b: 1.0 / (0.010 * b.double())  # noqa: E731  10 ms per token
    cost = MeasuredCost(prior, window=3)
    b = torch.tensor([4, 8, 16, 32])
    assert torch.allclose(cost.seconds_per_step(b), torch.tensor([0.04, 0.08, 0.16, 0.32], dtype=torch.float64))
    cost.observe(8, 5.0)  # the first forward of a shape (warm-up): dropped
    assert torch.allclose(cost.seconds_per_step(b), torch.tensor([0.04, 0.08, 0.16, 0.32], dtype=torch.float64))
    for seconds in (0.040, 0.041, 0.900, 0.039):  # one outlier among them; the window keeps the last 3
        cost.observe(8, seconds)
    # B = 8 measured at half the prior: its median, and the prior elsewhere scaled by the median ratio (about 0.51)
    got = cost.seconds_per_step(b)
    assert got[1] == pytest.approx(0.041)
    assert got[3] == pytest.approx(0.32 * 0.50625, rel=1e-6)  # ratios 0.5, 0.5125, 11.25, 0.4875: median 0.50625
    assert bool((got[1:] >= got[:-1]).all())  # monotone in B
    assert torch.allclose(cost.steps_per_second(b), 1.0 / got)
    cost.observe(4, 1.0)
    cost.observe(4, 0.2)
    cost.observe(4, 0.2)  # B = 4 now measured dearer than B = 8: the running maximum lifts B = 8 to it
    got = cost.seconds_per_step(b)
    assert got[0] == pytest.approx(0.2) and got[1] == pytest.approx(0.2)
    cost.observe(0, 1.0)
    cost.observe(16, float("nan"))  # ignored
    assert (None, 0) not in cost.samples and (None, 16) not in cost.samples and len(cost.samples) == 2


def test_the_scheduled_policy_reads_the_forwards_it_timed(monkeypatch, target):
    """`measured_cost=True` feeds every timed target forward (its tokens, padding included) to the policy's cost
    curve, and the output stays the target's greedy output."""
    from dspark_hf.decoding import round_state

    seen = []
    original = round_state.MeasuredCost.observe
    monkeypatch.setattr(round_state.MeasuredCost, "observe",
                        lambda self, b, s: seen.append(b) or original(self, b, s))
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=10, policy="scheduled", eos_token_id=[],
                             sps=lambda b: 1.0 / (1.0 + 0.01 * b), return_dict_in_generate=True)
    width = ids.shape[1]
    assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 10)
    assert len(seen) == max(s.rounds for s in out.stats)  # one timed forward per round
    assert seen[0] % len(PROMPTS) == 0  # a rectangle: rows x width (every row is active in the first round)
    seen.clear()
    dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=10, policy="scheduled", eos_token_id=[],
                       sps=lambda b: 1.0 / (1.0 + 0.01 * b), measured_cost=False)
    assert seen == []


def test_the_cost_curve_follows_the_rows_left(monkeypatch, target):
    """A table profiled in the loop's layout (`profile_sps(rows=R)`) is priced at the rows each round has: rows that
    stop at EOS leave the round, and the cost (and its measured times) follows them; the output is unchanged."""
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    free = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=10, policy="fixed", eos_token_id=[])
    stop = int(free[0, width + 1])  # row 0's second token: with it as EOS, row 0 stops early
    table = dspark_hf.profile_sps(target, max_tokens=4 * 5, context_lengths=(8,), repeats=1, progress=False, rows=4)
    seen = []
    original = round_state.MeasuredCost.set_rows
    monkeypatch.setattr(round_state.MeasuredCost, "set_rows", lambda self, r: seen.append(r) or original(self, r))
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=10, policy="scheduled", eos_token_id=[stop],
                             sps=table, return_dict_in_generate=True, record_rounds=True,
                             drop_finished="always")  # (riders would stay in the forward, not in the records)
    assert seen == [len(r.rows) for r in out.rounds] and seen[0] == 4 and min(seen) < 4  # the rows of every round
    plain = dspark_hf.generate(target, None, ids, mask, max_new_tokens=10, eos_token_id=[stop], speculate=False)
    assert torch.equal(out.sequences, plain)


def test_online_calibration_scales_survivals_by_what_past_rounds_accepted():
    from dspark_hf.decoding.round_state import OnlineCalibration

    cal = OnlineCalibration(window=2, prior=2.0)
    conf = torch.tensor([[0.8, 0.5, 0.5], [0.9, 0.9, 0.9]])
    assert torch.equal(cal.confidences(conf), conf) and cal.kappa == 1.0  # nothing seen: the estimates as given
    survival = torch.cumprod(conf, dim=1)
    verified = torch.tensor([[True, True, False], [True, True, True]])
    cal.observe(survival, verified, torch.tensor([0, 1]))  # predicted 0.8 + 0.4 + 0.9 + 0.81 + 0.729 = 3.639
    assert cal.kappa == pytest.approx((1 + 2) / (3.639 + 2))
    fixed = cal.confidences(conf)
    assert torch.allclose(torch.cumprod(fixed, dim=1), survival * cal.kappa)  # every prefix survival scaled
    assert torch.allclose(cal.survival(survival), survival * cal.kappa)
    cal.observe(survival, torch.zeros_like(verified), torch.tensor([0, 0]))  # nothing verified: not a round
    assert len(cal.history) == 1
    for _ in range(3):  # under-confident estimates: kappa > 1, survivals clipped at 1
        cal.observe(survival * 0.1, verified, torch.tensor([2, 3]))
    assert len(cal.history) == 2 and cal.kappa > 1
    assert float(cal.survival(torch.tensor([[0.9]]))) == 1.0


def test_over_confident_estimates_stop_buying_verification(target):
    """A drafter whose confidence head claims certainty on drafts the target rejects: with the online calibration the
    scheduled policy soon verifies far fewer drafts than without it, and the output is the target's own either way."""
    drafter = fixed_confidence_drafter(target, 8.0, block_size=4)  # sigmoid(8) = 0.9997 per position
    ids, mask = left_pad(PROMPTS)
    runs = {}
    for calibrated in (False, True):
        runs[calibrated] = dspark_hf.generate(
            target, drafter, ids, mask, max_new_tokens=24, policy="scheduled", eos_token_id=[],
            sps=lambda b: 1.0 / (1.0 + 0.2 * b), count_round_overhead=False, measured_cost=False,
            idle_backoff=False, online_calibration=calibrated, return_dict_in_generate=True)
    width = ids.shape[1]
    for out in runs.values():
        assert [out.sequences[r, width:].tolist() for r in range(len(PROMPTS))] == _plain_rows(target, PROMPTS, 24)
    verified = {k: sum(s.verified for s in out.stats) for k, out in runs.items()}
    accepted = sum(s.accepted for s in runs[False].stats)
    assert accepted < 0.5 * verified[False]  # the untrained drafter's drafts are mostly rejected ...
    assert verified[True] < 0.6 * verified[False]  # ... and the calibrated policy stops paying for them


def test_a_drafting_round_pays_only_if_it_beats_the_lookup_round_it_replaced():
    """`LengthPolicy.pays(alternative=)`, by hand: R = 1, a flat cost curve of 10 ms per forward, 5 ms measured
    overhead of which 4 ms is the drafter. A round with one draft of survival 0.9 expects 1.9 tokens per 15 ms
    (127/s) against plain decoding's 1 per 11 ms (91/s): it pays. Against a lookup-only round with the same draft at
    11 ms (1.9 / 11 ms = 173/s) it does not; against a lookup round with nothing to draft (91/s) it pays again."""
    from dspark_hf.decoding.round_state import LengthPolicy, RoundClock
    from dspark_hf.models.drafting import DraftBlock

    clock = RoundClock(priced=True)
    clock.add(0.005, 0.004)
    policy = LengthPolicy("scheduled", 2, lambda b: torch.full_like(torch.as_tensor(b, dtype=torch.float), 100.0),
                          0.5, clock, padded=True)

    def block(conf):
        c = torch.tensor([conf])
        return DraftBlock(torch.zeros(1, 2, dtype=torch.long), logits=torch.zeros(1, 2, 4), confidences=c,
                          confidence_logits=torch.logit(c.clamp(1e-6, 1 - 1e-6)))

    drafted, lengths = block([0.9, 0.0]), torch.tensor([1])
    assert policy.pays(drafted, lengths)
    assert not policy.pays(drafted, lengths, alternative=block([0.9, 0.0]))
    assert policy.pays(drafted, lengths, alternative=block([0.0, 0.0]))
    # a lookup-only round with the same draft: 11 ms plus its proposals' time
    assert policy.pays(drafted, lengths, lookup_seconds=0.001)  # 1.9 / 12 ms = 158/s > 91/s
    assert not policy.pays(drafted, lengths, lookup_seconds=0.015)  # 1.9 / 26 ms = 73/s < 91/s


def test_costly_probes_start_longer_skips():
    """`IdleBackoff.observe(min_skip=)` starts a skip at least that long (then doubles, capped at 32; 0 = never
    skip; from 10 on, after one failed round instead of two), and `LengthPolicy.probe_skip` asks for floor(probe / (5% x plain round)):
    a 4 ms drafter next to a 10 ms forward plus 1 ms of other overhead is 4 / (0.05 x 11) -> 7 rounds; 2 before
    anything was measured."""
    from dspark_hf.decoding.round_state import IdleBackoff, LengthPolicy, RoundClock

    backoff = IdleBackoff(enabled=True)
    backoff.observe(False, min_skip=8)
    assert backoff.skip_left == 0  # one failed round: no skip yet
    backoff.observe(False, min_skip=8)
    assert (backoff.skip_left, backoff.skip_len) == (8, 16)
    backoff.skip_left = 0
    cheap = IdleBackoff(enabled=True)  # a probe under 5% of a round: never skipped
    for _ in range(4):
        cheap.observe(False, min_skip=0)
        assert not cheap.skip()
    backoff.observe(False, min_skip=100)
    assert (backoff.skip_left, backoff.skip_len) == (32, 32)
    backoff.observe(True)
    assert (backoff.streak, backoff.skip_len) == (0, 2)
    costly = IdleBackoff(enabled=True)  # a drafter of half a plain round or more: one failed round suffices
    costly.observe(False, min_skip=IdleBackoff.IMPATIENT_SKIP)
    assert (costly.skip_left, costly.skip_len) == (10, 20)
    just_below = IdleBackoff(enabled=True)
    just_below.observe(False, min_skip=IdleBackoff.IMPATIENT_SKIP - 1)
    assert just_below.skip_left == 0

    clock = RoundClock(priced=True)
    policy = LengthPolicy("scheduled", 4, lambda b: torch.full_like(torch.as_tensor(b, dtype=torch.float), 100.0),
                          0.5, clock)
    assert policy.probe_skip(rows=4) == 2
    clock.add(0.005, 0.004)
    assert policy.probe_skip(rows=4) == 7
    assert policy.probe_skip(rows=4, share=1.0) == 0
    assert policy.probe_skip(rows=4, probe_seconds=0.0005) == 0  # a cheap probe (lookup proposals): never skipped
    assert policy.probe_skip(rows=4, probe_seconds=0.0112) == 20


def test_lookup_only_rounds_keep_their_own_calibration():
    """A drafter whose rounds accept nothing shrinks its own estimates, not the lookup-only rounds' (kept apart, so
    they go on verifying the lookup's drafts), and lookup-only rounds feed only their own factor."""
    from dspark_hf.decoding.round_state import LengthPolicy, OnlineCalibration, RoundClock
    from dspark_hf.models.drafting import DraftBlock

    # 4 rows: a plain forward 12 ms, one draft per row 14 ms, two 16 ms; a first draft pays above survival 1/6
    policy = LengthPolicy("scheduled", 2, lambda b: 1.0 / (0.01 * (1.0 + 0.05 * torch.as_tensor(b, dtype=torch.float))),
                          0.5, RoundClock(priced=True), padded=True, calibration=OnlineCalibration(),
                          lookup_calibration=OnlineCalibration())
    conf = torch.full((4, 2), 0.9)
    block = DraftBlock(torch.zeros(4, 2, dtype=torch.long), logits=torch.zeros(4, 2, 3), confidences=conf,
                       confidence_logits=torch.logit(conf))
    for _ in range(3):
        policy.observe(block, torch.full((4,), 2), torch.zeros(4, dtype=torch.long))  # drafter rounds: all rejected
    assert policy.calibration.kappa < 0.2 and policy.lookup_calibration.kappa == 1.0
    assert int(policy.lengths(block, torch.arange(4)).max()) == 0  # the drafter's estimates no longer pay
    # the lookup's still do; a source's first round verifies one draft per row (PROBE_LENGTH), however sure
    assert int(policy.lengths(block, torch.arange(4), with_drafter=False).max()) == 1
    policy.observe(block, torch.full((4,), 2), torch.full((4,), 2), lookup_only=True)
    assert policy.lookup_calibration.kappa > 1.0 and policy.calibration.kappa < 0.2
    assert int(policy.lengths(block, torch.arange(4), with_drafter=False).max()) == 2  # calibrated: the whole block


def test_a_source_probes_one_draft_per_row_until_every_row_could_have_been_calibrated():
    """Uncalibrated estimates are bet on with one draft per row at most: a confident drafter that is wrong costs a
    2-token forward, not a block-wide one. A round in which only some rows verified (2 drafts in 2 of 4 rows, both
    accepted) is not enough evidence; once the calibration has seen as many verified drafts as there are rows, its
    calibrated estimates decide alone."""
    from dspark_hf.decoding.round_state import PROBE_LENGTH, LengthPolicy, OnlineCalibration, RoundClock
    from dspark_hf.models.drafting import DraftBlock

    conf = torch.full((4, 5), 0.95)
    block = DraftBlock(torch.zeros(4, 5, dtype=torch.long), logits=torch.zeros(4, 5, 3), confidences=conf,
                       confidence_logits=torch.logit(conf))
    curve = lambda b: 1.0 / (0.01 * (1.0 + 0.01 * torch.as_tensor(b, dtype=torch.float)))  # noqa: E731
    policy = LengthPolicy("scheduled", 5, curve, 0.5, RoundClock(priced=True), padded=True,
                          calibration=OnlineCalibration(), lookup_calibration=OnlineCalibration())
    assert PROBE_LENGTH == 1 and int(policy.lengths(block, torch.arange(4)).max()) == 1
    policy.observe(block, torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 0, 0]))  # 2 rows verified, both accepted
    assert policy.calibration.verified == 2 and policy.calibration.kappa > 1.0
    assert int(policy.lengths(block, torch.arange(4)).max()) == 1  # still probing
    policy.observe(block, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]))
    assert policy.calibration.verified == 4
    assert int(policy.lengths(block, torch.arange(4)).max()) == 5
    uncalibrated = LengthPolicy("scheduled", 5, curve, 0.5, RoundClock(priced=True), padded=True)
    assert int(uncalibrated.lengths(block, torch.arange(4)).max()) == 5  # online_calibration=False: no probe cap


def test_a_rounds_width_prices_the_overhead_as_often_as_rounds_draft():
    """Once a round has drafted, its overhead is spent; a shorter verification costs later rounds, which pay the
    overhead only as often as rounds draft. Under load (most rounds plain) a 2-token round at 64 rows that accepts
    half its drafts must not look worth it merely because a large overhead is added to both widths."""
    from dspark_hf.decoding.round_state import RoundClock
    from dspark_hf.decoding.scheduler import schedule_width

    sps = lambda b: 1.0 / torch.where(b.double() <= 64, 0.53, 0.85)  # noqa: E731  64 rows: 1 token vs 2 tokens
    conf = torch.full((64, 1), 0.5)  # 32 extra tokens expected: pays only against a large per-round overhead
    clock = RoundClock(priced=True)
    assert clock.drafting_share == 1.0
    clock.add(0.3, 0.0)
    clock.count_round(drafted=True)
    assert int(schedule_width(conf, clock.cost(sps, amortized=True))[0]) == 1  # every round drafts: the whole 0.3 s
    for _ in range(7):
        clock.count_round(drafted=False)
    assert clock.drafting_share == pytest.approx(1 / 8)
    assert clock.cost(sps, amortized=True).overhead_s == pytest.approx(0.3 / 8)
    assert int(schedule_width(conf, clock.cost(sps))[0]) == 1  # the whole overhead on both widths: "pays"
    assert int(schedule_width(conf, clock.cost(sps, amortized=True))[0]) == 0  # amortized: 96 / 0.89 < 64 / 0.57
    for _ in range(40):
        clock.count_round(drafted=True)
    assert len(clock.recent) == clock.window and clock.drafting_share == 1.0  # a window of recent rounds


def test_the_loop_counts_every_round_and_whether_it_drafted(monkeypatch, target):
    seen = []
    original = round_state.RoundClock.count_round
    monkeypatch.setattr(round_state.RoundClock, "count_round",
                        lambda self, drafted: seen.append(drafted) or original(self, drafted))
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=10, policy="scheduled", eos_token_id=[],
                             sps=lambda b: 1.0 / (1.0 + 0.01 * b), return_dict_in_generate=True, record_rounds=True)
    assert seen == [r.drafts is not None for r in out.rounds] and any(seen)


def test_a_round_verifies_only_if_it_beats_a_plain_step_with_the_measured_tails():
    """`worth_verifying`: the drafts are spent; verifying them costs the wider forward plus the measured tail of a
    verifying round, a plain step its own (shorter) tail. Drafts that pay for their width alone do not pay once a
    verifying round's tail is priced; without measured tails (or unpriced policies) nothing is vetoed."""
    from dspark_hf.decoding.round_state import LengthPolicy, RoundClock
    from dspark_hf.models.drafting import DraftBlock

    conf = torch.full((4, 2), 0.5)  # 0.5 + 0.25 expected extra tokens per row for 2 drafts
    block = DraftBlock(torch.zeros(4, 2, dtype=torch.long), logits=torch.zeros(4, 2, 3), confidences=conf,
                       confidence_logits=torch.logit(conf))
    sps = lambda b: 1.0 / (0.1 + 0.001 * torch.as_tensor(b, dtype=torch.float))  # noqa: E731
    lengths = torch.full((4,), 2)
    clock = RoundClock(priced=True)
    policy = LengthPolicy("scheduled", 2, sps, 0.5, clock, padded=True)
    assert policy.worth_verifying(block, lengths)  # no tails measured yet
    clock.add_tail(False, 0.001)
    clock.add_tail(True, 0.002)
    assert clock.tails_measured and policy.worth_verifying(block, lengths)  # 1.75x tokens for ~1.08x the time
    for _ in range(3):
        clock.add_tail(True, 0.2)  # verifying rounds' tails: 2x a plain forward
    assert not policy.worth_verifying(block, lengths)
    assert policy.worth_verifying(block, torch.zeros(4, dtype=torch.long))  # nothing to veto
    assert LengthPolicy("fixed", 2, sps, 0.5, clock).worth_verifying(block, lengths)  # unpriced: never vetoed
