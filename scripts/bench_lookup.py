"""Batch 1, greedy, side by side in one run: target-only vs transformers' prompt lookup vs the DSpark drafter vs
n-gram lookup drafts (alone and with the drafter), with and without prepacked CPU linears (issue 14).

    python scripts/bench_lookup.py --out results/lookup_smollm2 [--sets humaneval mt_bench ...] [--prompts 2]

Every method runs on the same prompts, one prompt at a time, in a fixed order right after the baseline (target-only
on the unmodified target), so ratios are taken under the same machine state. Outputs are checked token for token
against that baseline. `tau` is new tokens per target forward (prefill included, as in `dspark-hf compare`).
The lookup table is built from the committed data (`dspark-hf lookup`) when `--lookup` does not exist yet; the
batch-1 cost curve (SPS) is profiled in the run, on the prepacked target, and printed.

Methods (`packed` = `dspark_hf.prepack_linears` applied to a copy of the target):
  target-only         the target's own greedy decoding (the baseline of every ratio)
  target-only/packed  the same on the packed copy
  prompt-lookup       transformers' prompt lookup (prompt_lookup_num_tokens=10), unpacked / packed
  (the dspark methods run `--drafter`, by default the target's release drafter)
  dspark[LABEL]       `--compare-drafter LABEL=FOLDER`: a second drafter, whole block every round, packed
  dspark              the drafter, whole block every round (as `generate(assistant_model=drafter)`), packed
  dspark+sps          the drafter, Algorithm 1 on its confidences and the measured cost curve (none verified when
                      nothing pays; after rounds that verified nothing the drafter skips a few rounds), packed
  dspark/realized     `dspark` with the realized gate (`set_assist(realized_gate=True)`: the drafter runs while its
                      rounds emit tokens at least as fast as plain steps, both timed in the call), packed
  dspark+sps/no-backoff, dspark+sps/realized
                      `dspark+sps` without the backoff, and without it but with the realized gate instead, packed
  lookup              n-gram lookup drafts only (`assistant_model=LookupAssistant(lookup, target, sps=...)`), packed
  lookup+dspark       lookup drafts first, the drafter where they do not pay, packed
  lookup/uncalibrated `lookup` without the online correction of its estimates (`online_calibration=False`), packed
  lookup/all-packed   `lookup` on a copy packed with `one_row_plain=False` (single-token forwards use the packed
                      kernel too, as before that option existed) and its own cost curve: the A/B of that option
  target-only/auto-rows, lookup/auto-rows
                      the same on a copy packed with `plain_rows="auto"` (PyTorch's own linear path up to the row
                      count where this CPU's packed kernel starts winning, measured on the whole model) and its own
                      cost curve: the A/B of that option against `target-only/packed` / `lookup`
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.evaluation.side_by_side import assisted_runner, greedy_runner
from dspark_hf.models.lookup import NgramLookup
from dspark_hf.models.prepacked import PrepackedLinear, prepack_linears
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance
from dspark_hf.testbed.release import load_release_drafter
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids

ALL_METHODS = ["target-only/packed", "prompt-lookup", "prompt-lookup/packed", "dspark", "dspark+sps", "dspark/realized",
               "dspark+sps/no-backoff", "dspark+sps/realized", "lookup",
               "lookup+dspark", "lookup/all-packed", "lookup/uncalibrated", "target-only/auto-rows", "lookup/auto-rows"]
DRAFTER_METHODS = ("dspark", "dspark+sps", "dspark/realized", "dspark+sps/no-backoff", "dspark+sps/realized",
                   "lookup+dspark")
DEFAULT_DATA = {"smollm2-135m-instruct": "data/smollm2-135m-12k,data/smollm2-135m",
                "qwen2.5-coder-0.5b-instruct": "data/qwen2.5-coder-0.5b"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", help="data for the lookup table (default: the target's committed data)")
    p.add_argument("--lookup", help="lookup table, built from --data when missing (default: "
                                    "outputs/lookup/<target>.safetensors)")
    p.add_argument("--sets", nargs="+", default=["humaneval", "mt_bench", "math500", "aime", "gsm_symbolic"])
    p.add_argument("--prompts", type=int, default=2, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", nargs="+", default=ALL_METHODS, choices=ALL_METHODS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drafter", help="drafter folder for the dspark methods (default: the target's release drafter)")
    p.add_argument("--compare-drafter", metavar="LABEL=FOLDER",
                   help="a second drafter, run whole-block as method dspark[LABEL] next to --drafter's methods (e.g. "
                        "the drafter a fine-tune started from)")
    p.add_argument("--gqa-attention", action="store_true",
                   help="run the packed copy with dspark_hf.use_gqa_attention (every packed method, target-only/packed "
                        "included)")
    p.add_argument("--draft-head-dtype", default="int8")
    p.add_argument("--out", default="results/lookup_smollm2")
    p.add_argument("--replot", action="store_true", help="only re-render results.md / speedup.png from results.json")
    args = p.parse_args()
    if args.replot:
        print(write_report(json.loads((Path(args.out) / "results.json").read_text()), Path(args.out)))
        return
    if args.compare_drafter and "=" not in args.compare_drafter:
        p.error(f"--compare-drafter wants LABEL=FOLDER, got {args.compare_drafter!r}")
    args.data = args.data or DEFAULT_DATA.get(args.target)
    args.lookup = args.lookup or f"outputs/lookup/{Path(args.target).name}.safetensors"
    torch.set_num_threads(args.threads)

    target, tok = load_target(args.target)
    packed = copy.deepcopy(target)
    swapped = prepack_linears(packed)
    if args.gqa_attention:
        dspark_hf.use_gqa_attention(packed)
    methods = [m for m in ALL_METHODS if m in args.methods]
    drafter = None
    if any(m in DRAFTER_METHODS for m in methods):
        if args.drafter:
            drafter = dspark_hf.DSparkDrafter.from_pretrained(args.drafter, target=packed)
        else:
            drafter = load_release_drafter(args.target, packed)  # (raises for a target without a release drafter)
        drafter.set_draft_head_dtype(args.draft_head_dtype)
    other = None
    if args.compare_drafter:
        label, folder = args.compare_drafter.split("=", 1)
        other = dspark_hf.DSparkDrafter.from_pretrained(folder, target=packed)
        other.set_draft_head_dtype(args.draft_head_dtype)
        methods.insert(methods.index("dspark") if "dspark" in methods else 0, f"dspark[{label}]")
    lookup_path = Path(args.lookup)
    if not lookup_path.is_file():
        if not args.data:
            p.error(f"--data is needed to build {lookup_path} for {args.target}")
        NgramLookup.from_data(args.data).save(lookup_path)
    lookup = NgramLookup.load(lookup_path)
    sps = dspark_hf.profile_batch1_sps(packed, repeats=5)
    widths = [1, 2, 3, 4, 6, 8, 12, 17]
    curve = {b: float(1.0 / sps.steps_per_second(b)) for b in widths}
    print("batch-1 cost curve, packed target (ms per forward of B new tokens): "
          + ", ".join(f"{b}: {1000 * s:.1f} ({s / curve[1]:.2f}x)" for b, s in curve.items()), flush=True)

    allpacked, sps_all = None, None
    if "lookup/all-packed" in methods:
        allpacked = copy.deepcopy(target)
        prepack_linears(allpacked, one_row_plain=False)
        sps_all = dspark_hf.profile_batch1_sps(allpacked, repeats=5)
        print("batch-1 cost curve, all-packed target (ms): " + ", ".join(
            f"{b}: {1000 / float(sps_all.steps_per_second(b)):.1f}" for b in widths), flush=True)

    autorows, sps_auto = None, None
    if any(m.endswith("/auto-rows") for m in methods):
        autorows = copy.deepcopy(target)
        prepack_linears(autorows, plain_rows="auto")
        rows = next(m.plain_rows for m in autorows.modules() if isinstance(m, PrepackedLinear))
        sps_auto = dspark_hf.profile_batch1_sps(autorows, repeats=5)
        print(f"plain_rows='auto' measured {rows} on this CPU; batch-1 cost curve of that copy (ms): " + ", ".join(
            f"{b}: {1000 / float(sps_auto.steps_per_second(b)):.1f}" for b in widths), flush=True)

    n = args.max_new_tokens

    def gen(model, **kw):
        return greedy_runner(model, n, **kw)

    def assisted(**options):
        return assisted_runner(packed, n, drafter, **options)

    runners = {
        "target-only/packed": gen(packed),
        "prompt-lookup": gen(target, prompt_lookup_num_tokens=10),
        "prompt-lookup/packed": gen(packed, prompt_lookup_num_tokens=10),
        "dspark": assisted(),
        "dspark+sps": assisted(sps=sps),
        "dspark/realized": assisted(realized_gate=True),
        "dspark+sps/no-backoff": assisted(sps=sps, drafter_backoff=False),
        "dspark+sps/realized": assisted(sps=sps, realized_gate=True, drafter_backoff=False),
        "lookup": gen(packed, assistant_model=dspark_hf.LookupAssistant(lookup, packed, sps=sps)),
        "lookup+dspark": assisted(lookup=lookup, sps=sps),
    }
    if other is not None:
        runners[f"dspark[{label}]"] = assisted_runner(packed, n, other)
    uncalibrated = dspark_hf.LookupAssistant(lookup, packed, sps=sps)
    uncalibrated.options.online_calibration = False
    runners["lookup/uncalibrated"] = gen(packed, assistant_model=uncalibrated)
    if allpacked is not None:
        runners["lookup/all-packed"] = gen(allpacked, assistant_model=dspark_hf.LookupAssistant(lookup, allpacked,
                                                                                                  sps=sps_all))
    if autorows is not None:
        runners["target-only/auto-rows"] = gen(autorows)
        runners["lookup/auto-rows"] = gen(autorows, assistant_model=dspark_hf.LookupAssistant(lookup, autorows,
                                                                                              sps=sps_auto))
    counts = {"target": [0], "packed": [0]}
    hooks = [target.register_forward_pre_hook(lambda *_: counts["target"].__setitem__(0, counts["target"][0] + 1)),
             packed.register_forward_pre_hook(lambda *_: counts["packed"].__setitem__(0, counts["packed"][0] + 1))]
    for extra in (allpacked, autorows):  # (their forwards count with the packed copy's)
        if extra is not None:
            hooks.append(extra.register_forward_pre_hook(
                lambda *_: counts["packed"].__setitem__(0, counts["packed"][0] + 1)))

    def timed(run, x):
        before = counts["target"][0] + counts["packed"][0]
        start = time.perf_counter()
        out = run(x)
        seconds = time.perf_counter() - start
        return out, seconds, counts["target"][0] + counts["packed"][0] - before

    rows = []
    first = True
    for name in args.sets:
        items = load_prompt_set(name, limit=args.prompts)
        prompts = [torch.tensor([chat_prompt_ids(tok, it.messages)]) for it in items]
        stats = {m: {"seconds": 0.0, "tokens": 0, "forwards": 0, "identical": 0} for m in ["target-only"] + methods}
        for x in prompts:
            if first:  # warm every path once, untimed
                for run in [gen(target)] + [runners[m] for m in methods]:
                    run(x)
                first = False
            base, seconds, forwards = timed(gen(target), x)
            s = stats["target-only"]
            s["seconds"] += seconds; s["tokens"] += base.shape[1] - x.shape[1]; s["forwards"] += forwards  # noqa: E702
            s["identical"] += 1
            for m in methods:
                out, seconds, forwards = timed(runners[m], x)
                s = stats[m]
                s["seconds"] += seconds
                s["tokens"] += out.shape[1] - x.shape[1]
                s["forwards"] += forwards
                s["identical"] += int(torch.equal(out, base))
        base_rate = stats["target-only"]["tokens"] / stats["target-only"]["seconds"]
        for m, s in stats.items():
            rate = s["tokens"] / s["seconds"]
            rows.append({"set": name, "method": m, "prompts": len(prompts), "tokens_per_s": rate,
                         "speedup": rate / base_rate, "tau": s["tokens"] / max(1, s["forwards"]),
                         "identical": f"{s['identical']}/{len(prompts)}"})
        print(" | ".join(f"{r['method']}: {r['speedup']:.2f}x tau {r['tau']:.2f} ({r['identical']})"
                         for r in rows if r["set"] == name), flush=True)
    for h in hooks:
        h.remove()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(threads=args.threads, prepacked_linears=swapped, gqa_attention=args.gqa_attention,
                      drafter=args.drafter or ("release" if drafter is not None else None),
                      compare_drafter=args.compare_drafter, lookup=str(lookup_path),
                      lookup_ngrams=len(lookup), lookup_meta=lookup.meta)
    data = {"provenance": prov, "settings": vars(args), "cost_curve_s": curve, "rows": rows}
    atomic_write_json(out / "results.json", data)
    print(write_report(data, out))


def write_report(data: dict, out: Path) -> str:
    """`results.md` and `speedup.png` under `out` from the run's JSON (`--replot` re-renders them alone)."""
    rows, settings, prov, curve = data["rows"], data["settings"], data["provenance"], data["cost_curve_s"]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    geo = {m: statistics.geometric_mean([r["speedup"] for r in rows if r["method"] == m]) for m in methods}
    macro_tau = {m: statistics.mean([r["tau"] for r in rows if r["method"] == m]) for m in methods}
    meta = prov.get("lookup_meta", {})
    base = curve[min(curve, key=lambda b: int(b))]
    lines = ["# Batch 1, greedy: target-only vs prompt lookup vs DSpark vs n-gram lookup drafts (issue 14)", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`. Target {settings['target']}, {settings['prompts']} prompts per set, "
             f"{settings['max_new_tokens']} new tokens. Lookup table `{prov.get('lookup')}`: "
             f"{prov.get('lookup_ngrams', 0):,} n-grams from {meta.get('sequences')} examples "
             f"({meta.get('answer_tokens')} answer tokens). Packed: {prov.get('prepacked_linears')} linears"
             + (", with GQA attention without repeat_kv copies" if prov.get("gqa_attention") else "") + "."
             + (f" Drafter: `{prov['drafter']}`." if prov.get("drafter") else "")
             + (f" Compared drafter (`dspark[...]`, whole block): `{prov['compare_drafter']}`."
                if prov.get("compare_drafter") else ""), "",
             "Batch-1 cost curve of the packed target, profiled in the run (seconds per forward of B new tokens, "
             "relative to B = 1): " + ", ".join(f"B={b}: {s / base:.2f}x" for b, s in curve.items()) + ".", "",
             "| method | " + " | ".join(sets) + " | geo-mean speedup | macro tau |",
             "|---" * (len(sets) + 3) + "|"]
    for m in methods:
        cells = []
        for name in sets:
            r = next(r for r in rows if r["method"] == m and r["set"] == name)
            same, total = r["identical"].split("/")
            note = "" if same == total else f" ({same}/{total} same)"
            cells.append(f"{r['speedup']:.2f}x, tau {r['tau']:.2f}{note}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {geo[m]:.2f}x | {macro_tau[m]:.2f} |")
    lines += ["", "Speedup: tokens/s over target-only (the unpacked target) on the same prompts in this run, each "
              "method right after it; tau: new tokens per target forward (prefill included). Every output equals "
              "target-only's token for token unless a cell says otherwise.", "", "![speedup](speedup.png)"]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "results.md", text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return text
    shown = [m for m in methods if m != "target-only"]
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, m in enumerate(shown):
        vals = [next(r["speedup"] for r in rows if r["method"] == m and r["set"] == name) for name in sets]
        ax.bar([j + i * width for j in range(len(sets))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(sets))], sets)
    same = all(r["identical"].split("/")[0] == r["identical"].split("/")[1] for r in rows)
    ax.set(ylabel="batch-1 speedup vs target-only",
           title=f"{settings['target']}, greedy, " + ("identical outputs" if same else "NOT all outputs identical"))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    return text


if __name__ == "__main__":
    main()
