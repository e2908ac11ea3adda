"""Weight-only quantized GEMM: dequantize the weight tile in registers, multiply, accumulate.

Computes ``y = x @ Wᵀ`` where W [N, K] (``nn.Linear`` layout) is stored quantized and
is widened tile by tile inside the kernel, so a decode step reads 1 byte (int8) or half a
byte (int4) per weight from memory instead of 2 or 4. Two formats
(:mod:`llmlab.quant.formats`, the layers of :mod:`llmlab.quant.linear`):

* **int8**, symmetric, one scale per output channel: ``W[n, k] = q[n, k] · scale[n]``.
  The codes are widened to the activation dtype (every int8 is exact in float16 and
  bfloat16), multiplied on tensor cores, and the scale is applied once to the float32
  accumulator: ``y[:, n] = (x @ q[n]ᵀ) · scale[n]``.
* **int4**, group-wise asymmetric: ``W[n, k] = q[n, k] · d[n, g] + m[n, g]`` with
  ``g = k // group_size`` and q ∈ 0..15. The codes are widened and dequantized in float32
  (``q·d + m``), rounded to the activation dtype, then multiplied.

Layouts (codes and scales contiguous; x and y may have any strides):

    x        [M, K]          float16, bfloat16 or float32 (the activations)
    int8:  q      [N, K]     int8
           scale  [N]        float32 (any float dtype)
    int4:  packed [N, K/2]   uint8: byte j of a row holds code 2j in its low nibble and
                             code 2j+1 in its high nibble (consecutive inputs, as
                             :class:`llmlab.quant.linear.GroupLinear` stores them)
           d, m   [N, K/group_size]   float16 or float32: step and minimum of each group
    y        [M, N]          x's dtype; accumulated in float32

How: one program per (BLOCK_M rows, BLOCK_N output channels); it walks K in steps of
BLOCK_K. A program loads its BLOCK_K × BLOCK_N tile of codes (int4: each byte is loaded
for both of its nibbles and shifted by ``(k % 2) · 4``), dequantizes it and calls
``tl.dot``. The group of a tile is one scalar when ``group_size`` is a multiple of
BLOCK_K (d and m are then one vector per tile); when BLOCK_K is a multiple of
``group_size`` the tile spans several groups and d, m are gathered per input. Rows, columns
and inputs past M, N, K are masked, so no size needs to be a multiple of a block.
Pointer offsets are int64: a weight may exceed 2^31 elements.

Limits: BLOCK_* powers of two >= 16 (``tl.dot``); int4 needs K even, ``group_size``
dividing K and a multiple or divisor of BLOCK_K. float32 activations multiply in IEEE
precision (no TF32, no tensor cores); float16/bfloat16 run on tensor cores (HMMA on
A100, HMMA or HGMMA on H100). M of 1-16 rows (decode) is the case the default tile is
sized for (BLOCK_M 16: tl.dot's minimum); larger M takes a 64-row tile.

On a machine without CUDA the kernel runs in the Triton interpreter (TRITON_INTERPRET=1,
set by ``import llmlab``): correct but slow, for tests at small sizes only. There, bfloat16
tiles are upcast to float32 before ``tl.dot`` (the interpreter would multiply their raw
16-bit patterns), as in :mod:`llmlab.kernels.moe_gemm`. Taught in notebook 08.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, Windows): the kernel refuses, the CPU paths work
    from types import SimpleNamespace

    triton, tl = SimpleNamespace(jit=lambda fn: fn), None


@triton.jit
def _quant_gemm_kernel(x_ptr, w_ptr, d_ptr, m_ptr, y_ptr, M, N, K,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_dn, stride_dg,
                       stride_ym, stride_yn,
                       INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        if INT4:   # [BLOCK_K, BLOCK_N] codes: byte k // 2, nibble k % 2
            byte = tl.load(w_cols + (kk[:, None] // 2) * stride_wk, mask=tile_ok, other=0)
            code = ((byte >> ((kk[:, None] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
            if GROUP >= BLOCK_K:   # the tile lies in one group: one step/minimum per column
                g = k0 // GROUP
                d = tl.load(d_ptr + cols.to(tl.int64) * stride_dn + g * stride_dg, mask=col_ok,
                            other=0.0).to(tl.float32)[None, :]
                mn = tl.load(m_ptr + cols.to(tl.int64) * stride_dn + g * stride_dg, mask=col_ok,
                             other=0.0).to(tl.float32)[None, :]
            else:                  # several groups per tile: gather per input
                gofs = cols[None, :].to(tl.int64) * stride_dn + (kk[:, None] // GROUP) * stride_dg
                d = tl.load(d_ptr + gofs, mask=tile_ok, other=0.0).to(tl.float32)
                mn = tl.load(m_ptr + gofs, mask=tile_ok, other=0.0).to(tl.float32)
            b = tl.where(tile_ok, code * d + mn, 0.0)
        else:      # int8 codes; the per-channel scale is applied to the accumulator
            b = tl.load(w_cols + kk[:, None] * stride_wk, mask=tile_ok, other=0)
        if UPCAST:                 # interpreter only: float32 tiles (the weight not rounded)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            b = b.to(a.dtype)      # the weight tile in the activations' dtype
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if not INT4:
        s = tl.load(d_ptr + cols.to(tl.int64) * stride_dn, mask=col_ok, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) built without register spills for
# A100 and H100, int4 and int8 (python -m llmlab.kernels.report --kernel quant); the first
# is the wrappers' default for M <= 16 (decode), the second for larger M. The int4 tile is
# dequantized in float32 registers, so K steps are short (BLOCK_K 64 with 64 or 128 rows
# spills on A100). float32 dots run without tensor cores and hold more in registers.
GPU_TILES = {
    "half": [(16, 64, 32, 4, 3), (64, 64, 32, 4, 3), (16, 128, 64, 4, 3), (128, 128, 32, 8, 3)],
    "fp32": [(16, 32, 32, 4, 3), (32, 64, 32, 8, 3), (16, 64, 32, 4, 3)],
}


def gpu_tiles(dtype: str) -> list[tuple[int, int, int, int, int]]:
    """The tiles of :data:`GPU_TILES` for activations ``dtype`` "fp16", "bf16" or "fp32"."""
    if dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}; allowed: 'fp16', 'bf16', 'fp32'")
    return list(GPU_TILES["fp32" if dtype == "fp32" else "half"])


def default_tile(dtype: torch.dtype, m: int) -> tuple[int, int, int, int, int]:
    """The wrappers' tile for ``m`` rows of ``dtype`` activations (see :data:`GPU_TILES`)."""
    tiles = GPU_TILES["fp32" if dtype == torch.float32 else "half"]
    return tiles[0] if m <= 16 else tiles[1]


def _rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_block(name: str, b) -> None:
    if not isinstance(b, int) or b < 16 or b & (b - 1):
        raise ValueError(f"{name}={b!r} must be a power of two >= 16 (tl.dot needs it)")


def _check_common(x: torch.Tensor, codes: torch.Tensor, code_dtype: torch.dtype, k_per_row: int,
                  scales: tuple[tuple[str, torch.Tensor], ...]) -> None:
    if tl is None:
        raise RuntimeError("the quantized GEMM is a Triton kernel and Triton is not installed "
                           "(it is Linux-only); use the layer's CPU path")
    if x.dim() < 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a float32, float16 or bfloat16 tensor [..., K]; got "
                         f"{tuple(x.shape)} {x.dtype}")
    if codes.dtype != code_dtype or codes.dim() != 2:
        raise ValueError(f"weight codes must be a 2-D {code_dtype} tensor; got "
                         f"{tuple(codes.shape)} {codes.dtype}")
    if codes.shape[1] != k_per_row:
        raise ValueError(f"x has K={x.shape[-1]} columns but the weight codes are "
                         f"{tuple(codes.shape)} (expected [N, {k_per_row}])")
    for name, t in (("codes", codes),) + scales:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call .contiguous() first")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if name != "codes" and not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor; got {t.dtype}")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"the quantized GEMM got {x.device.type} tensors, but Triton is "
                         "compiling for the GPU here; move them to CUDA, or set "
                         "TRITON_INTERPRET=1 before importing llmlab to use the interpreter")


def _launch(x, codes, d, m, n, int4, group, block_m, block_n, block_k):
    tile = default_tile(x.dtype, _rows(x))
    block_m, block_n = block_m or tile[0], block_n or tile[1]
    block_k = block_k or tile[2]
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_block(name, b)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    mrows, k = x.shape
    y = torch.empty(mrows, n, dtype=x.dtype, device=x.device)
    if mrows == 0 or n == 0:
        return y.reshape(*lead, n)
    grid = (triton.cdiv(mrows, block_m), triton.cdiv(n, block_n))
    # float32 dots in IEEE precision (no TF32); the interpreter multiplies bfloat16 tiles
    # as raw 16-bit patterns, so there they are upcast first; compiled kernels never upcast
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = _interpreted() and x.dtype == torch.bfloat16
    stride_dg = d.stride(1) if d.dim() == 2 else 0
    _quant_gemm_kernel[grid](x, codes, d, m, y, mrows, n, k, x.stride(0), x.stride(1),
                             codes.stride(0), codes.stride(1), d.stride(0), stride_dg,
                             y.stride(0), y.stride(1), INT4=int4, GROUP=group,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             PRECISION=precision, UPCAST=upcast, num_warps=tile[3],
                             num_stages=tile[4])
    return y.reshape(*lead, n)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *,
              block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (q [N, K] int8 · scale [N])ᵀ, in x's dtype (float32 accumulation).

    x may have leading dimensions ([..., K] -> [..., N]; M counts all its rows).
    The BLOCK_* sizes default to :func:`default_tile`'s. See the module docstring.
    """
    _check_common(x, q, torch.int8, x.shape[-1] if x.dim() else -1, (("scale", scale),))
    if scale.shape != (q.shape[0],):
        raise ValueError(f"scale must be [N] = [{q.shape[0]}]; got {tuple(scale.shape)}")
    return _launch(x, q, scale, scale, q.shape[0], False, 1, block_m, block_n, block_k)


def _int4_block_k(group_size: int, block_k: int | None, default: int) -> int:
    if block_k is not None:
        _check_block("block_k", block_k)
        if group_size % block_k and block_k % group_size:
            raise ValueError(f"group_size={group_size} and block_k={block_k}: one must be a "
                             "multiple of the other (a K tile lies in one group, or holds "
                             "whole groups)")
        return block_k
    if group_size % default == 0 or default % group_size == 0:
        return default
    if group_size % 16:
        raise ValueError(f"group_size={group_size} needs an explicit block_k: pass a power "
                         "of two >= 16 that it divides or that divides it")
    return 16


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              group_size: int = 32, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ Wᵀ with W [N, K] = q·d + m per group of ``group_size`` inputs.

    packed [N, K/2] uint8 (code 2j in the low nibble of byte j, 2j+1 in the high one);
    d, m [N, K/group_size] float; x may be [..., K]. The BLOCK_* sizes default to
    :func:`default_tile`'s, except a ``block_k`` that ``group_size`` neither divides nor
    is a multiple of: then 16 (see the module docstring).
    """
    k = x.shape[-1] if x.dim() else -1
    if k % 2:
        raise ValueError(f"int4 needs an even K (two codes per byte); got K={k}")
    _check_common(x, packed, torch.uint8, k // 2, (("d", d), ("m", m)))
    if not isinstance(group_size, int) or group_size < 2 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be an int >= 2 dividing K={k}")
    groups = (packed.shape[0], k // group_size)
    if tuple(d.shape) != groups or tuple(m.shape) != groups:
        raise ValueError(f"d and m must be [N, K/group_size] = {list(groups)}; got "
                         f"{list(d.shape)} and {list(m.shape)}")
    block_k = _int4_block_k(group_size, block_k, default_tile(x.dtype, _rows(x))[2])
    return _launch(x, packed, d, m, packed.shape[0], True, group_size, block_m, block_n, block_k)
