"""`dspark-hf training-report`: the training runs side by side, from their own logs.

Reads each run folder's `training_config.json` (config, provenance, example counts) and `log.jsonl` (one record per
`log_every` steps) and writes `training.md` (settings, data, and the last-50-step averages of the loss and of the
training-batch acceptance diagnostics) and `training.png` (expected tau and accept_rate@1 against step). The
diagnostics are computed on training batches against the target's distribution (c* = 1 - TV), so they track learning
but are not held-out measurements. Runs trained with `eval_every` also have `heldout.jsonl` (greedy speculative
decoding of held-out prompts along the way): the report then adds a held-out table and `learning_curve.png`, held-out
tau against training CPU hours, the runs side by side. Two runs that differ in one setting (an ablation: same seed,
same data, so the same batches step by step) are also compared at equal steps: the training-batch averages over the
same window of steps and the held-out tau at the last step every run evaluated.

Run folders live outside the work tree and may be gone on the next machine; the report keeps a copy of each run's
small logs under `<out>/runs/<label>/` (the three files above, a few hundred kB), so a later report can read a run
from there, or from an older report's `training.json` as `FILE.json#label` (its held-out records and the last-50-step
averages only: the per-step log was not kept before the copies were).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from ..provenance import atomic_write_json, atomic_write_text
from ..training.data import summarize_data
from .labels import labeled_folders

__all__ = ["equal_budget_taus", "equal_step_summary", "main", "read_reported_run", "read_run", "report"]


def read_run(folder: str | Path) -> dict:
    """A training run folder's `{"config": training_config.json, "log": [log.jsonl records], "heldout": [...]}`; a
    clear error when the folder is not a run or has no records yet. `REPORT.json#label` reads run `label` of an
    earlier report's `training.json` instead (`read_reported_run`)."""
    if "#" in str(folder) and str(folder).split("#", 1)[0].endswith(".json"):
        path, label = str(folder).split("#", 1)
        return read_reported_run(path, label)
    folder = Path(folder)
    cfg_path, log_path = folder / "training_config.json", folder / "log.jsonl"
    if not cfg_path.exists() or not log_path.exists():
        raise FileNotFoundError(f"{folder} is not a training run (needs training_config.json and log.jsonl)")
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{log_path} holds no log records yet")
    heldout_path = folder / "heldout.jsonl"
    heldout = ([json.loads(line) for line in heldout_path.read_text().splitlines() if line.strip()]
               if heldout_path.exists() else [])
    return {"config": json.loads(cfg_path.read_text()), "log": _last_per_step(records),
            "heldout": _last_per_step(heldout)}


def _last_per_step(records: list[dict]) -> list[dict]:
    """One record per step, the last one written, in step order: a run resumed from a checkpoint before this
    package dropped the records it trained again (`DSparkTrainer._drop_records_after`) logged those steps twice."""
    by_step = {r.get("step"): r for r in records}
    return sorted(by_step.values(), key=lambda r: r.get("step", 0))


def read_reported_run(path: str | Path, label: str) -> dict:
    """Run `label` of a report's `training.json`, as `read_run` returns it: its config, provenance and held-out
    records as recorded, and for the log a single record at its last step holding the report's last-50-step
    averages (the per-step log is not in the file). `KeyError` naming the labels the file has."""
    data = json.loads(Path(path).read_text())
    if label not in data.get("summary", {}):
        raise KeyError(f"{path} has no run {label!r}; it has {sorted(data.get('summary', {}))}")
    summary = data["summary"][label]
    record = {"step": summary["steps"], "loss": summary["loss"], "ce": summary["ce"],
              "expected_tau": summary["expected_tau"]}
    record.update({f"accept_rate@{j + 1}": x for j, x in enumerate(summary.get("accept_rate", []))})
    return {"config": data["configs"][label], "log": [record], "heldout": list(data.get("heldout", {}).get(label, []))}


def _keep_logs(label: str, run: dict, out: Path) -> None:
    """Copies (or, for a run read from a report, writes) the run's small logs to `<out>/runs/<label>/`."""
    folder = out / "runs" / label
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "training_config.json", json.dumps(run["config"], indent=2) + "\n")
    atomic_write_text(folder / "log.jsonl", "".join(json.dumps(r) + "\n" for r in run["log"]))
    atomic_write_text(folder / "heldout.jsonl", "".join(json.dumps(r) + "\n" for r in run["heldout"]))


def _tail_mean(records: list[dict], key: str, last_steps: int = 50, end: int | None = None) -> float:
    """Mean of `key` over the records of the `last_steps` steps up to step `end` (default: the last one logged)."""
    end = records[-1]["step"] if end is None else end
    vals = [r[key] for r in records if end - last_steps < r["step"] <= end and key in r]
    return statistics.mean(vals) if vals else float("nan")


def _epochs(run: dict) -> str:
    """Passes over the training examples so far: steps trained x batch size / training examples ("-" unknown)."""
    examples, batch = run["config"].get("train_examples"), run["config"]["config"].get("batch_size")
    if not examples or not batch or not run["log"]:
        return "-"
    return f"{run['log'][-1]['step'] * int(batch) / int(examples):.1f}"


def report(runs: dict[str, str | Path], out_dir: str | Path) -> Path:
    """Writes `training.md`, `training.json`, `training.png` (and `learning_curve.png` with held-out records) for
    the runs `{label: folder}` to `out_dir`, with a copy of each run's logs under `out_dir/runs/<label>/`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = {label: read_run(folder) for label, folder in runs.items()}
    for label, run in loaded.items():
        if Path(runs[label]).resolve() != (out / "runs" / label).resolve():
            _keep_logs(label, run, out)
    keys = ["variant", "sequential_head", "block_size", "num_hidden_layers", "markov_rank", "max_steps", "batch_size",
            "num_anchors", "learning_rate", "warmup_steps", "alpha_ce", "alpha_tv", "alpha_conf", "mixed_precision",
            "seed"]
    lines = ["# Training runs", ""]
    first = next(iter(loaded.values()))
    data_dir = Path(first["config"]["config"]["data_dir"])
    if (data_dir / "manifest.json").exists():
        lines += [summarize_data(data_dir), ""]
    prov = first["config"]["provenance"]
    lines += [f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}.", "",
              "| setting | " + " | ".join(loaded) + " |", "|---|" + "---|" * len(loaded)]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(str(r["config"]["config"].get(key)) for r in loaded.values()) + " |")
    lines.append("| train / held-out examples | " + " | ".join(
        f"{r['config']['train_examples']} / {r['config']['heldout_examples']}" for r in loaded.values()) + " |")
    lines.append("| epochs (steps trained x batch_size / train examples) | " + " | ".join(
        _epochs(r) for r in loaded.values()) + " |")
    k = max(int(r["config"]["config"]["block_size"]) for r in loaded.values())
    lines += ["", "Last 50 steps, on training batches (c* = 1 - TV(p_draft, p_target) per slot):", "",
              "| run | steps | loss | CE | expected tau | " + " | ".join(f"c*@{j + 1}" for j in range(k)) + " |",
              "|---|---|---|---|---|" + "---|" * k]
    table = {}
    for label, r in loaded.items():
        log = r["log"]
        row = {"steps": log[-1]["step"], "loss": _tail_mean(log, "loss"), "ce": _tail_mean(log, "ce"),
               "expected_tau": _tail_mean(log, "expected_tau"),
               "accept_rate": [_tail_mean(log, f"accept_rate@{j + 1}") for j in range(k)]}
        table[label] = row
        lines.append(f"| {label} | {row['steps']} | {row['loss']:.3f} | {row['ce']:.3f} | {row['expected_tau']:.2f} | "
                     + " | ".join(f"{x:.2f}" for x in row["accept_rate"]) + " |")
    with_heldout = {label: r for label, r in loaded.items() if r["heldout"]}
    if with_heldout:
        lines += ["", "Held-out tau along the way (greedy speculative decoding of held-out prompts, every draft "
                  "verified; `eval_every`), next to the expected tau on training batches over the 50 steps up to each "
                  "evaluation: a training / held-out ratio that climbs along a run means the drafter fits its training "
                  "examples better than new prompts (overfitting: more data or fewer epochs):", "",
                  "| run | step | training hours (wall) | process CPU hours | held-out tau | first draft accepted | "
                  "expected tau, training batches | training / held-out |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, r in with_heldout.items():
            for rec in r["heldout"]:
                cpu = f"{rec['train_cpu_seconds'] / 3600:.2f}" if "train_cpu_seconds" in rec else "-"
                train_tau = _tail_mean(r["log"], "expected_tau", end=rec["step"])
                gap = (f"{train_tau:.2f} | {train_tau / rec['heldout_tau']:.2f}x" if math.isfinite(train_tau)
                       else "- | -")
                lines.append(f"| {label} | {rec['step']} | {rec['train_seconds'] / 3600:.2f} | {cpu} | "
                             f"{rec['heldout_tau']:.3f} | {rec['heldout_accept@1']:.3f} | {gap} |")
        _plot_learning_curve(with_heldout, out / "learning_curve.png")
    equal = equal_budget_taus({label: r["heldout"] for label, r in with_heldout.items()})
    if equal is not None:
        first = next(iter(equal["tau"]))
        clock = ("CPU hours (process CPU time of the training steps)" if equal["clock"] == "train_cpu_seconds" else
                 "CPU hours (wall time of the training steps: a run that shared its cores with more jobs is charged "
                 "more)")
        lines += ["", f"At an equal training budget of {equal['seconds'] / 3600:.2f} {clock} (the shortest run's last "
                  "held-out evaluation; the others interpolated linearly between their evaluations):", "",
                  f"| run | held-out tau | vs {first} |", "|---|---|---|"]
        for label, tau in equal["tau"].items():
            lines.append(f"| {label} | {tau:.3f} | {tau / equal['tau'][first]:.3f}x |")
    steps = equal_step_summary(loaded)
    if steps is not None:
        first = next(iter(steps["runs"]))
        lines += ["", f"At equal steps: training-batch averages over steps {steps['from_step']}-{steps['to_step']} (the "
                  "same batches when the runs share seed and data)"
                  + (f" and held-out tau at step {steps['heldout_step']}, the last step every run evaluated" if
                     steps["heldout_step"] is not None else "") + ":", "",
                  f"| run | loss | expected tau | c*@1 | held-out tau | held-out tau vs {first} |", "|---|---|---|---|---|---|"]
        base = steps["runs"][first].get("heldout_tau")
        for label, row in steps["runs"].items():
            tau = row.get("heldout_tau")
            lines.append(f"| {label} | {row['loss']:.3f} | {row['expected_tau']:.3f} | {row['accept@1']:.3f} | "
                         + (f"{tau:.3f} | {tau / base:.3f}x |" if tau is not None and base else "- | - |"))
    atomic_write_json(out / "training.json", {"runs": {label: str(f) for label, f in runs.items()}, "summary": table,
                                              "heldout": {label: r["heldout"] for label, r in with_heldout.items()},
                                              "equal_budget": equal, "equal_steps": steps,
                                              "configs": {label: r["config"] for label, r in loaded.items()}})
    atomic_write_text(out / "training.md", "\n".join(lines) + "\n")
    _plot(loaded, out / "training.png")
    return out


def equal_budget_taus(heldout: dict[str, list[dict]]) -> dict | None:
    """Held-out tau of every run at one training budget: the smallest of the runs' last evaluation times; a run
    evaluated later is interpolated linearly between the two evaluations around it (from (0 s, tau 1) before its
    first). The clock is the steps' process CPU time (`train_cpu_seconds`) when every record has it, else their wall
    time (`train_seconds`), named in the result's "clock". None with fewer than two runs."""
    runs = {label: recs for label, recs in heldout.items() if recs}
    if len(runs) < 2:
        return None
    clock = _clock(runs.values())
    runs = {label: sorted(recs, key=lambda r: r[clock]) for label, recs in runs.items()}
    budget = min(recs[-1][clock] for recs in runs.values())
    taus = {}
    for label, recs in runs.items():
        points = [(0.0, 1.0)] + [(r[clock], r["heldout_tau"]) for r in recs]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x0 <= budget <= x1:
                taus[label] = y1 if x1 == x0 else y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
                break
    return {"seconds": budget, "tau": taus, "clock": clock}


def _clock(runs) -> str:
    """The budget clock of held-out records (one list per run): process CPU time when every record has it."""
    return "train_cpu_seconds" if all("train_cpu_seconds" in r for recs in runs for r in recs) else "train_seconds"


def equal_step_summary(loaded: dict[str, dict], window: int = 50) -> dict | None:
    """Every run at the same steps: the mean training-batch loss, expected tau and c*@1 over the last `window` steps
    up to the shortest run's last logged step, and the held-out tau at the largest step every run evaluated (None
    there when they share none). `loaded` maps labels to `read_run` results; None with fewer than two runs."""
    if len(loaded) < 2:
        return None
    end = min(r["log"][-1]["step"] for r in loaded.values())
    start = max(end - window, 0)
    evaluated = [{rec["step"] for rec in r["heldout"] if rec["step"] <= end} for r in loaded.values()]
    common = set.intersection(*evaluated)
    at = max(common) if common else None
    rows = {}
    for label, r in loaded.items():
        window_recs = [rec for rec in r["log"] if start < rec["step"] <= end]

        def mean(key: str) -> float:
            vals = [rec[key] for rec in window_recs if key in rec]
            return statistics.mean(vals) if vals else float("nan")

        rows[label] = {"loss": mean("loss"), "expected_tau": mean("expected_tau"), "accept@1": mean("accept_rate@1")}
        if at is not None:
            rows[label]["heldout_tau"] = next(rec["heldout_tau"] for rec in r["heldout"] if rec["step"] == at)
    return {"from_step": start + 1, "to_step": end, "heldout_step": at, "runs": rows}


def _plot_learning_curve(loaded: dict[str, dict], path: Path) -> None:
    """Held-out tau against training CPU hours, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clock = _clock(r["heldout"] for r in loaded.values())
    cpu = clock == "train_cpu_seconds"
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, r in loaded.items():
        ax.plot([x[clock] / 3600 for x in r["heldout"]], [x["heldout_tau"] for x in r["heldout"]],
                marker="o", label=label)
    ax.set(xlabel="training process CPU hours" if cpu else "training hours (wall time of the steps)",
           ylabel="held-out tau (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(loaded: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, r in loaded.items():
        steps = [x["step"] for x in r["log"]]
        axes[0].plot(steps, [x["expected_tau"] for x in r["log"]], label=label, alpha=0.85)
        axes[1].plot(steps, [x.get("accept_rate@1", float("nan")) for x in r["log"]], label=label, alpha=0.85)
    axes[0].set(xlabel="step", ylabel="expected tau (training batches)")
    axes[1].set(xlabel="step", ylabel="c* at slot 1")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    """`dspark-hf training-report` (its argument parser lives here, the CLI forwards to it)."""
    parser = argparse.ArgumentParser(prog="dspark-hf training-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=FOLDER",
                        help="a training run folder (or a report's runs/<label> copy, or REPORT.json#label)")
    parser.add_argument("--out", default="results/training")
    args = parser.parse_args(argv)
    out = report(labeled_folders(parser, "--run", args.run), args.out)
    print((out / "training.md").read_text())
    return out


if __name__ == "__main__":  # `python -m dspark_hf.evaluation.training_report`: the same as `dspark-hf ...`
    from dspark_hf.logging_utils import configure_logging
    from dspark_hf.evaluation.training_report import main as _main  # the imported module: its logger is dspark_hf.*

    configure_logging()
    _main()
