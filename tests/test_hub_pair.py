"""Drafters know their target (Hub id, revision, aliases) and `load_pair` loads a ready pair from a drafter id or
folder, offline from a huggingface_hub cache built in tmp_path; the int8 release format loads via from_pretrained."""

import json

import pytest
import torch
from huggingface_hub import constants

import dspark_hf
from conftest import cached_draft, make_drafter, make_target, make_tokenizer
from dspark_hf import DSparkDrafter, NotCachedError, load_pair
from dspark_hf.models.configuration_dspark import DSparkConfig
from dspark_hf.testbed.release import export_release, load_release, release_path

REV_T, REV_D = "1" * 40, "2" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache for this test (HF_HUB_CACHE, read by huggingface_hub and transformers)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def put_in_cache(cache, repo_id, revision, *objects):
    """Writes `objects` (anything with save_pretrained) as the `main` snapshot of `repo_id` in huggingface_hub's cache
    layout: models--org--name/snapshots/<revision>/... and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    for obj in objects:
        obj.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def cached_pair(cache, target_id="org/tiny-target", drafter_id="org/tiny-drafter"):
    target, tokenizer = make_target("llama"), make_tokenizer()
    target_dir = put_in_cache(cache, target_id, REV_T, target, tokenizer)
    loaded = type(target).from_pretrained(target_dir)  # as from the Hub: the config names the snapshot folder
    drafter = make_drafter(loaded)
    put_in_cache(cache, drafter_id, REV_D, drafter)
    return target, drafter


# ------------------------------------------------------------------------------------------ the recorded target

def test_from_target_records_the_hub_id_and_revision_not_a_path(tmp_path):
    target = make_target("llama")
    target.config._name_or_path, target.config._commit_hash = "org/tiny-target", "a" * 40
    cfg = make_drafter(target).config
    assert (cfg.target_name_or_path, cfg.target_revision, cfg.target_aliases) == ("org/tiny-target", "a" * 40, [])
    assert cfg.target_hub_id == "org/tiny-target"

    target.config._name_or_path = str(tmp_path / "hub" / "models--org--tiny-target" / "snapshots" / REV_T)
    cfg = make_drafter(target).config  # a cached snapshot folder is its Hub id and commit
    assert (cfg.target_name_or_path, cfg.target_revision) == ("org/tiny-target", REV_T)

    target.save_pretrained(tmp_path / "local")  # a plain local folder: recorded as the fallback, never shipped
    target.config._name_or_path = str(tmp_path / "local")
    cfg = make_drafter(target).config
    assert cfg.target_name_or_path == str(tmp_path / "local") and cfg.target_hub_id is None
    assert cfg.portable_target_fields() == {"target_name_or_path": None, "target_revision": None, "target_aliases": []}

    given = make_drafter(target, target_name_or_path="org/other", target_revision="v1").config  # given explicitly
    assert (given.target_name_or_path, given.target_revision) == ("org/other", "v1")
    assert DSparkConfig.from_dict(given.to_dict()).target_revision == "v1"  # round trip through config.json


def test_shipped_release_records_the_hub_id_with_the_registry_alias():
    config = json.loads((release_path("smollm2-135m-instruct") / "config.json").read_text())
    assert config["target_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["target_aliases"] == ["smollm2-135m-instruct"]
    assert not any(isinstance(v, str) and ("/.cache/" in v or v.startswith("/")) for v in config.values())


# ------------------------------------------------------------------------------------------ load_pair

def test_load_pair_from_cached_hub_ids_offline(hub_cache):
    target, drafter = cached_pair(hub_cache)
    loaded_target, tokenizer, loaded = load_pair("org/tiny-drafter", dtype=torch.float32)
    assert tokenizer is not None and tokenizer.convert_ids_to_tokens(7) == "w7"
    assert loaded.bound_to(loaded_target) and loaded.dtype == loaded_target.dtype == torch.float32
    assert loaded_target.config._name_or_path == "org/tiny-target"  # named like an online load, not by cache path
    assert loaded.config.target_name_or_path == "org/tiny-target" and loaded.config.target_revision == REV_T
    ids = torch.randint(4, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(cached_draft(loaded, loaded_target, ids, 8).tokens, cached_draft(drafter, target, ids, 8).tokens)
    ref = loaded_target.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ref, loaded_target.generate(ids, assistant_model=loaded, max_new_tokens=8, do_sample=False))
    # a drafter folder works the same; transformers itself resolves the cached drafter id too
    other_target, _, again = load_pair(hub_cache / "models--org--tiny-drafter" / "snapshots" / REV_D)
    assert again.bound_to(other_target)
    assert DSparkDrafter.from_pretrained("org/tiny-drafter").config.target_revision == REV_T


def test_load_pair_errors_name_the_missing_repo(hub_cache, tmp_path):
    with pytest.raises(NotCachedError, match="drafter 'org/absent-drafter'.*not in the local Hugging Face cache"):
        load_pair("org/absent-drafter")
    target = make_target("llama")
    make_drafter(target, target_name_or_path="org/absent-target").save_pretrained(tmp_path / "d")
    with pytest.raises(NotCachedError, match="org/absent-target"):
        load_pair(tmp_path / "d")
    with pytest.raises(ValueError, match="neither an existing folder nor a Hub id"):
        load_pair("no such folder")


@pytest.mark.parametrize("which", ["drafter", "target"])
def test_a_corrupted_download_names_the_repo(hub_cache, which):
    cached_pair(hub_cache)
    repo = {"drafter": "org/tiny-drafter", "target": "org/tiny-target"}[which]
    rev = {"drafter": REV_D, "target": REV_T}[which]
    weights = hub_cache / f"models--{repo.replace('/', '--')}" / "snapshots" / rev / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a partial download
    with pytest.raises(OSError, match=rf"'{repo}' is in the local Hugging Face cache .* corrupted or partial "
                                      rf"download\? .*hf download {repo} --force-download"):
        load_pair("org/tiny-drafter")


def test_load_pair_with_a_target_passed_in_checks_its_fingerprint(hub_cache):
    target, _ = cached_pair(hub_cache)
    same, tokenizer, drafter = load_pair("org/tiny-drafter", target=target)
    assert same is target and drafter.bound_to(target)
    assert tokenizer is not None  # looked up from the recorded target, in the cache
    with pytest.raises(ValueError, match="does not fit the target.*layer count"):
        load_pair("org/tiny-drafter", target=make_target("llama", layers=6))


def test_registry_alias_when_the_hub_id_is_not_cached(hub_cache, tmp_path, monkeypatch):
    """A drafter built on a converted test-bed target records the spec's Hub id (from the manifest, which load_target
    upgrades) and the registry name as an alias; with the Hub id absent from the cache, load_pair uses the alias."""
    from dspark_hf.testbed.targets import MANIFEST_NAME, TARGETS, load_target

    spec = TARGETS["smollm2-135m-instruct"]
    folder = tmp_path / "dspark" / "targets" / spec.name  # a finished conversion, no download needed
    make_target("llama").save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    (folder / MANIFEST_NAME).write_text(json.dumps({"name": spec.name, "sha256": spec.sha256}))  # an old manifest
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "dspark"))
    target, _ = load_target(spec.name)
    assert json.loads((folder / MANIFEST_NAME).read_text())["hub_id"] == spec.hub_id
    drafter = make_drafter(target)
    assert (drafter.config.target_name_or_path, drafter.config.target_aliases) == (spec.hub_id, [spec.name])
    drafter.save_pretrained(tmp_path / "drafter")
    loaded_target, tokenizer, loaded = load_pair(tmp_path / "drafter")
    assert loaded.bound_to(loaded_target) and tokenizer is not None
    assert loaded_target.config._name_or_path == str(folder)


def test_cli_takes_cached_hub_ids_for_target_and_drafter(hub_cache, capsys):
    from dspark_hf.cli import main
    from dspark_hf.testbed.targets import load_target

    cached_pair(hub_cache)
    model, _ = load_target("org/tiny-target")
    assert model.config._name_or_path == "org/tiny-target" and model.config._commit_hash == REV_T
    assert main(["demo", "--target", "org/tiny-target", "--drafter", "org/tiny-drafter", "--max-new-tokens", "6",
                 "--prompt", "w5 w6 w7"]) == 0
    assert "identical to target greedy: yes" in capsys.readouterr().out
    with pytest.raises(OSError, match="org/nope"):
        load_target("org/nope")


# ------------------------------------------------------------------------------------------ the int8 release format

def test_from_pretrained_loads_the_int8_release_like_load_release(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.config.target_name_or_path = "/root/.cache/dspark_hf/targets/smollm2-135m-instruct"  # a cache path
    drafter.save_pretrained(tmp_path / "trained")
    out = export_release(tmp_path / "trained", tmp_path / "release")
    shipped = json.loads((out / "config.json").read_text())
    assert shipped["target_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the cache path is stripped
    assert shipped["target_aliases"] == ["smollm2-135m-instruct"]
    via_hf = DSparkDrafter.from_pretrained(out, target=target)
    via_release = load_release(out, target=target)
    assert via_hf.dtype == torch.float32
    for (name, a), (_, b) in zip(via_hf.state_dict().items(), via_release.state_dict().items()):
        assert torch.equal(a, b), name
    half = DSparkDrafter.from_pretrained(out, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    ref = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ref, target.generate(ids, assistant_model=via_hf, max_new_tokens=8, do_sample=False))
    _, _, paired = load_pair(out, target=target)  # and load_pair takes a release folder
    assert paired.bound_to(target)


def test_from_pretrained_loads_the_shipped_release():
    drafter = DSparkDrafter.from_pretrained(release_path("smollm2-135m-instruct"))
    assert drafter.config.target_hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    reference = load_release(release_path("smollm2-135m-instruct"))
    name = "markov_head.markov_w1.weight"
    assert torch.equal(drafter.state_dict()[name], reference.state_dict()[name])
    assert dspark_hf.load_pair is load_pair
