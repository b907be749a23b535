"""The code a saved drafter folder carries, so that plain transformers (no dspark_hf installed) runs it.

A drafter folder holds two kinds of remote code:

* the model files next to `config.json` (`modeling_dspark.py` and what it imports from `dspark_hf/models/`, including
  the batch-1 candidate generator), copied by transformers' own `save_pretrained` because the classes are registered
  for `AutoConfig` / `AutoModel`: `AutoModel.from_pretrained(folder, trust_remote_code=True)`, then
  `target.generate(**inputs, assistant_model=drafter)`;
* `custom_generate/` (written here): `generate.py` (the recipe `dspark_hf.hub.custom_generate`) and copies of every
  dspark_hf module it reaches through relative imports (the batched loop, its round state, scheduler, verification,
  SPS profiler, the drafter), flattened into one folder with `from ..models.x import` / `from .x import` rewritten to
  `from .x import`, because transformers resolves a `custom_generate/generate.py`'s relative imports inside
  `custom_generate/` only: `target.generate(**inputs, custom_generate=folder_or_repo, trust_remote_code=True)`.

The copies are made from the installed package at save time, so a folder runs the code of the dspark_hf version
that saved it. Flattening needs distinct file names and no absolute `dspark_hf` import in any copied module; both are
checked (a `RuntimeError` names the file) so a module that breaks the rule fails the tests, not a user.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

__all__ = ["CUSTOM_GENERATE_DIR", "custom_generate_sources", "write_custom_generate"]

CUSTOM_GENERATE_DIR = "custom_generate"
_PACKAGE = Path(__file__).resolve().parents[1]  # .../dspark_hf
_ENTRY = Path("hub") / "custom_generate.py"
# transformers checks these before running the recipe (`check_python_requirements`): a clear message, not an ImportError
_REQUIREMENTS = "# checked by transformers before custom_generate/generate.py runs\ntransformers>=5.24\ntorch>=2.6\n"


def _inside_try(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a `try:` block (optional imports)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for child in ast.walk(node):
                if isinstance(child, ast.ImportFrom):
                    inside.add(id(child))
    return inside


def _relative_imports(path: Path) -> list[tuple[int, int, str | None]]:
    """`(line, level, module)` of every relative `from ... import` in the file, optional ones (in `try:`) left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    optional = _inside_try(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0 and id(node) not in optional:
            found.append((node.lineno, node.level, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dspark_hf":
            raise RuntimeError(f"{path} imports {node.module} by absolute path: it cannot be copied into a "
                               "drafter's custom_generate/ folder (use a relative import)")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "dspark_hf" for a in node.names):
            raise RuntimeError(f"{path} imports dspark_hf by absolute path: it cannot be copied into a drafter's "
                               "custom_generate/ folder (use a relative import)")
    return sorted(found)


def _resolve(path: Path, level: int, module: str | None) -> Path:
    base = path.parent
    for _ in range(level - 1):
        base = base.parent
    if module is None or not (base / (module.replace(".", "/") + ".py")).is_file():
        raise RuntimeError(f"{path}: `from {'.' * level}{module or ''} import ...` does not name a module file of "
                           "dspark_hf, so it cannot be copied into a drafter's custom_generate/ folder (import a "
                           "module, or make the import optional inside try:)")
    return base / (module.replace(".", "/") + ".py")


def custom_generate_sources() -> dict[str, str]:
    """`{file name: source}` of a drafter's `custom_generate/` folder: the recipe as `generate.py` and every module it
    reaches through relative imports, one folder, imports flattened. `RuntimeError` if a module cannot be flattened."""
    entry = _PACKAGE / _ENTRY
    names = {entry: "generate.py"}
    pending, sources = [entry], {}
    while pending:
        path = pending.pop()
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for lineno, level, module in _relative_imports(path):
            dep = _resolve(path, level, module)
            if dep not in names:
                names[dep] = dep.name
                pending.append(dep)
            pattern = rf"^(\s*from\s+)\.{{{level}}}{re.escape(module or '')}(\s+import\b)"
            line, count = re.subn(pattern, rf"\g<1>.{dep.stem}\g<2>", lines[lineno - 1])
            if count != 1:
                raise RuntimeError(f"{path}:{lineno}: could not rewrite the relative import of {module!r} "
                                   "(write it as one `from .x import ...` line)")
            lines[lineno - 1] = line
        sources[names[path]] = "".join(lines)
    clashes = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
    if clashes:
        raise RuntimeError(f"modules reached from {_ENTRY} share file names {clashes}: they cannot be flattened "
                           "into one custom_generate/ folder")
    return dict(sorted(sources.items()))


def write_custom_generate(save_directory: str | os.PathLike) -> Path:
    """Writes `<save_directory>/custom_generate/` (the recipe, its modules and a `requirements.txt`); returns it."""
    folder = Path(save_directory) / CUSTOM_GENERATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    sources = custom_generate_sources()
    for stale in folder.glob("*.py"):
        if stale.name not in sources:
            stale.unlink()
    for name, text in sources.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "requirements.txt").write_text(_REQUIREMENTS, encoding="utf-8")
    return folder


def _install() -> None:
    from ..models.modeling_dspark import DSparkDrafter

    DSparkDrafter._custom_generate_writer = staticmethod(write_custom_generate)


_install()
