"""Per-round cost of DSpark decoding outside the target's forward, on the real SmolLM2-135M target.

    python scripts/bench_round_overhead.py batch1 --prompts 3 --max-new-tokens 48 --repeats 1 \
        --drafters release random --head fp32 --label after
    python scripts/bench_round_overhead.py batch1 --prompts 2 --max-new-tokens 48 --repeats 2 --drafters release \
        --head fp32 fp16 int8 --threads 1 --label head_dtypes
    python scripts/bench_round_overhead.py batched --concurrency 1 4 16 64 --max-new-tokens 32 \
        --max-new-tokens-64 16 --repeats 3 --methods ours skip --max-prompt-len 24 --label after

`batch1`: `target.generate(ids, assistant_model=drafter, do_sample=False)` with the release drafter (and a random-init
drafter of the same shape), instrumented with `time.perf_counter()` around every part of a round (CPU: every op is
synchronous, so wall time per call is the part's cost):

* `verify forward`: the target's forward over anchor + K drafts (a forward hook on the target);
* `draft()`, split into `backbone` (the drafter's parallel forward), `LM head` (`draft_logits`: base logits of the K
  slots), `candidates` (`prepare_candidates`: top-M + W2 rows), `sequential loop` (`sample_block` less the
  confidence head), `confidence head` and `draft: rest` (masks, embeddings);
* `context update`: `append_context` of the verified rows (projection + k/v of the target's hidden states);
* `ours: rest`: the rest of `DSparkCandidateGenerator.get_candidates` (slicing, stop checks, concatenation);
* `transformers loop`: the rest of the round (transformers' `_assisted_decoding` bookkeeping: inputs, argmax, crop,
  kwargs update, stopping criteria).

A round runs from one `get_candidates` call to the next; only rounds that verify a full block (K drafts) count. Each
part's median over rounds is reported as a share of the median verification forward, with `overhead` = the median
of (round - verify forward). `--head fp32 bf16 fp16 int8` interleaves the drafter's LM-head dtypes
(`DSparkDrafter.set_draft_head_dtype`: `None`, bfloat16 copy, fbgemm fp16 weights, fbgemm int8; before that option
existed, `fp16` / `int8` were bench-only patches with the same kernels), each checked for output identical to the
target's own greedy decoding; `mm` / `mm-all` are bench-only patches (`W @ h^T` instead of `h @ W^T` for the LM head /
for every linear layer of the drafter). `--threads 1 2` interleaves torch thread counts.

`batched`: `dspark_hf.generate(..., speculate=False)` (the batched loop with no drafts) against transformers' plain
batched `target.generate(..., do_sample=False)`, same left-padded prompts, greedy, no EOS stop (an id outside the
vocabulary), repeats interleaved A B A B; median per-repeat ratio per concurrency, end to end and decode only (from
the end of the prefill forward, timed by a forward hook, to the end of the call). Also `skip`: the scheduled policy
with a drafter whose confidences are ~0, so the idle backoff skips the drafter almost every round.

Writes `<part>.json` and `<part>.md` under `--out` (with provenance) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import dspark_hf
from dspark_hf import DSparkDrafter
from dspark_hf.models.candidate_generator import DSparkCandidateGenerator
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance

TARGET = "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------- shared
def load(drafter_kind: str, target=None, tokenizer=None):
    from dspark_hf.testbed.release import load_release_drafter
    from dspark_hf.testbed.targets import load_target

    if target is None:
        target, tokenizer = load_target(TARGET)
        target.eval()
    release = load_release_drafter(TARGET, target).eval()
    if drafter_kind == "release":
        return target, tokenizer, release
    torch.manual_seed(0)
    drafter = DSparkDrafter(release.config).to(target.dtype).eval()
    drafter.bind_target(target)
    return target, tokenizer, drafter


def prompts(tokenizer, count: int, max_len: int | None, offset: int = 0) -> list[list[int]]:
    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    items = load_prompt_set("mt_bench")
    rows = []
    for i in range(count):
        text = tokenizer.apply_chat_template(items[(offset + i) % len(items)].messages, tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(ids[-max_len:] if max_len else ids)
    return rows


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- draft-head variants
# The drafter's own option (DSparkDrafter.set_draft_head_dtype), and two bench-only GEMM layouts it does not offer.
HEAD_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
HEADS = [*HEAD_DTYPES, "mm", "mm-all"]


def mm_draft_logits(drafter: DSparkDrafter) -> Callable[[torch.Tensor], torch.Tensor]:
    """`W @ h^T` instead of `h @ W^T` (same fp32 math, another GEMM layout: about 1.5x faster on this CPU at K = 7,
    but slower than the fp16 / int8 heads)."""
    def draft_logits(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = drafter._head_rows(None)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
        out = torch.mm(weight, flat.t()).t()
        if bias is not None:
            out = out + bias
        return out.reshape(*hidden.shape[:-1], weight.shape[0]).float()
    return draft_logits


def _mm_linear(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(module.weight, flat.t()).t()
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], module.weight.shape[0])
    return forward


def _linears(drafter: DSparkDrafter) -> list[torch.nn.Linear]:
    return [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]


def set_head(drafter: DSparkDrafter, head: str) -> None:
    """`fp32` / `bf16` / `fp16` / `int8`: `drafter.set_draft_head_dtype`, with the kernel's rows prepared now (not in
    a timed round). `mm`: the bench-only `W @ h^T` LM head; `mm-all`: that layout for every linear layer too."""
    drafter.__dict__.pop("draft_logits", None)
    for m in _linears(drafter):
        m.__dict__.pop("forward", None)
    drafter.set_draft_head_dtype(HEAD_DTYPES.get(head))
    if HEAD_DTYPES.get(head) is not None:
        drafter.draft_head_kernel()
    if head in ("mm", "mm-all"):
        drafter.draft_logits = mm_draft_logits(drafter)
    if head == "mm-all":  # the LM head and every linear layer of the drafter (backbone, fc, heads)
        for m in _linears(drafter):
            m.forward = _mm_linear(m)


# ---------------------------------------------------------------------------------------------- batch 1
PARTS = ["verify forward", "draft()", "backbone", "LM head", "candidates", "sequential loop", "confidence head",
         "draft: rest", "context update", "ours: rest", "transformers loop", "overhead"]


class RoundTimer:
    """Wraps the drafter's and the candidate generator's methods with timers; one dict of part -> seconds per round."""

    def __init__(self, target, drafter: DSparkDrafter) -> None:
        self.target, self.drafter = target, drafter
        self.rounds: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.round_start = 0.0

    def _add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] = self.current.get(key, 0.0) + seconds

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(key, time.perf_counter() - start)
        return wrapper

    def _close_round(self, now: float) -> None:
        if self.current is not None:
            self.current["round"] = now - self.round_start
            self.rounds.append(self.current)
        self.current = None

    @contextlib.contextmanager
    def installed(self):
        drafter, target = self.drafter, self.target
        saved = {name: drafter.__dict__.get(name) for name in
                 ("draft", "_backbone", "draft_logits", "prepare_candidates", "sample_block", "append_context")}
        for name, key in (("draft", "draft()"), ("_backbone", "backbone"), ("draft_logits", "LM head"),
                          ("prepare_candidates", "candidates"), ("sample_block", "sample_block"),
                          ("append_context", "context update")):
            setattr(drafter, name, self._timed(key, getattr(drafter, name)))
        original = DSparkCandidateGenerator.get_candidates
        timer = self

        def get_candidates(gen, input_ids, *args, **kwargs):
            start = time.perf_counter()
            timer._close_round(start)
            first = kwargs.get("is_first_iteration", False)
            timer.current = None if first else {}
            timer.round_start = start
            out = original(gen, input_ids, *args, **kwargs)
            timer._add("get_candidates", time.perf_counter() - start)
            timer._add("drafts", out[0].shape[1] - input_ids.shape[1])
            return out

        handles = []
        stamp = {}

        def pre(module, args, kwargs):
            stamp["t"] = time.perf_counter()

        def post(module, args, kwargs, output):
            self._add("verify forward", time.perf_counter() - stamp["t"])
            ids = kwargs.get("input_ids")
            self._add("width", 0 if ids is None else ids.shape[1])

        handles.append(target.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(target.register_forward_hook(post, with_kwargs=True))
        conf = drafter.confidence_head
        if conf is not None:
            cstamp = {}
            handles.append(conf.register_forward_pre_hook(lambda m, a: cstamp.__setitem__("t", time.perf_counter())))
            handles.append(conf.register_forward_hook(
                lambda m, a, o: self._add("confidence head", time.perf_counter() - cstamp["t"])))
        DSparkCandidateGenerator.get_candidates = get_candidates
        try:
            yield self
        finally:
            DSparkCandidateGenerator.get_candidates = original
            for h in handles:
                h.remove()
            for name, value in saved.items():
                if value is None:
                    drafter.__dict__.pop(name, None)
                else:
                    setattr(drafter, name, value)

    def end_call(self) -> None:
        """The call's last round has no next get_candidates: drop it (its end is not comparable)."""
        self.current = None

    def parts(self, block_size: int) -> list[dict[str, float]]:
        rows = []
        for r in self.rounds:
            if r.get("drafts") != block_size or r.get("width") != block_size + 1:
                continue
            g = {k: r.get(k, 0.0) for k in ("verify forward", "draft()", "backbone", "LM head", "candidates",
                                           "sample_block", "confidence head", "context update", "get_candidates",
                                           "round")}
            rows.append({
                "verify forward": g["verify forward"],
                "draft()": g["draft()"],
                "backbone": g["backbone"],
                "LM head": g["LM head"],
                "candidates": g["candidates"],
                "sequential loop": g["sample_block"] - g["confidence head"],
                "confidence head": g["confidence head"],
                "draft: rest": g["draft()"] - g["backbone"] - g["LM head"] - g["candidates"] - g["sample_block"],
                "context update": g["context update"],
                "ours: rest": g["get_candidates"] - g["draft()"] - g["context update"],
                "transformers loop": g["round"] - g["get_candidates"] - g["verify forward"],
                "overhead": g["round"] - g["verify forward"],
            })
        return rows


def run_batch1(args) -> dict:
    torch.set_num_threads(args.threads[0])
    target, tokenizer, _ = load("release")
    rows = prompts(tokenizer, args.prompts, args.max_prompt_len)
    vocab = int(target.config.vocab_size)
    configs = [(h, t) for t in args.threads for h in args.head]  # interleaved per repeat
    results = []
    for kind in args.drafters:
        _, _, drafter = load(kind, target, tokenizer)
        k = drafter.config.block_size
        parts_of = {c: [] for c in configs}
        tau = {c: [] for c in configs}
        seconds = {c: [] for c in configs}
        tokens = {c: 0 for c in configs}
        identical = {c: True for c in configs}
        refs = {}
        with torch.no_grad():
            for p in rows:
                refs[tuple(p)] = target.generate(torch.tensor([p]), max_new_tokens=args.max_new_tokens,
                                                 do_sample=False, eos_token_id=vocab)
        for rep in range(args.repeats):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for config in order:
                head, threads = config
                torch.set_num_threads(threads)
                set_head(drafter, head)
                timer = RoundTimer(target, drafter)
                with timer.installed(), torch.no_grad():
                    for p in rows:
                        ids = torch.tensor([p])
                        start = time.perf_counter()
                        out = target.generate(ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                              do_sample=False, eos_token_id=vocab)
                        seconds[config].append(time.perf_counter() - start)
                        tokens[config] += int(out.shape[1] - ids.shape[1])
                        timer.end_call()
                        identical[config] &= bool(torch.equal(out, refs[tuple(p)]))
                        tau[config].append(drafter.last_speculation_stats.mean_accepted_length)
                parts_of[config].extend(timer.parts(k))
        set_head(drafter, "fp32")
        torch.set_num_threads(args.threads[0])
        for config in configs:
            head, threads = config
            parts = parts_of[config]
            verify = median([r["verify forward"] for r in parts])
            entry = {"drafter": kind, "head": head, "threads": threads, "rounds": len(parts),
                     "tau": statistics.mean(tau[config]), "identical_to_target": identical[config],
                     "tokens_per_s": tokens[config] / sum(seconds[config]),
                     "median_ms": {name: 1e3 * median([r[name] for r in parts]) for name in PARTS},
                     "share_of_verify": {name: median([r[name] for r in parts]) / verify for name in PARTS}}
            results.append(entry)
            share = 100 * entry["share_of_verify"]["overhead"]
            print(f"{kind:8s} {head:5s} threads {threads} rounds {len(parts):4d} overhead {share:5.1f}% of verify "
                  f"({entry['median_ms']['verify forward']:.1f} ms)  tau {entry['tau']:.2f}", flush=True)
    return {"part": "batch1", "target": TARGET, "threads": args.threads, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "max_prompt_len": args.max_prompt_len, "repeats": args.repeats,
            "results": results}


def batch1_markdown(data: dict, label: str) -> str:
    res = data["results"]
    head = "| part | " + " | ".join(f"{r['drafter']} / {r['head']} / {r.get('threads', data['threads'])}t"
                                    for r in res) + " |"
    lines = [f"# Per-round cost at batch 1 ({label}): `target.generate(assistant_model=drafter)`, {TARGET}, greedy, "
             f"{data['prompts']} MT-Bench prompts, {data['max_new_tokens']} new tokens, torch threads "
             f"{data['threads']}", "",
             "Median per round over full-block rounds (K drafts, verification forward of K + 1 tokens), in ms and as "
             "a share of the median verification forward. `overhead` = median of (round - verification forward); the "
             "parts' medians need not add up to it.", "",
             head, "|---|" + "---|" * len(res)]
    for name in PARTS:
        cells = []
        for r in res:
            ms, share = r["median_ms"][name], r["share_of_verify"][name]
            cells.append(f"{ms:.1f} ms" if name == "verify forward" else f"{ms:.2f} ms ({100 * share:.1f}%)")
        lines.append(f"| {'**' + name + '**' if name == 'overhead' else name} | " + " | ".join(cells) + " |")
    lines.append("| rounds | " + " | ".join(str(r["rounds"]) for r in res) + " |")
    lines.append("| tau | " + " | ".join(f"{r['tau']:.2f}" for r in res) + " |")
    lines.append("| tokens/s (end to end) | " + " | ".join(f"{r['tokens_per_s']:.2f}" for r in res) + " |")
    lines.append("| identical to target greedy | " + " | ".join("yes" if r["identical_to_target"] else "NO"
                                                                 for r in res) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- batched, drafting off
def low_confidence(drafter: DSparkDrafter, target) -> DSparkDrafter:
    """A copy of `drafter` whose confidences are ~0: the scheduled policy verifies no draft, so the idle backoff skips
    the drafter (2, 4, ... 32 rounds, probing in between)."""
    quiet = DSparkDrafter(drafter.config).to(target.dtype).eval()
    quiet.load_state_dict(drafter.state_dict())
    quiet.bind_target(target)
    with torch.no_grad():
        quiet.confidence_head.proj.bias.fill_(-30.0)
        quiet.confidence_head.proj.weight.zero_()
    return quiet


class PrefillClock:
    """Timestamps the end of the first target forward of each call (the prefill), via a forward hook."""

    def __init__(self, target) -> None:
        self.end: float | None = None
        self.handle = target.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self.end is None:
            self.end = time.perf_counter()

    def reset(self) -> None:
        self.end = None


METHODS = {"ours": "ours (speculate=False)", "skip": "ours (scheduled, backoff skips)"}


def run_batched(args) -> dict:
    torch.set_num_threads(args.threads[0])
    target, tokenizer, drafter = load("release")
    quiet = low_confidence(drafter, target)
    # any cost curve will do for `skip`: with ~0 confidences the policy admits no draft whatever the curve says
    def sps(batch_tokens):
        return 1.0 / (0.05 + 0.01 * batch_tokens.double())

    vocab = int(target.config.vocab_size)
    clock = PrefillClock(target)
    results = []
    for c in args.concurrency:
        ids, mask = left_pad(prompts(tokenizer, c, args.max_prompt_len), int(target.generation_config.pad_token_id))
        n = args.max_new_tokens if c < 64 else args.max_new_tokens_64

        def plain():
            return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                   eos_token_id=vocab)

        def ours():
            return dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=n, speculate=False,
                                      eos_token_id=[])

        def skip():
            return dspark_hf.generate(target, quiet, ids, mask, max_new_tokens=n, policy="scheduled", sps=sps,
                                      eos_token_id=[])

        methods = {"hf plain": plain}
        for m in args.methods:
            methods[METHODS[m]] = {"ours": ours, "skip": skip}[m]
        total: dict[str, list[float]] = {name: [] for name in methods}
        decode: dict[str, list[float]] = {name: [] for name in methods}
        outs = {}
        with torch.no_grad():
            for rep in range(args.repeats):
                names = list(methods)
                names = names[rep % len(names):] + names[: rep % len(names)]
                for name in names:
                    clock.reset()
                    start = time.perf_counter()
                    outs[name] = methods[name]()
                    end = time.perf_counter()
                    total[name].append(end - start)
                    decode[name].append(end - clock.end)
        ref = outs["hf plain"]
        for name in methods:
            pair = [b / a for a, b in zip(total[name], total["hf plain"])]
            pair_decode = [b / a for a, b in zip(decode[name], decode["hf plain"])]
            entry = {"concurrency": c, "method": name, "max_new_tokens": n, "prompt_width": int(ids.shape[1]),
                     "seconds": total[name], "decode_seconds": decode[name], "median_s": median(total[name]),
                     "decode_median_s": median(decode[name]), "ratio_vs_hf": median(pair),
                     "decode_ratio_vs_hf": median(pair_decode), "identical": bool(torch.equal(outs[name], ref))}
            results.append(entry)
            print(f"C={c:<3} {name:32s} {entry['median_s']:7.2f}s (decode {entry['decode_median_s']:6.2f}s)  "
                  f"x{entry['ratio_vs_hf']:.3f}  decode x{entry['decode_ratio_vs_hf']:.3f}  "
                  f"identical={entry['identical']}", flush=True)
    clock.handle.remove()
    return {"part": "batched", "target": TARGET, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
            "max_new_tokens_64": args.max_new_tokens_64, "max_prompt_len": args.max_prompt_len,
            "repeats": args.repeats, "results": results}


def batched_markdown(data: dict, label: str) -> str:
    lines = [f"# Batched loop with drafting off vs transformers' plain batched generate ({label}), {TARGET}, greedy, "
             f"no EOS stop, MT-Bench prompts (last {data['max_prompt_len']} tokens), torch threads {data['threads']}, "
             f"{data['repeats']} interleaved repeats", "",
             "Speed ratio vs `target.generate(do_sample=False)` (> 1 = faster than transformers), median over repeats "
             "of the per-repeat ratio (the methods of a repeat run back to back): end to end, and decode only (from "
             "the end of the prefill forward to the end of the call).", "",
             "| concurrency | method | new tokens | median s | decode median s | ratio | decode ratio | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['max_new_tokens']} | {r['median_s']:.2f} | "
                     f"{r['decode_median_s']:.2f} | {r['ratio_vs_hf']:.3f} | {r['decode_ratio_vs_hf']:.3f} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["batch1", "batched"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="torch.set_num_threads (reported); batch1 interleaves several settings")
    parser.add_argument("--out", default="results/round_overhead")
    parser.add_argument("--label", default="", help="suffix of the output files, e.g. 'before'")
    parser.add_argument("--prompts", type=int, default=3, help="batch1: prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-new-tokens-64", type=int, default=16, help="batched: new tokens at concurrency 64")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="keep the last N prompt tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--drafters", nargs="+", default=["release", "random"], choices=["release", "random"])
    parser.add_argument("--head", nargs="+", default=["fp32"], choices=HEADS,
                        help="batch1: draft LM-head paths, interleaved: fp32 bf16 fp16 int8 = the drafter's "
                             "set_draft_head_dtype; mm, mm-all = bench-only GEMM layouts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--methods", nargs="+", default=["ours", "skip"], choices=sorted(METHODS),
                        help="batched: ours = speculate=False; skip = scheduled policy whose idle backoff skips")
    args = parser.parse_args(argv)
    label = args.label or "current"
    data = run_batch1(args) if args.part == "batch1" else run_batched(args)
    command = ["python", "scripts/bench_round_overhead.py"] + (sys.argv[1:] if argv is None else list(argv))
    data["provenance"] = provenance(threads=args.threads, label=label, command=" ".join(command))
    text = (batch1_markdown if args.part == "batch1" else batched_markdown)(data, label)
    out = Path(args.out)
    suffix = f"_{args.label}" if args.label else ""
    atomic_write_json(out / f"{args.part}{suffix}.json", data)
    atomic_write_text(out / f"{args.part}{suffix}.md", text)
    print(text)
    return data


if __name__ == "__main__":
    main()
