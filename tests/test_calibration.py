"""STS and calibration metrics: hand-checkable metrics, ECE falls, order never changes."""

import pytest
import torch

from conftest import learnable_examples, make_drafter, make_target
from dspark_hf.training.calibration import (
    auroc,
    brier_score,
    calibrate,
    calibration_report,
    RoundData,
    collect_rounds,
    expected_calibration_error,
    fit_sts,
    pooled_metrics,
)


def test_metrics_by_hand():
    probs = torch.tensor([0.1, 0.1, 0.9, 0.9])
    labels = torch.tensor([0, 1, 1, 1])
    # bins: 0.1 -> acc 0.5 (|0.1-0.5|*2/4 = 0.2), 0.9 -> acc 1.0 (|0.9-1|*2/4 = 0.05)
    assert expected_calibration_error(probs, labels, n_bins=10) == pytest.approx(0.25)
    assert auroc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    assert brier_score(probs, labels) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)


def synthetic_rounds(n=20_000, k=5, seed=0):
    """True conditional survival q_k per round; the head reports an over-confident version of its logit."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, k, generator=g) * 1.2 + 1.0
    q = torch.sigmoid(true_logit)
    survive = torch.rand(n, k, generator=g) < q
    accepted = survive.long().cumprod(dim=1).sum(dim=1)
    raw = torch.sigmoid(true_logit * torch.tensor([2.5, 2.0, 3.0, 1.8, 2.2]))  # over-confident, order-preserving
    return raw, accepted


def test_sts_lowers_ece_on_overconfident_scores_and_keeps_their_order():
    raw, accepted = synthetic_rounds()
    temps = fit_sts(raw, accepted)
    assert len(temps) == 5 and all(t > 1.0 for t in temps)  # over-confidence is cooled down
    assert temps[0] == pytest.approx(2.5, rel=0.15)
    before = pooled_metrics(raw, accepted, None)
    after = pooled_metrics(raw, accepted, temps)
    assert after["ece"] < 0.5 * before["ece"] and after["ece"] < 0.02
    # order-preserving: at every position the calibrated c_k rank the rounds exactly as the raw scores do
    scaled = torch.sigmoid(torch.logit(raw.double()) / torch.tensor(temps, dtype=torch.float64))
    for j in range(5):
        assert torch.equal(torch.argsort(raw[:, j].double(), stable=True), torch.argsort(scaled[:, j], stable=True))
    report = calibration_report(raw, accepted, temps)
    assert report[0].auroc_after == pytest.approx(report[0].auroc_before, abs=1e-12)  # a_1 = c_1
    assert all(p.ece_after <= p.ece_before for p in report)


def test_partially_verified_rounds_and_bad_input():
    raw, accepted = synthetic_rounds(n=2000)
    verified = torch.full((2000,), 5)
    verified[:500] = 2
    accepted = torch.minimum(accepted, verified)
    temps = fit_sts(raw, accepted, verified)
    assert len(temps) == 5
    # a position with too few surviving prefixes inherits the previous temperature instead of a degenerate fit
    few = torch.zeros(2000, dtype=torch.long)
    few[:30] = 1  # only 30 rounds accepted draft 1, none accepted draft 2
    sparse = fit_sts(raw, few, min_positives=20)
    assert sparse[1:] == [sparse[0]] * 4
    with pytest.raises(ValueError, match="exceeds"):
        fit_sts(raw, torch.full((2000,), 5), verified)
    with pytest.raises(ValueError, match="NaN"):
        fit_sts(torch.full((3, 2), float("nan")), torch.zeros(3, dtype=torch.long))


def test_calibrate_end_to_end_stores_temperatures(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    prompts = [e.input_ids[:8] for e in learnable_examples(target, count=12)]
    data = collect_rounds(target, drafter, prompts, max_new_tokens=16, batch_size=6, progress=False)
    assert data.confidences.shape[1] == 4 and len(data.accepted) == len(data.verified) > 12
    report = calibrate(drafter, data, tmp_path)
    assert drafter.config.sts_temperatures == report["temperatures"]
    assert (tmp_path / "calibration.json").exists() and (tmp_path / "reliability.png").stat().st_size > 1000
    assert "| position | rounds |" in (tmp_path / "calibration.md").read_text()
    # guaranteed: position 1 is fitted on its own (T = 1 is on the grid), so its ECE cannot get worse; later
    # positions are fitted given the calibrated prefix, so their (and the pooled) ECE may move either way
    first = report["positions"][0]
    assert first["ece_after"] <= first["ece_before"] + 1e-12


def test_calibrate_reports_on_heldout_rounds(tmp_path):
    """With held-out rounds, the headline metrics and the per-position table come from them, not the fit."""
    gen = torch.Generator().manual_seed(3)
    k = 3

    def rounds(n: int) -> RoundData:
        raw = torch.rand(n, k, generator=gen) * 0.96 + 0.02
        # the true acceptance probability is sigmoid(logit(raw) / 2.5): the raw confidences are over-confident
        ok = torch.rand(n, k, generator=gen) < torch.sigmoid(torch.logit(raw) / 2.5)
        accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
        return RoundData(raw, accepted, torch.full((n,), k))

    fit, held = rounds(3000), rounds(1500)
    target = make_target("llama")
    drafter = make_drafter(target, block_size=k)
    report = calibrate(drafter, fit, tmp_path, heldout=held)
    assert report["evaluated_on"] == "held-out prompts" and report["eval_rounds"] == 1500
    assert report["pooled_before"] == pooled_metrics(held.confidences, held.accepted, None, held.verified)
    assert report["pooled_after"] == pooled_metrics(held.confidences, held.accepted, report["temperatures"],
                                                    held.verified)
    assert report["positions"][0]["rounds"] == 1500
    # the fitted temperatures transfer: held-out ECE drops clearly for this over-confident head
    assert report["pooled_after"]["ece"] < 0.5 * report["pooled_before"]["ece"]
    assert "held-out prompts" in (tmp_path / "calibration.md").read_text()
