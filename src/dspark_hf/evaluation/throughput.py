"""`dspark-hf bench`: throughput against concurrency for every verification policy, side by side in one run.

For each concurrency C (number of requests decoded together) it runs, on the same C prompts:
no speculation (the target's own batched `generate`), and `dspark_hf.generate` with each policy (`fixed`,
`threshold`, `scheduled`, `async`). It reports aggregate tokens/s, mean per-request tokens/s (a request's tokens over
the time until it finished), mean verification length per request and round, and tau, as JSON (with provenance),
a Markdown table and plots (`throughput.png`: tokens/s vs concurrency; `verify_length.png`: the paper's Figure 8
shape — as load rises the scheduler shortens verification by itself).

Drafters: a trained one (`--drafter PATH`), an untrained one (`--drafter untrained`), or `--drafter simulated`: the
untrained drafter's forward runs (so drafting costs what it costs), but its drafts are replaced by the target's own
greedy continuation, each kept with a per-request acceptance rate and reported with that rate as a (perfectly
calibrated) confidence. The simulated drafter exists to exercise the scheduler against a real target before a trained
drafter does; its numbers say so in the output. Greedy decoding only for `simulated`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from transformers.utils import logging

from ..models.drafting import DraftBlock, DSparkContextCache
from ..decoding.batched import generate
from ..decoding.policy_memory import PolicyMemory
from ..models.modeling_dspark import DSparkDrafter
from ..provenance import atomic_write_json, atomic_write_text, provenance
from ..decoding.sps import SPSTable, profile_sps

__all__ = [
    "POLICY_NAMES",
    "TOY_SIZES",
    "BenchRow",
    "SimulatedDrafter",
    "bench",
    "main",
    "plot",
    "run_bench",
    "to_markdown",
]

logger = logging.get_logger(__name__)

POLICY_NAMES = ("none", "fixed", "threshold", "scheduled", "async", "scheduled-ragged", "scheduled-plain-skips",
                "scheduled-warm")
"""`none` is transformers' own batched `generate()`; `scheduled-ragged` is "scheduled" as the paper's Algorithm 1
prices it (B = the sum of per-row lengths, a profiled curve only: `padded_pricing=False, measured_cost=False`), the
reference for what pricing the padded forward and correcting the curve with timed forwards change;
`scheduled-plain-skips` is "scheduled" whose rounds skipped by the idle backoff are plain decoding even with a lookup
(`lookup_rounds=False`), the reference for what lookup-only rounds change; `scheduled-warm` is "scheduled" with a
`PolicyMemory` kept across its runs at one concurrency (`generate(policy_memory=)`), learned first in one untimed call
on the next C prompts of the set, so every timed run starts from what earlier calls learned, as in a server that
decodes a stream of similar batches (`scheduled` starts every call cold)."""
DEFAULT_POLICIES = POLICY_NAMES[:5]


@dataclass
class BenchRow:
    concurrency: int
    policy: str
    seconds: float
    tokens: int
    aggregate_tokens_per_s: float
    per_request_tokens_per_s: float
    mean_verify_length: float
    tau: float
    identical_to_target: bool | None


class _RowCache(DSparkContextCache):
    """Context cache that also tracks which request each batch row is (rows get dropped as they finish)."""

    rows: list[int] | None = None

    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)  # (rows may be dropped before the first draft: `rows` None is the identity)
        self.rows = index.tolist() if self.rows is None else [self.rows[i] for i in index.tolist()]


class SimulatedDrafter(DSparkDrafter):
    """Runs the real drafter forward, then proposes the target's greedy continuation with per-request accuracy.

    Slot k of request r is correct with probability `rates[r]` (independently), so the exact survival of slot k given
    the earlier slots is `rates[r]`: that is the reported confidence. Wrong slots propose the next vocabulary id."""

    def configure(self, continuations: list[list[int]], rates: list[float], seed: int = 0) -> "SimulatedDrafter":
        self._continuations, self._rates = continuations, rates
        self._rng = torch.Generator().manual_seed(seed)
        return self

    def new_cache(self) -> DSparkContextCache:
        cache = _RowCache()
        cache.rows = None
        return cache

    def draft(self, cache, anchor_ids, *, anchor_positions=None, **kwargs) -> DraftBlock:
        real = super().draft(cache, anchor_ids, anchor_positions=anchor_positions, **kwargs)
        if cache.rows is None:
            cache.rows = list(range(len(anchor_ids)))
        k, v = real.tokens.shape[1], self.config.vocab_size
        tokens, conf = [], []
        for i, row in enumerate(cache.rows):
            full, p = self._continuations[row], int(anchor_positions[i])
            cont = (full[p + 1: p + 1 + k] + [0] * k)[:k]
            keep = torch.rand(k, generator=self._rng) < self._rates[row]
            tokens.append([t if ok else (t + 1) % v for t, ok in zip(cont, keep.tolist())])
            conf.append([self._rates[row]] * k)
        tokens_t = torch.tensor(tokens, device=real.tokens.device)
        logits = torch.nn.functional.one_hot(tokens_t, v).float() * 30
        conf_t = torch.tensor(conf, device=real.tokens.device)
        return DraftBlock(tokens=tokens_t, logits=logits, confidences=conf_t, confidence_logits=torch.logit(conf_t))


TOY_SIZES = {  # name -> (vocab, hidden, intermediate, layers, heads, kv heads)
    "toy": (4096, 512, 1408, 8, 8, 4),
    "toy-tiny": (512, 64, 128, 2, 4, 2),  # for tests: seconds, not minutes
}


def _toy_target(seed: int = 0, size: str = "toy"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab, hidden, inter, layers, heads, kv = TOY_SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked next-token distributions, like a trained model's
    model.generation_config.pad_token_id = 0
    return model


def _prompts(target, tokenizer, concurrency: int, seed: int, prompt_set: str | None,
             offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`concurrency` left-padded prompts: random token ids (toy targets; `seed`, `offset` added to it) or the chat
    prompts of `prompt_set` from its `offset`-th item on (cycling)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed + offset)
        lengths = [16 + int(torch.randint(0, 48, (1,), generator=g)) for _ in range(concurrency)]
        rows = [torch.randint(1, target.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    else:
        from .prompt_sets import load_prompt_set

        items = load_prompt_set(prompt_set or "mt_bench")
        rows = []
        for i in range(concurrency):
            messages = items[(offset + i) % len(items)].messages
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids.to(target.device), mask.to(target.device)


def _run_policy(target, drafter, ids, mask, policy, max_new_tokens, sps, threshold, do_sample, seed, lookup=None,
                memory=None):
    """One timed run; returns (seconds, output or None for no speculation). `memory`: the `PolicyMemory` of
    `scheduled-warm`."""
    start = time.perf_counter()
    if policy == "none":
        # Exactly max_new_tokens per row with no EOS handling, as the speculative runs (eos_token_id=[]) do: the
        # stop id is one outside the vocabulary, so no row stops (generate() refills an unset eos_token_id from the
        # model's config). Not `min_new_tokens`: that suppresses EOS in the target's distribution, so a row whose
        # greedy choice is EOS would continue differently and the outputs could not be compared.
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  do_sample=do_sample, eos_token_id=int(target.config.vocab_size))
    else:
        variant = {}
        if policy == "scheduled-ragged":
            policy, variant = "scheduled", dict(padded_pricing=False, measured_cost=False)
        elif policy == "scheduled-plain-skips":
            policy, variant = "scheduled", dict(lookup_rounds=False)
        elif policy == "scheduled-warm":
            if memory is None:
                raise ValueError("scheduled-warm needs the PolicyMemory its runs share")
            policy, variant = "scheduled", dict(policy_memory=memory)
        out = generate(target, drafter, ids, mask, max_new_tokens=max_new_tokens, policy=policy, sps=sps,
                       threshold=threshold, do_sample=do_sample, eos_token_id=[], return_dict_in_generate=True,
                       generator=torch.Generator().manual_seed(seed), lookup=lookup, **variant)
    return time.perf_counter() - start, out


def run_bench(target, drafter, concurrencies: list[int], policies: list[str], max_new_tokens: int, sps: Any,
              threshold: float, tokenizer=None, prompt_set: str | None = None, simulated: bool = False,
              seed: int = 0, do_sample: bool = False, repeats: int = 3, lookup: Any = None) -> list[BenchRow]:
    """Every policy `repeats` times per concurrency, interleaved (policy order rotates each repeat), so that load
    changes on a shared machine hit all policies alike; the median time is reported. `lookup` (an `NgramLookup`)
    adds n-gram lookup drafts to every speculative policy (`dspark_hf.generate(..., lookup=)`). `sps`: one cost curve
    for every concurrency, or a mapping concurrency -> curve."""
    results = []
    policies = ["none"] + [p for p in policies if p != "none"]
    for c in concurrencies:
        table = sps[c] if isinstance(sps, Mapping) else sps
        ids, mask = _prompts(target, tokenizer, c, seed, prompt_set)
        width = ids.shape[1]
        _, base = _run_policy(target, drafter, ids, mask, "none", max_new_tokens, table, threshold, do_sample, seed)
        if simulated:
            g = torch.Generator().manual_seed(seed + c)
            rates = (0.55 + 0.4 * torch.rand(c, generator=g)).tolist()  # requests of different difficulty
            conts = [ids[r, mask[r].bool()].tolist() + base[r, width:].tolist() for r in range(c)]
        times: dict[str, list[float]] = {p: [] for p in policies}
        outs: dict[str, Any] = {}
        memory = None
        if "scheduled-warm" in policies:  # learned in one untimed call on the next C prompts (`POLICY_NAMES`)
            memory = PolicyMemory()
            warm_ids, warm_mask = _prompts(target, tokenizer, c, seed, prompt_set, offset=c)
            if simulated:  # (simulated drafts follow these prompts' continuations: learned on the same prompts)
                drafter.configure(conts, rates, seed)
                warm_ids, warm_mask = ids, mask
            _run_policy(target, drafter, warm_ids, warm_mask, "scheduled-warm", max_new_tokens, table, threshold,
                        do_sample, seed, lookup, memory)
        for rep in range(repeats):
            order = policies[rep % len(policies):] + policies[: rep % len(policies)]
            for policy in order:
                if simulated:
                    drafter.configure(conts, rates, seed)  # same simulated draws for every policy and repeat
                seconds, out = _run_policy(target, drafter, ids, mask, policy, max_new_tokens, table, threshold,
                                           do_sample, seed, lookup, memory)
                times[policy].append(seconds)
                outs[policy] = out
        for policy in policies:
            seconds = statistics.median(times[policy])
            if policy == "none":
                tokens = c * max_new_tokens
                row = BenchRow(c, "none", seconds, tokens, tokens / seconds, max_new_tokens / seconds, 0.0, 1.0, None)
            else:
                out = outs[policy]
                tokens = int(out.num_generated.sum())
                scale = seconds / max(s.seconds for s in out.stats)  # per-row finish times of the last run, rescaled
                per_req = statistics.mean(int(n) / max(s.seconds * scale, 1e-9)
                                          for n, s in zip(out.num_generated, out.stats))
                verify = statistics.mean(l for s in out.stats for l in s.verify_lengths)
                tau = statistics.mean(a for s in out.stats for a in s.accepted_lengths)
                identical = None if do_sample else bool(torch.equal(out.sequences[:, width:], base[:, width:]))
                row = BenchRow(c, policy, seconds, tokens, tokens / seconds, per_req, verify, tau, identical)
            results.append(row)
            logger.info(f"C={c:<4} {policy:<10} {row.aggregate_tokens_per_s:8.1f} tok/s  verify "
                        f"{row.mean_verify_length:5.2f}  tau {row.tau:5.2f}  identical={row.identical_to_target}  "
                        f"(median of {repeats}: {', '.join(f'{t:.2f}s' for t in times[policy])})")
    return results


def to_markdown(rows: list[BenchRow], prov: dict, label: str) -> str:
    lines = [f"# Throughput vs concurrency — {label}", "",
             f"Device: {prov['device']}; torch {prov['torch']}; transformers {prov['transformers']}; commit "
             f"`{prov['git_commit']}`.", "",
             "| concurrency | policy | aggregate tok/s | vs none | vs max(none, fixed) | per-request tok/s | "
             "mean verify length | tau | identical to target |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r.concurrency: r.aggregate_tokens_per_s for r in rows if r.policy == "none"}
    best = {c: max(r.aggregate_tokens_per_s for r in rows if r.concurrency == c and r.policy in ("none", "fixed"))
            for c in base}
    for r in rows:
        ident = "" if r.identical_to_target is None else ("yes" if r.identical_to_target else "NO")
        vs_best = "" if r.policy in ("none", "fixed") else f"{r.aggregate_tokens_per_s / best[r.concurrency]:.2f}x"
        lines.append(f"| {r.concurrency} | {r.policy} | {r.aggregate_tokens_per_s:.1f} | "
                     f"{r.aggregate_tokens_per_s / base[r.concurrency]:.2f}x | {vs_best} | "
                     f"{r.per_request_tokens_per_s:.1f} | {r.mean_verify_length:.2f} | {r.tau:.2f} | {ident} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[BenchRow], out: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, ylabel, name in (("aggregate_tokens_per_s", "aggregate tokens / s", "throughput.png"),
                                 ("mean_verify_length", "mean verification length (drafts)", "verify_length.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in POLICY_NAMES:
            pts = [(r.concurrency, getattr(r, metric)) for r in rows if r.policy == policy]
            if pts and not (metric == "mean_verify_length" and policy == "none"):
                ax.plot(*zip(*pts), marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests decoded together)")
        ax.set_ylabel(ylabel)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


def bench(target: str = "toy", drafter: str = "simulated", concurrency: Sequence[int] = (1, 4, 16, 64),
          policies: Sequence[str] = DEFAULT_POLICIES, max_new_tokens: int = 48, block_size: int = 7,
          threshold: float = 0.3, sps: str | Path | None = None, prompt_set: str = "mt_bench", do_sample: bool = False,
          seed: int = 0, repeats: int = 3, out: str | Path = "outputs/bench",
          settings: dict[str, Any] | None = None, lookup: str | None = None, prepack: bool = False,
          draft_head_dtype: str | None = None, gqa_attention: bool = False) -> list[BenchRow]:
    """`dspark-hf bench`: builds the target (`TOY_SIZES` name, registry name or folder) and the drafter
    (`"simulated"`, `"untrained"` or a folder), loads the SPS table `sps` for every concurrency (default: per
    concurrency C a table profiled as C rows of 1 .. block + 1 tokens, the rounds' own layout, saved as
    `<out>/sps-rows<C>.json` and reused from there), runs `run_bench` (with the `NgramLookup` file `lookup`, or the target's shipped table
    for "release"; `prepack`: the target's linears prepacked for every run, no speculation included;
    `gqa_attention`: `use_gqa_attention(target)` for every run (multi-token forwards without `repeat_kv` copies);
    `draft_head_dtype`: `DSparkDrafter.set_draft_head_dtype`) and writes `bench.json` (with provenance and
    `settings`, default these arguments), `bench.md`, `throughput.png` and `verify_length.png` to `out`. Returns the
    rows."""
    simulated = drafter == "simulated"
    if simulated and do_sample:
        raise ValueError("the simulated drafter supports greedy decoding only")
    if settings is None:
        settings = {"target": target, "drafter": drafter, "concurrency": list(concurrency),
                    "policies": list(policies), "max_new_tokens": max_new_tokens, "block_size": block_size,
                    "threshold": threshold, "sps": None if sps is None else str(sps), "prompt_set": prompt_set,
                    "do_sample": do_sample, "seed": seed, "repeats": repeats, "out": str(out)}
    torch.manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if target in TOY_SIZES:
        target_model = _toy_target(seed, target)
    else:
        from ..testbed.targets import load_target

        target_model, tokenizer = load_target(target)
    if prepack:
        from ..models.prepacked import prepack_linears

        prepack_linears(target_model)
    if gqa_attention:
        from ..models.gqa_attention import use_gqa_attention

        use_gqa_attention(target_model)
    table_lookup = None
    if lookup:
        from ..testbed.release import resolve_lookup

        table_lookup = resolve_lookup(lookup, target)
    if drafter in ("simulated", "untrained"):
        cls = SimulatedDrafter if simulated else DSparkDrafter
        drafter_model = cls.from_target(target_model, block_size=block_size, num_hidden_layers=1,
                                        draft_candidates=64).eval()
    else:
        drafter_model = DSparkDrafter.from_pretrained(drafter, target=target_model).eval()
    drafter_model.set_draft_head_dtype(draft_head_dtype)  # None: the target's own head
    width = drafter_model.config.block_size + 1
    if sps:  # the given table, for every concurrency
        table = SPSTable.load(sps, target=target_model, reprofile=True, max_tokens=max(concurrency) * width)
    else:  # per concurrency C, the rounds' own layout: C rows of 1 .. block + 1 tokens (`profile_sps(rows=C)`)
        table = {}
        for c in concurrency:
            path = out / f"sps-rows{c}.json"
            kwargs = dict(max_tokens=c * width, context_lengths=(128,), repeats=2, rows=c)
            saved = SPSTable.load(path, target=target_model, reprofile=True, **kwargs) if path.exists() else None
            if saved is None or saved.rows != c or saved.batch_tokens[-1] < c * width:
                saved = profile_sps(target_model, **kwargs)
                saved.save(path)
            table[c] = saved
    label = f"target={target}, drafter={drafter}, block={drafter_model.config.block_size}, " \
            f"max_new_tokens={max_new_tokens}, {'sampling' if do_sample else 'greedy'}, " \
            f"median of {repeats} interleaved runs" + (f", lookup={lookup}" if lookup else "") \
            + (", prepacked linears" if prepack else "") + (", GQA attention" if gqa_attention else "")
    rows = run_bench(target_model, drafter_model, list(concurrency), list(policies), max_new_tokens, table, threshold,
                     tokenizer, prompt_set, simulated, seed, do_sample, repeats, table_lookup)
    prov = provenance(target_model.device, args=settings)
    atomic_write_json(out / "bench.json", {"provenance": prov, "label": label, "rows": [asdict(r) for r in rows]})
    atomic_write_text(out / "bench.md", to_markdown(rows, prov, label))
    plot(rows, out, label)
    return rows


def main(argv: list[str] | None = None) -> list[BenchRow]:
    """`dspark-hf bench` (its argument parser lives here, the CLI forwards to it)."""
    parser = argparse.ArgumentParser(prog="dspark-hf bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="toy",
                        help="'toy' (random 8-layer Llama), 'toy-tiny', a registry name or a path")
    parser.add_argument("--drafter", default="simulated", help="'simulated', 'untrained' or a drafter folder")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=POLICY_NAMES)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=7, help="block size of simulated/untrained drafters")
    parser.add_argument("--threshold", type=float, default=0.3)
    parser.add_argument("--sps", help="SPS table JSON for every concurrency (default: per concurrency C, profiled as C rows "
                        "of w tokens and saved as <out>/sps-rows<C>.json)")
    parser.add_argument("--prompt-set", default="mt_bench", help="prompt set for real targets")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per policy; the median is reported")
    parser.add_argument("--lookup", metavar="FILE|release",
                        help="n-gram lookup drafts for every speculative policy (`dspark-hf lookup`; `release`: the "
                             "target's shipped table)")
    parser.add_argument("--prepack", action="store_true",
                        help="prepacked CPU linears for the target (every run, no speculation included)")
    parser.add_argument("--gqa-attention", action="store_true",
                        help="grouped-query attention without repeat_kv copies for the target's multi-token forwards "
                             "(dspark_hf.use_gqa_attention; every run, no speculation included)")
    parser.add_argument("--draft-head-dtype", choices=["int8", "float16", "bfloat16", "float32"],
                        help="the drafter's LM-head weight dtype (DSparkDrafter.set_draft_head_dtype; default: the "
                             "target's head)")
    parser.add_argument("--out", default="outputs/bench")
    args = parser.parse_args(argv)
    if args.drafter == "simulated" and args.do_sample:
        parser.error("--drafter simulated supports greedy decoding only")
    rows = bench(settings=vars(args), **vars(args))
    print(f"wrote {Path(args.out)}/bench.json, bench.md, throughput.png, verify_length.png")
    return rows


if __name__ == "__main__":  # `python -m dspark_hf.evaluation.throughput`: the same as `dspark-hf ...`
    from dspark_hf.logging_utils import configure_logging
    from dspark_hf.evaluation.throughput import main as _main  # the imported module: its logger is dspark_hf.*

    configure_logging()
    _main()
