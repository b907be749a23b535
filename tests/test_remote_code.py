"""A saved drafter runs with transformers alone (issue 12, part 3): in a fresh process that never imports dspark_hf,
`AutoModel.from_pretrained(folder, trust_remote_code=True)` drafts through `generate(assistant_model=...)`, and
`generate(custom_generate=<folder or cached Hub id>, trust_remote_code=True)` runs the batched loop from the folder's
own `custom_generate/`; outputs equal the installed package's (greedy and sampled, same seed). Also: what
`custom_generate/` holds, that uploads carry it, and the release folders."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.hf_api import RepoUrl

import dspark_hf
from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter
from dspark_hf.hub.remote_code import custom_generate_sources
from dspark_hf.testbed.release import export_release, release_path

PROMPT = [[5, 17, 33, 2, 9]]
BATCH = [[0, 0, 5, 17, 33], [4, 5, 6, 7, 8]]
REVISION = "3" * 40


def _package_outputs(target, drafter, release):
    ids = torch.tensor(PROMPT)
    batch = torch.tensor(BATCH)
    mask = (batch != 0).long()
    out = {"assisted": target.generate(ids, assistant_model=drafter, max_new_tokens=12,
                                       do_sample=False)[0].tolist(),
           "release_assisted": target.generate(ids, assistant_model=release, max_new_tokens=12,
                                               do_sample=False)[0].tolist()}
    out["greedy"] = target.generate(batch, attention_mask=mask, custom_generate=dspark_hf.speculative_generate,
                                    drafter=drafter, max_new_tokens=10, do_sample=False).tolist()
    torch.manual_seed(123)
    out["sampled"] = target.generate(batch, attention_mask=mask, custom_generate=dspark_hf.speculative_generate,
                                     drafter=drafter, max_new_tokens=10, do_sample=True, temperature=0.9,
                                     policy="threshold", threshold=0.3).tolist()
    return out


FRESH = """
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

class Collect(BaseStreamer):
    def __init__(self): self.chunks, self.ended = [], False
    def put(self, value): self.chunks.append(value.reshape(-1).tolist())
    def end(self): self.ended = True

folder, release, hub_id = sys.argv[1], sys.argv[2], sys.argv[3]
target = AutoModelForCausalLM.from_pretrained(sys.argv[4]).eval()
ids, batch = torch.tensor({prompt}), torch.tensor({batch})
mask = (batch != 0).long()
out = {{}}
drafter = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
out["assisted"] = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)[0].tolist()
out["stats"] = drafter.last_speculation_stats.proposed
out["drafter_module"] = type(drafter).__module__
released = AutoModel.from_pretrained(release, trust_remote_code=True).eval()
out["release_assisted"] = target.generate(ids, assistant_model=released, max_new_tokens=12,
                                          do_sample=False)[0].tolist()
out["greedy"] = target.generate(batch, attention_mask=mask, custom_generate=folder, trust_remote_code=True,
                                max_new_tokens=10, do_sample=False).tolist()
out["greedy_hub"] = target.generate(batch, attention_mask=mask, custom_generate=hub_id, trust_remote_code=True,
                                    max_new_tokens=10, do_sample=False).tolist()
torch.manual_seed(123)
out["sampled"] = target.generate(batch, attention_mask=mask, custom_generate=folder, trust_remote_code=True,
                                 max_new_tokens=10, do_sample=True, temperature=0.9, policy="threshold",
                                 threshold=0.3).tolist()
streamer = Collect()
row = target.generate(ids, custom_generate=folder, trust_remote_code=True, max_new_tokens=8, do_sample=False,
                      streamer=streamer, return_dict_in_generate=True)
out["streamed"] = [streamer.ended, streamer.chunks, row.sequences[0].tolist(), row.stats[0].rounds]
out["imported"] = sorted(m for m in sys.modules if m.startswith("dspark_hf"))
print(json.dumps(out))
"""


def test_saved_folder_runs_with_transformers_alone_in_a_fresh_process(tmp_path):
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "drafter")
    release = export_release(tmp_path / "drafter", tmp_path / "release", dtype=torch.float32)
    # the same folder as a cached Hub repo (HF_HUB_OFFLINE=1): models--org--tiny-drafter/snapshots/<rev>/...
    repo = tmp_path / "hub" / "models--org--tiny-drafter"
    drafter.save_pretrained(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)

    expected = _package_outputs(target, drafter, DSparkDrafter.from_pretrained(release, target=target))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_MODULES_CACHE=str(tmp_path / "modules"),
               OMP_NUM_THREADS="1")
    script = FRESH.format(prompt=PROMPT, batch=BATCH)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "drafter"), str(release), "org/tiny-drafter",
                           str(tmp_path / "target")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["imported"] == []  # transformers alone
    assert got["drafter_module"].startswith("transformers_modules")
    assert max(got["stats"]) == drafter.config.block_size  # it really drafted
    for key in ("assisted", "release_assisted", "greedy", "sampled"):
        assert got[key] == expected[key], key
    assert got["greedy_hub"] == expected["greedy"]
    ended, chunks, sequence, rounds = got["streamed"]
    assert ended and chunks[0] == PROMPT[0] and sum(chunks, []) == sequence and rounds > 0


def test_custom_generate_folder_is_flat_and_self_contained():
    sources = custom_generate_sources()
    assert {"generate.py", "batched.py", "round_state.py", "modeling_dspark.py", "candidate_generator.py"} <= set(
        sources)
    for name, text in sources.items():
        assert "from .." not in text, name
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("from .") and not stripped.startswith("from . import"):
                module = stripped[len("from ."):].split()[0]
                assert f"{module}.py" in sources, (name, stripped)
            assert not stripped.startswith(("import dspark_hf", "from dspark_hf")), (name, stripped)


def test_save_and_push_carry_custom_generate(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, target_name_or_path="org/tiny-target")
    drafter.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "custom_generate" / "generate.py").is_file()
    assert (tmp_path / "out" / "candidate_generator.py").is_file()  # batch 1 without dspark_hf
    card = (tmp_path / "out" / "README.md").read_text()
    assert 'custom_generate="./out", trust_remote_code=True' in card
    assert "AutoModel.from_pretrained(\"./out\", trust_remote_code=True)" in card
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]["AutoModel"] == (
        "modeling_dspark.DSparkDrafter")

    seen = {}

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            seen[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()
        return mock.MagicMock()

    with mock.patch.object(HfApi, "create_repo", return_value=RepoUrl("https://huggingface.co/me/tiny")), \
            mock.patch.object(HfApi, "create_commit", create_commit):
        drafter.push_to_hub("me/tiny")
    assert {f"custom_generate/{name}" for name in custom_generate_sources()} <= set(seen)
    assert "custom_generate/requirements.txt" in seen
    assert b'custom_generate="me/tiny", trust_remote_code=True' in seen["README.md"]


def test_release_folders_and_their_auto_map(tmp_path):
    shipped = release_path("smollm2-135m-instruct")
    config = json.loads((shipped / "config.json").read_text())
    assert "auto_map" not in config and not list(shipped.glob("*.py"))  # loads through dspark_hf, points at nothing
    assert isinstance(DSparkDrafter.from_pretrained(shipped), DSparkDrafter)
    assert "carries no remote code" in (shipped / "README.md").read_text()

    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path / "trained", model_card=False)
    out = export_release(tmp_path / "trained", tmp_path / "for-the-hub")  # remote code by default
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModel"] == "modeling_dspark.DSparkDrafter"
    assert (out / "modeling_dspark.py").is_file() and (out / "custom_generate" / "generate.py").is_file()
    bare = export_release(tmp_path / "trained", tmp_path / "bare", remote_code=False)
    assert "auto_map" not in json.loads((bare / "config.json").read_text()) and not list(bare.rglob("*.py"))


def test_custom_generate_names_the_repo_it_cannot_find(tmp_path):
    target = make_target("llama")
    with pytest.raises(OSError, match="does not contain a `custom_generate`"):
        target.generate(torch.tensor(PROMPT), custom_generate=str(tmp_path), trust_remote_code=True)


def test_custom_generate_refuses_a_target_the_drafter_was_not_built_for(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path / "drafter")
    deeper = make_target("llama", layers=6)
    with pytest.raises(ValueError, match=r"drafter .*drafter' does not fit this target.*layer count"):
        deeper.generate(torch.tensor(PROMPT), custom_generate=str(tmp_path / "drafter"), trust_remote_code=True,
                        max_new_tokens=4)


def test_models_files_import_only_each_other():
    """`save_pretrained` copies `modeling_dspark.py` and every file it reaches by relative imports (transformers'
    `custom_object_save`, which also reads imports inside functions). A relative import that leaves `models/`
    (`from ..decoding import ...`) names a file that does not exist there and breaks every save: pin that none does."""
    from transformers.dynamic_module_utils import get_relative_import_files

    models = Path(dspark_hf.__file__).parent / "models"
    reached = get_relative_import_files(str(models / "modeling_dspark.py"))
    missing = [f for f in reached if not Path(f).is_file()]
    assert not missing, f"modeling_dspark.py reaches files outside models/: {missing}"
    assert str(models / "candidate_generator.py") in reached and str(models / "realized_gain.py") in reached
