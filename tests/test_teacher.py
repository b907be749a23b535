"""The cached teacher log-normalizer (`training/teacher.py`): with a reduced draft vocabulary, the loss computed from the
draft rows' teacher logits plus the cached full-vocabulary logsumexp equals the loss from the full teacher logits; the
normalizers are computed once per example, persist atomically next to the feature cache, reload without recomputation,
and a folder written for another target is refused."""

import math

import pytest
import torch
from safetensors.torch import save_file

from conftest import learnable_examples, make_target
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.features import pad_examples
from dspark_hf.training.losses import LossWeights, dspark_loss
from dspark_hf.training.teacher import TeacherNormalizer, TeacherTopK, log_normalizer
from dspark_hf.training.trainer import DSparkTrainer


def _loss_inputs(n=12, k=5, v=80, vd=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(v, generator=g)[:vd].sort().values
    target_logits = torch.randn(n, k, v, generator=g) * 3
    labels = torch.randint(0, v, (n, k), generator=g)
    labels[:, :3] = d2t[torch.randint(0, vd, (n, 3), generator=g)]  # mostly reachable
    mask = torch.ones(n, k, dtype=torch.bool)
    mask[-2:, 3:] = False
    draft_logits = torch.randn(n, k, vd, generator=g, requires_grad=True)
    conf = torch.randn(n, k, generator=g)
    return d2t, target_logits, labels, mask, draft_logits, conf


def test_loss_from_draft_rows_and_cached_normalizer_equals_the_full_teacher():
    d2t, target_logits, labels, mask, draft_logits, conf = _loss_inputs()
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=4.0)
    full = dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, draft_vocab=d2t)
    lse = torch.logsumexp(target_logits, dim=-1)
    cached = dspark_loss(draft_logits, target_logits[..., d2t], labels, mask, conf, weights, draft_vocab=d2t,
                         target_lse=lse)
    for name in ("total", "ce", "tv", "conf", "expected_tau"):
        assert torch.allclose(getattr(full, name), getattr(cached, name), atol=1e-5), name
    assert torch.allclose(full.accept_rate, cached.accept_rate, atol=1e-6)
    g_full, = torch.autograd.grad(full.total, draft_logits)
    g_cached, = torch.autograd.grad(cached.total, draft_logits)
    assert torch.allclose(g_full, g_cached, atol=1e-6)
    # a wrong normalizer changes the loss (the argument is used, not ignored)
    shifted = dspark_loss(draft_logits, target_logits[..., d2t], labels, mask, conf, weights, draft_vocab=d2t,
                          target_lse=lse + 0.5)
    assert not torch.allclose(full.tv, shifted.tv, atol=1e-3)


def test_bad_normalizer_inputs_are_clear_errors():
    d2t, target_logits, labels, mask, draft_logits, conf = _loss_inputs()
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=4.0)
    lse = torch.logsumexp(target_logits, dim=-1)
    with pytest.raises(ValueError, match="draft vocabulary's"):  # full logits passed with a normalizer
        dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, draft_vocab=d2t, target_lse=lse)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, target_lse=lse)


def test_log_normalizer_is_logsumexp_in_chunks():
    head = torch.nn.Linear(8, 50, bias=True)
    hidden = torch.randn(37, 8)
    assert torch.allclose(log_normalizer(head, hidden, chunk=5), torch.logsumexp(head(hidden), -1), atol=1e-5)


def test_normalizers_are_computed_once_persisted_and_reloaded(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=6)
    head = target.get_output_embeddings()
    calls = []

    def lm_head(h):
        calls.append(h.shape[0])
        return head(h)

    ids, _, attn = pad_examples(examples[:4])
    attn[1, 20:] = 0  # a shorter (padded) row
    final = torch.randn(4, ids.shape[1], target.config.hidden_size)
    folder = tmp_path / "teacher-lse"
    teacher = TeacherNormalizer(lm_head, folder=folder, fingerprint="fp-a")
    out = teacher(examples[:4], final, attn)
    assert out.shape == attn.shape and teacher.computed == 4
    expected = torch.logsumexp(head(final[1, :20]), -1)
    assert torch.allclose(out[1, :20], expected, atol=1e-5) and torch.isnan(out[1, 20:]).all()  # padding: NaN
    before = len(calls)
    again = teacher(examples[:4], final * 0, attn)  # memoised: the (changed) hidden states are not read again
    assert len(calls) == before and torch.equal(again.nan_to_num(), out.nan_to_num())
    path = teacher.save(tag="r0")
    assert path is not None and path.exists() and teacher.save(tag="r0") is None  # nothing new: no second file
    assert not list(folder.glob(".*.tmp"))
    reloaded = TeacherNormalizer(lm_head, folder=folder, fingerprint="fp-a")
    assert len(reloaded) == 4
    calls.clear()
    assert torch.equal(reloaded(examples[:4], final, attn).nan_to_num(), out.nan_to_num())
    assert not calls and reloaded.computed == 0
    # a row longer than what was stored (a larger max_length) is recomputed, not truncated
    attn_long = torch.ones_like(attn)
    reloaded(examples[1:2], final[1:2], attn_long[1:2])
    assert reloaded.computed == 1
    reloaded.save(tag="r0")  # a second file holds the longer vector: it wins over the shorter one on reload
    key = next(k for k in reloaded.values if k.startswith(examples[1].id + "#"))
    assert TeacherNormalizer(lm_head, folder=folder, fingerprint="fp-a").values[key].shape[0] == attn.shape[1]
    # a leftover temporary file (an interrupted save) is ignored
    save_file({"junk": torch.zeros(3)}, folder / ".teacher-lse-r0123-1.safetensors.tmp")
    assert "junk" not in TeacherNormalizer(lm_head, folder=folder, fingerprint="fp-a").values
    with pytest.raises(ValueError, match="another folder"):
        TeacherNormalizer(lm_head, folder=folder, fingerprint="fp-b")


def test_only_answer_positions_are_computed_with_a_loss_mask():
    target = make_target("llama")
    examples = learnable_examples(target, count=2)  # 8 prompt tokens, 24 answer tokens
    head = target.get_output_embeddings()
    rows = []
    teacher = TeacherNormalizer(lambda h: (rows.append(h.shape[0]), head(h))[1])
    ids, loss, attn = pad_examples(examples)
    final = torch.randn(2, ids.shape[1], target.config.hidden_size)
    out = teacher(examples, final, attn, loss)
    assert sum(rows) == int(loss.sum()) == 48  # the answers' positions only
    assert torch.isnan(out[loss == 0]).all() and not torch.isnan(out[loss == 1]).any()
    assert torch.allclose(out[0, 8:], torch.logsumexp(head(final[0, 8:]), -1), atol=1e-5)


@pytest.mark.parametrize("use_cache", [False, True])
def test_trainer_loss_is_the_same_with_and_without_the_cached_normalizer(tmp_path, use_cache):
    target = make_target("llama")
    examples = learnable_examples(target, count=24)

    def loss(cache: bool, sub: str):
        config = DSparkTrainingConfig(output_dir=str(tmp_path / sub), max_steps=2, batch_size=4, num_anchors=8,
                                      block_size=4, markov_rank=16, learning_rate=3e-3, warmup_steps=1,
                                      save_every=1, log_every=1, resume=False, heldout_fraction=0.1,
                                      draft_candidates=None, draft_vocab_size=24, cache_teacher_normalizer=cache,
                                      feature_cache=str(tmp_path / f"features-{sub}") if use_cache else None,
                                      feature_cache_dtype="float32")
        torch.manual_seed(0)
        trainer = DSparkTrainer(config, target, examples, progress=False)
        out = trainer.compute_loss(trainer.micro_batch(0), 0)
        return trainer, out

    plain, out_plain = loss(False, "plain")
    cached, out_cached = loss(True, "cached")
    assert plain.teacher is None and cached.teacher is not None and cached.teacher.computed == 4
    for name in ("total", "ce", "tv", "conf"):
        a, b = float(getattr(out_plain, name).detach()), float(getattr(out_cached, name).detach())
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (name, a, b)
    cached.train()  # checkpoints write the normalizers next to the feature cache
    if use_cache:
        assert list((tmp_path / "features-cached" / "teacher-lse").glob("teacher-lse-r0*.safetensors"))


def test_a_supervised_slot_without_a_normalizer_is_an_error_not_a_silent_nan(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=24)
    config = DSparkTrainingConfig(output_dir=str(tmp_path / "run"), max_steps=1, batch_size=4, num_anchors=8,
                                  block_size=4, markov_rank=16, resume=False, heldout_fraction=0.1,
                                  draft_candidates=None, draft_vocab_size=24)
    trainer = DSparkTrainer(config, target, examples, progress=False)
    batch = trainer.micro_batch(0)
    trainer.compute_loss(batch, 0)
    for key in trainer.teacher.values:  # as if the answers' positions had never been computed
        trainer.teacher.values[key] = torch.full_like(trainer.teacher.values[key], float("nan"))
    with pytest.raises(RuntimeError, match="supervised slot"):
        trainer.compute_loss(batch, 0)


# ---------------------------------------------------------------- the sparse teacher (teacher_topk)
def _topk_of(target_logits, d2t, k):
    logp = target_logits.float().log_softmax(-1)[..., d2t]  # full-vocabulary log-probs of the draft ids
    top = logp.topk(k, dim=-1)
    return top.indices, top.values


def test_sparse_teacher_with_every_draft_id_is_the_dense_loss():
    d2t, target_logits, labels, mask, draft_logits, conf = _loss_inputs()
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=4.0)
    dense = dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, draft_vocab=d2t)
    sparse = dspark_loss(draft_logits, None, labels, mask, conf, weights, draft_vocab=d2t,
                         target_topk=_topk_of(target_logits, d2t, d2t.shape[0]))
    for name in ("total", "ce", "tv", "conf", "expected_tau"):
        assert torch.allclose(getattr(dense, name), getattr(sparse, name), atol=1e-5), name
    g_dense, = torch.autograd.grad(dense.total, draft_logits)
    g_sparse, = torch.autograd.grad(sparse.total, draft_logits)
    assert torch.allclose(g_dense, g_sparse, atol=1e-6)


def test_sparse_teacher_is_an_upper_bound_exact_when_the_teacher_mass_is_in_its_top_k():
    d2t, target_logits, labels, mask, draft_logits, conf = _loss_inputs()
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=4.0)
    dense = dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, draft_vocab=d2t)
    sparse = dspark_loss(draft_logits, None, labels, mask, conf, weights, draft_vocab=d2t,
                         target_topk=_topk_of(target_logits, d2t, 4))
    assert float(sparse.tv.detach()) > float(dense.tv.detach()) + 1e-3  # flat random teacher: mass beyond its top 4, a looser bound
    assert (sparse.accept_rate <= dense.accept_rate + 1e-6).all()  # c* a lower bound
    assert torch.allclose(sparse.ce, dense.ce)  # CE does not read the teacher
    # a peaked teacher (its draft-vocabulary mass on 3 ids per position): top 3 gives the exact loss
    peaked = torch.full_like(target_logits, -40.0)
    g = torch.Generator().manual_seed(1)
    n, k = labels.shape
    outside_id = next(v for v in range(peaked.shape[-1]) if v not in set(d2t.tolist()))
    for i in range(n):
        for j in range(k):
            peaked[i, j, d2t[torch.randperm(d2t.shape[0], generator=g)[:3]]] = torch.randn(3, generator=g) * 2
            peaked[i, j, outside_id] = 1.0  # mass outside the draft vocabulary: in r, still exact
    exact = dspark_loss(draft_logits, peaked, labels, mask, conf, weights, draft_vocab=d2t)
    sparse3 = dspark_loss(draft_logits, None, labels, mask, conf, weights, draft_vocab=d2t,
                          target_topk=_topk_of(peaked, d2t, 3))
    for name in ("total", "tv", "conf"):
        assert torch.allclose(getattr(exact, name), getattr(sparse3, name), atol=1e-5), name


def test_sparse_teacher_inputs_are_clear_errors():
    d2t, target_logits, labels, mask, draft_logits, conf = _loss_inputs()
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=4.0)
    top = _topk_of(target_logits, d2t, 4)
    with pytest.raises(ValueError, match="exactly one teacher"):
        dspark_loss(draft_logits, target_logits, labels, mask, conf, weights, draft_vocab=d2t, target_topk=top)
    with pytest.raises(ValueError, match="exactly one teacher"):
        dspark_loss(draft_logits, None, labels, mask, conf, weights, draft_vocab=d2t)
    with pytest.raises(ValueError, match="draft ids"):
        dspark_loss(draft_logits, None, labels, mask, conf, weights, target_topk=top)
    with pytest.raises(ValueError, match=r"\[N, K, k\]"):
        dspark_loss(draft_logits, None, labels, mask, conf, weights, draft_vocab=d2t,
                    target_topk=(top[0][:, :2], top[1][:, :2]))
    with pytest.raises(ValueError, match="teacher_topk"):
        DSparkTrainingConfig(output_dir="x", teacher_topk=16)  # no reduced draft vocabulary
    with pytest.raises(ValueError, match="teacher_topk"):
        DSparkTrainingConfig(output_dir="x", teacher_topk=16, draft_vocab_size=24, cache_teacher_normalizer=False)
    with pytest.raises(ValueError, match="teacher_topk must be"):
        TeacherTopK(lambda h: h, 30, torch.arange(24))


def test_top_k_entries_are_computed_once_persisted_and_refused_for_another_draft_vocabulary(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=3)  # 8 prompt tokens, 24 answer tokens
    head = target.get_output_embeddings()
    d2t = torch.arange(0, 48, 2)  # 24 draft ids
    rows = []

    def draft_head(h):
        rows.append(h.shape[0])
        return head(h)[..., d2t]

    ids, loss, attn = pad_examples(examples)
    final = torch.randn(3, ids.shape[1], target.config.hidden_size)
    lse = torch.logsumexp(head(final), -1)
    folder = tmp_path / "topk"
    store = TeacherTopK(draft_head, 5, d2t, folder=folder, fingerprint="fp-a")
    top_ids, top_logp = store(examples, final, attn, loss, lse)
    assert sum(rows) == int(loss.sum()) and store.computed == 3  # the answers' positions only
    expect = head(final[1, 8:]).log_softmax(-1)[:, d2t].topk(5, dim=-1)
    assert torch.equal(top_ids[1, 8:], expect.indices)
    assert torch.allclose(top_logp[1, 8:], expect.values, atol=2e-2)  # stored as float16
    assert torch.isinf(top_logp[loss == 0]).all()  # prompt positions: probability 0
    rows.clear()
    store(examples, final * 0, attn, loss, lse)
    assert not rows  # memoised
    assert store.save(tag="r0") is not None and store.save(tag="r0") is None
    reloaded = TeacherTopK(draft_head, 5, d2t, folder=folder, fingerprint="fp-a")
    again = reloaded(examples, final, attn, loss, lse)
    assert not rows and reloaded.computed == 0 and len(reloaded) == 3
    assert torch.equal(again[0], top_ids) and torch.equal(again[1], top_logp)
    for bad in (dict(k=4, draft_vocab=d2t, fingerprint="fp-a"), dict(k=5, draft_vocab=d2t + 1, fingerprint="fp-a"),
                dict(k=5, draft_vocab=d2t, fingerprint="fp-b")):
        with pytest.raises(ValueError, match="another setting"):
            TeacherTopK(draft_head, bad["k"], bad["draft_vocab"], folder=folder, fingerprint=bad["fingerprint"])


def test_trainer_with_the_sparse_teacher_trains_and_keeps_its_entries(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=24)

    def build(topk, sub):
        config = DSparkTrainingConfig(output_dir=str(tmp_path / sub), max_steps=3, batch_size=4, num_anchors=8,
                                      block_size=4, markov_rank=16, learning_rate=3e-3, warmup_steps=1,
                                      save_every=1, log_every=1, resume=False, heldout_fraction=0.1,
                                      draft_candidates=None, draft_vocab_size=24, teacher_topk=topk,
                                      feature_cache=str(tmp_path / "features"), feature_cache_dtype="float32")
        torch.manual_seed(0)
        return DSparkTrainer(config, target, examples, progress=False)

    dense, sparse_all, sparse = build(None, "dense"), build(24, "all"), build(4, "top4")
    out_dense = dense.compute_loss(dense.micro_batch(0), 0)
    out_all = sparse_all.compute_loss(sparse_all.micro_batch(0), 0)
    out_top = sparse.compute_loss(sparse.micro_batch(0), 0)
    assert dense.teacher_topk is None and sparse.teacher_topk.computed == 4
    for name in ("total", "ce", "tv", "conf"):  # k = the whole draft vocabulary: the dense loss
        a, b = float(getattr(out_dense, name).detach()), float(getattr(out_all, name).detach())
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4), (name, a, b)
    assert float(out_top.tv) >= float(out_dense.tv) - 1e-4 and math.isfinite(float(out_top.total))
    out_top.total.backward()  # gradients reach the drafter
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in sparse.drafter.parameters())
    sparse.drafter.zero_grad()
    sparse.train()
    assert (tmp_path / "top4" / "final").exists()
    saved = list((tmp_path / "features").glob("teacher-topk4-*/teacher-topk-r0*.safetensors"))
    assert saved
