"""Grouped GEMM for MoE dispatch: one matrix multiply per expert over its contiguous rows.

After the (token, expert) pairs are sorted by expert, the rows that go to expert ``e``
are the contiguous slice ``x[offsets[e]:offsets[e+1]]``. The grouped GEMM computes, for
every expert at once,

    y[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ w[e].T   (· scale[row], optional)

Layouts:
    x        [M, K]      rows already sorted by expert (any strides)
    w        [E, N, K]   one [N, K] matrix per expert (nn.Linear layout; a stride-0 expert
                         dimension — identical experts sharing storage — is fine)
    offsets  [E + 1]     int, offsets[0] = 0, offsets[E] = M, non-decreasing
    scale    [M]         optional per-row factor applied to the output (routing weights)
    y        [M, N]      same dtype as x

Two implementations with the same signature:
    grouped_gemm_torch   reference/CPU path: a Python loop over experts, one ``torch.mm`` on
                         a contiguous slice each (one host read of the offsets).
    grouped_gemm_triton  Triton kernel. The launch grid is (tiles, N / BLOCK_N), where a tile
                         is BLOCK_M rows of *one* expert; the tile table is built on the device
                         with an upper bound on the tile count (ceil(M / BLOCK_M) + E), so no
                         host synchronisation is needed, and spare tiles exit at once.
                         Ragged groups (sizes not multiples of BLOCK_M) are masked; empty
                         experts get no tiles. Accumulates in float32; for float32 inputs
                         the dot runs in IEEE precision (no TF32), so it matches PyTorch to
                         ~1e-6 relative; float16/bfloat16 run on tensor cores. Limits:
                         BLOCK_* powers of two >= 16 (tl.dot), 2-D x, 3-D w of x's dtype.

On a machine without CUDA the kernel runs in the Triton interpreter (TRITON_INTERPRET=1,
set by ``import llmlab``): correct but slow, for tests at small sizes only.
Taught in notebook 06.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, Windows): the PyTorch path works, the kernel refuses
    from types import SimpleNamespace

    def _needs_triton(fn):
        def missing(*args, **kwargs):
            raise RuntimeError(f"{fn.__name__} is a Triton kernel and Triton is not installed "
                               "(it is Linux-only); use impl='torch'")
        return missing

    triton, tl = SimpleNamespace(jit=_needs_triton), None


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor | None):
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected x [M, K] and w [E, N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"x has K={x.shape[1]} columns but w has K={w.shape[2]}")
    if offsets.dim() != 1 or offsets.numel() != w.shape[0] + 1:
        raise ValueError(f"offsets must be [E + 1] = [{w.shape[0] + 1}]; got {tuple(offsets.shape)}")
    if scale is not None and scale.shape != (x.shape[0],):
        raise ValueError(f"scale must be [M] = [{x.shape[0]}]; got {tuple(scale.shape)}")


def grouped_gemm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference grouped GEMM: for each expert, ``torch.mm`` on its contiguous row slice."""
    _check(x, w, offsets, scale)
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()  # one host read for all experts
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(x[lo:hi], w[e].t(), out=y[lo:hi])
    if scale is not None:
        y.mul_(scale.to(y.dtype)[:, None])
    return y


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, y_ptr, scale_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                         N, K,
                         stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
                         HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # spare tile of the upper-bound grid
        return
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(offsets_ptr + expert + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] = w[e].T tile
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) that build without register
# spills for A100 and H100 (python -m llmlab.kernels.report --kernel moe); the first is the
# wrapper's default. float32 dots run without tensor cores and hold more in registers, so
# its large tile has a shorter K step and 8 warps.
GPU_TILES = {
    "half": [(32, 64, 32, 4, 3), (64, 64, 32, 4, 3), (64, 128, 32, 4, 4), (128, 128, 64, 8, 3)],
    "fp32": [(32, 64, 32, 4, 3), (64, 64, 32, 4, 3), (64, 128, 32, 8, 3)],
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gpu_tiles(dtype: str) -> list[tuple[int, int, int, int, int]]:
    """The tiles of :data:`GPU_TILES` for ``dtype`` "fp16", "bf16" or "fp32"."""
    if dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}; allowed: 'fp16', 'bf16', 'fp32'")
    return list(GPU_TILES["fp32" if dtype == "fp32" else "half"])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_table(offsets: torch.Tensor, total_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_row), int32 [ceil(M / block_m) + E]: the expert and first row of each
    BLOCK_M-row tile; spare tiles have expert -1. Built on the device, with no host sync."""
    offsets = offsets.to(torch.int64)
    num_experts = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    starts = ends - blocks
    max_tiles = triton.cdiv(total_rows, block_m) + num_experts
    t = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(ends, t, right=True).clamp_max(num_experts - 1)
    valid = t < ends[-1]
    row = offsets[expert] + (t - starts[expert]) * block_m
    tile_expert = torch.where(valid, expert, torch.full_like(expert, -1)).to(torch.int32)
    return tile_expert, row.to(torch.int32)


def grouped_gemm_triton(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                        scale: torch.Tensor | None = None, block_m: int = 32, block_n: int = 64,
                        block_k: int = 32) -> torch.Tensor:
    """Grouped GEMM with the Triton kernel (compiled on CUDA, interpreted on CPU).

    x and w must share a dtype (float32, float16 or bfloat16); the BLOCK_* tile sizes are
    powers of two >= 16 (tl.dot's minimum).
    """
    if tl is None:
        raise RuntimeError("grouped_gemm_triton needs Triton, which is not installed here "
                           "(it is Linux-only); use impl='torch'")
    _check(x, w, offsets, scale)
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (tl.dot needs it)")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one dtype of float32, float16 or bfloat16; got "
                         f"x {x.dtype}, w {w.dtype}")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"grouped_gemm_triton got {x.device.type} tensors, but Triton is "
                         "compiling for the GPU here; move them to CUDA, or set "
                         "TRITON_INTERPRET=1 before importing llmlab to use the interpreter")
    m, n, k = x.shape[0], w.shape[1], x.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    tile_expert, tile_row = tile_table(offsets, m, block_m)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    # float32 dots in full IEEE precision (no TF32); float16/bfloat16 on tensor cores. The
    # interpreter multiplies bfloat16 tiles as raw 16-bit patterns, so there they are
    # upcast to float32 first (as in flash_attn); compiled kernels never upcast.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = _interpreted() and x.dtype == torch.bfloat16
    _grouped_gemm_kernel[grid](
        x, w, y, scale if scale is not None else y, offsets.to(torch.int32), tile_expert, tile_row,
        n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        HAS_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, UPCAST=upcast)
    return y


IMPLS = ("auto", "torch", "triton")


def _resolve(impl: str, x: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown grouped_gemm impl {impl!r}; allowed: {list(IMPLS)}")
    if impl == "auto":
        return "triton" if x.is_cuda else "torch"
    return impl


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                 scale: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Grouped GEMM; ``impl="auto"`` runs the Triton kernel on CUDA and PyTorch on CPU."""
    if _resolve(impl, x) == "triton":
        return grouped_gemm_triton(x, w, offsets, scale)
    return grouped_gemm_torch(x, w, offsets, scale)


def grouped_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   offsets: torch.Tensor, scale: torch.Tensor | None = None,
                   impl: str = "auto") -> torch.Tensor:
    """Every expert's SwiGLU MLP on its rows: down(silu(gate(x)) · up(x)) · scale, grouped.

    x [M, hidden] sorted by expert; w_gate, w_up [E, inter, hidden]; w_down [E, hidden, inter].
    Triton: three grouped-GEMM launches for all experts. PyTorch (CPU): one pass per expert
    over its contiguous slice doing all three GEMMs, so the [rows, inter] intermediate of
    one expert stays in cache instead of streaming the whole batch's through memory.
    """
    if _resolve(impl, x) == "triton":
        h = torch.nn.functional.silu(grouped_gemm_triton(x, w_gate, offsets))
        h = h * grouped_gemm_triton(x, w_up, offsets)
        return grouped_gemm_triton(h, w_down, offsets, scale)
    _check(x, w_gate, offsets, scale)
    y = torch.empty(x.shape[0], w_down.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(w_gate.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            xe = x[lo:hi]
            h = torch.nn.functional.silu(xe @ w_gate[e].t()).mul_(xe @ w_up[e].t())
            torch.mm(h, w_down[e].t(), out=y[lo:hi])
    if scale is not None:
        y.mul_(scale.to(y.dtype)[:, None])
    return y
