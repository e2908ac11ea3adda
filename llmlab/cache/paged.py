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

Inside the forward every attention layer calls ``cache.attend(layer_idx, q, k, v, backend)``
(the interface every cache in :mod:`llmlab.cache` implements): the new K/V are written by
slot mapping (slot −1, a left pad, is skipped), then a paged attention backend
(``paged`` = PyTorch reference, ``paged_triton`` = the Triton kernel) reads the blocks
through the block table. :func:`generate_paged` is a small greedy/sampling loop on top;
the serving engine (notebook 05) schedules many requests over the same pieces.

Taught in notebook 04.
"""
from __future__ import annotations

import itertools
import time
from typing import Hashable, Sequence

import torch

from .. import attention as attn_backends
from ..device import sync
from .block_manager import BlockManager, NoFreeBlocksError

PAGED_BACKENDS = ("paged", "paged_triton")


class PagedKVCache:
    """Paged K/V storage for every layer plus the block manager that maps it.

    ``backend`` picks the attention: ``"paged"`` or ``"paged_triton"``; None uses the
    layer's backend when it is one of those, else ``"paged"``.
    """

    name = "paged"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", enable_prefix_caching: bool = True,
                 backend: str | None = None):
        for label, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                             ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r} must be a positive int")
        if backend is not None and backend not in PAGED_BACKENDS:
            raise ValueError(f"backend={backend!r}; allowed: {list(PAGED_BACKENDS)} or None")
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._ids = itertools.count()
        self._slot_mapping: torch.Tensor | None = None     # [batch, seq_q] long, -1 = skip
        self._block_table: torch.Tensor | None = None      # [batch, max_blocks] int32
        self._seqlens: torch.Tensor | None = None          # [batch] int32

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, **kw) -> "PagedKVCache":
        """A cache shaped for ``model`` (a CausalLM), on its device and in its dtype."""
        c = model.config
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                   dtype=model.dtype, device=model.device, **kw)

    # -- size ------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers."""
        t = self.k[0]
        return 2 * self.num_layers * t[0].numel() * t.element_size()

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
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    def prepare(self, seq_ids: Sequence[Hashable], num_new: Sequence[int]) -> torch.Tensor:
        """Set up the next forward for ``seq_ids``, each feeding its ``num_new`` newest tokens.

        The manager must already hold the slots (``allocate`` / ``append_slot``). Rows are
        left-padded to the longest ``num_new``; returns positions [batch, max_new] (long,
        0 on pads), and remembers the slot mapping (−1 on pads), the block tables and the
        sequence lengths for :meth:`attend`.
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
        table = torch.zeros((len(seq_ids), max(len(t) for t in tables)), dtype=torch.int32)
        for row, t in enumerate(tables):
            table[row, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self._slot_mapping = slots.to(dev)
        self._block_table = table.to(dev)
        self._seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        return positions.to(dev)

    # -- the interface every cache implements --------------------------------------------
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor, has_pads: bool = True) -> None:
        """Store k, v [n, kv_heads, head_dim] at flat slots [n] of layer ``layer_idx`` (−1
        skipped). ``has_pads=False`` promises no −1 (a packed step) and skips the filter."""
        if has_pads:
            keep = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        self.k[layer_idx].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        self.v[layer_idx].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

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
        name = self.backend
        if name is None:
            layer_name = getattr(backend, "name", None)
            name = layer_name if layer_name in PAGED_BACKENDS else "paged"
        fn = attn_backends.get(name).with_kvcache
        return fn(q, self.k[layer_idx], self.v[layer_idx], self._seqlens, self._block_table,
                  causal=True)


def blocks_needed(lengths: Sequence[int], block_size: int) -> int:
    """Blocks that sequences of these token counts occupy without sharing."""
    return sum(-(-n // block_size) for n in lengths)


@torch.inference_mode()
def generate_paged(model, tokenizer, prompts, max_new_tokens: int = 32, block_size: int = 16,
                   backend: str = "paged", num_blocks: int | None = None, chat: bool = True,
                   cache: PagedKVCache | None = None, enable_prefix_caching: bool = True,
                   temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | None = None,
                   ignore_eos: bool = False):
    """Generate with a paged KV cache: one batched prefill, then batched decode steps.

    ``prompts``: a string, a list of strings, or a list of token-id lists. ``backend``:
    ``"paged"`` (PyTorch reference) or ``"paged_triton"``. ``num_blocks`` defaults to
    exactly what the prompts and ``max_new_tokens`` need; pass ``cache`` to reuse one
    across calls (its prefix cache then serves repeated prompt prefixes — the number of
    cached tokens is in ``generation.num_cached_tokens``). Finished sequences leave the
    batch and free their blocks. Returns :class:`llmlab.generate.Generation` objects
    (one, or a list, like :func:`llmlab.generate`).

    This is a fixed batch, not a scheduler: when the pool is too small it raises
    :class:`NoFreeBlocksError` (the continuous-batching engine preempts instead).
    """
    from ..engine.sampler import sample
    from ..generate import Generation, prepare_prompts
    from ..profiling.metrics import RequestMetrics

    single = isinstance(prompts, str)
    if backend not in PAGED_BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {list(PAGED_BACKENDS)}")
    prompts, encoded = prepare_prompts(tokenizer, prompts, max_new_tokens, temperature, top_k,
                                       top_p, chat)
    cfg = model.config
    for ids in encoded:
        if not ids or len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"a prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} "
                             f"must fit the context of {cfg.max_position_embeddings} tokens")
    if cache is None:
        need = blocks_needed([len(ids) + max_new_tokens for ids in encoded], block_size)
        cache = PagedKVCache.for_model(model, num_blocks or need, block_size,
                                       enable_prefix_caching=enable_prefix_caching,
                                       backend=backend)
    bm = cache.manager
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None

    seq_ids = [cache.new_seq_id() for _ in encoded]
    sync(dev)
    t0 = time.perf_counter()
    cached = []
    try:
        for sid, ids in zip(seq_ids, encoded):
            cached.append(bm.allocate(sid, ids))
    except NoFreeBlocksError:
        for sid in seq_ids[:len(cached)]:
            bm.free(sid)
        raise
    # prefill: only the tokens not found in the prefix cache, left-padded
    new = [ids[c:] for ids, c in zip(encoded, cached)]
    positions = cache.prepare(seq_ids, [len(n) for n in new])
    width = positions.shape[1]
    input_ids = torch.full((len(new), width), pad, dtype=torch.long)
    for row, n in enumerate(new):
        input_ids[row, width - len(n):] = torch.tensor(n)
    logits = model(input_ids.to(dev), positions=positions, cache=cache, last_only=True)[:, -1]

    out_tokens: list[list[int]] = [[] for _ in encoded]
    times: list[list[float]] = [[] for _ in encoded]
    active = list(range(len(encoded)))
    try:
        while True:
            nxt = sample(logits, temperature, top_k, top_p, gen).tolist()   # syncs
            now = time.perf_counter() - t0
            still = []
            for row, tok in zip(active, nxt):
                out_tokens[row].append(tok)
                times[row].append(now)
                done = (tok == eos and not ignore_eos) or len(out_tokens[row]) >= max_new_tokens
                if done:
                    bm.free(seq_ids[row])
                else:
                    still.append(row)
            active = still
            if not active:
                break
            cows = []
            for row in active:
                _, cow = bm.append_slot(seq_ids[row], out_tokens[row][-1])
                if cow:
                    cows.append(cow)
            cache.copy_blocks(cows)
            positions = cache.prepare([seq_ids[r] for r in active], [1] * len(active))
            ids = torch.tensor([[out_tokens[r][-1]] for r in active], device=dev)
            logits = model(ids, positions=positions, cache=cache, last_only=True)[:, -1]
    finally:
        for row in active:
            if bm.has_seq(seq_ids[row]):
                bm.free(seq_ids[row])

    results = []
    for i, p in enumerate(prompts):
        toks = out_tokens[i]
        finished = toks[-1] == eos and not ignore_eos
        text = tokenizer.decode(toks[:-1] if finished else toks, skip_special_tokens=True)
        metrics = RequestMetrics(prompt_tokens=len(encoded[i]), output_tokens=len(toks),
                                 ttft_s=times[i][0], e2e_s=times[i][-1])
        g = Generation(p, text, toks, encoded[i], "stop" if finished else "length", metrics)
        g.num_cached_tokens = cached[i]
        g.token_times_s = times[i]
        results.append(g)
    return results[0] if single else results


__all__ = ["PagedKVCache", "generate_paged", "blocks_needed", "PAGED_BACKENDS"]
