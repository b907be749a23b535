"""Side-by-side comparison of drafting methods on the evaluation prompt sets, in one run.

For each prompt set (`dspark_hf.evaluation.prompt_sets`) and each method, greedy decoding gives:

* tau: tokens emitted per target verification forward (bonus token included);
* for our drafters, per-position conditional acceptance (full-block verification, all `limit` prompts, batched);
* batch-1 wall-clock speedup over target-only greedy decoding of the *same* target, on the first `speed_prompts`
  prompts, timed back to back (target-only, then speculative, per prompt), and whether the outputs were identical.

Methods:

* each of our drafters (`label=folder`, e.g. `dspark=...`, `dflash=...`): `dspark_hf.evaluation.evaluate.evaluate_drafter`;
* `hf-dflash`: one of our DFlash-variant drafters run through transformers' built-in DFlash path
  (`speculation_type="dflash"`, see `dspark_hf.decoding.hf_dflash`); tau counted from its target forwards, on the speed prompts;
* `stock-assisted`: transformers' stock assisted generation with its default settings, a draft *model* as assistant
  (Qwen2.5-Coder-1.5B-Instruct target + 0.5B assistant by default); tau = new tokens / target forwards, on the
  speed prompts. Its speedup is relative to *its own* target decoding alone.

Writes `compare.json` (with provenance), `compare.md` and plots (`tau.png`, `acceptance.png`, `speedup.png`);
`run_comparison` (`dspark-hf compare`) = `compare` + `write_comparison`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers.utils import logging

from ..provenance import atomic_write_json, atomic_write_text, provenance

__all__ = [
    "Comparison",
    "MethodResult",
    "compare",
    "count_forwards",
    "forward_counted_tau",
    "parse_stock_pair",
    "plot",
    "run_comparison",
    "time_side_by_side",
    "to_markdown",
    "write_comparison",
]

logger = logging.get_logger(__name__)


@dataclass
class MethodResult:
    """One method on one prompt set."""

    method: str
    dataset: str
    target: str
    tau: float
    tau_prompts: int
    conditional_acceptance: list[float] | None = None
    speed: dict[str, Any] | None = None  # target/speculative tokens/s, speedup, identical, prompts


@dataclass
class Comparison:
    datasets: list[str]
    methods: list[str]
    results: list[MethodResult] = field(default_factory=list)

    def get(self, method: str, dataset: str) -> MethodResult | None:
        return next((r for r in self.results if r.method == method and r.dataset == dataset), None)

    def macro_tau(self, method: str) -> float | None:
        taus = [r.tau for r in self.results if r.method == method]
        return statistics.mean(taus) if taus else None


@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts `model.forward` calls inside the block (a forward pre-hook, removed on exit)."""
    counter = [0]
    handle = model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    try:
        yield counter
    finally:
        handle.remove()


def time_side_by_side(prompt_ids: Sequence[Sequence[int]], device, base: Callable[[torch.Tensor], torch.Tensor],
                      spec: Callable[[torch.Tensor], torch.Tensor],
                      count_model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Per prompt: `base(x)` then `spec(x)`, timed back to back. Returns tokens/s of both, the ratio and whether every
    speculative output equals the base output; with `count_model`, also `tau`: new tokens of the speculative runs per
    forward of that model (a pre-hook, negligible next to a forward)."""
    base_t = spec_t = 0.0
    base_n = spec_n = forwards = 0
    identical = True
    for ids in prompt_ids:
        x = torch.tensor([list(ids)], device=device)
        start = time.perf_counter()
        ref = base(x)
        base_t += time.perf_counter() - start
        with count_forwards(count_model) if count_model is not None else nullcontext([0]) as counter:
            start = time.perf_counter()
            out = spec(x)
            spec_t += time.perf_counter() - start
        forwards += counter[0]
        base_n += ref.shape[1] - x.shape[1]
        spec_n += out.shape[1] - x.shape[1]
        identical &= bool(torch.equal(ref, out))
    result = {"target_tokens_per_s": base_n / base_t, "speculative_tokens_per_s": spec_n / spec_t,
              "speedup": (spec_n / spec_t) / (base_n / base_t), "identical": identical, "prompts": len(prompt_ids)}
    if count_model is not None:
        result["tau"] = spec_n / max(1, forwards)
    return result


def _greedy(model, max_new_tokens: int, **kwargs) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  do_sample=False, **kwargs)
    return run


def forward_counted_tau(model, run: Callable[[torch.Tensor], torch.Tensor],
                        prompt_ids: Sequence[Sequence[int]], device) -> float:
    """New tokens per forward of `model` (every forward of an assisted loop verifies and emits >= 1 token)."""
    tokens = forwards = 0
    for ids in prompt_ids:
        x = torch.tensor([list(ids)], device=device)
        with count_forwards(model) as counter:
            out = run(x)
        tokens += out.shape[1] - x.shape[1]
        forwards += counter[0]
    return tokens / max(1, forwards)


def compare(target_name: str, drafters: dict[str, str], datasets: Sequence[str], limit: int = 16,
            max_new_tokens: int = 64, batch_size: int = 8, speed_prompts: int = 3, hf_dflash: str | None = None,
            stock: tuple[str, str] | None = None, stock_prompts: int | None = None,
            draft_head_dtype: torch.dtype | None = None, progress: bool = True) -> Comparison:
    """Runs every method on every prompt set (see the module docstring).

    Args:
        target_name: registered target name or folder (the target of `drafters`).
        drafters: label -> drafter folder, e.g. `{"dspark": ..., "dflash": ...}`.
        hf_dflash: label of a DFlash-variant drafter in `drafters` to also run through transformers' built-in path.
        stock: `(target, assistant)` names for transformers' stock assisted generation, or None to skip.
        stock_prompts: speed prompts for the stock pair (default `speed_prompts`; its target is the slowest part).
        draft_head_dtype: `DSparkDrafter.set_draft_head_dtype` for all our drafters (not the built-in DFlash path,
            which applies the target's head itself).
    """
    from ..training.data import chat_prompt_ids
    from .evaluate import evaluate_drafter
    from ..models.modeling_dspark import DSparkDrafter
    from .prompt_sets import load_prompt_set
    from ..testbed.targets import load_target

    if hf_dflash is not None and hf_dflash not in drafters:
        raise ValueError(f"hf_dflash={hf_dflash!r} must name one of the drafters {sorted(drafters)}")
    target, tokenizer = load_target(target_name)
    loaded = {label: DSparkDrafter.from_pretrained(path, target=target, dtype=target.dtype).eval()
              for label, path in drafters.items()}
    for drafter in loaded.values():
        drafter.set_draft_head_dtype(draft_head_dtype)
    methods = list(drafters) + (["hf-dflash"] if hf_dflash else []) + (["stock-assisted"] if stock else [])
    result = Comparison(datasets=list(datasets), methods=methods)
    stock_models = None
    if stock is not None:
        stock_target, stock_tok = load_target(stock[0])
        stock_assistant, _ = load_target(stock[1])
        stock_models = (stock_target, stock_tok, stock_assistant)
    adapter = None
    if hf_dflash is not None:
        from ..decoding.hf_dflash import dflash_adapter

        adapter = dflash_adapter(loaded[hf_dflash], target)
    for name in datasets:
        items = load_prompt_set(name, limit=limit)
        for label, drafter in loaded.items():
            if progress:
                logger.info(f"[{name}] {label}")
            (r,) = evaluate_drafter(target, drafter, tokenizer, [name], limit=limit, max_new_tokens=max_new_tokens,
                                    batch_size=batch_size, speed_prompts=speed_prompts, quality=False,
                                    progress=False)
            result.results.append(MethodResult(label, name, target_name, r.tau, r.prompts,
                                               r.conditional_acceptance, r.speedup))
        prompts = [chat_prompt_ids(tokenizer, it.messages) for it in items][:speed_prompts]
        if adapter is not None and prompts:
            if progress:
                logger.info(f"[{name}] hf-dflash")
            spec = _greedy(target, max_new_tokens, assistant_model=adapter, speculation_type="dflash")
            speed = time_side_by_side(prompts, target.device, _greedy(target, max_new_tokens), spec, target)
            result.results.append(MethodResult("hf-dflash", name, target_name, speed["tau"], len(prompts), None,
                                               speed))
        if stock_models is not None:
            s_target, s_tok, s_assistant = stock_models
            n = speed_prompts if stock_prompts is None else stock_prompts
            s_prompts = [chat_prompt_ids(s_tok, it.messages) for it in items][:n]
            if s_prompts:
                if progress:
                    logger.info(f"[{name}] stock-assisted")
                spec = _greedy(s_target, max_new_tokens, assistant_model=s_assistant)
                speed = time_side_by_side(s_prompts, s_target.device, _greedy(s_target, max_new_tokens), spec,
                                          s_target)
                result.results.append(MethodResult("stock-assisted", name, f"{stock[0]} + {stock[1]}",
                                                   speed["tau"], len(s_prompts), None, speed))
    return result


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "" if x is None else f"{x:{spec}}{suffix}"


def to_markdown(comp: Comparison, prov: dict, settings: dict) -> str:
    methods = comp.methods
    lines = ["# Drafting methods side by side", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`. Greedy decoding. Settings: "
             + ", ".join(f"{k}={v}" for k, v in settings.items()) + ".", "",
             "### tau (tokens emitted per target forward, bonus included)", "",
             "| data set | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for d in comp.datasets:
        cells = [_fmt(getattr(comp.get(m, d), "tau", None)) for m in methods]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines.append("| **macro-average** | " + " | ".join(f"**{_fmt(comp.macro_tau(m))}**" for m in methods) + " |")
    if "dflash" in methods:  # every drafter of ours against the DFlash baseline
        base = comp.macro_tau("dflash")
        ours = [m for m in methods if m not in ("dflash", "hf-dflash", "stock-assisted")]
        lines += [""] + [f"{m} / dflash macro-average tau: **{comp.macro_tau(m) / base:.3f}x**" for m in ours]
    notes = {"hf-dflash": "our DFlash weights through transformers' built-in `speculation_type=\"dflash\"` path",
             "stock-assisted": "transformers' stock assisted generation, draft model as assistant (other target)"}
    lines += [""] + [f"- `{m}`: {notes[m]}; tau on the speed prompts only." for m in methods if m in notes]
    if any(r.speed for r in comp.results):
        lines += ["", "### Batch-1 wall-clock speedup over the same target's greedy decoding", "",
                  "| data set | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for d in comp.datasets:
            cells = []
            for m in methods:
                r = comp.get(m, d)
                if r is None or not r.speed:
                    cells.append("")
                else:
                    ok = "" if r.speed["identical"] else " (NOT identical)"
                    cells.append(f"{r.speed['speedup']:.2f}x{ok}")
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        lines += ["", "Every speculative output was identical to its target's own greedy output unless marked."]
    lines += ["", "### Per-position conditional acceptance P(draft k accepted | drafts < k accepted)", "",
              "| method | data set | " + " | ".join(f"k={k + 1}" for k in range(_max_k(comp))) + " |",
              "|---|---|" + "---|" * _max_k(comp)]
    for r in comp.results:
        if r.conditional_acceptance:
            lines.append(f"| {r.method} | {r.dataset} | " + " | ".join(_fmt(x) for x in r.conditional_acceptance)
                         + " |")
    return "\n".join(lines) + "\n"


def _max_k(comp: Comparison) -> int:
    return max((len(r.conditional_acceptance) for r in comp.results if r.conditional_acceptance), default=0)


def plot(comp: Comparison, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / max(1, len(comp.methods))
    for key, fname, ylabel in (("tau", "tau.png", "tau (tokens per target forward)"),
                               ("speedup", "speedup.png", "batch-1 speedup vs target-only")):
        if key == "speedup" and not any(r.speed for r in comp.results):
            continue
        fig, ax = plt.subplots(figsize=(8, 3.8))
        for i, m in enumerate(comp.methods):
            vals = []
            for d in comp.datasets:
                r = comp.get(m, d)
                v = None if r is None else (r.tau if key == "tau" else (r.speed or {}).get("speedup"))
                vals.append(float("nan") if v is None else v)
            ax.bar([j + i * width for j in range(len(comp.datasets))], vals, width, label=m)
        if key == "speedup":
            ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + width * (len(comp.methods) - 1) / 2 for j in range(len(comp.datasets))], comp.datasets)
        ax.set(ylabel=ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    with_acc = [r for r in comp.results if r.conditional_acceptance]
    if with_acc:
        fig, axes = plt.subplots(1, len(comp.datasets), figsize=(3.2 * len(comp.datasets), 3.2), sharey=True,
                                 squeeze=False)
        for ax, d in zip(axes[0], comp.datasets):
            for r in with_acc:
                if r.dataset == d:
                    ax.plot(range(1, len(r.conditional_acceptance) + 1), r.conditional_acceptance, marker="o",
                            label=r.method)
            ax.set(title=d, xlabel="draft position k", ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("P(accept k | accepted < k)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=110)
        plt.close(fig)


def write_comparison(comp: Comparison, out_dir: str | Path, settings: dict, device=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(device)
    atomic_write_json(out / "compare.json", {"provenance": prov, "settings": settings, "datasets": comp.datasets,
                                             "methods": comp.methods, "results": [asdict(r) for r in comp.results]})
    atomic_write_text(out / "compare.md", to_markdown(comp, prov, settings))
    plot(comp, out)
    return out


def parse_stock_pair(text: str, flag: str = "--stock") -> tuple[str, str]:
    """`"TARGET:ASSISTANT"` -> `(target, assistant)`, split at the first `:`; `ValueError` naming `flag` otherwise."""
    stock_target, sep, assistant = text.partition(":")
    if not sep or not stock_target or not assistant:
        raise ValueError(f"{flag} takes TARGET:ASSISTANT, got {text!r}")
    return stock_target, assistant


def run_comparison(target_name: str, drafters: dict[str, str], datasets: Sequence[str], out_dir: str | Path,
                   settings: dict | None = None, *, draft_head_dtype: torch.dtype | str | None = None,
                   **kwargs: Any) -> Path:
    """`dspark-hf compare`: `compare(target_name, drafters, datasets, **kwargs)` written to `out_dir` with
    `write_comparison` (`settings` recorded next to the numbers; default: the arguments). `draft_head_dtype` may
    be given by name (`"bfloat16"`, `"float32"`). Returns `out_dir`."""
    if isinstance(draft_head_dtype, str):
        draft_head_dtype = getattr(torch, draft_head_dtype)
    comp = compare(target_name, drafters, list(datasets), draft_head_dtype=draft_head_dtype, **kwargs)
    if settings is None:
        settings = {"target": target_name, "drafters": dict(drafters), "datasets": ",".join(datasets),
                    **{k: v for k, v in kwargs.items() if v is not None}}
    return write_comparison(comp, out_dir, settings)
