"""Prepacked CPU linears: verification forwards of a few tokens at nearly the cost of one.

On the CPUs this package is measured on, a target forward of 2-8 new tokens costs 1.5-2.7x a forward of one
(SmolLM2-135M, fp32): for one token PyTorch's linear is a matrix-vector product that streams each weight once, for
2+ tokens it becomes a GEMM that repacks every weight matrix on every call. Speculative decoding always verifies 2+
tokens, so it starts every round with that penalty. oneDNN's linear with weights packed once
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the kernels `torch.compile` freezing uses on a CPU)
skips the repacking: measured on the whole SmolLM2 forward, 2-8 tokens then cost 1.1-1.5x one token
(`scripts/bench_lookup.py` prints the curve of the machine it runs on). A single row (one token at batch 1) keeps
PyTorch's matrix-vector path: on some CPUs the packed kernel is slower there (one AVX-512 Xeon: 73-76 ms per
one-token SmolLM2 forward packed vs 62 ms plain, while 8 tokens took 95 ms packed vs 130 ms plain), on others it is
the same, so plain decoding steps never lose to the packing.

Where the two kernels cross is the CPU's: on one AVX-512 Xeon PyTorch's own path was also faster for 2 and 3 rows
(batch-1 SmolLM2 forwards: 85 / 94 ms vs 103 / 103 ms packed) and slower from 4 rows on (107 vs 103 ms;
`scripts/bench_lookup.py --methods lookup lookup/auto-rows` prints both curves), while on an AMD EPYC the packed
kernel already won at 2 rows. `plain_rows=N` sends inputs of up to N
rows through `F.linear`; `plain_rows="auto"` measures the crossover on the whole model once
(`calibrate_plain_rows`: forwards of 1..8 tokens both ways, interleaved, a few seconds for a 135M model).

`prepack_linears(model)` swaps every `nn.Linear` of a CPU model for a `PrepackedLinear` that keeps the original
parameter as `weight` (shared, so tied embeddings, `get_output_embeddings()` and a drafter bound to the target still
see the same tensor) next to a packed copy used for the product. Outputs equal `F.linear`'s up to float rounding (a
different summation order), like any other kernel choice; greedy decoding stays the model's own argmax sequence in
practice, and the benchmark checks its outputs token for token against the unpacked model. Inference only (the packed
copy is not trained) and a runtime option: nothing is saved, `unpack_linears(model)` restores the modules. Doubles
the memory of the linear weights.

`ragged_tokens(valid)` makes the packed linears of one forward multiply only the real tokens of a right-padded
`[R, W]` batch (the batched loop's verification forwards, `ragged_verification`): on a CPU the linears and the LM head
cost about in proportion to the tokens they multiply, so the padding then costs its attention alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrepackedLinear", "calibrate_plain_rows", "is_prepacked", "prepack_linears", "prepacked_available",
           "ragged_tokens", "unpack_linears"]

_DTYPES = (torch.float32, torch.bfloat16)

# (tokens of the padded rectangle, flat indices of its real tokens) while `ragged_tokens` is active
_RAGGED: contextvars.ContextVar[tuple[int, torch.Tensor] | None] = contextvars.ContextVar("_RAGGED", default=None)


@contextlib.contextmanager
def ragged_tokens(valid: torch.Tensor) -> Iterator[None]:
    """Within this block every `PrepackedLinear` whose input holds exactly `valid.numel()` tokens (a `[R, W, in]`
    forward of the padded rectangle `valid` `[R, W]` describes) multiplies only the tokens where `valid` is True and
    writes zeros at the others.

    A batched verification forward feeds each row its anchor and drafts, right-padded to the widest row: on a CPU the
    linears (and the LM head) cost about in proportion to the tokens they multiply, so the padding costs as much as
    real drafts. Skipping it, a round costs about the drafts it verifies (Algorithm 1's sum of per-row lengths)
    rather than its rectangle. The caller must read nothing at the padded positions: their hidden states and logits are
    meaningless (their keys and values are zeros, which the verification mask already hides as holes). The real
    tokens' outputs equal those of the full product up to float rounding (a different row count for the kernel)."""
    flat = valid.reshape(-1)
    index = flat.nonzero().reshape(-1).to(torch.long)
    token = _RAGGED.set((int(flat.numel()), index.cpu()))
    try:
        yield
    finally:
        _RAGGED.reset(token)


def is_prepacked(model: nn.Module) -> bool:
    """Whether `prepack_linears` swapped `model`'s linears (so `ragged_tokens` can skip the padding of its forwards)."""
    return any(isinstance(m, PrepackedLinear) for m in model.modules())


def prepacked_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear kernels (CPU builds from pytorch.org do)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


class PrepackedLinear(nn.Module):
    """`nn.Linear` for CPU inference with its weight packed once for oneDNN.

    Attributes:
        weight, bias: the original module's parameters (shared, not copied).
        in_features, out_features: as `nn.Linear`.
        plain_rows: inputs of at most this many rows take `F.linear` (PyTorch's own path; one row: its
            matrix-vector product) instead of the packed kernel. 1 by default (`one_row_plain=True`); 0 packs every
            call (`one_row_plain=False`, the behaviour before the option existed).
    """

    def __init__(self, linear: nn.Linear, one_row_plain: bool = True, plain_rows: int | None = None) -> None:
        super().__init__()
        self.plain_rows = _plain_rows(one_row_plain, plain_rows)
        weight = linear.weight
        if weight.device.type != "cpu":
            raise ValueError(f"prepacked linears run on the CPU only; this weight is on {weight.device}")
        if weight.dtype not in _DTYPES:
            raise ValueError(f"prepacked linears support {[str(d) for d in _DTYPES]}, got {weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = weight
        self.bias = linear.bias
        self.__dict__["_source"] = linear  # (not a submodule: its parameters are already ours)
        self._packed_from: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def _pack(self) -> torch.Tensor:
        # re-pack when the weight's storage or version changed (e.g. weights reloaded in place)
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed_from != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_from = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype or torch.is_grad_enabled() and (
                x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # training, other devices or dtypes: the plain path
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ragged = _RAGGED.get()
        if ragged is not None and flat.shape[0] == ragged[0] and ragged[1].numel() < ragged[0]:
            index = ragged[1]  # only the real tokens of a padded verification forward (`ragged_tokens`)
            out = flat.new_zeros(flat.shape[0], self.out_features)
            out.index_copy_(0, index, self._product(flat.index_select(0, index)))
            return out.reshape(*shape[:-1], self.out_features)
        return self._product(flat).reshape(*shape[:-1], self.out_features)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` `[N, in]` times the weight: PyTorch's own path for a few rows (one row: matrix-vector), else the
        packed kernel."""
        if flat.shape[0] <= self.plain_rows:
            return F.linear(flat, self.weight, self.bias)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(flat, self._pack(), bias, "none", [], "")

    @property
    def one_row_plain(self) -> bool:
        """Whether a single row takes PyTorch's matrix-vector path (`plain_rows >= 1`)."""
        return self.plain_rows >= 1

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"plain_rows={self.plain_rows}")


def _plain_rows(one_row_plain: bool, plain_rows: int | None) -> int:
    if plain_rows is None:
        return 1 if one_row_plain else 0
    if isinstance(plain_rows, bool) or not isinstance(plain_rows, int) or plain_rows < 0:
        raise ValueError(f"plain_rows must be a non-negative integer or 'auto', got {plain_rows!r}")
    return plain_rows


def _time_forward(model: nn.Module, rows: int, generator: torch.Generator) -> float:
    """Seconds of one forward of `rows` random tokens (batch 1, no cache) through `model`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = torch.randint(0, int(config.vocab_size), (1, rows), generator=generator)
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        return time.perf_counter() - start


def calibrate_plain_rows(model: nn.Module, max_rows: int = 8, repeats: int = 3,
                         measure: Callable[[int, bool], float] | None = None) -> int:
    """The largest N <= `max_rows` such that the whole model's forwards of 1..N tokens are at least as fast with
    PyTorch's own linear path as with the packed kernel, measured on this CPU (0: the packed kernel wins already at
    one row). Every size runs `repeats` times each way, interleaved, after a warm-up; the medians are compared.

    `model` must already be prepacked (`prepack_linears`); its modules' `plain_rows` are restored afterwards.
    `measure(rows, plain)` replaces the timing (seconds of one forward of `rows` tokens with every linear plain or
    packed), e.g. for tests."""
    modules = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    if not modules:
        raise ValueError("calibrate_plain_rows needs a prepacked model (prepack_linears) with at least one linear")
    saved = [m.plain_rows for m in modules]
    generator = torch.Generator().manual_seed(0)

    def timed(rows: int, plain: bool) -> float:
        if measure is not None:
            return float(measure(rows, plain))
        for m in modules:
            m.plain_rows = rows if plain else 0
        return _time_forward(model, rows, generator)

    try:
        times: dict[tuple[int, bool], list[float]] = {}
        for rows in range(1, max_rows + 1):
            timed(rows, False), timed(rows, True)  # warm-up (first calls of a shape)
        for _ in range(repeats):
            for rows in range(1, max_rows + 1):
                for plain in (False, True):
                    times.setdefault((rows, plain), []).append(timed(rows, plain))
    finally:
        for m, value in zip(modules, saved):
            m.plain_rows = value
    best = 0
    for rows in range(1, max_rows + 1):
        if statistics.median(times[(rows, True)]) > statistics.median(times[(rows, False)]):
            break
        best = rows
    return best


def prepack_linears(model: nn.Module, one_row_plain: bool = True, plain_rows: int | str | None = None) -> int:
    """Replaces every `nn.Linear` of `model` (a CPU model in float32 or bfloat16) by a `PrepackedLinear`, in place;
    returns how many were replaced. `one_row_plain`: single-row inputs (plain decoding at batch 1) keep PyTorch's
    matrix-vector path (see the module docstring). `plain_rows`: inputs of up to this many rows keep PyTorch's path
    (overrides `one_row_plain`); "auto" measures the crossover on this model and CPU (`calibrate_plain_rows`, a few
    seconds). `ValueError` for a model on another device or in another dtype, or a PyTorch build without oneDNN."""
    auto = plain_rows == "auto"
    rows = _plain_rows(one_row_plain, None if auto else plain_rows)
    if not prepacked_available():
        raise ValueError("this PyTorch build has no oneDNN packed linear (torch.ops.mkldnn._linear_pointwise)")
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for _, _, child in linears:  # check everything before changing anything
        if child.weight.device.type != "cpu" or child.weight.dtype not in _DTYPES:
            raise ValueError(f"prepack_linears needs a CPU model in float32 or bfloat16; found a linear with "
                             f"{child.weight.dtype} weights on {child.weight.device}")
    for parent, name, child in linears:
        setattr(parent, name, PrepackedLinear(child, plain_rows=rows))
    if auto:
        rows = calibrate_plain_rows(model)
        for module in model.modules():
            if isinstance(module, PrepackedLinear):
                module.plain_rows = rows
    return len(linears)


def unpack_linears(model: nn.Module) -> int:
    """Puts the original `nn.Linear` modules back; returns how many."""
    swapped = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, PrepackedLinear)]
    for parent, name, child in swapped:
        setattr(parent, name, child._source)
    return len(swapped)
