"""The release drafter shipped in the package, and the export that writes it."""

import os

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter
from dspark_hf.testbed.release import (MAX_RELEASE_BYTES, RELEASES, export_release, folder_bytes, load_release,
                               quantize_rows, release_path)


def test_shipped_release_drafter_fits_smollm2_and_the_size_limit():
    path = release_path("smollm2-135m-instruct")
    assert folder_bytes(path) <= MAX_RELEASE_BYTES
    drafter = load_release(path)  # strict: every tensor present and shaped right
    cfg = drafter.config
    assert (cfg.target_vocab_size, cfg.target_hidden_size, cfg.target_num_hidden_layers) == (49152, 576, 30)
    assert cfg.sequential_head == "markov" and cfg.confidence_head
    assert len(cfg.sts_temperatures) == cfg.block_size  # calibrated
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # the target's own, never shipped


def test_release_path_errors_name_the_problem():
    with pytest.raises(KeyError, match="no release drafter for target 'nope'"):
        release_path("nope")
    assert "smollm2-135m-instruct" in RELEASES


def test_export_release_casts_and_refuses_oversized_without_touching_the_old_copy(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "trained")
    out = export_release(tmp_path / "trained", tmp_path / "release")
    loaded = load_release(out, target=target)
    ref = DSparkDrafter.from_pretrained(tmp_path / "trained", target=target)
    for (name, a), (_, b) in zip(loaded.named_parameters(), ref.named_parameters()):
        if name.startswith("markov_head.markov_w"):  # int8 rows: within half a quantization step of each row
            step = b.abs().amax(dim=1, keepdim=True) / 127
            assert ((a - b).abs() <= step / 2 + 1e-6).all(), name
        else:
            assert torch.equal(a, b.bfloat16().float()), name  # exactly the bf16 rounding of the trained weights
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    ref_out = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ref_out, target.generate(ids, assistant_model=loaded, max_new_tokens=12, do_sample=False))
    size = folder_bytes(out)
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.rglob('*') if f.is_file()} == {
        f.name: oct(0o644 & ~umask) for f in out.rglob('*') if f.is_file()}  # shareable, as git checks out
    with pytest.raises(ValueError, match="over the"):
        export_release(tmp_path / "trained", tmp_path / "release", max_bytes=size // 4)
    assert folder_bytes(out) == size and not list(tmp_path.glob(".release*"))  # old copy intact, no leftovers


def test_quantize_rows_round_trip_and_corrupt_release_errors(tmp_path):
    w = torch.randn(10, 6)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (10, 1)
    assert ((q.float() * scale - w).abs() <= scale / 2 + 1e-7).all()
    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path / "trained")
    out = export_release(tmp_path / "trained", tmp_path / "release")
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="could not read the release drafter"):
        load_release(out)


def test_the_shipped_lookup_table_loads_and_drafts():
    """The n-gram lookup table shipped for SmolLM2 (the demo's default) loads and continues a common answer opening;
    a target without one gets None."""
    from dspark_hf.models.lookup import NgramLookup
    from dspark_hf.testbed.release import LOOKUPS, load_release_lookup

    assert set(LOOKUPS) <= set(RELEASES)
    lookup = load_release_lookup("smollm2-135m-instruct")
    assert isinstance(lookup, NgramLookup) and len(lookup) > 100_000
    report = lookup.calibration_report()
    assert report["corpus"]["trials"] > 1000 and abs(report["corpus"]["rate"] - report["corpus"]["predicted"]) < 0.05
    assert load_release_lookup("no-such-target") is None
    from dspark_hf.testbed.release import LOOKUPS, RELEASE_DIR, resolve_lookup

    assert len(resolve_lookup("release", "smollm2-135m-instruct")) == len(lookup)
    path = RELEASE_DIR / LOOKUPS["smollm2-135m-instruct"] / "lookup.safetensors"
    assert len(resolve_lookup(str(path), "anything")) == len(lookup)
    with pytest.raises(ValueError, match="no lookup table ships"):
        resolve_lookup("release", "no-such-target")


def test_files_written_atomically_get_the_mode_a_plain_write_gives(tmp_path):
    """mkstemp and safetensors create 0600 files; results, caches and shipped data written through a temporary file
    must be as readable as a plain `open(...).write` makes them."""
    from dspark_hf.models.lookup import NgramLookup
    from dspark_hf.provenance import atomic_write_json

    (tmp_path / "plain.txt").write_text("x")
    atomic_write_json(tmp_path / "atomic.json", {"x": 1})
    NgramLookup.build([([1, 2, 3, 1, 2, 3], [1] * 6)], max_order=2, heldout_share=0.0).save(tmp_path / "t.safetensors")
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["atomic.json"] == modes["t.safetensors"] == modes["plain.txt"]
