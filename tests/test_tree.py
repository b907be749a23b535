"""Tree drafts end to end (`dspark_hf.generate(..., tree_budget=N)`): lossless, chain-compatible, target checks.

* greedy output equals each row's own greedy output for every sequential head and several tree shapes, and with
  oracle trees whose accepted path leaves the chain (the chain breaks, an alternative carries on);
* sampled output follows the enumerated target distribution with branching verified in most rounds;
* `tree_budget=0` reproduces the chain loop's rounds exactly (greedy and sampled, every policy);
* drafted trees keep their invariants; Llama, Qwen2 and Qwen3 take the tree mask; targets that cannot are refused;
* under load the loop drafts chains only while the scheduler verifies no branch;
* priced growth: with a prohibitive growth cost the tree policy decodes exactly as the chain policy (same tokens,
  records and target forwards, no tree work); the growth cost is measured on live rounds and trees still branch
  where they pay, losslessly (greedy and sampled).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

import dspark_hf
from conftest import (TrackingCache, _bound_copy, bias_markov_head, exact_joint, generated_rows, greedy_reference,
                      left_pad, make_drafter, make_target, sps_curve, target_hidden)
from dspark_hf import DSparkDrafter, SamplingParams
from dspark_hf.decoding.tree import DraftTree, TreeSpec, draft_tree
from dspark_hf.decoding.tree_attention import check_tree_attention, verification_inputs

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]
POLICIES = ("fixed", "threshold", "scheduled", "async")
LONG = 40  # reference continuations are computed once per target, this long, and cut


def _spread_confidence_drafter(target, **kw) -> DSparkDrafter:
    """A block-3 drafter with a biased Markov head whose confidences spread around sigmoid(1) ~ 0.73: alternatives
    worth verifying, for the sampling tests."""
    drafter = bias_markov_head(make_drafter(target, block_size=3, markov_rank=4, seed=4, **kw))
    with torch.no_grad():
        drafter.confidence_head.proj.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
        drafter.confidence_head.proj.bias.fill_(1.0)
    return drafter


@functools.lru_cache(maxsize=None)
def _target(arch: str):
    return make_target(arch)


@functools.lru_cache(maxsize=None)
def _reference(arch: str, prompt: tuple[int, ...]) -> list[int]:
    """The target's own greedy continuation of `prompt` (`LONG` tokens; no EOS, so every shorter one is a prefix)."""
    return greedy_reference(_target(arch), list(prompt), LONG)


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn"])
@pytest.mark.parametrize("budget,children,policy", [(2, 2, "fixed"), (6, 3, "scheduled"), (12, 4, "fixed")])
def test_tree_greedy_equals_each_rows_own_greedy(arch, head, budget, children, policy):
    target = _target(arch)
    drafter = make_drafter(target, sequential_head=head)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, policy=policy, sps=sps_curve,
                             tree_budget=budget, tree_max_children=children, return_dict_in_generate=True,
                             record_rounds=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == _reference(arch, tuple(prompt))[:16], (head, budget, row)
    if policy == "fixed":  # every drafted node is verified (but past max_new_tokens): the trees really branched
        branched = torch.cat([r.tree_verified > r.lengths for r in out.rounds if r.tree_verified is not None])
        assert branched.float().mean() > 0.8


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_a_width_cap_verifies_the_most_likely_nodes_losslessly(arch, policy):
    """`tree_max_nodes=W`: no row verifies more than W nodes in a round, the budget's alternatives replace the chain's
    tail (alternatives verified while the chain is cut short), and greedy output is still each row's own."""
    target = _target(arch)
    drafter = make_drafter(target)
    with torch.no_grad():  # every draft estimated at sigmoid(-2) = 0.12: the chain's tail is worth less than siblings
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(-2.0)
    k = drafter.config.block_size
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, policy=policy, sps=sps_curve,
                             tree_budget=6, tree_max_nodes=k - 1, return_dict_in_generate=True, record_rounds=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == _reference(arch, tuple(prompt))[:16], (policy, row)
    trees = [r for r in out.rounds if r.tree_verified is not None]
    verified = torch.cat([r.tree_verified for r in trees])
    assert int(verified.max()) <= k - 1
    if policy == "fixed":  # part of the width went to alternatives in place of the chain's tail
        swapped = torch.cat([(r.tree_verified > r.lengths) & (r.lengths < k - 1) for r in trees])
        assert swapped.float().mean() > 0.5


def test_a_width_cap_needs_a_tree_and_a_positive_width():
    target = _target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="tree_max_nodes"):
        dspark_hf.generate(target, drafter, ids, max_new_tokens=4, tree_max_nodes=3)
    with pytest.raises(ValueError, match="tree_max_nodes"):
        dspark_hf.generate(target, drafter, ids, max_new_tokens=4, tree_budget=4, tree_max_nodes=0)


def _restricted_drafter(target, mode: str, **kw) -> DSparkDrafter:
    """A drafter scoring M = 8 candidates per slot, a reduced draft vocabulary of 40 ids, or both."""
    if mode == "candidates":
        return make_drafter(target, draft_candidates=8, **kw)
    vocab = torch.arange(2, 82, 2)  # 40 ids: the odd ones (and 0, 1) can never be drafted
    drafter = make_drafter(target, draft_vocab_size=len(vocab), draft_candidates=8 if mode == "both" else None, **kw)
    drafter.set_draft_vocab(vocab)
    return drafter


@pytest.mark.parametrize("mode", ["candidates", "draft_vocab", "both"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_tree_greedy_with_candidates_and_a_reduced_draft_vocabulary(mode, head):
    target = _target("llama")
    drafter = _restricted_drafter(target, mode, sequential_head=head)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, policy="fixed", tree_budget=6,
                             tree_max_children=3, return_dict_in_generate=True, record_rounds=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:16], (mode, row)
    assert any(bool((r.tree_verified > r.lengths).any()) for r in out.rounds)


class TreeOracle(DSparkDrafter):
    """Test drafter of trees whose best path is not the chain: knows every row's greedy continuation; its chain is
    right for `chain_right` drafts and then wrong; at the first wrong depth it proposes `siblings` alternatives of
    which the `right_rank`-th (1-based; 0 = none) is right and is continued rightly to depth K; the other
    alternatives get one wrong child each while the budget lasts. One-hot logits, survival falling with creation
    order (the invariant the scheduler relies on)."""

    def setup(self, full: list[list[int]], chain_right: int, siblings: int, right_rank: int) -> "TreeOracle":
        self.full, self.chain_right, self.siblings, self.right_rank = full, chain_right, siblings, right_rank
        return self

    def new_cache(self):
        return TrackingCache()

    def draft_tree(self, cache, anchor_ids, *, anchor_positions, spec, sampling, generator) -> DraftTree:
        k, v = self.config.block_size, self.config.vocab_size
        if cache.rows is None:
            cache.rows = list(range(len(anchor_ids)))
        rows_nodes = []
        for i, row in enumerate(cache.rows):
            full, p = self.full[row], int(anchor_positions[i])
            right = (full[p + 1: p + 1 + k] + [1] * k)[:k]
            nodes = [((right[j] if j < self.chain_right else (right[j] + 1) % v), j - 1, j + 1) for j in range(k)]
            b = self.chain_right  # the first wrong depth is b + 1, parent: chain node b - 1 (or the anchor)
            extra, branch_parent = [], b - 1
            if b < k:
                for rank in range(1, self.siblings + 1):
                    token = right[b] if rank == self.right_rank else (right[b] + 1 + rank) % v
                    extra.append((token, branch_parent, b + 1))
                    if rank == self.right_rank:
                        parent = k + len(extra) - 1
                        for depth in range(b + 2, k + 1):
                            extra.append((right[depth - 1], parent, depth))
                            parent = k + len(extra) - 1
                wrong_children = [(k + m, d) for m, (t, par, d) in enumerate(extra) if d == b + 1
                                  and t != right[b] and d < k]
                for parent, depth in wrong_children:
                    extra.append(((right[depth] + 3) % v, parent, depth + 1))
            rows_nodes.append(nodes + extra[: spec.budget])
        n = max(map(len, rows_nodes))
        tokens = torch.zeros(len(rows_nodes), n, dtype=torch.long)
        parents = torch.full((len(rows_nodes), n), -1)
        depths = torch.ones(len(rows_nodes), n, dtype=torch.long)
        valid = torch.zeros(len(rows_nodes), n, dtype=torch.bool)
        for r, nodes in enumerate(rows_nodes):
            for m, (t, par, d) in enumerate(nodes):
                tokens[r, m], parents[r, m], depths[r, m], valid[r, m] = t, par, d, True
        logits = torch.nn.functional.one_hot(tokens, v).float() * 20
        survival = 0.97 ** (torch.arange(n, dtype=torch.float32) + 1).expand(len(rows_nodes), n).clone()
        return DraftTree(tokens=tokens, parents=parents, depths=depths, logits=logits, valid=valid,
                         survival=survival, node_ids=torch.arange(n).expand(len(rows_nodes), n), num_chain=k,
                         confidences=torch.full((len(rows_nodes), k), 0.97),
                         confidence_logits=torch.zeros(len(rows_nodes), k))


@pytest.mark.parametrize("chain_right,siblings,right_rank", [(0, 2, 1), (1, 3, 3), (2, 2, 2), (1, 2, 0), (4, 2, 1)])
@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_oracle_trees_whose_best_path_is_not_the_chain(chain_right, siblings, right_rank, policy):
    """The chain breaks after `chain_right` drafts; an alternative at the break is right and carries on to depth K
    (or none is: right_rank 0). Output = plain greedy; every full round accepts K drafts (through the alternative)
    when one is right, else `chain_right`."""
    target = _target("qwen3")
    k, new = 4, 24
    full = [p + _reference("qwen3", tuple(p)) for p in PROMPTS]
    oracle = _bound_copy(TreeOracle, target, k).setup(full, chain_right, siblings, right_rank).eval()
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, oracle, ids, mask, max_new_tokens=new, policy=policy, sps=lambda b: 1.0,
                             tree_budget=12, tree_max_children=siblings + 1, return_dict_in_generate=True,
                             record_rounds=True)
    rows = generated_rows(out, ids.shape[1])
    for i, p in enumerate(PROMPTS):
        assert rows[i] == _reference("qwen3", tuple(p))[:new], (chain_right, siblings, right_rank, i)
    expected = k if (right_rank and chain_right < k) else chain_right
    first = 1 if policy == "scheduled" else 0  # (scheduled: the first round verifies depth 1 only, PROBE_LENGTH)
    for s in out.stats:  # every round but a row's last (cut by max_new_tokens) accepts `expected` drafts
        assert all(a == expected + 1 for a in s.accepted_lengths[first:-1]), s.accepted_lengths
        assert first == 0 or s.accepted_lengths[0] == min(expected, 1) + 1
    if right_rank and chain_right < k:  # the accepted path left the chain after `chain_right` chain drafts
        full_rounds = [r for r in out.rounds[first:-1] if r.tree_accepted is not None]
        assert all(bool((r.accepted == chain_right).all()) for r in full_rounds)
        assert all(bool((r.tree_accepted == k).all()) for r in full_rounds)


def test_batch_of_one_through_generate_and_the_assisted_loop_refusal():
    target = _target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([PROMPTS[1]])
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          custom_generate=dspark_hf.speculative_generate, drafter=drafter, policy="fixed",
                          tree_budget=5, max_new_tokens=12, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == _reference("llama", tuple(PROMPTS[1]))[:12]
    direct = dspark_hf.generate(target, drafter, ids, max_new_tokens=12, policy="fixed", tree_budget=5)
    assert torch.equal(direct, out)
    with pytest.raises(ValueError, match="tree_budget.*chains only.*dspark_hf.generate"):
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, tree_budget=5,
                        max_new_tokens=4)


# ---------------------------------------------------------------------------------------------- chain = today
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_chain_only_tree_reproduces_the_chain_loops_rounds_exactly(policy, do_sample):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad(PROMPTS)
    runs = []
    for tree_budget in (None, 0):
        runs.append(dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=18, policy=policy, sps=sps_curve,
                                       threshold=0.3, do_sample=do_sample, temperature=0.8, tree_budget=tree_budget,
                                       generator=torch.Generator().manual_seed(11), record_rounds=True,
                                       count_round_overhead=False,  # measured wall time would steer the policy
                                       measured_cost=False, return_dict_in_generate=True))
    chain, tree = runs
    assert torch.equal(chain.sequences, tree.sequences)
    assert len(chain.rounds) == len(tree.rounds)
    for a, b in zip(chain.rounds, tree.rounds):
        assert torch.equal(a.rows, b.rows) and torch.equal(a.lengths, b.lengths) and torch.equal(a.accepted, b.accepted)
        assert (a.drafts is None) == (b.drafts is None) and (a.drafts is None or torch.equal(a.drafts, b.drafts))
        assert (a.confidence_logits is None or torch.equal(a.confidence_logits, b.confidence_logits))
    assert [s.accepted_lengths for s in chain.stats] == [s.accepted_lengths for s in tree.stats]
    assert [s.verify_lengths for s in chain.stats] == [s.verify_lengths for s in tree.stats]


@pytest.mark.parametrize("head,mode", [("markov", "full"), ("gated_markov", "full"), ("rnn", "full"),
                                       ("markov", "candidates"), ("rnn", "both")])
@pytest.mark.parametrize("do_sample", [False, True])
def test_drafted_trees_keep_their_invariants(head, mode, do_sample):
    """The chain of a branched tree is `drafter.draft`'s block (same generator); siblings are distinct; survival never
    increases from parent to child, nor (sampling) from sibling to next sibling; every token has its node's largest
    logit (greedy) or a finite one (sampled); node logits of alternatives exclude the earlier siblings."""
    target = make_target("llama")
    drafter = (make_drafter(target, sequential_head=head, block_size=5) if mode == "full"
               else _restricted_drafter(target, mode, sequential_head=head, block_size=5)).bind_target(target)
    ids = torch.tensor([[5, 17, 33, 2, 9, 8, 7], [40, 41, 42, 43, 44, 45, 46]])
    hs = target_hidden(target, ids)
    cache = drafter.new_cache()
    drafter.append_context(cache, drafter.context_features(hs)[:, :6], torch.arange(6).expand(2, 6))
    sampling = SamplingParams(do_sample=do_sample, temperature=0.9, top_k=20 if do_sample else None)
    tree = draft_tree(drafter, cache, ids[:, 6], spec=TreeSpec(10, 3), sampling=sampling,
                      generator=torch.Generator().manual_seed(4))
    block = drafter.draft(cache, ids[:, 6], sampling=sampling, generator=torch.Generator().manual_seed(4))
    assert torch.equal(tree.tokens[:, :5], block.tokens)
    torch.testing.assert_close(tree.logits[:, :5], block.logits)
    assert tree.tokens.shape[1] == 15 and bool(tree.valid.all())
    for r in range(2):
        for n in range(15):
            parent = int(tree.parents[r, n])
            s = float(tree.survival[r, n])
            assert s <= (1.0 if parent < 0 else float(tree.survival[r, parent])) + 1e-7
            assert int(tree.depths[r, n]) == (1 if parent < 0 else int(tree.depths[r, parent]) + 1)
            siblings = [m for m in range(n) if int(tree.parents[r, m]) == parent]
            if siblings:
                assert not do_sample or s <= float(tree.survival[r, siblings[-1]]) + 1e-7
                assert int(tree.tokens[r, n]) not in tree.tokens[r, siblings].tolist()
                assert torch.isinf(tree.logits[r, n, tree.tokens[r, siblings]]).all()
            logit = tree.logits[r, n, tree.tokens[r, n]]
            assert torch.isfinite(logit) and (do_sample or logit == tree.logits[r, n].max())
    assert (tree.parents[:, 5:] != torch.arange(5, 15) - 1).any()  # it branched


# ---------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("candidates", [None, 3])
def test_tree_sampling_matches_the_target_distribution(candidates):
    """3 tokens over V^3 = 64 outcomes from 3000 identical rows, trees of 4 extra nodes verified whole (policy
    "fixed"), by Algorithm 1, and capped at 2 of their 7 nodes (`tree_max_nodes`, most likely first): TV within
    2.5x the TV expected from exact sampling (as the chain loop's test), with alternatives verified in most row-rounds
    and accepted paths leaving the chain in some of them. With the full vocabulary and with the drafter restricted to 3 candidates per slot (compact node distributions)."""
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = _spread_confidence_drafter(target, draft_candidates=candidates)
    prompt, rows, n_tokens = [1, 2, 3, 1], 3000, 3
    ids = torch.tensor([prompt] * rows)
    exact = exact_joint(target, prompt, n_tokens, 0.9, 3, None)
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * rows)).sum().item()
    for policy, cap in (("fixed", None), ("scheduled", None), ("fixed", 2)):
        out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                                 temperature=0.9, top_k=3, policy=policy, sps=lambda b: 1.0 / (1.0 + 2e-6 * b),
                                 tree_budget=4, tree_max_children=3, tree_max_nodes=cap,
                                 generator=torch.Generator().manual_seed(7), count_round_overhead=False,
                                 record_rounds=True, return_dict_in_generate=True)
        new = out.sequences[:, len(prompt):]
        codes = (new * torch.tensor([16, 4, 1])).sum(1)
        empirical = torch.bincount(codes, minlength=64).float() / rows
        tv = 0.5 * (empirical - exact).abs().sum().item()
        assert tv < 2.5 * expected_tv, (policy, tv, expected_tv)
        verified = torch.cat([r.tree_verified for r in out.rounds if r.tree_verified is not None])
        chain = torch.cat([r.lengths for r in out.rounds if r.tree_verified is not None])
        left_chain = torch.cat([r.tree_accepted > r.accepted for r in out.rounds if r.tree_verified is not None])
        # branching verified in most row-rounds (capped at 2 nodes, whenever an alternative outranks the chain's
        # second draft: about a third of them here)
        assert (verified > chain).float().mean() > (0.5 if cap is None else 0.25), policy
        assert left_chain.float().mean() > (0.05 if cap is None else 0.02), policy  # ... accepted off the chain in some
        if cap is not None:
            assert int(verified.max()) == cap


# ---------------------------------------------------------------------------------------------- targets
def _qwen2(vocab_size: int = 96):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama-eager"])
def test_testbed_families_take_the_tree_mask(family):
    """SmolLM2's (Llama) and Qwen2.5-Coder's (Qwen2) families and Qwen3, with SDPA (and Llama with eager attention,
    an additive float mask): the probe passes, and a tree forward over a cached prompt gives every node the logits of
    its own path run as a plain sequence."""
    target = _qwen2() if family == "qwen2" else make_target(family.split("-")[0])
    implementation = "eager" if family.endswith("eager") else "sdpa"
    target.config._attn_implementation = implementation
    assert check_tree_attention(target) == implementation
    prompt = torch.tensor([[3, 14, 15, 9]])
    #            node: 0   1   2   3   4
    tokens = torch.tensor([[21, 22, 23, 24, 25]])
    parents = torch.tensor([[-1, 0, -1, 2, 0]])
    depths = torch.tensor([[1, 2, 1, 2, 2]])
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, logits=None,
                     valid=torch.ones(1, 5, dtype=torch.bool), survival=None, node_ids=torch.arange(5)[None],
                     num_chain=2)
    cache = DynamicCache()
    with torch.no_grad():
        target(input_ids=prompt[:, :-1], cache=cache, use_cache=True)
        input_ids, positions, mask = verification_inputs(tree, prompt[:, -1], torch.tensor([3]),
                                                         torch.ones(1, 3, dtype=torch.bool),
                                                         implementation=implementation)
        logits = target(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True).logits[0]
        for node, path in enumerate([[21], [21, 22], [23], [23, 24], [21, 25]]):
            plain = target(torch.cat([prompt, torch.tensor([path])], 1)).logits[0, -1]
            torch.testing.assert_close(logits[1 + node], plain, atol=1e-4, rtol=1e-4)


def test_targets_that_cannot_take_the_tree_mask_are_refused():
    target = make_target("llama")
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*flash_attention_2.*4-D"):
        check_tree_attention(target)
    target = make_target("llama")
    original = target.forward

    def ignores_custom_masks(*args, attention_mask=None, **kwargs):  # a model that drops a 4-D mask
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return original(*args, attention_mask=attention_mask, **kwargs)

    target.forward = ignores_custom_masks
    with pytest.raises(ValueError, match="does not honour a custom 4-D attention mask"):
        check_tree_attention(target)
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="does not honour"):
        dspark_hf.generate(target, make_drafter(target), ids, mask, max_new_tokens=4, tree_budget=3, policy="fixed")
    plain = make_target("llama")
    with pytest.raises(ValueError, match="confidence head"):
        dspark_hf.generate(plain, make_drafter(plain, confidence_head=False), ids, mask, max_new_tokens=4,
                           tree_budget=3, policy="fixed")


def test_a_passed_probe_is_remembered_until_what_it_checked_changes():
    target = make_target("llama")
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    assert check_tree_attention(target) == "sdpa" and len(calls) == 2  # the probe's two forwards
    check_tree_attention(target)
    assert len(calls) == 2  # remembered: no forward
    target.to(torch.float64)  # another dtype: probed again
    check_tree_attention(target)
    assert len(calls) == 4
    hook.remove()
    original = target.forward

    def ignores_custom_masks(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return original(*args, attention_mask=attention_mask, **kwargs)

    target.forward = ignores_custom_masks  # a wrapped forward is a different model: probed again, and refused
    with pytest.raises(ValueError, match="does not honour"):
        check_tree_attention(target)


def test_tree_greedy_with_eager_attention():
    target = make_target("llama")
    target.config._attn_implementation = "eager"
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, make_drafter(target), ids, mask, max_new_tokens=12, policy="fixed",
                             tree_budget=6, return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:12]


def test_tree_kv_cache_stays_within_the_stated_bound():
    target = _target("llama")
    drafter = make_drafter(target, block_size=4)
    prompts = [[3] * 2, [4] * 20, [5] * 9]
    ids, mask = left_pad(prompts)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy="fixed", hole_budget=8,
                             tree_budget=6, return_dict_in_generate=True)
    longest = max(len(p) + int(n) for p, n in zip(prompts, out.num_generated))
    assert out.peak_cache_columns <= longest + 8 + (1 + 4 + 6)
    for row, prompt in enumerate(prompts):
        assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:40]


def test_under_load_the_loop_drafts_chains_while_no_branch_is_verified(monkeypatch):
    """A cost curve where a verified token costs nearly a third of a round: the scheduler verifies chain drafts only
    (alternatives survive less), so after 2 such tree rounds the loop drafts chains alone, probing with a tree at
    doubling intervals. Output is plain greedy either way."""
    from dspark_hf.decoding import tree as tree_module

    target = _target("llama")
    drafter = make_drafter(target)
    ids, mask = left_pad(PROMPTS[:2])
    grown = []
    original = tree_module._TreeGrower.grow
    monkeypatch.setattr(tree_module._TreeGrower, "grow", lambda self: grown.append(1) or original(self))
    runs = {}
    for backoff in (True, False):
        grown.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=30, policy="scheduled",
                                 sps=lambda b: 1.0 / (1.0 + 0.3 * b), tree_budget=6, idle_backoff=backoff,
                                 count_round_overhead=False, record_rounds=True, return_dict_in_generate=True,
                                 measured_cost=False)  # the stated curve, not one corrected by timed forwards:
        # this test's decisions must not follow the machine's load (with the correction a branch was verified once
        # in a full-suite run next to two training jobs)
        for row, prompt in enumerate(PROMPTS[:2]):
            assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:30]
        drafted = [r for r in out.rounds if r.tree_verified is not None]
        assert all(bool((r.tree_verified == r.lengths).all()) for r in drafted)  # no branch verified
        runs[backoff] = (len(grown), len(drafted))
    (grown_on, rounds_on), (grown_off, rounds_off) = runs[True], runs[False]
    assert grown_off == rounds_off  # without the backoff every drafting round grows a tree
    assert 2 <= grown_on <= rounds_on // 2  # with it: 2 rounds, then probes only


# ---------------------------------------------------------------------------------------------- priced growth
def _steady_clock(monkeypatch, growth_cost=None):
    """Deterministic pricing for comparisons: every round's measured overhead reads 20 ms (5 of them drafting), and
    with `growth_cost` the growth clock reads that cost instead of the measured one."""
    from dspark_hf.decoding import round_state

    add = round_state.RoundClock.add
    monkeypatch.setattr(round_state.RoundClock, "add", lambda self, overhead, draft: add(self, 0.02, 0.005))
    if growth_cost is not None:
        monkeypatch.setattr(round_state.GrowthClock, "cost", lambda self: growth_cost if self.priced else None)


def _counting(monkeypatch, module, name, calls):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("policy", ["scheduled", "async"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_prohibitive_growth_cost_decodes_exactly_as_the_chain(monkeypatch, policy, do_sample):
    """A growth step (and a growing round) priced far above a round, under a width cost at which free growth does
    branch: the plan grows nothing, so the tree policy's rounds are the chain policy's — the same tokens (greedy and sampled, same generator), the same round records and
    the same number of target forwards — and no tree work is done (no growth step, no tree inputs or 4-D mask, no
    tree verification)."""
    from dspark_hf.decoding import batched
    from dspark_hf.decoding import tree as tree_module
    from dspark_hf.decoding.scheduler import GrowthCost

    _steady_clock(monkeypatch, GrowthCost(step_seconds=1e3, tree_seconds=1e3))
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    forwards = []
    forward = target.forward
    target.forward = lambda *args, **kwargs: forwards.append(1) or forward(*args, **kwargs)
    check_tree_attention(target)  # probed (and remembered) before counting
    calls = {}
    _counting(monkeypatch, batched, "verification_inputs", calls)
    _counting(monkeypatch, batched, "tree_verify", calls)
    grow = tree_module.TreeDrafting.grow
    steps = []
    monkeypatch.setattr(tree_module.TreeDrafting, "grow",
                        lambda self, plan=None: (grow(self, plan), steps.append(self.steps))[0])
    ids, mask = left_pad(PROMPTS)
    cheap_width = lambda b: 1.0 / (1.0 + 0.002 * b)  # noqa: E731  (at which free growth does branch)
    runs = {}
    for tree_budget in (None, 8):
        forwards.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=18, policy=policy, sps=cheap_width,
                                 do_sample=do_sample, temperature=0.8, tree_budget=tree_budget,
                                 generator=torch.Generator().manual_seed(11), record_rounds=True,
                                 return_dict_in_generate=True, measured_cost=False)  # (the given curve, not timings
        runs[tree_budget] = (out, len(forwards))                           # that differ between the two runs under load)
    (chain, chain_forwards), (tree, tree_forwards) = runs[None], runs[8]
    assert torch.equal(chain.sequences, tree.sequences)
    assert chain_forwards == tree_forwards
    assert len(chain.rounds) == len(tree.rounds)
    for a, b in zip(chain.rounds, tree.rounds):
        assert torch.equal(a.rows, b.rows) and torch.equal(a.lengths, b.lengths) and torch.equal(a.accepted, b.accepted)
        assert (a.drafts is None) == (b.drafts is None) and (a.drafts is None or torch.equal(a.drafts, b.drafts))
        assert b.tree_verified is None or torch.equal(b.tree_verified, b.lengths)
    assert steps and not any(steps)  # the plan was asked, and grew nothing
    assert calls == {}
    if not do_sample:
        for row, prompt in enumerate(PROMPTS):
            assert generated_rows(tree, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:18]


def test_priced_trees_are_measured_grown_where_they_pay_and_lossless(monkeypatch):
    """The default pricing on the live machine: the first growing round is timed (seconds per growth step and per
    growing round, both > 0) and prices the next ones; branches are still verified where a cheap cost curve makes
    them pay, never more than the budget is grown, and the output is each row's own greedy output."""
    from dspark_hf.decoding import round_state

    measured = []
    add = round_state.GrowthClock.add
    monkeypatch.setattr(round_state.GrowthClock, "add",
                        lambda self, steps, step_s, tree_s: (measured.append((steps, step_s, tree_s)),
                                                             add(self, steps, step_s, tree_s))[1])
    target = _target("llama")
    drafter = make_drafter(target)
    ids, mask = left_pad(PROMPTS)
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=16, policy="scheduled",
                             sps=lambda b: 1.0 / (1.0 + 0.002 * b), tree_budget=6, tree_max_children=3,
                             return_dict_in_generate=True, record_rounds=True)
    for row, prompt in enumerate(PROMPTS):
        assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:16], row
    assert measured and all(0 < steps <= 6 and step_s > 0 and tree_s > 0 for steps, step_s, tree_s in measured)
    assert any(bool((r.tree_verified > r.lengths).any()) for r in out.rounds if r.tree_verified is not None)


def test_priced_tree_sampling_matches_the_target_distribution(monkeypatch):
    """Sampling through the growth plan: 3000 rows, trees of up to 4 extra nodes, a growth step priced so that the
    plan grows some branches and declines others. TV to the enumerated target joint within 2.5x the TV expected from
    exact sampling, with branches verified in many row-rounds and fewer than the budget in others."""
    from dspark_hf.decoding.scheduler import GrowthCost

    _steady_clock(monkeypatch, GrowthCost(step_seconds=1e-5, tree_seconds=1e-5))
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = _spread_confidence_drafter(target)
    prompt, rows, n_tokens = [1, 2, 3, 1], 3000, 3
    ids = torch.tensor([prompt] * rows)
    exact = exact_joint(target, prompt, n_tokens, 0.9, 3, None)
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * rows)).sum().item()
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                             temperature=0.9, top_k=3, policy="scheduled", sps=lambda b: 1.0 / (1.0 + 2e-6 * b),
                             tree_budget=4, tree_max_children=3, generator=torch.Generator().manual_seed(7),
                             record_rounds=True, return_dict_in_generate=True, measured_cost=False)
    new = out.sequences[:, len(prompt):]
    codes = (new * torch.tensor([16, 4, 1])).sum(1)
    empirical = torch.bincount(codes, minlength=64).float() / rows
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 2.5 * expected_tv, (tv, expected_tv)
    drafted = [r for r in out.rounds if r.tree_verified is not None]
    branches = torch.cat([r.tree_verified - r.lengths for r in drafted])
    assert (branches > 0).float().mean() > 0.2
    assert (branches < 4).float().mean() > 0.2


def test_trees_that_verified_at_a_loss_are_backed_off_to_chains(monkeypatch):
    """Tree rounds feed `RealizedGain` as their own kind ("tree": rows + accepted path lengths); where that evidence
    says trees lost time, the branch backoff drafts chains alone even though the cheap cost curve verifies branches
    whenever a tree is grown (a nearly flat curve, every branch verified). Output is plain greedy either way."""
    from dspark_hf.decoding import round_state
    from dspark_hf.decoding import tree as tree_module

    fed = []
    verifying = round_state.RealizedGain.verifying_round
    monkeypatch.setattr(round_state.RealizedGain, "verifying_round",
                        lambda self, kind, seconds, tokens: fed.append((kind, tokens))
                        or verifying(self, kind, seconds, tokens))
    grown = []
    original = tree_module._TreeGrower.grow
    monkeypatch.setattr(tree_module._TreeGrower, "grow", lambda self: grown.append(1) or original(self))
    target = _target("llama")
    drafter = make_drafter(target)
    ids, mask = left_pad(PROMPTS)
    runs = {}
    for trees_lose in (False, True):
        monkeypatch.setattr(round_state.RealizedGain, "pays", lambda self, kind: not (trees_lose and kind == "tree"))
        fed.clear(), grown.clear()
        out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=40, policy="scheduled",
                                 sps=lambda b: 1.0 / (1.0 + 0.00001 * b), tree_budget=6, tree_max_children=3,
                                 measured_cost=False, count_round_overhead=False, return_dict_in_generate=True,
                                 record_rounds=True)
        for row, prompt in enumerate(PROMPTS):
            assert generated_rows(out, ids.shape[1])[row] == _reference("llama", tuple(prompt))[:40], row
        verifying_trees = [r for r in out.rounds if r.tree_verified is not None and int(r.tree_verified.max()) > 0]
        assert [t for k, t in fed if k == "tree"] and all(k in ("tree", "drafter") for k, _ in fed)
        tree_tokens = sorted(len(r.rows) + int(r.tree_accepted.sum()) for r in verifying_trees)
        assert sorted(t for _, t in fed) == tree_tokens  # every verifying tree round, rows + accepted path
        runs[trees_lose] = len(grown)
    assert runs[True] < runs[False], runs
