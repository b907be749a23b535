"""Prepacked CPU linears (`prepack_linears`): same outputs as `nn.Linear` up to float rounding, parameters shared
(tied embeddings and a bound drafter still see them), greedy and speculative decoding unchanged, training and
unsupported dtypes fall back or are refused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import greedy_continuation, make_drafter, make_target
from dspark_hf.models.prepacked import (PrepackedLinear, calibrate_plain_rows, prepack_linears, prepacked_available,
                                        unpack_linears)

pytestmark = pytest.mark.skipif(not prepacked_available(), reason="this PyTorch build has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_matches_linear_up_to_rounding(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(2, rows, 64)
    with torch.no_grad():
        expected, got = linear(x), packed(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert packed.weight is linear.weight and packed.bias is linear.bias


def test_a_single_row_takes_the_plain_matrix_vector_path(monkeypatch):
    """One row (a plain decoding step at batch 1) runs `F.linear` (bitwise its output) and never packs the weight;
    two rows run the packed kernel."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PrepackedLinear(linear)
    calls = []
    original = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        for shape in [(1, 64), (1, 1, 64)]:
            x = torch.randn(shape)
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        assert not calls and packed._packed is None
        packed(torch.randn(1, 2, 64))
        assert calls and packed._packed is not None
        calls.clear()
        always = PrepackedLinear(linear, one_row_plain=False)  # the option: every call packed
        x = torch.randn(1, 64)
        torch.testing.assert_close(always(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    assert calls


def test_plain_rows_sends_inputs_of_up_to_that_many_rows_through_f_linear(monkeypatch):
    """`plain_rows=3`: 1-3 rows (however batched) are bitwise `F.linear`, 4 rows take the packed kernel; 0 packs one
    row too; bad values are refused."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PrepackedLinear(linear, plain_rows=3)
    calls = []
    original = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        for shape in [(1, 64), (3, 64), (1, 3, 64), (3, 1, 64)]:
            x = torch.randn(shape)
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        assert not calls and packed.one_row_plain
        x = torch.randn(1, 4, 64)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
        assert len(calls) == 1
        none = PrepackedLinear(linear, plain_rows=0)
        none(torch.randn(1, 64))
        assert len(calls) == 2 and not none.one_row_plain
    for bad in (-1, 1.5, True, "many"):
        with pytest.raises(ValueError, match="plain_rows"):
            PrepackedLinear(linear, plain_rows=bad)


def test_calibrate_plain_rows_finds_where_the_packed_kernel_starts_winning():
    """The crossover from (synthetic) whole-model timings: plain faster up to 3 rows -> 3; packed faster from one row
    -> 0; plain faster everywhere -> max_rows; a faster plain size after a slower one does not count. The modules'
    setting is left as it was. On a real model it returns a row count and `prepack_linears(plain_rows="auto")` sets
    it on every linear."""
    target = make_target("llama", vocab_size=96, seed=0)
    prepack_linears(target, plain_rows=2)

    def synthetic(crossover, exceptions=()):
        return lambda rows, plain: (1.0 if rows <= crossover or rows in exceptions else 2.0) if plain else 1.5

    assert calibrate_plain_rows(target, measure=synthetic(3)) == 3
    assert calibrate_plain_rows(target, measure=synthetic(0)) == 0
    assert calibrate_plain_rows(target, max_rows=5, measure=synthetic(99)) == 5
    assert calibrate_plain_rows(target, measure=synthetic(2, exceptions=(5,))) == 2
    assert {m.plain_rows for m in target.modules() if isinstance(m, PrepackedLinear)} == {2}
    measured = calibrate_plain_rows(target, max_rows=3, repeats=1)
    assert 0 <= measured <= 3
    other = make_target("llama", vocab_size=96, seed=0)
    ids = torch.tensor([[5, 17, 33, 2, 8]])
    ref = greedy_continuation(other, ids, 10)
    prepack_linears(other, plain_rows="auto")
    assert len({m.plain_rows for m in other.modules() if isinstance(m, PrepackedLinear)}) == 1
    assert torch.equal(greedy_continuation(other, ids, 10), ref)
    with pytest.raises(ValueError, match="prepacked"):
        calibrate_plain_rows(make_target("llama", vocab_size=96, seed=0))


def test_weight_updates_are_seen():
    linear = nn.Linear(16, 8)
    packed = PrepackedLinear(linear)
    x = torch.randn(3, 16)
    with torch.no_grad():
        packed(x)
        linear.weight.mul_(2.0)  # in place: the packed copy must be rebuilt
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


def test_training_takes_the_plain_path_and_gets_gradients():
    linear = nn.Linear(16, 8)
    packed = PrepackedLinear(linear)
    packed(torch.randn(4, 16)).sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def test_model_keeps_its_parameters_and_greedy_output():
    target = make_target("llama", vocab_size=96, seed=0)
    ids = torch.tensor([[5, 17, 33, 2, 8]])
    ref = greedy_continuation(target, ids, 20)
    keys = set(target.state_dict())
    params = {id(p) for p in target.parameters()}
    n = prepack_linears(target)
    assert n == sum(1 for m in target.modules() if isinstance(m, PrepackedLinear)) > 0
    assert set(target.state_dict()) == keys and {id(p) for p in target.parameters()} == params
    assert target.get_output_embeddings().weight is not None
    assert torch.equal(greedy_continuation(target, ids, 20), ref)
    drafter = make_drafter(target, block_size=4)  # binds the packed target's head and embeddings
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    assert torch.equal(out[:, ids.shape[1]:], ref)
    assert unpack_linears(target) == n
    assert not any(isinstance(m, PrepackedLinear) for m in target.modules())
    assert torch.equal(greedy_continuation(target, ids, 20), ref)


def test_unsupported_dtype_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).half())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        prepack_linears(model)
    assert all(type(m) is nn.Linear for m in model)  # nothing swapped
