"""`dspark-hf training-report` reads run folders and compares them; bad folders get a clear error."""

import json

import pytest

from dspark_hf.evaluation.training_report import report


def _run(folder, variant, taus):
    folder.mkdir()
    cfg = {"data_dir": str(folder / "no-data"), "variant": variant, "block_size": 2, "max_steps": len(taus) * 10}
    prov = {"device": "cpu", "torch": "t", "transformers": "x"}
    (folder / "training_config.json").write_text(json.dumps(
        {"config": cfg, "provenance": prov, "train_examples": 90, "heldout_examples": 2}))
    (folder / "log.jsonl").write_text("".join(json.dumps(
        {"step": 10 * (i + 1), "loss": 1.0 / (i + 1), "ce": 2.0, "expected_tau": t, "accept_rate@1": t - 1,
         "accept_rate@2": (t - 1) / 2}) + "\n" for i, t in enumerate(taus)))
    return folder


def test_report_averages_the_last_50_steps_and_plots(tmp_path):
    a = _run(tmp_path / "a", "dspark", [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4])  # steps 10..80
    b = _run(tmp_path / "b", "dflash", [1.0] * 8)
    out = report({"dspark": a, "dflash": b}, tmp_path / "out")
    summary = json.loads((out / "training.json").read_text())["summary"]
    assert summary["dspark"]["steps"] == 80
    assert summary["dspark"]["expected_tau"] == pytest.approx((1.6 + 1.8 + 2.0 + 2.2 + 2.4) / 5)  # steps 40..80
    assert summary["dspark"]["accept_rate"][0] == pytest.approx(1.0)
    md = (out / "training.md").read_text()
    assert "| variant | dspark | dflash |" in md and "| dflash | 80 |" in md
    assert (out / "training.png").stat().st_size > 1000


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a training run"):
        report({"x": tmp_path}, tmp_path / "out")
