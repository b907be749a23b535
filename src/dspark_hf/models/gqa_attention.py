"""Grouped-query attention without `repeat_kv` copies for multi-token forwards: verification rounds on a CPU.

transformers' SDPA attention (`integrations/sdpa_attention.py`) runs a one-token query of a grouped-query model
(SmolLM2, Qwen2.5, Llama 3: fewer key/value heads than query heads) on the key/value heads directly, but for a query
of several tokens with an attention mask on a CPU it first copies every key and value head `num_key_value_groups`
times (`repeat_kv`: the whole cache, per layer, per forward). A speculative verification forward is exactly that: a
few tokens per row over a long cache, with a mask. On a 2-core Xeon with SmolLM2-135M-Instruct at 64 rows over a
~200-token cache, those copies took 0.4 s of a 0.7 s forward of 2 tokens per row and 0.7 s of a 1.35 s forward of
3 tokens per row, against 0.33 s for one token per row (`python scripts/bench_gqa_attention.py`); so under load,
verifying even one draft per row cost more than it could return.

`use_gqa_attention(model)` switches such a model to the attention implementation `"sdpa_gqa"` registered here
(transformers' `AttentionInterface`, with SDPA's own mask format): the same `torch.nn.functional.
scaled_dot_product_attention`, called with `enable_gqa=True` instead of on repeated copies, so the result is the same
attention up to float rounding (a different kernel; the benchmarks check outputs token for token against
target-only decoding on the same model). One-token queries, models without grouped heads, position biases and
non-CPU tensors go through transformers' own SDPA function unchanged (on a GPU, SDPA with a mask and `enable_gqa`
falls back to its slowest kernel). A runtime option like `prepack_linears`: nothing is saved, `restore_attention`
switches back, and the 4-D tree attention masks of tree drafts work the same (`decoding.tree_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GQA_ATTENTION", "gqa_sdpa_attention_forward", "restore_attention", "use_gqa_attention"]

GQA_ATTENTION = "sdpa_gqa"
"""The attention implementation name `use_gqa_attention` sets (registered with transformers on import)."""


def gqa_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped key/value heads handed to SDPA as they are (`enable_gqa=True`) for
    multi-token queries on a CPU. Same signature and output (`[B, Q, H, D]`, None) as `sdpa_attention_forward`."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    if (groups <= 1 or q_length == 1 or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)
            or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_length:  # (as transformers: an empty static cache's prefill)
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)


def _implementation(model: PreTrainedModel) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def use_gqa_attention(model: PreTrainedModel) -> bool:
    """Switches `model` (loaded with `attn_implementation="sdpa"`, transformers' default) to `"sdpa_gqa"`, in place.
    Returns whether it changed anything: False when it already runs `"sdpa_gqa"`. `ValueError` naming the model and
    its attention for any other implementation (eager, flash, flex: they have their own kernels)."""
    impl = _implementation(model)
    if impl == GQA_ATTENTION:
        return False
    if impl != "sdpa":
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise ValueError(f"use_gqa_attention needs a model running attn_implementation='sdpa'; {name} runs {impl!r}")
    model.set_attn_implementation(GQA_ATTENTION)
    return True


def restore_attention(model: PreTrainedModel) -> bool:
    """Undoes `use_gqa_attention` (back to `"sdpa"`); returns whether anything changed."""
    if _implementation(model) != GQA_ATTENTION:
        return False
    model.set_attn_implementation("sdpa")
    return True
