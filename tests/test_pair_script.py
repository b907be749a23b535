"""scripts/train_dspark_vs_dflash.sh: which folders the DSpark / DFlash pair trains into, measures and reports.

The script is run for real with `dspark-hf` and `python` replaced by stubs on PATH that record their arguments, so the
test checks the commands the script issues (not the training they start).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_dspark_vs_dflash.sh"


def _run_pair(tmp_path: Path, **env: str) -> list[list[str]]:
    """Runs the pair script with recording stubs; returns each stubbed command's argv (program name first)."""
    stubs, calls = tmp_path / "bin", tmp_path / "calls.txt"
    stubs.mkdir()
    for program in ("dspark-hf", "python"):
        stub = stubs / program
        stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {program} "$@" >> "{calls}"\nprintf "\\n" >> "{calls}"\n')
        stub.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "RUNS": str(tmp_path / "runs"),
                "EXAMPLES": "8", "STEPS": "10", **env}
    result = subprocess.run(["bash", str(SCRIPT)], env=full_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line.rstrip("\0").split("\0") for line in calls.read_text().splitlines() if line]


def _trains(calls: list[list[str]]) -> dict[str, list[str]]:
    """The pair's `dspark-hf train` calls by their variant (the cache call has none)."""
    out = {}
    for argv in calls:
        if argv[:2] == ["dspark-hf", "train"]:
            variant = next((a.split("=", 1)[1] for a in argv if a.startswith("variant=")), None)
            if variant is not None:
                out[variant] = argv
    return out


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("dflash_tag, dflash_run", [(None, "dflash-x"), ("-base", "dflash-base")])
def test_both_runs_train_measure_and_report_under_their_own_names(tmp_path, dflash_tag, dflash_run):
    env = {"TAG": "-x", "DSPARK_ARGS": "markov_rank=512", "ARGS": "seed=1"}
    if dflash_tag is not None:
        env["DFLASH_TAG"] = dflash_tag
    calls = _run_pair(tmp_path, **env)
    runs = tmp_path / "runs"
    trains = _trains(calls)
    assert set(trains) == {"dspark", "dflash"}
    assert f"output_dir={runs}/dspark-x-8-10" in trains["dspark"]
    assert f"output_dir={runs}/{dflash_run}-8-10" in trains["dflash"]
    # settings for both runs reach both; DSpark-only settings never reach the baseline
    assert "seed=1" in trains["dspark"] and "seed=1" in trains["dflash"]
    assert "markov_rank=512" in trains["dspark"] and "markov_rank=512" not in trains["dflash"]
    measured = [argv for argv in calls if argv[:2] == ["python", "scripts/heldout_tau.py"] and "--drafter" in argv]
    assert sorted(_value(argv, "--drafter") for argv in measured) == sorted(
        [f"dspark-x={runs}/dspark-x-8-10/final", f"{dflash_run}={runs}/{dflash_run}-8-10/final"])
    merge = next(argv for argv in calls if "--merge" in argv)
    assert merge[merge.index("--merge") + 1:merge.index("--merge") + 3] == [
        f"{runs}/heldout-dspark-x-8-10.json", f"{runs}/heldout-{dflash_run}-8-10.json"]
    report = next(argv for argv in calls if argv[:2] == ["dspark-hf", "training-report"])
    assert [report[i + 1] for i, a in enumerate(report) if a == "--run"] == [
        f"dspark-x={runs}/dspark-x-8-10", f"{dflash_run}={runs}/{dflash_run}-8-10"]


def test_a_dspark_only_call_compares_with_an_earlier_baseline(tmp_path):
    calls = _run_pair(tmp_path, TAG="-rnn", DFLASH_TAG="", VARIANTS="dspark", DSPARK_ARGS="sequential_head=rnn")
    runs = tmp_path / "runs"
    assert set(_trains(calls)) == {"dspark"}
    merge = next(argv for argv in calls if "--merge" in argv)
    assert f"{runs}/heldout-dflash-8-10.json" in merge, shlex.join(merge)
    report = next(argv for argv in calls if argv[:2] == ["dspark-hf", "training-report"])
    assert f"dflash={runs}/dflash-8-10" in report
