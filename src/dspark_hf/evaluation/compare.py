"""Side-by-side comparison of drafting methods on the evaluation prompt sets, in one run.

For each prompt set (`dspark_hf.evaluation.prompt_sets`) and each method, greedy decoding gives:

* tau: tokens emitted per target verification forward (bonus token included; accepted drafts per round = tau - 1);
* for our drafters, per-position conditional acceptance (full-block verification, all `limit` prompts, batched);
* batch 1, on the first `speed_prompts` prompts: tokens/s, speedup over target-only greedy decoding of the *same*
  target and whether each output is identical to it, every method timed side by side in one run
  (`dspark_hf.evaluation.side_by_side.time_methods`: per prompt target-only first, then each method).

Methods (the batch-1 ones only when `speed_prompts > 0`):

* `target-only`: the target's own greedy decoding, the baseline of every speedup (tau 1 by construction);
* `prompt-lookup`: transformers' prompt-lookup decoding, `generate(prompt_lookup_num_tokens=N)` (default N = 10 and
  transformers' default `max_matching_ngram_size`, 2): training-free, the first thing a user tries;
* `assisted`: transformers' assisted generation with a small draft model of the same tokenizer (`assistant=`);
* each of our drafters (`label=folder`, e.g. `dspark=...`, `dflash=...`): tau and acceptance from
  `dspark_hf.evaluation.evaluate.evaluate_drafter` (batched loop, `limit` prompts), speed through
  `target.generate(assistant_model=drafter)`;
* `hf-dflash`: one of our DFlash-variant drafters run through transformers' built-in DFlash path
  (`speculation_type="dflash"`, see `dspark_hf.decoding.hf_dflash`);
* `stock-assisted`: transformers' assisted generation on *another* target / draft-model pair (`stock=`, e.g.
  Qwen2.5-Coder-1.5B-Instruct + 0.5B), timed against that target's own decoding.

tau of the batch-1 methods is new tokens per target forward on the speed prompts (a forward pre-hook counts them);
the prefill forward counts too (it emits one token and verifies no draft), so for short outputs it sits a little
below the per-round tau of the drafters' batched runs. The assistant must be a separate model object: its forwards
would otherwise be counted as the target's.
Writes `compare.json` (with provenance), `compare.md` and plots (`tau.png`, `acceptance.png`, `speedup.png`);
`run_comparison` (`dspark-hf compare`) = `compare` + `write_comparison`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from transformers.utils import logging

from ..provenance import atomic_write_json, atomic_write_text, provenance
from .side_by_side import (assisted_runner, batched_runner, count_forwards, forward_counted_tau, greedy_runner, prompt_lookup_runner,
                           time_methods, time_side_by_side)

__all__ = [
    "BASELINE_METHODS",
    "DEFAULT_PROMPT_LOOKUP_TOKENS",
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

# transformers' own default for the number of tokens a prompt-lookup round proposes (PromptLookupCandidateGenerator)
DEFAULT_PROMPT_LOOKUP_TOKENS = 10
# methods that are not drafters of ours (every other method name is a drafter label)
BASELINE_METHODS = ("target-only", "prompt-lookup", "assisted", "hf-dflash", "stock-assisted")


@dataclass
class MethodResult:
    """One method on one prompt set. `speed`: a `side_by_side.SpeedRecord` as a dict (target / speculative tokens/s,
    speedup, identical, prompts, tau at batch 1, ...), None when not timed."""

    method: str
    dataset: str
    target: str
    tau: float
    tau_prompts: int
    conditional_acceptance: list[float] | None = None
    speed: dict[str, Any] | None = None


@dataclass
class Comparison:
    datasets: list[str]
    methods: list[str]
    results: list[MethodResult] = field(default_factory=list)
    device: str | None = None  # where it ran (the provenance's device)

    def get(self, method: str, dataset: str) -> MethodResult | None:
        return next((r for r in self.results if r.method == method and r.dataset == dataset), None)

    def macro_tau(self, method: str) -> float | None:
        taus = [r.tau for r in self.results if r.method == method]
        return statistics.mean(taus) if taus else None

    @property
    def drafters(self) -> list[str]:
        """Our drafters' labels, in order (every method that is not one of `BASELINE_METHODS`)."""
        return [m for m in self.methods if m not in BASELINE_METHODS]


def _prompt_items(name: str, limit: int, prompt_sets: Mapping[str, Sequence] | None) -> list:
    from .prompt_sets import load_prompt_set

    if prompt_sets is not None and name in prompt_sets:
        return list(prompt_sets[name])[:limit]
    return load_prompt_set(name, limit=limit)


def compare(target_name: str, drafters: Mapping[str, str], datasets: Sequence[str], limit: int = 16,
            max_new_tokens: int = 64, batch_size: int = 8, speed_prompts: int = 3, hf_dflash: str | None = None,
            stock: tuple[str, str] | None = None, stock_prompts: int | None = None,
            draft_head_dtype: torch.dtype | None = None, prompt_lookup: int | None = DEFAULT_PROMPT_LOOKUP_TOKENS,
            max_matching_ngram_size: int | None = None, assistant: str | None = None,
            dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
            prompt_sets: Mapping[str, Sequence] | None = None, warmup: bool = True,
            preloaded: Mapping[str, tuple[Any, Any]] | None = None, progress: bool = True,
            lookup: str | None = None, prepack: bool = False, gqa_attention: bool = False,
            lookup_branches: int | None = None) -> Comparison:
    """Runs every method on every prompt set (see the module docstring).

    Args:
        target_name: registered target name or folder (the target of `drafters`).
        drafters: label -> drafter folder, e.g. `{"dspark": ..., "dflash": ...}` (may be empty: baselines only).
        speed_prompts: prompts timed at batch 1 per set; 0 = tau and acceptance of our drafters only.
        hf_dflash: label of a DFlash-variant drafter in `drafters` to also run through transformers' built-in path.
        stock: `(target, assistant)` names for transformers' assisted generation on another target, or None to skip.
        stock_prompts: speed prompts for the stock pair (default `speed_prompts`; its target is the slowest part).
        draft_head_dtype: `DSparkDrafter.set_draft_head_dtype` for all our drafters (not the built-in DFlash path,
            which applies the target's head itself).
        prompt_lookup: tokens per prompt-lookup round (`prompt_lookup_num_tokens`); None or 0 skips the method.
        max_matching_ngram_size: prompt lookup's longest n-gram matched (None: transformers' default, 2).
        assistant: a draft model (registered name or folder) of `target_name`'s tokenizer for `assisted`.
        dtype, device: the models' dtype and device (default float32 on the CPU).
        prompt_sets: name -> prompts (`EvalPrompt`s) to use instead of `load_prompt_set` (e.g. read from a file on
            a machine without the prompt-set packages).
        warmup: run every batch-1 method once, untimed, before the first set's timings.
        preloaded: name -> `(model, tokenizer)` already loaded (on their device), used instead of loading that name
            (`target_name`, `assistant` or a `stock` name).
        lookup: an `NgramLookup` file, or "release" for the target's shipped table: adds the methods `lookup`
            (`LookupAssistant`, no drafter) and `<label>+lookup` per drafter (`set_assist(lookup, sps=...)`), both
            with round lengths from the target's batch-1 cost curve, profiled here (tau counted at batch 1).
        lookup_branches: with `lookup`, also the method `<label>+branches` per drafter: `dspark_hf.generate` at batch
            1 with the lookup's continuation verified as a branch of the drafter's chain (`tree_budget=0`,
            `tree.lookup_branches`), at most this many nodes per round (`tree_max_nodes`), policy "fixed".
        prepack: `prepack_linears(target)` (CPU): every method, target-only included, runs on the prepacked target.
        gqa_attention: `use_gqa_attention(target)`: every method, target-only included, runs its multi-token
            forwards without `repeat_kv` copies (one-token steps are unchanged).
    """
    from ..models.modeling_dspark import DSparkDrafter
    from ..testbed.targets import load_target
    from ..training.data import chat_prompt_ids
    from .evaluate import evaluate_drafter

    if hf_dflash is not None and hf_dflash not in drafters:
        raise ValueError(f"hf_dflash={hf_dflash!r} must name one of the drafters {sorted(drafters)}")
    if prompt_lookup is not None and prompt_lookup < 0:
        raise ValueError(f"prompt_lookup must be >= 0 (0 = skip it), got {prompt_lookup}")
    reserved = set(BASELINE_METHODS) | ({"lookup"} | {f"{d}+lookup" for d in drafters}
                                        | {f"{d}+branches" for d in drafters} if lookup else set())
    if lookup_branches is not None and (not lookup or isinstance(lookup_branches, bool)
                                        or not isinstance(lookup_branches, int) or lookup_branches < 1):
        raise ValueError(f"lookup_branches must be a node count >= 1 and needs lookup; got "
                         f"lookup_branches={lookup_branches!r}, lookup={lookup!r}")
    clash = sorted(set(drafters) & reserved)
    if clash:
        raise ValueError(f"drafter labels {clash} are method names of the comparison; choose other labels")

    def load(name: str):
        if preloaded is not None and name in preloaded:
            return preloaded[name]
        model, tok = load_target(name, dtype=dtype)
        return (model.to(device) if device is not None else model), tok

    target, tokenizer = load(target_name)
    if prepack:
        from ..models.prepacked import prepack_linears

        prepack_linears(target)
    if gqa_attention:
        from ..models.gqa_attention import use_gqa_attention

        use_gqa_attention(target)
    table = None
    if lookup:
        from ..testbed.release import resolve_lookup

        table = resolve_lookup(lookup, target_name)
    loaded = {label: DSparkDrafter.from_pretrained(path, target=target, dtype=target.dtype).to(target.device).eval()
              for label, path in drafters.items()}
    for drafter in loaded.values():
        drafter.set_draft_head_dtype(draft_head_dtype)
    timed = speed_prompts > 0
    baselines = (["target-only"] + (["prompt-lookup"] if prompt_lookup else [])
                 + (["assisted"] if assistant else [])) if timed else []
    with_lookup = ["lookup"] + [f"{label}+lookup" for label in drafters] if table is not None and timed else []
    if with_lookup and lookup_branches:
        with_lookup += [f"{label}+branches" for label in drafters]
    methods = (baselines + list(drafters) + with_lookup + (["hf-dflash"] if hf_dflash else [])
               + (["stock-assisted"] if stock else []))
    result = Comparison(datasets=list(datasets), methods=methods, device=str(target.device))
    assistant_model = load(assistant)[0] if assistant and timed else None
    if assistant_model is target:  # its forwards would count as the target's: tau and the comparison meaningless
        raise ValueError(f"assistant={assistant!r} is the target model itself; pass a separate draft model")
    stock_models = None
    if stock is not None:
        stock_target, stock_tok = load(stock[0])
        stock_models = (stock_target, stock_tok, load(stock[1])[0])
    adapter = None
    if hf_dflash is not None:
        from ..decoding.hf_dflash import dflash_adapter

        adapter = dflash_adapter(loaded[hf_dflash], target)
    runners = {}  # the batch-1 methods on `target`, in the order they are timed after target-only
    if timed and prompt_lookup:
        runners["prompt-lookup"] = prompt_lookup_runner(target, max_new_tokens, prompt_lookup,
                                                        max_matching_ngram_size)
    if assistant_model is not None:
        runners["assisted"] = greedy_runner(target, max_new_tokens, assistant_model=assistant_model)
    for label, drafter in loaded.items():
        runners[label] = greedy_runner(target, max_new_tokens, assistant_model=drafter)
    if with_lookup:
        from ..decoding.sps import profile_batch1_sps
        from ..models.candidate_generator import LookupAssistant

        sps = profile_batch1_sps(target)
        runners["lookup"] = greedy_runner(target, max_new_tokens, assistant_model=LookupAssistant(table, target,
                                                                                                  sps=sps))
        for label, drafter in loaded.items():
            runners[f"{label}+lookup"] = assisted_runner(target, max_new_tokens, drafter, lookup=table, sps=sps)
        if lookup_branches:
            for label, drafter in loaded.items():
                runners[f"{label}+branches"] = batched_runner(target, max_new_tokens, drafter, lookup=table,
                                                              tree_budget=0, tree_max_nodes=lookup_branches,
                                                              policy="fixed")
    if adapter is not None:
        runners["hf-dflash"] = greedy_runner(target, max_new_tokens, assistant_model=adapter,
                                             speculation_type="dflash")
    for i, name in enumerate(datasets):
        items = _prompt_items(name, limit, prompt_sets)
        by_method: dict[str, MethodResult] = {}
        for label, drafter in loaded.items():
            if progress:
                logger.info(f"[{name}] {label}: tau and acceptance on {len(items)} prompts")
            (r,) = evaluate_drafter(target, drafter, tokenizer, [name], limit=limit, max_new_tokens=max_new_tokens,
                                    batch_size=batch_size, speed_prompts=0, quality=False, progress=False,
                                    prompt_sets={name: items})
            by_method[label] = MethodResult(label, name, target_name, r.tau, r.prompts, r.conditional_acceptance)
        prompts = [chat_prompt_ids(tokenizer, it.messages) for it in items][:speed_prompts]
        if timed and prompts:
            if progress:
                logger.info(f"[{name}] batch 1 on {len(prompts)} prompts: target-only, {', '.join(runners)}")
            base, records = time_methods(prompts, target.device, greedy_runner(target, max_new_tokens), runners,
                                         count_model=target, warmup=warmup and i == 0)
            by_method["target-only"] = MethodResult("target-only", name, target_name, base.tau, len(prompts),
                                                    speed=base.to_dict())
            for label, record in records.items():
                if label in by_method:  # our drafter: tau from the batched loop, speed from here
                    by_method[label].speed = record.to_dict()
                else:
                    by_method[label] = MethodResult(label, name, target_name, record.tau, len(prompts),
                                                    speed=record.to_dict())
        if stock_models is not None:
            s_target, s_tok, s_assistant = stock_models
            n = speed_prompts if stock_prompts is None else stock_prompts
            s_prompts = [chat_prompt_ids(s_tok, it.messages) for it in items][:n]
            if s_prompts:
                if progress:
                    logger.info(f"[{name}] stock-assisted on {len(s_prompts)} prompts")
                _, records = time_methods(
                    s_prompts, s_target.device, greedy_runner(s_target, max_new_tokens),
                    {"stock-assisted": greedy_runner(s_target, max_new_tokens, assistant_model=s_assistant)},
                    count_model=s_target, warmup=warmup and i == 0)
                record = records["stock-assisted"]
                by_method["stock-assisted"] = MethodResult("stock-assisted", name, f"{stock[0]} + {stock[1]}",
                                                           record.tau, len(s_prompts), speed=record.to_dict())
        result.results.extend(by_method[m] for m in methods if m in by_method)
    return result


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "" if x is None else f"{x:{spec}}{suffix}"


_NOTES = {
    "target-only": "the target's own greedy decoding: the baseline of every speedup",
    "prompt-lookup": "transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`), no draft model, no training",
    "assisted": "transformers' assisted generation with a draft model (`assistant_model=`)",
    "hf-dflash": "our DFlash weights through transformers' built-in `speculation_type=\"dflash\"` path",
    "stock-assisted": "transformers' assisted generation on another target / draft-model pair, against that target",
    "lookup": "n-gram lookup drafts from the target's own answers and the sequence (`LookupAssistant`), no drafter; "
              "round lengths from the measured cost curve",
}


def _speed_cell(r: MethodResult | None) -> str:
    if r is None or not r.speed:
        return ""
    return f"{r.speed['speedup']:.2f}x" + ("" if r.speed["identical"] else " (NOT identical)")


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
        lines += [""] + [f"{m} / dflash macro-average tau: **{comp.macro_tau(m) / base:.3f}x**"
                         for m in comp.drafters if m != "dflash"]
    lines += [""] + [f"- `{m}`: {_NOTES[m]}; tau on the batch-1 prompts." for m in methods if m in _NOTES]
    lines += [f"- `{m}`: the drafter's chain and the lookup's continuation verified together as a tree "
              "(`dspark_hf.generate(..., lookup=, tree_budget=0, tree_max_nodes=W)`, policy fixed, the batched loop "
              "at batch 1); tau on the batch-1 prompts." for m in methods if m.endswith("+branches")]
    if any(r.speed for r in comp.results):
        lines += ["", "### Batch-1 wall-clock speedup over the same target's greedy decoding", "",
                  "| data set | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for d in comp.datasets:
            lines.append(f"| {d} | " + " | ".join(_speed_cell(comp.get(m, d)) for m in methods) + " |")
        lines += ["", "Every speculative output was identical to its target's own greedy output unless marked.",
                  "", "### Batch 1, greedy, side by side (per prompt: target-only, then each method)", "",
                  "| data set | method | prompts | tokens/s | speedup vs target-only | tau at batch 1 "
                  "| accepted drafts per target forward (tau - 1) | identical to target greedy |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in comp.datasets:
            for m in methods:
                r = comp.get(m, d)
                if r is None or not r.speed:
                    continue
                s, tau = r.speed, r.speed.get("tau")
                ident = "yes" if s["identical"] else f"NO ({s.get('identical_prompts', '?')}/{s['prompts']})"
                lines.append(f"| {d} | {m} | {s['prompts']} | {s['speculative_tokens_per_s']:.1f} | "
                             f"{s['speedup']:.2f}x | {_fmt(tau)} | {_fmt(None if tau is None else tau - 1)} | "
                             f"{ident} |")
        lines += [""] + _faster_than_lines(comp)
    lines += ["", "### Per-position conditional acceptance P(draft k accepted | drafts < k accepted)", "",
              "| method | data set | " + " | ".join(f"k={k + 1}" for k in range(_max_k(comp))) + " |",
              "|---|---|" + "---|" * _max_k(comp)]
    for r in comp.results:
        if r.conditional_acceptance:
            lines.append(f"| {r.method} | {r.dataset} | " + " | ".join(_fmt(x) for x in r.conditional_acceptance)
                         + " |")
    return "\n".join(lines) + "\n"


def _faster_than_lines(comp: Comparison) -> list[str]:
    """For each of our drafters: on how many sets its batch-1 tokens/s beat target-only and prompt lookup (both
    measured in the same run, on the same prompts)."""
    lines = []
    for m in comp.drafters:
        for rival in ("target-only", "prompt-lookup", "assisted"):
            pairs = [(comp.get(m, d), comp.get(rival, d)) for d in comp.datasets]
            pairs = [(a.speed, b.speed) for a, b in pairs if a and b and a.speed and b.speed]
            if not pairs:
                continue
            wins = sum(a["speculative_tokens_per_s"] > b["speculative_tokens_per_s"] for a, b in pairs)
            ratio = statistics.geometric_mean([a["speculative_tokens_per_s"] / b["speculative_tokens_per_s"]
                                               for a, b in pairs])
            lines.append(f"- `{m}` faster than `{rival}` on **{wins} of {len(pairs)}** sets (geometric-mean "
                         f"tokens/s ratio {ratio:.2f}x)")
    return lines


def _max_k(comp: Comparison) -> int:
    return max((len(r.conditional_acceptance) for r in comp.results if r.conditional_acceptance), default=0)


def plot(comp: Comparison, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in comp.methods if m != "target-only"]  # its tau and speedup are 1: the plots' baseline line
    width = 0.8 / max(1, len(shown))
    for key, fname, ylabel in (("tau", "tau.png", "tau (tokens per target forward)"),
                               ("speedup", "speedup.png", "batch-1 speedup vs target-only")):
        if key == "speedup" and not any(r.speed for r in comp.results):
            continue
        fig, ax = plt.subplots(figsize=(8, 3.8))
        for i, m in enumerate(shown):
            vals = []
            for d in comp.datasets:
                r = comp.get(m, d)
                v = None if r is None else (r.tau if key == "tau" else (r.speed or {}).get("speedup"))
                vals.append(float("nan") if v is None else v)
            ax.bar([j + i * width for j in range(len(comp.datasets))], vals, width, label=m)
        ax.axhline(1.0, color="k", lw=0.8)  # target-only
        ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(comp.datasets))], comp.datasets)
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


def write_comparison(comp: Comparison, out_dir: str | Path, settings: dict, device=None, plots: bool = True) -> Path:
    """`compare.json` (provenance of `device`, default the comparison's own), `compare.md` and the plots (unless
    `plots=False`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(device or comp.device)
    atomic_write_json(out / "compare.json", {"provenance": prov, "settings": settings, "datasets": comp.datasets,
                                             "methods": comp.methods, "results": [asdict(r) for r in comp.results]})
    atomic_write_text(out / "compare.md", to_markdown(comp, prov, settings))
    if plots:
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
                   dtype: torch.dtype | str = torch.float32, **kwargs: Any) -> Path:
    """`dspark-hf compare`: `compare(target_name, drafters, datasets, **kwargs)` written to `out_dir` with
    `write_comparison` (`settings` recorded next to the numbers; default: the arguments). `draft_head_dtype` and
    `dtype` may be given by name (`"bfloat16"`, `"float32"`). Returns `out_dir`."""
    if isinstance(draft_head_dtype, str):
        draft_head_dtype = getattr(torch, draft_head_dtype)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    comp = compare(target_name, drafters, list(datasets), draft_head_dtype=draft_head_dtype, dtype=dtype, **kwargs)
    if settings is None:
        settings = {"target": target_name, "drafters": dict(drafters), "datasets": ",".join(datasets),
                    "dtype": str(dtype).removeprefix("torch."),
                    **{k: (str(v) if isinstance(v, torch.device) else v) for k, v in kwargs.items()
                       if v is not None and k != "prompt_sets"}}
    return write_comparison(comp, out_dir, settings)
