"""`use_gqa_attention`: multi-token forwards of grouped-query targets without `repeat_kv` copies, same outputs.

* it is really used: the multi-token forwards of a switched model call SDPA with `enable_gqa=True` on the key/value
  heads as cached (fewer heads than the query), one-token steps go through transformers' own SDPA function;
* padded, cached multi-token forwards give transformers' SDPA logits (float rounding at most), for both test
  architectures; models without grouped heads are left to transformers' function;
* speculative decoding stays lossless on a switched target: the batched loop (chains and trees, every draft
  accepted or some rejected) and batch 1 through `generate(assistant_model=...)` equal the target's own greedy output;
* the switch is explicit and reversible: a clear error for a model not running SDPA, `restore_attention` goes back.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import dspark_hf
from dspark_hf.decoding.tree_attention import check_tree_attention
from dspark_hf.models import gqa_attention
from dspark_hf.models.gqa_attention import GQA_ATTENTION, restore_attention, use_gqa_attention

from conftest import batch_oracle, generated_rows, greedy_reference, left_pad, make_drafter, make_target, sps_curve

PROMPTS = [[5, 9, 17, 3, 44, 8, 2], [7, 7, 31], [12, 60, 4, 4, 19]]


def _cached_logits(model, ids, mask, width: int = 3) -> torch.Tensor:
    """Prefill all but the last `width` columns, then one `width`-token forward over the cache (padded rows)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-width], attention_mask=mask[:, :-width], cache=cache)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        return model(input_ids=ids[:, -width:], attention_mask=mask, position_ids=positions, cache=cache).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_cached_multi_token_forwards_match_transformers_sdpa_and_skip_repeat_kv(arch, monkeypatch):
    model = make_target(arch)
    ids, mask = left_pad([p + [11, 23, 5] for p in PROMPTS])
    stock = _cached_logits(model, ids, mask)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], query.shape[2], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(gqa_attention.F, "scaled_dot_product_attention", spy)
    assert use_gqa_attention(model) is True
    assert model.config._attn_implementation == GQA_ATTENTION
    switched = _cached_logits(model, ids, mask)
    torch.testing.assert_close(switched, stock, rtol=1e-5, atol=1e-5)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert kv_heads < heads
    layers = model.config.num_hidden_layers
    # prefill and the 3-token forward of every layer: query heads over the cached key/value heads, no copies
    assert calls == [(heads, kv_heads, ids.shape[1] - 3, True)] * layers + [(heads, kv_heads, 3, True)] * layers


def test_one_token_steps_and_ungrouped_models_use_transformers_own_function(monkeypatch):
    model = make_target("llama")
    seen = []
    original = gqa_attention.sdpa_attention_forward

    def stock(module, query, *args, **kwargs):
        seen.append((query.shape[2], getattr(module, "num_key_value_groups", 1)))
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(gqa_attention, "sdpa_attention_forward", stock)
    use_gqa_attention(model)
    ids, mask = left_pad(PROMPTS)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
        assert seen == []  # the multi-token prefill took the enable_gqa path
        model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1), cache=cache)
    assert seen == [(1, 2)] * model.config.num_hidden_layers
    seen.clear()
    # a model whose key/value heads are not grouped: nothing to save, transformers' function every time
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    reference = plain(input_ids=ids, attention_mask=mask).logits
    use_gqa_attention(plain)
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits, reference)
    assert seen == [(ids.shape[1], 1)] * 2


def test_the_switch_is_explicit_reversible_and_refuses_other_kernels():
    model = make_target("llama")
    assert model.config._attn_implementation == "sdpa"
    assert restore_attention(model) is False  # nothing to undo
    assert use_gqa_attention(model) is True and use_gqa_attention(model) is False
    assert restore_attention(model) is True and model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*'eager'"):
        use_gqa_attention(model)
    assert model.config._attn_implementation == "eager"
    assert dspark_hf.use_gqa_attention is use_gqa_attention  # exported at the top level


@pytest.mark.parametrize("correct", [0, 2, 4])
def test_batched_chains_and_trees_on_a_switched_target_equal_the_targets_greedy_output(correct):
    target = make_target("llama", layers=2)
    refs = [greedy_reference(target, p, 20) for p in PROMPTS]  # transformers' own attention
    use_gqa_attention(target)
    oracle = batch_oracle(target, PROMPTS, 20, correct)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, oracle, ids, mask, max_new_tokens=20, policy="fixed", sps=sps_curve,
                             return_dict_in_generate=True)
    assert generated_rows(out, ids.shape[1]) == refs
    assert max(max(s.verify_lengths) for s in out.stats) == 4  # multi-token verification forwards ran
    drafter = make_drafter(target)
    assert check_tree_attention(target) == GQA_ATTENTION  # the probe's tree mask is honoured
    tree = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=20, policy="fixed", tree_budget=4,
                              return_dict_in_generate=True)
    assert generated_rows(tree, ids.shape[1]) == refs


def test_batch_one_assisted_generation_on_a_switched_target_equals_its_greedy_output():
    target = make_target("qwen3", layers=2)
    prompt = PROMPTS[0]
    ref = greedy_reference(target, prompt, 24)
    use_gqa_attention(target)
    drafter = make_drafter(target)
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=24,
                          do_sample=False)
    assert out[0, len(prompt):].tolist() == ref
