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


# ---------------------------------------------------------------------- `dspark-hf calibrate` (library side)

def test_split_fit_measure_is_seeded_and_pinned():
    import random

    from dspark_hf.training.calibration import split_fit_measure

    # the former inline split of `dspark-hf calibrate`: random.Random(seed).shuffle, first round(n * f) fit
    assert split_fit_measure(10, 0.5, 0) == ([1, 3, 5, 7, 8], [0, 2, 4, 6, 9])
    assert split_fit_measure(10, 0.5, 1) == ([5, 6, 7, 8, 9], [0, 1, 2, 3, 4])
    for seed in range(5):
        order = list(range(23))
        random.Random(seed).shuffle(order)
        assert split_fit_measure(23, 0.3, seed) == (sorted(order[:7]), sorted(order[7:]))
    assert split_fit_measure(5, 1.0, 3) == ([0, 1, 2, 3, 4], [])  # 1 = fit and report on all
    assert split_fit_measure(3, 0.1, 0) == ([0], [1, 2])  # at least one prompt fits
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fit_fraction"):
            split_fit_measure(10, bad)


def test_save_pretrained_in_place_replaces_files_keeps_others_and_is_atomic(tmp_path):
    from dspark_hf.training.calibration import save_pretrained_in_place

    class Model:
        def __init__(self, fail: bool = False):
            self.fail = fail

        def save_pretrained(self, folder):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text("new config")
            if self.fail:
                raise OSError("disk full")
            (folder / "model.safetensors").write_text("new weights")

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("old config")
    (folder / "model.safetensors").write_text("old weights")
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(OSError, match="disk full"):
        save_pretrained_in_place(Model(fail=True), folder)
    # a failed save leaves the folder as it was and no temporary folder behind
    assert (folder / "config.json").read_text() == "old config"
    assert (folder / "model.safetensors").read_text() == "old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    assert save_pretrained_in_place(Model(), folder) == folder
    assert (folder / "config.json").read_text() == "new config"
    assert (folder / "model.safetensors").read_text() == "new weights"
    assert (folder / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def _calibration_setup(tmp_path):
    from conftest import make_tokenizer

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    (folder / "notes.txt").write_text("keep me")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": " ".join(
        f"w{4 + (7 * i + 3 * j) % 90}" for j in range(6))}]} for i in range(12)]
    return target, make_tokenizer(), folder, prompts


def test_calibrate_drafter_fits_on_one_part_measures_on_the_other_and_saves_in_place(tmp_path):
    from dspark_hf import DSparkDrafter
    from dspark_hf.training.calibration import calibrate_drafter

    target, tokenizer, folder, prompts = _calibration_setup(tmp_path)
    report = calibrate_drafter(folder, target, tokenizer, prompts, limit=10, max_new_tokens=12, batch_size=5,
                               fit_fraction=0.5, split_seed=0, progress=False)
    assert report["evaluated_on"] == "held-out prompts"
    assert report["rounds"] > 0 and report["eval_rounds"] > 0
    reloaded = DSparkDrafter.from_pretrained(folder, target=target)
    assert reloaded.config.sts_temperatures == report["temperatures"]
    assert (folder / "notes.txt").read_text() == "keep me"
    assert all((folder / "calibration" / name).exists() for name in ("calibration.json", "calibration.md"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporary folder left
    # the same split seed gives the same fit (the temperatures are a function of the fitted rounds)
    again = calibrate_drafter(folder, target, tokenizer, prompts, limit=10, max_new_tokens=12, batch_size=5,
                              fit_fraction=0.5, split_seed=0, out=tmp_path / "again", progress=False)
    assert again["temperatures"] == report["temperatures"] and again["rounds"] == report["rounds"]


def test_calibrate_drafter_out_folder_in_sample_and_bad_input(tmp_path):
    from dspark_hf.training.calibration import calibrate_drafter

    target, tokenizer, folder, prompts = _calibration_setup(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    prompt_file = tmp_path / "heldout.jsonl"
    prompt_file.write_text("".join(__import__("json").dumps(p) + "\n" for p in prompts))
    out, reports = tmp_path / "calibrated", tmp_path / "reports"
    report = calibrate_drafter(folder, target, tokenizer, prompt_file, limit=None, max_new_tokens=8, batch_size=12,
                               fit_fraction=1.0, out=out, report_dir=reports, progress=False)
    assert report["evaluated_on"] == "the fitting rounds (in-sample)"
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (reports / "calibration.json").exists() and not (out / "calibration").exists()
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before  # the source is untouched
    with pytest.raises(ValueError, match="fit_fraction"):
        calibrate_drafter(folder, target, tokenizer, prompts, fit_fraction=0)
    with pytest.raises(ValueError, match="tokenizer"):
        calibrate_drafter(folder, target, None, prompts)
    with pytest.raises(ValueError, match="no calibration prompts"):
        calibrate_drafter(folder, target, tokenizer, [])
