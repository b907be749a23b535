"""Quantized and sharded targets (issue 12, part 5): a bitsandbytes 8-bit / 4-bit target and a target loaded with
`device_map="auto"` or with decoder layers offloaded to disk decode exactly as the same target decodes alone, in both
loops (batch-1 assisted generation and the batched loop, also through `custom_generate`). A target whose embedding or
LM head is offloaded is refused with the way out.

bitsandbytes runs here on its CPU backend (0.50.2, torch 2.13 CPU); where it does not import or cannot quantize on
this machine the bitsandbytes tests skip and say why. accelerate's offload runs on any CPU."""

import pytest
import torch

import dspark_hf
from conftest import left_pad, make_drafter, make_target

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    target = make_target("llama")
    target.save_pretrained(folder)
    return folder, target, make_drafter(target)


def own_greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


def check_both_loops(target, drafter, n=10):
    """Both loops against `target`'s own greedy decoding of each prompt."""
    drafter.bind_target(target)
    ref = [own_greedy(target, p, n) for p in PROMPTS]
    for prompt, expected in zip(PROMPTS, ref):
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=n,
                              do_sample=False)
        assert out[0, len(prompt):].tolist() == expected
        assert drafter.last_speculation_stats.rounds > 0  # it drafted
    ids, mask = left_pad(PROMPTS)
    for out in (dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=n, policy="fixed"),
                target.generate(ids, attention_mask=mask, custom_generate=dspark_hf.speculative_generate,
                                drafter=drafter, policy="threshold", threshold=0.2, max_new_tokens=n)):
        assert [out[r, ids.shape[1]:].tolist() for r in range(len(PROMPTS))] == ref


# ---------------------------------------------------------------------------------------------- bitsandbytes
def _bnb_target(folder, bits):
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # not installed, or its native library does not load here
        pytest.skip(f"bitsandbytes does not import here ({type(err).__name__}: {err}); pip install 'dspark-hf[quant]'")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        target = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device)
        with torch.no_grad():
            target(torch.tensor([[1, 2, 3]], device=device))
    except Exception as err:  # e.g. a bitsandbytes build without a backend for this device
        pytest.skip(f"bitsandbytes cannot run a {bits}-bit model on {device} here ({type(err).__name__}: {err})")
    return target.eval()


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_target_decodes_like_itself(saved, bits):
    folder, plain, drafter = saved
    target = _bnb_target(folder, bits)
    linear = type(target.model.layers[0].mlp.down_proj).__name__
    assert linear == ("Linear8bitLt" if bits == 8 else "Linear4bit")  # really quantized
    fresh = make_drafter(plain).to(target.device)
    fresh.load_state_dict(drafter.state_dict())
    check_both_loops(target, fresh)


# ---------------------------------------------------------------------------------------------- device_map / offload
def test_device_map_auto_and_disk_offload_decode_like_the_plain_target(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, plain, drafter = saved
    ref = [own_greedy(plain, p, 10) for p in PROMPTS]
    auto = AutoModelForCausalLM.from_pretrained(folder, device_map="auto").eval()
    check_both_loops(auto, drafter)
    layers_on_disk = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(folder, device_map=layers_on_disk,
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert offloaded.model.layers[1].mlp.down_proj.weight.device == torch.device("meta")  # really on disk
    assert [own_greedy(offloaded, p, 10) for p in PROMPTS] == ref
    check_both_loops(offloaded, drafter)


def test_offloaded_embedding_or_head_is_refused_with_the_way_out(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _, drafter = saved
    everything_on_disk = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "disk",
                          "model.rotary_emb": "cpu", "lm_head": "disk"}
    target = AutoModelForCausalLM.from_pretrained(folder, device_map=everything_on_disk,
                                                  offload_folder=str(tmp_path / "offload")).eval()
    with pytest.raises(ValueError, match="LM head is offloaded.*'lm_head': 0"):
        drafter.bind_target(target)
    with pytest.raises(ValueError, match="LM head is offloaded"):
        target.generate(torch.tensor([PROMPTS[0]]), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="LM head is offloaded"):
        dspark_hf.generate(target, drafter, torch.tensor([PROMPTS[0]]), max_new_tokens=4, policy="fixed")
