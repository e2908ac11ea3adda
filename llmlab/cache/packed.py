"""The paged KV cache in the packed layout of continuous batching (taught in notebook 05).

The serving engine feeds every scheduled sequence's new tokens as one row,
``input_ids [1, total_tokens]``, with ``cu_seqlens`` (int32 ``[batch + 1]``) marking where
each sequence starts, as in FlashAttention's varlen API: a prompt of 300 tokens and
twelve single-token decodes cost 312 token positions, no padding. :class:`PackedPagedCache`
is the cache object for such a step. It stores K/V in a
:class:`~llmlab.cache.paged.PagedKVCache` and implements the same
``attend(layer_idx, q, k, v, backend)`` as every cache in :mod:`llmlab.cache`. Per layer:

* the new K/V of every token are written into the pool by slot mapping;
* prompts read from scratch (no cached prefix) attend to their own new K/V only: one
  call to the layer backend's **varlen** form over all of them (``cu_seqlens``), so
  the cost is the sum of each prompt's square, never the square of the whole pack;
* prompts continuing a cached prefix (a prefix-cache hit, or the next chunk under
  chunked prefill) and decode tokens read K/V from the pool through their block
  tables, with the cache's **paged attention** backend (``paged_sdpa``, ``paged`` or
  ``paged_triton``: :mod:`llmlab.attention.paged`). A kernel that reads blocks in place
  (``paged_triton``) serves every decode of the step in one call per layer; the backends
  that copy K/V out of the pool pad each row to the longest sequence of its call, so
  for them decodes are sorted by length and attend in groups of up to ``decode_group``.

Everything the layers share is built once per step by :meth:`PackedPagedCache.prepare`
and kept in a :class:`PackedStep`: offsets, slot mapping, and for each pool call its
int32 block tables and lengths (:class:`~llmlab.attention.paged.PagedBatch`, the longest
length as a Python int). Each layer's attention then only launches work: on a GPU it
reads nothing back to the host and casts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from ..attention.paged import PagedBatch, attend_paged, prepare_paged_batch
from .paged import PagedKVCache

# Paged backends that read K/V blocks in place: one call covers sequences of any lengths
# at no padding cost, so every decode of a step goes into a single call.
IN_PLACE_BACKENDS = ("paged_triton",)
GATHER_DECODE_GROUP = 8     # decodes per call for the backends that copy K/V out first


@dataclass
class PoolGroup:
    """Sequences whose new tokens attend over the pool together (one paged-attention call)."""

    rows: torch.Tensor              # long [n * seq_q]: their new tokens' rows in the pack
    seq_q: int                      # new tokens per sequence (1 for decodes)
    tables: PagedBatch              # int32 block tables cut to the longest, int32 lengths
    whole: bool = False             # its rows are the whole pack, in order (e.g. a step of
                                    # decodes only): q is used as it is, no gather or scatter


@dataclass
class PackedStep:
    """Metadata of one packed step, built once by :meth:`PackedPagedCache.prepare` and read
    by every layer (tensors on the cache's device)."""

    cu_seqlens: torch.Tensor        # int32 [batch + 1]: row offsets into the packed tokens
    cu: list[int]                   # the same offsets on the host
    num_new: list[int]              # new tokens per sequence
    seqlens: list[int]              # cached + new tokens per sequence
    slot_mapping: torch.Tensor      # long [total]: where each new token's K/V goes
    last_rows: torch.Tensor         # long [batch]: each sequence's last new token in the pack
    max_position: int               # the highest position fed this step
    tables: list[list[int]]         # block table of each sequence
    fresh: list[int]                # sequences reading a prompt from scratch (no cached prefix)
    continued: list[int]            # prompts on top of a cached prefix
    decode: list[int]               # one new token on top of the cache
    fresh_rows: torch.Tensor        # long [fresh tokens]: the fresh prompts' rows in the pack
    fresh_cu: torch.Tensor          # int32 [len(fresh) + 1]: their offsets among fresh_rows
    fresh_max: int                  # the longest fresh prompt (varlen's max_seqlen)
    pool_groups: list[PoolGroup]    # continued prompts and decodes, grouped for the pool
    # when the layer backend is itself a paged one, fresh prompts read the pool too
    # (built by the first layer that needs them, shared by the rest)
    fresh_groups: list[PoolGroup] | None = field(default=None)


class PackedPagedCache:
    """A cache object for packed steps over a :class:`PagedKVCache` (see the module docstring).

    ``prepare(seq_ids, num_new, num_computed)`` before the forward returns positions
    [1, total]; every attention layer then calls :meth:`attend`. The pool is read with
    the paged cache's backend (:meth:`PagedKVCache.paged_attention`).
    ``decode_group``: decodes per pool call; None (the default) puts all of a step's
    decodes into one call when the pool's backend reads blocks in place
    (``IN_PLACE_BACKENDS``), else groups of ``GATHER_DECODE_GROUP`` sorted by length.
    """

    def __init__(self, paged: PagedKVCache, decode_group: int | None = None):
        if decode_group is not None and (not isinstance(decode_group, int) or decode_group < 1):
            raise ValueError(f"decode_group={decode_group!r} must be a positive int or None")
        self.paged = paged
        self.decode_group = decode_group
        self.step: PackedStep | None = None

    def decodes_per_call(self, num_decodes: int) -> int:
        """How many decodes share one pool call in a step with ``num_decodes`` of them."""
        if self.decode_group is not None:
            return self.decode_group
        if self.paged.backend in IN_PLACE_BACKENDS:
            return max(num_decodes, 1)
        return GATHER_DECODE_GROUP

    def _group(self, members: list[int], step_tables: list[list[int]], lens: list[int],
               cu: list[int], seq_q: int, dev) -> PoolGroup:
        rows = [r for i in members for r in range(cu[i + 1] - seq_q, cu[i + 1])]
        tables = prepare_paged_batch([lens[i] for i in members],
                                     [step_tables[i] for i in members],
                                     self.paged.block_size, dev)
        return PoolGroup(torch.tensor(rows, dtype=torch.long).to(dev), seq_q, tables,
                         whole=rows == list(range(cu[-1])))

    def prepare(self, seq_ids: Sequence[Hashable], num_new: Sequence[int],
                num_computed: Sequence[int] | None = None) -> torch.Tensor:
        """Set up one packed step; returns positions [1, total].

        Sequence i feeds ``num_new[i]`` tokens starting at position ``num_computed[i]``
        (default: its last ``num_new[i]`` reserved slots; a chunk of a longer prompt
        passes where the chunk starts). The block manager must hold the slots already.
        """
        bm = self.paged.manager
        dev = self.paged.k[0].device
        if len(seq_ids) != len(num_new) or not seq_ids:
            raise ValueError(f"seq_ids ({len(seq_ids)}) and num_new ({len(num_new)}) must be "
                             "non-empty and of equal length")
        tables, lens, slot_map, positions = [], [], [], []
        fresh, continued, decode = [], [], []
        for i, (sid, n) in enumerate(zip(seq_ids, num_new)):
            total = bm.num_tokens(sid)
            start = total - n if num_computed is None else num_computed[i]
            if not (n >= 1 and 0 <= start and start + n <= total):
                raise ValueError(f"num_new={n} from position {start} for sequence {sid!r} of "
                                 f"{total} reserved tokens; allowed: n >= 1 within 0..{total}")
            tables.append(bm.block_table(sid))
            lens.append(start + n)
            slot_map += bm.slot_mapping(sid, start, start + n)
            positions += range(start, start + n)
            # a one-token prompt reads its own K/V back from the pool, like a decode
            (fresh if start == 0 and n > 1 else decode if n == 1 else continued).append(i)
        cu = [0]
        for n in num_new:
            cu.append(cu[-1] + n)
        per_call = self.decodes_per_call(len(decode))
        # split into several calls: by length, so that each call pads little
        order = decode if per_call >= len(decode) else sorted(decode, key=lambda i: lens[i])
        groups = [self._group(order[j:j + per_call], tables, lens, cu, 1, dev)
                  for j in range(0, len(order), per_call)]
        groups += [self._group([i], tables, lens, cu, num_new[i], dev) for i in continued]
        fresh_cu = [0]
        for i in fresh:
            fresh_cu.append(fresh_cu[-1] + num_new[i])
        fresh_rows = [r for i in fresh for r in range(cu[i], cu[i + 1])]
        self.step = PackedStep(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(dev), cu=cu,
            num_new=list(num_new), seqlens=lens,
            slot_mapping=torch.tensor(slot_map, dtype=torch.long).to(dev),
            last_rows=torch.tensor(cu[1:], dtype=torch.long).sub_(1).to(dev),
            max_position=max(lens) - 1, tables=tables,
            fresh=fresh, continued=continued, decode=decode,
            fresh_rows=torch.tensor(fresh_rows, dtype=torch.long).to(dev),
            fresh_cu=torch.tensor(fresh_cu, dtype=torch.int32).to(dev),
            fresh_max=max((num_new[i] for i in fresh), default=0), pool_groups=groups)
        return torch.tensor(positions, dtype=torch.long).to(dev)[None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend) -> torch.Tensor:
        """q [1, total, heads, head_dim]; k, v [1, total, kv_heads, head_dim] (rotated)
        -> [1, total, heads, head_dim]."""
        st = self.step
        if st is None:
            raise ValueError("call prepare(seq_ids, num_new) before the forward")
        if q.shape[0] != 1 or q.shape[1] != st.slot_mapping.numel():
            raise ValueError(f"packed q must be [1, {st.slot_mapping.numel()}, heads, head_dim]; "
                             f"got {tuple(q.shape)}")
        q, k, v = q[0], k[0], v[0]
        self.paged.write(layer_idx, k, v, st.slot_mapping, has_pads=False)
        out = torch.empty_like(q)
        groups = st.pool_groups
        if st.fresh and backend.with_kvcache is not None:
            groups = groups + self._fresh_groups(q.device)
        elif st.fresh:
            rows, cu, longest = st.fresh_rows, st.fresh_cu, st.fresh_max
            fresh_out = backend.varlen(q.index_select(0, rows), k.index_select(0, rows),
                                       v.index_select(0, rows), cu, cu, longest, longest,
                                       causal=True)
            out.index_copy_(0, rows, fresh_out)
        attention = self.paged.paged_attention(backend)
        heads, head_dim = q.shape[1:]
        for g in groups:
            k_pool, v_pool, tables = self.paged.pools(layer_idx, g.tables)
            if g.whole:
                got = attend_paged(attention, q.reshape(-1, g.seq_q, heads, head_dim), k_pool,
                                   v_pool, tables, causal=True)
                return got.reshape(1, -1, heads, head_dim)
            qg = q.index_select(0, g.rows).view(-1, g.seq_q, heads, head_dim)
            got = attend_paged(attention, qg, k_pool, v_pool, tables, causal=True)
            out.index_copy_(0, g.rows, got.reshape(-1, heads, head_dim))
        return out[None]

    def _fresh_groups(self, dev) -> list[PoolGroup]:
        """Fresh prompts as pool groups of their own (for a layer backend that is a paged one)."""
        st = self.step
        if st.fresh_groups is None:
            st.fresh_groups = [self._group([i], st.tables, st.seqlens, st.cu,
                                           st.cu[i + 1] - st.cu[i], dev) for i in st.fresh]
        return st.fresh_groups


__all__ = ["PackedPagedCache", "PackedStep", "PoolGroup", "IN_PLACE_BACKENDS",
           "GATHER_DECODE_GROUP"]
