"""Reduced draft vocabulary (`DSparkConfig.draft_vocab_size`, the `d2t` mapping): the drafter proposes only target ids
in its draft vocabulary; decoding stays lossless (greedy equals the target's greedy output, also when the target's
argmax lies outside the draft vocabulary; sampling follows the target's distribution), the mapping round-trips through
checkpoints and a bad one is refused, the loss terms account for the target mass outside the draft vocabulary, and a
drafter with a reduced vocabulary trains."""

import json
import math
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark_hf
from conftest import cached_draft, exact_joint, learnable_examples, make_drafter, make_target, target_hidden
from dspark_hf import DSparkConfig, DSparkContextCache, DSparkDrafter, rejection_verify, verify, SamplingParams
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.losses import LossWeights, dspark_loss
from dspark_hf.training.trainer import DSparkTrainer, build_drafter
from dspark_hf.training.vocab import (answer_token_counts, build_draft_vocab, coverage_report,
                                      draft_vocab_from_counts)
from dspark_hf.training.data import TokenizedExample

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


def greedy_ref(target, prompt, n, **kw):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def vocab_without(tokens, vocab_size, size, seed=0):
    """`size` random ids of the vocabulary that avoid `tokens`."""
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(tokens)))
    pick = torch.randperm(len(allowed), generator=torch.Generator().manual_seed(seed))[:size]
    return allowed[pick].sort().values


def reduced_drafter(target, draft_vocab, **kw):
    drafter = make_drafter(target, draft_vocab_size=len(draft_vocab), **kw)
    drafter.set_draft_vocab(draft_vocab)
    return drafter


# ---------------------------------------------------------------------------------------------- the mapping
def test_mapping_shapes_and_oov_previous_token():
    target = make_target("llama")
    d2t = torch.tensor([3, 9, 10, 50, 95])
    drafter = reduced_drafter(target, d2t[[2, 0, 4, 1, 3]])  # any order in: stored sorted
    assert torch.equal(drafter.d2t, d2t)
    head = drafter.markov_head
    assert head.markov_w1.weight.shape == (6, 16) and head.markov_w2.weight.shape == (5, 16)  # Vd + 1 "unknown" row
    assert drafter.to_draft_inputs(torch.tensor([3, 9, 4, 95, 0])).tolist() == [0, 1, 5, 4, 5]
    assert drafter.t2d.sum() == 5 and drafter.t2d[d2t].all()
    assert torch.equal(drafter.d2t_offsets() + torch.arange(5), d2t)  # speculators' offset convention
    hidden = torch.randn(2, 3, 32)
    assert torch.allclose(drafter.draft_logits(hidden), drafter.lm_head(hidden)[..., d2t].float(), atol=1e-6)
    assert make_drafter(target).d2t is None and make_drafter(target).t2d is None


def test_bad_mappings_are_clear_errors(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=4)
    for bad, match in [([1, 2, 2, 3], "duplicate"), ([1, 2, 3, 96], r"\[0, 96\)"), ([-1, 2, 3, 4], r"\[0, 96\)"),
                       ([1, 2, 3], "holds 3 ids"), ([0.5, 1.0, 2.0, 3.0], "integer")]:
        with pytest.raises(ValueError, match=match):
            drafter.set_draft_vocab(torch.tensor(bad))
    with pytest.raises(ValueError, match="full vocabulary"):
        make_drafter(target).set_draft_vocab([1, 2])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DSparkConfig.from_target_config(target.config, draft_vocab_size=97)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DSparkConfig.from_target_config(target.config, draft_vocab_size=0)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):  # HF's DFlash path drafts from the full head
        dspark_hf.dflash_adapter(make_drafter(target, sequential_head="none", draft_vocab_size=8), target)
    # a checkpoint whose stored mapping is corrupt (unsorted / duplicate / out of range) is refused on load
    drafter.set_draft_vocab([4, 8, 15, 16])
    drafter.save_pretrained(tmp_path / "ok")
    for name, ids, match in [("dup", [4, 8, 8, 16], "duplicate"), ("unsorted", [8, 4, 15, 16], "sorted"),
                             ("range", [4, 8, 15, 200], "lie in")]:
        folder = tmp_path / name
        drafter.save_pretrained(folder)
        state = load_file(folder / "model.safetensors")
        state["d2t"] = torch.tensor(ids)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"bad draft vocabulary mapping.*{match}"):
            DSparkDrafter.from_pretrained(folder)
    # a mapping of the wrong length does not fit the architecture
    state = load_file(tmp_path / "ok" / "model.safetensors")
    state["d2t"] = torch.tensor([1, 2, 3])
    save_file(state, tmp_path / "ok" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"bad draft vocabulary mapping \(d2t\): shape \[3\], but draft_vocab_size is 4"):
        DSparkDrafter.from_pretrained(tmp_path / "ok")
    del state["d2t"]
    save_file(state, tmp_path / "ok" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="stores no draft vocabulary mapping"):
        DSparkDrafter.from_pretrained(tmp_path / "ok")


def test_save_load_round_trip(tmp_path, target):
    drafter = reduced_drafter(target, vocab_without([], 96, 30, seed=3))
    drafter.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["d2t"].dtype == torch.int64 and torch.equal(stored["d2t"], drafter.d2t)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 30
    assert not any(t.dim() == 2 and 96 in t.shape for t in stored.values())  # nothing vocabulary-sized is saved
    loaded = DSparkDrafter.from_pretrained(tmp_path, target=target)
    low = DSparkDrafter.from_pretrained(tmp_path, target=target, dtype=torch.bfloat16)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(low.d2t, drafter.d2t)  # ids never cast to a float
    ids = torch.tensor([PROMPTS[1]])
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False),
                       target.generate(ids, assistant_model=loaded, max_new_tokens=12, do_sample=False))


def test_training_forward_agrees_with_cached_draft_and_distributions_are_zero_outside(target):
    drafter = reduced_drafter(target, vocab_without([], 96, 40, seed=1), block_size=5)
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    hs = target_hidden(target, ids)
    with torch.no_grad():
        out = drafter(ids[:, [6, 13]], torch.tensor([[6, 13]]), drafter.context_features(hs))
    assert out.logits.shape[-1] == 40
    outside = ~drafter.t2d
    for a, pos in enumerate([6, 13]):
        for candidates in (0, 5):
            block = cached_draft(drafter, target, ids, pos, candidates=candidates)
            ref = drafter.sample_block(out.hidden_states[:, a], out.logits[:, a].float(), ids[:, pos],
                                       candidates=candidates)
            assert torch.equal(block.tokens, ref.tokens) and torch.allclose(block.logits, ref.logits, atol=1e-4)
            assert block.logits.shape[-1] == 96 and torch.isinf(block.logits[..., outside]).all()
            assert drafter.t2d[block.tokens].all()
            probs = block.probs
            assert torch.isfinite(probs).all() and (probs[..., outside] == 0).all()
            assert torch.allclose(probs.sum(-1), torch.ones(()))


# ---------------------------------------------------------------------------------------------- greedy is lossless
@pytest.mark.parametrize("head, candidates", [("markov", None), ("gated_markov", None), ("rnn", 6), ("none", None)])
def test_greedy_hf_generate_equals_target(target, head, candidates):
    examples = learnable_examples(target, count=40)
    drafter = reduced_drafter(target, build_draft_vocab(examples, 32, vocab_size=96), sequential_head=head,
                              block_size=5, draft_candidates=candidates)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(ref, target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False))
    # a full-vocabulary logits processor on the HF path (drafts expanded to V with -inf outside, then penalised)
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.5)
    assert torch.equal(ref, target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False,
                                            repetition_penalty=1.5))


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_greedy_batched_generate_equals_each_rows_greedy(target, policy):
    drafter = reduced_drafter(target, vocab_without([], 96, 24, seed=5), block_size=4)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=20, policy=policy,
                             sps=lambda b: 1.0 / (1.0 + 0.08 * b), return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        n = int(out.num_generated[row])
        assert out.sequences[row, width: width + n].tolist() == greedy_ref(target, prompt, 20), (policy, row)


class VocabOracle(DSparkDrafter):
    """Drafts through the real `sample_block` from base logits that put the target's own greedy continuation first
    *where it lies in the draft vocabulary*; where it does not, the base logits are flat (the draft is some other id)."""

    def setup(self, target, full_sequences=None) -> "VocabOracle":
        object.__setattr__(self, "_oracle", target)
        self.full = full_sequences
        with torch.no_grad():
            self.markov_head.markov_w2.weight.zero_()  # no Markov bias: the base logits decide
        return self

    def new_cache(self):
        return RowCache()

    def _base_logits(self, continuation):
        vd = self.config.draft_vocab_size
        draft_ids = self.to_draft_inputs(continuation)  # Vd where the target's token is outside the draft vocab
        base = torch.zeros(*continuation.shape, vd + 1)
        base.scatter_(2, draft_ids[..., None], 30.0)
        return base[..., :vd]

    def draft(self, cache, anchor_ids, *, anchor_positions=None, prefix_ids=None, num_drafts=None, sampling=None,
              generator=None, do_sample=False, logits_processor=None, **kw):
        k = num_drafts or self.config.block_size
        if self.full is None:  # HF path, batch 1: the continuation of the prefix
            out = prefix_ids
            with torch.no_grad():
                for _ in range(k):
                    out = torch.cat([out, self._oracle(out).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
            cont = out[:, prefix_ids.shape[1]:]
        else:  # batched path: every row's known greedy continuation
            if cache.rows is None:
                cache.rows = list(range(len(anchor_ids)))
            cont = torch.tensor([(self.full[r][int(p) + 1: int(p) + 1 + k] + [1] * k)[:k]
                                 for r, p in zip(cache.rows, anchor_positions)])
        hidden = torch.zeros(cont.shape[0], k, self.config.hidden_size)
        return self.sample_block(hidden, self._base_logits(cont), anchor_ids, do_sample=do_sample, sampling=sampling,
                                 logits_processor=logits_processor, prefix_ids=prefix_ids, generator=generator)


@dataclass
class RowCache(DSparkContextCache):
    rows: list | None = None

    def select_rows(self, index):
        super().select_rows(index)
        self.rows = [self.rows[i] for i in index.tolist()]


def vocab_oracle(target, d2t, full=None, block_size=4):
    base = make_drafter(target, block_size=block_size, draft_vocab_size=len(d2t))
    oracle = VocabOracle(base.config)
    oracle.load_state_dict(base.state_dict())
    oracle.set_draft_vocab(d2t)
    oracle.bind_target(target)
    return oracle.setup(target, full).eval()


def test_target_argmax_outside_the_draft_vocabulary_is_emitted_by_the_target(target):
    """The drafter proposes the target's own token whenever it can: with the continuation's tokens split between
    inside and outside the draft vocabulary, every OOV position is a rejected draft and the target's token is
    emitted: the output is still the target's greedy output; with no continuation token inside, nothing is
    accepted."""
    prompt, n = PROMPTS[1], 30
    ref = greedy_ref(target, prompt, n)
    distinct = sorted(set(ref))
    outside = distinct[::2]  # half of the continuation's distinct tokens are not draftable
    inside_ids = [t for t in range(96) if t not in outside]
    ids = torch.tensor([prompt])
    oracle = vocab_oracle(target, torch.tensor(inside_ids))
    assert target.generate(ids, assistant_model=oracle, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist() == ref
    stats = oracle.last_speculation_stats
    assert sum(stats.accepted) > 0  # in-vocabulary tokens are accepted ...
    # ... and the first OOV token of each round stops the round: emitted tokens per round = leading in-vocab + 1
    pos = 0
    for accepted, proposed in zip(stats.accepted, stats.proposed):
        window = ref[pos + 1: pos + 1 + proposed]  # the drafts of this round continue after the anchor at ref[pos]
        lead = next((j for j, t in enumerate(window) if t in outside), len(window))
        assert accepted == min(lead, proposed), (pos, accepted, window)
        pos += accepted + 1
    # no continuation token in the draft vocabulary: every round rejects its first draft, output unchanged
    none_in = vocab_oracle(target, vocab_without(distinct, 96, 30))
    assert target.generate(ids, assistant_model=none_in, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist() == ref
    assert sum(none_in.last_speculation_stats.accepted) == 0


def test_target_argmax_outside_the_draft_vocabulary_batched(target):
    n = 24
    refs = [greedy_ref(target, p, n + 8) for p in PROMPTS]
    outside = sorted({t for r in refs for t in r})[::2]
    oracle = vocab_oracle(target, torch.tensor([t for t in range(96) if t not in outside]),
                          full=[p + r for p, r in zip(PROMPTS, refs)])
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = dspark_hf.generate(target, oracle, ids, mask, max_new_tokens=n, policy="fixed", return_dict_in_generate=True)
    for row in range(len(PROMPTS)):
        assert out.sequences[row, width: width + int(out.num_generated[row])].tolist() == refs[row][:n]
    assert sum(s.accepted for s in out.stats) > 0 and sum(s.verified - s.accepted for s in out.stats) > 0


# ---------------------------------------------------------------------------------------------- sampling is lossless
def test_rejection_verification_with_minus_inf_draft_logits_has_no_nan():
    """p_d is zero outside the draft vocabulary; a target with all its mass there always rejects and resamples from
    the target; the residual and the bonus distribution stay finite."""
    v, k = 6, 3
    draft_logits = torch.full((2, k, v), float("-inf"))
    draft_logits[..., :2] = torch.tensor([1.0, 0.0])  # draft vocabulary {0, 1}
    target_logits = torch.full((2, k + 1, v), float("-inf"))
    target_logits[0, ..., 4:] = 0.0  # row 0: all target mass outside the draft vocabulary
    target_logits[1] = torch.randn(k + 1, v)
    draft_tokens = torch.tensor([[0, 1, 0], [1, 0, 0]])
    sampling = SamplingParams(do_sample=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        res = verify(draft_tokens, draft_logits, target_logits, sampling, generator=g)
        assert res.num_accepted[0] == 0 and int(res.next_tokens[0]) in (4, 5)
    probs = torch.softmax(draft_logits, dim=-1)
    assert torch.isfinite(probs).all()
    res = rejection_verify(draft_tokens, probs, torch.softmax(target_logits, dim=-1), generator=g)
    assert 0 <= int(res.next_tokens[1]) < v


def _sampling_setup(candidates=None):
    target = make_target("llama", vocab_size=4, seed=3, sharpen=6.0)
    drafter = make_drafter(target, block_size=3, markov_rank=4, seed=4, draft_vocab_size=2, draft_candidates=candidates)
    drafter.set_draft_vocab([0, 2])  # tokens 1 and 3 can never be drafted
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0.0, 8.0, generator=torch.Generator().manual_seed(0))
        drafter.confidence_head.proj.weight.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    return target, drafter


def _tv_check(counts, exact, n_runs):
    empirical = counts / n_runs
    expected_tv = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n_runs)).sum().item()
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 2.5 * expected_tv, (tv, expected_tv)


@pytest.mark.parametrize("policy, candidates", [("fixed", None), ("scheduled", None), ("fixed", 1)])
def test_batched_sampling_matches_the_target_distribution(policy, candidates):
    """The first 3 tokens over V^3 = 64 outcomes from 3000 identical rows: the empirical distribution is within
    2.5x the TV expected from exact sampling of the enumerated target distribution, although the drafter can
    propose only 2 of the 4 tokens (half the target's mass here lies outside its vocabulary)."""
    target, drafter = _sampling_setup(candidates)
    prompt, rows, n_tokens = [1, 2, 3, 1], 3000, 3
    ids = torch.tensor([prompt] * rows)
    out = dspark_hf.generate(target, drafter, ids, torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=True,
                             temperature=0.9, top_k=3, policy=policy, sps=lambda b: 1.0 / (1.0 + 0.0004 * b),
                             generator=torch.Generator().manual_seed(7), return_dict_in_generate=True,
                             padded_pricing=False, measured_cost=False)  # per-row lengths from the curve as given
    codes = (out.sequences[:, len(prompt):] * torch.tensor([16, 4, 1])).sum(1)
    exact = exact_joint(target, prompt, n_tokens, 0.9, 3, None)
    assert exact.reshape(4, 4, 4)[:, [1, 3]].sum() > 0.2  # the target often continues outside the draft vocab
    _tv_check(torch.bincount(codes, minlength=64).float(), exact, rows)
    assert sum(s.accepted for s in out.stats) > 0 and sum(s.verified - s.accepted for s in out.stats) > 0


def test_hf_sampling_matches_the_target_distribution():
    """The same check through `target.generate(assistant_model=drafter, do_sample=True)` (HF's warpers run as full-
    vocabulary logits processors on the expanded draft logits)."""
    target, drafter = _sampling_setup()
    prompt, n_runs, n_tokens = [1, 2, 3, 1], 1000, 3
    exact = exact_joint(target, prompt, n_tokens, 0.8, None, 0.95)
    counts = torch.zeros(64)
    ids = torch.tensor([prompt])
    for run in range(n_runs):
        torch.manual_seed(run)
        out = target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=n_tokens,
                              temperature=0.8, top_p=0.95)
        new = out[0, len(prompt):].tolist()
        counts[sum(t * 4 ** (n_tokens - 1 - i) for i, t in enumerate(new))] += 1
    _tv_check(counts, exact, n_runs)


# ---------------------------------------------------------------------------------------------- losses by hand
def test_loss_terms_with_a_reduced_vocabulary_equal_a_hand_computation():
    """V = 5, draft ids -> target ids d2t = [0, 2, 3]. Slot 0: label 2 (draft id 1); slot 1: label 4, outside the
    draft vocabulary (CE masked, TV / c* kept: the target's mass on 1 and 4 is lost); slot 2 follows an OOV label
    (unreachable: dropped from every term)."""
    d2t = torch.tensor([0, 2, 3])
    draft = torch.tensor([[[1.0, 0.5, -1.0], [0.0, 2.0, 0.3], [0.2, 0.1, 0.0]]])  # [N=1, K=3, Vd=3]
    target = torch.tensor([[[0.0, 1.0, 2.0, 0.0, -1.0], [1.0, 0.0, 0.5, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 4, 0]])
    mask = torch.tensor([[True, True, True]])
    conf = torch.tensor([[0.3, -0.7, 1.0]])
    w = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=2.0)
    out = dspark_loss(draft, target, labels, mask, conf, w, draft_vocab=d2t)

    def softmax(xs):
        m = max(xs)
        e = [math.exp(x - m) for x in xs]
        return [x / sum(e) for x in e]

    pd = [softmax(draft[0, k].tolist()) for k in range(2)]
    pt = [softmax(target[0, k].tolist()) for k in range(2)]
    l1 = [sum(abs(pd[k][j] - pt[k][int(d2t[j])]) for j in range(3)) + pt[k][1] + pt[k][4] for k in range(2)]
    cstar = [1 - 0.5 * x for x in l1]
    wk = [1.0, math.exp(-1 / 2)]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    bce = [-(c * math.log(sig(z)) + (1 - c) * math.log(1 - sig(z))) for c, z in zip(cstar, [0.3, -0.7])]
    avg = lambda xs: sum(a * b for a, b in zip(wk, xs)) / sum(wk)  # noqa: E731
    ce = -math.log(pd[0][1])  # slot 0 only: label 2 = draft id 1
    assert float(out.ce) == pytest.approx(ce, rel=1e-5)
    assert float(out.tv) == pytest.approx(avg(l1), rel=1e-5)
    assert float(out.conf) == pytest.approx(avg(bce), rel=1e-5)
    assert float(out.total) == pytest.approx(0.1 * ce + 0.9 * avg(l1) + avg(bce), rel=1e-5)
    assert out.num_slots == 2
    assert out.accept_rate.tolist() == pytest.approx(cstar + [0.0], rel=1e-5, abs=1e-7)
    assert float(out.expected_tau) == pytest.approx(1 + cstar[0] + cstar[0] * cstar[1], rel=1e-5)
    # the exact full-vocabulary TV: the same as expanding p_d with zeros outside the draft vocabulary
    full_pd = torch.zeros(2, 5).index_copy(1, d2t, torch.tensor(pd))
    assert float((full_pd - torch.softmax(target[0, :2], -1)).abs().sum(-1)[0]) == pytest.approx(l1[0], rel=1e-5)
    # the identity mapping (every id draftable) reproduces the full-vocabulary loss
    full_draft = torch.randn(1, 3, 5)
    a = dspark_loss(full_draft, target, labels, mask, conf, w)
    b = dspark_loss(full_draft, target, labels, mask, conf, w, draft_vocab=torch.arange(5))
    for x, y in [(a.ce, b.ce), (a.tv, b.tv), (a.conf, b.conf), (a.total, b.total)]:
        assert float(x) == pytest.approx(float(y), rel=1e-5)


def test_loss_gradient_reaches_only_draft_logits_and_is_finite():
    d2t = torch.tensor([1, 3])
    draft = torch.randn(4, 3, 2, requires_grad=True)
    target = torch.randn(4, 3, 6) * 5
    labels = torch.randint(0, 6, (4, 3))
    out = dspark_loss(draft, target, labels, torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, 3), LossWeights(),
                      draft_vocab=d2t)
    out.total.backward()
    assert torch.isfinite(draft.grad).all() and torch.isfinite(out.total)


# ---------------------------------------------------------------------------------------------- vocabulary choice
def test_build_draft_vocab_counts_answer_tokens_only():
    examples = [TokenizedExample(id="a", input_ids=[9, 9, 9, 1, 2, 2, 3], loss_mask=[0, 0, 0, 1, 1, 1, 1]),
                TokenizedExample(id="b", input_ids=[8, 8, 2, 3, 3, 5], loss_mask=[0, 0, 1, 1, 1, 1])]
    counts = answer_token_counts(examples, 10)
    assert counts.tolist() == [0, 1, 3, 3, 0, 1, 0, 0, 0, 0]  # prompt tokens (8, 9) are not counted
    assert build_draft_vocab(examples, 2, vocab_size=10).tolist() == [2, 3]
    assert build_draft_vocab(examples, 3, vocab_size=10).tolist() == [1, 2, 3]  # tie 1 vs 5: the smaller id
    assert build_draft_vocab(examples, 3, always_include=[7], vocab_size=10).tolist() == [2, 3, 7]
    assert build_draft_vocab(examples, 6, vocab_size=10).tolist() == [0, 1, 2, 3, 4, 5]  # unseen ids fill last
    assert build_draft_vocab(examples, 2).tolist() == [2, 3]  # vocab size inferred from the data
    with pytest.raises(ValueError, match="always_include"):
        draft_vocab_from_counts(counts, 1, always_include=[4, 7])
    report = coverage_report(examples, 10, sizes=(1, 2, 4, 16))
    assert [r["coverage"] for r in report["sizes"]] == pytest.approx([3 / 8, 6 / 8, 8 / 8, 1.0])
    assert report["answer_tokens"] == 8 and report["distinct_answer_tokens"] == 4


# ---------------------------------------------------------------------------------------------- training
def test_training_with_a_reduced_vocabulary(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=40)
    config = DSparkTrainingConfig(output_dir=str(tmp_path / "run"), max_steps=4, batch_size=4, num_anchors=8,
                                  block_size=4, markov_rank=16, learning_rate=3e-3, warmup_steps=1, save_every=1000,
                                  log_every=1, resume=False, heldout_fraction=0.1, draft_candidates=None,
                                  draft_vocab_size=24)
    torch.manual_seed(0)
    trainer = DSparkTrainer(config, target, examples, progress=False)
    drafter = trainer.drafter
    assert drafter.config.draft_vocab_size == 24
    assert torch.equal(drafter.d2t, build_draft_vocab(trainer.train_examples, 24, vocab_size=96))
    assert drafter.markov_head.markov_w2.weight.shape[0] == 24
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    final = trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and 0 <= r["tv"] <= 2 for r in log)
    changed = [n for n, p in drafter.named_parameters() if not torch.equal(before[n], p.detach())]
    assert sorted(changed) == sorted(before), set(before) - set(changed)
    reloaded = DSparkDrafter.from_pretrained(final, target=target)
    assert torch.equal(reloaded.d2t, drafter.d2t)
    ids = torch.tensor([examples[0].input_ids[:8]])
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False),
                       target.generate(ids, assistant_model=reloaded, max_new_tokens=16, do_sample=False))
    # a size >= V means the full vocabulary
    full = build_drafter(DSparkTrainingConfig(draft_vocab_size=500, draft_candidates=None), target, examples)
    assert full.d2t is None


def test_draft_candidates_zero_scores_the_whole_vocabulary_even_when_the_config_restricts(target):
    """`draft(candidates=0)` overrides `config.draft_candidates`: every token gets a finite logit and the Markov bias of
    its own W2 row (it used to fall back to the config's top-M in the sequential loop)."""
    drafter = make_drafter(target, block_size=4, draft_candidates=8)
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    restricted = cached_draft(drafter, target, ids, 9)
    full = cached_draft(drafter, target, ids, 9, candidates=0)
    assert restricted.sparse_logits is not None and torch.isfinite(restricted.logits).sum(-1).max() == 8
    assert full.sparse_logits is None and torch.isfinite(full.logits).all()
    cache = drafter.new_cache()
    drafter.append_context(cache, drafter.context_features(target_hidden(target, ids))[:, :9], torch.arange(9)[None])
    with torch.no_grad():
        hidden = drafter.draft_slots(drafter.block_states(cache, ids[:, 9]))
        first = drafter.draft_logits(hidden[:, :1])[:, 0] + drafter.markov_head.project(
            drafter.markov_head.step(drafter.to_draft_inputs(ids[:, 9]), hidden[:, 0], None)[0]).float()
    assert torch.allclose(full.logits[:, 0].float(), first, atol=1e-5)
