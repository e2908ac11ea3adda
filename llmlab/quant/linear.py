"""Quantized drop-in replacements for ``nn.Linear`` and the (tied) token embedding.

Each layer stores its weight in a quantized format (:mod:`llmlab.quant.formats`) and has
two forward paths with the same answer up to rounding:

* the **reference**: dequantize the whole weight to float32, then ``F.linear``. Clear, and
  as slow as float32 (it even reads more bytes);
* the **packed kernel** (CPU): PyTorch's weight-only kernels, which read the small weight
  and widen it inside the matmul: ``torch._weight_int8pack_mm`` for int8 and
  ``aten._weight_int4pack_mm_for_cpu`` for 4-bit groups. On this PyTorch build they are
  fast only with bfloat16 activations (the float32 and float16 paths are slower than a
  dense float32 matmul), so the layer rounds its input to bfloat16, runs the kernel and
  widens the output back to float32. That extra rounding is part of what the quality
  evaluation measures.

``use_kernels(False)`` switches every layer to the reference path (a context manager).
Taught in notebook 08.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from . import formats

_KERNELS = {"enabled": True}
INT4_KERNEL_GROUPS = (32, 64, 128, 256)     # group sizes the CPU int4 kernel accepts


@contextlib.contextmanager
def use_kernels(enabled: bool = True):
    """Within the block, quantized layers use the packed kernels (True) or the reference."""
    old = _KERNELS["enabled"]
    _KERNELS["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _KERNELS["enabled"] = old


def _kernel_ok(x: torch.Tensor) -> bool:
    return _KERNELS["enabled"] and x.device.type == "cpu"


def _as_2d(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class QuantizedLinear(nn.Module):
    """Base class: ``y = x Wᵀ`` with W stored quantized; x [..., in] -> y [..., out] (float32)."""

    scheme = "?"

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer stands for."""
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes of the stored format (codes plus scales), what a decode step reads."""
        raise NotImplementedError

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.dequantized_weight())

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed kernel's answer, or None where it does not apply."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _kernel_ok(x):
            y = self.kernel_forward(x)
            if y is not None:
                return y
        return self.reference_forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weight, one float32 scale per output channel."""

    scheme = "int8"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        q, scale = formats.int8_quantize(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    def dequantized_weight(self) -> torch.Tensor:
        return formats.int8_dequantize(self.qweight, self.scale)

    def weight_nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` of the weight (the embedding lookup of a tied table)."""
        return self.qweight[ids].float() * self.scale[ids][..., None]

    def kernel_forward(self, x):
        x2, lead = _as_2d(x)
        y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.scale_bf16)
        return y.float().reshape(*lead, self.out_features)


class GroupLinear(QuantizedLinear):
    """Group-wise asymmetric 4-bit weight: w = q·d + m per group of ``group_size`` inputs.

    ``q4_1=True`` makes the groups GGUF Q4_1 blocks (32 inputs, codes by llama.cpp's
    rounding); otherwise any group size, codes rounded to nearest. d and m are float16.
    The codes are kept packed two per byte; the CPU kernel's own packing is built once.
    """

    def __init__(self, weight: torch.Tensor, group_size: int = 32, q4_1: bool = False):
        super().__init__(weight.shape[1], weight.shape[0])
        self.group_size = formats.Q4_1_BLOCK if q4_1 else group_size
        self.scheme = "q4_1" if q4_1 else "int4"
        if q4_1:
            b = formats.q4_1_quantize(weight)
            codes, d, m = b.codes(), b.d, b.m
        else:
            codes, d, m = formats.group_quantize(weight, bits=4, group_size=group_size)
            # stored in float16 like Q4_1's (4 bytes per group); codes were rounded with the
            # float32 step, as llama.cpp does
            d, m = d.to(torch.float16), m.to(torch.float16)
        self.register_buffer("packed_codes", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self._kernel_weight = None   # (packed int4 weight, scales_and_zeros), built on first use

    def codes(self) -> torch.Tensor:
        lo, hi = self.packed_codes & 0x0F, self.packed_codes >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return formats.group_dequantize(self.codes(), self.d, self.m)

    def weight_nbytes(self) -> int:
        return (self.packed_codes.numel() + self.d.numel() * self.d.element_size()
                + self.m.numel() * self.m.element_size())

    def _build_kernel_weight(self):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
        # the kernel computes w = (q - 8)·scale + zero, so zero = m + 8·d
        d, m = self.d.float(), self.m.float()
        sz = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        self._kernel_weight = (packed, sz.to(torch.bfloat16))

    def kernel_forward(self, x):
        if self.group_size not in INT4_KERNEL_GROUPS:
            return None
        if self._kernel_weight is None:
            self._build_kernel_weight()
        packed, sz = self._kernel_weight
        x2, lead = _as_2d(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), packed,
                                                       self.group_size, sz)
        return y.float().reshape(*lead, self.out_features)


class FP8Linear(QuantizedLinear):
    """float8 e4m3 weight, one float32 scale per output channel (reference path only:
    this CPU build has no fast float8 matmul; on H100-class GPUs it is a tensor-core type)."""

    scheme = "fp8"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        w8, scale = formats.fp8_quantize(weight)
        self.register_buffer("w8", w8)
        self.register_buffer("scale", scale)

    def dequantized_weight(self) -> torch.Tensor:
        return formats.fp8_dequantize(self.w8, self.scale)

    def weight_nbytes(self) -> int:
        return self.w8.numel() + self.scale.numel() * 4


class BF16Linear(QuantizedLinear):
    """bfloat16 weight (8 significant bits, float32's range); the kernel path runs the matmul
    in bfloat16 (this CPU has bfloat16 matrix instructions), the reference in float32."""

    scheme = "bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("wbf16", weight.detach().to(torch.bfloat16))

    def dequantized_weight(self) -> torch.Tensor:
        return self.wbf16.float()

    def weight_nbytes(self) -> int:
        return self.wbf16.numel() * 2

    def kernel_forward(self, x):
        return F.linear(x.to(torch.bfloat16), self.wbf16).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wbf16[ids].float()


class QuantizedEmbedding(nn.Module):
    """A token embedding that reads its rows from a quantized [vocab, hidden] linear (the
    tied lm_head), so the table is stored once: ids [...] -> vectors [..., hidden]."""

    def __init__(self, table: "Int8Linear | BF16Linear"):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)
