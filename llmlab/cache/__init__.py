"""KV caches, chosen by name: ``"none"`` (the baseline: recompute everything), ``"contiguous"``,
``"paged"`` or ``"static"`` (fixed shapes, for a compiled decode step).

Every cache implements one interface, which the attention layers call::

    cache.attend(layer_idx, q, k, v, backend) -> out
      q    [batch, seq_q, heads, head_dim]      queries of the new tokens (rotated)
      k, v [batch, seq_q, kv_heads, head_dim]   keys/values of the new tokens (rotated)
      out  [batch, seq_q, heads, head_dim]

plus its own per-step bookkeeping around the model's forward (for the contiguous cache:
``positions = cache.begin(num_new, mask)`` before, ``cache.advance()`` after; for the
paged one, blocks from its block manager and ``positions = cache.prepare(seq_ids,
num_new)``). A cache is built by a factory ``factory(model, batch, max_len, **options)``
registered under its name, so ``llmlab.generate(..., kv_cache=name)`` can pick it.
Taught in notebook 02 (contiguous), notebook 04 (paged) and notebook 05 (the serving
engine's packed layout, :class:`PackedPagedCache`).

This package depends only on :mod:`llmlab.attention` (and the model's config): the
generation loops that drive the caches live in :mod:`llmlab.generate` and
:mod:`llmlab.engine`.
"""
from __future__ import annotations

from typing import Callable

from .block_manager import BlockManager, NoFreeBlocksError
from .contiguous import ContiguousKVCache, kv_bytes_per_token, kv_cache_bytes
from .packed import PackedPagedCache
from .paged import PagedKVCache, blocks_needed
from .static import StaticKVCache, slots_for


def _paged_for_model(model, batch: int, max_len: int, block_size: int = 16,
                     num_blocks: int | None = None, **kw) -> PagedKVCache:
    """A paged cache with room for ``batch`` sequences of ``max_len`` tokens (or ``num_blocks``)."""
    if num_blocks is None:
        num_blocks = blocks_needed([max_len] * batch, block_size)
    return PagedKVCache.for_model(model, num_blocks, block_size, **kw)


def _contiguous_for_model(model, batch: int, max_len: int, **kw) -> ContiguousKVCache:
    return ContiguousKVCache.for_model(model, batch, max_len, **kw)


def _static_for_model(model, batch: int, max_len: int, kv_dtype: str = "auto") -> StaticKVCache:
    if kv_dtype != "auto":
        raise ValueError(f"kv_dtype={kv_dtype!r}: the static cache keeps K/V in the model's "
                         "dtype; allowed: 'auto'")
    return StaticKVCache.for_model(model, batch, slots_for(max_len, model.config.max_position_embeddings))


_FACTORIES: dict[str, Callable | None] = {"none": None, "contiguous": _contiguous_for_model,
                                          "paged": _paged_for_model, "static": _static_for_model}


def register(name: str, factory: Callable) -> None:
    """Make ``factory(model, batch, max_len, **options)`` available as ``kv_cache=name``."""
    _FACTORIES[name] = factory


def unregister(name: str) -> bool:
    """Remove a cache added by :func:`register`; returns whether it was there."""
    return _FACTORIES.pop(name, None) is not None


def available() -> list[str]:
    """Names accepted by ``kv_cache=`` (``"none"`` first: the no-cache baseline)."""
    return list(_FACTORIES)


def check_name(name: str) -> str:
    """``name`` if it is a known cache; ValueError listing the allowed names otherwise."""
    if not isinstance(name, str) or name not in _FACTORIES:
        raise ValueError(f"unknown kv_cache {name!r}; allowed: {available()}")
    return name


def create(name: str, model, batch: int, max_len: int, **options):
    """A fresh cache called ``name`` for ``model`` with room for ``batch`` sequences of
    ``max_len`` slots (None for ``"none"``); ``options`` go to the factory (for
    ``"paged"``: ``block_size``, ``num_blocks``, ``backend``, ``enable_prefix_caching``)."""
    factory = _FACTORIES[check_name(name)]
    return None if factory is None else factory(model, batch, max_len, **options)


__all__ = ["ContiguousKVCache", "kv_bytes_per_token", "kv_cache_bytes", "register", "unregister",
           "available", "check_name", "create", "BlockManager", "NoFreeBlocksError",
           "PagedKVCache", "PackedPagedCache", "blocks_needed", "StaticKVCache"]
