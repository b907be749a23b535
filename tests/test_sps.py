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
