"""Fused elementwise kernels of the decoder layer, in Triton: each reads its input once and
writes its outputs once, where PyTorch runs several operators with a round trip through
memory (and a Python call) between them.

    add_rmsnorm   h = x + residual;  out = rmsnorm(h) · weight           -> (out, h)
    swiglu        gate_up = [gate | up];  out = silu(gate) · up
    qkv_rope      qkv = [q | k | v];  q, k rotated by RoPE (half-split), v copied -> (q, k, v)

The matrix multiplies around them stay PyTorch's: the model concatenates the q/k/v weights
(and the gate/up weights) so that one matmul produces ``qkv`` (``gate_up``), and these
kernels take that output apart. Plain-PyTorch references with the same signatures are in
:mod:`llmlab.layers.fused` (the parity tests compare the two); the model uses either
through :func:`llmlab.layers.fused.fuse_model`.

Layouts (rows are tokens; any leading dims, flattened to rows; last dim contiguous):

    add_rmsnorm  x, residual [tokens, hidden]; weight [hidden]; out, h [tokens, hidden]
                 (residual may be None: a plain RMSNorm, and h is x)
    swiglu       gate_up [tokens, 2 * inter] -> out [tokens, inter]
    qkv_rope     qkv [tokens, (heads + 2 * kv_heads) * head_dim], positions [tokens] int,
                 inv_freq [head_dim / 2] float32
                 -> q [tokens, heads, head_dim], k, v [tokens, kv_heads, head_dim]

Arithmetic: float32 inside every kernel, with the input dtype's roundings where PyTorch's
unfused ops round (``x + residual`` before the norm, the normalized row before the weight,
silu's output, each product of the rotation), so a bfloat16 or float16 result matches the
unfused model's up to the order of a sum; in float32 those roundings are no-ops. The RMS is
``1 / sqrt(mean(h²) + eps)`` with an IEEE square root; RoPE's angles are
``float32(position) · inv_freq`` and their cos/sin are computed in the kernel (the model's
tables, rounded to the activation dtype). SiLU and the cos/sin use the GPU's fast exp and
trig: a few ulps from PyTorch's.

Limits: float32, float16 or bfloat16, one dtype for every tensor (inv_freq float32);
add_rmsnorm holds a whole row in one program: BLOCK = the next power of two >= hidden,
hidden <= :data:`MAX_HIDDEN`; qkv_rope holds a token's heads in one program: head_dim even,
(next power of two >= heads) · (next power of two >= head_dim / 2) <= :data:`MAX_HEAD_TILE`
elements; swiglu has no size limit (BLOCK columns per program, a grid over the rest).
One program per row (swiglu: per row and BLOCK columns), so a decode step at batch 1
launches one program per kernel: these kernels save memory traffic and launches, not
compute. On a machine without CUDA they run in the Triton interpreter (TRITON_INTERPRET=1,
set by ``import llmlab``): correct but slow, for tests at small sizes. Taught in notebook 11.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, Windows): the PyTorch references work, these refuse
    from types import SimpleNamespace

    def _needs_triton(fn):
        def missing(*args, **kwargs):
            raise RuntimeError(f"{fn.__name__} is a Triton kernel and Triton is not installed "
                               "(it is Linux-only); use backend='torch'")
        return missing

    triton, tl = SimpleNamespace(jit=_needs_triton), None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 8192           # add_rmsnorm: one row per program (a 16384 block spills on sm_90)
MAX_HEAD_TILE = 4096        # qkv_rope: padded heads x padded half head_dim (8192 spills on sm_80)
SWIGLU_BLOCK = 1024         # swiglu: columns per program


def next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def rmsnorm_warps(block: int) -> int:
    """Warps for add_rmsnorm's row of ``block`` columns: 8 columns per thread up to 16 warps."""
    return max(1, min(16, block // 256))


# -- the kernels ------------------------------------------------------------------------

@triton.jit
def _rounded(x, PTR, BF16_BITS: tl.constexpr):
    """float32 ``x`` rounded (to nearest even) to the element type of ``PTR``, as float32."""
    if BF16_BITS:   # the interpreter truncates float32 -> bfloat16: round on the bits instead
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(PTR.dtype.element_ty).to(tl.float32)


@triton.jit
def _add_rmsnorm_kernel(X, R, W, OUT, H, stride_x, stride_r, stride_out, stride_h, n_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                        BF16_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    hf = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        hf = _rounded(hf + r, H, BF16_BITS)                     # torch's x + residual
        tl.store(H + row * stride_h + cols, hf.to(H.dtype.element_ty), mask=ok)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = _rounded(hf * rstd, OUT, BF16_BITS)                # HF's rounding before the weight
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    out = _rounded(normed * w, OUT, BF16_BITS)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_kernel(GU, OUT, stride_gu, stride_out, inter, BLOCK: tl.constexpr,
                   BF16_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    s = _rounded(g / (1.0 + tl.exp(-g)), OUT, BF16_BITS)        # silu, rounded as F.silu's
    out = _rounded(s * u, OUT, BF16_BITS)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(SRC, DST, stride_dst_head, n_heads, offs_j, j_ok, cos, sin,
                  HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BF16_BITS: tl.constexpr):
    """Rotate ``n_heads`` heads of one token: SRC[h * HEAD_DIM + j] -> DST[h, j], half-split."""
    heads = tl.arange(0, BLOCK_HEADS)
    m = (heads < n_heads)[:, None] & j_ok[None, :]
    src = SRC + heads[:, None] * HEAD_DIM + offs_j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HEAD_DIM // 2, mask=m, other=0.0).to(tl.float32)
    # x·cos + rotate_half(x)·sin, each product and sum rounded to the dtype as PyTorch's are
    o1 = _rounded(x1 * cos[None, :], DST, BF16_BITS) - _rounded(x2 * sin[None, :], DST, BF16_BITS)
    o2 = _rounded(x2 * cos[None, :], DST, BF16_BITS) + _rounded(x1 * sin[None, :], DST, BF16_BITS)
    dst = DST + heads[:, None] * stride_dst_head + offs_j[None, :]
    tl.store(dst, _rounded(o1, DST, BF16_BITS).to(DST.dtype.element_ty), mask=m)
    tl.store(dst + HEAD_DIM // 2, _rounded(o2, DST, BF16_BITS).to(DST.dtype.element_ty), mask=m)


@triton.jit
def _qkv_rope_kernel(QKV, POS, INV_FREQ, Q, K, V, stride_qkv, stride_q, stride_k, stride_v,
                     num_heads, num_kv_heads,
                     HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_KV: tl.constexpr, BF16_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_HALF)
    j_ok = offs_j < HEAD_DIM // 2
    angle = tl.load(POS + row).to(tl.float32) * tl.load(INV_FREQ + offs_j, mask=j_ok, other=0.0)
    cos = _rounded(tl.cos(angle), Q, BF16_BITS)          # the model's tables, in the dtype
    sin = _rounded(tl.sin(angle), Q, BF16_BITS)
    src = QKV + row * stride_qkv
    _rotate_heads(src, Q + row * stride_q, HEAD_DIM, num_heads, offs_j, j_ok, cos, sin,
                  HEAD_DIM, BLOCK_H, BF16_BITS)
    src = src + num_heads * HEAD_DIM
    _rotate_heads(src, K + row * stride_k, HEAD_DIM, num_kv_heads, offs_j, j_ok, cos, sin,
                  HEAD_DIM, BLOCK_KV, BF16_BITS)
    # v: copied as it is, both halves
    src = src + num_kv_heads * HEAD_DIM
    heads = tl.arange(0, BLOCK_KV)
    m = (heads < num_kv_heads)[:, None] & j_ok[None, :]
    off = heads[:, None] * HEAD_DIM + offs_j[None, :]
    dst = V + row * stride_v
    tl.store(dst + off, tl.load(src + off, mask=m, other=0.0), mask=m)
    tl.store(dst + off + HEAD_DIM // 2, tl.load(src + off + HEAD_DIM // 2, mask=m, other=0.0),
             mask=m)


# -- argument checks (shared with the PyTorch references) ---------------------------------

def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: float32, float16, bfloat16")


def check_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> None:
    """Raise ValueError naming the wrong argument of ``add_rmsnorm``."""
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., hidden] with hidden >= 1; got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [hidden] = [{x.shape[-1]}]; got {tuple(weight.shape)}")
    if residual is not None:
        _check_float("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}: "
                             "they must match")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual has dtype {residual.dtype}, x {x.dtype}: they must match")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps={eps!r} must be a positive number")


def check_swiglu(gate_up: torch.Tensor) -> None:
    """Raise ValueError naming what is wrong with ``swiglu``'s input."""
    _check_float("gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 * inter]: its last dim "
                         f"{gate_up.shape[-1] if gate_up.dim() else None} must be even "
                         f"(shape {tuple(gate_up.shape)})")


def check_qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError naming the wrong argument of ``qkv_rope``."""
    _check_float("qkv", qkv)
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive int")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for the half-split rotation")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads="
                         f"{num_kv_heads}: each KV head must serve the same number of query heads")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() < 1 or qkv.shape[-1] != width:
        raise ValueError(f"qkv must be [..., (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[..., {width}]; got shape {tuple(qkv.shape)}")
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
            or positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor; got "
                         f"{getattr(positions, 'dtype', type(positions).__name__)}")
    if positions.shape != qkv.shape[:-1]:
        raise ValueError(f"positions has shape {tuple(positions.shape)}; it must be qkv's "
                         f"leading dims {tuple(qkv.shape[:-1])}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be a float32 tensor; got "
                         f"{getattr(inv_freq, 'dtype', type(inv_freq).__name__)}")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be [head_dim / 2] = [{head_dim // 2}]; got "
                         f"{tuple(inv_freq.shape)}")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(name: str, t: torch.Tensor) -> None:
    if tl is None:
        raise RuntimeError(f"{name} needs Triton, which is not installed here (it is "
                           "Linux-only); use backend='torch'")
    if t.device.type != "cuda" and not _interpreted():
        raise ValueError(f"{name} got {t.device.type} tensors, but Triton is compiling for the "
                         "GPU here; move them to CUDA, or set TRITON_INTERPRET=1 before "
                         "importing llmlab to run the kernel in the interpreter")


def _bf16_bits(t: torch.Tensor) -> bool:
    """Round to bfloat16 on the bits: in the interpreter only, whose conversion truncates
    (Triton 3.x); compiled kernels round to nearest even in hardware and never take it."""
    return _interpreted() and t.dtype == torch.bfloat16


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with a contiguous last dim (a view when it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


# -- the wrappers -------------------------------------------------------------------------

def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``rmsnorm(h) · weight`` in one pass over each row.

    Returns ``(out, h)``, both shaped like x; ``residual=None`` normalizes x (and h is x).
    """
    check_add_rmsnorm(x, residual, weight, eps)
    _check_device("add_rmsnorm", x)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype}, x {x.dtype}: the kernel needs "
                         "one dtype")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden={hidden} is over {MAX_HIDDEN}: the kernel keeps a row in "
                         "one program")
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        r2, h = x2, x2
    else:
        r2 = _rows(residual)
        h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = next_power_of_two(hidden)
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, h, x2.stride(0), r2.stride(0), out.stride(0),
            h.stride(0), hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block,
            BF16_BITS=_bf16_bits(x), num_warps=rmsnorm_warps(block))
    if residual is None:
        return out.view(x.shape), x
    return out.view(x.shape), h.view(x.shape)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` where gate, up are the two halves of gate_up's last dim."""
    check_swiglu(gate_up)
    _check_device("swiglu", gate_up)
    inter = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and inter:
        grid = (gu.shape[0], triton.cdiv(inter, SWIGLU_BLOCK))
        _swiglu_kernel[grid](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=SWIGLU_BLOCK,
                             BF16_BITS=_bf16_bits(gate_up))
    return out.view(*gate_up.shape[:-1], inter)


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int):
    """Split the fused projection's output into q, k, v and rotate q and k (RoPE, half-split).

    qkv [..., (num_heads + 2 * num_kv_heads) * head_dim]; positions [...] (qkv's leading
    dims), any integer dtype; inv_freq [head_dim / 2] float32. Returns new contiguous
    tensors q [..., num_heads, head_dim], k and v [..., num_kv_heads, head_dim].
    """
    check_qkv_rope(qkv, positions, inv_freq, num_heads, num_kv_heads, head_dim)
    _check_device("qkv_rope", qkv)
    block_half = next_power_of_two(head_dim // 2)
    block_h = next_power_of_two(num_heads)
    if block_h * block_half > MAX_HEAD_TILE:
        raise ValueError(f"num_heads={num_heads} with head_dim={head_dim} is a tile of "
                         f"{block_h} x {block_half}, over {MAX_HEAD_TILE} elements")
    lead = qkv.shape[:-1]
    rows = _rows(qkv)
    n = rows.shape[0]
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if n:
        pos = positions.reshape(-1).contiguous()
        _qkv_rope_kernel[(n,)](
            rows, pos, inv_freq.contiguous(), q, k, v, rows.stride(0), q.stride(0), k.stride(0),
            v.stride(0), num_heads, num_kv_heads, HEAD_DIM=head_dim, BLOCK_HALF=block_half,
            BLOCK_H=block_h, BLOCK_KV=next_power_of_two(num_kv_heads), BF16_BITS=_bf16_bits(qkv))
    return (q.view(*lead, num_heads, head_dim), k.view(*lead, num_kv_heads, head_dim),
            v.view(*lead, num_kv_heads, head_dim))


__all__ = ["add_rmsnorm", "swiglu", "qkv_rope", "check_add_rmsnorm", "check_swiglu",
           "check_qkv_rope", "DTYPES", "MAX_HIDDEN", "MAX_HEAD_TILE", "SWIGLU_BLOCK",
           "next_power_of_two", "rmsnorm_warps"]
