"""`dspark_hf.generate` arguments: unknown keywords fail loudly, `generation_config=` is honoured (explicit keywords
win), settings the loop cannot honour raise NotImplementedError, and nothing (no SPS table) is cached at module
level."""

import pytest
import torch
from transformers import GenerationConfig

import dspark_hf
from conftest import make_drafter, make_target
from dspark_hf.decoding import batched, round_state

IDS = torch.tensor([[5, 17, 33, 2], [40, 41, 42, 43]])


def sps_curve(b):
    return 1.0 / (1.0 + 0.08 * b)


def new_tokens(out, prompt_width=IDS.shape[1]):
    seqs = out.sequences if hasattr(out, "sequences") else out
    return seqs[:, prompt_width:]


@pytest.fixture(scope="module")
def llama():
    target = make_target("llama")
    return target, make_drafter(target)


# ---------------------------------------------------------------------------------------------- unknown keywords
@pytest.mark.parametrize("typo, suggestion", [("max_new_token", "max_new_tokens"), ("polcy", "policy"),
                                              ("temprature", "temperature")])
def test_misspelled_keyword_is_a_type_error_naming_it(llama, typo, suggestion):
    target, drafter = llama
    with pytest.raises(TypeError, match=rf"'{typo}' \(did you mean '{suggestion}'\?\)"):
        dspark_hf.generate(target, drafter, IDS, policy="fixed", **{typo: 5})


def test_non_generation_keyword_is_a_type_error(llama):
    target, drafter = llama
    with pytest.raises(TypeError, match="token_type_ids"):
        dspark_hf.generate(target, drafter, IDS, max_new_tokens=3, policy="fixed", token_type_ids=torch.zeros_like(IDS))
    with pytest.raises(TypeError, match="GenerationConfig"):
        dspark_hf.generate(target, drafter, IDS, policy="fixed", generation_config={"max_new_tokens": 3})


# ---------------------------------------------------------------------------------------------- generation_config
@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_generation_config_max_new_tokens_is_honoured(target, drafter, policy):
    ref = target.generate(IDS, attention_mask=torch.ones_like(IDS), do_sample=False, max_new_tokens=12)
    out = dspark_hf.generate(target, drafter, IDS, generation_config=GenerationConfig(max_new_tokens=12),
                             policy=policy, sps=sps_curve)
    assert new_tokens(out).shape == (2, 12)
    assert torch.equal(out, ref)


def test_generation_config_max_length_and_return_dict(llama):
    target, drafter = llama
    cfg = GenerationConfig(max_length=IDS.shape[1] + 7, return_dict_in_generate=True)
    out = dspark_hf.generate(target, drafter, IDS, generation_config=cfg, policy="fixed")
    assert isinstance(out, dspark_hf.DSparkGenerateOutput)
    assert out.num_generated.tolist() == [7, 7] and new_tokens(out).shape == (2, 7)
    # max_length also works as a transformers-style keyword argument
    out = dspark_hf.generate(target, drafter, IDS, policy="fixed", max_length=IDS.shape[1] + 3)
    assert new_tokens(out).shape == (2, 3)


def test_explicit_keywords_win_over_generation_config(llama):
    target, drafter = llama
    ref = target.generate(IDS, attention_mask=torch.ones_like(IDS), do_sample=False, max_new_tokens=5)
    cfg = GenerationConfig(max_new_tokens=30, do_sample=True, temperature=0.5, return_dict_in_generate=True)
    out = dspark_hf.generate(target, drafter, IDS, generation_config=cfg, max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=False, policy="fixed")
    assert isinstance(out, torch.Tensor) and torch.equal(out, ref)
    # an EOS from the config stops the rows; an explicit empty EOS list overrides it
    eos = int(ref[0, IDS.shape[1] + 1])
    stopped = dspark_hf.generate(target, drafter, IDS[:1], policy="fixed", return_dict_in_generate=True,
                                 generation_config=GenerationConfig(max_new_tokens=5, eos_token_id=eos))
    assert stopped.num_generated.tolist() == [2]
    unstopped = dspark_hf.generate(target, drafter, IDS[:1], policy="fixed", eos_token_id=[],
                                   return_dict_in_generate=True,
                                   generation_config=GenerationConfig(max_new_tokens=5, eos_token_id=eos))
    assert unstopped.num_generated.tolist() == [5]


def test_max_time_is_honoured(llama):
    target, drafter = llama
    out = dspark_hf.generate(target, drafter, IDS, policy="fixed", max_new_tokens=20, max_time=0.0,
                             return_dict_in_generate=True)
    assert out.num_generated.tolist() == [1, 1]  # the time is up after every row's first token


# ---------------------------------------------------------------------------------------------- unsupported settings
UNSUPPORTED = [("repetition_penalty", 1.3), ("num_beams", 2), ("min_new_tokens", 3), ("no_repeat_ngram_size", 2),
               ("bad_words_ids", [[3]]), ("typical_p", 0.9), ("output_scores", True)]


@pytest.mark.parametrize("name, value", UNSUPPORTED)
def test_unsupported_settings_raise_as_keyword_and_in_generation_config(llama, name, value):
    target, drafter = llama
    with pytest.raises(NotImplementedError, match=name):
        dspark_hf.generate(target, drafter, IDS, max_new_tokens=3, policy="fixed", **{name: value})
    with pytest.raises(NotImplementedError, match=name):
        dspark_hf.generate(target, drafter, IDS, policy="fixed",
                           generation_config=GenerationConfig(max_new_tokens=3, **{name: value}))


def test_neutral_and_harmless_settings_are_accepted(llama):
    target, drafter = llama
    ref = dspark_hf.generate(target, drafter, IDS, max_new_tokens=6, policy="fixed")
    out = dspark_hf.generate(target, drafter, IDS, max_new_tokens=6, policy="fixed", repetition_penalty=1.0,
                             num_beams=1, use_cache=False, output_attentions=False)
    assert torch.equal(out, ref)


def test_custom_generate_path_refuses_unsupported_settings(llama):
    target, drafter = llama
    with pytest.raises(NotImplementedError, match="RepetitionPenalty"):
        target.generate(IDS, custom_generate=dspark_hf.speculative_generate, drafter=drafter, policy="fixed",
                        max_new_tokens=4, repetition_penalty=1.3)
    # transformers' prepared model kwargs (position_ids, cache, use_cache, ...) are accepted
    ref = dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="fixed")
    out = target.generate(IDS, custom_generate=dspark_hf.speculative_generate, drafter=drafter, policy="fixed",
                          max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------- no module-level caches
def test_modules_hold_no_mutable_module_level_state():
    assert not hasattr(batched, "_SPS_CACHE")
    for module in (batched, round_state):
        mutable = [name for name, value in vars(module).items()
                   if not name.startswith("__") and isinstance(value, (dict, list, set))]
        assert mutable == [], (module.__name__, mutable)


def test_sps_cache_directory_spares_a_new_cache_the_profile_for_the_same_setup_only(monkeypatch, llama, tmp_path):
    target, drafter = llama
    calls = []

    def fake_profile(*a, **k):
        calls.append(k["rows"])
        return dspark_hf.profile_sps(target, max_tokens=k["max_tokens"], context_lengths=(8,), repeats=1,
                                     progress=False, rows=k["rows"])

    monkeypatch.setattr(batched, "profile_sps", fake_profile)
    first = dspark_hf.SPSCache(tmp_path / "sps")
    out = dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled", sps=first)
    files = sorted((tmp_path / "sps").glob("sps-*.json"))
    assert first.profiles == 1 and len(files) == 1 and calls == [2]
    # a new cache (a new process) on the same directory reads the table instead of profiling, and decodes the same
    second = dspark_hf.SPSCache(tmp_path / "sps")
    again = dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled", sps=second)
    assert torch.equal(out, again) and second.profiles == 0 and second.loaded == 1 and len(calls) == 1
    assert second.tables[next(iter(second.tables))].seconds == first.tables[next(iter(first.tables))].seconds
    # another setup never reads that file: other torch threads (the device as described), another attention
    monkeypatch.setattr(batched, "device_description", lambda device=None: "another CPU (torch threads 7)")
    third = dspark_hf.SPSCache(tmp_path / "sps")
    dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled", sps=third)
    assert third.loaded == 0 and third.profiles == 1 and len(list((tmp_path / "sps").glob("sps-*.json"))) == 2
    monkeypatch.undo()
    monkeypatch.setattr(batched, "profile_sps", fake_profile)
    key = dspark_hf.SPSCache.key(target)
    target.config._attn_implementation = "eager"
    try:
        assert dspark_hf.SPSCache.key(target) != key
        fourth = dspark_hf.SPSCache(tmp_path / "sps")
        fourth.table(target, 10, rows=2)
        assert fourth.loaded == 0 and fourth.profiles == 1
    finally:
        target.config._attn_implementation = key[3]
    # a damaged file is profiled anew and replaced, not trusted and not fatal
    files[0].write_text("{not json")
    fifth = dspark_hf.SPSCache(tmp_path / "sps")
    fifth.table(target, 10, rows=2)
    assert fifth.loaded == 0 and fifth.profiles == 1
    sixth = dspark_hf.SPSCache(tmp_path / "sps")
    sixth.table(target, 10, rows=2)
    assert sixth.loaded == 1 and sixth.profiles == 0
    # a call wider than the stored table covers profiles anew (and replaces the file)
    sixth.table(target, 40, rows=2)
    assert sixth.profiles == 1


def test_sps_cache_profiles_once_and_sps_none_every_call(monkeypatch, llama):
    target, drafter = llama
    real = dspark_hf.profile_sps(target, max_tokens=12, context_lengths=(8,), repeats=1, progress=False)
    calls = []
    monkeypatch.setattr(batched, "profile_sps", lambda *a, **k: calls.append((k["max_tokens"], k["rows"])) or real)
    cache = dspark_hf.SPSCache()
    first = dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled", sps=cache)
    second = dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled", sps=cache)
    assert torch.equal(first, second)
    assert len(calls) == 1 and cache.profiles == 1 and len(cache.tables) == 1
    # a batch wider than the table covers (3 rows x (block 4 + 1) = 15 > 12 tokens) re-profiles once
    dspark_hf.generate(target, drafter, torch.cat([IDS, IDS[:1]]), max_new_tokens=4, policy="scheduled", sps=cache)
    assert len(calls) == 2 and cache.profiles == 2
    # in the loop's layout: the call's rows rounded up to a power of two (2, then 3 -> 4), 1 .. block + 1 tokens each
    assert calls == [(2 * 5, 2), (4 * 5, 4)] and len(cache.tables) == 2
    calls.clear()
    for _ in range(2):  # no hidden cache: sps=None profiles for that call only
        dspark_hf.generate(target, drafter, IDS, max_new_tokens=4, policy="scheduled")
    assert len(calls) == 2
