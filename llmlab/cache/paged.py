"""The paged KV cache: K/V in a pool of fixed-size blocks, found through block tables.

Storage, per layer: ``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_size, kv_heads,
head_dim]``. A :class:`~llmlab.cache.block_manager.BlockManager` decides which physical
block holds which part of which sequence; a token at position ``pos`` of a sequence is
stored at slot ``table[pos // block_size] * block_size + pos % block_size`` of the
flattened pool (``[num_blocks * block_size, kv_heads, head_dim]``).

One step of the model with the cache::

    cached = cache.manager.allocate(seq_id, prompt_ids)    # prefill: reserve the prompt's slots
    slot, cow = cache.manager.append_slot(seq_id, token)   # decode: reserve one slot
    if cow: cache.copy_blocks([cow])                       # copy-on-write after a fork
    positions = cache.prepare(seq_ids, num_new)            # slots, block tables, lengths
    logits = model(ids, positions=positions, cache=cache, last_only=True)
    cache.manager.mark_computed(seq_id, n)                 # written: full blocks join the prefix cache

Inside the forward every attention layer calls ``cache.attend(layer_idx, q, k, v, backend)``
(the interface every cache in :mod:`llmlab.cache` implements): the new K/V are written by
slot mapping (slot −1, a left pad, is skipped), then a paged attention backend
(``paged`` = PyTorch reference, ``paged_sdpa`` = whole blocks + fused SDPA,
``paged_triton`` = the Triton kernel; :mod:`llmlab.attention.paged`) reads the blocks
through the block table. ``llmlab.generate(..., kv_cache="paged")`` runs a generation on
it; the serving engine (notebook 05) schedules many requests over the same pieces, in
the packed layout of :class:`llmlab.cache.packed.PackedPagedCache`.

Taught in notebook 04.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Hashable, Sequence

import torch

from .. import attention as attn_backends
from ..attention.paged import PagedBatch, attend_paged, prepare_paged_batch
from .block_manager import BlockManager
from .contiguous import check_kv_dtype, dequantize_kv, kv_storage, quantize_kv


class PagedKVCache:
    """Paged K/V storage for every layer plus the block manager that maps it.

    ``backend`` picks the attention that reads the pool, one of
    ``llmlab.attention.paged_backends()`` (``"paged"``, ``"paged_sdpa"``,
    ``"paged_triton"``); None uses the layer's backend when it is one of those, else
    ``"paged"``.

    ``kv_dtype="int8"`` stores K and V as int8 with one float32 scale per token and KV
    head (``k_scale[layer]``, ``v_scale[layer]``: ``[num_blocks, block_size, kv_heads]``;
    :func:`~llmlab.cache.contiguous.quantize_kv`). Attention then reads, per call, the
    blocks its block tables reference, dequantized to ``dtype`` into a compact pool
    (:meth:`pools`), so every backend, ``paged_triton`` included, sees float K/V. In the
    engine's packed steps, prompts without a cached prefix attend to their own new K/V
    before quantization; everything read back from the pool went through int8.

    ``prefix_cache``: ``"hash"``, ``"radix"`` or None (as :class:`BlockManager` takes it).

    ``allocator``: a class (or factory) called as ``allocator(num_blocks, block_size)``
    whose object replaces the block manager's pool, and ``append_slot`` the function that
    updates a block table for the next token (both as :class:`BlockManager` takes them).
    """

    name = "paged"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", enable_prefix_caching: bool = True,
                 backend: str | None = None, kv_dtype: str = "auto",
                 allocator: Callable | None = None, append_slot: Callable | None = None,
                 prefix_cache: str | Callable | None = "hash"):
        for label, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                             ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r} must be a positive int")
        if backend is not None and backend not in attn_backends.paged_backends():
            raise ValueError(f"backend={backend!r}; allowed: {attn_backends.paged_backends()} "
                             "or None")
        self.manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching,
            allocator=None if allocator is None else allocator(num_blocks, block_size),
            append_slot=append_slot, prefix_cache=prefix_cache)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend
        self.kv_dtype, self.dtype = check_kv_dtype(kv_dtype), dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k, self.v, self.k_scale, self.v_scale = kv_storage(num_layers, shape, dtype,
                                                                self.kv_dtype, device)
        self._ids = itertools.count()
        self._slot_mapping: torch.Tensor | None = None     # [batch, seq_q] long, -1 = skip
        self._tables: PagedBatch | None = None             # int32 block tables and lengths

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, **kw) -> "PagedKVCache":
        """A cache shaped for ``model`` (a CausalLM), on its device and in its dtype.

        It holds the KV heads this process computes: all of them, or a tensor-parallel
        rank's share.
        """
        c = model.config
        kv_heads = model.layers[0].self_attn.num_kv_heads
        return cls(c.num_layers, kv_heads, c.head_dim, num_blocks, block_size,
                   dtype=model.dtype, device=model.device, **kw)

    # -- size ------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers (int8: scales included)."""
        t = self.k[0]
        scale = 4 * t[0].numel() // self.head_dim if self.kv_dtype == "int8" else 0
        return 2 * self.num_layers * (t[0].numel() * t.element_size() + scale)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks currently referenced by some sequence."""
        return self.bytes_per_block * self.manager.num_used_blocks

    def new_seq_id(self) -> int:
        """A sequence id not used before in this cache."""
        return next(self._ids)

    # -- per-step bookkeeping ------------------------------------------------------------
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy block ``src`` to ``dst`` in every layer, for each (src, dst)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k[0].device)
        for pool in self.k + self.v + self.k_scale + self.v_scale:
            pool[dst] = pool[src]

    def prepare(self, seq_ids: Sequence[Hashable], num_new: Sequence[int]) -> torch.Tensor:
        """Set up the next forward for ``seq_ids``, each feeding its ``num_new`` newest tokens.

        The manager must already hold the slots (``allocate`` / ``append_slot``). Rows are
        left-padded to the longest ``num_new``; returns positions [batch, max_new] (long,
        0 on pads), and remembers the slot mapping (−1 on pads), the block tables and the
        sequence lengths for :meth:`attend`: built and checked here once, read by every
        layer (:class:`~llmlab.attention.paged.PagedBatch`).
        """
        if len(seq_ids) != len(num_new) or not seq_ids:
            raise ValueError(f"seq_ids ({len(seq_ids)}) and num_new ({len(num_new)}) must be "
                             "non-empty and of equal length")
        width = max(num_new)
        dev = self.k[0].device
        slots = torch.full((len(seq_ids), width), -1, dtype=torch.long)
        positions = torch.zeros((len(seq_ids), width), dtype=torch.long)
        tables, lens = [], []
        for row, (sid, n) in enumerate(zip(seq_ids, num_new)):
            total = self.manager.num_tokens(sid)
            if not 1 <= n <= total:
                raise ValueError(f"num_new={n} for sequence {sid!r} of {total} reserved tokens; "
                                 "allowed: 1..reserved")
            slots[row, width - n:] = torch.tensor(self.manager.slot_mapping(sid, total - n, total))
            positions[row, width - n:] = torch.arange(total - n, total)
            tables.append(self.manager.block_table(sid))
            lens.append(total)
        self._slot_mapping = slots.to(dev)
        self._tables = prepare_paged_batch(lens, tables, self.block_size, dev)
        return positions.to(dev)

    # -- the interface every cache implements --------------------------------------------
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor, has_pads: bool = True) -> None:
        """Store k, v [n, kv_heads, head_dim] at flat slots [n] of layer ``layer_idx`` (−1
        skipped). ``has_pads=False`` promises no −1 (a packed step) and skips the filter."""
        if has_pads:
            keep = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        kv = self.num_kv_heads
        for new, pool, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if self.kv_dtype == "int8":
                new, scale = quantize_kv(new)
                scales[layer_idx].view(-1, kv).index_copy_(0, slot_mapping, scale)
            pool[layer_idx].view(-1, kv, self.head_dim).index_copy_(0, slot_mapping, new)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend) -> torch.Tensor:
        """Write the new K/V by slot mapping, then attend through the block tables.

        q [batch, seq_q, heads, head_dim]; k, v [batch, seq_q, kv_heads, head_dim] (rotated)
        -> [batch, seq_q, heads, head_dim].
        """
        if self._slot_mapping is None:
            raise ValueError("call cache.prepare(seq_ids, num_new) before the forward")
        if tuple(q.shape[:2]) != tuple(self._slot_mapping.shape):
            raise ValueError(f"q has [batch, seq_q] = {tuple(q.shape[:2])} but prepare() set up "
                             f"{tuple(self._slot_mapping.shape)}")
        b, s = q.shape[:2]
        self.write(layer_idx, k.reshape(b * s, self.num_kv_heads, self.head_dim),
                   v.reshape(b * s, self.num_kv_heads, self.head_dim),
                   self._slot_mapping.reshape(-1))
        k_pool, v_pool, tables = self.pools(layer_idx, self._tables)
        return attend_paged(self.paged_attention(backend), q, k_pool, v_pool, tables, causal=True)

    def pools(self, layer_idx: int, tables: PagedBatch
              ) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """(k pool, v pool, tables) for attention over ``tables``: the stored pools, or for
        int8 the blocks the tables reference, dequantized into a compact pool (block i·width
        + j holds row i's j-th block) with the tables renumbered to match."""
        if self.kv_dtype != "int8":
            return self.k[layer_idx], self.v[layer_idx], tables
        table = tables.block_table
        used = table.clamp_min(0).long().reshape(-1)
        k = dequantize_kv(self.k[layer_idx][used], self.k_scale[layer_idx][used], self.dtype)
        v = dequantize_kv(self.v[layer_idx][used], self.v_scale[layer_idx][used], self.dtype)
        compact = torch.arange(used.numel(), dtype=table.dtype, device=table.device)
        compact = torch.where(table >= 0, compact.view_as(table), table)
        return k, v, dataclasses.replace(tables, block_table=compact)

    def paged_attention(self, layer_backend) -> Callable:
        """The with-KV-cache function that reads this pool: the cache's ``backend``, else
        the layer's backend when it is a paged one, else the ``paged`` reference."""
        if self.backend is not None:
            return attn_backends.get(self.backend).with_kvcache
        if getattr(layer_backend, "with_kvcache", None) is not None:
            return layer_backend.with_kvcache
        return attn_backends.get("paged").with_kvcache


def blocks_needed(lengths: Sequence[int], block_size: int) -> int:
    """Blocks that sequences of these token counts occupy without sharing."""
    return sum(-(-n // block_size) for n in lengths)


__all__ = ["PagedKVCache", "blocks_needed"]
