"""The example notebooks (issue 12, part 4): each runs top to bottom on the CPU (nbclient, a fresh kernel, the tiny
random pair so that no download is needed), carries no stored outputs in git, and opens in Colab from its badge.
`pytest -m slow` also runs them on SmolLM2-135M-Instruct where its converted target is cached."""

import json
import os
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "train_your_own", "calibration_and_scheduling"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_no_stored_outputs_and_a_colab_badge(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, "".join(cell["source"])[:80]
    assert "widgets" not in nb["metadata"]
    first = "".join(nb["cells"][0]["source"])
    assert "colab.research.google.com/assets/colab-badge.svg" in first
    assert f"/blob/main/examples/{path.name})" in first
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "torch.cuda.is_available()" in code  # picks a GPU when there is one


def _run(path, tmp_path, **env):
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' (nbclient, nbformat, ipykernel)")
    import nbformat

    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_on_the_tiny_pair(path, tmp_path):
    nb = _run(path, tmp_path, DSPARK_EXAMPLES_TOY="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "tiny" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)  # its plots were drawn


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_smollm2_when_cached(path, tmp_path):
    from dspark_hf.testbed.targets import TARGETS, default_cache_dir, is_complete

    if not is_complete(default_cache_dir() / "smollm2-135m-instruct", TARGETS["smollm2-135m-instruct"]):
        pytest.skip("SmolLM2-135M-Instruct is not cached (dspark-hf fetch-target smollm2-135m-instruct)")
    _run(path, tmp_path, DSPARK_EXAMPLES_TOY="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
