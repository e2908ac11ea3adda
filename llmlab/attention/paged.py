"""Attention over a paged KV cache: the ``paged`` (PyTorch) and ``paged_triton`` backends.

Both have the with-KV-cache form of FlashAttention's ``flash_attn_with_kvcache``::

    with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *,
                 softmax_scale=None, causal=True) -> out
      q             [batch, seq_q, heads, head_dim]        the new tokens' queries
      k_cache       [num_blocks, block_size, kv_heads, head_dim]   one layer's paged pool
      v_cache       [num_blocks, block_size, kv_heads, head_dim]
      cache_seqlens [batch] int32    tokens in the cache per sequence, new ones included
      block_table   [batch, max_blocks] int32    logical block -> physical block
      out           [batch, seq_q, heads, head_dim]

``causal`` is aligned bottom-right: query row i is the token at position
``cache_seqlens[b] - seq_q + i``. A decode step has ``seq_q == 1``; prefill on top of a
cached prefix has ``seq_q`` new tokens that see the prefix and, causally, each other.
With ragged new-token counts, left-pad the queries; rows that see no key output zeros.

Every layer of a step reads the pool with the same block tables and lengths, so a cache
builds them once per step with :func:`prepare_paged_batch`: a :class:`PagedBatch` holds
them validated on the host, as int32 tensors on the pool's device, with the longest
length as a Python int. :func:`attend_paged` passes that int on as ``max_seqlen_k=`` to
a backend that takes it, which then reads no length back from the device: on a GPU a
per-layer ``int(cache_seqlens.max())`` would stall the host once per layer.

Three backends have this form:

``paged``
    the reference: gathers K/V slot by slot through the block table into a dense
    tensor and runs the textbook formula in float32.
``paged_sdpa``
    the fast path on a CPU: copies whole blocks with one ``index_select`` per pool and
    runs torch's fused SDPA once (the serving engine's default without a GPU).
``paged_triton``
    a Triton kernel that reads the blocks in place (:mod:`llmlab.kernels.paged_attn`).

:func:`paged_attention_blocks` is that kernel's loop in PyTorch (decode only, not a
registered backend): one block per step with an online softmax.

Their dense ``forward`` raises a ValueError: they only make sense with a paged cache
(:class:`llmlab.cache.paged.PagedKVCache`, or the engine's packed
:class:`llmlab.cache.packed.PackedPagedCache`), which writes the new K/V into the pool
and then calls ``with_kvcache``. ``llmlab.attention.paged_backends()`` lists them.

Taught in notebook 04 (the serving engine of notebook 05 uses them too).
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import register
from .reference import group_queries, ungroup_queries


@dataclass(frozen=True)
class PagedBatch:
    """The block-table side of a with-KV-cache call, built once per step and read by
    every layer (see :func:`prepare_paged_batch`)."""

    cache_seqlens: torch.Tensor     # int32 [batch], contiguous, on the pool's device
    block_table: torch.Tensor       # int32 [batch, width], contiguous; -1 past a row's blocks
    max_seqlen_k: int               # max(cache_seqlens), on the host
    block_size: int

    @property
    def batch(self) -> int:
        return self.cache_seqlens.shape[0]


def prepare_paged_batch(seqlens: Sequence[int], tables: Sequence[Sequence[int]],
                        block_size: int, device: torch.device | str,
                        width: int | None = None) -> PagedBatch:
    """Check lengths against block tables on the host, then build the int32 tensors once.

    ``seqlens[b]``: tokens of sequence b in the cache (new ones included); ``tables[b]``:
    its physical block ids. Rows are cut or padded with -1 to ``width`` blocks (default:
    enough for the longest sequence). ValueError names a length that is negative or
    that its table (or the width) cannot hold.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    if len(seqlens) != len(tables):
        raise ValueError(f"{len(seqlens)} lengths but {len(tables)} block tables")
    longest = max(seqlens, default=0)
    if width is None:
        width = max(-(-longest // block_size), 1)
    for b, (n, table) in enumerate(zip(seqlens, tables)):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"cache_seqlens[{b}]={n!r} must be an int >= 0")
        held = min(len(table), width) * block_size
        if n > held:
            raise ValueError(f"cache_seqlens[{b}]={n} exceeds what its block table maps: "
                             f"{min(len(table), width)} blocks × {block_size} slots")
    rows = [list(t[:width]) + [-1] * (width - len(t)) for t in tables]
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
    return PagedBatch(torch.tensor(list(seqlens), dtype=torch.int32).to(device),
                      table.to(device), int(longest), block_size)


@functools.lru_cache(maxsize=None)
def takes_max_seqlen(fn: Callable) -> bool:
    """Whether the with-KV-cache function ``fn`` accepts ``max_seqlen_k=`` (the library's
    do; one written to FlashAttention's five arguments does not, and is called without)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "max_seqlen_k" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def attend_paged(with_kvcache: Callable, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: PagedBatch, *, causal: bool = True
                 ) -> torch.Tensor:
    """``with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=...)`` with the
    step's prepared tables, plus ``max_seqlen_k`` where the function takes it."""
    if takes_max_seqlen(with_kvcache):
        return with_kvcache(q, k_cache, v_cache, batch.cache_seqlens, batch.block_table,
                            causal=causal, max_seqlen_k=batch.max_seqlen_k)
    return with_kvcache(q, k_cache, v_cache, batch.cache_seqlens, batch.block_table,
                        causal=causal)


def read_lengths(cache_seqlens: torch.Tensor) -> tuple[int, int]:
    """(max, min) of ``cache_seqlens`` read back to the host: on a GPU this waits for the
    device, which is why a step's callers pass ``max_seqlen_k`` instead."""
    low, high = torch.aminmax(cache_seqlens)
    longest, shortest = torch.stack([high, low]).tolist()     # one read, not two
    return int(longest), int(shortest)


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor,
                     max_seqlen_k: int | None = None) -> int:
    """ValueError naming the bad shape or value; shapes as in the module docstring.

    Returns the longest ``cache_seqlens``. Given ``max_seqlen_k`` (a promise of the
    caller, e.g. a :class:`PagedBatch`'s, whose lengths were checked on the host), only
    shapes and that bound are checked: nothing is read back from the device.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, seq_q, heads, head_dim]; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, kv_heads, "
                         f"head_dim]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, _, heads, head_dim = q.shape
    _, block_size, kv_heads, kd = k_cache.shape
    if kd != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, the cache has {kd}")
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of kv heads {kv_heads}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [batch={batch}, max_blocks]; "
                         f"got {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table dtype {block_table.dtype}; allowed: torch.int32 (or int64)")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be [batch={batch}]; got {tuple(cache_seqlens.shape)}")
    capacity = block_table.shape[1] * block_size
    if max_seqlen_k is not None:
        if not isinstance(max_seqlen_k, int) or not 0 <= max_seqlen_k <= capacity:
            raise ValueError(f"max_seqlen_k={max_seqlen_k!r} must be an int in 0..{capacity} "
                             f"(the block table maps {block_table.shape[1]} blocks × "
                             f"{block_size} slots)")
        return max_seqlen_k
    if not batch:
        return 0
    longest, shortest = read_lengths(cache_seqlens)
    if longest > capacity:
        raise ValueError(f"cache_seqlens max {longest} exceeds what the block "
                         f"table maps: {block_table.shape[1]} blocks × {block_size} slots")
    if shortest < 0:
        raise ValueError(f"cache_seqlens must be >= 0; got {shortest}")
    return longest


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Copy the first ``length`` tokens of each sequence out of the pool.

    cache [num_blocks, block_size, kv_heads, head_dim] -> [batch, length, kv_heads, head_dim]
    (positions past a sequence's own length hold whatever its table points at; mask them).
    """
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    logical = (pos // block_size).clamp_max(block_table.shape[1] - 1)
    physical = block_table.long()[:, logical].clamp_min(0)           # [batch, length]
    slots = physical * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]


def paged_mask(cache_seqlens: torch.Tensor, seq_q: int, length: int,
               causal: bool = True) -> torch.Tensor:
    """Bool [batch, seq_q, length]: which of the first ``length`` keys each new query sees.

    Row b holds ``cache_seqlens[b]`` keys, the last ``seq_q`` of them the new tokens
    themselves; keys past the row's length are hidden, and with ``causal`` (bottom-right)
    so are keys after each query's own position.
    """
    lens = cache_seqlens.long()
    key_pos = torch.arange(length, device=lens.device)
    allowed = key_pos[None, None, :] < lens[:, None, None]
    if causal:
        q_pos = lens[:, None] - seq_q + torch.arange(seq_q, device=lens.device)  # [b, sq]
        allowed = allowed & (key_pos[None, None, :] <= q_pos[:, :, None])
    return allowed.expand(lens.shape[0], seq_q, length)


def _grouped_mask(allowed: torch.Tensor, group: int) -> torch.Tensor:
    """[b, seq_q, L] -> [b, 1, group * seq_q, L], matching :func:`group_queries`' rows."""
    batch, seq_q, length = allowed.shape
    if seq_q == 1:
        return allowed[:, None]            # one row per head in the group: broadcast
    return allowed[:, None, None].expand(batch, 1, group, seq_q, length) \
        .reshape(batch, 1, group * seq_q, length)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                              softmax_scale: float | None = None, causal: bool = True,
                              max_seqlen_k: int | None = None) -> torch.Tensor:
    """Gather K/V through the block table, then softmax(Q Kᵀ · scale + mask) V in float32.

    Shapes in the module docstring. The mask (:func:`paged_mask`) hides keys past each
    sequence's length and, with ``causal``, keys after each query's own position.
    ``max_seqlen_k``: the longest ``cache_seqlens`` if the caller knows it (else read).
    """
    longest = check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    length = max(longest, 1)
    k = gather_kv(k_cache, block_table, length).transpose(1, 2).float()   # [b, kv, L, d]
    v = gather_kv(v_cache, block_table, length).transpose(1, 2).float()
    qg = group_queries(q.float(), kv_heads)                                # [b, kv, g*sq, d]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale                # [b, kv, g*sq, L]
    allowed = paged_mask(cache_seqlens.to(q.device), seq_q, length, causal)
    scores = scores.masked_fill(~_grouped_mask(allowed, heads // kv_heads), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # rows with no key -> zeros
    return ungroup_queries(torch.matmul(probs, v), seq_q).to(q.dtype)


def paged_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                         softmax_scale: float | None = None, causal: bool = True,
                         max_seqlen_k: int | None = None) -> torch.Tensor:
    """Copy the needed blocks out of the pool whole, then one fused SDPA call.

    Shapes in the module docstring. Only the first ``ceil(max(cache_seqlens) /
    block_size)`` columns of ``block_table`` are read (entries past a row's own blocks
    may be anything, -1 included: their keys are masked). One ``index_select`` per pool
    copies ``blocks · block_size`` keys per row, contiguous blocks rather than slot by
    slot; grouped query heads become extra query rows (:func:`group_queries`), so no K/V
    is repeated per query head. Rows that see no key are zeros. ``max_seqlen_k``: the
    longest ``cache_seqlens`` if the caller knows it (else read from the tensor).
    """
    longest = check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    batch, seq_q, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = max(-(-longest // block_size), 1)
    table = block_table[:, :width].long().clamp_min(0).reshape(-1)
    length = width * block_size
    k = k_cache.index_select(0, table).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, table).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    allowed = paged_mask(cache_seqlens.to(q.device), seq_q, length, causal)
    out = F.scaled_dot_product_attention(group_queries(q, kv_heads), k, v,
                                         attn_mask=_grouped_mask(allowed, heads // kv_heads),
                                         scale=softmax_scale)
    return ungroup_queries(out, seq_q).nan_to_num(0.0)    # a row with no key: NaN -> zeros


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           max_seqlen_k: int | None = None) -> torch.Tensor:
    """The Triton kernel reading K/V in place through the block table (interpreted on CPU).

    One launch serves the whole batch, whatever its lengths: each program walks its own
    sequence's blocks only. Give int32 contiguous ``cache_seqlens`` and ``block_table``
    (a :class:`PagedBatch`'s) and ``max_seqlen_k``, and the call neither casts nor reads
    anything back from the device.
    """
    check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    from ..kernels.paged_attn import paged_attention

    return paged_attention(q, k_cache, v_cache, cache_seqlens, block_table,
                           softmax_scale=softmax_scale, causal=causal)


def paged_attention_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           max_seqlen_k: int | None = None) -> torch.Tensor:
    """Decode attention that walks each sequence's block table, one block per step, folding
    each block into a running (online) softmax: the loop ``paged_triton`` runs per
    sequence, written in PyTorch (notebook 04 times it per block size).

    Shapes in the module docstring, with ``seq_q == 1``; nothing is gathered: each step
    reads the filled slots of one block where it lies in the pool.
    """
    check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    batch, seq_q, heads, head_dim = q.shape
    if seq_q != 1:
        raise ValueError(f"paged_attention_blocks is decode attention: seq_q must be 1, got "
                         f"{seq_q}")
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        qb = q[b, 0].float().view(kv_heads, heads // kv_heads, head_dim) * scale
        m = torch.full(qb.shape[:2], float("-inf"), device=q.device)
        l = torch.zeros(qb.shape[:2], device=q.device)
        acc = torch.zeros_like(qb)
        for i, block in enumerate(block_table[b, :-(-n // block_size)].tolist()):
            filled = min(block_size, n - i * block_size)
            k = k_cache[block, :filled].float().transpose(0, 1)        # [kv_heads, filled, d]
            v = v_cache[block, :filled].float().transpose(0, 1)
            s = torch.matmul(qb, k.transpose(1, 2))                      # [kv_heads, group, filled]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            m = m_new
        if n:
            out[b] = (acc / l[..., None]).reshape(heads, head_dim)
    return out[:, None].to(q.dtype)


def _needs_paged_cache(name: str):
    def forward(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
        raise ValueError(f"attention backend {name!r} reads K/V through a block table and needs "
                         "a paged KV cache (llmlab.cache.paged.PagedKVCache, e.g. "
                         "llmlab.generate(..., kv_cache='paged')); for dense attention use "
                         "'naive' or 'sdpa'")
    forward.__name__ = f"{name}_forward"
    return forward


register("paged", _needs_paged_cache("paged"), with_kvcache=paged_attention_reference,
         description="PyTorch reference: gather K/V through the block table, then softmax(QKᵀ)V")
register("paged_sdpa", _needs_paged_cache("paged_sdpa"), with_kvcache=paged_attention_sdpa,
         description="copy whole blocks with one index_select, then one fused SDPA call")
register("paged_triton", _needs_paged_cache("paged_triton"), with_kvcache=paged_attention_triton,
         description="Triton kernel reading K/V blocks in place through the block table")

__all__ = ["paged_attention_reference", "paged_attention_sdpa", "paged_attention_triton",
           "paged_attention_blocks",
           "gather_kv", "paged_mask", "check_paged_args", "PagedBatch", "prepare_paged_batch",
           "attend_paged", "takes_max_seqlen", "read_lengths"]
