"""SPS cost tables: profiling, interpolation, persistence and validation."""

import json

import pytest
import torch

from conftest import make_target
from dspark_hf import SPSTable, profile_sps


def test_profile_is_monotone_and_interpolates(tmp_path):
    target = make_target("llama")
    table = profile_sps(target, max_tokens=40, context_lengths=(8, 16), repeats=1, progress=False)
    assert table.batch_tokens[0] == 1 and table.batch_tokens[-1] == 40
    assert len(table.seconds) == 2 and all(len(r) == len(table.batch_tokens) for r in table.seconds)
    b = torch.arange(1, 120)
    sps = table.steps_per_second(b)
    assert (sps > 0).all()
    assert (sps[1:] <= sps[:-1] + 1e-12).all()  # more tokens never run more steps per second
    # past the last measured B the cost grows linearly in B
    assert float(table.seconds_per_step(torch.tensor(80))) == pytest.approx(2 * float(table.seconds_per_step(torch.tensor(40))))
    table.save(tmp_path / "sps.json")
    again = SPSTable.load(tmp_path / "sps.json", target=target)
    assert torch.allclose(again.steps_per_second(b), sps)
    data = json.loads((tmp_path / "sps.json").read_text())
    assert data["target_fingerprint"].startswith("llama:L4:d32:V96") and data["meta"]["torch"]


def test_hand_made_table_interpolation():
    table = SPSTable(target="t", target_fingerprint="f", device="d", dtype="float32", context_lengths=[1],
                     batch_tokens=[1, 3], seconds=[[1.0, 3.0]])
    assert table.seconds_per_step(torch.tensor([1, 2, 3, 6])).tolist() == [1.0, 2.0, 3.0, 6.0]
    assert table(torch.tensor([2])).tolist() == [0.5]


def test_invalid_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match="ascending"):
        SPSTable(target="t", target_fingerprint="f", device="d", dtype="x", context_lengths=[1],
                 batch_tokens=[3, 1], seconds=[[1.0, 1.0]])
    with pytest.raises(ValueError, match="positive"):
        SPSTable(target="t", target_fingerprint="f", device="d", dtype="x", context_lengths=[1],
                 batch_tokens=[1], seconds=[[0.0]])
    (tmp_path / "bad.json").write_text("{ nope")
    with pytest.raises(ValueError, match="could not read"):
        SPSTable.load(tmp_path / "bad.json")
    table = SPSTable(target="t", target_fingerprint="f", device="some other gpu", dtype="float32",
                     context_lengths=[1], batch_tokens=[1], seconds=[[1.0]])
    with pytest.raises(ValueError, match="device"):
        table.check(device="cpu")


def test_rows_layout_profiles_the_loops_own_rounds(monkeypatch):
    """`profile_sps(rows=R)` times R rows of w = 1, 2, ... tokens (the padded rounds of the batched loop, the plain
    step first), not B / 4 rows of 4 tokens."""
    target = make_target("llama")
    shapes = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: shapes.append(tuple(k["input_ids"].shape)) or forward(*a, **k))
    table = profile_sps(target, max_tokens=3 * 4, context_lengths=(8,), repeats=1, progress=False, rows=3)
    assert table.batch_tokens == [3, 6, 9, 12] and table.rows == 3 and table.meta["rows"] == 3
    timed = [s for s in shapes if s[1] <= 4 and s[0] == 3]  # (the context's one-row prefill aside)
    assert sorted(set(timed)) == [(3, 1), (3, 2), (3, 3), (3, 4)] and len(timed) == 4 * 2  # warm-up + 1 repeat each
    assert profile_sps(target, max_tokens=8, context_lengths=(8,), repeats=1, progress=False).rows is None
    with pytest.raises(ValueError, match="rows"):
        profile_sps(target, max_tokens=8, rows=0, progress=False)
    with pytest.raises(ValueError, match="not both"):
        profile_sps(target, max_tokens=8, rows=2, batch_tokens=[2, 4], progress=False)


def test_row_scaled_cost_prices_the_rows_a_round_has():
    from dspark_hf.decoding.sps import RowScaledCost

    table = SPSTable(target="t", target_fingerprint="f", device="d", dtype="float32", context_lengths=[1],
                     batch_tokens=[64, 128, 192], seconds=[[0.5, 0.86, 1.22]], meta={"rows": 64})
    cost = RowScaledCost(table)
    b = torch.tensor([64, 128, 192])
    assert torch.allclose(cost.seconds_per_step(b), table.seconds_per_step(b))  # at the profiled rows: the table
    cost.rows = 16  # 16 rows of 1 / 2 / 3 tokens: a quarter of the 64-row forwards of the same widths
    assert torch.allclose(cost.seconds_per_step(torch.tensor([16, 32, 48])),
                          torch.tensor([0.125, 0.215, 0.305], dtype=torch.float64))
    assert torch.allclose(cost(torch.tensor([32])), 1.0 / torch.tensor([0.215], dtype=torch.float64))
    plain = SPSTable(target="t", target_fingerprint="f", device="d", dtype="float32", context_lengths=[1],
                     batch_tokens=[1, 4], seconds=[[0.1, 0.2]])
    with pytest.raises(ValueError, match="rows=R"):
        RowScaledCost(plain)


def test_measured_cost_keeps_times_per_row_count():
    """64 rows of 2 tokens and 32 rows of 4 are both B = 128, not the same forward: a time measured at one row count
    is not read back at another (only through the prior's scale)."""
    from dspark_hf.decoding.round_state import MeasuredCost
    from dspark_hf.decoding.sps import RowScaledCost

    table = SPSTable(target="t", target_fingerprint="f", device="d", dtype="float32", context_lengths=[1],
                     batch_tokens=[64, 128], seconds=[[0.5, 1.0]], meta={"rows": 64})
    cost = MeasuredCost(RowScaledCost(table))
    cost.set_rows(64)
    for seconds in (9.0, 2.0, 2.0):  # B = 128 at 64 rows: twice the prior (after the warm-up)
        cost.observe(128, seconds)
    assert float(cost.seconds_per_step(torch.tensor([128]))) == pytest.approx(2.0)
    cost.set_rows(32)
    assert cost.prior.rows == 32  # the prior follows the rows
    # at 32 rows B = 128 is unmeasured: the prior at 32 rows (32 x 4 tokens, past the table: linear) x the ratio 2
    assert float(cost.seconds_per_step(torch.tensor([128]))) == pytest.approx(2 * 0.5 * 2.0)
    assert set(cost.samples) == {(64, 128)}
