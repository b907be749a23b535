"""Drafter evaluation: tau per data set, per-position acceptance, threshold sweep, speedup, quality guard.

For each prompt set (see `dspark_hf.evaluation.prompt_sets`), greedy decoding with full-block verification (`policy="fixed"`)
records every round; from those rounds:

* tau: mean tokens emitted per round, bonus token included (max block_size + 1);
* per-position conditional acceptance (paper Figure 2): P(draft k accepted | drafts < k accepted);
* acceptance histogram: how many drafts each round accepted;
* static-threshold sweep (paper Figure 5): with verification cut at the first a_k < t, the emitted tokens per round
  (min(accepted, l) + 1) and the verified tokens per round (l + 1) — exact offline for greedy decoding, since whether
  a draft matches does not depend on how many are verified;
* wall-clock speedup at batch size 1: target-only greedy `generate` vs `generate(assistant_model=drafter)`, on the
  same prompts, timed back to back (`dspark_hf.evaluation.side_by_side`); greedy outputs must be identical (checked);
  `dspark-hf compare` times prompt lookup and other baselines beside the drafter;
* quality guard: HumanEval pass@1 (its own tests, in a subprocess) and math exact match of target-only vs speculative
  outputs.

Writes `eval.json` (with provenance), `eval.md` and plots (`acceptance.png`, `threshold_sweep.png`);
`run_evaluation` (`dspark-hf eval`) loads a target and a drafter folder, evaluates and writes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from transformers.utils import logging

from ..decoding.batched import generate
from ..provenance import atomic_write_json, atomic_write_text, provenance

__all__ = [
    "MATH_SETS",
    "THRESHOLDS",
    "DatasetResult",
    "evaluate_drafter",
    "measure_speedup",
    "plot",
    "quality_guard",
    "round_statistics",
    "run_evaluation",
    "threshold_sweep",
    "to_markdown",
    "write_results",
]

logger = logging.get_logger(__name__)

MATH_SETS = ("math500", "aime", "gsm_symbolic")
THRESHOLDS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


@dataclass
class DatasetResult:
    dataset: str
    prompts: int
    rounds: int
    tau: float
    conditional_acceptance: list[float]
    acceptance_histogram: list[int]
    threshold_sweep: list[dict[str, float]] = field(default_factory=list)
    speedup: dict[str, Any] | None = None  # side_by_side.SpeedRecord as a dict
    quality: dict[str, Any] | None = None


def round_statistics(accepted: torch.Tensor, verified: torch.Tensor, block_size: int) -> dict[str, Any]:
    """tau, conditional acceptance per position and the histogram from per-round accepted / verified counts."""
    full = verified == block_size
    tau = float((accepted + 1).float().mean())
    cond = []
    for k in range(block_size):
        reached = full & (accepted >= k)
        cond.append(float((accepted[reached] > k).float().mean()) if reached.any() else float("nan"))
    hist = torch.bincount(accepted[full], minlength=block_size + 1).tolist()
    return {"tau": tau, "conditional_acceptance": cond, "acceptance_histogram": hist}


def threshold_sweep(confidences: torch.Tensor, accepted: torch.Tensor, thresholds: Sequence[float] = THRESHOLDS
                    ) -> list[dict[str, float]]:
    """For each static threshold t on the prefix survival a_k: tau and verified tokens per round (greedy, offline)."""
    survival = torch.cumprod(confidences.double(), dim=1)
    out = []
    for t in thresholds:
        lengths = (survival >= t).sum(dim=1)
        emitted = torch.minimum(accepted, lengths) + 1
        out.append({"threshold": t, "tau": float(emitted.float().mean()),
                    "verified_per_round": float((lengths + 1).float().mean()),
                    "tokens_per_verified": float(emitted.sum() / (lengths + 1).sum())})
    return out


def _encode(tokenizer, messages) -> list[int]:
    from ..training.data import chat_prompt_ids

    return chat_prompt_ids(tokenizer, messages)


def measure_speedup(target, drafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, Any]:
    """Batch-1 greedy: target-only vs speculative, same prompts, back to back (`side_by_side.time_methods`). Returns
    tokens/s of both and the ratio, whether every speculative output equals the target's own, and tau at batch 1
    (new tokens per target forward)."""
    from .side_by_side import greedy_runner, time_methods

    _, records = time_methods(prompt_ids, target.device, greedy_runner(target, max_new_tokens),
                              {"speculative": greedy_runner(target, max_new_tokens, assistant_model=drafter)},
                              count_model=target)
    return records["speculative"].to_dict()


def quality_guard(dataset: str, items, texts_target: list[str], texts_spec: list[str]) -> dict[str, Any]:
    """Task accuracy of target-only vs speculative outputs (HumanEval pass@1, math exact match)."""
    from .quality import extract_final_answer, humaneval_pass_at_1, math_exact_match

    if dataset == "humaneval":
        a = humaneval_pass_at_1(items, texts_target)
        b = humaneval_pass_at_1(items, texts_spec)
        return {"metric": "pass@1", "target": a["pass_at_1"], "speculative": b["pass_at_1"]}
    if dataset in MATH_SETS:
        ok_t = [math_exact_match(extract_final_answer(t), it.reference) for t, it in zip(texts_target, items)]
        ok_s = [math_exact_match(extract_final_answer(t), it.reference) for t, it in zip(texts_spec, items)]
        return {"metric": "exact_match", "target": sum(ok_t) / len(ok_t), "speculative": sum(ok_s) / len(ok_s)}
    return {"metric": None}


def evaluate_drafter(target, drafter, tokenizer, datasets: Sequence[str], limit: int = 32, max_new_tokens: int = 128,
                     batch_size: int = 8, speed_prompts: int = 4, quality: bool = True,
                     progress: bool = True, prompt_sets: Mapping[str, Sequence] | None = None) -> list[DatasetResult]:
    """Runs the evaluation described in the module docstring on each prompt set (`prompt_sets`: name -> prompts to
    use instead of `load_prompt_set`, first `limit` taken)."""
    from .prompt_sets import load_prompt_set

    results = []
    k = drafter.config.block_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for name in datasets:
        if prompt_sets is not None and name in prompt_sets:
            items = list(prompt_sets[name])[:limit]
        else:
            items = load_prompt_set(name, limit=limit)
        prompts = [_encode(tokenizer, it.messages) for it in items]
        conf, acc, ver, texts_spec = [], [], [], [None] * len(items)
        for start in range(0, len(prompts), batch_size):
            rows = prompts[start: start + batch_size]
            width = max(map(len, rows))
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=target.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
            out = generate(target, drafter, ids, mask, max_new_tokens=max_new_tokens, policy="fixed",
                           record_rounds=True, return_dict_in_generate=True)
            for r in out.rounds:
                acc.append(r.accepted)
                ver.append(r.lengths)
                if r.confidence_logits is not None:
                    conf.append(torch.sigmoid(r.confidence_logits / torch.tensor(
                        drafter.config.sts_temperatures or [1.0] * k)))
            for i in range(len(rows)):
                n = int(out.num_generated[i])
                texts_spec[start + i] = tokenizer.decode(out.sequences[i, width: width + n], skip_special_tokens=True)
            if progress:
                logger.info(f"{name}: {min(start + batch_size, len(prompts))}/{len(prompts)} prompts")
        accepted, verified = torch.cat(acc), torch.cat(ver)
        stats = round_statistics(accepted, verified, k)
        sweep = []
        if conf:
            full = verified == k
            sweep = threshold_sweep(torch.cat(conf)[full], accepted[full])
        result = DatasetResult(dataset=name, prompts=len(prompts), rounds=len(accepted), threshold_sweep=sweep,
                               **stats)
        if speed_prompts:
            result.speedup = measure_speedup(target, drafter, prompts[:speed_prompts], max_new_tokens)
        if quality:
            texts_target = []
            for p in prompts:
                x = torch.tensor([p], device=target.device)
                ref = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False)
                texts_target.append(tokenizer.decode(ref[0, len(p):], skip_special_tokens=True))
            result.quality = quality_guard(name, items, texts_target, texts_spec)
            result.quality["identical_outputs"] = sum(a == b for a, b in zip(texts_target, texts_spec)) / len(items)
        results.append(result)
    return results


def to_markdown(results: list[DatasetResult], prov: dict, label: str) -> str:
    lines = [f"# Drafter evaluation — {label}", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`. Greedy decoding, full-block verification.", "",
             "| data set | prompts | rounds | tau | acceptance @1..K | batch-1 speedup | identical | quality (target / spec.) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        acc = ", ".join(f"{x:.2f}" for x in r.conditional_acceptance)
        speed = f"{r.speedup['speedup']:.2f}x" if r.speedup else ""
        ident = ("yes" if r.speedup["identical"] else "NO") if r.speedup else ""
        qual = ""
        if r.quality and r.quality.get("metric"):
            qual = f"{r.quality['metric']} {r.quality['target']:.2f} / {r.quality['speculative']:.2f}"
        lines.append(f"| {r.dataset} | {r.prompts} | {r.rounds} | {r.tau:.2f} | {acc} | {speed} | {ident} | {qual} |")
    if len(results) > 1:
        lines += ["", f"Macro-average tau: {statistics.mean(r.tau for r in results):.3f}"]
    return "\n".join(lines) + "\n"


def plot(results: list[DatasetResult], out: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        axes[0].plot(range(1, len(r.conditional_acceptance) + 1), r.conditional_acceptance, marker="o",
                     label=r.dataset)
        total = max(1, sum(r.acceptance_histogram))
        axes[1].plot(range(len(r.acceptance_histogram)), [h / total for h in r.acceptance_histogram], marker="s",
                     label=r.dataset)
    axes[0].set(xlabel="draft position k", ylabel="P(accept k | accepted < k)", ylim=(0, 1),
                title="per-position conditional acceptance")
    axes[1].set(xlabel="drafts accepted in a round", ylabel="share of rounds", title="acceptance histogram")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    if any(r.threshold_sweep for r in results):
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for r in results:
            if r.threshold_sweep:
                ax.plot([s["verified_per_round"] for s in r.threshold_sweep], [s["tau"] for s in r.threshold_sweep],
                        marker="o", label=r.dataset)
        ax.set(xlabel="tokens verified per round", ylabel="tau (tokens emitted per round)",
               title="static-threshold sweep")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "threshold_sweep.png", dpi=110)
        plt.close(fig)


def write_results(results: list[DatasetResult], out_dir: str | Path, label: str, device=None,
                  extra: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(device, **(extra or {}))
    atomic_write_json(out / "eval.json", {"provenance": prov, "label": label,
                                          "results": [asdict(r) for r in results]})
    atomic_write_text(out / "eval.md", to_markdown(results, prov, label))
    plot(results, out, label)
    return out


def run_evaluation(drafter_path: str | Path, target_name: str | Path, datasets: Sequence[str], limit: int = 32,
                   max_new_tokens: int = 128, batch_size: int = 8, speed_prompts: int = 4, quality: bool = True,
                   out_dir: str | Path = "outputs/eval", settings: dict | None = None, progress: bool = True) -> Path:
    """`dspark-hf eval`: loads the target (`load_target`) and the drafter folder, runs `evaluate_drafter` and writes
    `eval.json` / `eval.md` / plots to `out_dir` (`write_results`); `settings` (default: these arguments) are
    recorded in the provenance as `args`. Returns `out_dir`."""
    from ..models.modeling_dspark import DSparkDrafter
    from ..testbed.targets import load_target

    datasets = list(datasets)
    if settings is None:
        settings = {"drafter": str(drafter_path), "target": str(target_name), "datasets": ",".join(datasets),
                    "limit": limit, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                    "speed_prompts": speed_prompts, "no_quality": not quality, "out": str(out_dir)}
    target, tokenizer = load_target(target_name)
    drafter = DSparkDrafter.from_pretrained(drafter_path, target=target).eval()
    results = evaluate_drafter(target, drafter, tokenizer, datasets, limit, max_new_tokens, batch_size, speed_prompts,
                               quality, progress)
    label = f"drafter={drafter_path}, target={target_name}, max_new_tokens={max_new_tokens}"
    return write_results(results, out_dir, label, target.device, {"args": settings})
