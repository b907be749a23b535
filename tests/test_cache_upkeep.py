"""Cache copies the batched loop saves: finished rows riding along (`round_state.Riders`, `drop_finished=`) and hole
compaction where it pays (`round_state.compaction_pays`, the default `hole_budget`); the output, the statistics and
the round records do not change with them."""

import pytest
import torch

import dspark_hf
from conftest import batch_oracle, generated_rows, greedy_reference, left_pad, make_target, sps_curve
from dspark_hf.decoding.round_state import ActiveRows, Riders, RowOutputs, compaction_pays

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]


# ---------------------------------------------------------------------------------------------- the rule
def test_riders_rule_weighs_the_rounds_left_against_the_drop():
    riders = Riders()
    assert not riders.drop_now(0, 16, 600, 40)
    assert riders.drop_now(2, 16, 600, 40)  # nothing measured yet: drop (rows that finished at their first token)
    riders.observe_round(0.16, live_rows=16, emitted=16)  # pace 1 token per row-round
    # prior: a drop costs 0.25 of a round; one rider costs 1/16 of a round per round left
    assert riders.rounds_left(3) == 3
    assert not riders.drop_now(1, 16, 600, 3)  # 3/16 < 0.25
    assert riders.drop_now(1, 16, 600, 5)  # 5/16 > 0.25
    assert riders.drop_now(2, 16, 600, 3)  # 6/16 > 0.25
    riders.observe_drop(0.16, rows=16, columns=600)  # measured: a drop costs a whole round at this size
    assert not riders.drop_now(2, 16, 600, 7)  # 14/16 < 1
    assert riders.drop_now(2, 16, 600, 9)  # 18/16 > 1
    assert not riders.drop_now(2, 16, 1200, 9)  # twice the columns: twice the copy
    assert riders.drop_now(16, 16, 600, 1)  # every row finished
    # a cost curve's share: riders cost less than their rows' share where a forward grows slower than its rows
    assert riders.drop_now(2, 16, 600, 9, share=2 / 16)
    assert not riders.drop_now(2, 16, 600, 9, share=2 / 16 * 0.5)


def test_rider_share_from_the_cost_curve():
    from dspark_hf.decoding.batched import _rider_share

    def curve(b):  # 0.1 s + 2 ms per token
        return 1.0 / (0.1 + 0.002 * torch.as_tensor(b, dtype=torch.float64))
    assert _rider_share(None, 16, 2) is None
    assert _rider_share(curve, 16, 2) == pytest.approx(2 * 0.002 / (0.1 + 0.032))


def test_riders_pace_counts_live_rows_tokens():
    riders = Riders()
    riders.observe_round(0.2, live_rows=4, emitted=12)  # 3 tokens per row-round
    assert riders.rounds_left(9) == 3 and riders.rounds_left(10) == 4
    riders.observe_round(0.2, live_rows=4, emitted=0)  # (at least one token per round is assumed)
    assert riders.rounds_left(3) == 2


def test_riders_modes():
    always, never = Riders("always"), Riders("never")
    for r in (always, never):
        r.observe_round(0.1, 8, 8)
    assert always.drop_now(1, 8, 100, 1) and not never.drop_now(1, 8, 100, 1000)
    assert never.drop_now(8, 8, 100, 0)  # all finished
    with pytest.raises(ValueError, match="drop_finished"):
        Riders("sometimes")


def test_finished_rows_emit_nothing_and_are_not_logged():
    ids, mask = left_pad([[1, 2], [3, 4]])
    out = RowOutputs(ids, mask, max_new_tokens=6, eos_token_ids=[9], stopping_criteria=None, streamer=None,
                     pad_token_id=0, started=0.0)
    rows = torch.tensor([0, 1])
    finished = out.emit(rows, torch.tensor([[5, 9, 7], [5, 6, 7]]), torch.tensor([3, 3]), torch.tensor([2, 2]),
                        torch.tensor([2, 2]))
    assert finished.tolist() == [True, False] and out.tokens == [[5, 9], [5, 6, 7]]
    assert out.remaining(rows).tolist() == [0, 2] and out.left(rows).tolist() == [0, 3]
    assert out.done(rows).tolist() == [True, False]
    finished = out.emit(rows, torch.tensor([[8, 8], [8, 8]]), torch.tensor([2, 2]), torch.tensor([1, 1]),
                        torch.tensor([1, 1]))
    assert finished.tolist() == [True, False] and out.tokens == [[5, 9], [5, 6, 7, 8, 8]]
    stats = out.stats
    assert stats[0].rounds == 1 and stats[1].rounds == 2  # the rider's round is not its own


# ---------------------------------------------------------------------------------------------- the loop
@pytest.fixture
def drops(monkeypatch):
    calls = []
    real = ActiveRows.drop

    def counting(self, finished):
        if finished.any():
            calls.append((len(self), int(finished.sum())))
        return real(self, finished)
    monkeypatch.setattr(ActiveRows, "drop", counting)
    return calls


@pytest.mark.parametrize("correct", [1, 3])
def test_drop_modes_give_the_same_output_and_stats(drops, correct):
    target = make_target("llama")
    ref = {i: greedy_reference(target, p, 26) for i, p in enumerate(PROMPTS)}
    eos = ref[1][4]  # row 1 stops early: many tokens left for the others
    ids, mask = left_pad(PROMPTS)
    results = {}
    for mode in ("always", "never", "auto"):
        drops.clear()
        out = dspark_hf.generate(target, batch_oracle(target, PROMPTS, 26, correct), ids, mask, max_new_tokens=26,
                                 policy="fixed", eos_token_id=eos, drop_finished=mode, return_dict_in_generate=True,
                                 record_rounds=True)
        rows = generated_rows(out, ids.shape[1])
        for i, p in enumerate(PROMPTS):
            assert rows[i] == greedy_reference(target, p, 26, eos_token_id=eos), (mode, i)
        results[mode] = (out, list(drops))
        # rounds recorded only for rows still generating: each row's records add up to its tokens
        for i in range(len(PROMPTS)):
            recorded = sum(int(a) + 1 for r in out.rounds for row, a in zip(r.rows.tolist(), r.accepted.tolist())
                           if row == i)
            assert recorded + 1 >= len(rows[i]), (mode, i)  # (+1: the prefill's token; a last round may be cut)
            assert out.stats[i].rounds == sum(row == i for r in out.rounds for row in r.rows.tolist()), (mode, i)
    assert results["never"][1] == []
    assert len(results["always"][1]) >= 2  # row 1 early, the others at different rounds
    assert (1 in {n for _, n in results["auto"][1]})  # the early stop is dropped at once in auto mode
    for mode in ("never", "auto"):  # the fixed policy drafts the same blocks: the rows' statistics agree
        for a, b in zip(results["always"][0].stats, results[mode][0].stats):
            assert (a.rounds, a.verified, a.accepted) == (b.rounds, b.verified, b.accepted), mode


def test_a_row_finishing_one_round_early_rides_along(drops):
    target = make_target("llama")
    prompts = PROMPTS + [[11, 12, 13]]
    ids, mask = left_pad(prompts)
    # row 0 emits 4 tokens a round, the others 3: row 0 reaches max_new_tokens=9 one round before them
    outs = {}
    for mode in ("auto", "always"):
        drops.clear()
        out = dspark_hf.generate(target, batch_oracle(target, prompts, 9, [3, 2, 2, 2, 2]), ids, mask,
                                 max_new_tokens=9, policy="fixed", eos_token_id=[], drop_finished=mode,
                                 return_dict_in_generate=True)
        for i, p in enumerate(prompts):
            assert generated_rows(out, ids.shape[1])[i] == greedy_reference(target, p, 9), (mode, i)
        outs[mode] = list(drops)
        assert [s.rounds for s in out.stats] == [2, 3, 3, 3, 3], mode
    assert outs["always"] == [(5, 1)]  # dropped as it finished
    assert outs["auto"] == []  # 1 rider x 1 round / 5 rows < a drop's prior 1/4 round: it rides to the end


def test_bad_drop_mode_is_refused(target, drafter):
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="drop_finished"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=4, drop_finished="later", sps=sps_curve)


# ---------------------------------------------------------------------------------------------- holes
def test_compaction_pays_when_the_holes_outlast_a_copy():
    assert compaction_pays(100, 650, 7)  # 700 >= 650: left padding at the start of a call
    assert not compaction_pays(16, 650, 40)
    assert compaction_pays(17, 650, 40)
    assert not compaction_pays(0, 10, 100) and not compaction_pays(64, 650, 0)


@pytest.fixture
def compactions(monkeypatch):
    calls = []
    real = ActiveRows.compact_holes

    def counting(self, *args, **kwargs):
        spare, columns = self.spare, self.kv_valid.shape[1]
        did = real(self, *args, **kwargs)
        if did:
            calls.append((spare, columns))
        return did
    monkeypatch.setattr(ActiveRows, "compact_holes", counting)
    return calls


def test_default_hole_budget_leaves_holes_a_short_call_cannot_repay(compactions):
    target = make_target("llama")
    prompts = [[(7 * j) % 90 + 1 for j in range(200)], [3] * 190]
    ids, mask = left_pad(prompts)
    width = 1 + 4  # block 4; 1 of 4 drafts right: 3 holes a round, 2 tokens
    outs = {}
    for budget in (None, 2 * width):
        compactions.clear()
        out = dspark_hf.generate(target, batch_oracle(target, prompts, 16, 1), ids, mask, max_new_tokens=16,
                                 policy="fixed", eos_token_id=[], hole_budget=budget, return_dict_in_generate=True)
        outs[budget] = (out, list(compactions))
    for i, p in enumerate(prompts):
        assert generated_rows(outs[None][0], ids.shape[1])[i] == greedy_reference(target, p, 16)
    assert torch.equal(outs[None][0].sequences, outs[2 * width][0].sequences)
    assert outs[2 * width][1]  # the fixed budget copies a 200-column cache to save a few rounds 12 holes
    assert outs[None][1] == []  # 3k holes x (8 - k) rounds left never reach 200 columns


def test_default_hole_budget_compacts_early_in_a_long_call(compactions):
    target = make_target("llama")
    prompts = [[5, 6, 7], [8] * 6]
    ids, mask = left_pad(prompts)
    out = dspark_hf.generate(target, batch_oracle(target, prompts, 80, 0), ids, mask, max_new_tokens=80,
                             policy="fixed", eos_token_id=[], return_dict_in_generate=True)
    for i, p in enumerate(prompts):
        assert generated_rows(out, ids.shape[1])[i] == greedy_reference(target, p, 80)
    width = 1 + 4  # no draft right: 4 holes a round, 1 token
    assert compactions and all(width < spare for spare, _ in compactions)  # never below a verification width
    assert compactions[0][1] < 20  # the first while the cache is short and ~80 rounds remain
    assert out.peak_cache_columns <= ids.shape[1] + 80 + 8 * width + width
