"""Training: data, anchors, losses by hand, online == offline features, learning, exact resume, bad input."""

import json
import math
from pathlib import Path

import pytest
import torch

import dspark_hf
from conftest import learnable_examples, make_drafter, make_target, make_tokenizer
from dspark_hf.training.data import (GenerationRecipe, TokenizedExample, _write_shard, generate_responses,
                                     read_examples, sample_anchors, summarize_data)
from dspark_hf.training.features import FeatureCache, OnlineFeatures, build_feature_cache
from dspark_hf.training.losses import LossWeights, dspark_loss, position_weights
from dspark_hf.training.trainer import (DSparkTrainer, build_drafter, eval_prompts, heldout_prompt_ids, split_examples,
                                       subset_examples)
from dspark_hf.training.config import DSparkTrainingConfig, load_training_config


# ---------------------------------------------------------------------------------------------- anchors
def test_anchor_sampling_respects_the_mask():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    anchors, label_mask = sample_anchors(mask, num_anchors=100, block_size=3)
    # p valid iff mask[p] and mask[p+1]: 2, 3, 6, 7, 8
    assert anchors.tolist() == [2, 3, 6, 7, 8]
    # slot k of anchor p is supervised while labels p+1..p+k+1 stay in the mask and the sequence
    assert label_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
    few, _ = sample_anchors(mask, num_anchors=2, block_size=3, generator=torch.Generator().manual_seed(0))
    assert len(few) == 2 and set(few.tolist()) <= {2, 3, 6, 7, 8}


# ---------------------------------------------------------------------------------------------- losses by hand
def test_each_loss_term_equals_a_hand_computation():
    draft = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # [N=1, K=2, V=3]
    target = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 3.0, 0.0]]])
    labels = torch.tensor([[0, 2]])
    mask = torch.tensor([[True, True]])
    conf = torch.tensor([[0.5, -1.0]])
    w = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=2.0)
    out = dspark_loss(draft, target, labels, mask, conf, w)
    pd = [[math.exp(2) / (math.exp(2) + 2), 1 / (math.exp(2) + 2), 1 / (math.exp(2) + 2)],
          [1 / (math.e + 2), math.e / (math.e + 2), 1 / (math.e + 2)]]
    pt = [[1 / 3] * 3, [1 / (math.exp(3) + 2), math.exp(3) / (math.exp(3) + 2), 1 / (math.exp(3) + 2)]]
    wk = [1.0, math.exp(-1 / 2)]
    ce = [-math.log(pd[0][0]), -math.log(pd[1][2])]
    l1 = [sum(abs(a - b) for a, b in zip(pd[k], pt[k])) for k in range(2)]
    cstar = [1 - 0.5 * x for x in l1]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    bce = [-(c * math.log(sig(z)) + (1 - c) * math.log(1 - sig(z))) for c, z in zip(cstar, [0.5, -1.0])]
    avg = lambda xs: sum(a * b for a, b in zip(wk, xs)) / sum(wk)  # noqa: E731
    assert float(out.ce) == pytest.approx(avg(ce), rel=1e-5)
    assert float(out.tv) == pytest.approx(avg(l1), rel=1e-5)
    assert float(out.conf) == pytest.approx(avg(bce), rel=1e-5)
    assert float(out.total) == pytest.approx(0.1 * avg(ce) + 0.9 * avg(l1) + avg(bce), rel=1e-5)
    assert out.accept_rate.tolist() == pytest.approx(cstar, rel=1e-5)
    assert float(out.expected_tau) == pytest.approx(1 + cstar[0] + cstar[0] * cstar[1], rel=1e-5)
    # a masked slot contributes nothing
    masked = dspark_loss(draft, target, labels, torch.tensor([[True, False]]), conf, w)
    assert float(masked.ce) == pytest.approx(ce[0], rel=1e-5)
    assert position_weights(3, 2.0).tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])


@pytest.mark.parametrize("sparse", [False, True])
def test_an_unweighted_tv_term_is_reported_and_adds_no_gradient(sparse):
    """DFlash (alpha_tv = alpha_conf = 0) still reports TV and c*, but its gradient is the CE term's alone; with a
    weight the TV term's gradient is there (dense teacher and the sparse top-k teacher alike)."""
    g = torch.Generator().manual_seed(3)
    n, k, vd = 4, 3, 10
    d2t = torch.arange(0, 2 * vd, 2)  # draft ids -> even target ids
    draft = torch.randn(n, k, vd, generator=g)
    target = torch.randn(n, k, 2 * vd, generator=g)
    labels = d2t[torch.randint(0, vd, (n, k), generator=g)]
    mask = torch.ones(n, k, dtype=torch.bool)
    teacher = {"target_logits": target}
    if sparse:
        logp = torch.log_softmax(target, dim=-1)[..., d2t]
        top = logp.topk(4, dim=-1)
        teacher = {"target_logits": None, "target_topk": (top.indices, top.values)}

    def run(weights):
        x = draft.clone().requires_grad_(True)
        out = dspark_loss(x, teacher["target_logits"], labels, mask, None, weights, draft_vocab=d2t,
                          target_topk=teacher.get("target_topk"))
        out.total.backward()
        return out, x.grad

    dflash, g_dflash = run(LossWeights(ce=0.1, tv=0.0, conf=0.0, decay=4.0))
    dspark, g_dspark = run(LossWeights(ce=0.1, tv=0.9, conf=0.0, decay=4.0))
    ce_only, g_ce = run(LossWeights(ce=0.1, tv=0.0, conf=0.0, decay=4.0))
    assert float(dflash.tv) == pytest.approx(float(dspark.tv.detach())) and float(dflash.tv) > 0
    assert torch.equal(dflash.accept_rate, dspark.accept_rate)
    assert not dflash.tv.requires_grad
    assert torch.equal(g_dflash, g_ce)
    assert not torch.allclose(g_dspark, g_dflash)
    # the TV gradient by hand: d/dx of 0.9 * mean_w(TV) equals the difference of the two gradients
    x = draft.clone().requires_grad_(True)
    tv_only = dspark_loss(x, teacher["target_logits"], labels, mask, None, LossWeights(ce=0.0, tv=0.9, conf=0.0,
                          decay=4.0), draft_vocab=d2t, target_topk=teacher.get("target_topk"))
    tv_only.total.backward()
    assert torch.allclose(g_dspark - g_dflash, x.grad, atol=1e-6)


# ---------------------------------------------------------------------------------------------- data
def test_build_training_data_with_prepacked_linears_writes_the_same_answers_and_restores_the_model(tmp_path):
    from dspark_hf.models.prepacked import PrepackedLinear, prepacked_available
    from dspark_hf.training.data import build_training_data

    if not prepacked_available():
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    target = make_target("llama")
    tok = make_tokenizer()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "w{10 + i} w{20 + i}"}}]}}\n'
                               for i in range(5)))
    recipe = GenerationRecipe(max_new_tokens=8, batch_size=4, shard_size=8)
    runs = {}
    for packed in (False, True):
        build_training_data(target, prompts, tmp_path / str(packed), recipe, tokenizer=tok, prepack=packed,
                            progress=False)
        runs[packed] = [e.input_ids for e in read_examples(tmp_path / str(packed))]
        assert not any(isinstance(m, PrepackedLinear) for m in target.modules())  # the caller's model, as it was
    assert runs[True] == runs[False] and len(runs[True]) == 5


def test_generate_responses_is_resumable_and_masks_the_answer(tmp_path):
    target = make_target("llama")
    tok = make_tokenizer()
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"w{10 + i} w{20 + i}"}], "source": "t"}
               for i in range(6)]
    recipe = GenerationRecipe(max_new_tokens=6, batch_size=4, shard_size=3)
    generate_responses(target, tok, prompts[:4], tmp_path, recipe, progress=False)
    first = read_examples(tmp_path)
    generate_responses(target, tok, prompts, tmp_path, recipe, progress=False)  # resumes: only 2 new prompts
    examples = read_examples(tmp_path)
    assert [e.id for e in examples] == [f"p{i}" for i in range(6)]
    assert [e.input_ids for e in examples[:4]] == [e.input_ids for e in first]
    for e, p in zip(examples, prompts):
        prompt_ids = tok.apply_chat_template(p["messages"], tokenize=True, add_generation_prompt=True)
        prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
        assert e.input_ids[: len(prompt_ids)] == prompt_ids
        assert e.loss_mask == [0] * len(prompt_ids) + [1] * (len(e.input_ids) - len(prompt_ids))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["recipe"]["max_new_tokens"] == 6
    summary = summarize_data(tmp_path)
    tokens = sum(len(e.input_ids) for e in examples)
    answers = sum(sum(e.loss_mask) for e in examples)
    assert f"6 examples (of 6 prompts), {tokens} tokens of which {answers} answer tokens" in summary
    assert "max_new_tokens=6" in summary and summary.endswith("By source: t 6.")
    with pytest.raises(FileNotFoundError, match="manifest"):
        summarize_data(tmp_path / "nothing")


def test_prompts_given_as_token_ids_are_answered_without_a_tokenizer_exactly_as_from_messages(tmp_path):
    target = make_target("llama")
    tok = make_tokenizer()
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"w{10 + i} w{30 - i}"}], "source": "t"}
               for i in range(5)]
    recipe = GenerationRecipe(max_new_tokens=6, batch_size=2, shard_size=2)
    generate_responses(target, tok, prompts, tmp_path / "text", recipe, progress=False)
    as_ids = []
    for p in prompts:
        ids = tok.apply_chat_template(p["messages"], tokenize=True, add_generation_prompt=True)
        as_ids.append({"id": p["id"], "source": "t", "prompt_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    target.generation_config.pad_token_id = tok.pad_token_id
    generate_responses(target, None, as_ids, tmp_path / "ids", recipe, progress=False)
    assert [e.to_json() for e in read_examples(tmp_path / "ids")] == [e.to_json() for e in read_examples(tmp_path / "text")]
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        generate_responses(target, None, prompts, tmp_path / "none", recipe, progress=False)
    with pytest.raises(ValueError, match="empty prompt_ids"):
        generate_responses(target, None, [{"id": "e", "prompt_ids": []}], tmp_path / "empty", recipe, progress=False)


def test_max_seconds_stops_between_batches_keeps_what_was_answered_and_a_rerun_finishes(tmp_path, monkeypatch):
    import time as time_module

    target = make_target("llama")
    tok = make_tokenizer()
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"w{10 + i}"}]} for i in range(7)]
    recipe = GenerationRecipe(max_new_tokens=4, batch_size=2, shard_size=4)
    clock = iter([0.0, 0.0, 5.0, 11.0] + [100.0] * 50)  # start, batch 1 at 0 s, batch 2 at 5 s, batch 3 at 11 s
    monkeypatch.setattr(time_module, "perf_counter", lambda: next(clock))
    generate_responses(target, tok, prompts, tmp_path, recipe, progress=False, max_seconds=10)
    assert len(read_examples(tmp_path)) == 4  # two batches of 2, then the clock passed 10 s
    monkeypatch.undo()
    generate_responses(target, tok, prompts, tmp_path, recipe, progress=False, max_seconds=1e9)
    assert sorted(e.id for e in read_examples(tmp_path)) == [f"p{i}" for i in range(7)]
    full = tmp_path / "full"
    generate_responses(target, tok, prompts, full, recipe, progress=False)
    assert sorted(e.to_json() for e in read_examples(tmp_path)) == sorted(e.to_json() for e in read_examples(full))


def test_spread_order_answers_a_source_sorted_file_source_by_source_mixed_and_limit_samples_every_source(tmp_path):
    from dspark_hf.training.data import build_training_data
    from dspark_hf.training.trainer import spread_ranks, spread_subset

    target = make_target("llama")
    tok = make_tokenizer()
    prompts = tmp_path / "prompts.jsonl"  # sorted by source, as every committed prompt file is
    prompts.write_text("".join(f'{{"id": "{src}/{i}", "source": "{src}", "messages": [{{"role": "user", '
                               f'"content": "w{10 + i}"}}]}}\n' for src in ("a", "b", "c") for i in range(6)))
    recipe = GenerationRecipe(max_new_tokens=3, batch_size=4, shard_size=4)
    build_training_data(target, prompts, tmp_path / "file", recipe, tokenizer=tok, limit=6, progress=False)
    assert {e.id.split("/")[0] for e in read_examples(tmp_path / "file")} == {"a"}  # the first 6: one source
    build_training_data(target, prompts, tmp_path / "spread", recipe, tokenizer=tok, limit=6, progress=False,
                        order="spread")
    spread = read_examples(tmp_path / "spread")
    ids = [f"{src}/{i}" for src in ("a", "b", "c") for i in range(6)]
    assert sorted(e.id for e in spread) == sorted(spread_subset(ids, 6, str))  # the same 6 the evaluations pick
    assert {e.id.split("/")[0] for e in spread} == {"a", "b", "c"}
    ranks = spread_ranks(ids, str)
    assert sorted(ranks) == list(range(18)) and spread_subset(ids, 6, str) == [ids[i] for i in sorted(ranks[:6])]
    # resuming in spread order answers the rest, and the answers are the file order's
    build_training_data(target, prompts, tmp_path / "spread", recipe, tokenizer=tok, progress=False, order="spread")
    build_training_data(target, prompts, tmp_path / "file", recipe, tokenizer=tok, progress=False)
    by_id = lambda folder: {e.id: e.input_ids for e in read_examples(folder)}  # noqa: E731
    assert by_id(tmp_path / "spread") == by_id(tmp_path / "file") and len(by_id(tmp_path / "file")) == 18
    with pytest.raises(ValueError, match="order must be 'file' or 'spread'"):
        build_training_data(target, prompts, tmp_path / "x", recipe, tokenizer=tok, progress=False, order="random")


def test_sort_window_keeps_the_given_order_at_its_scale_so_a_stopped_run_answered_a_prefix(tmp_path, monkeypatch):
    import time as time_module

    target = make_target("llama")
    tok = make_tokenizer()
    long_words = " ".join(f"w{10 + k}" for k in range(12))
    prompts = [{"id": f"long{i}", "messages": [{"role": "user", "content": long_words}]} for i in range(2)]
    prompts += [{"id": f"short{i}", "messages": [{"role": "user", "content": "w5"}]} for i in range(2)]
    recipe = GenerationRecipe(max_new_tokens=2, batch_size=1, shard_size=1)
    answered = {}
    for window in (None, 2):
        clock = iter([0.0, 0.0, 5.0, 11.0] + [100.0] * 50)  # two batches start before 10 s
        monkeypatch.setattr(time_module, "perf_counter", lambda: next(clock))
        out = tmp_path / str(window)
        generate_responses(target, tok, prompts, out, recipe, progress=False, max_seconds=10, sort_window=window)
        monkeypatch.undo()
        answered[window] = sorted(e.id for e in read_examples(out))
    assert answered[None] == ["short0", "short1"]  # the whole list sorted: the shortest first
    assert answered[2] == ["long0", "long1"]  # sorted within pairs: the first pair first
    with pytest.raises(ValueError, match="sort_window"):
        generate_responses(target, tok, prompts, tmp_path / "bad", recipe, progress=False, sort_window=0)


def test_data_cli_passes_max_seconds_and_the_recipe(monkeypatch, tmp_path):
    from dspark_hf import cli
    from dspark_hf.training import data as data_module

    seen = {}

    def fake_build(target, prompts, out, recipe, **kwargs):
        seen.update(target=target, recipe=recipe, **kwargs)
        return data_module.DataBuild(Path(out))

    monkeypatch.setattr(data_module, "build_training_data", fake_build)
    cli._data(["--target", "t", "--prompts", "p.jsonl", "--out", str(tmp_path), "--max-seconds", "90",
               "--batch-size", "64", "--compress", "--order", "spread"])
    assert seen["max_seconds"] == 90.0 and seen["recipe"].batch_size == 64 and seen["recipe"].compress
    assert seen["order"] == "spread"
    cli._data(["--target", "t", "--prompts", "p.jsonl", "--out", str(tmp_path)])
    assert seen["max_seconds"] is None and seen["order"] == "file"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    target = make_target("llama")
    with pytest.raises(ValueError, match="chat template"):
        generate_responses(target, make_tokenizer(chat_template=None),
                           [{"id": "a", "messages": [{"role": "user", "content": "w5"}]}], tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------- features
def test_online_and_offline_features_give_the_same_batches(tmp_path):
    target = make_target("qwen3")
    examples = learnable_examples(target, count=10)
    layers = [1, 2]
    build_feature_cache(target, examples, tmp_path, layers, batch_size=3, shard_examples=4, progress=False)
    offline = FeatureCache(tmp_path, target, layers)
    online = OnlineFeatures(target, layers)
    batch = examples[2:7]
    a, b = online(batch), offline(batch)
    for name in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    valid = a.attention_mask.bool()
    assert torch.allclose(a.context[valid], b.context[valid], atol=1e-6)
    assert torch.allclose(a.final_hidden[valid], b.final_hidden[valid], atol=1e-6)
    with pytest.raises(ValueError, match="layers"):
        FeatureCache(tmp_path, target, [0, 1])
    with pytest.raises(ValueError, match="target"):
        FeatureCache(tmp_path, make_target("qwen3", layers=6))


def test_read_examples_merges_folders_newest_first(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir(), old.mkdir()
    _write_shard(new / "data-00000.jsonl.gz", [TokenizedExample("a", [1, 2, 3, 4], [0, 0, 1, 1], "s"),
                                              TokenizedExample("b", [5, 6], [0, 1], "s")])
    _write_shard(old / "data-00000.jsonl", [TokenizedExample("a", [1, 2, 9], [0, 0, 1], "s"),
                                            TokenizedExample("c", [7, 8], [0, 1], "s")])
    merged = read_examples(f"{new},{old}")
    assert [(e.id, e.input_ids) for e in merged] == [("a", [1, 2, 3, 4]), ("b", [5, 6]), ("c", [7, 8])]
    assert [e.id for e in read_examples([old, new])] == ["a", "c", "b"]
    assert read_examples([old, new])[0].input_ids == [1, 2, 9]
    with pytest.raises(FileNotFoundError, match="empty"):
        (tmp_path / "empty").mkdir()
        read_examples([new, tmp_path / "empty"])


def test_a_capped_folder_gives_a_fixed_spread_sample_and_keeps_its_other_ids_from_later_folders(tmp_path):
    from dspark_hf.training.data import data_folders, data_sources
    from dspark_hf.training.trainer import spread_subset

    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir(), old.mkdir()
    _write_shard(new / "data-00000.jsonl", [TokenizedExample("n0", [1, 2], [0, 1], "x")])
    olds = [TokenizedExample(f"{src}/{i}", [3, i], [0, 1], src) for src in ("p", "q", "r") for i in range(5)]
    _write_shard(old / "data-00000.jsonl", olds)
    _write_shard(new / "data-00001.jsonl", [TokenizedExample("p/0", [1, 9], [0, 1], "p")])  # newer answer of p/0
    capped = read_examples(f"{old}@4,{new}")
    assert [e.id for e in capped] == spread_subset([e.id for e in olds], 4, str) + ["n0"]  # p/0 stays old's
    assert {e.id.split("/")[0] for e in capped[:4]} == {"p", "q", "r"}  # a sample of every source
    assert read_examples(f"{old}@4,{new}") == capped  # fixed by the ids
    assert len(read_examples(f"{new},{old}@100")) == 16  # a cap above the count: all
    assert data_sources(f"{new}, {old}@7") == [(new, None), (old, 7)] and data_folders(f"{old}@7") == [old]
    for bad in (f"{old}@0", f"{old}@x", "@3"):
        with pytest.raises(ValueError, match="positive number of examples"):
            read_examples(bad)


def test_feature_cache_misses_an_example_whose_tokens_changed(tmp_path):
    target = make_target("qwen3")
    examples = learnable_examples(target, count=4)
    layers = [1, 2]
    build_feature_cache(target, examples, tmp_path, layers, batch_size=2, shard_examples=2, progress=False)
    changed = TokenizedExample(examples[0].id, examples[0].input_ids[:-2] + [3, 4], examples[0].loss_mask,
                               examples[0].source)
    cache = FeatureCache(tmp_path, target, layers)
    assert examples[0] in cache and changed not in cache
    with pytest.raises(KeyError, match="tokens changed"):
        cache([changed])
    # the build resumes over the changed example only, and then serves its own (new) features
    build_feature_cache(target, [changed, *examples[1:]], tmp_path, layers, batch_size=2, shard_examples=2,
                        progress=False)
    cache = FeatureCache(tmp_path, target, layers)
    assert len(cache.manifest["shards"]) == 3
    online = OnlineFeatures(target, layers)([changed])
    assert torch.allclose(cache([changed]).context, online.context, atol=1e-6)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["key_format"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="older format"):
        FeatureCache(tmp_path, target, layers)


def test_growing_a_feature_cache_with_other_settings_names_what_differs_and_writes_nothing(tmp_path):
    target = make_target("qwen3")
    examples = learnable_examples(target, count=4)
    build_feature_cache(target, examples[:2], tmp_path, [1, 2], batch_size=2, shard_examples=2, max_length=32,
                        progress=False)
    before = sorted(p.name for p in tmp_path.iterdir()), (tmp_path / "manifest.json").read_text()
    with pytest.raises(ValueError, match=r"max_length: cached 32, asked 48") as err:
        build_feature_cache(target, examples, tmp_path, [1, 2], batch_size=2, shard_examples=2, max_length=48,
                            progress=False)
    assert "target_layer_ids" not in str(err.value)  # only what differs is named
    assert (sorted(p.name for p in tmp_path.iterdir()), (tmp_path / "manifest.json").read_text()) == before


# ---------------------------------------------------------------------------------------------- learning
def tiny_config(tmp_path, **kw) -> DSparkTrainingConfig:
    base = dict(output_dir=str(tmp_path / "run"), max_steps=150, batch_size=8, num_anchors=16, block_size=4,
                markov_rank=16, learning_rate=3e-3, warmup_steps=10, save_every=1000, log_every=10, resume=False,
                heldout_fraction=0.1, draft_candidates=None)
    base.update(kw)
    return DSparkTrainingConfig(**base)


def measured_tau(target, drafter, examples) -> float:
    ids = torch.tensor([e.input_ids[:8] for e in examples])
    out = dspark_hf.generate(target, drafter.eval(), ids, max_new_tokens=24, policy="fixed",
                             return_dict_in_generate=True)
    return sum(s.mean_accepted_length for s in out.stats) / len(out.stats)


def test_training_lowers_the_loss_and_raises_measured_tau(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=200)
    config = tiny_config(tmp_path)
    torch.manual_seed(0)
    drafter = build_drafter(config, target)
    untrained = build_drafter(config, target).eval()
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    frozen_before = {n: p.detach().clone() for n, p in target.named_parameters()}
    trainer = DSparkTrainer(config, target, examples, drafter=drafter, progress=False)
    final = trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]
    assert log[-1]["tv"] < log[0]["tv"] and log[-1]["expected_tau"] > log[0]["expected_tau"]
    assert all(f"accept_rate@{k}" in log[-1] for k in range(1, 5))
    changed = [n for n, p in drafter.named_parameters() if not torch.equal(before[n], p.detach())]
    assert sorted(changed) == sorted(before), set(before) - set(changed)  # every trainable parameter changed
    assert all(torch.equal(frozen_before[n], p) for n, p in target.named_parameters())  # the target did not
    heldout = trainer.heldout
    assert heldout and not set(e.id for e in heldout) & set(e.id for e in trainer.train_examples)
    trained_tau, untrained_tau = measured_tau(target, drafter, heldout), measured_tau(target, untrained, heldout)
    assert trained_tau > untrained_tau + 0.25, (trained_tau, untrained_tau)
    reloaded = dspark_hf.DSparkDrafter.from_pretrained(final, target=target)
    assert measured_tau(target, reloaded, heldout) == pytest.approx(trained_tau)


@pytest.mark.parametrize("detach", [False, True])
def test_detached_confidence_inputs_keep_the_bce_out_of_the_drafts(tmp_path, detach):
    target = make_target("llama")
    config = tiny_config(tmp_path, alpha_ce=0.0, alpha_tv=0.0, alpha_conf=1.0, detach_confidence_inputs=detach)
    torch.manual_seed(0)
    drafter = build_drafter(config, target)
    trainer = DSparkTrainer(config, target, learnable_examples(target, count=20), drafter=drafter, progress=False)
    out = trainer.compute_loss(trainer.micro_batch(0), 0)
    assert float(out.conf.detach()) > 0
    out.total.backward()
    reached = {n for n, p in drafter.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert reached and all(n.startswith("confidence_head.") for n in reached) == detach, sorted(reached)
    assert any(n.startswith("confidence_head.") for n in reached)
    # the markov head's W1 and the backbone's layers: reached only when trained end to end
    assert any(n.startswith("layers.") for n in reached) != detach
    assert any(n.startswith("markov_head.") for n in reached) != detach


def test_dflash_variant_has_no_heads_and_uses_ce_only(tmp_path):
    target = make_target("llama")
    config = tiny_config(tmp_path, variant="dflash", max_steps=3)
    drafter = build_drafter(config, target)
    assert drafter.markov_head is None and drafter.confidence_head is None
    assert (config.alpha_tv, config.alpha_conf) == (0.0, 0.0)
    trainer = DSparkTrainer(config, target, learnable_examples(target, count=20), drafter=drafter, progress=False)
    trainer.train()
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert last["conf"] == 0.0 and last["loss"] == pytest.approx(0.1 * last["ce"], rel=1e-5)


def test_exact_resume(tmp_path):
    """Stopping at step 6 and resuming gives the same losses at steps 7..12 as an uninterrupted run (1e-5)."""
    target = make_target("llama")
    examples = learnable_examples(target, count=40)

    def run(folder, max_steps, resume):
        cfg = tiny_config(tmp_path, output_dir=str(tmp_path / folder), max_steps=max_steps, save_every=6,
                          log_every=1, resume=resume, gradient_accumulation_steps=2, batch_size=3)
        torch.manual_seed(0)
        trainer = DSparkTrainer(cfg, target, examples, drafter=build_drafter(cfg, target), progress=False)
        trainer.train()
        return [json.loads(line) for line in (tmp_path / folder / "log.jsonl").read_text().splitlines()]

    straight = run("a", 12, False)
    run("b", 6, False)
    resumed = run("b", 12, True)  # the second process finds checkpoint-000006 and continues
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for x, y in zip(straight[6:], resumed[6:]):
        assert x["step"] == y["step"] and x["loss"] == pytest.approx(y["loss"], abs=1e-5)


def test_stop_at_step_ends_early_under_the_full_schedule(tmp_path):
    """stop_at_step=4 of a 10-step cosine run: steps 1..4 at the 10-step schedule's learning rates, a checkpoint and
    a final drafter at step 4, and resuming without it continues exactly as an uninterrupted run."""
    target = make_target("llama")
    examples = learnable_examples(target, count=40)

    def run(folder, resume, **kw):
        cfg = tiny_config(tmp_path, output_dir=str(tmp_path / folder), max_steps=10, warmup_steps=2, log_every=1,
                          resume=resume, batch_size=3, lr_schedule="cosine", **kw)
        torch.manual_seed(0)
        trainer = DSparkTrainer(cfg, target, examples, drafter=build_drafter(cfg, target), progress=False)
        trainer.train()
        return [json.loads(line) for line in (tmp_path / folder / "log.jsonl").read_text().splitlines()]

    straight = run("a", False)
    early = run("b", False, stop_at_step=4)
    assert [r["step"] for r in early] == [1, 2, 3, 4]
    assert [r["lr"] for r in early] == pytest.approx([r["lr"] for r in straight[:4]])
    assert early[-1]["lr"] > 0.5 * 3e-3  # at 85% of the peak, not decayed to 0 as a 4-step schedule would be
    assert (tmp_path / "b" / "checkpoint-000004").is_dir() and (tmp_path / "b" / "final").is_dir()
    resumed = run("b", True)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for x, y in zip(straight[4:], resumed[4:]):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
    with pytest.raises(ValueError, match="stop_at_step"):
        DSparkTrainingConfig(stop_at_step=0)


# ---------------------------------------------------------------------------------------------- bad input
def test_config_errors(tmp_path):
    (tmp_path / "c.yaml").write_text("learning_rate: 0.001\nlearnig_rate: 3\n")
    with pytest.raises(ValueError, match="learnig_rate"):
        load_training_config(["--config", str(tmp_path / "c.yaml")])
    with pytest.raises(ValueError, match="nope"):
        load_training_config(["nope=1"])
    (tmp_path / "ok.yaml").write_text("max_steps: 5\nlearning_rate: 0.5\n")
    cfg = load_training_config(["--config", str(tmp_path / "ok.yaml"), "max_steps=7", "--learning_rate", "0.01",
                                "target_layer_ids=[1, 2]"])
    assert cfg.max_steps == 7 and cfg.learning_rate == 0.01 and cfg.target_layer_ids == [1, 2]
    with pytest.raises(ValueError, match="variant"):
        DSparkTrainingConfig(variant="eagle")


def test_checkpoint_from_another_target_is_refused(tmp_path):
    other = make_target("llama", vocab_size=64)
    make_drafter(other).save_pretrained(tmp_path / "other")
    target = make_target("llama")
    with pytest.raises(ValueError, match="vocab size"):
        build_drafter(tiny_config(tmp_path, init_from=str(tmp_path / "other")), target)


def test_heldout_split_is_stable():
    examples = learnable_examples(make_target("llama"), count=50)
    a = split_examples(examples, 0.2)
    b = split_examples(list(reversed(examples)), 0.2)
    assert {e.id for e in a[1]} == {e.id for e in b[1]} and 0 < len(a[1]) < 50


def test_held_out_evaluations_decode_prompts_spread_over_the_sources():
    """Held-out files are sorted by source (the first 24 of data/heldout_prompts.jsonl are 16 chatterbot dialogs, the
    hardest source: the release drafter's held-out tau there was 1.52 against 1.84 on a spread of the same file).
    `eval_prompts` takes them spread by a hash of the ids: several sources, order-free, growing only adds prompts."""
    prompts = [{"id": f"{source}/{i}", "source": source, "messages": [{"role": "user", "content": f"{source} {i}"}]}
               for source in ("chatterbot", "codeio", "fortunes", "reasoning_gym") for i in range(25)]
    first = eval_prompts(prompts, 8, "file")
    assert {p["source"] for p in first} == {"chatterbot"}  # what the first prompts of a sorted file are
    spread = eval_prompts(prompts, 8)
    assert len(spread) == 8 and len({p["source"] for p in spread}) >= 3
    assert [p["id"] for p in spread] == [p["id"] for p in eval_prompts(list(reversed(prompts)), 8)][::-1]  # order-free
    assert {p["id"] for p in spread} < {p["id"] for p in eval_prompts(prompts, 20)}
    assert eval_prompts(prompts, 500) == prompts
    unnamed = [{"messages": p["messages"]} for p in prompts]  # rows without ids: by line number
    assert len(eval_prompts(unnamed, 8)) == 8 and eval_prompts(unnamed, 8) != unnamed[:8]
    with pytest.raises(ValueError, match="'spread' or 'file'"):
        eval_prompts(prompts, 8, "random")
    with pytest.raises(ValueError, match="eval_prompt_order"):
        tiny_config(Path("/nonexistent"), eval_prompt_order="first")


def test_heldout_examples_prompts_are_spread_too():
    examples = learnable_examples(make_target("llama"), count=30)
    spread = heldout_prompt_ids(examples, 5)
    assert spread == heldout_prompt_ids(subset_examples(examples, 5), 5) and spread != heldout_prompt_ids(examples, 5, "file")
    assert heldout_prompt_ids(examples, 5, "file") == heldout_prompt_ids(examples[:5], 5, "file")


def test_max_examples_is_a_fixed_order_free_subset_that_only_grows(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=40)
    small, large = subset_examples(examples, 10), subset_examples(examples, 25)
    assert len(small) == 10 and len(large) == 25
    assert {e.id for e in small} < {e.id for e in large}  # growing the count only adds examples
    assert {e.id for e in subset_examples(list(reversed(examples)), 10)} == {e.id for e in small}  # order-free
    positions = [examples.index(e) for e in small]
    assert positions == sorted(positions)  # kept in data order
    assert max(positions) > 10  # not simply the first ten
    assert subset_examples(examples, None) == examples and subset_examples(examples, 99) == examples
    trainer = DSparkTrainer(tiny_config(tmp_path, max_examples=7, max_steps=1), target, examples, progress=False)
    heldout = {e.id for e in split_examples(examples, 0.1)[1]}
    assert len(trainer.train_examples) == 7 and not heldout & {e.id for e in trainer.train_examples}
    with pytest.raises(ValueError, match="max_examples"):
        DSparkTrainingConfig(target="x", data_dir="y", max_examples=0)


def test_bf16_mixed_precision_trains(tmp_path):
    from accelerate.state import AcceleratorState

    target = make_target("llama")
    config = tiny_config(tmp_path, mixed_precision="bf16", max_steps=4, log_every=1)
    AcceleratorState._reset_state(True)  # accelerate keeps one state per process; the other tests use fp32
    try:
        trainer = DSparkTrainer(config, target, learnable_examples(target, count=20), progress=False)
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and all(math.isfinite(r["loss"]) for r in log)
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch, caplog, native):
    import logging

    from accelerate.state import AcceleratorState
    import dspark_hf.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: native)
    target = make_target("llama")
    AcceleratorState._reset_state(True)
    try:
        with caplog.at_level(logging.WARNING, logger="dspark_hf.training.trainer"):
            DSparkTrainer(tiny_config(tmp_path, mixed_precision="bf16", max_steps=1), target,
                          learnable_examples(target, count=8), progress=False)
    finally:
        AcceleratorState._reset_state(True)
    assert ("without AVX-512 BF16 or AMX" in caplog.text) is (not native)


def test_cpu_has_native_bf16_reads_the_flags():
    from dspark_hf.provenance import cpu_flags, cpu_has_native_bf16

    assert cpu_has_native_bf16({"fpu", "avx2", "avx512f"}) is False
    assert cpu_has_native_bf16({"avx2", "avx512_bf16"}) is True and cpu_has_native_bf16({"amx_bf16"}) is True
    if Path("/proc/cpuinfo").exists():  # Linux: the flags are read
        assert cpu_flags() and cpu_has_native_bf16() == bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def test_cpu_signature_tells_cpus_with_the_same_bare_name_apart(tmp_path, monkeypatch):
    """Virtual machines report "AMD EPYC" for Zen 2 and Zen 4 alike, whose cost curves differ: the device line of
    every measurement carries the family / model numbers and the widest vector unit."""
    from dspark_hf import provenance as prov

    def cpuinfo(family: int, model: int, flags: str) -> Path:
        block = (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                 f"model name\t: AMD EPYC\nflags\t\t: {flags}\n\n")
        path = tmp_path / f"cpuinfo-{family}-{model}"
        path.write_text(block + block.replace("processor\t: 0", "processor\t: 1").replace(f": {model}\n", ": 0\n"))
        return path

    zen2, zen4 = cpuinfo(23, 49, "fpu sse2 avx avx2 fma"), cpuinfo(25, 17, "fpu avx2 avx512f avx512_bf16")
    assert prov.cpu_signature(zen2) == "family 23 model 49, AVX2"
    assert prov.cpu_signature(zen4) == "family 25 model 17, AVX-512"
    assert prov.cpu_signature(tmp_path / "missing") == ""
    monkeypatch.setattr(prov, "cpu_signature", lambda: "family 23 model 49, AVX2")
    monkeypatch.setattr(prov, "cpu_model", lambda: "AMD EPYC")
    assert prov.device_description("cpu").startswith("AMD EPYC (family 23 model 49, AVX2) ")


@pytest.mark.parametrize("path", sorted(str(p) for p in (Path(__file__).parents[1] / "examples" / "configs").glob("*.yaml")))
def test_every_example_config_parses_and_validates(path):
    """The shipped configs are what `dspark-hf train --config` reads: a typo'd key or a bad value must not wait for a
    user's 30-minute run to surface."""
    cfg = load_training_config(["--config", path])
    assert cfg.max_steps > 0 and cfg.block_size > 0
    if cfg.target:  # a real-target recipe names its data and output folders
        assert cfg.data_dir and cfg.output_dir
