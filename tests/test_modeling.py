"""The drafter as a Transformers model: layouts agree, heads agree, checkpoints round-trip, bad input is refused."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import cached_draft, make_drafter, make_target, target_hidden
from dspark_hf import DSparkDrafter
from dspark_hf.models.sequential_heads import build_sequential_head


@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn", "none"])
def test_training_forward_agrees_with_cached_draft(target, head):
    drafter = make_drafter(target, sequential_head=head, block_size=5)
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    hs = target_hidden(target, ids)
    anchors = torch.tensor([[6, 13]])
    with torch.no_grad():
        out = drafter(ids[:, [6, 13]], anchors, drafter.context_features(hs))
    for a, pos in enumerate([6, 13]):
        block = cached_draft(drafter, target, ids, pos)
        ref = drafter.sample_block(out.hidden_states[:, a], out.logits[:, a].float(), ids[:, pos])
        assert torch.equal(block.tokens, ref.tokens)
        assert torch.allclose(block.logits, ref.logits, atol=1e-4)
        if head != "none":
            assert torch.allclose(block.confidences, ref.confidences, atol=1e-5)
            assert ((block.confidences > 0) & (block.confidences < 1)).all()


def test_context_appended_in_pieces_equals_one_shot(target, drafter):
    ids = torch.randint(1, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    one = cached_draft(drafter, target, ids, 12)
    pieces = cached_draft(drafter, target, ids, 12, chunks=(3, 4, 9))
    assert torch.equal(one.tokens, pieces.tokens)
    assert torch.allclose(one.logits, pieces.logits, atol=1e-5)


def test_cache_holes_and_compaction_are_exact(target, drafter):
    """Masked hole columns (rejected slots in a batch) change nothing, before or after compaction."""
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    feats = drafter.context_features(target_hidden(target, ids))
    ref = cached_draft(drafter, target, ids, 10)
    cache = drafter.new_cache()
    junk = torch.randn(1, 3, feats.shape[-1])
    drafter.append_context(cache, feats[:, :5], torch.arange(5)[None])
    drafter.append_context(cache, junk, torch.arange(5, 8)[None], valid=torch.zeros(1, 3, dtype=torch.bool))
    drafter.append_context(cache, feats[:, 5:10], torch.arange(5, 10)[None])
    holed = drafter.draft(cache, ids[:, 10])
    cache.compact()
    assert cache.num_columns == 10 and cache.num_holes == 0
    compacted = drafter.draft(cache, ids[:, 10])
    for block in (holed, compacted):
        assert torch.equal(block.tokens, ref.tokens)
        assert torch.allclose(block.logits, ref.logits, atol=1e-5)


@pytest.mark.parametrize("kind", ["markov", "gated_markov", "rnn"])
def test_sequential_step_equals_teacher_forcing(kind):
    torch.manual_seed(0)
    head = build_sequential_head(kind, vocab_size=30, rank=8, hidden_size=12)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.5)
    prev = torch.randint(0, 30, (3, 5))
    hidden = torch.randn(3, 5, 12)
    tf_bias, tf_feat = head.teacher_forced(prev, hidden)
    state = head.init_state(3, hidden.device, hidden.dtype)
    cands = torch.randint(0, 30, (3, 6))
    for k in range(5):
        latent, feat, state = head.step(prev[:, k], hidden[:, k], state)
        bias = head.project(latent)
        assert torch.allclose(bias, tf_bias[:, k], atol=1e-5)
        assert torch.allclose(feat, tf_feat[:, k])
        # restricted to candidate ids: exactly the full bias at those ids
        assert torch.allclose(head.project(latent, cands), bias.gather(1, cands), atol=1e-5)
    if kind == "rnn":  # the RNN state carries the whole prefix: changing x_0 changes the bias at slot 3
        other = prev.clone()
        other[:, 0] = (other[:, 0] + 1) % 30
        assert not torch.allclose(head.teacher_forced(other, hidden)[0][:, 3], tf_bias[:, 3])


@pytest.mark.parametrize("kind", ["markov", "gated_markov"])
def test_teacher_forced_bias_with_repeated_previous_tokens_equals_one_product_per_slot(kind):
    """The plain Markov head computes its training bias once per distinct previous token (a batch repeats most of
    them); values, the W1 features and every gradient equal the per-slot product W2(W1[x]); the gated head, whose
    latent reads h_k, still gives slots with the same previous token different biases."""
    torch.manual_seed(0)
    head = build_sequential_head(kind, vocab_size=40, rank=8, hidden_size=12)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.5)
    prev = torch.randint(0, 6, (9, 5))  # 45 slots, at most 6 distinct tokens
    hidden = torch.randn(9, 5, 12, requires_grad=True)
    grad_out = torch.randn(9, 5, 40)
    bias, feat = head.teacher_forced(prev, hidden)
    (bias * grad_out).sum().backward()
    fast = {name: p.grad.clone() for name, p in head.named_parameters()}
    head.zero_grad()
    feat_ref = head.markov_w1(prev)
    ref = head.markov_w2(head._latent(feat_ref, hidden))
    (ref * grad_out).sum().backward()
    assert torch.equal(bias, ref) and torch.equal(feat, feat_ref)
    for name, p in head.named_parameters():
        assert torch.allclose(fast[name], p.grad, atol=1e-5, rtol=1e-5), name
    same = (prev[:, 1] == prev[0, 1]).nonzero()[:, 0]
    assert len(same) > 1
    rows = bias[same, 1]
    assert torch.allclose(rows, rows[:1].expand_as(rows)) == (kind == "markov")


def test_candidate_restriction_is_an_exact_distribution_over_the_candidates(target):
    drafter = make_drafter(target, block_size=5)
    ids = torch.randint(1, 96, (1, 14), generator=torch.Generator().manual_seed(7))
    full = cached_draft(drafter, target, ids, 11)
    hs = target_hidden(target, ids)
    cache = drafter.new_cache()
    drafter.append_context(cache, drafter.context_features(hs)[:, :11], torch.arange(11)[None])
    # every candidate: the same drafts and logits as the full vocabulary
    every = drafter.draft(cache, ids[:, 11], candidates=96)
    assert torch.equal(every.tokens, full.tokens) and torch.allclose(every.logits, full.logits, atol=1e-5)
    few = drafter.draft(cache, ids[:, 11], candidates=8)
    finite = torch.isfinite(few.logits)
    assert (finite.sum(-1) == 8).all()  # zero probability outside the 8 candidates of each slot
    assert finite.gather(2, few.tokens[..., None]).all()  # drafts are among them
    # slot 0 (previous token = the anchor in both): within the candidates, the full-vocabulary corrected logits
    assert torch.allclose(few.logits[:, 0][finite[:, 0]], full.logits[:, 0][finite[:, 0]], atol=1e-5)
    sampled = drafter.draft(cache, ids[:, 11], candidates=8, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(sampled.logits.gather(2, sampled.tokens[..., None])).all()


def test_sts_temperatures_scale_the_confidence_logit(target, drafter):
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    raw = cached_draft(drafter, target, ids, 8)
    drafter.set_sts_temperatures([2.0, 1.0, 0.5, 3.0])
    scaled = cached_draft(drafter, target, ids, 8)
    assert torch.allclose(scaled.confidence_logits, raw.confidence_logits)
    expected = torch.sigmoid(raw.confidence_logits / torch.tensor([2.0, 1.0, 0.5, 3.0]))
    assert torch.allclose(scaled.confidences, expected)
    assert drafter.config.sts_temperatures == [2.0, 1.0, 0.5, 3.0]
    with pytest.raises(ValueError, match="sts_temperatures"):
        drafter.set_sts_temperatures([1.0])


def test_mask_token_id_variant_and_learned_mask(target):
    learned = make_drafter(target)
    assert learned.mask_embedding is not None
    by_id = make_drafter(target, mask_token_id=5)
    assert by_id.mask_embedding is None
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    assert cached_draft(by_id, target, ids, 8).tokens.shape == (1, 4)


def test_save_load_round_trip_gives_identical_drafts_and_small_checkpoint(tmp_path, target, drafter):
    drafter.set_sts_temperatures([1.5, 1.2, 1.1, 1.0])
    drafter.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert not any("embed" in k and "mask" not in k for k in weights), sorted(weights)
    assert not any("lm_head" in k for k in weights)
    assert sum(v.numel() for v in weights.values()) == sum(p.numel() for p in drafter.parameters())
    loaded = DSparkDrafter.from_pretrained(tmp_path, target=target).eval()
    assert loaded.config.sts_temperatures == [1.5, 1.2, 1.1, 1.0]
    ids = torch.randint(1, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    a, b = cached_draft(drafter, target, ids, 11), cached_draft(loaded, target, ids, 11)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logits, b.logits)
    assert torch.allclose(a.confidences, b.confidences)


def test_unbound_drafter_says_how_to_bind(tmp_path, target, drafter):
    drafter.save_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="bind_target"):
        cached_draft(loaded, target, torch.ones(1, 5, dtype=torch.long), 3)


def test_trust_remote_code_folder_loads_in_a_fresh_process(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    expected = cached_draft(drafter, target, ids, 9).tokens.tolist()
    script = textwrap.dedent(f"""
        import json, sys, torch
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'target')!r}).eval()
        drafter = AutoModel.from_pretrained({str(tmp_path / 'drafter')!r}, trust_remote_code=True).eval()
        drafter.bind_target(target)
        ids = torch.tensor({ids.tolist()})
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        cache = drafter.new_cache()
        drafter.append_context(cache, drafter.context_features(hs)[:, :9], torch.arange(9)[None])
        block = drafter.draft(cache, ids[:, 9])
        print(json.dumps({{"tokens": block.tokens.tolist(), "module": type(drafter).__module__,
                          "imported": any(m.startswith("dspark_hf") for m in sys.modules)}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] is False
    assert result["module"].startswith("transformers_modules")
    assert result["tokens"] == expected


def test_mismatched_target_is_refused(drafter):
    other_vocab = make_target("llama", vocab_size=64)
    with pytest.raises(ValueError, match="vocab size"):
        drafter.bind_target(other_vocab)
    deeper = make_target("llama", layers=6)
    with pytest.raises(ValueError, match="layer count"):
        drafter.bind_target(deeper)
    with pytest.raises(ValueError, match="vocab size"):
        other_vocab.generate(torch.ones(1, 3, dtype=torch.long), assistant_model=drafter, max_new_tokens=3)


def test_out_of_range_layers_and_bad_block_size_are_refused(target):
    with pytest.raises(ValueError, match="target_layer_ids"):
        DSparkDrafter.from_target(target, target_layer_ids=[1, 3])  # 3 is the last of 4 layers
    with pytest.raises(ValueError, match="target_layer_ids"):
        DSparkDrafter.from_target(target, target_layer_ids=[9])
    with pytest.raises(ValueError, match="block_size"):
        DSparkDrafter.from_target(target, block_size=0)


def _corrupt(folder: Path, how: str) -> None:
    weights = folder / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "missing_tensor":
        from safetensors.torch import save_file
        tensors = load_file(weights)
        tensors.pop(next(k for k in tensors if k.startswith("fc.")))
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "wrong_shape":
        from safetensors.torch import save_file
        tensors = load_file(weights)
        key = next(k for k in tensors if k.startswith("fc."))
        tensors[key] = torch.zeros(3, 3)
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "bad_config":
        (folder / "config.json").write_text("{ not json")


@pytest.mark.parametrize("how", ["truncated", "missing_tensor", "wrong_shape", "bad_config"])
def test_corrupted_checkpoint_is_a_clear_error(tmp_path, drafter, how):
    drafter.save_pretrained(tmp_path)
    _corrupt(tmp_path, how)
    with pytest.raises((OSError, ValueError, RuntimeError)) as info:
        DSparkDrafter.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value) or "config" in str(info.value).lower()
