"""The serving engine's decode step in fixed shapes, so that ``LLM(..., compile=True)`` can
run it as one compiled graph (a CUDA graph on a GPU) per batch size.

A decode step of the engine (every scheduled sequence adds one token) reads the paged
pool through block tables whose widths change with the sequences' lengths, for a batch
whose size changes as requests come and go. A compiled graph is specialized to its shapes,
so :class:`GraphedPagedDecode` pads both to buckets, as vLLM does for its CUDA graphs:

* the batch to the next *capture size* (1, 2, 4, 8, ... up to ``max_num_seqs``): a padded
  row repeats the first sequence (same token, position, slot and blocks), so it writes
  the very K/V that row writes and its output is dropped;
* every block table to the same number of entries, enough blocks for the static cache's
  bucket of slots (a power of two, at least 256): entries past a sequence's end point at
  block 0 and are masked out by its length.

Per layer, :meth:`GraphedPagedDecode.attend` writes the new K/V into the pool at the slot
mapping (a scatter at a tensor of slots) and attends over the gathered blocks under the
mask ``slot < length``: the same arithmetic as the eager paged read, with no Python in
between. Only ``kv_cache_dtype="auto"`` pools are read this way (an int8 pool decodes
eagerly). Taught in notebook 11.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F

from .paged import PagedKVCache
from .static import slots_for


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch buckets: powers of two below ``max_num_seqs``, then ``max_num_seqs``."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive int")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest size in ``sizes`` (ascending) that holds ``n``."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} sequences exceed the largest capture size {sizes[-1]}")


class GraphedPagedDecode:
    """A decode-only step over a :class:`PagedKVCache` in fixed shapes (module docstring).

    ``prepare(seq_ids, tokens, batch)`` builds the step's tensors and returns
    ``(input_ids [batch, 1], positions [batch, 1])``; the model's layers then call
    :meth:`attend`. ``batch`` is a capture size at least ``len(seq_ids)``.
    """

    name = "graphed_paged"

    def __init__(self, paged: PagedKVCache):
        if paged.kv_dtype != "auto":
            raise ValueError(f"kv_dtype={paged.kv_dtype!r}: the graphed decode reads float "
                             "pools only; allowed: 'auto'")
        self.paged = paged
        self.slot_mapping: torch.Tensor | None = None    # long [batch]
        self.block_tables: torch.Tensor | None = None    # long [batch, blocks]
        self.lengths: torch.Tensor | None = None         # long [batch]: keys per row

    def table_width(self, longest: int) -> int:
        """Block-table entries per row for sequences of up to ``longest`` tokens: the static
        cache's bucket of slots (:func:`~llmlab.cache.static.slots_for`) in blocks."""
        bs = self.paged.block_size
        return -(-slots_for(max(longest, 1), self.paged.num_blocks * bs) // bs)

    def prepare(self, seq_ids: Sequence[Hashable], tokens: Sequence[int],
                positions: Sequence[int], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per sequence, at ``positions`` (its slot already reserved by the
        block manager). Returns input_ids and positions, long [batch, 1], on the pool's
        device."""
        n = len(seq_ids)
        if not 1 <= n <= batch or len(tokens) != n or len(positions) != n:
            raise ValueError(f"{n} sequences, {len(tokens)} tokens and {len(positions)} "
                             f"positions for a batch of {batch}; need 1 <= sequences == "
                             "tokens == positions <= batch")
        bm, bs = self.paged.manager, self.paged.block_size
        lengths = [p + 1 for p in positions]
        width = self.table_width(max(lengths))
        tables, slots = [], []
        for sid, pos in zip(seq_ids, positions):
            table = list(bm.block_table(sid))
            tables.append(table + [0] * (width - len(table)))
            slots.append(table[pos // bs] * bs + pos % bs)
        pad = batch - n                   # padded rows repeat row 0 (same writes, dropped)
        dev = self.paged.k[0].device

        def rows(values: list) -> torch.Tensor:
            return torch.tensor(values + values[:1] * pad, dtype=torch.long).to(dev)

        self.slot_mapping, self.block_tables, self.lengths = rows(slots), rows(tables), rows(lengths)
        return rows(list(tokens))[:, None], rows(list(positions))[:, None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend=None) -> torch.Tensor:
        """q [batch, 1, heads, head_dim]; k, v [batch, 1, kv_heads, head_dim] (rotated) ->
        [batch, 1, heads, head_dim]. ``backend`` is not used (a masked SDPA read)."""
        return graphed_paged_attend(self.paged.k[layer_idx], self.paged.v[layer_idx],
                                    self.slot_mapping, self.block_tables, self.lengths, q, k, v)


def graphed_paged_attend(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write one token's K/V per row into the pool, then attend over the row's blocks.

    k_pool, v_pool [num_blocks, block_size, kv_heads, head_dim] (written in place);
    slot_mapping [b] long; block_tables [b, blocks] long; lengths [b] long (keys per row,
    the new one included); q [b, 1, heads, head_dim]; k, v [b, 1, kv_heads, head_dim].
    """
    b, _, h, d = q.shape
    nb, bs, kv, _ = k_pool.shape
    k_pool.view(nb * bs, kv, d).index_copy_(0, slot_mapping, k[:, 0].to(k_pool.dtype))
    v_pool.view(nb * bs, kv, d).index_copy_(0, slot_mapping, v[:, 0].to(v_pool.dtype))
    keys = k_pool[block_tables].reshape(b, -1, kv, d).transpose(1, 2)     # [b, kv, slots, d]
    values = v_pool[block_tables].reshape(b, -1, kv, d).transpose(1, 2)
    slots = keys.shape[2]
    visible = torch.arange(slots, device=q.device)[None, :] < lengths[:, None]    # [b, slots]
    groups = h // kv
    qg = q.reshape(b, kv, groups, d)             # the heads sharing a KV head: query rows
    mask = visible[:, None, None, :]
    out = F.scaled_dot_product_attention(qg, keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=mask)
    return out.reshape(b, 1, h, d)


__all__ = ["GraphedPagedDecode", "graphed_paged_attend", "capture_sizes", "bucket"]
