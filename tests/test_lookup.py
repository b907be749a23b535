"""N-gram lookup drafts (`NgramLookup`, `DSparkDrafter.set_assist`): the table's statistics, storage, and that
`generate(assistant_model=drafter)` stays lossless with lookup drafts (greedy equals the target's own output, sampling
follows the target's distribution) while actually using them."""

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dspark_hf
from conftest import (oracle_for, bias_markov_head, exact_joint, fixed_confidence_drafter, generated_rows, greedy_continuation,
                      greedy_reference, left_pad, make_drafter, make_target, sps_curve)
from dspark_hf.models.candidate_generator import AssistOptions, LookupAssistant
from dspark_hf.models.lookup import LookupContext, NgramLookup, _suffix_hashes, _window_hashes


def _all(seqs):
    return [(s, [1] * len(s)) for s in seqs]


# ------------------------------------------------------------------------------------------------ the table
def test_corpus_candidate_is_the_most_frequent_continuation_of_the_longest_match():
    lookup = NgramLookup.build(_all([[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5]]), max_order=4, heldout_share=0.0)
    # order 3 (1, 2, 3) -> 4 three times out of four
    assert lookup._corpus_candidate([9, 1, 2, 3]) == (4, 3, 3, 4)
    # backs off to the longest order that matches: (7, 2, 3) is unseen, (2, 3) is
    assert lookup._corpus_candidate([7, 2, 3]) == (4, 2, 3, 4)
    assert lookup._corpus_candidate([42]) is None


def test_ties_go_to_the_smaller_id_and_only_answer_tokens_are_predicted():
    # prompt tokens (mask 0) are never a predicted next token, but may be context of one
    seqs = [([8, 1, 6], [0, 0, 1]), ([8, 1, 5], [0, 0, 1]), ([1, 9], [0, 0])]
    lookup = NgramLookup.build(seqs, max_order=2, heldout_share=0.0)
    assert lookup._corpus_candidate([8, 1]) == (5, 2, 1, 2)  # 5 and 6 once each: the smaller id
    assert lookup._corpus_candidate([8]) is None  # 8 -> 1 is a prompt token: not counted


def test_suffix_hashes_of_all_orders_match_the_vectorised_window_hashes():
    """The lookup's per-call suffix hashes (every order in one pass) equal the hashes the table was built from."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=40)
    hashes = _window_hashes(ids, 8)
    for end in (1, 5, 8, 17, 40):
        suffix = _suffix_hashes(ids.tolist(), 8, end)
        assert len(suffix) == min(8, end) + 1
        for n in range(1, len(suffix)):
            assert suffix[n] == hashes[n][end - n]
    assert _suffix_hashes(ids.tolist()[:17], 8) == _suffix_hashes(ids.tolist(), 8, 17)  # `end` defaults to the length


def test_an_incremental_context_proposes_exactly_what_the_whole_sequence_does():
    """`LookupContext` (the loop's per-row index, extended as rows grow) must give the same candidates and the same
    proposals as re-hashing the whole sequence, at every length, with long copies (past max_order), ties and
    repeats; a proposal leaves the context as it was."""
    rng = np.random.default_rng(4)
    motif = rng.integers(0, 12, size=11).tolist()
    seqs = [rng.integers(0, 12, size=150).tolist(),  # small vocabulary: many short repeats and ties
            motif + rng.integers(0, 12, size=9).tolist() + motif + motif[:5] + [3] * 12 + motif]
    lookup = NgramLookup.build(_all([s[:60] for s in seqs] * 3), max_order=4, heldout_share=0.0)
    for seq in seqs:
        context = lookup.context(seq[:1])
        for end in range(1, len(seq) + 1):
            context.extend(seq[len(context):end])
            assert context.ids == seq[:end]
            assert context.candidate() == lookup._context_candidate(seq[:end]), end
            for cut in (0.0, 0.3):
                assert lookup.propose(context, 6, min_survival=cut) == lookup.propose(seq[:end], 6, min_survival=cut)
            assert context.ids == seq[:end]  # the drafts were popped again
        fresh = lookup.context(seq)
        assert [dict(d) for d in fresh._starts] == [dict(d) for d in context._starts]


def test_context_push_and_pop_undo_each_other_and_bad_use_is_refused():
    context = LookupContext(3, [1, 2, 3, 1, 2])
    before = [{k: list(v) for k, v in d.items()} for d in context._starts]
    for t in (3, 1, 2, 9):
        context.push(t)
    assert [context.pop() for _ in range(4)] == [9, 2, 1, 3]
    assert [{k: list(v) for k, v in d.items()} for d in context._starts] == before
    assert context.candidate() == (3, 2, 1, 1)  # (1, 2) once before, followed by 3
    with pytest.raises(IndexError):
        LookupContext(2).pop()
    with pytest.raises(ValueError, match="max_order"):
        LookupContext(0)
    lookup = NgramLookup.build(_all([[1, 2, 3, 4]] * 2), max_order=4, heldout_share=0.0)
    with pytest.raises(ValueError, match="max_order 3"):
        lookup.propose(context, 4)


def test_context_candidate_prefers_the_longest_suffix_and_then_frequency_then_recency():
    lookup = NgramLookup.build(_all([[0, 0]]), max_order=4, heldout_share=0.0)
    assert lookup._context_candidate([7, 8, 9, 3, 7, 8]) == (9, 2, 1, 1)
    # suffix (5,) followed by 1, 2, 2: the most frequent continuation wins
    assert lookup._context_candidate([5, 1, 5, 2, 5, 2, 4, 5])[0] == 2
    # 1 and 2 once each after (5,): the most recent wins
    assert lookup._context_candidate([5, 1, 5, 2, 4, 5])[0] == 2
    assert lookup._context_candidate([1, 2, 3]) is None


def test_a_long_copy_from_the_context_is_followed_past_the_longest_order():
    lookup = NgramLookup.build(_all([[0, 0]]), max_order=3, heldout_share=0.0)
    code = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    token, order, best, total = lookup._context_candidate([5] + code + [6, 7] + code[:8])
    assert token == 19 and (best, total) == (1, 1)
    assert order == 6  # 8 tokens match, followed back to the cap of 2 * max_order
    token, order, _, _ = lookup._context_candidate([5] + code + [6, 7] + code[3:8])
    assert token == 19 and order == 5  # the 5 copied tokens


def test_propose_continues_a_memorised_sequence_with_decreasing_survival():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    lookup = NgramLookup.build(_all([seq] * 5), max_order=6, heldout_share=0.0)
    proposal = lookup.propose(seq[:6], 8)
    assert proposal.tokens == seq[6:14]
    assert all(0.0 < a <= 1.0 for a in proposal.acceptance)
    survival = proposal.survival
    assert all(b <= a for a, b in zip(survival, survival[1:]))
    assert lookup.propose(seq[:6], 0).tokens == []
    # stops once the survival is below the cut: the drafts up to the first that crosses it
    cut = lookup.propose(seq[:6], 8, min_survival=survival[2])
    assert cut.tokens == proposal.tokens[: len(cut.tokens)] and len(cut.tokens) <= 4
    assert all(a >= survival[2] for a in cut.survival[:-1])


def test_calibration_measures_held_out_acceptance_and_estimates_follow_it():
    rng = np.random.default_rng(1)
    # deterministic data: every continuation is right, so calibrated estimates of long matches rise toward 1
    base = rng.integers(0, 30, size=60).tolist()
    seqs = [(base[i:] + base[:i], [1] * 60) for i in range(60)]
    lookup = NgramLookup.build(seqs, max_order=5, heldout_share=0.3, ids=[f"s{i}" for i in range(60)])
    report = lookup.calibration_report()
    assert report["corpus"]["trials"] > 100
    assert report["corpus"]["rate"] > 0.9
    top = lookup.estimate(0, 5, 10, 10)
    assert top > 0.9 and top > lookup.estimate(0, 1, 1, 4)  # calibrated above the 0.5 * purity prior


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no sequences"):
        NgramLookup.build([])
    with pytest.raises(ValueError, match="max_order"):
        NgramLookup.build(_all([[1, 2]]), max_order=0)
    with pytest.raises(ValueError, match="as long as"):
        NgramLookup.build([([1, 2, 3], [1, 1])])
    with pytest.raises(ValueError, match="non-negative"):
        NgramLookup.build(_all([[1, -2]]))


# ------------------------------------------------------------------------------------------------ storage
def test_save_load_round_trip_is_atomic_and_checked(tmp_path):
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    lookup = NgramLookup.build(_all([seq] * 4 + [[1, 5, 7]]), max_order=4, heldout_share=0.0, meta={"k": "v"})
    path = tmp_path / "sub" / "lookup.safetensors"
    lookup.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["lookup.safetensors"]  # no temporary file left
    again = NgramLookup.load(path)
    assert again.meta["k"] == "v" and len(again) == len(lookup)
    for prefix in ([3, 1, 4], [1, 5], [9, 9, 2]):
        assert again.propose(prefix, 5) == lookup.propose(prefix, 5)
    with pytest.raises(FileNotFoundError, match="dspark-hf lookup"):
        NgramLookup.load(tmp_path / "missing.safetensors")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "something-else"})
    with pytest.raises(ValueError, match="not an n-gram lookup"):
        NgramLookup.load(tmp_path / "other.safetensors")
    tensors = {"calibration": lookup.calibration}
    for n in range(1, 5):
        t = lookup.tables[n]
        tensors.update({f"keys.{n}": t.keys.view(np.int64)[::-1].copy(), f"best.{n}": t.best,
                        f"count.{n}": t.count, f"total.{n}": t.total})
    save_file(tensors, str(tmp_path / "bad.safetensors"),
              metadata={"format": "dspark-ngram-lookup-v2", "max_order": "4", "meta": "{}"})
    with pytest.raises(ValueError, match="corrupt"):
        NgramLookup.load(tmp_path / "bad.safetensors")


def test_cli_builds_a_table_from_a_data_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"x{i}", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1],
             "source": "t"} for i in range(20)]
    (data / "data-00000.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "lk.safetensors"
    res = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "lookup", "--data", str(data), "--out", str(out),
                          "--max-order", "3"], capture_output=True, text=True, check=True)
    assert "n-grams (orders 1-3) from 20 examples" in res.stdout
    assert NgramLookup.load(out).propose([1, 2, 3], 3).tokens == [4, 5, 6]


# ------------------------------------------------------------------------------------------------ decoding
def _lookup_from_target(target, prompts, n=24, noise_seed=None):
    """A table built from the target's own greedy continuations (drafts often right), plus random sequences
    (drafts often wrong) when noise_seed is given."""
    seqs = []
    for p in prompts:
        ids = torch.tensor([p])
        cont = greedy_continuation(target, ids, n)[0].tolist()
        seqs.append((p + cont, [0] * len(p) + [1] * len(cont)))
    if noise_seed is not None:
        g = torch.Generator().manual_seed(noise_seed)
        for _ in range(10):
            s = torch.randint(0, target.config.vocab_size, (30,), generator=g).tolist()
            seqs.append((s, [1] * 30))
    return NgramLookup.build(seqs, max_order=4, heldout_share=0.0)


PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [7, 8]]


@pytest.mark.parametrize("use_drafter, sps", [(False, None), (True, None), (True, "curve"), (False, "curve")])
def test_greedy_with_lookup_drafts_equals_target_and_uses_them(use_drafter, sps):
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], noise_seed=3)
    # a jagged CPU-like curve: one token is cheap, 2+ cost 1.6x
    curve = (lambda b: 1.0 if b <= 1 else 1 / 1.6) if sps == "curve" else None
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = greedy_continuation(target, ids, 30)
        drafter.set_assist(lookup, sps=curve, use_drafter=use_drafter, min_survival=0.0)
        try:
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
        finally:
            drafter.set_assist()
        assert torch.equal(out[:, ids.shape[1]:], ref), prompt
        stats = drafter.last_speculation_stats
        if prompt in PROMPTS[:2]:  # the memorised continuations: lookup rounds with accepted drafts
            assert stats.lookup_rounds > 0 and sum(stats.accepted) > 0
    assert drafter.assist_options is None  # set_assist() restored the default


def test_batch1_online_calibration_stops_verifying_over_confident_lookup_drafts():
    """A lookup that memorised sequences the target does not write is confident (held-out rate ~1) and wrong: with
    `online_calibration` (the default) its estimates are scaled down by what past rounds accepted, so far fewer drafts
    are verified; without it every round verifies its long proposals. Output identical either way."""
    target = make_target("llama", vocab_size=96, seed=0)
    cycle = [5, 6, 7, 8, 9] * 12
    lookup = NgramLookup.build([(cycle, [1] * len(cycle))] * 20, max_order=4, heldout_share=0.5,
                               ids=[str(i) for i in range(20)])
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = greedy_continuation(target, ids, 30)
    flat = lambda b: 1.0 / (1.0 + 0.15 * b)  # noqa: E731  (each draft adds ~13% to a forward)
    verified = {}
    for calibrated in (False, True):
        assistant = LookupAssistant(lookup, target, sps=flat)
        assistant.options.online_calibration = calibrated
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=30, do_sample=False)
        assert torch.equal(out[:, ids.shape[1]:], ref)
        verified[calibrated] = assistant.last_speculation_stats
    off, on = verified[False], verified[True]
    assert sum(on.proposed) < 0.5 * sum(off.proposed), (sum(on.proposed), sum(off.proposed))
    assert sum(off.accepted) < 0.3 * sum(off.proposed)  # the drafts were indeed mostly wrong


@pytest.mark.parametrize("sps", [None, "curve"])
def test_lookup_assistant_without_a_drafter_equals_target_greedy(sps):
    target = make_target("llama", vocab_size=96, seed=0)
    lookup = _lookup_from_target(target, PROMPTS[:2], noise_seed=3)
    curve = (lambda b: 1.0 if b <= 1 else 1 / 1.6) if sps == "curve" else None
    assistant = LookupAssistant(lookup, target, sps=curve, min_survival=0.0)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=30, do_sample=False)
        assert torch.equal(out[:, ids.shape[1]:], greedy_continuation(target, ids, 30)), prompt
        stats = assistant.last_speculation_stats
        if prompt in PROMPTS[:2]:
            assert stats.lookup_rounds > 0 and sum(stats.accepted) > 0
        # every step is a verified round or a plain step: together they emit the new tokens (the prefill's first
        # token aside, up to the cut at max_new_tokens)
        assert 29 <= sum(a + 1 for a in stats.accepted) + stats.plain_steps <= 30
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.ones(2, 2, dtype=torch.long),
                        assistant_model=assistant, max_new_tokens=3)


def test_a_jagged_cost_curve_verifies_nothing_when_drafts_do_not_pay():
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:1], noise_seed=None)
    ids = torch.tensor([PROMPTS[2]])  # an unseen prompt: only weak, short matches
    prohibitive = lambda b: 1.0 if b <= 1 else 1e-3  # noqa: E731  (any verified draft costs 1000x)
    drafter.set_assist(lookup, sps=prohibitive, use_drafter=True)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    drafter.set_assist()
    assert torch.equal(out[:, ids.shape[1]:], greedy_continuation(target, ids, 12))
    stats = drafter.last_speculation_stats
    assert stats.rounds == 0 and stats.plain_steps > 0  # every step plain: no draft was worth verifying


@pytest.mark.parametrize("via", ["drafter", "assistant"])
def test_sampling_with_lookup_drafts_matches_the_target_distribution(via):
    """First 3 tokens over V^3 = 64 outcomes, lookup drafts (point masses) proposed in most rounds: the empirical
    distribution is within 2.5x the TV expected from exact sampling of the enumerated target distribution. The
    lookup proposes the cyclic successor of each token, which the target does not favour, so an accept-all
    verifier would fail the bound."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = make_drafter(target, block_size=3, markov_rank=4, seed=4)
    cycle = [0, 1, 2, 3] * 8
    lookup = NgramLookup.build([(cycle, [1] * len(cycle))], max_order=2, heldout_share=0.0)
    prompt, n_runs, n_tokens, temperature = [1, 2, 3, 1], 2500, 3, 0.9
    exact = exact_joint(target, prompt, n_tokens, temperature, None, None)
    counts = torch.zeros(4 ** n_tokens)
    lookup_rounds = rounds = 0
    ids = torch.tensor([prompt])
    drafter.set_assist(lookup, use_drafter=False, min_survival=0.0, lookup_max_tokens=3)
    assistant = drafter if via == "drafter" else LookupAssistant(lookup, target, min_survival=0.0, max_tokens=3)
    for run in range(n_runs):
        torch.manual_seed(run)
        out = target.generate(ids, assistant_model=assistant, do_sample=True, max_new_tokens=n_tokens,
                              temperature=temperature)
        new = out[0, len(prompt):].tolist()
        counts[sum(t * 4 ** (n_tokens - 1 - i) for i, t in enumerate(new))] += 1
        stats = assistant.last_speculation_stats
        lookup_rounds += stats.lookup_rounds
        rounds += stats.rounds + stats.plain_steps
    drafter.set_assist()
    assert lookup_rounds > 0.9 * rounds
    empirical = counts / n_runs
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n_runs)).sum().item()
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 2.5 * expected_tv, (tv, expected_tv)
    # power: always accepting the cyclic drafts would give (2, 3, 0) with probability 1
    accept_all = torch.zeros(64)
    accept_all[2 * 16 + 3 * 4 + 0] = 1.0
    assert 0.5 * (accept_all - exact).abs().sum().item() > 2.5 * expected_tv


def test_drafter_backs_off_while_its_rounds_verify_nothing():
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    calls = []
    original = drafter.draft
    drafter.draft = lambda *a, **k: calls.append(1) or original(*a, **k)
    prohibitive = lambda b: 1.0 if b <= 1 else 1e-3  # noqa: E731
    ids = torch.tensor([PROMPTS[1]])
    ref = greedy_continuation(target, ids, 40)
    for backoff, most in [(False, None), (True, 12)]:
        calls.clear()
        drafter.set_assist(sps=prohibitive, drafter_backoff=backoff)
        assert drafter.assist_options.drafter_backoff is backoff
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        assert torch.equal(out[:, ids.shape[1]:], ref)
        steps = drafter.last_speculation_stats.plain_steps
        if most is None:
            assert len(calls) == steps  # every step ran the drafter
        else:  # 1 + 1 skipped, 1 + 3, 1 + 7, then 1 + 8 each: 38 steps need 6 drafter rounds
            assert len(calls) <= most < steps
    drafter.set_assist()


class _FakeClock:
    """A clock that advances only where a test says: `tick` seconds per call of what it wraps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def wrap(self, fn, seconds):
        def timed(*a, **k):
            self.now += seconds
            return fn(*a, **k)
        return timed


def _clocked(monkeypatch, target, drafter, draft_seconds, forward_seconds=0.1):
    """The realized gate's clock, advanced by `draft_seconds` per drafter call and `forward_seconds` per target
    forward; returns the list the drafter's calls are counted in."""
    import dspark_hf.models.candidate_generator as candidate_generator

    clock, calls = _FakeClock(), []
    monkeypatch.setattr(candidate_generator, "_clock", clock)
    original = drafter.draft
    drafter.draft = clock.wrap(lambda *a, **k: calls.append(1) or original(*a, **k), draft_seconds)
    target.register_forward_pre_hook(lambda *_: setattr(clock, "now", clock.now + forward_seconds))
    return calls


def test_realized_gate_skips_a_drafter_whose_rounds_emit_slower_than_plain_steps(monkeypatch):
    """`set_assist(realized_gate=True)`: a drafter whose rounds take 10x a plain step and accept little is run only
    to keep its evidence current (plain steps in between, `stats.drafter_skips`), and the output is the target's
    own greedy output; without the gate it drafts every round."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    calls = _clocked(monkeypatch, target, drafter, draft_seconds=1.0)
    ids = torch.tensor([PROMPTS[1]])
    ref = greedy_continuation(target, ids, 40)
    for gate in (False, True):
        calls.clear()
        drafter.set_assist(realized_gate=gate)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        assert torch.equal(out[:, ids.shape[1]:], ref)
        stats = drafter.last_speculation_stats
        if gate:
            assert stats.drafter_skips >= 20 and len(calls) <= 8  # 2 measured, then 1 per 8 skips
        else:
            assert stats.drafter_skips == 0 and len(calls) == stats.rounds + stats.plain_steps
    drafter.set_assist()
    assert drafter.assist_options is None


def test_realized_gate_keeps_a_drafter_that_emits_faster(monkeypatch):
    """A drafter whose drafts the target accepts (an oracle for the target's greedy continuation), free on the
    clock: past the one plain step that measures the plain rate, every round drafts."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = oracle_for(target, correct=4, block_size=4)
    calls = _clocked(monkeypatch, target, drafter, draft_seconds=0.0)
    ids = torch.tensor([PROMPTS[1]])
    drafter.set_assist(realized_gate=True)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    drafter.set_assist()
    assert torch.equal(out[:, ids.shape[1]:], greedy_continuation(target, ids, 40))
    stats = drafter.last_speculation_stats
    assert stats.drafter_skips == 1 and stats.plain_steps == 1 and len(calls) == stats.rounds
    assert stats.mean_accepted_length > 4


def test_sampling_with_the_realized_gate_matches_the_target_distribution(monkeypatch):
    """The gate decides from past rounds' timings only: sampled output still follows the target (first 3 tokens
    over 64 outcomes, within 2.5x the TV of exact sampling), with drafter rounds and gate skips both in the runs."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = make_drafter(target, block_size=3, markov_rank=4, seed=4)
    calls = _clocked(monkeypatch, target, drafter, draft_seconds=1.0)
    prompt, n_runs, n_tokens, temperature = [1, 2, 3, 1], 1000, 6, 0.9
    exact = exact_joint(target, prompt, 3, temperature, None, None)
    counts, skips = torch.zeros(64), 0
    ids = torch.tensor([prompt])
    drafter.set_assist(realized_gate=True)
    for run in range(n_runs):
        torch.manual_seed(run)
        out = target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=n_tokens,
                              temperature=temperature)
        new = out[0, len(prompt):len(prompt) + 3].tolist()
        counts[sum(t * 4 ** (2 - i) for i, t in enumerate(new))] += 1
        skips += drafter.last_speculation_stats.drafter_skips
    drafter.set_assist()
    assert skips > 0 and len(calls) > n_runs
    empirical = counts / n_runs
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n_runs)).sum().item()
    assert 0.5 * (empirical - exact).abs().sum().item() < 2.5 * expected_tv


# ------------------------------------------------------------------------------------------------ batched loop
@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduled", "async"])
def test_batched_greedy_with_lookup_equals_each_rows_greedy_and_needs_fewer_rounds(policy):
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = fixed_confidence_drafter(target, -2.0, block_size=4)  # an untrained drafter that knows it is weak
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24, noise_seed=3)
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, policy=policy, sps=sps_curve, threshold=0.2, return_dict_in_generate=True)
    plain = dspark_hf.generate(target, drafter, ids, mask, **kw)
    out = dspark_hf.generate(target, drafter, ids, mask, lookup=lookup, **kw)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (policy, row)
    for row in (0, 1):  # the memorised rows: lookup drafts accepted, fewer rounds than the untrained drafter alone
        assert out.stats[row].rounds < plain.stats[row].rounds, (policy, row)
    with pytest.raises(ValueError, match="greedy decoding only"):  # lookup branches: greedy only
        dspark_hf.generate(target, drafter, ids, mask, lookup=lookup, tree_budget=2, max_new_tokens=4,
                           do_sample=True)
    foreign = NgramLookup.build(_all([[5, 500, 7]] * 2), max_order=2, heldout_share=0.0)  # ids past the vocabulary
    with pytest.raises(ValueError, match="another model"):
        dspark_hf.generate(target, drafter, ids, mask, lookup=foreign, max_new_tokens=4)
    with pytest.raises(ValueError, match="another model"):
        target.generate(ids[:1], assistant_model=LookupAssistant(foreign, target), max_new_tokens=4)


def test_the_loop_and_the_candidate_generator_index_each_sequence_once(monkeypatch):
    """Each row's `LookupContext` is made once per call and then only extended (the proposals cost a few lookups per
    draft instead of re-hashing the row's whole sequence every round); output unchanged."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = fixed_confidence_drafter(target, -2.0, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24, noise_seed=3)
    made = []
    original = NgramLookup.context
    monkeypatch.setattr(NgramLookup, "context", lambda self, ids=(): made.append(list(ids)) or original(self, ids))
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, lookup=lookup, max_new_tokens=24, policy="fixed",
                             return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24)
    assert len(made) == len(PROMPTS) and sum(out.stats[r].rounds for r in range(3)) > 3 * 2
    made.clear()
    assistant = LookupAssistant(lookup, target, min_survival=0.0)
    prompt = torch.tensor([PROMPTS[0]])
    out = target.generate(prompt, assistant_model=assistant, max_new_tokens=24, do_sample=False)
    assert torch.equal(out[:, prompt.shape[1]:], greedy_continuation(target, prompt, 24))
    assert assistant.last_speculation_stats.lookup_rounds > 1 and len(made) == 1


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_batched_sampling_with_lookup_matches_the_target_distribution(policy, monkeypatch):
    """3000 identical rows, 3 tokens over V^3 outcomes: within 2.5x the TV of exact sampling while the lookup's
    cyclic drafts (which the target does not favour) replace the drafter's in most rows."""
    import dspark_hf.decoding.batched as batched

    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = bias_markov_head(fixed_confidence_drafter(target, -2.0, block_size=3, markov_rank=4, seed=4))
    cycle = [0, 1, 2, 3] * 8
    lookup = NgramLookup.build([(cycle, [1] * len(cycle))], max_order=2, heldout_share=0.0)
    shares = []
    original = batched.merge_lookup_drafts

    def recording(block, proposals, do_sample):
        merged, used = original(block, proposals, do_sample)
        shares.append(float(used.float().mean()))
        return merged, used

    monkeypatch.setattr(batched, "merge_lookup_drafts", recording)
    prompt, rows, n_tokens = [1, 2, 3, 1], 3000, 3
    ids = torch.tensor([prompt] * rows)
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                             temperature=0.9, policy=policy, sps=lambda b: 1.0 / (1.0 + 0.00005 * b), lookup=lookup,
                             generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                             drop_finished="always")  # (riders get no proposals: the shares count live rows only)
    assert shares and min(shares) > 0.9
    new = out.sequences[:, len(prompt):]
    empirical = torch.bincount((new * torch.tensor([16, 4, 1])).sum(1), minlength=64).float() / rows
    exact = exact_joint(target, prompt, n_tokens, 0.9, None, None)
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * rows)).sum().item()
    assert 0.5 * (empirical - exact).abs().sum().item() < 2.5 * expected_tv
    assert sum(s.verified for s in out.stats) >= rows  # lookup drafts were verified, and many rejected
    assert sum(s.verified - s.accepted for s in out.stats) > 0.1 * rows
    # power: a verifier that accepted the lookup's drafts would make x2 = x1 + 1 (mod 4) always
    pairs = exact.reshape(4, 4, 4).sum(-1)  # P(x1, x2)
    accept_all = torch.zeros(4, 4)
    accept_all[torch.arange(4), (torch.arange(4) + 1) % 4] = pairs.sum(1)
    assert 0.5 * (accept_all - pairs).abs().sum().item() > 2.5 * expected_tv


def _slow(drafter, seconds):
    """The drafter with `seconds` added to every `draft` call: its measured time makes its rounds not pay."""
    original = drafter.draft

    def draft(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    drafter.draft = draft
    return drafter


def _fast_curve(b):
    """About a millisecond per forward (what the measured round overhead is compared with)."""
    return 1.0 / (0.001 * (1.0 + 0.08 * b))


def test_lookup_block_is_point_masses_with_the_calibrated_estimates_and_nothing_past_the_proposal():
    from dspark_hf.models.lookup import LookupProposal, lookup_block

    block = lookup_block([LookupProposal([5, 6], [0.9, 0.5], ["corpus", "context"]), LookupProposal([], [], [])],
                         width=4, vocab_size=10)
    assert block.tokens.tolist() == [[5, 6, 6, 6], [0, 0, 0, 0]]
    assert torch.allclose(block.confidences, torch.tensor([[0.9, 0.5, 0, 0], [0, 0, 0, 0]]))
    probs = block.probs
    assert probs.shape == (2, 4, 10)
    assert torch.equal(probs.argmax(-1), block.tokens) and torch.allclose(probs.max(-1).values, torch.ones(2, 4))
    with pytest.raises(ValueError, match="width"):
        lookup_block([], width=0, vocab_size=10)


def test_batched_lookup_only_rounds_replace_the_backed_off_drafter_and_stay_lossless(monkeypatch):
    """A drafter too slow to pay is backed off; the rounds it skips draft from the lookup alone (recorded as such,
    no drafter confidences), verify lookup drafts, need fewer rounds than plain skipped rounds, and the output is
    each row's own greedy output. (Every drafting round reads as 60 ms outside the target's forward, 50 of them in
    the drafter, whatever the machine's load: measured, the bookkeeping of a loaded machine made the drafter's share
    and so the number of backed-off rounds vary.)"""
    from dspark_hf.decoding import round_state

    add = round_state.RoundClock.add
    monkeypatch.setattr(round_state.RoundClock, "add", lambda self, overhead, draft: add(self, 0.06, 0.05))
    counted = []  # what the round clock was told of each round's kind (the share its overhead is amortized over)
    count_round = round_state.RoundClock.count_round
    monkeypatch.setattr(round_state.RoundClock, "count_round",
                        lambda self, drafted: counted.append(drafted) or count_round(self, drafted))
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = fixed_confidence_drafter(target, -2.0, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24, noise_seed=3)
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, policy="scheduled", sps=_fast_curve, measured_cost=False, lookup=lookup,
              record_rounds=True, return_dict_in_generate=True)
    with_lookup = dspark_hf.generate(target, drafter, ids, mask, **kw)
    # lookup-only rounds run no drafter: they do not count toward the share of rounds paying the drafter's overhead
    assert counted == [r.drafts is not None and not r.lookup_only for r in with_lookup.rounds] and any(counted)
    plain = dspark_hf.generate(target, drafter, ids, mask, lookup_rounds=False, **kw)
    for out in (with_lookup, plain):
        for row, prompt in enumerate(PROMPTS):
            assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), row
    only = [r for r in with_lookup.rounds if r.lookup_only]
    assert len(only) >= 3 and all(r.confidence_logits is None and r.drafts is not None for r in only)
    assert sum(int(r.accepted.sum()) for r in only) > 0  # lookup drafts verified and accepted
    assert not any(r.lookup_only for r in plain.rounds)
    assert len(with_lookup.rounds) < len(plain.rounds)


def test_realized_gain_weighs_what_verifying_rounds_emitted_against_the_plain_rate():
    from dspark_hf.decoding.round_state import RealizedGain

    gain = RealizedGain(window=2)
    gain.verifying_round("lookup", 1.0, 2)  # no plain rate yet: no evidence
    assert gain.pays("lookup") and gain.gains == {}
    gain.plain_round(0.5, 10)  # 50 ms per row-step
    gain.plain_round(1.0, 10)  # averaged: 0.7 * 50 + 0.3 * 100 ms
    assert gain.plain_seconds_per_token == pytest.approx(0.065)
    gain.verifying_round("lookup", 1.0, 12)  # 12 row-steps are worth 0.78 s: lost 0.22 s
    assert gain.gains["lookup"] == [pytest.approx(-0.22)] and not gain.pays("lookup") and gain.pays("drafter")
    gain.verifying_round("lookup", 1.0, 20)  # +0.30 s: the window sums to a gain
    assert gain.pays("lookup")
    gain.verifying_round("lookup", 1.0, 14)  # -0.09: the oldest (-0.22) left the window, +0.30 - 0.09 >= 0
    assert len(gain.gains["lookup"]) == 2 and gain.pays("lookup")


def test_the_backoff_skips_a_kind_of_round_that_verified_at_a_loss(monkeypatch):
    """The loop feeds `RealizedGain` every plain round and every verifying chain round (its kind, rows + accepted);
    where the evidence says a kind's verifying rounds lost time, its rounds are skipped even when their estimates
    say they pay (fewer lookup-only rounds), and the output is the target's own either way."""
    from dspark_hf.decoding import round_state

    add = round_state.RoundClock.add
    monkeypatch.setattr(round_state.RoundClock, "add", lambda self, overhead, draft: add(self, 0.06, 0.05))
    fed = []
    verifying = round_state.RealizedGain.verifying_round
    monkeypatch.setattr(round_state.RealizedGain, "verifying_round",
                        lambda self, kind, seconds, tokens: fed.append((kind, tokens))
                        or verifying(self, kind, seconds, tokens))
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = fixed_confidence_drafter(target, -2.0, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24, noise_seed=3)
    ids, mask = left_pad(PROMPTS)
    lookup_only = {}
    for proven in (True, False):  # the evidence forced to "gained" / "lost"
        monkeypatch.setattr(round_state.RealizedGain, "pays", lambda self, kind: proven)
        fed.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=24, policy="scheduled", sps=_fast_curve,
                                 measured_cost=False, lookup=lookup, record_rounds=True, return_dict_in_generate=True)
        for row, prompt in enumerate(PROMPTS):
            assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (proven, row)
        verified = [r for r in out.rounds if int(r.lengths.max()) > 0]
        assert fed == [("lookup" if r.lookup_only else "drafter", len(r.rows) + int(r.accepted.sum()))
                       for r in verified]
        lookup_only[proven] = sum(r.lookup_only for r in out.rounds)
    assert lookup_only[True] >= 3 and lookup_only[False] < lookup_only[True], lookup_only


def test_a_drafter_that_adds_nothing_next_to_the_lookup_is_backed_off():
    """The drafter's drafts are never chosen over the lookup's (confidence ~0.002) and it costs time, so its rounds
    pay against plain decoding (the lookup's drafts do) but not against lookup-only rounds: with lookup-only rounds it
    is backed off and runs far fewer times; without them it drafts every round. Output identical either way."""
    target = make_target("llama", vocab_size=96, seed=0)
    # 10 ms per draft: well above the 5% of a 20 ms round below which a probe is never skipped, well below what the
    # memorised rows' lookup drafts earn, whatever else the machine runs
    drafter = _slow(fixed_confidence_drafter(target, -6.0, block_size=4), 0.01)
    calls = []
    original = drafter.draft
    drafter.draft = lambda *a, **k: calls.append(1) or original(*a, **k)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=32)
    ids, mask = left_pad(PROMPTS[:2])
    counted = {}
    for lookup_rounds in (False, True):
        calls.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=32, policy="scheduled",
                                 sps=lambda b: 1.0 / (0.02 * (1.0 + 0.01 * b)), measured_cost=False, lookup=lookup,
                                 lookup_rounds=lookup_rounds, record_rounds=True, return_dict_in_generate=True)
        for row, prompt in enumerate(PROMPTS[:2]):
            assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 32), row
        counted[lookup_rounds] = (len(calls), len(out.rounds))
    assert counted[False][0] == counted[False][1]  # every round drafted: the merged rounds beat plain decoding
    assert counted[True][0] <= counted[True][1] - 2 and counted[True][0] < counted[False][0]


def test_batched_sampling_with_lookup_only_rounds_matches_the_target_distribution():
    """Identical rows whose slow drafter is backed off after two rounds: later rounds draft the lookup's cyclic
    continuations alone (point masses), and 8 sampled tokens (2^8 outcomes) stay within 2.5x the TV of exact
    sampling."""
    target = make_target("llama", vocab_size=2, seed=3, sharpen=3.0)
    drafter = _slow(fixed_confidence_drafter(target, -2.0, block_size=3, markov_rank=4, seed=4), 0.03)
    cycle = [0, 1] * 12
    lookup = NgramLookup.build([(cycle, [1] * len(cycle))], max_order=2, heldout_share=0.0)
    prompt, rows, n_tokens = [1, 0, 0, 1], 3000, 8
    ids = torch.tensor([prompt] * rows)
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                             temperature=0.9, policy="scheduled", sps=lambda b: 1.0 / (0.001 * (1.0 + 1e-6 * b)),
                             measured_cost=False, online_calibration=False, lookup=lookup,
                             generator=torch.Generator().manual_seed(7), record_rounds=True,
                             return_dict_in_generate=True)
    only = [r for r in out.rounds if r.lookup_only]
    assert only and sum(int(r.lengths.sum()) for r in only) >= rows // 2  # lookup-only drafts verified
    assert sum(int((r.lengths - r.accepted).sum()) for r in only) > 0.1 * rows  # and many rejected
    new = out.sequences[:, len(prompt):]
    weights = torch.tensor([2 ** (n_tokens - 1 - i) for i in range(n_tokens)])
    empirical = torch.bincount((new * weights).sum(1), minlength=2 ** n_tokens).float() / rows
    exact = exact_joint(target, prompt, n_tokens, 0.9, None, None)
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * rows)).sum().item()
    assert 0.5 * (empirical - exact).abs().sum().item() < 2.5 * expected_tv


# ------------------------------------------------------------------------------------------------ options
def test_assist_options_choose_lengths_and_refuse_bad_values():
    with pytest.raises(ValueError, match="needs a lookup"):
        AssistOptions(use_drafter=False)
    with pytest.raises(ValueError, match="lookup_max_tokens"):
        AssistOptions(lookup=object(), lookup_max_tokens=0)
    with pytest.raises(ValueError, match="min_survival"):
        AssistOptions(min_survival=1.5)
    jagged = AssistOptions(sps=lambda b: 1.0 if b <= 1 else 1 / 1.6)
    # one draft at 0.5 does not pay (1.5 < 1.6) but four do (1 + 0.5 + 0.45 + 0.4 + 0.35 = 2.7 > 1.6)
    survival = [0.5, 0.45, 0.4, 0.35]
    assert jagged.lookup_length(survival) == 4  # whole-curve search
    assert jagged.drafter_length(torch.tensor([0.5, 0.9, 0.89, 0.875]), exhaustive=False) == 0  # the break
    assert jagged.drafter_length(torch.tensor([0.5, 0.9, 0.89, 0.875]), exhaustive=True) == 4
    assert AssistOptions(min_survival=0.42).lookup_length(survival) == 2
    assert jagged.lookup_length([]) == 0


# ------------------------------------------------------------------------------------------------ lookup branches
def _chain_tree(tokens, survival):
    from dspark_hf.decoding.tree import DraftTree

    k = len(tokens)
    arange = torch.arange(k)[None]
    return DraftTree(tokens=torch.tensor([tokens]), parents=arange - 1, depths=arange + 1,
                     valid=torch.ones(1, k, dtype=torch.bool), survival=torch.tensor([survival]), node_ids=arange,
                     num_chain=k, vocab_size=50)


def _proposal(tokens, acceptance):
    from dspark_hf.models.lookup import LookupProposal

    return LookupProposal(list(tokens), list(acceptance), ["corpus"] * len(tokens))


def test_lookup_branches_merge_the_proposal_like_a_trie():
    from dspark_hf.decoding.tree import lookup_branches

    chain = _chain_tree([3, 4, 5], [0.9, 0.5, 0.2])
    # the lookup agrees on two drafts (those nodes are reused, their survival raised), then leaves the chain
    tree = lookup_branches(chain, [_proposal([3, 4, 7, 8], [0.95, 0.9, 0.8, 0.5])])
    assert tree.tokens.tolist() == [[3, 4, 5, 7, 8]]
    assert tree.parents.tolist() == [[-1, 0, 1, 1, 3]]
    assert tree.depths.tolist() == [[1, 2, 3, 3, 4]]
    assert tree.valid.all() and tree.num_chain == 3
    expected = [0.95, 0.95 * 0.9, 0.2, 0.95 * 0.9 * 0.8, 0.95 * 0.9 * 0.8 * 0.5]
    assert torch.allclose(tree.survival, torch.tensor([expected]))
    parent_survival = torch.where(tree.parents >= 0, tree.survival.gather(1, tree.parents.clamp(min=0)),
                                  torch.ones_like(tree.survival))
    assert bool((tree.survival <= parent_survival + 1e-7).all())  # a cap / schedule keeps a tree
    # a lookup that disagrees at once is a second child of the anchor; rows without a proposal keep their tree
    two = _chain_tree([3, 4, 5], [0.9, 0.5, 0.2])
    two = two._replace(tokens=two.tokens.repeat(2, 1), parents=two.parents.repeat(2, 1),
                       depths=two.depths.repeat(2, 1), valid=two.valid.repeat(2, 1),
                       survival=two.survival.repeat(2, 1), node_ids=two.node_ids.repeat(2, 1))
    tree = lookup_branches(two, [_proposal([9, 3], [0.6, 0.5]), _proposal([], [])])
    assert tree.tokens[0, 3:].tolist() == [9, 3] and tree.parents[0, 3:].tolist() == [-1, 3]
    assert tree.valid[1].tolist() == [True, True, True, False, False]
    assert lookup_branches(chain, [_proposal([], [])]) is chain  # nothing to merge
    with pytest.raises(ValueError, match="2 lookup proposals for a tree of 1 rows"):
        lookup_branches(chain, [_proposal([1], [0.5])] * 2)


@pytest.mark.parametrize("policy, budget, cap", [("fixed", 0, None), ("fixed", 0, 4), ("scheduled", 0, None),
                                                 ("threshold", 2, 5), ("async", 2, None)])
def test_greedy_with_lookup_branches_equals_each_rows_greedy_and_leaves_the_chain(policy, budget, cap):
    """An untrained drafter (its chain breaks at once) next to a lookup that memorised two rows: with the lookup's
    continuation verified as a branch, the accepted paths leave the chain, the rows need fewer rounds than the
    drafter alone, and every row's output is still its own greedy output (batch 1 too)."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24, noise_seed=3)
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, policy=policy, sps=sps_curve, threshold=0.05, return_dict_in_generate=True)
    plain = dspark_hf.generate(target, drafter, ids, mask, **kw)
    out = dspark_hf.generate(target, drafter, ids, mask, lookup=lookup, tree_budget=budget, tree_max_nodes=cap,
                             record_rounds=True, **kw)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (policy, row)
    for row in (0, 1):
        assert out.stats[row].rounds < plain.stats[row].rounds, (policy, row)
    # accepted paths longer than their chain part: the path left the chain (for the lookup's nodes)
    left_chain = sum(int((r.tree_accepted > r.accepted).sum()) for r in out.rounds if r.tree_accepted is not None)
    assert left_chain > 0
    if cap is not None:
        assert max(int(r.tree_verified.max()) for r in out.rounds if r.tree_verified is not None) <= cap
    one = dspark_hf.generate(target, drafter, torch.tensor([PROMPTS[1]]), lookup=lookup, tree_budget=budget,
                             tree_max_nodes=cap, **kw)
    assert one.sequences[0, len(PROMPTS[1]):].tolist() == greedy_reference(target, PROMPTS[1], 24)


def test_a_lookup_branch_is_calibrated_by_what_its_own_nodes_accepted():
    """Each source's online calibration sees only its own nodes: a lookup branch that is verified and never accepted
    drives the lookup's correction down (and not the drafter's, whose chain was accepted), so the priced policy
    stops verifying the branch while it keeps the chain; corrected estimates stay non-increasing down the tree."""
    from dspark_hf.decoding.round_state import LengthPolicy, OnlineCalibration, RoundClock
    from dspark_hf.decoding.tree import lookup_branches

    chain = _chain_tree([3, 4, 5], [0.9, 0.8, 0.7])
    tree = lookup_branches(chain, [_proposal([3, 9, 8], [0.95, 0.9, 0.9])])  # shares node 0, then nodes 3, 4
    lookup_from = 3
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3]]
    def curve(b):  # a forward of b tokens costs 1 + 0.3 (b - 1) of one: width is not free
        return 1.0 / (0.01 * (1.0 + 0.3 * (torch.as_tensor(b, dtype=torch.float) - 1.0)))

    policy = LengthPolicy("scheduled", 3, curve, 0.5, RoundClock(priced=False), calibration=OnlineCalibration(),
                          lookup_calibration=OnlineCalibration())
    rows = torch.arange(1)
    assert policy.admit(tree, rows, lookup_from=lookup_from).tolist() == [[True, False, False, False, False]]  # probe
    verified = tree.valid.clone()
    on_chain = torch.tensor([[True, True, True, False, False]])  # the target took the chain every time
    for _ in range(6):
        policy.observe(tree, verified, torch.tensor([3]), lookup_from=lookup_from, accepted_nodes=on_chain)
    assert policy.calibration.kappa > 1.0 > 0.5 > policy.lookup_calibration.kappa
    survival = policy._tree_survival(tree, lookup_from)
    assert survival[0, 3] < tree.survival[0, 3] and survival[0, 1] >= tree.survival[0, 1]
    parents = tree.parents
    above = torch.where(parents >= 0, survival.gather(1, parents.clamp(min=0)), torch.ones_like(survival))
    assert bool((survival <= above + 1e-7).all())
    admitted = policy.admit(tree, rows, lookup_from=lookup_from)
    assert admitted[0, :3].all() and not admitted[0, 3:].any()
    # one shared correction (no lookup_from) would have kept the branch's high estimates
    shared = LengthPolicy("scheduled", 3, policy.sps, 0.5, RoundClock(priced=False), calibration=OnlineCalibration())
    for _ in range(6):
        shared.observe(tree, verified, torch.tensor([3]))
    assert shared.admit(tree, rows)[0, 3:].all()


def test_teacher_forced_acceptance_counts_every_answer_anchor():
    """`scripts/teacher_forced_acceptance.py`: every answer position is an anchor (the first N only, when asked) and
    the per-slot rates are rates over those anchors."""
    from conftest import load_script
    from dspark_hf.training.data import TokenizedExample
    from dspark_hf.training.features import OnlineFeatures

    script = load_script("teacher_forced_acceptance")
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=3)
    drafter.bind_target(target)
    examples = []
    for i, prompt in enumerate(PROMPTS):
        answer = greedy_reference(target, prompt, 12)
        examples.append(TokenizedExample(f"e{i}", prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    features = OnlineFeatures(target, drafter.config.target_layer_ids)
    every = script.teacher_forced(drafter, features, examples)
    assert every["anchors"] == sum(12 - 3 for _ in examples)  # anchors p-1 .. T-K-2 of each example
    for metric in ("c_star", "greedy_match"):
        assert len(every[metric]) == 3 and all(0.0 <= v <= 1.0 for v in every[metric])
    first = script.teacher_forced(drafter, features, examples, first=4)
    assert first["anchors"] == 4 * len(examples)
    # the first anchor of each example drafts the same block either way: restricting anchors changes the average only
    assert every["greedy_match"] != first["greedy_match"] or every["c_star"] != first["c_star"]


def test_the_drafter_gate_skips_the_drafter_where_the_lookup_alone_does_better():
    from dspark_hf.decoding.round_state import DrafterGate

    gate = DrafterGate()
    sure = _proposal([1, 2, 3], [0.95, 0.95, 0.95])
    assert gate.runs_drafter([sure])  # nothing measured yet: draft
    # a drafter costing 10% of a round whose chain survives 0.5, 0.25, 0.125
    gate.observe(1.1, 0.1, torch.tensor([[0.5, 0.25, 0.125]]))
    assert gate.drafter_seconds == pytest.approx(0.1) and gate.other_seconds == pytest.approx(1.0)
    # no lookup proposal: the drafter adds 0.875 tokens to 1 for 10% more time
    assert gate.runs_drafter([_proposal([], [])])
    # a confident lookup: the drafter adds 0.5 x 0.05 + 0.25 x 0.0975 + ... < 10% of 1 + 2.57 tokens
    assert not gate.runs_drafter([sure]) and gate.skipped == 1
    # a weak lookup: the drafter pays again
    assert gate.runs_drafter([_proposal([1], [0.2])])


def test_the_drafter_gate_decides_from_what_each_lookup_bin_realized():
    """Once a bin of lookup strength has drafting rounds of its own, the gate compares their realized rates: the
    lookup-alone counterfactual is the proposal's prefix on the emitted tokens (capped at the verified width), the
    drafter's gain what it accepted beyond that."""
    from dspark_hf.decoding.round_state import DrafterGate, _lookup_alone

    assert _lookup_alone([5, 6, 7], [5, 6, 9, 1], None) == 2
    assert _lookup_alone([5, 6, 7], [5, 6, 7, 1], 2) == 2  # (a width cap: what a lookup-only round verifies)
    assert _lookup_alone([], [3], None) == 0
    gate = DrafterGate(min_rounds=2, explore_every=3, decay=1.0)
    strong = _proposal([1, 2, 3], [0.9, 0.9, 0.9])  # expected 2.4 drafts: one bin
    weak = _proposal([1], [0.3])  # expected 0.3: another
    assert gate.bin([strong]) != gate.bin([weak])
    survival = torch.tensor([[0.9, 0.8, 0.7]])  # a drafter whose prior always says "draft"
    # strong bin: the lookup's three drafts are taken, the drafter adds nothing, and its round costs 1.5 s vs 1.0 s
    for _ in range(2):
        gate.observe(1.5, 0.4, survival, proposals=[strong], emitted=[[1, 2, 3, 8]])
    gate.observe(1.0, 0.0, None, proposals=[strong], emitted=[[1, 2, 3, 8]])
    evidence = gate.evidence[gate.bin([strong])]
    assert evidence.drafter_gain == 0 and evidence.lookup_tokens == 3 and evidence.lookup_seconds == 1.0
    # weak bin: the lookup's draft is rejected, the drafter's three are taken (gain 3 for 1.5 s against 1.0 s)
    for _ in range(2):
        gate.observe(1.5, 0.4, survival, proposals=[weak], emitted=[[7, 8, 9, 4]])
    assert gate.evidence[gate.bin([weak])].drafter_gain == 3
    assert gate.runs_drafter([weak])
    assert not gate.runs_drafter([strong]) and gate.skipped == 1
    # a bin the gate keeps skipping drafts again after `explore_every` skips, then skips again
    decisions = [gate.runs_drafter([strong]) for _ in range(4)]
    assert decisions == [False, False, True, False]
    # the prior still decides for a bin without drafting rounds of its own (here: draft)
    medium = _proposal([1, 2], [0.8, 0.7])
    assert gate.bin([medium]) not in gate.evidence and gate.runs_drafter([medium])


@pytest.mark.parametrize("policy", ["fixed", "scheduled", "async"])
def test_gated_lookup_branch_rounds_verify_the_lookup_alone_and_stay_lossless(policy, monkeypatch):
    """A lookup that memorised the rows and an untrained drafter: after the first timed rounds the gate takes rounds
    from the drafter (lookup-only rounds), the output is still each row's greedy output; `drafter_gate=False` (and
    no idle backoff) drafts in every round."""
    import dspark_hf.decoding.round_state as round_state

    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24)
    ids, mask = left_pad(PROMPTS[:2])
    # the drafter's forward timed as a large share of a round (a CPU drafter next to a small target)
    monkeypatch.setattr(round_state.DrafterGate, "observe", lambda self, seconds, drafter_seconds=0.0,
                        chain_survival=None, **_: _observe_as(self, drafter_seconds, chain_survival))
    kw = dict(max_new_tokens=24, policy=policy, sps=sps_curve, lookup=lookup, tree_budget=0, record_rounds=True,
              return_dict_in_generate=True)
    gated = dspark_hf.generate(target, drafter, ids, mask, **kw)
    # (the idle backoff's own lookup-only rounds depend on measured time: off here)
    always = dspark_hf.generate(target, drafter, ids, mask, drafter_gate=False, idle_backoff=False, **kw)
    for out in (gated, always):
        for row, prompt in enumerate(PROMPTS[:2]):
            assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (policy, row)
    assert any(r.lookup_only for r in gated.rounds)
    assert not any(r.lookup_only for r in always.rounds)


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_lookup_max_tokens_frees_the_lookups_own_rounds_from_the_node_cap(policy, monkeypatch):
    """`lookup_max_tokens`: the rounds the gate gives to the lookup alone propose up to that many drafts and are not
    held to `tree_max_nodes`, so a lookup that memorised the rows verifies its long runs (fewer rounds than under the
    cap) and the output stays each row's greedy output; drafting rounds still keep the cap. Without it, no round
    verifies more than the cap."""
    import dspark_hf.decoding.round_state as round_state

    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:2], n=24)
    ids, mask = left_pad(PROMPTS[:2])
    monkeypatch.setattr(round_state.DrafterGate, "observe", lambda self, seconds, drafter_seconds=0.0,
                        chain_survival=None, **_: _observe_as(self, drafter_seconds, chain_survival))
    kw = dict(max_new_tokens=24, policy=policy, sps=lambda b: 1.0 / (1.0 + 0.001 * b), lookup=lookup, tree_budget=0,
              tree_max_nodes=2, record_rounds=True, return_dict_in_generate=True)  # (a flat curve: long runs pay)
    capped = dspark_hf.generate(target, drafter, ids, mask, **kw)
    free = dspark_hf.generate(target, drafter, ids, mask, lookup_max_tokens=12, **kw)
    for out in (capped, free):
        for row, prompt in enumerate(PROMPTS[:2]):
            assert generated_rows(out, ids.shape[1])[row] == greedy_reference(target, prompt, 24), (policy, row)

    def verified(out, lookup_only):
        return [int(r.lengths.max() if r.tree_verified is None else r.tree_verified.max())
                for r in out.rounds if r.lookup_only == lookup_only]

    assert max(verified(capped, True) + verified(capped, False)) <= 2
    assert max(verified(free, True)) > 4  # past the cap and past a block
    assert max(verified(free, False), default=0) <= 2  # a drafting round: still capped
    assert sum(r.rounds for r in free.stats) < sum(r.rounds for r in capped.stats)
    one = dspark_hf.generate(target, drafter, torch.tensor([PROMPTS[1]]), lookup_max_tokens=12, **kw)
    assert one.sequences[0, len(PROMPTS[1]):].tolist() == greedy_reference(target, PROMPTS[1], 24)


def test_fixed_lookup_rounds_price_their_length_on_the_cost_curve_given():
    """Under "fixed" with `sps`, a round of the lookup alone verifies the width that maximises expected tokens per
    second on the whole curve: a steep curve verifies fewer of the same drafts than a flat one, and a curve where
    no draft pays verifies none (plain steps); without `sps` the whole proposal is verified."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:1], n=24)
    x = torch.tensor([PROMPTS[0]])
    kw = dict(max_new_tokens=24, policy="fixed", lookup=lookup, lookup_max_tokens=12, record_rounds=True,
              return_dict_in_generate=True, idle_backoff=True)
    gate = dspark_hf.decoding.round_state.DrafterGate

    def run(**extra):
        out = dspark_hf.generate(target, drafter, x, tree_budget=0, **kw, **extra)
        assert out.sequences[0, x.shape[1]:].tolist() == greedy_reference(target, PROMPTS[0], 24)
        return [int(r.lengths.max()) for r in out.rounds if r.lookup_only]

    import unittest.mock as mock
    with mock.patch.object(gate, "runs_drafter", lambda self, proposals: False):  # every round: the lookup alone
        whole = run()
        flat = run(sps=lambda b: 1.0 / (1.0 + 0.001 * b))
        steep = run(sps=lambda b: 1.0 / (1.0 + 0.3 * b))
        never = run(sps=lambda b: 1.0 / b ** 2)
    assert whole and flat and steep and never
    assert max(whole) >= max(flat) > max(steep) >= 1 and max(whole) > 2
    assert max(never) == 0  # (plain steps, recorded as the lookup's rounds that verified nothing)


def test_lookup_max_tokens_is_checked():
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    lookup = _lookup_from_target(target, PROMPTS[:1], n=8)
    x = torch.tensor([PROMPTS[0]])
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="lookup_max_tokens must be an integer >= 1"):
            dspark_hf.generate(target, drafter, x, max_new_tokens=4, lookup=lookup, lookup_max_tokens=bad)
    with pytest.raises(ValueError, match="needs lookup="):
        dspark_hf.generate(target, drafter, x, max_new_tokens=4, lookup_max_tokens=8)


def _observe_as(gate, drafter_seconds, chain_survival):
    """`DrafterGate.observe` with fixed timings: rounds of 1 s, of which a drafting round's drafter took 0.5 s."""
    gate.other_seconds = 1.0
    if chain_survival is not None:
        gate.drafter_seconds = 0.5
        gate.survival = chain_survival.float().mean(dim=0)


def test_async_history_reads_a_chain_round_as_a_tree_and_a_tree_round_as_a_chain():
    """Gated lookup-only rounds push chain confidences between tree rounds (and back): the async policy's two-rounds-
    ago budget reads either kind in the form it needs."""
    from dspark_hf.decoding.round_state import ConfidenceHistory

    rows = torch.tensor([0, 1])
    history = ConfidenceHistory()
    history.push(torch.tensor([[0.5, 0.5], [1.0, 0.2]]), rows)  # a chain round: confidences
    history.push(torch.tensor([[0.9, 0.1, 0.8]]).repeat(2, 1), rows, torch.ones(2, 3, dtype=torch.bool))
    survival, valid = history.survival_two_rounds_ago(rows)
    assert torch.allclose(survival, torch.tensor([[0.5, 0.25], [1.0, 0.2]])) and bool(valid.all())
    history.push(torch.tensor([[0.5, 0.5]]).repeat(2, 1), rows)
    # a tree round (node survivals 0.9, 0.1, 0.8; node 1 invalid in row 1) as the chain of its best nodes
    history.valid[-2] = torch.tensor([[True, True, True], [True, False, True]])
    conf = history.confidences_two_rounds_ago(rows)
    assert torch.allclose(conf, torch.tensor([[0.9, 0.8 / 0.9, 0.1 / 0.8], [0.9, 0.8 / 0.9, 0.0]]))


def test_realized_gate_stops_only_a_drafter_that_confidently_loses():
    """The batch-1 gate judges the mean gain of the last 16 drafter rounds with one standard error of slack, not the
    sign of a short sum: a drafter that gains on average through noisy rounds (accepting nothing three rounds in four,
    three tokens the fourth: mean +0.1 plain step a round) keeps running every round; one that loses steadily stops
    after `min_evidence` rounds; one that loses by less than its noise runs until the evidence is in."""
    from dspark_hf.models.candidate_generator import _RealizedRates

    def drive(tokens_per_round, round_seconds=1.4, rounds=40):
        rates, ran = _RealizedRates(), []
        for i in range(rounds):
            run = rates.runs_drafter()
            ran.append(run)
            if run:
                rates.observe("drafter", round_seconds, tokens_per_round[i % len(tokens_per_round)])
            else:
                rates.observe("plain", 1.0, 1)
        return ran

    noisy_winner = drive([1, 1, 1, 3, 1, 1, 1, 3, 1, 3])  # (the first two rounds and one plain step measure)
    assert noisy_winner[:2] == [True, True] and noisy_winner[2] is False and all(noisy_winner[3:])
    steady_loser = drive([1], round_seconds=3.0)
    assert steady_loser[3:6] == [True] * 3 and sum(steady_loser[6:]) <= 5  # then only the 1-in-9 explorations
    rates = _RealizedRates()
    rates.observe("plain", 1.0, 1)
    for tokens in (1, 1):  # two rounds are not evidence enough to stop
        rates.observe("drafter", 1.4, tokens)
    rates.drafted = rates.min_rounds
    assert not rates.loses() and rates.runs_drafter()


def test_sim_lookup_trees_replays_the_chain_and_the_other_sources_branch():
    """`scripts/sim_lookup_trees.py`: the tree holds the chain's nodes first (same survival), adds the other source's
    token where the corpus and the context disagree, never raises survival along a path, and a replay whose target
    follows the losing source accepts more with the tree than with the chain at the same node budget."""
    from conftest import load_script

    script = load_script("sim_lookup_trees")
    table = NgramLookup.build([([1, 2, 5, 6, 8, 9], [0, 0, 1, 1, 1, 1])] * 6, max_order=2, heldout_share=0.0)
    drafts = script.Drafts(table)
    seq = [3, 5, 7, 4, 5]  # the context saw 5 -> 7; the corpus says 5 -> 6
    toks, surv, _ = drafts.chain(seq, 3)
    nodes = drafts.tree(seq, 3)
    assert toks[0] == 6  # (equal estimates: the corpus first, as `NgramLookup.propose`)
    assert table.propose(seq, 3).tokens == toks
    assert [(p, s) for p, s in nodes[: len(toks)]] == [(toks[: j + 1], surv[j]) for j in range(len(toks))]
    assert {p[0] for p, _ in nodes if len(p) == 1} == {6, 7}
    survival = {tuple(p): s for p, s in nodes}
    assert all(s <= survival[tuple(p[:-1])] + 1e-12 for p, s in nodes if len(p) > 1)
    assert script.accepted([[6, 8], [7, 4]], [7, 4, 1]) == 2 and script.accepted([[6]], [7]) == 0
    refs = [{"set": "a", "prompt": seq, "gen": [7, 4, 9]}]
    tau = script.simulate(refs, table, depth=3, budgets=[4])
    # chain: 6 rejected (+7), then 4 accepted, 5 rejected (+9): 2 rounds; tree: 7, 4 accepted (+9): 1 round
    assert tau["a"] == {"chain4": 1.5, "tree4": 3.0}
    assert script.simulate(refs, table, 3, [4], trees=False)["a"] == {"chain4": 1.5}


def test_sim_drafter_lookup_replays_each_rule_by_hand():
    """`scripts/sim_drafter_lookup.py`'s replay on a continuation built by hand: the lookup is wrong at position 1,
    the drafter at position 2, so each source's chain and the better chain per round need 3 rounds for 8 tokens,
    while choosing per position needs 2; the estimates steer `splice` to the drafter exactly where the lookup is
    unsure, and the fitted table decides `splice_fit`."""
    from conftest import load_script

    script = load_script("sim_drafter_lookup")
    gen = [1, 2, 3, 4, 5, 6, 7, 8]
    l_tok = [1, 0, 3, 4, 5, 6, 7, 8]
    l_est = [0.9, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    d_tok = np.array([[gen[t + j] if t + j < 8 and t + j != 2 else 0 for j in range(3)] for t in range(8)])
    d_conf = np.full((8, 3), 0.5)
    lookup_first = np.ones((5, 5), dtype=bool)
    tau = script.replay(gen, l_tok, l_est, d_tok, d_conf, 3, None, lookup_first)
    assert tau == pytest.approx({"lookup": 8 / 3, "drafter": 8 / 3, "lookup_by_drafter": 8 / 3, "round_pick": 8 / 3,
                                 "splice": 4.0, "splice_fit": 8 / 3, "oracle_round": 8 / 3, "oracle_splice": 4.0})
    # the lookup's other source drafted 2 at position 1, and the drafter likes it better there (only there)
    l_other = [-1, 2, -1, -1, -1, -1, -1, -1]
    logp = np.full((8, 3, 2), -1.0)
    logp[0, 1], logp[1, 0] = [-3.0, -0.5], [-3.0, -0.5]
    arbitrated = script.replay(gen, l_tok, l_est, d_tok, d_conf, 3, None, lookup_first, l_other, logp)
    assert arbitrated["lookup_by_drafter"] == 4.0 and arbitrated["lookup"] == 8 / 3
    drafter_first = script.replay(gen, l_tok, l_est, d_tok, d_conf, 3, None, ~lookup_first)
    assert drafter_first["splice_fit"] == pytest.approx(8 / 3)  # right at 1, wrong at 2: the drafter's chain
    flat = script.replay(gen, l_tok, l_est, d_tok, d_conf, 3, [1.0] * 4, lookup_first)
    assert flat["round_pick_scheduled"] == flat["round_pick"] and flat["splice_fit_scheduled"] == flat["splice_fit"]
    steep = script.replay(gen, l_tok, l_est, d_tok, d_conf, 3, [1.0, 9.0, 9.0, 9.0], lookup_first)
    assert steep["round_pick_scheduled"] == 1.0  # a draft costs more than it can return: plain steps
    data = [{"gen": gen, "l_tok": l_tok, "l_est": l_est, "d_tok": d_tok, "d_conf": d_conf}]
    table = script.fit_choice(data, 3)
    # disagreements: position 1 (lookup 0.3 -> bin 1, drafter right) and position 2 (lookup 0.9 -> bin 4, lookup right)
    assert not table[1, 2] and table[4, 2] and table[0, 0]


def test_sim_drafter_lookup_drafts_the_block_draft_drafts():
    """`drafter_blocks` (one target forward, every anchor at once, the head fed the recorded previous token) gives
    the tokens and STS confidences of `DSparkDrafter.draft` through its cache: the whole block where the recorded
    continuation is the drafter's own, the first slot at every anchor."""
    from conftest import cached_draft, load_script, make_drafter, make_target

    script = load_script("sim_drafter_lookup")
    target = make_target()
    drafter = make_drafter(target, draft_candidates=8)
    drafter.set_sts_temperatures([0.5, 1.0, 2.0, 1.5])
    features = script.OnlineFeatures(target, drafter.config.target_layer_ids)
    prompt = [5, 17, 33, 2, 60, 41, 9]
    ids = torch.tensor([prompt])
    own = cached_draft(drafter, target, ids, len(prompt) - 1)
    gen = own.tokens[0].tolist() + [11, 12, 13]
    scored = [[g, -1] for g in gen]  # each position's recorded token, and no second one
    tokens, conf, logp = script.drafter_blocks(drafter, features, prompt, gen, scored)
    assert tokens.shape == (len(gen), 4) and logp.shape == (len(gen), 4, 2)
    assert np.isneginf(logp[..., 1]).all() and np.isneginf(logp[len(gen) - 1, 1:, 0]).all()  # past the end too
    full = cached_draft(drafter, target, ids, len(prompt) - 1, candidates=0)  # the whole vocabulary's logits
    expected = torch.log_softmax(full.logits[0].float(), -1)[torch.arange(4), torch.tensor(gen[:4])]
    assert np.allclose(logp[0, :, 0], expected.numpy(), atol=1e-4)
    assert tokens[0].tolist() == own.tokens[0].tolist()
    assert np.allclose(conf[0], own.confidences[0].numpy(), atol=1e-5)
    full = torch.tensor([prompt + gen])
    for t in range(1, len(gen)):
        block = cached_draft(drafter, target, full, len(prompt) + t - 1)
        assert int(tokens[t, 0]) == int(block.tokens[0, 0])
        assert abs(float(conf[t, 0]) - float(block.confidences[0, 0])) < 1e-5
