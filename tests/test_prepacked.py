"""Prepacked CPU linears (`prepack_linears`): same outputs as `nn.Linear` up to float rounding, parameters shared
(tied embeddings and a bound drafter still see them), greedy and speculative decoding unchanged, training and
unsupported dtypes fall back or are refused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dspark_hf
from conftest import generated_rows, greedy_continuation, greedy_reference, left_pad, make_drafter, make_target
from dspark_hf.models.prepacked import (PrepackedLinear, calibrate_plain_rows, is_prepacked, prepack_linears,
                                        prepacked_available, ragged_tokens, unpack_linears)

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


# ---------------------------------------------------------------------------------------------- ragged verification
def test_ragged_tokens_multiplies_only_the_real_tokens(monkeypatch):
    """Inside `ragged_tokens(valid)` an input of exactly `valid.numel()` tokens is multiplied at its real tokens only
    (the kernel sees that many rows), zeros elsewhere; other inputs, and every input outside the block, are whole."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PrepackedLinear(linear)
    seen = []
    original = packed._product
    monkeypatch.setattr(packed, "_product", lambda flat: seen.append(flat.shape[0]) or original(flat))
    x = torch.randn(3, 4, 64)
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        full = linear(x)
        with ragged_tokens(valid):
            got = packed(x)
            other = packed(torch.randn(2, 4, 64))  # another size: the whole product
        after = packed(x)
    assert seen == [7, 8, 12]
    torch.testing.assert_close(got[valid], full[valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~valid], torch.zeros(int((~valid).sum()), 48))
    assert other.shape == (2, 4, 48)
    torch.testing.assert_close(after, full, atol=1e-5, rtol=1e-5)


def _count_head_rows(target, monkeypatch) -> list[int]:
    """The rows the target's LM head multiplies in each forward (a spy on its `PrepackedLinear`)."""
    head = target.get_output_embeddings()
    assert isinstance(head, PrepackedLinear)
    seen: list[int] = []
    original = head._product
    monkeypatch.setattr(head, "_product", lambda flat: seen.append(flat.shape[0]) or original(flat))
    return seen


RAGGED_PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [9, 8, 7, 6, 5, 4]]


@pytest.mark.parametrize("policy,tree_budget", [("threshold", None), ("scheduled", None), ("scheduled", 4)])
def test_batched_greedy_with_ragged_verification_equals_each_rows_own_greedy(policy, tree_budget, monkeypatch):
    """On a prepacked target the batched loop multiplies only each row's anchor and drafts (or tree nodes): fewer
    LM-head rows than the padded rectangle in rounds whose rows verify different lengths; the output is every row's
    own greedy continuation, as with the padding multiplied (`ragged_verification=False`)."""
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    prepack_linears(target)
    assert is_prepacked(target)
    ids, mask = left_pad(RAGGED_PROMPTS)
    sps = lambda b: 1.0 / (1.0 + 0.02 * b)  # noqa: E731  (flat enough that some rows verify drafts)
    kw = dict(max_new_tokens=20, policy=policy, sps=sps, threshold=0.02, return_dict_in_generate=True,
              measured_cost=False, record_rounds=True, drop_finished="always", tree_budget=tree_budget)
    seen = _count_head_rows(target, monkeypatch)
    ragged = dspark_hf.generate(target, drafter, ids, mask, **kw)
    ragged_rows = list(seen)
    seen.clear()
    padded = dspark_hf.generate(target, drafter, ids, mask, ragged_verification=False, **kw)
    for row, prompt in enumerate(RAGGED_PROMPTS):
        expected = greedy_reference(target, prompt, 20)
        assert generated_rows(ragged, ids.shape[1])[row] == expected, (policy, row)
        assert generated_rows(padded, ids.shape[1])[row] == expected, (policy, row)
    verified = [r.lengths if tree_budget is None else r.tree_verified for r in ragged.rounds]
    assert any(len(set(v.tolist())) > 1 for v in verified)  # rounds whose rows verified different lengths
    # every round's forward (the last ones of the call, one per round) multiplied exactly its anchors and drafts
    assert ragged_rows[-len(verified):] == [int((1 + v).sum()) for v in verified]
    assert sum(ragged_rows) < sum(seen) or ragged.rounds != padded.rounds


def test_ragged_verification_needs_a_prepacked_target():
    target = make_target("llama", vocab_size=96, seed=0)
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad(RAGGED_PROMPTS)
    with pytest.raises(ValueError, match="ragged_verification=True needs a target whose linears are prepacked"):
        dspark_hf.generate(target, drafter, ids, mask, max_new_tokens=4, ragged_verification=True)
