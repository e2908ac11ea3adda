"""FlashAttention forward in Triton, FlashAttention-2 style (taught in notebook 03).

What it computes: O = softmax(Q Kᵀ · scale + mask) V, exactly (up to rounding), without
ever writing the [seq_q, seq_k] score matrix to main memory.

How: each program owns one tile of BLOCK_M query rows of one (sequence, KV head); the
rows are the query positions × the query heads that share that KV head, interleaved
(row r = position r // groups of head kv_head·groups + r % groups), so grouped-query
attention reads each K/V block once per group and never repeats K/V in memory. The
wrapper hands the kernel q and the output in that packed order, [batch, kv_heads,
seq_q·groups, head_dim] (a view when groups is 1 or seq_q is 1, else one copy each way):
a tile's row addresses are then base + row · stride, which the compiler recomputes for
free, where interleaved addresses would stay in registers across the whole key loop and
make the large tiles spill. The program keeps its Q tile on chip, streams K and V
through in blocks of BLOCK_N keys, and keeps an online softmax in float32: running row
max ``m``, running sum ``l``, and an accumulator rescaled by 2^(m_old − m_new) when the
max grows (scores are pre-multiplied by log2(e) so the kernel can use exp2).

The key blocks start at the row's first visible key (``key_start``, 0 without one), so
left padding never needs a mask, and the loop is split in two so only the blocks that
need a mask pay for one:

    unmasked   the blocks every row of the tile sees in full
    masked     the blocks crossing the causal diagonal, and the ragged tail

Blocks past the causal diagonal of the tile's last row are never loaded.

Layouts (last dimension contiguous, other strides arbitrary):
    dense   q [batch, seq_q, heads, head_dim], k/v [batch, seq_k, kv_heads, head_dim]
    varlen  q [total_q, heads, head_dim],      k/v [total_k, kv_heads, head_dim],
            cu_seqlens_q/k int32 [batch + 1]
    output  same layout and dtype as q (contiguous).

Masks: ``causal`` is aligned bottom-right (query i sees key j when j <= i + seq_k − seq_q,
per sequence), which covers decode (seq_q = 1) and chunked prefill (seq_q < seq_k).
``key_start``/``key_end`` int32 [batch] hide keys outside [key_start[b], key_end[b]) (left
padding; tokens after a row finished). A query row with no visible key returns zeros.

Limits: head_dim a power of two from 16 to 256; inputs float32, float16 or bfloat16
(float16/bfloat16 dots run on tensor cores, float32 dots in full IEEE precision, not
TF32); grouped-query attention when heads is a multiple of kv_heads (query head h reads
KV head h // (heads // kv_heads)). Forward only. On a GPU the tile is autotuned among
:func:`tile_configs`, tiles that build without spilling registers on A100 (sm_80) and
H100 (sm_90) — ``python -m llmlab.kernels.report`` shows each build. Without CUDA the
kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by ``import llmlab``):
same code, slow.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _attend_kv_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_step, v_step, offs_n, n_blocks,
                      k_stop, row_end, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold ``n_blocks`` key blocks into the online-softmax state (acc, l_i, m_i).

    k_ptrs [HEAD_DIM, BLOCK_N] and v_ptrs [BLOCK_N, HEAD_DIM] point at the first block and
    move on by k_step / v_step elements per block; offs_n [BLOCK_N] are its key indices.
    MASKED: keys at or past ``k_stop`` are not loaded, and query row r sees only keys
    before row_end[r]. Not MASKED: every key of every block is visible to every row, so
    the hot loop has no comparisons at all.
    """
    for _ in range(n_blocks):
        if MASKED:
            in_range = offs_n < k_stop
            k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale       # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            s = tl.where(offs_n[None, :] < row_end[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # row saw no key yet
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
            v = tl.load(v_ptrs)
        if UPCAST:
            v = v.to(tl.float32)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += k_step
        v_ptrs += v_step
        offs_n += BLOCK_N
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seq_q", "seq_k"])
def _flash_fwd_kernel(Q, K, V, O, CU_Q, CU_K, K_START, K_END,
                      stride_qb, stride_qh, stride_qr,
                      stride_kb, stride_kn, stride_kh,
                      stride_vb, stride_vn, stride_vh,
                      stride_ob, stride_oh, stride_or,
                      seq_q, seq_k, kv_heads, groups, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, VARLEN: tl.constexpr, HAS_K_RANGE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Program (start_m, b * kv_heads + kv_h). Q and O come packed, [batch, kv_heads,
    # seq_q * groups, head_dim] (varlen: [1, kv_heads, total_q * groups, head_dim]): row
    # r of (b, kv_h) is query position r // groups of head kv_h * groups + r % groups.
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    kv_h = bh % kv_heads
    # every offset that can pass 2^31 elements is computed in int64, once, here
    if VARLEN:
        q_first = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_first
        k_first = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_first
        q_base = (q_first * groups).to(tl.int64) * stride_qr + kv_h.to(tl.int64) * stride_qh
        o_base = (q_first * groups).to(tl.int64) * stride_or + kv_h.to(tl.int64) * stride_oh
        k_base = k_first.to(tl.int64) * stride_kn + kv_h.to(tl.int64) * stride_kh
        v_base = k_first.to(tl.int64) * stride_vn + kv_h.to(tl.int64) * stride_vh
    else:
        q_len = seq_q
        k_len = seq_k
        q_base = b.to(tl.int64) * stride_qb + kv_h.to(tl.int64) * stride_qh
        o_base = b.to(tl.int64) * stride_ob + kv_h.to(tl.int64) * stride_oh
        k_base = b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
        v_base = b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    if start_m * BLOCK_M >= q_len * groups:
        return                                        # a tile past this sequence's rows
    # causal alignment uses the full key length; a key range [k_begin, k_stop) per batch
    # row (left padding, finished rows) only hides keys
    causal_offset = k_len - q_len
    k_begin = 0
    k_stop = k_len
    if HAS_K_RANGE:
        k_begin = tl.load(K_START + b)
        k_stop = tl.minimum(k_len, tl.load(K_END + b))
    offs_r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < q_len * groups
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + q_base + offs_r[:, None] * stride_qr + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # The first n_full key blocks are visible to every row of the tile and run unmasked;
    # the rest, up to the last key the tile's last row sees, run masked.
    if CAUSAL:
        first_i = (start_m * BLOCK_M) // groups
        last_i = tl.minimum(((start_m + 1) * BLOCK_M - 1) // groups, q_len - 1)
        hi = tl.minimum(k_stop, last_i + 1 + causal_offset)
        all_see = tl.minimum(k_stop, first_i + 1 + causal_offset)
        row_end = tl.minimum(offs_r // groups + 1 + causal_offset, k_stop)   # [BLOCK_M]
    else:
        hi = k_stop
        all_see = k_stop
        row_end = tl.full([BLOCK_M], 0, tl.int32) + k_stop
    n_full = tl.maximum(all_see - k_begin, 0) // BLOCK_N
    n_all = (tl.maximum(hi - k_begin, 0) + BLOCK_N - 1) // BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = k_begin + tl.arange(0, BLOCK_N)
    k_ptrs = K + k_base + offs_n[None, :] * stride_kn + offs_d[:, None]     # [D, BLOCK_N]
    v_ptrs = V + v_base + offs_n[:, None] * stride_vn + offs_d[None, :]     # [BLOCK_N, D]
    acc, l_i, m_i = _attend_kv_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, BLOCK_N * stride_kn,
                                      BLOCK_N * stride_vn, offs_n, n_full, k_stop, row_end,
                                      qk_scale, BLOCK_N, False, DOT_PRECISION, UPCAST)
    offs_n = k_begin + n_full * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ptrs = K + k_base + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = V + v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    acc, l_i, m_i = _attend_kv_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, BLOCK_N * stride_kn,
                                      BLOCK_N * stride_vn, offs_n, n_all - n_full, k_stop,
                                      row_end, qk_scale, BLOCK_N, True, DOT_PRECISION, UPCAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)           # a row with no visible key -> zeros
    out = acc / l_safe[:, None]
    tl.store(O + o_base + offs_r[:, None] * stride_or + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])


# On a GPU the tile is autotuned once per (head_dim, masks, dtype) among the tiles below,
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU generation, head_dim and dot kind.
# Each builds with no register spills and fits the generation's shared memory (see
# llmlab.kernels.report, checked in tests/test_kernel_compile.py). sm_80 (A100) keeps
# K/V operands in registers (mma.sync), so its large tiles need more warps than sm_90's
# (H100, wgmma reads them from shared memory); 128 query rows on 4 warps at head_dim 128
# hold a 128-register accumulator per thread and always spill.
_TILES = {
    ("sm_80", 64, "half"): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                            (64, 32, 4, 4)],
    ("sm_80", 128, "half"): [(128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 4)],
    ("sm_80", 256, "half"): [(64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 1)],
    ("sm_90", 64, "half"): [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
                            (64, 64, 4, 3), (64, 32, 4, 4)],
    ("sm_90", 128, "half"): [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3),
                             (64, 32, 4, 4)],
    ("sm_90", 256, "half"): [(64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 1)],
    ("sm_80", 64, "fp32"): [(64, 32, 8, 2), (32, 32, 8, 2)],
    ("sm_80", 128, "fp32"): [(16, 16, 8, 2), (32, 16, 8, 2)],
    ("sm_80", 256, "fp32"): [(16, 16, 4, 2)],
    ("sm_90", 64, "fp32"): [(64, 32, 8, 2), (32, 32, 4, 2)],
    ("sm_90", 128, "fp32"): [(16, 16, 4, 2), (16, 16, 8, 2), (32, 16, 8, 2)],
    ("sm_90", 256, "fp32"): [(16, 16, 8, 2), (16, 16, 4, 2)],
}
ARCHS = ("sm_80", "sm_90")


def tile_configs(arch: str, head_dim: int, dtype: str) -> list[tuple[int, int, int, int]]:
    """The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may pick.

    ``arch`` "sm_80" or "sm_90" (other GPUs use the nearest older one); ``dtype``
    "fp16", "bf16" or "fp32"; head_dim 16..256 (up to 64 share the head_dim-64 tiles).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}; allowed: {list(ARCHS)}")
    if dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}; allowed: 'fp16', 'bf16', 'fp32'")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim={head_dim}; allowed: 16, 32, 64, 128, 256")
    return list(_TILES[(arch, max(head_dim, 64), "fp32" if dtype == "fp32" else "half")])


def _arch_of(device: torch.device) -> str:
    major, _ = torch.cuda.get_device_capability(device)
    return "sm_90" if major >= 9 else "sm_80"


def _prune_tiles(configs, named_args, **kwargs):
    """The autotuner's candidates for this launch: the tiles of :func:`tile_configs`."""
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(named_args["Q"].dtype, "fp32")
    wanted = tile_configs(_arch_of(named_args["Q"].device), kwargs["HEAD_DIM"], dtype)
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps,
                                   c.num_stages) in wanted]


_ALL_TILES = sorted({t for tiles in _TILES.values() for t in tiles})
_flash_fwd_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
             for bm, bn, w, s in _ALL_TILES],
    key=["HEAD_DIM", "CAUSAL", "VARLEN", "HAS_K_RANGE", "DOT_PRECISION", "UPCAST"],
    prune_configs_by={"early_config_prune": _prune_tiles},
)(_flash_fwd_kernel)

INTERPRETER_BLOCK = 64  # interpreter cost grows with program count, so fewer, larger tiles


def _interpreted() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m, block_n) -> None:
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"flash_attn got {q.device.type} tensors, but Triton is compiling for the "
                         "GPU here; move q/k/v to CUDA, or set TRITON_INTERPRET=1 before importing "
                         "llmlab to run the kernel in the interpreter")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"flash_attn takes float32, float16 or bfloat16 q/k/v of one dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim={d} is not supported; allowed: 16, 32, 64, 128, 256")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk is not None and (not isinstance(blk, int) or blk < 16 or blk & (blk - 1)):
            raise ValueError(f"{name}={blk!r} must be a power of two >= 16 (16, 32, 64, 128, ...)")
    if (block_m is None) != (block_n is None):
        raise ValueError("give both block_m and block_n, or neither (then they are chosen)")


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, seq, heads, d] -> the view [batch, kv_heads, seq, groups, d]."""
    b, s, h, d = t.shape
    return t.view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 1, 3, 4)


def _packed_rows(t: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
    """[batch, seq, heads, d] -> the view [batch, kv_heads, seq * groups, d] in the kernel's
    row order, or None where the strides do not allow one (groups > 1 and seq > 1)."""
    b, s, h, d = t.shape
    try:
        return _grouped(t, kv_heads).view(b, kv_heads, s * (h // kv_heads), d)
    except RuntimeError:
        return None


def _launch(q, k, v, cu_q, cu_k, key_start, key_end, k_strides, seq_q, seq_k, batch, max_seqlen_q,
            causal, varlen, softmax_scale, block_m, block_n, num_warps, num_stages):
    """q [B, seq, heads, d] (varlen: B = 1, seq = total_q) -> o, same shape, contiguous."""
    heads, kv_heads, d = q.shape[-2], k.shape[-2], q.shape[-1]
    groups = heads // kv_heads
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    packed_shape = (q.shape[0], kv_heads, q.shape[1] * groups, d)
    qp = _packed_rows(q, kv_heads)
    if qp is None:
        qp = _grouped(q, kv_heads).reshape(packed_shape)            # one copy in
    op = _packed_rows(o, kv_heads)
    o_is_view = op is not None
    if not o_is_view:
        op = torch.empty(packed_shape, dtype=q.dtype, device=q.device)   # one copy out, below
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rows = max_seqlen_q * groups  # tile rows per (sequence, KV head)
    dummy = o  # never read when the matching flag is off
    args = (qp, k, v, op, cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy,
            key_start if key_start is not None else dummy,
            key_end if key_end is not None else dummy,
            qp.stride(0), qp.stride(1), qp.stride(2), *k_strides,
            op.stride(0), op.stride(1), op.stride(2),
            seq_q, seq_k, kv_heads, groups, scale * LOG2E)
    # The interpreter multiplies bfloat16 tiles as their raw uint16 bits (Triton 3.x), so
    # there the tiles are upcast to float32 before tl.dot; compiled kernels never upcast.
    upcast = _interpreted() and q.dtype == torch.bfloat16
    flags = dict(HEAD_DIM=d, CAUSAL=bool(causal), VARLEN=varlen,
                 HAS_K_RANGE=key_start is not None, DOT_PRECISION=precision, UPCAST=upcast)
    if block_m is None and not _interpreted():
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), batch * kv_heads)  # noqa: E731
        _flash_fwd_tuned[grid](*args, **flags)
    else:
        if block_m is None:
            block_m = block_n = INTERPRETER_BLOCK
        grid = (triton.cdiv(rows, block_m), batch * kv_heads)
        extra = {}
        if num_warps is not None:
            extra["num_warps"] = num_warps
        if num_stages is not None:
            extra["num_stages"] = num_stages
        _flash_fwd_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, **flags, **extra)
    if not o_is_view:
        _grouped(o, kv_heads).copy_(op.view(*packed_shape[:2], -1, groups, d))
    return o


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None, key_start: torch.Tensor | None = None,
                    key_end: torch.Tensor | None = None, block_m: int | None = None,
                    block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Dense form. q [batch, seq_q, heads, head_dim]; k, v [batch, seq_k, kv_heads, head_dim];
    key_start, key_end int [batch]: row b sees only keys key_start[b] <= j < key_end[b]
    (left padding before, finished tokens after; both or neither; key_start >= 0)
    -> [batch, seq_q, heads, head_dim].

    ``block_m``/``block_n`` fix the tile (BLOCK_M query rows × BLOCK_N keys, powers of two
    >= 16); left as None they are autotuned on a GPU and set to 64 in the interpreter. A
    tile's BLOCK_M rows hold query positions × the query heads of one KV head (interleaved).
    """
    _check_inputs(q, k, v, block_m, block_n)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"expected q [b, sq, h, d] and k = v [b, sk, kv_h, d] with h % kv_h == 0; "
                         f"got q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch, seq_q, heads, d = q.shape
    seq_k = k.shape[1]
    if (key_start is None) != (key_end is None):
        raise ValueError("give both key_start and key_end, or neither")
    if key_start is not None:
        for name, t in (("key_start", key_start), ("key_end", key_end)):
            if t.shape != (batch,):
                raise ValueError(f"{name} must be [batch] = [{batch}]; got {tuple(t.shape)}")
        if batch and int(key_start.min()) < 0:
            raise ValueError(f"key_start={key_start.tolist()} has a negative entry; a key range "
                             "starts at key 0 or later")
        key_start = key_start.to(device=q.device, dtype=torch.int32).contiguous()
        key_end = key_end.to(device=q.device, dtype=torch.int32).contiguous()
    if seq_q == 0 or batch == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    return _launch(q, k, v, None, None, key_start, key_end, k_strides, seq_q, seq_k, batch, seq_q,
                   causal, False, softmax_scale, block_m, block_n, num_warps, num_stages)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           block_m: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None
                           ) -> torch.Tensor:
    """Packed form, as ``flash_attn_varlen_func``: q [total_q, heads, head_dim],
    k/v [total_k, kv_heads, head_dim], cu_seqlens_q/k int32 [batch + 1] (prefix sums of
    the lengths), max_seqlen_q/k the longest lengths (at least the real ones)
    -> [total_q, heads, head_dim].
    """
    _check_inputs(q, k, v, block_m, block_n)
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[-1] != k.shape[-1] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [total_q, h, d] and k = v [total_k, kv_h, d], h % kv_h == 0; "
                         f"got q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q ({cu_seqlens_q.numel()}) and cu_seqlens_k "
                         f"({cu_seqlens_k.numel()}) must both have batch + 1 >= 2 entries")
    if int(max_seqlen_q) < 0 or int(max_seqlen_k) < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} must be >= 0")
    # the grid covers max_seqlen_q rows per sequence: a smaller value would silently drop
    # the queries past it (one host read of the offsets, as the caller's checks do)
    longest_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if longest_q > int(max_seqlen_q):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is smaller than the longest query "
                         f"sequence in cu_seqlens_q ({longest_q})")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    batch = cu_q.numel() - 1
    if q.shape[0] == 0 or int(max_seqlen_q) == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    k_strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
    o = _launch(q[None], k, v, cu_q, cu_k, None, None, k_strides, int(max_seqlen_q),
                int(max_seqlen_k), batch, int(max_seqlen_q), causal, True, softmax_scale,
                block_m, block_n, num_warps, num_stages)
    return o[0]
