import pytest
from transformers import LlamaConfig

from dspark_hf import DSparkConfig


def target_config(layers: int = 36, hidden: int = 64, vocab: int = 100) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2)


def test_default_layers_match_reference_spread_and_never_last():
    assert DSparkConfig.default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    for layers in range(2, 48):
        ids = DSparkConfig.default_target_layer_ids(layers)
        assert ids == sorted(set(ids)) and ids
        assert max(ids) <= layers - 2, (layers, ids)


def test_from_target_config_copies_fingerprint_and_sizes():
    cfg = DSparkConfig.from_target_config(target_config(), block_size=9, markov_rank=32)
    assert cfg.block_size == 9 and cfg.markov_rank == 32
    assert (cfg.vocab_size, cfg.hidden_size) == (100, 64)
    assert (cfg.target_vocab_size, cfg.target_hidden_size, cfg.target_num_hidden_layers) == (100, 64, 36)
    assert cfg.target_model_type == "llama"
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.sts_temperatures == [] and cfg.effective_loss_decay == 9.0


def test_round_trip_through_dict():
    cfg = DSparkConfig.from_target_config(target_config(), sequential_head="rnn", sts_temperatures=[1.5] * 7)
    again = DSparkConfig.from_dict(cfg.to_dict())
    assert again.sequential_head == "rnn" and again.sts_temperatures == [1.5] * 7
    assert again.target_layer_ids == cfg.target_layer_ids


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-3), "block_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(sequential_head="lstm"), "sequential_head"),
        (dict(markov_rank=0), "markov_rank"),
        (dict(target_layer_ids=[1, 35]), "target_layer_ids"),  # 35 is the last layer of 36
        (dict(target_layer_ids=[1, 40]), "target_layer_ids"),
        (dict(target_layer_ids=[-2]), "target_layer_ids"),  # -1 (the embedding output) is valid, see test_convert
        (dict(target_layer_ids=[3, 3]), "target_layer_ids"),
        (dict(hidden_size=32), "hidden_size"),
        (dict(vocab_size=10), "vocab_size"),
        (dict(sts_temperatures=[1.0, 1.0]), "sts_temperatures"),
        (dict(sts_temperatures=[0.0] * 7), "sts_temperatures"),
        (dict(loss_decay=0.0), "loss_decay"),
        (dict(mask_token_id=100), "mask_token_id"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        DSparkConfig.from_target_config(target_config(), **overrides)


def test_none_head_allows_zero_rank():
    cfg = DSparkConfig.from_target_config(target_config(), sequential_head="none", markov_rank=0, confidence_head=False)
    assert cfg.sequential_head == "none"
