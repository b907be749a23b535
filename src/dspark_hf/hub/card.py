"""Model cards of DSpark drafters, generated through huggingface_hub's `ModelCard` / `ModelCardData`.

`DSparkDrafter.save_pretrained` writes one as `README.md` (this module installs itself as the drafter's card
writer on `import dspark_hf`), `DSparkDrafter.push_to_hub` uploads it instead of transformers' generic card, and
`dspark-hf release` / `scripts/write_model_cards.py` write the release drafter's. Nothing in a card is typed by hand
except optional prose sections: the settings come from the drafter's config, the numbers from results files.

Front matter (`ModelCardData`):

* `library_name: dspark_hf`. Not `transformers`: a drafter is not a causal LM one can run alone, so the Hub's
  transformers snippets and widgets (`pipeline("text-generation", model=...)`, `AutoModelForCausalLM`) would not work
  on it; it needs its target and `import dspark_hf` (the `assistant_model=` hook, `dspark_hf.generate`). The card's
  usage section shows the code that does work. The checkpoint still loads with plain transformers
  (`AutoModel.from_pretrained(..., trust_remote_code=True)`), which the card says too.
* `base_model`: the target's Hub id (`DSparkConfig.portable_target_fields()`; omitted when the target has none),
  so the Hub lists the drafter on its target's model tree the way it lists adapters.
* `pipeline_tag: text-generation`, `tags: [speculative-decoding, dspark, drafter]` (+ the caller's), `license`,
  `datasets` (Hub dataset ids, when known).

Inputs for the numbers (all optional; each a dict as below, or the path of a results JSON that `load_results` reads):

* `metrics` — measured tau / speedup per data set, e.g. from `metrics_from_compare("results/.../compare.json")`::

      {"source": "results/compare_smollm2/compare.json", "method": "dspark", "baseline": "dflash",
       "setting": "greedy, 16 prompts per data set, 64 new tokens",
       "rows": [{"dataset": "humaneval", "tau": 1.32, "baseline_tau": 1.26, "acceptance": [0.24, 0.26, 0.5],
                 "speedup": 0.59, "identical": True}, ...]}

  optionally with `"reference": "prompt-lookup"` and per row `"reference_tau"` / `"reference_speedup"`: what a
  user would otherwise pick, measured in the same run (`metrics_from_compare` fills them where the file has them).

* `calibration` — `calibration_from_report("<drafter>/calibration/calibration.json")`: ECE / AUROC / Brier of the
  prefix-survival estimate before and after STS, rounds, temperatures.
* `throughput` — a list of `throughput_from_bench("results/.../bench.json")`: aggregate tokens/s of each verification
  policy relative to plain batched decoding, per concurrency.

Every table names the file its numbers come from (`source`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from huggingface_hub import ModelCard, ModelCardData

__all__ = [
    "CARD_TAGS",
    "LIBRARY_NAME",
    "build_model_card",
    "calibration_from_report",
    "load_results",
    "metrics_from_compare",
    "model_card_data",
    "throughput_from_bench",
    "write_model_card",
]

LIBRARY_NAME = "dspark_hf"
CARD_TAGS = ("speculative-decoding", "dspark", "drafter")
PAPER_URL = "https://arxiv.org/abs/2607.05147"
DATASET_NAMES = {"humaneval": "HumanEval", "mt_bench": "MT-Bench", "math500": "MATH500 (mmath)",
                 "aime": "AIME (mmath)", "gsm_symbolic": "GSM-symbolic"}


# ============================================================================================ results files -> inputs

def _read_json(data_or_path: Mapping | str | os.PathLike) -> tuple[dict, str | None]:
    if isinstance(data_or_path, Mapping):
        return dict(data_or_path), None
    path = Path(data_or_path)
    return json.loads(path.read_text()), path.as_posix()


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(float(value)) else None


def metrics_from_compare(data_or_path: Mapping | str | os.PathLike, method: str = "dspark",
                         baseline: str | None = None, source: str | None = None,
                         reference: str | None = "prompt-lookup", baseline_setting: str = "same budget") -> dict:
    """The `metrics` input from a `dspark-hf compare` result (`compare.json`): tau, the first three conditional
    acceptances, the batch-1 speedup and the lossless check of `method` per data set, with `baseline`'s tau beside
    it (default: another of our drafters in the same file, e.g. the DFlash baseline) and, where the file has it, the
    tau and batch-1 speedup of `reference` (default: transformers' prompt lookup, what a user tries first; None: not
    shown) measured in the same run. `baseline_setting` describes the baseline in the table's header (default: it
    was trained with the same budget; "" for nothing)."""
    data, path = _read_json(data_or_path)
    results = data.get("results") or []
    methods = [r.get("method") for r in results]
    if method not in methods:
        raise ValueError(f"{path or 'the comparison'} has no method {method!r}; it has {sorted(set(methods))}")
    if baseline is None:
        # another drafter of ours, never a batch-1 baseline of the comparison (compare.BASELINE_METHODS)
        baseline = next((m for m in data.get("methods", []) if m != method and m in methods
                         and not str(m).startswith(("hf-", "stock", "target-only", "prompt-lookup", "assisted"))),
                        None)
    base_tau = {r.get("dataset"): _finite(r.get("tau")) for r in results if r.get("method") == baseline}
    ref = {r.get("dataset"): r for r in results if reference is not None and r.get("method") == reference}
    rows = []
    for r in results:
        if r.get("method") != method:
            continue
        speed = r.get("speed") or {}
        accept = [_finite(a) for a in (r.get("conditional_acceptance") or [])[:3]]
        rows.append({"dataset": r.get("dataset"), "tau": _finite(r.get("tau")),
                     "baseline_tau": base_tau.get(r.get("dataset")),
                     "acceptance": accept, "speedup": _finite(speed.get("speedup")),
                     "identical": speed.get("identical")})
        if r.get("dataset") in ref:
            other = ref[r.get("dataset")]
            rows[-1]["reference_tau"] = _finite(other.get("tau"))
            rows[-1]["reference_speedup"] = _finite((other.get("speed") or {}).get("speedup"))
    settings = data.get("settings") or {}
    setting = ", ".join(part for part in (
        "greedy decoding",
        f"{settings['limit']} prompts per data set" if "limit" in settings else "",
        f"{settings['max_new_tokens']} new tokens" if "max_new_tokens" in settings else "",
        f"batch-1 speedup on {settings['speed_prompts']} prompts per set, timed against target-only decoding"
        if "speed_prompts" in settings else "",
        (data.get("provenance") or {}).get("device", ""),
    ) if part)
    out = {"source": source or path, "method": method, "baseline": baseline, "setting": setting, "rows": rows,
           "baseline_setting": baseline_setting}
    if ref:
        out["reference"] = reference
    return out


def calibration_from_report(data_or_path: Mapping | str | os.PathLike, source: str | None = None) -> dict:
    """The `calibration` input from a `dspark-hf calibrate` report (`calibration.json`)."""
    data, path = _read_json(data_or_path)

    def pooled(key: str) -> dict:
        return {k: _finite(v) for k, v in (data.get(key) or {}).items()}

    return {"source": source or path, "temperatures": [float(t) for t in data.get("temperatures", [])],
            "fit_rounds": data.get("rounds"), "eval_rounds": data.get("eval_rounds"),
            "evaluated_on": data.get("evaluated_on"), "before": pooled("pooled_before"),
            "after": pooled("pooled_after")}


def throughput_from_bench(data_or_path: Mapping | str | os.PathLike, policies: Sequence[str] = ("scheduled", "fixed"),
                          source: str | None = None) -> dict:
    """The `throughput` input from a `dspark-hf bench` result (`bench.json`): each policy's aggregate tokens/s relative
    to plain batched decoding (`policy="none"`) at the same concurrency."""
    data, path = _read_json(data_or_path)
    plain = {r["concurrency"]: r["aggregate_tokens_per_s"] for r in data.get("rows", []) if r.get("policy") == "none"}
    rows = [{"concurrency": r["concurrency"], "policy": r["policy"],
             "relative": r["aggregate_tokens_per_s"] / plain[r["concurrency"]],
             "mean_verify_length": _finite(r.get("mean_verify_length")), "identical": r.get("identical_to_target")}
            for r in data.get("rows", []) if r.get("policy") in policies and plain.get(r.get("concurrency"))]
    return {"source": source or path, "label": data.get("label", ""), "rows": rows}


def load_results(data_or_path: Mapping | str | os.PathLike, source: str | None = None) -> dict:
    """An input dict from a results JSON of any of the three kinds (compare, calibration, bench), told apart by its
    keys; an input dict (one with `rows` or `temperatures`) is returned as it is."""
    data, path = _read_json(data_or_path)
    if "results" in data and "methods" in data:
        return metrics_from_compare(data, source=source or path)
    if "pooled_before" in data:
        return calibration_from_report(data, source=source or path)
    if data.get("rows") and "policy" in data["rows"][0] and "aggregate_tokens_per_s" in data["rows"][0]:
        return throughput_from_bench(data, source=source or path)
    if "rows" in data or "temperatures" in data:
        return data
    raise ValueError(f"{path or 'the results'}: not a compare, calibration or bench result (keys {sorted(data)[:8]})")


# ============================================================================================ the card

def _config_of(drafter_or_config):
    return getattr(drafter_or_config, "config", drafter_or_config)


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def model_card_data(drafter_or_config, *, license: str | None = None, datasets: Iterable[str] | None = None,
                    tags: Iterable[str] | None = None, base_model: str | None = None) -> ModelCardData:
    """The card's front matter (see the module docstring)."""
    config = _config_of(drafter_or_config)
    base = base_model or config.portable_target_fields()["target_name_or_path"]
    all_tags = list(dict.fromkeys([*CARD_TAGS, *(tags or [])]))
    return ModelCardData(
        license=license, library_name=LIBRARY_NAME, base_model=base or None, pipeline_tag="text-generation",
        tags=all_tags, datasets=list(datasets) if datasets else None,
    )


def _settings_table(drafter_or_config, storage: str | None) -> str:
    config = _config_of(drafter_or_config)
    k = config.block_size
    layout = getattr(config, "block_layout", "dspark")
    slots = (f"anchor slot + {k - 1} mask slots" if layout == "dspark"
             else f"anchor slot + {k} mask slots, DFlash layout")
    head = config.sequential_head
    head_text = "none (the DFlash baseline: drafts independent given the context)" if head == "none" else (
        f"{head.replace('_', ' ')}, rank {config.markov_rank}")
    candidates = (f"top-{config.draft_candidates} base candidates per slot (`draft_candidates`)"
                  if config.draft_candidates else "the full draft vocabulary")
    vocab = (f"{config.draft_vocab_size:,} of the target's {config.vocab_size:,} ids (`draft_vocab_size`, "
             "the `d2t` map)"
             if config.draft_vocab_size else f"the target's full vocabulary ({config.vocab_size:,})")
    if config.confidence_head:
        with_markov = getattr(config, "confidence_head_with_markov", True) and head != "none"
        reads = "h_k and W1[x_{k-1}]" if with_markov else "h_k"
        confidence = f"yes (reads {reads}), prefix-survival estimates used by scheduled verification"
    else:
        confidence = "no"
    temps = (", ".join(f"{t:.2f}" for t in config.sts_temperatures) if config.sts_temperatures
             else "not calibrated (`dspark-hf calibrate` fits them)")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_text = f"{rope.get('rope_type', 'default')}, theta {float(config.rope_theta):g}"
    rows = [
        ("block size", f"{k} drafts per forward ({slots}); {k + 1} tokens verified per round"),
        ("draft layers", f"{config.num_hidden_layers} (hidden {config.hidden_size}, {config.num_attention_heads} "
                         f"heads / {config.num_key_value_heads} KV heads, head dim {config.head_dim}, "
                         f"MLP {config.intermediate_size})"),
        ("context features", f"target layers {list(config.target_layer_ids)}"),
        ("sequential head", head_text),
        ("drafting", candidates),
        ("draft vocabulary", vocab),
        ("confidence head", confidence),
        ("STS temperatures", temps),
        ("RoPE", rope_text),
        ("embedding / LM head", "the target's, bound at run time (not stored)"),
    ]
    if hasattr(drafter_or_config, "parameters"):
        count = sum(p.numel() for p in drafter_or_config.parameters())
        rows.append(("parameters", f"{count / 1e6:.1f}M (the drafter's own; none of the target's)"))
    if storage:
        rows.append(("storage", storage))
    return "| setting | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def _target_table(config) -> str:
    ref = config.portable_target_fields()
    name = ref["target_name_or_path"]
    rows = [("model", f"[{name}](https://huggingface.co/{name})" if name else
             "a local model (not recorded: it has no Hub id)")]
    if ref["target_revision"]:
        rows.append(("revision", f"`{ref['target_revision']}`"))
    if ref["target_aliases"]:
        rows.append(("also loads as", ", ".join(f"`{a}`" for a in ref["target_aliases"])
                     + " (registry name of `dspark_hf.testbed.targets`: fetched offline from PyPI)"))
    fingerprint = [f"{config.target_model_type}" if config.target_model_type else None,
                   f"{config.target_num_hidden_layers} layers" if config.target_num_hidden_layers else None,
                   f"hidden {config.target_hidden_size}" if config.target_hidden_size else None,
                   f"vocab {config.target_vocab_size:,}" if config.target_vocab_size else None]
    rows.append(("fingerprint (checked on binding)", ", ".join(f for f in fingerprint if f)))
    return "| target | |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def _usage(config, ref_expr: str, setup: str | None, remote_code: bool = True) -> str:
    lines = ["```python", "import torch", "import dspark_hf"]
    if setup:
        lines.append(setup.rstrip())
    lines += [
        "",
        f"target, tokenizer, drafter = dspark_hf.load_pair({ref_expr})  # + dtype=, device_map= for the target",
        "",
        'messages = [{"role": "user", "content": "Explain recursion in one paragraph."}]',
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",",
        "                                       return_dict=True).to(target.device)",
        "# batch size 1: transformers' assisted generation, the drafter as the assistant (lossless)",
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128, do_sample=False)",
        "print(tokenizer.decode(out[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
        "",
        "# any batch size: confidence-scheduled speculative decoding (left padding), lossless too",
        "batch = tokenizer([\"def fibonacci(n):\", \"The capital of France is\"], return_tensors=\"pt\", padding=True,",
        "                  padding_side=\"left\").to(target.device)",
        "out = dspark_hf.generate(target, drafter, **batch, max_new_tokens=128, policy=\"scheduled\")",
        "```",
        "",
        "`load_pair` loads the target this drafter records (above), from the Hub or, offline, from the local Hugging "
        "Face cache; pass `target=` to use a target you have loaded (its fingerprint must fit).",
    ]
    if not remote_code:
        lines += ["", "This folder carries no remote code: it loads through dspark_hf "
                      "(`DSparkDrafter.from_pretrained`, `load_pair`)."]
        return "\n".join(lines)
    target = config.portable_target_fields()["target_name_or_path"] or "path/to/the-target"
    lines += [
        "",
        "With transformers alone (no dspark_hf installed), through the code this drafter carries "
        "(`trust_remote_code=True` runs it: read it first):",
        "",
        "```python",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        "",
        f"target = AutoModelForCausalLM.from_pretrained({json.dumps(target)})",
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(target)})",
        "# batch size 1: transformers' assisted generation with the drafter as the assistant",
        f"drafter = AutoModel.from_pretrained({ref_expr}, trust_remote_code=True).to(target.device, target.dtype)",
        "inputs = tokenizer(\"The capital of France is\", return_tensors=\"pt\").to(target.device)",
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128, do_sample=False)",
        "# any batch size: the batched loop, as this repo's custom_generate/generate.py (loads the drafter itself)",
        "batch = tokenizer([\"def fibonacci(n):\", \"The capital of France is\"], return_tensors=\"pt\", padding=True,",
        "                  padding_side=\"left\").to(target.device)",
        f"out = target.generate(**batch, custom_generate={ref_expr}, trust_remote_code=True, max_new_tokens=128)",
        "```",
    ]
    return "\n".join(lines)


def _metrics_section(metrics: Mapping) -> str:
    rows = list(metrics.get("rows") or [])
    if not rows:
        return ""
    method, baseline = metrics.get("method") or "this drafter", metrics.get("baseline")
    has = {key: any(r.get(key) is not None and r.get(key) != [] for r in rows)
           for key in ("tau", "baseline_tau", "acceptance", "speedup", "identical", "reference_tau",
                       "reference_speedup")}
    reference = metrics.get("reference") or "reference"
    head = ["data set", f"tau ({method})"]
    if has["baseline_tau"]:
        note = metrics.get("baseline_setting", "same budget")
        head.append(f"tau ({baseline}, {note})" if note else f"tau ({baseline})")
    if has["acceptance"]:
        head.append(f"P(accept k \\| < k rejected), k = 1..3 ({method})")
    if has["speedup"]:
        head.append("batch-1 speedup")
    if has["reference_tau"] or has["reference_speedup"]:
        head.append(f"{reference}: tau, speedup (same run)")
    if has["identical"]:
        head.append("identical to target")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [DATASET_NAMES.get(r.get("dataset"), str(r.get("dataset"))), _fmt(r.get("tau"))]
        if has["baseline_tau"]:
            cells.append(_fmt(r.get("baseline_tau")))
        if has["acceptance"]:
            cells.append(", ".join(_fmt(a) for a in r.get("acceptance") or []))
        if has["speedup"]:
            cells.append(_fmt(r.get("speedup"), suffix="x"))
        if has["reference_tau"] or has["reference_speedup"]:
            cells.append(f"{_fmt(r.get('reference_tau'))}, {_fmt(r.get('reference_speedup'), suffix='x')}")
        if has["identical"]:
            cells.append({True: "yes", False: "**no**"}.get(r.get("identical"), "n/a"))
        lines.append("| " + " | ".join(cells) + " |")
    taus = [r["tau"] for r in rows if r.get("tau") is not None]
    if len(taus) > 1:
        cells = ["macro-average", _fmt(sum(taus) / len(taus))]
        if has["baseline_tau"]:
            base = [r["baseline_tau"] for r in rows if r.get("baseline_tau") is not None]
            ratio = (sum(taus) / len(taus)) / (sum(base) / len(base)) if base else None
            cells.append(f"{_fmt(sum(base) / len(base))} ({method} / {baseline} = {_fmt(ratio, suffix='x')})"
                         if base else "n/a")
        cells += [""] * (len(head) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    intro = "tau: tokens per verification round (accepted drafts + 1)."
    if metrics.get("setting"):
        intro += f" {metrics['setting'][0].upper()}{metrics['setting'][1:]}."
    if metrics.get("source"):
        intro += f" Numbers from `{metrics['source']}`."
    return intro + "\n\n" + "\n".join(lines)


def _calibration_section(calibration: Mapping | None, config) -> str:
    temps = list((calibration or {}).get("temperatures") or config.sts_temperatures or [])
    parts = []
    if temps:
        parts.append("Sequential Temperature Scaling (STS) temperatures, one per block position, stored in "
                     f"`config.json`: {', '.join(f'{t:.2f}' for t in temps)}.")
    else:
        parts.append("Not calibrated: the confidence head's raw sigmoid is used (`dspark-hf calibrate` fits STS).")
    if calibration and (calibration.get("before") or calibration.get("after")):
        before, after = calibration.get("before") or {}, calibration.get("after") or {}
        rounds = calibration.get("eval_rounds")
        parts.append(
            f"Prefix-survival estimate measured on {calibration.get('evaluated_on') or 'held-out prompts'}"
            + (f" ({rounds} rounds)" if rounds else "")
            + f": pooled ECE {_fmt(100 * before['ece'] if before.get('ece') is not None else None)}% before / "
            f"{_fmt(100 * after['ece'] if after.get('ece') is not None else None)}% after STS, AUROC "
            f"{_fmt(before.get('auroc'), 3)} / {_fmt(after.get('auroc'), 3)}, Brier {_fmt(before.get('brier'), 3)} / "
            f"{_fmt(after.get('brier'), 3)}"
            + (f" (`{calibration['source']}`)." if calibration.get("source") else "."))
    return "\n\n".join(parts)


def _throughput_section(benches: Sequence[Mapping]) -> str:
    out = []
    for bench in benches:
        rows = bench.get("rows") or []
        if not rows:
            continue
        levels = sorted({r["concurrency"] for r in rows})
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        by = {(r["policy"], r["concurrency"]): r for r in rows}
        lines = ["| policy | " + " | ".join(f"concurrency {c}" for c in levels) + " | identical to target |",
                 "|" + "---|" * (len(levels) + 2)]
        for policy in policies:
            cells = [_fmt(by[(policy, c)]["relative"], suffix="x") if (policy, c) in by else "n/a" for c in levels]
            same = [by[(policy, c)].get("identical") for c in levels if (policy, c) in by]
            lines.append(f"| `{policy}` | " + " | ".join(cells) + " | "
                         + ("yes" if all(s is True for s in same) else "**no**" if False in same else "n/a") + " |")
        label = bench.get("label") or ""
        out.append(f"Aggregate tokens/s relative to plain batched decoding ({label})"
                   + (f", from `{bench['source']}`" if bench.get("source") else "") + ":\n\n" + "\n".join(lines))
    return "\n\n".join(out)


def build_model_card(
    drafter_or_config,
    *,
    repo_id: str | None = None,
    usage_ref: str | None = None,
    usage_setup: str | None = None,
    title: str | None = None,
    summary: str | None = None,
    license: str | None = None,
    datasets: Iterable[str] | None = None,
    tags: Iterable[str] | None = None,
    metrics: Mapping | str | os.PathLike | None = None,
    calibration: Mapping | str | os.PathLike | None = None,
    throughput: Sequence[Mapping | str | os.PathLike] | Mapping | str | os.PathLike | None = None,
    storage: str | None = None,
    sections: Mapping[str, str] | None = None,
    regenerate_with: str | None = None,
    remote_code: bool = True,
) -> ModelCard:
    """The model card of a drafter (or of its config).

    Args:
        repo_id: the drafter's Hub id (the usage code loads it; default `usage_ref`, else a placeholder path).
        usage_ref / usage_setup: a Python expression for `load_pair`'s argument and lines it needs first (the release
            card uses `release_path("...")`).
        title / summary: the heading (default from the target) and an opening paragraph (default: what DSpark is).
        license / datasets / tags: front matter (see `model_card_data`).
        metrics / calibration / throughput: measured numbers, dicts or results JSON paths (module docstring).
        storage: how the weights are stored (e.g. the int8 release format).
        sections: further `{heading: markdown}` sections (training data, limitations, ...), in order, at the end.
        regenerate_with: the command that regenerates this card (said in a comment at its top).
        remote_code: the folder carries the trust_remote_code files and `custom_generate/` (what `save_pretrained`
            writes): the usage shows the transformers-only forms too. False for folders without them (the release).
    """
    from .. import __version__

    config = _config_of(drafter_or_config)
    data = model_card_data(drafter_or_config, license=license, datasets=datasets, tags=tags)
    target = data.base_model or config.portable_target_fields()["target_name_or_path"]
    # results files, raw results dicts (e.g. the report `calibrate` returns) and input dicts alike
    metrics = load_results(metrics) if metrics else None
    calibration = load_results(calibration) if calibration else None
    if throughput is not None and (isinstance(throughput, (str, os.PathLike, Mapping))):
        throughput = [throughput]
    benches = [load_results(b) for b in (throughput or [])]
    ref_expr = usage_ref or json.dumps(repo_id or "path/to/this-drafter")
    title = title or (f"DSpark drafter for {target.split('/')[-1]}" if target else "DSpark drafter")
    summary = summary or (
        f"A [DSpark]({PAPER_URL}) drafter for speculative decoding with "
        + (f"[{target}](https://huggingface.co/{target})" if target else "its target model")
        + f": one parallel forward drafts a block of {config.block_size} tokens from the target's hidden states, "
        + ("a sequential head restores the dependency on the previous draft, "
           if config.sequential_head != "none" else "")
        + ("a confidence head estimates how many drafts will survive verification, " if config.confidence_head else "")
        + "and the target verifies the block. Decoding with it is lossless: greedy output equals the target's own, "
          "sampled output follows the target's distribution.")
    body = [f"<!-- generated by dspark_hf.hub.card (dspark_hf {__version__})"
            + (f"; regenerate with `{regenerate_with}`" if regenerate_with else "") + ", do not edit by hand -->",
            "", f"# {title}", "", summary, "", "## Usage", "", _usage(config, ref_expr, usage_setup, remote_code),
            "", "## Target", "", _target_table(config), "", "## Drafter settings", "",
            _settings_table(drafter_or_config, storage)]
    metrics_text = _metrics_section(metrics) if metrics else ""
    if metrics_text:
        body += ["", "## Evaluation", "", metrics_text]
    body += ["", "## Calibration", "", _calibration_section(calibration, config)]
    throughput_text = _throughput_section(benches)
    if throughput_text:
        body += ["", "## Throughput against concurrency", "", throughput_text]
    for heading, text in (sections or {}).items():
        body += ["", f"## {heading}", "", text.strip()]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body).rstrip() + "\n")


def write_model_card(drafter_or_config, folder: str | os.PathLike, filename: str = "README.md",
                     **options: Any) -> Path:
    """Writes `build_model_card(drafter_or_config, **options)` to `folder/filename` and returns the path. Without a
    `repo_id` / `usage_ref`, the usage code loads `./<folder name>` (a placeholder path for a hidden, i.e. temporary,
    folder such as the trainer's and calibration's staging folders)."""
    folder = Path(folder)
    if not options.get("repo_id") and not options.get("usage_ref"):
        name = folder.resolve().name
        options["usage_ref"] = json.dumps("path/to/this-drafter" if name.startswith(".") else f"./{name}")
    path = folder / filename
    path.write_text(str(build_model_card(drafter_or_config, **options)), encoding="utf-8")
    return path


def _install() -> None:
    from ..models.modeling_dspark import DSparkDrafter

    DSparkDrafter._model_card_writer = staticmethod(write_model_card)


_install()
