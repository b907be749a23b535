"""Training prompts for target-regenerated drafter data, built offline from sources that are not evaluation sets.

The target later answers these prompts with its own chat template; the drafter trains on those answers. Sources:

| source                      | what                                                        | needs                   |
|-----------------------------|-------------------------------------------------------------|-------------------------|
| `reasoning_gym/<name>`      | generated arithmetic / algorithmic tasks                    | reasoning-gym==0.1.25   |
| `reasoning_gym_code/<name>` | the same generators, asking for a general Python solution   | reasoning-gym==0.1.25   |
| `codeio`                    | "write `main_solution(...)`" tasks from reasoning-gym's     | reasoning-gym==0.1.25   |
|                             | CodeIO data file (read as data; its code never runs)        |                         |
| `chatterbot`                | first user turns of the English chatterbot-corpus dialogs   | chatterbot-corpus, yaml |
| `python_docs`               | "explain / write code for" prompts from the Python 3.11 doc | apt python3.11-doc      |
| `fortunes`                  | "explain / discuss / rewrite" prompts around fortunes       | apt fortunes            |
| `python_functions`          | "complete this function" stubs (signature + docstring) of   | Python's own stdlib     |
|                             | the running Python's standard library (parsed, never run)   | (opt-in: count 0)       |
| `reasoning_gym_boxed/<name>`| the math generators asking to reason step by step and box   | reasoning-gym==0.1.25   |
|                             | the answer (opt-in: `GymSource(name, n, "boxed")`)          |                         |

Design choices and limits:

- Deterministic: every source gets its own seed derived from `recipe.seed` and the source's name (crc32, not `hash`),
  pools are read in sorted file order and sampled with `random.Random`; the final list is shuffled with the recipe seed.
- `gsm_symbolic` is refused: it is the `gsm_symbolic` evaluation set's generator (see `prompt_sets.py`). Other
  generators share no templates with the evaluation sets; `eval_overlap` checks exact text equality anyway.
- Dedup is on whitespace-collapsed, case-folded text across all sources, in source order; a source that runs out of
  distinct prompts yields fewer than asked, with a warning. A missing source raises (naming the pip / apt command)
  unless `recipe.skip_missing`, which skips it with a warning.
- Gym prompts are short-answer tasks; the target's answers to them are short. The docs, codeio and fortune prompts
  supply the longer code and prose that a drafter for chat needs.
- The opt-in sources ask in the *form* the evaluation sets ask (a function stub to complete; "reason step by step,
  box the answer"), with content of their own: a drafter's acceptance depends on the kind of answer far more than on
  the prompt having been seen (`results/heldout_tau/smollm2_release_by_source.md`), so answers of that form are what
  a drafter for those sets needs. They are off by default, so the default recipe (and every committed prompt file
  built from it) is unchanged.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import random
import re
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evaluation.prompt_sets import CODE_INSTRUCTION, MATH_INSTRUCTION

GYM_STYLES = ("answer", "code", "boxed")
GYM_CODE_TEMPLATE = ("Write a Python function that solves tasks like the one below for any input, explain how it "
                     "works, and then use it to answer this instance.\n\n{question}")
# The opt-in sources ask in the evaluation sets' form (their instructions, not their content).
GYM_BOXED_TEMPLATE = "{question}\n\n" + MATH_INSTRUCTION.replace("{", "{{").replace("}", "}}")
FUNCTION_TEMPLATE = CODE_INSTRUCTION + "\n\n```python\n{stub}\n```"
FUNCTION_SKIP_DIRS = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
                      "__pycache__", "__phello__", "tkinter", "pydoc_data")
FORTUNE_TEMPLATES = (
    "What does this quote mean? Explain it in a few sentences.\n\n{text}",
    "Write a short story (under 200 words) inspired by this:\n\n{text}",
    "Do you agree with the following? Give your reasons.\n\n{text}",
    "Rewrite the following in plain, modern English and say what its point is:\n\n{text}",
)
FORTUNE_FILES = ("computers", "education", "food", "fortunes", "goedel", "humorists", "kids", "linux", "literature",
                 "magic", "miscellaneous", "paradoxum", "people", "pets", "platitudes", "science", "songs-poems",
                 "sports", "startrek", "tao", "wisdom", "work")
PYTHON_DOCS_PARTS = ("library", "tutorial", "howto", "faq", "reference")

__all__ = [
    "DEFAULT_GYM_SOURCES",
    "FORTUNE_FILES",
    "FORTUNE_TEMPLATES",
    "FUNCTION_TEMPLATE",
    "GYM_BOXED_TEMPLATE",
    "GYM_CODE_TEMPLATE",
    "GYM_STYLES",
    "PROMPT_FAMILIES",
    "PYTHON_DOCS_PARTS",
    "MATH_GENERATORS",
    "GymSource",
    "TrainingPromptRecipe",
    "boxed_math_sources",
    "build_training_prompts",
    "count_by_source",
    "eval_overlap",
    "exclude_prompts",
    "prompt_family",
    "read_prompts_jsonl",
    "sample_by_family",
    "write_jsonl",
    "write_training_prompts",
]


@dataclass(frozen=True)
class GymSource:
    """`count` prompts from the reasoning-gym generator `name`; style "answer" asks the task, "code" asks for code,
    "boxed" asks to reason step by step and box the final answer (the form of the math evaluation sets' prompts)."""

    name: str
    count: int
    style: str = "answer"

    def __post_init__(self) -> None:
        if self.name == "gsm_symbolic":
            raise ValueError("gsm_symbolic is an evaluation set (prompt_sets.py); never train on it")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count} for {self.name}")
        if self.style not in GYM_STYLES:
            raise ValueError(f"style must be one of {GYM_STYLES}, got {self.style!r}")

    @property
    def source(self) -> str:
        suffix = {"answer": "", "code": "_code", "boxed": "_boxed"}[self.style]
        return f"reasoning_gym{suffix}/{self.name}"


_MATH = ("basic_arithmetic", "chain_sum", "decimal_arithmetic", "fraction_simplification", "gcd", "lcm",
         "prime_factorization", "simple_equations", "complex_arithmetic", "count_primes", "time_intervals",
         "calendar_arithmetic", "leg_counting", "polynomial_multiplication", "simple_integration", "power_function",
         "bitwise_arithmetic")
_ALGORITHMIC = ("number_sorting", "word_sorting", "spell_backward", "base_conversion", "count_bits", "caesar_cipher",
                "letter_counting", "string_manipulation", "group_anagrams", "isomorphic_strings", "ransom_note",
                "rotate_matrix", "spiral_matrix", "binary_alternation", "course_schedule", "shortest_path",
                "syllogism", "list_functions", "family_relationships", "word_sequence_reversal", "manipulate_matrix")
_CODE = ("number_sorting", "base_conversion", "count_bits", "caesar_cipher", "isomorphic_strings", "ransom_note",
         "rotate_matrix", "spiral_matrix", "binary_alternation", "course_schedule", "group_anagrams", "shortest_path")
MATH_GENERATORS = _MATH  # the generators `boxed_math_sources` asks in the boxed style
DEFAULT_GYM_SOURCES: tuple[GymSource, ...] = (
    tuple(GymSource(name, 100) for name in _MATH + _ALGORITHMIC) + tuple(GymSource(name, 60, "code") for name in _CODE)
)


@dataclass
class TrainingPromptRecipe:
    """Which sources, how many prompts from each, and the seed: everything `build_training_prompts` depends on."""

    seed: int = field(default=1234, metadata={"help": "Master seed; each source derives its own from it."})
    reasoning_gym: tuple[GymSource, ...] = field(default=DEFAULT_GYM_SOURCES,
                                                 metadata={"help": "reasoning-gym generators (not gsm_symbolic)."})
    codeio: int = field(default=1000, metadata={"help": "Code-writing prompts from reasoning-gym's CodeIO data."})
    chatterbot: int = field(default=600, metadata={"help": "Chat openers from chatterbot-corpus (English)."})
    python_docs: int = field(default=1500, metadata={"help": "Prompts from the python3.11-doc reST sources."})
    fortunes: int = field(default=600, metadata={"help": "Open-chat prompts around Debian fortunes."})
    python_functions: int = field(default=0, metadata={"help": "Function stubs of the standard library to complete "
                                                               "(opt-in)."})
    python_docs_dir: str = field(default="/usr/share/doc/python3.11/html/_sources",
                                 metadata={"help": "reST sources installed by `apt-get install python3.11-doc`."})
    fortunes_dir: str = field(default="/usr/share/games/fortunes",
                              metadata={"help": "Fortune files installed by `apt-get install fortunes`."})
    skip_missing: bool = field(default=False, metadata={"help": "Skip (warn) instead of raising for absent sources."})

    def __post_init__(self) -> None:
        self.reasoning_gym = tuple(GymSource(**s) if isinstance(s, dict) else s for s in self.reasoning_gym)
        for name in ("codeio", "chatterbot", "python_docs", "fortunes", "python_functions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        sources = [s.source for s in self.reasoning_gym]
        if len(sources) != len(set(sources)):
            raise ValueError("each reasoning-gym (name, style) may appear once in a recipe")

    def scaled(self, factor: float) -> "TrainingPromptRecipe":
        """The same recipe asking every source for `factor` times as many prompts (rounded; sources that run out of
        distinct prompts give what they have, with a warning). `scaled(1)` is the recipe itself."""
        if factor <= 0:
            raise ValueError(f"scale must be > 0, got {factor}")
        return dataclasses.replace(
            self, reasoning_gym=tuple(dataclasses.replace(s, count=round(s.count * factor)) for s in self.reasoning_gym),
            codeio=round(self.codeio * factor), chatterbot=round(self.chatterbot * factor),
            python_docs=round(self.python_docs * factor), fortunes=round(self.fortunes * factor),
            python_functions=round(self.python_functions * factor))

    def counts(self) -> dict[str, int]:
        """source -> requested count."""
        counts = {s.source: s.count for s in self.reasoning_gym}
        counts.update(codeio=self.codeio, chatterbot=self.chatterbot, python_docs=self.python_docs,
                      fortunes=self.fortunes)
        if self.python_functions:  # (opt-in: absent from recipes that do not ask for it, as before it existed)
            counts["python_functions"] = self.python_functions
        return counts

    def source_seeds(self) -> dict[str, int]:
        """source -> the seed it is built with (stable across processes and Python versions)."""
        return {source: (self.seed * 1_000_003 + zlib.crc32(source.encode())) % (2**31 - 1) for source in self.counts()}

    def to_dict(self) -> dict[str, Any]:
        """The recipe with resolved per-source counts and seeds, for provenance next to the JSONL."""
        data = dataclasses.asdict(self)
        data["reasoning_gym"] = [dataclasses.asdict(s) for s in self.reasoning_gym]
        data["sources"] = {s: {"count": c, "seed": self.source_seeds()[s]} for s, c in self.counts().items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingPromptRecipe:
        """The recipe back from `to_dict()` (the derived `sources` entry is ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


# ----------------------------------------------------------------------------------------------------------- sources

def _module_dir(module: str, requirement: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"this training-prompt source needs {requirement}: run "
                                  f"`pip install '{requirement}'` (or `pip install 'dspark-hf[data]'`)")
    return Path(next(iter(spec.submodule_search_locations)))


def _gym_candidates(source: GymSource, seed: int) -> Iterator[tuple[str, str]]:
    _module_dir("reasoning_gym", "reasoning-gym==0.1.25")
    import reasoning_gym

    size = 4 * source.count + 64  # room for duplicates; items are generated lazily, only those taken cost time
    dataset = reasoning_gym.create_dataset(source.name, size=size, seed=seed)
    for index in range(size):
        question = dataset[index]["question"].strip()
        template = {"answer": "{question}", "code": GYM_CODE_TEMPLATE, "boxed": GYM_BOXED_TEMPLATE}[source.style]
        text = template.format(question=question)
        yield f"{source.source}/{seed}/{index}", text


def _codeio_candidates(seed: int) -> Iterator[tuple[str, str]]:
    path = _module_dir("reasoning_gym", "reasoning-gym==0.1.25") / "data" / "codeio.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    for index in order:
        row = rows[index]
        signature = re.search(r"def main_solution\(([^)]*)\)", row.get("code_sample", ""))
        args = signature.group(1).strip() if signature else "..."
        yield f"codeio/{index}", (f"Write a Python function `main_solution({args})` that solves this problem.\n\n"
                                  f"{row['task_description'].strip()}\n\n{row['input_output_spec'].strip()}")


def _chatterbot_candidates(seed: int) -> Iterator[tuple[str, str]]:
    root = _module_dir("chatterbot_corpus", "chatterbot-corpus==1.3.3") / "data" / "english"
    try:
        import yaml
    except ImportError as error:
        raise ModuleNotFoundError("the chatterbot source needs PyYAML: run `pip install pyyaml`") from error
    pool = []
    for path in sorted(root.glob("*.yml")):
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: ~10x faster
        dialogs = (yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}).get("conversations") or []
        pool += [(f"chatterbot/{path.stem}/{i}", str(d[0]).strip()) for i, d in enumerate(dialogs) if d and d[0]]
    random.Random(seed).shuffle(pool)
    yield from pool


_ROLE = re.compile(r":[\w:.+-]+:`(~?)!?([^`<]*?)\s*(?:<[^>]*>)?`")


def _strip_rst(text: str) -> str:
    """Plain text from inline reST: roles, literals, emphasis and link targets."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r"\*\*(.+?)\*\*|\*(.+?)\*", lambda m: m.group(1) or m.group(2), text)
    return " ".join(text.split())


_DIRECTIVE = re.compile(r"^\.\. (function|method|class|exception|decorator|classmethod|staticmethod|coroutinefunction|"
                        r"coroutinemethod)::\s*(.+?)\s*$")
_HEADING_RULE = re.compile(r"^([=\-~^*#\"'+])\1{2,}\s*$")


def _doc_items(path: Path, part: str) -> Iterator[tuple[str, str, str]]:
    """Items of one reST file: ("api", qualname, summary) per documented callable / class (library pages only)
    and ("heading", page title, heading) per section heading."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    module, title = "", ""
    for i, line in enumerate(lines):
        found = re.match(r"^\.\. (?:current)?module::\s*(\S+)", line)
        if found:
            module = found.group(1)
        underline = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.strip() and _HEADING_RULE.match(underline) and len(underline) >= len(line.strip()) \
                and not _HEADING_RULE.match(line):
            heading = _strip_rst(line)
            title = title or heading
            yield "heading", title, heading
        directive = _DIRECTIVE.match(line) if part == "library" else None
        if not directive:
            continue
        name = directive.group(2).split("(", 1)[0].strip()
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            continue
        # Methods are documented as `Class.method`; name their module so that `Path.exists` is unambiguous.
        qualname = name if not module or name.split(".")[0] == module.split(".")[0] else f"{module}.{name}"
        # The directive's options and continued signatures run up to the first blank line; then its first paragraph.
        j = i + 1
        while j < len(lines) and lines[j].strip():
            j += 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        body = []
        while j < len(lines) and lines[j].strip() and lines[j].startswith("   "):
            body.append(lines[j].strip())
            j += 1
        yield "api", qualname, _strip_rst(" ".join(body))


def _debian_source_dir(root: str, source: str, package: str) -> Path:
    """The folder of a source that a Debian package provides, or a clear error naming the package."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"{root} not found: the {source} source needs Debian's {package} "
                                f"(`apt-get install {package}`), or set recipe.{source} = 0")
    return base


def _python_docs_candidates(root: str, seed: int) -> Iterator[tuple[str, str]]:
    base = _debian_source_dir(root, "python_docs", "python3.11-doc")
    rng, pool = random.Random(seed), []
    for part in PYTHON_DOCS_PARTS:
        for path in sorted((base / part).rglob("*.rst.txt")):
            doc_id = path.relative_to(base).as_posix().removesuffix(".rst.txt")
            for n, (kind, first, second) in enumerate(_doc_items(path, part)):
                if kind == "api":
                    summary = second.split(". ")[0].rstrip(".")
                    quoted = f' The documentation summarises it as: "{summary}."' if 20 <= len(summary) <= 400 else ""
                    pool.append((f"python_docs/{doc_id}/{n}/explain",
                                 f"Explain what `{first}` does in Python.{quoted} Illustrate it with a short example."))
                    pool.append((f"python_docs/{doc_id}/{n}/code",
                                 f"Write a short Python program that demonstrates `{first}`, with comments "
                                 "explaining each step."))
                elif part == "faq" and second.endswith("?"):
                    pool.append((f"python_docs/{doc_id}/{n}/faq", second))
                elif part != "faq" and len(second) >= 8 and second != first and not second[0].isdigit():
                    pool.append((f"python_docs/{doc_id}/{n}/topic",
                                 f"Explain \"{second}\" (from the Python documentation page \"{first}\"), with "
                                 "a code example."))
    rng.shuffle(pool)
    yield from pool


def _fortune_candidates(root: str, seed: int) -> Iterator[tuple[str, str]]:
    base = _debian_source_dir(root, "fortunes", "fortunes")
    rng, pool = random.Random(seed), []
    for name in FORTUNE_FILES:
        path = base / name
        if not path.is_file():
            continue
        text = re.sub(r".\x08", "", path.read_text(encoding="utf-8", errors="replace"))  # overstrike: X^HX -> X
        for n, entry in enumerate(re.split(r"\n%\n", text)):
            entry = entry.strip().expandtabs(4)
            letters = sum(ch.isalpha() for ch in entry)
            if 30 <= len(entry) <= 500 and entry.count("\n") <= 12 and letters >= 0.6 * len(entry.replace(" ", "")):
                pool.append((f"fortunes/{name}/{n}", entry))
    rng.shuffle(pool)
    for prompt_id, entry in pool:
        yield prompt_id, rng.choice(FORTUNE_TEMPLATES).format(text=entry)


def boxed_math_sources(count: int) -> tuple[GymSource, ...]:
    """`count` boxed-style prompts from each math generator (`MATH_GENERATORS`), to add to a recipe's sources (none for
    a count of 0, so a recipe that asks for none is the recipe without them)."""
    return tuple(GymSource(name, count, "boxed") for name in MATH_GENERATORS) if count else ()


def _function_stub(node: Any, owner: str | None = None) -> str | None:
    """`def name(args):` and its docstring (decorators and body dropped), inside `class owner:` for a method; None
    where the docstring is missing, too short or too long, or the body is a one-liner."""
    import ast

    doc = ast.get_docstring(node, clean=True)
    if not doc or not 40 <= len(doc) <= 1200 or len(node.body) < 3 or '"""' in doc:  # (docstring + 2 statements)
        return None
    kind = ast.AsyncFunctionDef if isinstance(node, ast.AsyncFunctionDef) else ast.FunctionDef
    header = ast.unparse(ast.fix_missing_locations(kind(
        name=node.name, args=node.args, body=[ast.Pass()], decorator_list=[], returns=node.returns, type_comment=None,
        type_params=[], lineno=1, col_offset=0))).split("\n")[0]
    depth = "    " if owner is None else "        "
    lines = [f"class {owner}:", f"    {header}"] if owner is not None else [header]
    doc_lines = doc.split("\n")
    lines.append(f'{depth}"""{doc_lines[0]}')
    lines += [f"{depth}{line}" if line.strip() else "" for line in doc_lines[1:]]
    lines.append(f'{depth}"""')
    return "\n".join(lines)


def _python_function_candidates(seed: int, root: str | None = None) -> Iterator[tuple[str, str]]:
    """Public functions and public classes' public methods of the standard library with a docstring, as stubs to
    complete (parsed with `ast`; nothing is imported or run)."""
    import ast
    import sysconfig

    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"no standard library sources at {base}")
    rng, pool = random.Random(seed), []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part in FUNCTION_SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = rel.with_suffix("").as_posix()
        members = [(node, None) for node in tree.body if isinstance(node, functions)]
        members += [(item, cls.name) for cls in tree.body
                    if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_")
                    for item in cls.body if isinstance(item, functions)]
        for node, owner in members:
            if node.name.startswith("_"):
                continue
            stub = _function_stub(node, owner)
            if stub is not None:
                name = node.name if owner is None else f"{owner}.{node.name}"
                pool.append((f"python_functions/{module}/{name}/{node.lineno}", FUNCTION_TEMPLATE.format(stub=stub)))
    if not pool:
        raise FileNotFoundError(f"no documented public functions under {base}")
    rng.shuffle(pool)
    yield from pool


# ----------------------------------------------------------------------------------------------------------- builder

def _dedup_key(text: str) -> str:
    return " ".join(text.split()).casefold()


def build_training_prompts(recipe: TrainingPromptRecipe | None = None) -> list[dict[str, Any]]:
    """Builds the training prompts of a recipe: `[{"id", "source", "messages": [{"role": "user", ...}]}, ...]`.

    Deterministic given the recipe (and the installed source versions); deduplicated across sources; shuffled.
    """
    recipe = recipe or TrainingPromptRecipe()
    seeds = recipe.source_seeds()
    # (source, count, candidates): candidates() yields (id, text) in a fixed order; the builder takes the first
    # `count` texts not seen before.
    sources: list[tuple[str, int, Callable[[], Iterator[tuple[str, str]]]]] = [
        (s.source, s.count, lambda s=s: _gym_candidates(s, seeds[s.source])) for s in recipe.reasoning_gym]
    sources += [
        ("codeio", recipe.codeio, lambda: _codeio_candidates(seeds["codeio"])),
        ("chatterbot", recipe.chatterbot, lambda: _chatterbot_candidates(seeds["chatterbot"])),
        ("python_docs", recipe.python_docs, lambda: _python_docs_candidates(recipe.python_docs_dir,
                                                                            seeds["python_docs"])),
        ("fortunes", recipe.fortunes, lambda: _fortune_candidates(recipe.fortunes_dir, seeds["fortunes"])),
    ]
    if recipe.python_functions:
        sources.append(("python_functions", recipe.python_functions,
                        lambda: _python_function_candidates(seeds["python_functions"])))
    seen: set[str] = set()
    prompts: list[dict[str, Any]] = []
    for source, count, candidates in sources:
        if count == 0:
            continue
        taken = 0
        try:
            for prompt_id, text in candidates():
                key = _dedup_key(text)
                if not key or key in seen:
                    continue
                seen.add(key)
                prompts.append({"id": prompt_id, "source": source, "messages": [{"role": "user", "content": text}]})
                taken += 1
                if taken == count:
                    break
        except (ModuleNotFoundError, FileNotFoundError) as error:
            if not recipe.skip_missing:
                raise
            warnings.warn(f"skipping training-prompt source {source}: {error}", stacklevel=2)
            continue
        if taken < count:
            warnings.warn(f"{source}: only {taken} distinct prompts of {count} requested", stacklevel=2)
    random.Random(recipe.seed).shuffle(prompts)
    return prompts


def count_by_source(prompts: list[dict[str, Any]]) -> dict[str, int]:
    """source -> number of prompts, in first-seen order."""
    return dict(Counter(prompt.get("source") for prompt in prompts))


# ------------------------------------------------------------------------------------------ subsets of a prompt list

PROMPT_FAMILIES = ("chat", "code", "math")


def prompt_family(source: str) -> str:
    """The family of a prompt source: "code" (`reasoning_gym_code/*`, `codeio`, `python_docs`, `python_functions`),
    "math" (the other `reasoning_gym*/*` generators, boxed ones included) or "chat" (everything else: `chatterbot`,
    `fortunes`, unknown sources)."""
    if source.startswith("reasoning_gym_code") or source in ("codeio", "python_docs", "python_functions"):
        return "code"
    return "math" if source.startswith("reasoning_gym") else "chat"


def sample_by_family(prompts: list[dict[str, Any]], limit: int | None, seed: int = 1234) -> list[dict[str, Any]]:
    """`limit` prompts split evenly across the families present (`prompt_family`), evenly across the sources of each
    family, sorted by id.

    Families are taken in sorted order; with F families present, family i gets `limit // F` prompts plus one while
    i < `limit % F`. Inside a family each source's prompts are shuffled (one `random.Random(seed)` for the whole
    call, sources in first-seen order) and taken round robin, one per source in turn, so a source with few prompts
    gives all it has and the others fill the quota. A family with fewer prompts than its quota gives all it has (the
    result is then shorter than `limit`). With `limit` None or at least `len(prompts)`, returns the prompts as they
    are. Deterministic for a seed.
    """
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rng = random.Random(seed)
    picked: list[dict[str, Any]] = []
    families = sorted({prompt_family(p["source"]) for p in prompts})
    for f_index, fam in enumerate(families):
        quota = limit // len(families) + (f_index < limit % len(families))
        by_source: dict[str, list[dict[str, Any]]] = {}
        for p in prompts:
            if prompt_family(p["source"]) == fam:
                by_source.setdefault(p["source"], []).append(p)
        for rows in by_source.values():
            rng.shuffle(rows)
        taken: list[dict[str, Any]] = []
        i = 0
        while len(taken) < quota and any(i < len(r) for r in by_source.values()):  # round robin
            for rows in by_source.values():
                if i < len(rows) and len(taken) < quota:
                    taken.append(rows[i])
            i += 1
        picked += taken
    return sorted(picked, key=lambda p: p["id"])


def exclude_prompts(prompts: list[dict[str, Any]], paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """The prompts none of whose messages has exactly the content of a message in the JSONL files `paths` (e.g. the
    training set, when building held-out prompts). Order is kept; broken lines of the files are skipped."""
    seen = {m["content"] for path in paths for p in read_prompts_jsonl(path)[0] for m in p["messages"]}
    if not seen:
        return list(prompts)
    return [p for p in prompts if not any(m["content"] in seen for m in p["messages"])]


def write_training_prompts(out: str | os.PathLike, recipe: TrainingPromptRecipe | None = None,
                           limit: int | None = None, exclude: Iterable[str | os.PathLike] = ()) -> list[dict[str, Any]]:
    """`dspark-hf prompts`: builds the recipe's prompts, drops those in the `exclude` files, keeps `limit` of them
    (`sample_by_family`, seeded with the recipe's seed) and writes them to `out` as JSONL. Returns what it wrote."""
    recipe = recipe or TrainingPromptRecipe()
    prompts = build_training_prompts(recipe)
    exclude = list(exclude)
    if exclude:
        prompts = exclude_prompts(prompts, exclude)
    prompts = sample_by_family(prompts, limit, recipe.seed)
    write_jsonl(out, prompts)
    return prompts


def eval_overlap(prompts: list[dict[str, Any]], prompt_sets: tuple[str, ...] | None = None) -> list[str]:
    """Ids of training prompts whose text equals an evaluation prompt's (installed sets; whitespace-insensitive).

    Compares against each evaluation prompt's chat text and its raw problem text (`prompt` / `question` metadata).
    """
    from ..evaluation.prompt_sets import PROMPT_SETS, load_prompt_set, prompt_set_available

    forbidden: set[str] = set()
    for name in prompt_sets or PROMPT_SETS:
        if not prompt_set_available(name):
            continue
        for item in load_prompt_set(name):
            forbidden.add(_dedup_key(item.user_text))
            for key in ("prompt", "question"):
                if item.metadata.get(key):
                    forbidden.add(_dedup_key(item.metadata[key]))
    return [p["id"] for p in prompts if any(_dedup_key(m["content"]) in forbidden for m in p["messages"])]


# ---------------------------------------------------------------------------------------------------------- JSONL I/O

def write_jsonl(path: str | os.PathLike, prompts: list[dict[str, Any]]) -> None:
    """Writes prompts as JSON lines, atomically (a temporary file, then `os.replace`)."""
    from ..provenance import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(prompt) + "\n" for prompt in prompts))


def _as_prompt(row: Any, line_number: int) -> dict[str, Any]:
    """A validated prompt row; raises ValueError describing what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("'messages' must be a non-empty list of {'role': str, 'content': str}")
    elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError("a row needs 'messages' or a non-empty string 'prompt'")
    return {"id": str(row.get("id", f"line{line_number}")), "source": row.get("source"), "messages": messages}


def read_prompts_jsonl(path: str | os.PathLike, on_error: str = "skip") -> tuple[list[dict[str, Any]], int]:
    """Reads prompt rows (`messages` or `prompt`) from JSONL; returns (prompts, number of broken lines skipped).

    Blank lines are ignored. `on_error="raise"` raises a ValueError naming the file and 1-based line number instead.
    """
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    prompts, skipped = [], 0
    with open(path, "rb") as handle:  # bytes: a line that is not UTF-8 is one broken line, not a broken file
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                prompts.append(_as_prompt(json.loads(line.decode("utf-8")), line_number))
            except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if on_error == "raise":
                    raise ValueError(f"{path}:{line_number}: {error}") from error
                skipped += 1
    return prompts, skipped
