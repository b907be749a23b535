"""The drafter's LM-head dtypes (`DSparkDrafter.set_draft_head_dtype`: float32 / bfloat16 / float16 / int8) and the
sparse draft logits (`SparseLogits`): greedy output stays the target's own, the distribution the verifier gets is
exactly the one the drafts were drawn from, and a greedy round never builds the `[B, K, V]` draft logits."""

import pytest
import torch

import dspark_hf
from conftest import greedy_reference, left_pad, make_drafter, make_target
from dspark_hf import DraftBlock
from dspark_hf.models.draft_head import DraftHead, parse_draft_head_dtype
from dspark_hf.models.drafting import SparseLogits

PROMPTS = [[5, 3, 1, 2], [4, 1, 4, 1, 4, 1, 2, 6, 7], [7], [6, 5, 4, 3, 2, 1]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def _small_pair(**drafter_overrides):
    """An 8-token target: random drafts are often right, so rounds accept some drafts and reject others."""
    target = make_target("llama", vocab_size=8, seed=2, sharpen=3.0)
    return target, make_drafter(target, block_size=4, **drafter_overrides)


# ---------------------------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_gives_float32_logits_close_to_the_heads(target, dtype):
    drafter = make_drafter(target)
    hidden = torch.randn(3, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    exact = drafter.lm_head(hidden).float()
    drafter.set_draft_head_dtype(dtype)
    assert drafter.draft_head_dtype == dtype
    low = drafter.draft_logits(hidden)
    assert low.dtype == torch.float32 and low.shape == exact.shape
    # tolerances relative to max |logit|: worst element, mean (int8: fbgemm's 16-bit pair sums saturate, rarely)
    worst, mean = {torch.float32: (0.0, 0.0), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2),
                   torch.int8: (0.4, 0.02)}[dtype]
    err, scale = (low - exact).abs(), exact.abs().max().item()
    assert err.max().item() <= worst * scale and err.mean().item() <= mean * scale
    kernel = drafter.draft_head_kernel().kernel
    assert kernel == {torch.float16: "fbgemm-fp16", torch.int8: "fbgemm-int8"}.get(dtype, "linear")
    drafter.set_draft_head_dtype(None)
    assert torch.equal(drafter.draft_logits(hidden), exact)


def test_dtype_names_and_refusals():
    assert parse_draft_head_dtype("int8") is torch.int8 and parse_draft_head_dtype("torch.float16") is torch.float16
    assert parse_draft_head_dtype(None) is None and parse_draft_head_dtype("default") is None
    for bad in ("int4", torch.float64, "Linear"):
        with pytest.raises(ValueError, match="draft head dtype"):
            parse_draft_head_dtype(bad)
    with pytest.raises(ValueError, match="CPU"):
        DraftHead(torch.empty(6, 4, device="meta"), None, torch.int8)


def test_the_low_precision_head_follows_the_target_and_the_draft_vocab():
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=40)
    drafter.set_draft_vocab(torch.arange(1, 81, 2))
    drafter.set_draft_head_dtype("int8")
    hidden = torch.randn(2, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    rows = drafter.lm_head(hidden).float()[..., drafter.d2t]
    tol = 0.05 * rows.abs().max()  # mean error (a stale copy would be off by about 2 mean |logit|)
    assert (drafter.draft_logits(hidden) - rows).abs().mean() < tol
    with torch.no_grad():
        target.lm_head.weight.mul_(-1.0)  # the target's head changes in place: the int8 copy is rebuilt
    assert (drafter.draft_logits(hidden) + rows).abs().mean() < tol
    drafter.set_draft_vocab(torch.arange(40))
    assert (drafter.draft_logits(hidden) - drafter.lm_head(hidden).float()[..., :40]).abs().mean() < tol


# ---------------------------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("overrides", [{}, {"draft_candidates": 3}, {"draft_vocab_size": 6}])
def test_greedy_output_is_the_targets_with_every_dtype(dtype, overrides):
    target, drafter = _small_pair(**overrides)
    drafter.set_draft_head_dtype(dtype)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
        assert out[0, len(prompt):].tolist() == greedy_reference(target, prompt, 20)
    accepted = drafter.last_speculation_stats.accepted
    assert 0 < sum(accepted) < sum(drafter.last_speculation_stats.proposed)  # drafts kept and drafts rejected
    ids, mask = left_pad(PROMPTS)
    batched = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=20, policy="fixed", eos_token_id=[])
    width = ids.shape[1]
    assert [batched[r, width:].tolist() for r in range(len(PROMPTS))] == [
        greedy_reference(target, p, 20) for p in PROMPTS]


def test_sampled_drafts_are_draws_from_the_logits_handed_to_verification(monkeypatch):
    """int8 head, sampling: (1) the block's logits are the int8 head's distribution, not fp32's; (2) replaying the
    block's RNG stream on those logits draws exactly the block's tokens, so the drafts came from them; (3) transformers'
    speculative sampling gets those very logits as q."""
    import transformers.generation.utils as hf_utils

    target, drafter = _small_pair(draft_candidates=None)  # the loop scores the whole (8-token) vocabulary
    with torch.no_grad():  # a column shared by every row: the same distributions, but a coarse int8 grid per row
        target.lm_head.weight[:, 0] = 50.0
    drafter.set_draft_head_dtype(torch.int8)
    blocks, seeds, handed = [], [], []
    original_draft = drafter.draft

    def draft(*args, **kwargs):
        seeds.append(torch.get_rng_state())
        block = original_draft(*args, **kwargs)
        blocks.append(block)
        return block

    original_sampling = hf_utils._speculative_sampling

    def speculative_sampling(candidate_input_ids, candidate_logits, *args, **kwargs):
        handed.append(candidate_logits.clone())
        return original_sampling(candidate_input_ids, candidate_logits, *args, **kwargs)

    drafter.draft = draft
    monkeypatch.setattr(hf_utils, "_speculative_sampling", speculative_sampling)
    torch.manual_seed(0)
    target.generate(torch.tensor([PROMPTS[1]]), assistant_model=drafter, do_sample=True, max_new_tokens=24)
    assert len(blocks) > 3 and len(handed) == len(blocks)
    for block, state, q in zip(blocks, seeds, handed):
        assert torch.equal(q, block.logits[:, : q.shape[1]].to(q.dtype))
        g = torch.Generator().set_state(state)
        replay = [torch.multinomial(torch.softmax(block.logits[:, k], -1), 1, generator=g).item()
                  for k in range(block.tokens.shape[1])]
        assert replay == block.tokens[0].tolist()
    # the int8 head's distribution is far from the fp32 head's: a verifier handed fp32's would fail the replay
    cache = drafter.new_cache()
    with torch.no_grad():
        hs = target(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states
    drafter.append_context(cache, drafter.context_features(hs)[:, :8], torch.arange(8)[None])
    hidden = drafter.draft_slots(drafter.block_states(cache, torch.tensor([PROMPTS[1][8]])))
    low = torch.softmax(drafter.draft_logits(hidden), -1)
    drafter.set_draft_head_dtype(None)
    tv = 0.5 * (low - torch.softmax(drafter.draft_logits(hidden), -1)).abs().sum(-1)
    assert tv.mean() > 0.1


# ---------------------------------------------------------------------------------------------- sparse logits
def test_sparse_logits_stand_for_the_dense_tensor():
    values = torch.tensor([[[0.5, -1.0], [2.0, 0.0]]])
    ids = torch.tensor([[[3, 1], [0, 4]]])
    dense = torch.full((1, 2, 5), float("-inf"))
    dense[0, 0, 3], dense[0, 0, 1], dense[0, 1, 0], dense[0, 1, 4] = 0.5, -1.0, 2.0, 0.0
    block = DraftBlock(tokens=torch.tensor([[3, 0]]), sparse_logits=SparseLogits(values, ids, 5))
    assert torch.equal(block.truncate(1).logits, dense[:, :1])
    assert torch.equal(block.logits, dense) and block.logits is block.logits  # built once
    assert torch.equal(block.truncate(1).logits, dense[:, :1])
    assert torch.allclose(block.probs.sum(-1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="exactly one"):
        DraftBlock(tokens=block.tokens)
    with pytest.raises(ValueError, match="exactly one"):
        DraftBlock(tokens=block.tokens, logits=dense, sparse_logits=block.sparse_logits)


@pytest.mark.parametrize("overrides", [{"draft_candidates": 3}, {"draft_vocab_size": 6}])
def test_greedy_rounds_never_build_the_dense_draft_logits(monkeypatch, overrides):
    built = []
    original = SparseLogits.dense
    monkeypatch.setattr(SparseLogits, "dense", lambda self: built.append(1) or original(self))
    target, drafter = _small_pair(**overrides)
    ids = torch.tensor([PROMPTS[1]])
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == greedy_reference(target, PROMPTS[1], 16)
    padded, mask = left_pad(PROMPTS)
    dspark_hf.generate(target, drafter, padded, mask, max_new_tokens=16, policy="fixed", eos_token_id=[])
    assert built == []
    dspark_hf.generate(target, drafter, padded, mask, max_new_tokens=8, policy="fixed", eos_token_id=[],
                       do_sample=True)
    assert built  # sampled verification reads them
