"""PagedAttention in Triton: attention whose K/V are read through a block table.

Computes, for every sequence b, query row i and query head h::

    out[b, i, h] = softmax(q[b, i, h] · K_bᵀ · scale + mask) · V_b

where K_b, V_b are the first ``cache_seqlens[b]`` tokens of sequence b, stored in
fixed-size blocks scattered over a paged pool. Used for decode (``seq_q == 1``: one new
token attends to the whole cache) and for prefill on top of a cached prefix
(``seq_q > 1``: the new tokens attend to the cached prefix and, causally, to themselves).

Layouts (last dimension contiguous):

    q            [batch, seq_q, heads, head_dim]
    k_cache      [num_blocks, block_size, kv_heads, head_dim]   (one layer's paged pool)
    v_cache      [num_blocks, block_size, kv_heads, head_dim]
    cache_seqlens [batch] int32   tokens of each sequence in the cache, new ones included
    block_table  [batch, max_blocks] int32   logical block j of sequence b -> physical id
    out          [batch, seq_q, heads, head_dim]

``causal`` aligns the query rows bottom-right: row i of sequence b is the token at
position ``cache_seqlens[b] - seq_q + i`` and sees keys at positions ``<= `` that. With
ragged new-token counts, left-pad the queries: pad rows get no keys and output zeros.

How: one program per (tile of BLOCK_M packed query rows, sequence, kv head). The rows of
a tile are (query position, query head) pairs of the *same* kv head, so with grouped-query
attention the group's heads share every K/V tile that is loaded (GQA packing). Keys are
visited BLOCK_N tokens at a time; each token's physical address is looked up in the block
table (``block_table[b, j // block_size] * block_size + j % block_size``), so one tile may
span several small blocks or part of a large one, and any block size that is a power of
two works. Softmax is online (running max and sum, as in FlashAttention), in float32.

Limits: head_dim a power of two >= 16; block_size a power of two (tested 8..128); q and
the pool of one dtype (float16/bfloat16 dots run on tensor cores, float32 in IEEE
precision); offsets into the pool in int64, so a pool may exceed 2^31 elements. This
kernel gives one program all of a sequence's keys, so a long context with few sequences
uses few programs; :func:`paged_attention_split` splits the keys too (flash-decoding:
partial outputs with their log-sum-exp, merged exactly by a second kernel). Taught in
notebook 04; the split in notebook 14.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attn_fwd(
    Q, K, V, O, BT, SEQLENS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_os, stride_oh,
    sm_scale, seq_q, num_kv_heads,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    ctx = tl.load(SEQLENS + b)
    # offsets into the pool reach past 2^31 elements on a large GPU: int64 from here on
    b64 = b.to(tl.int64)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh

    # packed rows: (query position, head within the kv head's group)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qpos = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = qpos < seq_q
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + qpos[:, None] * stride_qs + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if CAUSAL:
        row_end = ctx - seq_q + qpos + 1                       # keys [0, row_end) visible
        last_q = (tl.minimum((pid_m + 1) * BLOCK_M, seq_q * GROUP) - 1) // GROUP
        hi = tl.minimum(ctx - seq_q + last_q + 1, ctx)
    else:
        row_end = ctx + 0 * qpos
        hi = ctx

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < ctx
        blk = tl.load(BT + b64 * stride_btb + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
        blk = blk.to(tl.int64)
        tok = offs_n % BLOCK_SIZE
        k = tl.load(k_head + blk[:, None] * stride_kb + tok[:, None] * stride_kt
                    + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale      # [M, N]
        allowed = key_ok[None, :] & (offs_n[None, :] < row_end[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + blk[:, None] * stride_vb + tok[:, None] * stride_vt
                    + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]       # no visible key -> zeros
    tl.store(O + b64 * stride_ob + qpos[:, None] * stride_os + head[:, None] * stride_oh
             + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


BLOCK_M = 16   # packed query rows per tile: tl.dot's minimum; a decode step has `group` rows
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_tile(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the wrapper uses: 64 keys per step in float16/bfloat16; in float32,
    whose dots run without tensor cores and hold their operands in registers, 32 keys (16
    past head_dim 128), so that no build spills registers (``python -m
    llmlab.kernels.report --kernel paged`` shows each build)."""
    if dtype != torch.float32:
        return BLOCK_M, 64
    return BLOCK_M, (32 if head_dim <= 128 else 16)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def _check_launch(q, k_cache, v_cache, head_dim: int, block_size: int, block_m: int,
                  block_n: int) -> None:
    """ValueError for what the compiled kernels cannot do (the interpreter would forgive it)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Triton kernel")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype of float32, float16 or "
                         f"bfloat16; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not _power_of_two(blk) or blk < 16:
            raise ValueError(f"{name}={blk!r} must be a power of two >= 16 (16, 32, 64, ...)")
    if not _power_of_two(block_size):
        raise ValueError(f"KV block_size={block_size} must be a power of two (8, 16, 32, ...)")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"paged_attention got {q.device.type} tensors, but Triton is compiling "
                         "for the GPU here; move them to CUDA, or set TRITON_INTERPRET=1 before "
                         "importing llmlab to run the kernel in the interpreter")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_seqlens: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float | None = None, causal: bool = True,
                    block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of ``q`` over a paged K/V pool; shapes in the module docstring.

    Shapes and lengths are assumed validated by
    :func:`llmlab.attention.paged.check_paged_args`; this checks what the compiled kernel
    needs beyond them (the interpreter would forgive it): one dtype for q and the pool,
    tiles and KV block size that are powers of two (tiles >= 16, for ``tl.dot``).
    ``block_m``/``block_n`` default to :func:`default_tile`.
    """
    batch, seq_q, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    tile_m, tile_n = default_tile(q.dtype, head_dim)
    block_m = tile_m if block_m is None else block_m
    block_n = tile_n if block_n is None else block_n
    _check_launch(q, k_cache, v_cache, head_dim, block_size, block_m, block_n)
    q = q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seqlens = cache_seqlens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    grid = (triton.cdiv(seq_q * group, block_m), batch * kv_heads)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The interpreter multiplies bfloat16 tiles as their raw 16-bit patterns (Triton 3.x), so
    # there the tiles are upcast to float32 before tl.dot, as in flash_attn; never compiled.
    upcast = _interpreted() and q.dtype == torch.bfloat16
    _paged_attn_fwd[grid](
        q, k_cache, v_cache, out, block_table, seqlens,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        scale, seq_q, kv_heads,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), PRECISION=precision,
        UPCAST=upcast,
    )
    return out


# ---- split-KV decode (flash-decoding) -------------------------------------------------------
#
# With few sequences, the kernel above runs batch · kv_heads · ceil(seq_q·group / BLOCK_M)
# programs: SmolLM2 at batch 1 decodes with 3 programs on a chip of 132 SMs, each walking the
# whole context alone. Split-KV (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
# inference", 2023) also splits each sequence's keys into NUM_SPLITS contiguous ranges, one
# program each; every program writes its range's normalized partial output and the range's
# log-sum-exp, and a second kernel merges the partials exactly.


@triton.jit
def _paged_attn_split_fwd(
    Q, K, V, O_PART, LSE, BT, SEQLENS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    sm_scale, seq_q, num_kv_heads, num_heads, rows,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    ctx = tl.load(SEQLENS + b)
    b64 = b.to(tl.int64)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qpos = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = qpos < seq_q
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + qpos[:, None] * stride_qs + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # this split's keys: the sequence's key tiles dealt out in equal runs (split_bounds)
    tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, ctx)
    if CAUSAL:
        row_end = ctx - seq_q + qpos + 1                       # keys [0, row_end) visible
        last_q = (tl.minimum((pid_m + 1) * BLOCK_M, seq_q * GROUP) - 1) // GROUP
        hi = tl.minimum(hi, ctx - seq_q + last_q + 1)
    else:
        row_end = ctx + 0 * qpos

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        blk = tl.load(BT + b64 * stride_btb + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
        blk = blk.to(tl.int64)
        tok = offs_n % BLOCK_SIZE
        k = tl.load(k_head + blk[:, None] * stride_kb + tok[:, None] * stride_kt
                    + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale      # [M, N]
        allowed = key_ok[None, :] & (offs_n[None, :] < row_end[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + blk[:, None] * stride_vb + tok[:, None] * stride_vt
                    + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]                 # no key in range -> zeros
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    # partials are float32 [num_splits, rows, HEAD_DIM], rows = (b, query position, head)
    row = (b64 * seq_q + qpos) * num_heads + head
    where = split.to(tl.int64) * rows + row
    tl.store(O_PART + where[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(LSE + where, lse, mask=row_ok)


@triton.jit
def _lse_merge(O_PART, LSE, O, LSE_OUT, rows, num_splits,
               HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[r] = Σ_s exp(lse[s, r] − L[r]) · o[s, r], L[r] = log Σ_s exp(lse[s, r])."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for s in range(0, num_splits):
        where = s * rows + offs_r
        lse = tl.load(LSE + where, mask=r_ok, other=float("-inf"))
        o = tl.load(O_PART + where[:, None] * HEAD_DIM + offs_d[None, :], mask=r_ok[:, None],
                    other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no split saw a key yet
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(O + offs_r[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=r_ok[:, None])
    tl.store(LSE_OUT + offs_r, tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)),
                                        float("-inf")), mask=r_ok)


MERGE_ROWS = 16   # rows (query position × head) per merge program


def split_tile(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the split kernel: :func:`default_tile`'s, except float32 at
    head_dim 128, where the split's range bookkeeping tips the 32-key tile over 255
    registers (424 bytes of spill per thread on sm_90), so it takes 16 keys per step."""
    tile_m, tile_n = default_tile(dtype, head_dim)
    if dtype == torch.float32 and head_dim >= 128:
        tile_n = 16
    return tile_m, tile_n


def split_warps(dtype: torch.dtype, head_dim: int) -> int:
    """Warps per program of the split kernel: 4, or 8 for float32 at head_dim 256, whose
    16-key tile still needs 168 registers on 4 warps and spills 8 bytes on sm_90."""
    return 8 if dtype == torch.float32 and head_dim >= 256 else 4


def paged_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cache_seqlens: torch.Tensor, block_table: torch.Tensor,
                          num_splits: int, softmax_scale: float | None = None,
                          causal: bool = True, block_m: int | None = None,
                          block_n: int | None = None, return_partials: bool = False):
    """:func:`paged_attention` with each sequence's keys split into ``num_splits`` ranges.

    Launches ``_paged_attn_split_fwd`` on a grid of (query tiles, batch · kv_heads,
    num_splits): split s of sequence b covers its key tiles ``[s·t, (s+1)·t)`` of
    ``BLOCK_N`` keys, with ``t = ceil(ceil(len_b / BLOCK_N) / num_splits)`` (a split past
    the end gets no key; :func:`llmlab.attention.split_kv.split_bounds` is the same rule).
    Each writes float32 partials ``o_part [num_splits, batch·seq_q·heads, head_dim]``
    (normalized over the split's keys) and ``lse [num_splits, batch·seq_q·heads]`` (their
    natural log-sum-exp of scaled scores; -inf where a row saw no key). ``_lse_merge``
    combines them: weights ``exp(lse_s − L)``, ``L = log Σ_s exp(lse_s)``.

    ``block_m``/``block_n`` default to :func:`split_tile`. Returns ``out [batch, seq_q,
    heads, head_dim]`` in q's dtype, or with
    ``return_partials`` ``(out, lse [batch, seq_q, heads], o_part, lse_part)`` with the
    partials shaped ``[num_splits, batch, seq_q, heads, (head_dim)]``. Limits as
    :func:`paged_attention`'s; ``num_splits`` an int >= 1 (one is the unsplit kernel's
    arithmetic in two launches).
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1")
    batch, seq_q, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    tile_m, tile_n = split_tile(q.dtype, head_dim)
    block_m = tile_m if block_m is None else block_m
    block_n = tile_n if block_n is None else block_n
    _check_launch(q, k_cache, v_cache, head_dim, block_size, block_m, block_n)
    q = q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seqlens = cache_seqlens.to(torch.int32).contiguous()
    rows = batch * seq_q * heads
    o_part = torch.empty(num_splits, rows, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits, rows, dtype=torch.float32, device=q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = _interpreted() and q.dtype == torch.bfloat16
    grid = (triton.cdiv(seq_q * group, block_m), batch * kv_heads, num_splits)
    _paged_attn_split_fwd[grid](
        q, k_cache, v_cache, o_part, lse_part, block_table, seqlens,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        scale, seq_q, kv_heads, heads, rows,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), PRECISION=precision,
        UPCAST=upcast, num_warps=split_warps(q.dtype, head_dim),
    )
    out = torch.empty(rows, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    _lse_merge[(triton.cdiv(rows, MERGE_ROWS),)](o_part, lse_part, out, lse, rows, num_splits,
                                                 HEAD_DIM=head_dim, BLOCK_R=MERGE_ROWS)
    out = out.view(batch, seq_q, heads, head_dim)
    if not return_partials:
        return out
    return (out, lse.view(batch, seq_q, heads),
            o_part.view(num_splits, batch, seq_q, heads, head_dim),
            lse_part.view(num_splits, batch, seq_q, heads))
