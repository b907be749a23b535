"""`dspark_hf.convert.export`: drafters written in the serving engines' layouts, and read back.

* "deepspec" / "sglang": the written config and weights match, key for key and shape for shape, the checkpoints
  DeepSpec itself saved for the same sizes (tests/fixtures/export/: the config.json and the key list of the recorded
  reference drafters, copied from shared/fixtures/reference-drafters; no weights).
* "speculators": the key set and config fields that vllm-project/speculators' `DSparkDraftModel` (v0.7.0.1) saves
  and vLLM's `update_dspark` reads.
* Every export is read back into a fresh `DSparkDrafter` (by `dspark_hf.convert.convert_checkpoint` when that
  exists, and always by the minimal readers below, which invert exactly the documented mapping): it drafts the same
  tokens, logits and confidences on the same context as the drafter that was exported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cached_draft, make_drafter, make_target
from safetensors.torch import load_file

from dspark_hf import DSparkDrafter
from dspark_hf.convert.export import EXPORT_FORMATS, SIDE_FILE, build_export, export_drafter, serve_command
from dspark_hf.models.configuration_dspark import DSparkConfig

FIXTURES = Path(__file__).parent / "fixtures" / "export"
HEADS = {"deepspec-vanilla": "markov", "deepspec-gated": "gated_markov", "deepspec-rnn": "rnn", "deepspec-none": "none"}
HEAD_TYPES = {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}


# --------------------------------------------------------------------------------------------------- models
def fixture_target():
    """A random Qwen3 target with the recorded fixtures' config (6 layers, hidden 64, vocab 512, RoPE theta 1e6)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw = json.loads((FIXTURES / "target_config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "dtype")}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**raw)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def randomize(drafter: DSparkDrafter, seed: int = 3) -> DSparkDrafter:
    """Every parameter random (norm weights around 1), so that every exported tensor matters for the drafts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return drafter


def fixture_drafter(target, sequential_head: str, **overrides) -> DSparkDrafter:
    """A drafter of DeepSpec's fixture sizes: block 7, 2 layers, rank 16, target layers [1, 3], mask token 500."""
    kwargs = dict(block_size=7, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, target_layer_ids=[1, 3], mask_token_id=500, markov_rank=16,
                  sequential_head=sequential_head, confidence_head=sequential_head != "none")
    kwargs.update(overrides)
    return randomize(DSparkDrafter.from_target(target, **kwargs).eval())


def drafts_of(drafter, target, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, target.config.vocab_size, (1, 12), generator=g)
    return [cached_draft(drafter, target, ids, pos, chunks=(3,)) for pos in (5, 11)]


def assert_same_drafts(a, b, target) -> None:
    for x, y in zip(drafts_of(a, target), drafts_of(b, target)):
        assert torch.equal(x.tokens, y.tokens)
        torch.testing.assert_close(x.logits, y.logits, rtol=1e-5, atol=1e-5)
        if x.confidences is None:
            assert y.confidences is None
        else:
            torch.testing.assert_close(x.confidences, y.confidences, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- minimal readers (the way back)
def _learned_mask(tensors: dict, target, mask_id: int) -> torch.Tensor | None:
    """The exported embedding row of the mask token, when it is not the target's own (a learned mask vector)."""
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        return None
    row = embed[mask_id]
    return None if torch.equal(row, target.get_input_embeddings().weight[mask_id].detach().to(row.dtype)) else row


def _build(target, config_kwargs: dict, state: dict, mask_row, d2t=None) -> DSparkDrafter:
    if mask_row is not None:
        config_kwargs["mask_token_id"] = None
        state["mask_embedding"] = mask_row
    config = DSparkConfig.from_target_config(target.config, **config_kwargs)
    drafter = DSparkDrafter(config)
    if d2t is not None:
        state["d2t"] = d2t
    drafter.load_state_dict(state, strict=True)
    return drafter.bind_target(target).eval()


def ours(folder: Path) -> dict:
    side = folder / SIDE_FILE
    return json.loads(side.read_text()) if side.is_file() else {}


def read_deepspec(folder: Path, target) -> DSparkDrafter:
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    rank = int(cfg["markov_rank"])
    head = HEAD_TYPES[cfg["markov_head_type"]] if rank > 0 else "none"
    kwargs = dict(
        block_size=cfg["block_size"], num_hidden_layers=cfg["num_hidden_layers"],
        intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"], rope_parameters=cfg["rope_parameters"],
        target_layer_ids=cfg["target_layer_ids"], mask_token_id=cfg["mask_token_id"], sequential_head=head,
        markov_rank=rank if rank > 0 else 16, confidence_head=cfg["enable_confidence_head"],
        confidence_head_with_markov=cfg.get("confidence_head_with_markov", True),
        sts_temperatures=ours(folder).get("sts_temperatures") or None,
    )
    mask_row = _learned_mask(tensors, target, cfg["mask_token_id"])
    state = {k.replace("markov_head.joint_proj.", "markov_head.rnn_proj."): v for k, v in tensors.items()
             if k not in ("embed_tokens.weight", "lm_head.weight")}
    return _build(target, kwargs, state, mask_row)


def read_speculators(folder: Path, target) -> DSparkDrafter:
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    tl = cfg["transformer_layer_config"]
    rank = int(cfg["markov_rank"])
    head = HEAD_TYPES[cfg["markov_head_type"]] if rank > 0 else "none"
    anchor_predicts = bool(cfg["sample_from_anchor"])
    vocab, vd = int(tl["vocab_size"]), int(cfg["draft_vocab_size"])
    kwargs = dict(
        block_size=cfg["block_size"] - (0 if anchor_predicts else 1),
        block_layout="dspark" if anchor_predicts else "dflash",
        num_hidden_layers=tl["num_hidden_layers"], intermediate_size=tl["intermediate_size"],
        num_attention_heads=tl["num_attention_heads"], num_key_value_heads=tl["num_key_value_heads"],
        head_dim=tl["head_dim"], rms_norm_eps=tl["rms_norm_eps"], rope_parameters=tl["rope_parameters"],
        max_position_embeddings=tl["max_position_embeddings"],
        target_layer_ids=[i - 1 for i in cfg["aux_hidden_state_layer_ids"]], mask_token_id=cfg["mask_token_id"],
        sequential_head=head, markov_rank=rank if rank > 0 else 16, confidence_head=cfg["enable_confidence_head"],
        confidence_head_with_markov=cfg["confidence_head_with_markov"] or head == "none",
        draft_vocab_size=vd if vd < vocab else None,
        sts_temperatures=ours(folder).get("sts_temperatures") or None,
    )
    mask_row = _learned_mask(tensors, target, cfg["mask_token_id"])
    state = {k.replace("markov_head.joint_proj.", "markov_head.rnn_proj."): v for k, v in tensors.items()
             if k not in ("embed_tokens.weight", "lm_head.weight", "t2d", "d2t")}
    d2t = None
    if vd < vocab:
        d2t = torch.arange(vd) + tensors["d2t"]
        assert torch.equal(tensors["t2d"].nonzero().squeeze(1), d2t)
        w1 = state["markov_head.markov_w1.weight"]  # [V, r] by target id -> [Vd + 1, r] by draft id + unknown
        outside = int((~tensors["t2d"]).nonzero()[0])
        state["markov_head.markov_w1.weight"] = torch.cat([w1[d2t], w1[outside: outside + 1]])
        assert torch.equal(w1[~tensors["t2d"]], w1[outside].expand(vocab - vd, -1))  # all outside rows: "unknown"
    return _build(target, kwargs, state, mask_row, d2t)


def read_back(folder: Path, target) -> DSparkDrafter:
    cfg = json.loads((folder / "config.json").read_text())
    return (read_speculators if "speculators_model_type" in cfg else read_deepspec)(folder, target)


def convert_back_with_library(folder: Path, target, tmp_path: Path) -> DSparkDrafter | None:
    """`dspark_hf.convert.convert_checkpoint`, when the package has it (written by the converters' work)."""
    import dspark_hf.convert as convert

    fn = getattr(convert, "convert_checkpoint", None)
    if fn is None:
        return None
    out = tmp_path / "converted"
    result = fn(folder, out)  # (the optional target= check is the converters' own business)
    path = result if isinstance(result, (str, Path)) else out
    return DSparkDrafter.from_pretrained(path, target=target).eval()


# ------------------------------------------------------------------------------------ DeepSpec / SGLang layout
@pytest.mark.parametrize("fixture", sorted(HEADS))
def test_deepspec_export_matches_the_recorded_checkpoints(fixture, tmp_path):
    target = fixture_target()
    drafter = fixture_drafter(target, HEADS[fixture])
    out = export_drafter(drafter, tmp_path / "draft", to="deepspec", target=target)
    written = json.loads((out / "config.json").read_text())
    recorded = json.loads((FIXTURES / fixture / "config.json").read_text())
    assert set(written) == set(recorded)
    for key in set(recorded) - {"transformers_version", "num_anchors"}:  # num_anchors: a training setting
        assert written[key] == recorded[key], key
    keys = json.loads((FIXTURES / fixture / "keys.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: list(v.shape) for k, v in tensors.items()} == {k: v["shape"] for k, v in keys.items()}
    assert all(v.dtype == torch.float32 for v in tensors.values())
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight)
    assert_same_drafts(drafter, read_back(out, target), target)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sglang_export_is_the_deepspec_layout_without_the_target_copies(head, tmp_path):
    target = fixture_target()
    drafter = fixture_drafter(target, head)
    drafter.set_sts_temperatures([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2])
    assert "embed_tokens.weight" not in build_export(drafter, "sglang").tensors  # no target needed
    sglang = export_drafter(drafter, tmp_path / "sglang", to="sglang", target=target)  # (its bos / eos / pad ids)
    deepspec = build_export(drafter, "deepspec", target=target)
    tensors = load_file(str(sglang / "model.safetensors"))
    assert set(tensors) == set(deepspec.tensors) - {"embed_tokens.weight", "lm_head.weight"}
    config = json.loads((sglang / "config.json").read_text())
    assert config == deepspec.config
    # what SGLang's parse_dspark_draft_config / resolve_runtime_config require
    assert config["markov_rank"] > 0 and config["markov_head_type"] in ("vanilla", "gated", "rnn")
    assert 0 <= config["mask_token_id"] < target.config.vocab_size and "speculators_model_type" not in config
    assert ours(sglang)["sts_temperatures"] == drafter.config.sts_temperatures and ours(sglang)["format"] == "sglang"
    back = read_back(sglang, target)
    assert back.config.sts_temperatures == drafter.config.sts_temperatures
    assert_same_drafts(drafter, back, target)


def _recorded_fixtures() -> Path | None:
    """The recorded reference drafters with their weights (not in the repo's export fixtures): the repo's own copy if
    the converters' work added one, else the workplace's shared/ folder (beside the checkout, or /work/shared)."""
    here = Path(__file__).resolve().parent
    for root in (here / "fixtures" / "reference-drafters",
                 here.parents[1] / "shared" / "fixtures" / "reference-drafters",
                 Path("/work/shared/fixtures/reference-drafters")):
        if (root / "deepspec-rnn" / "draft" / "model.safetensors").is_file():
            return root
    return None


@pytest.mark.parametrize("fixture", sorted(HEADS))
def test_deepspec_checkpoints_read_in_and_exported_again_are_unchanged(fixture, tmp_path):
    """DeepSpec's own saved drafter, read by the minimal reader, drafts what DeepSpec's loop recorded; exported again
    it is byte for byte the checkpoint DeepSpec saved (so the export is the exact inverse of DeepSpec's layout)."""
    root = _recorded_fixtures()
    if root is None:
        pytest.skip("the recorded reference drafters (shared/fixtures/reference-drafters) are not on this machine")
    from transformers import AutoModelForCausalLM

    folder = root / fixture
    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32).eval()
    drafter = read_deepspec(folder / "draft", target)
    recorded = load_file(str(folder / "rounds.safetensors"))
    cache = drafter.new_cache()
    rounds = json.loads((folder / "rounds.json").read_text())["rounds"]
    for r in range(len(rounds)):
        drafter.append_context(cache, recorded[f"ctx_features_r{r}"], recorded[f"ctx_positions_r{r}"])
        block = drafter.draft(cache, recorded[f"anchor_id_r{r}"], anchor_positions=recorded[f"anchor_pos_r{r}"])
        assert torch.equal(block.tokens, recorded[f"tokens_r{r}"]), r
        torch.testing.assert_close(block.logits, recorded[f"markov_logits_r{r}"], rtol=1e-4, atol=1e-4)
    out = export_drafter(drafter, tmp_path / "again", to="deepspec", target=target)
    original, again = load_file(str(folder / "draft" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    written = json.loads((out / "config.json").read_text())
    saved = json.loads((folder / "draft" / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("transformers_version", "num_anchors")} == \
        {k: v for k, v in saved.items() if k not in ("transformers_version", "num_anchors")}


LIBRARY_CASES = {
    "deepspec-gated": ("deepspec", dict(sequential_head="gated_markov")),
    "sglang-rnn": ("sglang", dict(sequential_head="rnn")),
    "speculators-vanilla-reduced-vocab": ("speculators",
                                          dict(sequential_head="markov", draft_vocab=list(range(0, 512, 3)))),
    "speculators-dflash-layout": ("speculators", dict(sequential_head="gated_markov", block_layout="dflash")),
}


@pytest.mark.parametrize("case", sorted(LIBRARY_CASES))
def test_the_library_converter_reads_the_exports_back(case, tmp_path):
    """`dspark_hf.convert.convert_checkpoint` (the converters into our format) takes every export back unchanged."""
    import dspark_hf.convert as convert

    if not hasattr(convert, "convert_checkpoint"):
        pytest.skip("dspark_hf.convert.convert_checkpoint is not there yet (the minimal readers cover the way back)")
    fmt, kwargs = LIBRARY_CASES[case]
    target = fixture_target()
    vocab = kwargs.pop("draft_vocab", None)
    if vocab is not None:
        kwargs["draft_vocab_size"] = len(vocab)
    drafter = fixture_drafter(target, **kwargs)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    out = export_drafter(drafter, tmp_path / "draft", to=fmt, target=target)
    assert_same_drafts(drafter, convert_back_with_library(out, target, tmp_path), target)


# --------------------------------------------------------------------------------------------- speculators layout
def expected_speculators_keys(drafter) -> set[str]:
    """The state-dict keys speculators' DSparkDraftModel saves for this drafter (verifier_lm_head / verifier_norm are
    excluded on save; t2d / d2t only with a reduced vocabulary; rotary buffers are not persistent)."""
    cfg = drafter.config
    keys = {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        keys |= {p + s + ".weight" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                              "post_attention_layernorm")}
    if cfg.sequential_head != "none":
        keys |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    extra = {"gated_markov": "gate_proj", "rnn": "joint_proj"}.get(cfg.sequential_head)
    if extra:
        keys |= {f"markov_head.{extra}.weight", f"markov_head.{extra}.bias"}
    if cfg.confidence_head:
        keys |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    if cfg.draft_vocab_size is not None:
        keys |= {"t2d", "d2t"}
    return keys


SPECULATORS_CASES = {
    "vanilla-learned-mask": dict(head="markov", mask=None, export_mask=90),
    "rnn-reduced-vocab": dict(head="rnn", mask=7, vocab=list(range(0, 96, 2)) + [1, 3]),
    "gated-dflash-layout": dict(head="gated_markov", mask=7, block_layout="dflash"),
    "dflash-baseline": dict(head="none", mask=7, confidence_head=False),
}


@pytest.mark.parametrize("case", sorted(SPECULATORS_CASES))
def test_speculators_export_round_trip(case, tmp_path, arch="qwen3"):
    spec = dict(SPECULATORS_CASES[case])
    target = make_target(arch)
    kwargs = dict(sequential_head=spec.pop("head"), mask_token_id=spec.pop("mask"), block_size=4)
    export_mask = spec.pop("export_mask", None)
    vocab = spec.pop("vocab", None)
    kwargs.update(spec)
    drafter = randomize(make_drafter(target, draft_vocab=vocab, **kwargs))
    out = export_drafter(drafter, tmp_path / "spec", to="speculators", target=target, mask_token_id=export_mask,
                         verifier_name_or_path="org/tiny-target")
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == expected_speculators_keys(drafter)
    c = drafter.config
    v, vd, d = c.vocab_size, c.draft_vocab_size or c.vocab_size, c.hidden_size
    assert tensors["embed_tokens.weight"].shape == (v, d) and tensors["lm_head.weight"].shape == (vd, d)
    if c.sequential_head != "none":
        assert tensors["markov_head.markov_w1.weight"].shape == (v, c.markov_rank)  # indexed by verifier token
        assert tensors["markov_head.markov_w2.weight"].shape == (vd, c.markov_rank)
    if vocab is not None:
        assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == vd
        assert tensors["d2t"].dtype == torch.long and tensors["d2t"].shape == (vd,)
        assert torch.equal(torch.arange(vd) + tensors["d2t"], drafter.d2t)  # target id = draft id + d2t[draft id]
        assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight[drafter.d2t])
    # the config fields speculators' DSparkSpeculatorConfig holds and vLLM's update_dspark / SpeculatorsConfig read
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "dspark" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                       "speculative_tokens": c.block_size, "verifier_accept_k": 1}]
    assert sc["verifier"] == {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "org/tiny-target"}
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in c.target_layer_ids]
    assert cfg["sample_from_anchor"] == (c.block_layout == "dspark")
    assert cfg["block_size"] == c.block_size + (c.block_layout == "dflash")
    assert cfg["draft_vocab_size"] == vd and cfg["mask_token_id"] == (c.mask_token_id or export_mask)
    assert cfg["markov_rank"] == (0 if c.sequential_head == "none" else c.markov_rank)
    assert cfg["enable_confidence_head"] == c.confidence_head
    from transformers import Qwen3Config

    tl = Qwen3Config(**cfg["transformer_layer_config"])
    assert (tl.hidden_size, tl.num_hidden_layers, tl.vocab_size, tl.head_dim) == \
        (d, c.num_hidden_layers, v, c.head_dim)
    if export_mask is not None:  # the learned mask vector sits in the chosen row, the rest is the target's
        assert torch.equal(tensors["embed_tokens.weight"][export_mask], drafter.mask_embedding.detach())
        others = torch.arange(v) != export_mask
        assert torch.equal(tensors["embed_tokens.weight"][others], target.model.embed_tokens.weight[others])
    back = read_back(out, target)
    assert back.config.block_layout == c.block_layout and back.config.draft_vocab_size == c.draft_vocab_size
    assert_same_drafts(drafter, back, target)


def test_exported_dtype(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, mask_token_id=7, draft_vocab=list(range(40)))
    exported = build_export(drafter, "speculators", target=target, dtype=torch.bfloat16)
    assert exported.config["dtype"] == "bfloat16"
    for name, tensor in exported.tensors.items():
        expected = {"t2d": torch.bool, "d2t": torch.long}.get(name, torch.bfloat16)
        assert tensor.dtype == expected, name


# ---------------------------------------------------------------------------------------------------- refusals
def test_what_the_layouts_cannot_hold():
    target = make_target("qwen3")
    learned = make_drafter(target)  # mask_token_id=None: a learned mask embedding
    with pytest.raises(ValueError, match="learned mask embedding.*SGLang"):
        build_export(learned, "sglang")
    with pytest.raises(ValueError, match="mask_token_id=ID"):
        build_export(learned, "speculators", target=target)
    fixed = make_drafter(target, mask_token_id=7)
    with pytest.raises(ValueError, match="would change its drafts"):
        build_export(fixed, "deepspec", target=target, mask_token_id=8)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        build_export(make_drafter(target, mask_token_id=7, draft_vocab=list(range(40))), "deepspec", target=target)
    with pytest.raises(ValueError, match="block layout"):
        build_export(make_drafter(target, mask_token_id=7, block_layout="dflash"), "sglang")
    with pytest.raises(ValueError, match="sequential head"):
        build_export(make_drafter(target, mask_token_id=7, sequential_head="none"), "sglang")
    with pytest.raises(ValueError, match="pass target="):
        build_export(fixed, "deepspec")
    with pytest.raises(ValueError, match="unknown export format"):
        build_export(fixed, "tensorrt", target=target)
    with pytest.raises(ValueError, match="strictly increasing"):
        build_export(make_drafter(target, mask_token_id=7, target_layer_ids=[2, 0]), "speculators", target=target)
    with pytest.raises(ValueError, match="embedding output"):
        build_export(make_drafter(target, mask_token_id=7, target_layer_ids=[-1, 1]), "sglang")
    assert build_export(make_drafter(target, mask_token_id=7, target_layer_ids=[-1, 1]), "speculators",
                        target=target).config["aux_hidden_state_layer_ids"] == [0, 2]
    other = make_target("qwen3", vocab_size=128)
    with pytest.raises(ValueError, match="vocab_size=96"):
        build_export(fixed, "speculators", target=other)


# ------------------------------------------------------------------------------------------ writing and the CLI
def test_export_writes_atomically(tmp_path, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, mask_token_id=7)
    out = tmp_path / "out"
    export_drafter(drafter, out, to="sglang")
    first = (out / "config.json").read_text()
    with pytest.raises(FileExistsError):
        export_drafter(drafter, out, to="sglang")
    import safetensors.torch

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_drafter(drafter, out, to="deepspec", target=target, overwrite=True)
    assert (out / "config.json").read_text() == first  # the old export is untouched
    monkeypatch.undo()
    export_drafter(drafter, out, to="deepspec", target=target, overwrite=True)
    assert ours(out)["format"] == "deepspec"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folders left behind
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SIDE_FILE, "model.safetensors"]


def test_cli_export(tmp_path, capsys):
    from dspark_hf.cli import main

    target = make_target("qwen3")
    drafter = randomize(make_drafter(target, mask_token_id=7))
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "exported"
    assert main(["export", "--to", "speculators", str(tmp_path / "drafter"), str(out), "--target",
                 str(tmp_path / "target"), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "vllm serve" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    assert_same_drafts(drafter, read_back(out, target), target)
    with pytest.raises(SystemExit):
        main(["export", "--to", "trt", str(tmp_path / "drafter"), str(out)])


def test_serve_command():
    assert serve_command("sglang", "out", "Qwen/Qwen3-4B", 7) == (
        "python -m sglang.launch_server --model-path Qwen/Qwen3-4B --speculative-algorithm DSPARK "
        "--speculative-draft-model-path out --speculative-dspark-block-size 7")
    assert serve_command("deepspec", "out", "Qwen/Qwen3-4B", 7) == (
        'vllm serve Qwen/Qwen3-4B --speculative-config \'{"model": "out", "method": "dspark", '
        '"num_speculative_tokens": 7}\'')
    assert set(EXPORT_FORMATS) == {"speculators", "sglang", "deepspec"}


def test_a_tensor_no_layout_has_a_place_for_is_refused():
    target = make_target("llama")
    drafter = make_drafter(target, mask_token_id=7)
    drafter.register_buffer("extra_scale", torch.ones(3))
    with pytest.raises(ValueError, match="extra_scale"):
        build_export(drafter, "speculators", target=target)
