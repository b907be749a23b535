"""Sequential Temperature Scaling (paper 3.2.1) and calibration metrics.

The scheduler needs the *absolute* prefix-survival probabilities a_k = prod_{i<=k} c_i, so the confidence head is
calibrated after training, without touching weights: for k = 1..K in order, one temperature T_k on the confidence
logit is grid-searched to minimise the expected calibration error (ECE) of the cumulative product
prod_{i<=k} sigmoid(z_i / T_i) against the label "the first k drafts were all accepted", keeping T_1..T_{k-1} fixed.
Temperature scaling is monotone, so the order of the scores (AUROC) never changes.

* `expected_calibration_error`, `auroc`, `brier_score`: metrics on (probabilities, binary labels).
* `fit_sts(confidences, accepted, verified=None) -> temperatures`: the fit, from raw per-position confidences
  `[N, K]` (the head's probabilities without STS) and the number of drafts accepted in each round `[N]`.
* `collect_rounds`: runs target + drafter (full-block verification) on prompts and records (raw confidences,
  accepted, verified) per round; `calibrate` = fit + report (+ reliability diagram PNG) + store the temperatures in
  the drafter's config.
* `calibrate_drafter` (`dspark-hf calibrate`): a saved drafter folder + its target + held-out prompts -> a seeded
  fit / measure split of the prompts (`split_fit_measure`), `collect_rounds` on each part, `calibrate`, and the
  calibrated drafter written back (`save_pretrained_in_place`: through a temporary folder, one rename per file).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = [
    "DEFAULT_GRID",
    "PositionReport",
    "RoundData",
    "auroc",
    "brier_score",
    "calibrate",
    "calibrate_drafter",
    "calibrated_survival",
    "calibration_markdown",
    "calibration_report",
    "calibration_summary",
    "collect_rounds",
    "expected_calibration_error",
    "fit_sts",
    "pooled_metrics",
    "reliability_diagram",
    "save_pretrained_in_place",
    "split_fit_measure",
]

DEFAULT_GRID = torch.logspace(-1.3, 1.3, 261)  # temperatures 0.05 .. 20


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20) -> float:
    """sum_b |B_b| / N * |mean(label in b) - mean(prob in b)| over `n_bins` equal-width bins of [0, 1]."""
    probs, labels = probs.double().flatten(), labels.double().flatten()
    if probs.numel() == 0:
        return float("nan")
    bins = torch.clamp((probs * n_bins).long(), max=n_bins - 1)
    count = torch.bincount(bins, minlength=n_bins).double()
    conf = torch.bincount(bins, weights=probs, minlength=n_bins)
    acc = torch.bincount(bins, weights=labels, minlength=n_bins)
    return float((conf - acc).abs().sum() / probs.numel())


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN if only one class is present."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # average ranks over ties
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if len(unique) < len(scores):
        first = torch.cumsum(counts, 0) - counts + 1
        avg = first + (counts - 1) / 2.0
        ranks[order] = avg[inverse].double()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float(((probs.double() - labels.double()) ** 2).mean())


def _logits(confidences: torch.Tensor) -> torch.Tensor:
    eps = 1e-6
    return torch.logit(confidences.double().clamp(eps, 1 - eps))


def _prefix_labels(accepted: torch.Tensor, k: int) -> torch.Tensor:
    """`[N, K]`: label[n, j] = 1 if the first j + 1 drafts of round n were all accepted."""
    return (accepted[:, None] > torch.arange(k)[None, :]).double()


def calibrated_survival(confidences: torch.Tensor, temperatures: Sequence[float] | None) -> torch.Tensor:
    """prod_{i<=k} sigmoid(logit(c_i) / T_i): `[N, K]`."""
    z = _logits(confidences)
    if temperatures:
        z = z / torch.tensor(list(temperatures), dtype=torch.float64)[: z.shape[1]]
    return torch.cumprod(torch.sigmoid(z), dim=1)


def fit_sts(
    confidences: torch.Tensor,
    accepted: torch.Tensor,
    verified: torch.Tensor | None = None,
    n_bins: int = 20,
    grid: torch.Tensor | None = None,
    min_positives: int = 20,
) -> list[float]:
    """One temperature per position, fitted left to right (see module docstring).

    Args:
        confidences: `[N, K]` raw per-position confidences c_k in (0, 1) (no STS applied).
        accepted: `[N]` drafts accepted in each round.
        verified: `[N]` drafts verified in each round (default K); position k is fitted on rounds with verified >= k.
        min_positives: a position whose prefix survived in fewer rounds than this is not fitted (too few positives
            make the ECE minimiser run to the ends of the grid); it inherits the previous position's temperature.
    """
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [N, K], got {tuple(confidences.shape)}")
    n, k = confidences.shape
    if accepted.shape != (n,):
        raise ValueError(f"accepted must be [N] = [{n}], got {tuple(accepted.shape)}")
    if torch.isnan(confidences).any():
        raise ValueError("confidences contain NaN")
    verified = torch.full((n,), k) if verified is None else verified
    if (accepted > verified).any():
        raise ValueError("accepted exceeds verified in some rounds")
    grid = DEFAULT_GRID if grid is None else grid.double()
    z = _logits(confidences)
    labels = _prefix_labels(accepted, k)
    temps: list[float] = []
    prefix = torch.ones(n, dtype=torch.float64)
    for j in range(k):
        rows = verified > j
        if rows.sum() == 0 or labels[rows, j].sum() < min_positives or (1 - labels[rows, j]).sum() < min_positives:
            temps.append(temps[-1] if temps else 1.0)
            prefix = prefix * torch.sigmoid(z[:, j] / temps[-1])
            continue
        cand = prefix[rows, None] * torch.sigmoid(z[rows, j][:, None] / grid[None, :])  # [n_j, G]
        errors = torch.tensor([expected_calibration_error(cand[:, g], labels[rows, j], n_bins)
                               for g in range(len(grid))])
        best = float(errors.min())
        # among near-ties prefer the temperature closest to 1 (the least change)
        near = (errors <= best + 1e-12).nonzero().flatten()
        pick = int(near[torch.argmin((grid[near].log()).abs())])
        temps.append(float(grid[pick]))
        prefix = prefix * torch.sigmoid(z[:, j] / grid[pick])
    return temps


@dataclass
class PositionReport:
    position: int
    rounds: int
    ece_before: float
    ece_after: float
    auroc_before: float
    auroc_after: float
    brier_before: float
    brier_after: float


def calibration_report(confidences: torch.Tensor, accepted: torch.Tensor, temperatures: Sequence[float],
                       verified: torch.Tensor | None = None, n_bins: int = 20) -> list[PositionReport]:
    """ECE / AUROC / Brier of the cumulative survival per position, before and after STS."""
    n, k = confidences.shape
    verified = torch.full((n,), k) if verified is None else verified
    before = calibrated_survival(confidences, None)
    after = calibrated_survival(confidences, temperatures)
    labels = _prefix_labels(accepted, k)
    out = []
    for j in range(k):
        rows = verified > j
        b, a, y = before[rows, j], after[rows, j], labels[rows, j]
        out.append(PositionReport(j + 1, int(rows.sum()), expected_calibration_error(b, y, n_bins),
                                  expected_calibration_error(a, y, n_bins), auroc(b, y), auroc(a, y),
                                  brier_score(b, y), brier_score(a, y)))
    return out


def pooled_metrics(confidences: torch.Tensor, accepted: torch.Tensor, temperatures: Sequence[float] | None,
                   verified: torch.Tensor | None = None, n_bins: int = 20) -> dict[str, float]:
    """ECE / AUROC / Brier of a_k over all (round, position) pairs that were verified."""
    n, k = confidences.shape
    verified = torch.full((n,), k) if verified is None else verified
    surv = calibrated_survival(confidences, temperatures)
    labels = _prefix_labels(accepted, k)
    sel = torch.arange(k)[None, :] < verified[:, None]
    return {"ece": expected_calibration_error(surv[sel], labels[sel], n_bins), "auroc": auroc(surv[sel], labels[sel]),
            "brier": brier_score(surv[sel], labels[sel])}


def reliability_diagram(confidences: torch.Tensor, accepted: torch.Tensor, temperatures: Sequence[float],
                        path: str | Path, verified: torch.Tensor | None = None, n_bins: int = 10) -> Path:
    """One panel per position: empirical prefix-acceptance vs predicted survival, before and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, k = confidences.shape
    verified = torch.full((n,), k) if verified is None else verified
    before, after = calibrated_survival(confidences, None), calibrated_survival(confidences, temperatures)
    labels = _prefix_labels(accepted, k)
    cols = min(k, 4)
    rows_n = (k + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 3.0 * rows_n), squeeze=False)
    for j in range(k):
        ax = axes[j // cols][j % cols]
        sel = verified > j
        for probs, name, style in ((before[sel, j], "raw", "o--"), (after[sel, j], "STS", "s-")):
            bins = torch.clamp((probs * n_bins).long(), max=n_bins - 1)
            xs, ys = [], []
            for b in range(n_bins):
                m = bins == b
                if m.sum() >= 5:
                    xs.append(float(probs[m].mean()))
                    ys.append(float(labels[sel, j][m].mean()))
            ax.plot(xs, ys, style, label=name, markersize=4)
        ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8)
        ax.set_title(f"position {j + 1}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        if j == 0:
            ax.legend(fontsize=8)
    for j in range(k, rows_n * cols):
        axes[j // cols][j % cols].axis("off")
    fig.supxlabel("predicted prefix survival a_k")
    fig.supylabel("empirical: first k drafts accepted")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass
class RoundData:
    """Per-round calibration data: raw confidences `[N, K]`, accepted `[N]`, verified `[N]`."""

    confidences: torch.Tensor
    accepted: torch.Tensor
    verified: torch.Tensor


def collect_rounds(target, drafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 128,
                   batch_size: int = 16, do_sample: bool = False, temperature: float = 1.0, pad_id: int = 0,
                   progress: bool = True) -> RoundData:
    """Runs full-block verification on the prompts and records every round's raw confidences and outcome."""
    from ..decoding.batched import generate

    if drafter.confidence_head is None:
        raise ValueError("this drafter has no confidence head: nothing to calibrate")
    conf, acc, ver = [], [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompt_ids), desc="calibration rounds", unit="prompt")
    for start in range(0, len(prompt_ids), batch_size):
        rows = [list(p) for p in prompt_ids[start: start + batch_size]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        out = generate(target, drafter, ids, mask, max_new_tokens=max_new_tokens, policy="fixed",
                       do_sample=do_sample, temperature=temperature, record_rounds=True,
                       return_dict_in_generate=True, generator=torch.Generator().manual_seed(start))
        for r in out.rounds:
            conf.append(torch.sigmoid(r.confidence_logits))
            acc.append(r.accepted)
            ver.append(r.lengths)
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.close()
    return RoundData(torch.cat(conf), torch.cat(acc), torch.cat(ver))


def calibration_markdown(report: dict) -> str:
    """The report as Markdown: pooled metrics and one row per position."""
    b, a = report["pooled_before"], report["pooled_after"]
    where = report.get("evaluated_on", "the fitting rounds (in-sample)")
    lines = ["# STS calibration", "",
             f"Fitted on {report['rounds']} verification rounds (full-block); metrics below on {where} "
             f"({report.get('eval_rounds', report['rounds'])} rounds). Temperatures: "
             + ", ".join(f"{t:.3f}" for t in report["temperatures"]), "",
             "| | ECE | AUROC | Brier |", "|---|---|---|---|",
             f"| before STS (pooled a_k) | {b['ece']:.4f} | {b['auroc']:.3f} | {b['brier']:.4f} |",
             f"| after STS (pooled a_k) | {a['ece']:.4f} | {a['auroc']:.3f} | {a['brier']:.4f} |"]
    if "fit_pooled_after" in report and report.get("evaluated_on") == "held-out prompts":
        fb, fa = report["fit_pooled_before"], report["fit_pooled_after"]
        lines += [f"| in-sample before STS | {fb['ece']:.4f} | {fb['auroc']:.3f} | {fb['brier']:.4f} |",
                  f"| in-sample after STS | {fa['ece']:.4f} | {fa['auroc']:.3f} | {fa['brier']:.4f} |"]
    lines += ["",
             "| position | rounds | ECE before | ECE after | AUROC before | AUROC after | Brier before | Brier after |",
             "|---|---|---|---|---|---|---|---|"]
    for p in report["positions"]:
        lines.append(f"| {p['position']} | {p['rounds']} | {p['ece_before']:.4f} | {p['ece_after']:.4f} | "
                     f"{p['auroc_before']:.3f} | {p['auroc_after']:.3f} | {p['brier_before']:.4f} | "
                     f"{p['brier_after']:.4f} |")
    return "\n".join(lines) + "\n"


def calibrate(drafter, data: RoundData, out_dir: str | Path | None = None, n_bins: int = 20,
              heldout: RoundData | None = None) -> dict:
    """Fits STS on `data`, stores the temperatures in `drafter.config` and returns (and writes) the report.

    With `heldout` (rounds from prompts not used for the fit) the before/after metrics, the per-position table and
    the reliability diagram are computed on those rounds; the in-sample pooled metrics are kept under
    `fit_pooled_before` / `fit_pooled_after`.
    """
    temps = fit_sts(data.confidences, data.accepted, data.verified, n_bins=n_bins)
    drafter.set_sts_temperatures(temps)
    ev = heldout if heldout is not None else data
    report = {
        "temperatures": temps,
        "rounds": int(len(data.accepted)),
        "evaluated_on": "held-out prompts" if heldout is not None else "the fitting rounds (in-sample)",
        "eval_rounds": int(len(ev.accepted)),
        "pooled_before": pooled_metrics(ev.confidences, ev.accepted, None, ev.verified, n_bins),
        "pooled_after": pooled_metrics(ev.confidences, ev.accepted, temps, ev.verified, n_bins),
        "fit_pooled_before": pooled_metrics(data.confidences, data.accepted, None, data.verified, n_bins),
        "fit_pooled_after": pooled_metrics(data.confidences, data.accepted, temps, data.verified, n_bins),
        "positions": [asdict(p) for p in calibration_report(ev.confidences, ev.accepted, temps, ev.verified,
                                                            n_bins)],
    }
    if out_dir is not None:
        from ..provenance import atomic_write_json, atomic_write_text

        out_dir = Path(out_dir)
        atomic_write_json(out_dir / "calibration.json", report)
        atomic_write_text(out_dir / "calibration.md", calibration_markdown(report))
        reliability_diagram(ev.confidences, ev.accepted, temps, out_dir / "reliability.png", ev.verified)
    return report


def calibration_summary(report: dict, written_to: str | Path | None = None) -> str:
    """One line on a calibration report: the temperatures and ECE / AUROC / Brier before -> after STS."""
    before, after = report["pooled_before"], report["pooled_after"]
    line = (f"STS temperatures {['%.3f' % t for t in report['temperatures']]}; on {report['evaluated_on']}: "
            f"ECE {before['ece']:.4f} -> {after['ece']:.4f}, AUROC {before['auroc']:.3f} -> {after['auroc']:.3f}, "
            f"Brier {before['brier']:.4f} -> {after['brier']:.4f}")
    return line + (f"; written to {written_to}" if written_to is not None else "")


def split_fit_measure(n: int, fit_fraction: float = 0.5, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices `0..n-1` split by a seeded shuffle into (fit, measure), each in increasing order.

    `max(1, round(n * fit_fraction))` indices fit; the rest (none when `fit_fraction` is 1) measure. A shuffle, not a
    cut by position: prompt files are often sorted by source, and a split by position would measure on other sources
    than it fitted on. Deterministic for a seed (`random.Random(seed)`).
    """
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_fit = max(1, round(n * fit_fraction))
    return sorted(order[:n_fit]), sorted(order[n_fit:])


def save_pretrained_in_place(model, folder: str | Path, **save_kwargs) -> Path:
    """`model.save_pretrained(folder)` without ever leaving a half-written file in `folder`.

    Everything is first written into a temporary sibling folder `.<name>.calibrating` (same file system); only when
    that succeeded is each written file moved over its namesake in `folder` with `os.replace` (atomic per file).
    Files of `folder` that `save_pretrained` does not write (a calibration report, notes) are kept; a subfolder it
    writes (`custom_generate/`) replaces the old one whole (two renames). On failure the temporary folder is removed
    and `folder` is as it was.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.calibrating"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, **save_kwargs)
        for item in sorted(tmp.iterdir()):  # replace the model's files, keep anything else in the folder
            dest = folder / item.name
            if item.is_dir() and dest.is_dir():  # e.g. custom_generate/: os.replace cannot replace a full folder
                old = folder.parent / f".{folder.name}.{item.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(dest, old)
                os.replace(item, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(item, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def calibrate_drafter(
    drafter_path: str | os.PathLike,
    target: Any,
    tokenizer: Any = None,
    prompts: str | os.PathLike | Sequence[dict[str, Any]] = (),
    *,
    limit: int | None = 64,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    fit_fraction: float = 0.5,
    split_seed: int = 0,
    out: str | os.PathLike | None = None,
    report_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict:
    """`dspark-hf calibrate`: STS-calibrates the drafter saved at `drafter_path` and writes it back.

    Args:
        target: the target model, or its registry name / folder (then loaded with `load_target`, tokenizer included).
        tokenizer: the target's tokenizer (required with a model; prompts go through its chat template).
        prompts: held-out prompts (`{"messages": [...]}` rows) or a JSONL file of them; the first `limit` are used
            (all with `limit=None`).
        fit_fraction, split_seed: `split_fit_measure` of those prompts; STS is fitted on the rounds of the fit part
            and the report's metrics are measured on the other part (in-sample when `fit_fraction` is 1).
        out: folder the calibrated drafter is written to (default: `drafter_path`, in place, with
            `save_pretrained_in_place`).
        report_dir: where `calibration.json` / `.md` / `reliability.png` go (default `<out>/calibration`).

    Returns the `calibrate` report.
    """
    from ..models.modeling_dspark import DSparkDrafter
    from .data import chat_prompt_ids
    from .prompts import read_prompts_jsonl

    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    if isinstance(prompts, (str, os.PathLike)):
        prompts, _ = read_prompts_jsonl(prompts)
    prompts = list(prompts)[:limit] if limit is not None else list(prompts)
    if not prompts:
        raise ValueError("no calibration prompts")
    if isinstance(target, (str, os.PathLike)):
        from ..testbed.targets import load_target

        target, loaded_tokenizer = load_target(target)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    if tokenizer is None:
        raise ValueError("calibrate_drafter needs the target's tokenizer when given a target model")
    drafter = DSparkDrafter.from_pretrained(drafter_path, target=target).eval()
    drafter.set_sts_temperatures([])
    ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    fit_index, eval_index = split_fit_measure(len(ids), fit_fraction, split_seed)
    pad_id = tokenizer.pad_token_id or 0
    data = collect_rounds(target, drafter, [ids[i] for i in fit_index], max_new_tokens, batch_size, pad_id=pad_id,
                          progress=progress)
    heldout = None
    if eval_index:
        heldout = collect_rounds(target, drafter, [ids[i] for i in eval_index], max_new_tokens, batch_size,
                                 pad_id=pad_id, progress=progress)
    out_path = Path(out if out is not None else drafter_path)
    report = calibrate(drafter, data, report_dir if report_dir is not None else out_path / "calibration",
                       heldout=heldout)
    # the model card (README.md) reports this calibration (dspark_hf.hub.card reads the report's keys)
    save_pretrained_in_place(drafter, out_path, model_card={"calibration": report})
    return report
