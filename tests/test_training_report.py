"""`dspark-hf training-report` reads run folders and compares them; bad folders get a clear error."""

import json

import pytest

from dspark_hf.evaluation.training_report import report


def _run(folder, variant, taus):
    folder.mkdir()
    cfg = {"data_dir": str(folder / "no-data"), "variant": variant, "block_size": 2, "max_steps": len(taus) * 10,
           "batch_size": 4}
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


def test_report_adds_the_heldout_learning_curve_when_runs_measured_it(tmp_path):
    a = _run(tmp_path / "a", "dspark", [1.0, 1.5])
    b = _run(tmp_path / "b", "dflash", [1.0, 1.2])
    (a / "heldout.jsonl").write_text("".join(json.dumps(
        {"step": s, "train_seconds": 1800.0 * i, "heldout_tau": tau, "heldout_accept@1": acc}) + "\n"
        for i, (s, tau, acc) in enumerate([(10, 1.25, 0.2), (20, 1.75, 0.5)], start=1)))
    out = report({"dspark": a, "dflash": b}, tmp_path / "out")
    md = (out / "training.md").read_text()
    # next to each evaluation, the expected tau on training batches over the 50 steps up to it, and the ratio
    assert "| dspark | 10 | 0.50 | - | 1.250 | 0.200 | 1.00 | 0.80x |" in md
    assert "| dspark | 20 | 1.00 | - | 1.750 | 0.500 | 1.25 | 0.71x |" in md
    assert "| epochs (steps trained x batch_size / train examples) | 0.9 | 0.9 |" in md  # 20 steps x 4 / 90
    held = md.split("Held-out tau along the way")[1].split("At equal steps")[0]
    assert "| dflash |" not in held  # b measured nothing held out
    assert json.loads((out / "training.json").read_text())["heldout"]["dspark"][1]["heldout_tau"] == 1.75
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert not (tmp_path / "out2").exists()
    report({"dflash": b}, tmp_path / "out2")
    assert not (tmp_path / "out2" / "learning_curve.png").exists()


def test_equal_budget_interpolates_the_longer_run_at_the_shorter_runs_last_evaluation(tmp_path):
    from dspark_hf.evaluation.training_report import equal_budget_taus

    heldout = {"dspark": [{"train_seconds": 1000.0, "heldout_tau": 1.5}, {"train_seconds": 3000.0, "heldout_tau": 2.5}],
               "dflash": [{"train_seconds": 2000.0, "heldout_tau": 1.6}]}
    got = equal_budget_taus(heldout)
    assert got["seconds"] == 2000.0 and got["tau"] == {"dspark": 2.0, "dflash": 1.6}
    assert got["clock"] == "train_seconds"
    # with CPU time in every record, the budget is counted in it (here half of the wall time)
    cpu = {"dspark": [dict(r, train_cpu_seconds=s) for r, s in zip(heldout["dspark"], (500.0, 1500.0))],
           "dflash": [dict(heldout["dflash"][0], train_cpu_seconds=1000.0)]}
    by_cpu = equal_budget_taus(cpu)
    assert by_cpu["clock"] == "train_cpu_seconds" and by_cpu["seconds"] == 1000.0
    assert by_cpu["tau"] == {"dspark": 2.0, "dflash": 1.6}
    cpu["dflash"][0].pop("train_cpu_seconds")
    assert equal_budget_taus(cpu)["clock"] == "train_seconds"  # one record without it: wall time for all
    assert equal_budget_taus({"dspark": heldout["dspark"]}) is None
    a = _run(tmp_path / "a", "dspark", [1.0, 1.5])
    b = _run(tmp_path / "b", "dflash", [1.0, 1.2])
    for folder, recs in ((a, heldout["dspark"]), (b, heldout["dflash"])):
        (folder / "heldout.jsonl").write_text("".join(json.dumps(
            {"step": 10 * (i + 1), "heldout_accept@1": 0.1, **r}) + "\n" for i, r in enumerate(recs)))
    md = (report({"dspark": a, "dflash": b}, tmp_path / "out") / "training.md").read_text()
    assert "equal training budget of 0.56 CPU hours" in md
    assert "| dspark | 2.000 | 1.000x |" in md and "| dflash | 1.600 | 0.800x |" in md


def test_equal_steps_compares_runs_over_the_same_window_and_the_last_common_evaluation(tmp_path):
    from dspark_hf.evaluation.training_report import equal_step_summary, read_run

    a = _run(tmp_path / "a", "dspark", [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4])  # steps 10..80
    b = _run(tmp_path / "b", "dspark", [1.0, 1.1, 1.1, 1.1])  # steps 10..40: the window is steps 1..40
    for folder, steps in ((a, [20, 40, 60]), (b, [20, 40])):
        (folder / "heldout.jsonl").write_text("".join(json.dumps(
            {"step": s, "train_seconds": 10.0 * s, "heldout_tau": 1 + s / 100 * (2 if folder == a else 1),
             "heldout_accept@1": 0.1}) + "\n" for s in steps))
    got = equal_step_summary({"two": read_run(a), "one": read_run(b)})
    assert (got["from_step"], got["to_step"], got["heldout_step"]) == (1, 40, 40)
    assert got["runs"]["two"]["expected_tau"] == pytest.approx((1.0 + 1.2 + 1.4 + 1.6) / 4)  # not a's last steps
    assert got["runs"]["one"]["heldout_tau"] == pytest.approx(1.4) and got["runs"]["two"]["heldout_tau"] == 1.8
    md = (report({"two": a, "one": b}, tmp_path / "out") / "training.md").read_text()
    assert "averages over steps 1-40" in md and "held-out tau at step 40" in md
    assert "| one | 0.521 | 1.075 | 0.075 | 1.400 | 0.778x |" in md
    (b / "heldout.jsonl").write_text("")
    assert equal_step_summary({"two": read_run(a), "one": read_run(b)})["heldout_step"] is None
    assert equal_step_summary({"two": read_run(a)}) is None


def test_a_report_keeps_the_runs_logs_and_a_later_report_reads_a_run_from_an_older_report(tmp_path):
    """Run folders live outside the work tree and may be gone on the next machine: the report's own copy of a run's
    logs (`runs/<label>/`) reads back as the run, and an older report's `training.json#label` gives its held-out
    records and last-50-step averages next to a new run."""
    import shutil

    a = _run(tmp_path / "a", "dspark", [1.0, 1.5, 2.0])
    b = _run(tmp_path / "b", "dflash", [1.0, 1.1, 1.2])
    for folder, taus in ((a, [1.2, 1.6]), (b, [1.1, 1.15])):
        (folder / "heldout.jsonl").write_text("".join(json.dumps(
            {"step": 10 * i, "train_seconds": 600.0 * i, "train_cpu_seconds": 590.0 * i, "heldout_tau": tau,
             "heldout_accept@1": 0.1}) + "\n" for i, tau in enumerate(taus, start=1)))
    first = report({"dspark": a}, tmp_path / "first")
    kept = first / "runs" / "dspark"
    assert (kept / "log.jsonl").read_text() == (a / "log.jsonl").read_text()
    shutil.rmtree(a)  # the machine is gone
    again = report({"dspark": kept, "dflash": b}, tmp_path / "again")
    assert json.loads((again / "training.json").read_text())["equal_steps"]["runs"]["dspark"]["heldout_tau"] == 1.6
    from dspark_hf.evaluation.training_report import read_run

    old = read_run(f"{first / 'training.json'}#dspark")
    assert [r["heldout_tau"] for r in old["heldout"]] == [1.2, 1.6]
    assert old["log"] == [{"step": 30, "loss": pytest.approx((1.0 + 1.0 / 2 + 1.0 / 3) / 3), "ce": 2.0,
                           "expected_tau": pytest.approx(1.5), "accept_rate@1": pytest.approx(0.5),
                           "accept_rate@2": pytest.approx(0.25)}]  # the 3 logged steps are the last 50
    mixed = report({"dspark": f"{first / 'training.json'}#dspark", "dflash": b}, tmp_path / "mixed")
    data = json.loads((mixed / "training.json").read_text())
    assert data["equal_budget"]["tau"] == {"dspark": pytest.approx(1.6), "dflash": pytest.approx(1.15)}
    assert "| dspark | 20 | 0.33 | 0.33 | 1.600 | 0.100 |" in (mixed / "training.md").read_text()
    with pytest.raises(KeyError, match="no run 'dflash'.*'dspark'"):
        read_run(f"{first / 'training.json'}#dflash")


def test_a_run_that_logged_steps_twice_is_read_once_per_step_the_last_record_winning(tmp_path):
    """A run resumed by an older version logged the steps it trained again twice; the report reads each step once,
    the record written last (the weights the run ended with)."""
    from dspark_hf.evaluation.training_report import read_run

    folder = _run(tmp_path / "a", "dspark", [1.0, 1.2, 1.4])  # steps 10, 20, 30
    with open(folder / "log.jsonl", "a") as f:  # resumed from step 10: steps 20 and 30 logged again
        for step, tau in ((20, 1.25), (30, 1.45)):
            f.write(json.dumps({"step": step, "loss": 0.5, "ce": 2.0, "expected_tau": tau}) + "\n")
    (folder / "heldout.jsonl").write_text("".join(json.dumps({"step": s, "heldout_tau": t}) + "\n"
                                                  for s, t in ((20, 1.1), (20, 1.2))))
    run = read_run(folder)
    assert [(r["step"], r["expected_tau"]) for r in run["log"]] == [(10, 1.0), (20, 1.25), (30, 1.45)]
    assert run["heldout"] == [{"step": 20, "heldout_tau": 1.2}]


def test_a_run_read_from_an_older_report_shows_its_training_tau_at_its_last_evaluation_only(tmp_path):
    a = _run(tmp_path / "a", "dspark", [1.0, 1.5, 2.0])
    (a / "heldout.jsonl").write_text("".join(json.dumps(
        {"step": s, "train_seconds": 60.0 * s, "heldout_tau": 1.5, "heldout_accept@1": 0.3}) + "\n" for s in (10, 30)))
    old = report({"dspark": a}, tmp_path / "old")
    md = (report({"dspark": f"{old / 'training.json'}#dspark"}, tmp_path / "new") / "training.md").read_text()
    assert "| dspark | 10 | 0.17 | - | 1.500 | 0.300 | - | - |" in md  # the per-step log is not in the report
    assert "| dspark | 30 | 0.50 | - | 1.500 | 0.300 | 1.50 | 1.00x |" in md  # its last-50-step average
    assert "| epochs (steps trained x batch_size / train examples) | 1.3 |" in md
