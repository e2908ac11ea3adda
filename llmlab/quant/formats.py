"""Weight formats as plain tensor functions: quantize a float matrix, dequantize it back.

Every function takes a weight ``w [out_features, in_features]`` (the layout of
``nn.Linear.weight``) and quantizes along the input dimension, the dimension a matmul
sums over, so that one scale multiplies a whole group of products at once.

* int8, symmetric, one scale per output row:        w ≈ q · s[row],        q ∈ [-127, 127]
* group-wise asymmetric (int4 by default):           w ≈ q · d[g] + m[g],   q ∈ [0, 2^bits - 1]
* GGUF Q4_1 (llama.cpp's layout, exactly):          blocks of 32, float16 d and m, q ∈ [0, 15]
* float8 e4m3, one scale per output row:            w ≈ fp8(w / s[row]) · s[row]
* GGUF Q8_0 (the embedding's type):                  blocks of 32, float16 d,  q ∈ [-127, 127]

Taught in notebook 08.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Q4_1_BLOCK = 32          # weights per Q4_1 block (GGUF's QK4_1)
FP8_MAX = 448.0          # largest finite float8 e4m3 value


def _check_matrix(w: torch.Tensor, name: str = "w") -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a floating-point matrix [out_features, in_features]; "
                         f"got {shape}")


def check_group_size(group_size: int, in_features: int) -> None:
    """Raise a ValueError unless ``group_size`` is a positive divisor of ``in_features``."""
    if not isinstance(group_size, int) or group_size < 2 or in_features % group_size:
        allowed = [g for g in range(2, in_features + 1) if in_features % g == 0]
        raise ValueError(f"group_size={group_size!r} must divide in_features={in_features}; "
                         f"allowed: {allowed[:12]}{' ...' if len(allowed) > 12 else ''}")


# -- int8, symmetric, per output channel -------------------------------------------------

def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]) with w ≈ q · scale[:, None].

    The scale maps each row's largest magnitude to 127 (symmetric: zero stays exactly zero).
    """
    _check_matrix(w)
    w = w.float()
    scale = int8_scale(w)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_scale(w: torch.Tensor) -> torch.Tensor:
    """The per-row scale of :func:`int8_quantize`: max|w_row| / 127, float32 [out] (an
    all-zero row gets 1). GPTQ (:mod:`llmlab.quant.gptq`) keeps these scales."""
    scale = w.float().abs().amax(dim=1) / 127.0
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [out, in], scale [out]) -> float32 [out, in]."""
    return q.float() * scale.float()[:, None]


# -- group-wise asymmetric (int4 by default) ---------------------------------------------

def group_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 32
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in], d float32 [out, in/group], m float32 [out, in/group]).

    Each run of ``group_size`` consecutive inputs of a row gets its own step d and
    offset m: m is the group's minimum and d = (max - min) / (2^bits - 1), so the group's
    smallest weight is code 0 and its largest code 2^bits - 1. w ≈ q · d + m.
    """
    _check_matrix(w)
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} must be an int in 1..8")
    out_f, in_f = w.shape
    check_group_size(group_size, in_f)
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    levels = (1 << bits) - 1
    d = (hi - lo) / levels
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))          # a constant group: all codes 0
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, levels).to(torch.uint8)
    return q.reshape(out_f, in_f), d, lo


def group_dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(q [out, in], d [out, groups], m [out, groups]) -> float32 [out, in]; group = in/groups."""
    out_f, in_f = q.shape
    groups = d.shape[1]
    g = q.reshape(out_f, groups, in_f // groups).float()
    return (g * d.float()[..., None] + m.float()[..., None]).reshape(out_f, in_f)


# -- GGUF Q4_1 ------------------------------------------------------------------------------

@dataclass
class Q4_1:
    """Q4_1 blocks of a [out, in] matrix, as GGUF stores them (20 bytes per 32 weights).

    d, m: float16 [out, in/32], the block's step and minimum.
    qs: uint8 [out, in/32, 16]: byte j holds weight j in its low nibble and weight j+16
    in its high nibble (GGUF's packing).
    """
    d: torch.Tensor
    m: torch.Tensor
    qs: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * Q4_1_BLOCK

    def codes(self) -> torch.Tensor:
        """The 4-bit codes unpacked, uint8 [out, in]."""
        lo, hi = self.qs & 0x0F, self.qs >> 4
        return torch.cat([lo, hi], dim=-1).reshape(self.shape)

    def nbytes(self) -> int:
        return self.d.numel() * 2 + self.m.numel() * 2 + self.qs.numel()

    def to_bytes(self) -> bytes:
        """The raw GGUF tensor data: per block d (fp16), m (fp16), then 16 bytes of nibbles."""
        out_f, blocks = self.d.shape
        raw = torch.cat([self.d.reshape(out_f, blocks, 1).view(torch.uint8),
                         self.m.reshape(out_f, blocks, 1).view(torch.uint8), self.qs], dim=-1)
        return raw.contiguous().numpy().tobytes()


def q4_1_quantize(w: torch.Tensor) -> Q4_1:
    """w [out, in] (in a multiple of 32) -> :class:`Q4_1`, the way llama.cpp quantizes.

    Per block of 32 consecutive inputs: d = (max - min) / 15 and m = min in float32, both
    stored as float16; the codes are computed with the float32 d and min (not the rounded
    ones): q = min(15, trunc((x - min) / d + 0.5)), as ggml's reference quantizer does.
    """
    _check_matrix(w)
    out_f, in_f = w.shape
    if in_f % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 needs in_features to be a multiple of {Q4_1_BLOCK}; got {in_f}")
    blocks = w.float().reshape(out_f, in_f // Q4_1_BLOCK, Q4_1_BLOCK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.trunc((blocks - lo[..., None]) * inv[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return Q4_1(d=d.to(torch.float16), m=lo.to(torch.float16), qs=qs)


def q4_1_dequantize(blocks: Q4_1) -> torch.Tensor:
    """:class:`Q4_1` -> float32 [out, in]: w = q·d + m, computed as GGUF's reader does
    (float16 d and m widened to float32, one float32 multiply, then one float32 add)."""
    out_f, in_f = blocks.shape
    q = blocks.codes().reshape(out_f, in_f // Q4_1_BLOCK, Q4_1_BLOCK).float()
    d = blocks.d.float()[..., None]
    m = blocks.m.float()[..., None]
    return (d * q + m).reshape(out_f, in_f)


# -- GGUF Q8_0 (the tied embedding's type in the shipped file) ------------------------------

def q8_0_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in a multiple of 32) -> (q int8 [out, in], d float16 [out, in/32]):
    GGUF's Q8_0, symmetric int8 per block of 32 inputs, d = max|w| / 127 (llama.cpp's rule).
    w ≈ q · d. On a tensor that already is dequantized Q8_0 it gives back the same q and d."""
    _check_matrix(w)
    out_f, in_f = w.shape
    if in_f % Q4_1_BLOCK:
        raise ValueError(f"Q8_0 needs in_features to be a multiple of {Q4_1_BLOCK}; got {in_f}")
    blocks = w.float().reshape(out_f, in_f // Q4_1_BLOCK, Q4_1_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_f, in_f), d.to(torch.float16)


def q8_0_dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [out, in], d float16 [out, in/32]) -> float32 [out, in]: w = q · d."""
    out_f, in_f = q.shape
    blocks = q.reshape(out_f, in_f // Q4_1_BLOCK, Q4_1_BLOCK).float()
    return (blocks * d.float()[..., None]).reshape(out_f, in_f)


# -- float8 e4m3, per output channel -----------------------------------------------------

def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (w8 float8_e4m3fn [out, in], scale float32 [out]); w ≈ w8 · scale.

    The scale maps each row's largest magnitude to 448, e4m3's largest finite value.
    """
    _check_matrix(w)
    w = w.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w8 = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def fp8_dequantize(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w8.float() * scale.float()[:, None]
