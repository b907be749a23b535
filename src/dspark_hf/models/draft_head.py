"""The drafter's base-logit kernels: the K-row product with the target's LM-head rows, in a chosen weight dtype.

On a CPU that product (`[B*K, d] x [d, V]`, V = 49,152 for SmolLM2) is the largest part of a drafting round (about
22 of the 29 points the round costs beyond the target's verification forward at batch 1, fp32); fewer bytes per
weight, and fbgemm's packed kernels for them, make it cheaper. `DraftHead` holds the rows the drafts use (all V, or a
reduced draft vocabulary's `d2t` rows) prepared once for one `dtype`:

* `None` (default): the target's head as it is (`F.linear`), bit for bit the logits the target's head gives.
* `float32`, `bfloat16`: a copy in that dtype (`F.linear`). bf16 pays where the hardware has bf16 GEMMs (GPUs, AMX
  CPUs); on an AVX2-only CPU it is slower than fp32.
* `float16`: on a CPU fbgemm's fp16-weight GEMM (weights rounded to fp16 once; fp32 activations and accumulation:
  on SmolLM2-135M drafter states logits within 4e-3 of fp32, the same argmax everywhere, 99.99% of the top-64
  candidates the same); elsewhere a half-precision copy (`F.linear`).
* `int8`: CPU only (fbgemm). Weights symmetric int8 per row (one fp32 scale each), activations quantized
  dynamically to uint8 on one grid per call (the min / max of all rows drafted together, so a row's logits depend
  slightly on the rows drafted beside it), int32 accumulation; on AVX2 the 16-bit pair sums can saturate, which puts
  a rare logit off by more. Measured on SmolLM2-135M drafter states (two samples of 231 and 340 slots): the argmax
  agrees with fp32 on 98.5-99.6% of slots, 98% of the top-64 candidates are the same, mean |error| 0.05. fbgemm's
  `reduce_range` (7-bit activations, no saturation) or 7-bit weights agree less (97%); per-row activation grids
  (scaling each row, appending range rows) cost about 20% more on this CPU for no gain in agreement.

Lossless whatever the kernel: the drafts are drawn from (or are the argmax of) the distribution these logits give
after the sequential head and the logits processing, and `DraftBlock.logits` carries exactly that distribution to
the verifier. A cheaper head can only change which drafts are proposed, so acceptance.

Imports nothing from `dspark_hf` (trust_remote_code copies it next to `modeling_dspark.py`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

__all__ = ["DRAFT_HEAD_DTYPES", "DraftHead", "parse_draft_head_dtype"]

DRAFT_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def parse_draft_head_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`None`, a dtype of `DRAFT_HEAD_DTYPES`, or its name (`"int8"`, `"float16"`, `"torch.bfloat16"`, ...)."""
    if dtype is None or (isinstance(dtype, str) and dtype in ("none", "None", "default")):
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        parsed = getattr(torch, name, None)
        if not isinstance(parsed, torch.dtype):
            raise ValueError(f"unknown draft head dtype {dtype!r}; choose one of "
                             f"{[str(d).removeprefix('torch.') for d in DRAFT_HEAD_DTYPES]} or None")
        dtype = parsed
    if dtype not in DRAFT_HEAD_DTYPES:
        raise ValueError(f"draft head dtype {dtype} is not supported; choose one of "
                         f"{[str(d).removeprefix('torch.') for d in DRAFT_HEAD_DTYPES]} or None")
    return dtype


def _quantized_ops_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and "fbgemm" in torch.backends.quantized.supported_engines


class DraftHead:
    """Base logits `[..., N]` (float32) from head rows `weight` `[N, d]` (and `bias` `[N]`) for one weight dtype.

    `weight` / `bias` are the rows as the target holds them; they are read (and, for a copy or a packed kernel,
    converted) once here. Raises `ValueError` for `int8` off the CPU or without fbgemm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.num_rows = int(weight.shape[0])
        self.device = weight.device
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        cpu = weight.device.type == "cpu"
        self._packed = None
        if dtype == torch.int8:
            if not cpu or not _quantized_ops_available():
                raise ValueError(f"the int8 draft head needs torch's fbgemm quantized kernels on the CPU (the head is "
                                 f"on {weight.device}; supported engines: {torch.backends.quantized.supported_engines});"
                                 f" use dtype float16 / bfloat16 there")
            w = weight.float()
            scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
            with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm's packed GEMM still needs one
                warnings.simplefilter("ignore")
                qweight = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0,
                                                     torch.qint8)
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            self._weight, self._bias = None, None if bias is None else bias.float()
        elif dtype == torch.float16 and cpu and _quantized_ops_available():
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
            self._weight, self._bias = None, None if bias is None else bias.float()
        else:
            self._weight = weight if dtype is None else weight.to(dtype)
            self._bias = None if bias is None else (bias if dtype is None else bias.to(dtype))

    @property
    def kernel(self) -> str:
        """What computes the logits: `linear` (F.linear), `fbgemm-fp16` or `fbgemm-int8`."""
        if self._packed is None:
            return "linear"
        return "fbgemm-int8" if self.dtype == torch.int8 else "fbgemm-fp16"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[..., d]` -> float32 logits `[..., N]`."""
        if self._packed is None:
            return F.linear(hidden.to(self._weight.dtype), self._weight, self._bias).float()
        flat = hidden.reshape(-1, hidden.shape[-1]).float()  # [R, d]
        if self.dtype == torch.int8:
            out = torch.ops.quantized.linear_dynamic(flat, self._packed)
        else:
            out = torch.ops.quantized.linear_dynamic_fp16(flat, self._packed)
        if self._bias is not None:
            out = out + self._bias
        return out.reshape(*hidden.shape[:-1], self.num_rows)
