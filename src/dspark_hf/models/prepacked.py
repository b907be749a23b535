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

`prepack_linears(model)` swaps every `nn.Linear` of a CPU model for a `PrepackedLinear` that keeps the original
parameter as `weight` (shared, so tied embeddings, `get_output_embeddings()` and a drafter bound to the target still
see the same tensor) next to a packed copy used for the product. Outputs equal `F.linear`'s up to float rounding (a
different summation order), like any other kernel choice; greedy decoding stays the model's own argmax sequence in
practice, and the benchmark checks its outputs token for token against the unpacked model. Inference only (the packed
copy is not trained) and a runtime option: nothing is saved, `unpack_linears(model)` restores the modules. Doubles
the memory of the linear weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrepackedLinear", "prepack_linears", "prepacked_available", "unpack_linears"]

_DTYPES = (torch.float32, torch.bfloat16)


def prepacked_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear kernels (CPU builds from pytorch.org do)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


class PrepackedLinear(nn.Module):
    """`nn.Linear` for CPU inference with its weight packed once for oneDNN.

    Attributes:
        weight, bias: the original module's parameters (shared, not copied).
        in_features, out_features: as `nn.Linear`.
        one_row_plain: a single input row takes `F.linear` (PyTorch's matrix-vector path) instead of the packed
            kernel (default True; False packs every call, the behaviour before this option existed).
    """

    def __init__(self, linear: nn.Linear, one_row_plain: bool = True) -> None:
        super().__init__()
        self.one_row_plain = bool(one_row_plain)
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
        if flat.shape[0] == 1 and self.one_row_plain:  # one row: PyTorch's matrix-vector path, nothing to repack
            return F.linear(x, self.weight, self.bias)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._pack(), bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, one_row_plain: bool = True) -> int:
    """Replaces every `nn.Linear` of `model` (a CPU model in float32 or bfloat16) by a `PrepackedLinear`, in place;
    returns how many were replaced. `one_row_plain`: single-row inputs (plain decoding at batch 1) keep PyTorch's
    matrix-vector path (see the module docstring). `ValueError` for a model on another device or in another dtype,
    or a PyTorch build without oneDNN."""
    if not prepacked_available():
        raise ValueError("this PyTorch build has no oneDNN packed linear (torch.ops.mkldnn._linear_pointwise)")
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for _, _, child in linears:  # check everything before changing anything
        if child.weight.device.type != "cpu" or child.weight.dtype not in _DTYPES:
            raise ValueError(f"prepack_linears needs a CPU model in float32 or bfloat16; found a linear with "
                             f"{child.weight.dtype} weights on {child.weight.device}")
    for parent, name, child in linears:
        setattr(parent, name, PrepackedLinear(child, one_row_plain=one_row_plain))
    return len(linears)


def unpack_linears(model: nn.Module) -> int:
    """Puts the original `nn.Linear` modules back; returns how many."""
    swapped = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, PrepackedLinear)]
    for parent, name, child in swapped:
        setattr(parent, name, child._source)
    return len(swapped)
