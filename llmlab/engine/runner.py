"""The model runner: executes one scheduled step over the paged KV cache.

Two input layouts, as the two scheduling policies need them:

* **packed** (continuous batching): every sequence's new tokens are concatenated into
  one row ``input_ids [1, total_tokens]``, with ``cu_seqlens`` (int32 ``[batch + 1]``)
  marking where each sequence starts, as in FlashAttention's varlen API. A prefill of
  300 tokens and twelve single-token decodes cost 312 token positions — no padding.
* **padded** (the static baseline): new tokens are left-padded into a rectangle
  ``[batch, max_new]``; pads cost compute but are never written to the cache (slot −1).

The packed layout needs an attention that knows where sequences start and which
cached tokens each one sees; :class:`PackedPagedAttention` is that cache object. It
implements the same ``attend(layer_idx, q, k, v, backend)`` interface as every cache in
:mod:`llmlab.cache`, storing K/V in a :class:`~llmlab.cache.paged.PagedKVCache`
(``[num_blocks, block_size, kv_heads, head_dim]`` per layer, written by slot mapping).
Per layer it attends, for each kind of row:

* a fresh prompt (no cached prefix): the layer's own backend (naive/sdpa/flash) on that
  sequence's rows, causal — nothing to read from the pool (short packs of several
  prompts take one SDPA call with a block-diagonal causal mask built from cu_seqlens);
* a prompt continuing a cached prefix (a prefix-cache hit, or the next chunk of a prompt
  under chunked prefill), and decode tokens: keys and values read from the
  pool through the block tables (``decode_attention``: ``"gather"`` copies the needed
  blocks with one ``index_select`` and runs SDPA with a length mask; ``"paged"`` and
  ``"paged_triton"`` are the paged backends of notebook 04). Decodes are sorted by
  length and attend in groups of up to eight, so short sequences are not padded to the
  longest one in the batch.

Taught in notebook 05.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import attention as attn_backends
from ..cache.paged import PAGED_BACKENDS, PagedKVCache
from ..generate import left_pad
from .scheduler import SchedulerOutput

DECODE_ATTENTION = ("gather",) + PAGED_BACKENDS


def gather_mask(seqlens: torch.Tensor, seq_q: int, length: int) -> torch.Tensor:
    """Bool [batch, 1, seq_q, length]: key j is visible to new query i of a row whose
    ``seqlens`` keys end with its ``seq_q`` new tokens (length mask + causal, bottom-right)."""
    dev = seqlens.device
    key_pos = torch.arange(length, device=dev)
    lens = seqlens.long()
    q_pos = lens[:, None] - seq_q + torch.arange(seq_q, device=dev)               # [b, sq]
    allowed = (key_pos[None, None, :] < lens[:, None, None]) \
        & (key_pos[None, None, :] <= q_pos[:, :, None])                           # [b, sq, L]
    return allowed[:, None]


def gather_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_table: torch.Tensor, seqlens: torch.Tensor,
                     softmax_scale: float | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of new queries over keys copied out of a paged pool, whole blocks at a time.

    q [batch, seq_q, heads, head_dim]; k_pool, v_pool [num_blocks, block_size, kv_heads,
    head_dim]; block_table [batch, n] long: the blocks of each row, cut to the longest row
    (entries past a row's length may be any valid block, they are masked); seqlens
    [batch]: keys per row, the new tokens included (the new tokens are the last
    ``seq_q`` positions, causal bottom-right). -> [batch, seq_q, heads, head_dim].

    One ``index_select`` per pool copies ``n · block_size`` keys per row (contiguous
    blocks, not slot by slot); then one SDPA call. Grouped-query heads are never
    expanded: the ``heads / kv_heads`` query heads that share a KV head are laid out as
    extra query rows of that head, so each key is read once per KV head. ``mask`` (from
    :func:`gather_mask` at length ``n · block_size``) may be passed in when many layers
    share it (bool, or additive 0 / -inf in q's dtype).
    """
    batch, seq_q, heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    length = block_table.shape[1] * block_size
    flat = block_table.reshape(-1)
    k = k_pool.index_select(0, flat).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v_pool.index_select(0, flat).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    if mask is None:
        mask = gather_mask(seqlens.to(q.device), seq_q, length)
    # [b, sq, kv, g, d] -> [b, kv, g * sq, d]: row r of KV head h is query head h·g + r // sq
    qg = q.view(batch, seq_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, kv_heads, group * seq_q, head_dim)
    if seq_q > 1 and group > 1:            # one mask row per (head in group, query)
        mask = mask[:, :, None].expand(batch, 1, group, seq_q, length)
        mask = mask.reshape(batch, 1, group * seq_q, length)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=softmax_scale)
    out = out.view(batch, kv_heads, group, seq_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, seq_q, heads, head_dim)


def block_diagonal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool [total, total] for packed sequences: each token sees its own sequence's
    earlier tokens (block-diagonal, causal inside each block)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(seg.numel(), device=cu_seqlens.device)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def block_diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens: torch.Tensor | None,
                             softmax_scale: float | None = None,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed sequences in one call, each seeing only itself.

    q [total, heads, head_dim]; k, v [total, kv_heads, head_dim]; cu_seqlens int32
    [batch + 1] (unused when ``mask`` is given) -> [total, heads, head_dim]. The mask
    (:func:`block_diagonal_mask`; pass it in when many layers share it) is [total, total],
    so use this for short packs; a varlen kernel never builds it.
    """
    heads = q.shape[1]
    if mask is None:
        mask = block_diagonal_mask(cu_seqlens.to(q.device))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask,
                                         scale=softmax_scale,
                                         enable_gqa=heads != k.shape[1])
    return out[0].transpose(0, 1)


@dataclass
class PoolGroup:
    """Sequences whose new tokens attend over the pool together (one gather + one SDPA)."""

    rows: torch.Tensor              # long [n * seq_q]: their new tokens' rows in the pack
    seq_q: int                      # new tokens per sequence (1 for decodes)
    block_table: torch.Tensor       # long [n, blocks]: cut to the group's longest sequence
    seqlens: torch.Tensor           # int32 [n]: cached + new tokens
    mask: torch.Tensor | None       # [n, 1, seq_q, blocks · block_size], 0 / -inf, for "gather"


@dataclass
class PackedBatch:
    """Metadata of one packed step (all tensors on the cache's device)."""

    cu_seqlens: torch.Tensor        # int32 [batch + 1]: row offsets into the packed tokens
    cu: list[int]                   # the same offsets on the host (read by every layer)
    num_new: list[int]              # new tokens per sequence
    seqlens: list[int]              # cached + new tokens per sequence
    slot_mapping: torch.Tensor      # long [total]: where each new token's K/V goes
    fresh: list[int]                # sequences with no cached prefix (prompt from scratch)
    continued: list[int]            # prompts on top of a cached prefix
    decode: list[int]               # one new token on top of the cache
    pool_groups: list[PoolGroup]    # continued prompts and decodes, grouped for the pool
    tables: list[list[int]]         # block table of each sequence
    # built by the first layer that needs them, then shared by the rest:
    fresh_groups: dict = field(default_factory=dict)   # fresh prompts read back (paged backends)
    fresh_pack: tuple | None = None  # (rows, mask) of the fresh prompts' block-diagonal call


class PackedPagedAttention:
    """A cache object for packed steps over a :class:`PagedKVCache` (see module docstring).

    ``prepare(seq_ids, num_new)`` before the forward returns positions [1, total];
    every attention layer then calls ``attend``.

    Decodes are sorted by length and cut into groups of at most ``decode_group``
    sequences, each padded only to its own longest: a 40-token and a 900-token sequence
    in one rectangle would copy and attend 860 masked keys for the short one.
    """

    def __init__(self, paged: PagedKVCache, decode_attention: str = "gather"):
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r}; allowed: "
                             f"{list(DECODE_ATTENTION)}")
        self.paged = paged
        self.decode_attention = decode_attention
        self.batch: PackedBatch | None = None
        # up to this many fresh prompt tokens go through one block-diagonal SDPA call
        # (one call instead of one per prompt); longer packs loop over the prompts
        self.pack_limit = 1024
        self.decode_group = 8

    def _group(self, members: list[int], tables: list[list[int]], lens: list[int],
               cu: list[int], seq_q: int, dev) -> PoolGroup:
        width = -(-max(lens[i] for i in members) // self.paged.block_size)
        table = torch.tensor([tables[i][:width] + [tables[i][0]] * (width - len(tables[i]))
                              for i in members], dtype=torch.long)
        seqlens = torch.tensor([lens[i] for i in members], dtype=torch.int32)
        rows = torch.tensor([r for i in members for r in range(cu[i + 1] - seq_q, cu[i + 1])],
                            dtype=torch.long)
        mask = None
        if self.decode_attention == "gather":       # additive: SDPA converts a bool one per call
            allowed = gather_mask(seqlens, seq_q, width * self.paged.block_size)
            mask = torch.zeros(allowed.shape, dtype=self.paged.k[0].dtype)
            mask = mask.masked_fill_(~allowed, float("-inf")).to(dev)
        return PoolGroup(rows.to(dev), seq_q, table.to(dev), seqlens.to(dev), mask)

    def prepare(self, seq_ids: list, num_new: list[int],
                num_computed: list[int] | None = None) -> torch.Tensor:
        """Set up one packed step; returns positions [1, total].

        Sequence i feeds ``num_new[i]`` tokens starting at position ``num_computed[i]``
        (default: its last ``num_new[i]`` reserved slots; a chunk of a longer prompt
        passes where the chunk starts).
        """
        bm = self.paged.manager
        dev = self.paged.k[0].device
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
            (fresh if start == 0 and n > 1 else decode if n == 1 else continued).append(i)
        cu = [0]
        for n in num_new:
            cu.append(cu[-1] + n)
        by_length = sorted(decode, key=lambda i: lens[i])
        groups = [self._group(by_length[j:j + self.decode_group], tables, lens, cu, 1, dev)
                  for j in range(0, len(by_length), self.decode_group)]
        groups += [self._group([i], tables, lens, cu, num_new[i], dev) for i in continued]
        self.batch = PackedBatch(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev), cu=cu,
            num_new=list(num_new),
            seqlens=lens,
            slot_mapping=torch.tensor(slot_map, dtype=torch.long, device=dev),
            fresh=fresh, continued=continued, decode=decode, pool_groups=groups,
            tables=tables)
        return torch.tensor(positions, dtype=torch.long, device=dev)[None]

    def _pool_attention(self, layer_idx: int, q: torch.Tensor, group: PoolGroup) -> torch.Tensor:
        """q [n, seq_q, heads, head_dim] of the group's sequences, over the pool."""
        k_pool, v_pool = self.paged.k[layer_idx], self.paged.v[layer_idx]
        if self.decode_attention == "gather":
            return gather_attention(q, k_pool, v_pool, group.block_table, group.seqlens,
                                    mask=group.mask)
        fn = attn_backends.get(self.decode_attention).with_kvcache
        return fn(q, k_pool, v_pool, group.seqlens, group.block_table, causal=True)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend) -> torch.Tensor:
        """q [1, total, heads, head_dim]; k, v [1, total, kv_heads, head_dim] -> [1, total, heads, head_dim]."""
        b = self.batch
        if b is None:
            raise ValueError("call prepare(seq_ids, num_new) before the forward")
        if q.shape[0] != 1 or q.shape[1] != b.slot_mapping.numel():
            raise ValueError(f"packed q must be [1, {b.slot_mapping.numel()}, heads, head_dim]; "
                             f"got {tuple(q.shape)}")
        q, k, v = q[0], k[0], v[0]
        self.paged.write(layer_idx, k, v, b.slot_mapping, has_pads=False)
        out = torch.empty_like(q)
        self._fresh_attention(layer_idx, q, k, v, backend, out)
        heads, head_dim = q.shape[1:]
        for g in b.pool_groups:
            qg = q.index_select(0, g.rows).view(-1, g.seq_q, heads, head_dim)
            out.index_copy_(0, g.rows, self._pool_attention(layer_idx, qg, g)
                            .reshape(-1, heads, head_dim))
        return out[None]

    def _fresh_attention(self, layer_idx, q, k, v, backend, out) -> None:
        """Prompts from scratch: their K/V are the new ones, no need to read the pool."""
        b = self.batch
        if not b.fresh:
            return
        cu = b.cu
        name = getattr(backend, "name", None)
        total = sum(cu[i + 1] - cu[i] for i in b.fresh)
        if name in ("naive", "sdpa") and len(b.fresh) > 1 and total <= self.pack_limit:
            if b.fresh_pack is None:
                idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in b.fresh]).to(q.device)
                lens = [0] + [cu[i + 1] - cu[i] for i in b.fresh]
                local = torch.tensor(lens, device=q.device).cumsum(0).to(torch.int32)
                b.fresh_pack = (idx, block_diagonal_mask(local))
            idx, mask = b.fresh_pack
            out[idx] = block_diagonal_attention(q[idx], k[idx], v[idx], None, mask=mask)
            return
        for i in b.fresh:
            s, e = cu[i], cu[i + 1]
            if name in PAGED_BACKENDS:
                if i not in b.fresh_groups:
                    b.fresh_groups[i] = self._group([i], b.tables, b.seqlens, cu,
                                                    e - s, q.device)
                out[s:e] = self._pool_attention(layer_idx, q[None, s:e], b.fresh_groups[i])[0]
            else:
                out[s:e] = backend.forward(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)[0]


class ModelRunner:
    """Runs a :class:`SchedulerOutput` through the model; returns last-token logits.

    ``paged`` holds the K/V pool and the block manager the scheduler allocates from.
    """

    def __init__(self, model, paged: PagedKVCache, decode_attention: str = "gather",
                 pad_token_id: int = 0):
        self.model = model
        self.paged = paged
        self.packed = PackedPagedAttention(paged, decode_attention)
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """-> logits [num_scheduled, vocab] for the last new token of each sequence."""
        self.paged.copy_blocks(step.block_copies)
        seqs = [s.seq for s in step.scheduled]
        num_new = [s.num_new for s in step.scheduled]
        starts = [s.num_computed for s in seqs]
        ids = [s.seq.all_token_ids[s.seq.num_computed:s.seq.num_computed + s.num_new]
               for s in step.scheduled]
        dev = self.model.device
        # a step of single-token decodes has nothing to pad: both layouts are the same,
        # so it takes the packed path (one attention implementation for both policies)
        if step.packed or all(n == 1 for n in num_new):
            positions = self.packed.prepare([s.seq_id for s in seqs], num_new, starts)
            flat = torch.tensor([t for row in ids for t in row], dtype=torch.long, device=dev)
            last = self.packed.batch.cu_seqlens[1:].long() - 1
            return self._forward_rows(flat[None], positions, self.packed, last)
        positions = self.paged.prepare([s.seq_id for s in seqs], num_new)
        input_ids, _ = left_pad(ids, self.pad_token_id, dev)
        return self.model(input_ids, positions=positions, cache=self.paged,
                          last_only=True)[:, -1]

    def _forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                      rows: torch.Tensor) -> torch.Tensor:
        """The decoder over a packed row, with logits only at ``rows`` (each sequence's
        last token) — the vocabulary projection is the most expensive matmul per token."""
        m = self.model
        top = int(positions.max())
        if top >= m.config.max_position_embeddings:
            raise ValueError(f"position {top} is past the model's context of "
                             f"{m.config.max_position_embeddings} tokens")
        x = m.embed_tokens(input_ids)
        for layer in m.layers:
            x = layer(x, positions, cache)
        return m.lm_head(m.norm(x[0, rows]))


def padding_tokens(lengths: list[int]) -> int:
    """Pads a left-padded rectangle of these rows holds: batch · max − sum."""
    return len(lengths) * max(lengths, default=0) - sum(lengths)


__all__ = ["ModelRunner", "PackedPagedAttention", "PackedBatch", "PoolGroup", "gather_attention", "gather_mask",
           "block_diagonal_attention", "block_diagonal_mask",
           "padding_tokens", "DECODE_ATTENTION"]
