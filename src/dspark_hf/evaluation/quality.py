"""Quality guard for evaluation: HumanEval pass@1 in isolated subprocesses, and math final-answer matching.

Speculative decoding must not change what the target says; these scorers check that on real outputs (a lossless
decoder scores exactly like plain decoding) and catch broken pipelines (a drafter bug that corrupts text shows up as a
drop in pass@1 or exact match).

Design choices and limits:

- Model-written code never runs in this process. Each HumanEval program (problem prompt + completion + the problem's
  own `test` + `check(entry_point)`) runs as `python -I` in a fresh temporary directory, in its own session so that a
  timeout kills its whole process group, with an address-space limit on POSIX. This is isolation against accidents
  (infinite loops, memory blow-ups, stray files), not a security sandbox against hostile code.
- A chat model's completion is usually a fenced code block holding the whole function. `build_program` takes the first
  fenced block that defines the entry point (else the first block, else the raw text); a completion that defines
  `def <entry_point>(` is appended after the prompt (the prompt still contributes imports and helper functions, and the
  later definition wins), anything else is treated as a continuation of the prompt's function body.
- `extract_final_answer` looks for, in order: the last `\\boxed{...}` (nested braces handled), the last `#### x`
  (GSM8K style), the last number. `math_exact_match` normalises lightly (`$`, thousands commas, spaces, `\\left`,
  `\\dfrac`, a trailing `.0`) and compares numerically when both sides are numbers or simple fractions. It is not a
  symbolic checker: `\\frac{\\sqrt{3}}{2}` vs `\\sqrt{3}/2` does not match.
- The `evaluate` library's `code_eval` metric is not used: it downloads its script from the Hub, which is unreachable.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "PASS_MARKER",
    "TaskResult",
    "build_program",
    "extract_code",
    "extract_final_answer",
    "humaneval_pass_at_1",
    "math_exact_match",
    "normalize_answer",
    "run_program",
]

# Printed after `check` returns: a program that exits early with status 0 (`sys.exit(0)` in a completion) is no pass.
PASS_MARKER = "__dspark_hf_check_passed__"
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass
class TaskResult:
    """The outcome of one HumanEval task: `status` is "passed", "failed" or "timeout"; `error` the stderr tail."""

    task_id: str
    passed: bool
    status: str
    error: str = ""


def _problem_fields(problem: Any) -> tuple[str, str, str, str]:
    """(task_id, prompt, test, entry_point) of a HumanEval problem given as a dict or a `prompt_sets.EvalPrompt`."""
    fields = problem.metadata if hasattr(problem, "metadata") else problem
    task_id = getattr(problem, "id", None) or fields["task_id"]
    return task_id, fields["prompt"], fields["test"], fields["entry_point"]


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: the first fenced block defining `entry_point`, else the first block, else all text.

    A completion that starts indented continues the prompt's function body (base-model style); it is cut at its first
    fence, where such a model starts talking about its code.
    """
    if completion.lstrip("\n")[:1] in (" ", "\t"):
        return completion.split("```", 1)[0]
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    if entry_point is not None:
        for block in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.MULTILINE):
                return block
    return blocks[0]


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program that checks one completion: prompt + code + the problem's `test` + `check(entry_point)`."""
    code = extract_code(completion, entry_point)
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        # A whole function: the prompt (a valid def with only a docstring) keeps its imports and helpers.
        body = prompt.rstrip() + "\n\n\n" + code
    else:
        body = prompt + code  # a continuation of the prompt's function body (the original HumanEval setting)
    return f"{body}\n\n\n{test}\n\n\ncheck({entry_point})\nprint({PASS_MARKER!r})\n"


def _memory_limit_preamble(max_memory_bytes: int | None) -> str:
    if not max_memory_bytes or os.name != "posix":
        return ""
    return ("import resource as _r\n"
            f"_r.setrlimit(_r.RLIMIT_AS, ({int(max_memory_bytes)}, {int(max_memory_bytes)}))\n"
            "del _r\n")


def run_program(program: str, timeout: float = 10.0, max_memory_bytes: int | None = 4 << 30) -> tuple[str, str]:
    """Runs `program` in a fresh `python -I` subprocess and temp dir; returns (status, stderr tail).

    status is "passed" (exit code 0 and `PASS_MARKER` printed: the program ran to its end), "failed" or "timeout"
    (then the whole process group is killed).
    """
    with tempfile.TemporaryDirectory(prefix="dspark_quality_") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(_memory_limit_preamble(max_memory_bytes) + program)
        process = subprocess.Popen(
            [sys.executable, "-I", path], cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            return "timeout", f"timed out after {timeout} s"
        finally:
            _kill_group(process)  # children the program may have left behind
    error = stderr.decode("utf-8", errors="replace").strip()[-2000:]
    passed = process.returncode == 0 and PASS_MARKER.encode() in stdout
    if process.returncode == 0 and not passed:
        error = (error + "\nexited before the tests finished").strip()
    return ("passed" if passed else "failed"), error


def _kill_group(process: subprocess.Popen) -> None:
    try:
        if os.name == "posix":
            os.killpg(process.pid, signal.SIGKILL)
        elif process.poll() is None:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def humaneval_pass_at_1(
    problems: Sequence[Any],
    completions: Mapping[str, str] | Sequence[str],
    timeout: float = 10.0,
    num_workers: int | None = None,
    max_memory_bytes: int | None = 4 << 30,
) -> dict[str, Any]:
    """HumanEval pass@1 with one completion per problem, each checked in its own subprocess.

    Args:
        problems: HumanEval problems, as `prompt_sets.EvalPrompt`s or dicts with `task_id`, `prompt`, `test`,
            `entry_point` (the rows of `HumanEval.jsonl.gz`).
        completions: task_id -> completion, or a list aligned with `problems`. A problem without a completion fails.
        timeout: seconds per program.
        num_workers: parallel subprocesses (default: CPU count).
        max_memory_bytes: address-space limit per program (None: no limit).

    Returns:
        `{"pass_at_1": float, "num_tasks": int, "num_passed": int,
        "results": {task_id: {"passed": bool, "status": str, "error": str}}}`.
    """
    fields = [_problem_fields(problem) for problem in problems]
    if isinstance(completions, Mapping):
        texts = [completions.get(task_id) for task_id, *_ in fields]
    else:
        if len(completions) != len(fields):
            raise ValueError(f"{len(completions)} completions for {len(fields)} problems")
        texts = list(completions)

    def check(index: int) -> TaskResult:
        task_id, prompt, test, entry_point = fields[index]
        if texts[index] is None:
            return TaskResult(task_id, False, "failed", "no completion")
        status, error = run_program(build_program(prompt, texts[index], test, entry_point), timeout,
                                    max_memory_bytes)
        return TaskResult(task_id, status == "passed", status, error)

    with ThreadPoolExecutor(max_workers=num_workers or os.cpu_count() or 1) as pool:
        results = list(pool.map(check, range(len(fields))))
    num_passed = sum(result.passed for result in results)
    return {
        "pass_at_1": num_passed / len(results) if results else 0.0,
        "num_tasks": len(results),
        "num_passed": num_passed,
        "results": {result.task_id: {k: v for k, v in asdict(result).items() if k != "task_id"}
                    for result in results},
    }


# ----------------------------------------------------------------------------------------------------- math answers

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}`, matching nested braces; None if there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for position in range(start, len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:position].strip()
    return None


def extract_final_answer(text: str | None) -> str | None:
    """The final answer in a math solution: last `\\boxed{}`, else last `#### x`, else the last number; else None."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = re.findall(r"####\s*([^\n]+)", text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def normalize_answer(answer: str) -> str:
    """Light normalisation of a math answer for string comparison."""
    text = answer.strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        text = boxed
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\$", "").replace("$", "")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # thousands separators only: (1,2) stays a pair
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"^(-?\d+)\.0+$", r"\1", text)  # 12.0 -> 12
    return text


def _as_number(text: str) -> Fraction | None:
    """A normalised answer as an exact number if it is an integer, decimal, `a/b` or `\\frac{a}{b}`."""
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", text) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", text)
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        if re.fullmatch(r"-?(?:\d+\.?\d*|\.\d+)", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_exact_match(prediction: str | None, reference: str | None) -> bool:
    """Whether a predicted answer equals the reference after light normalisation (numerically if both parse).

    `prediction` may be a bare answer or a whole solution; for a solution its `extract_final_answer` is compared.
    """
    if prediction is None or reference is None:
        return False
    expected = normalize_answer(reference)
    expected_number = _as_number(expected)
    for candidate in (prediction, extract_final_answer(prediction)):
        if candidate is None:
            continue
        predicted = normalize_answer(candidate)
        if predicted == expected:
            return True
        if expected_number is not None and _as_number(predicted) == expected_number:
            return True
    return False
