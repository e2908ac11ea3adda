"""KV caches, chosen by name: ``"none"`` (the baseline: recompute everything) or ``"contiguous"``.

Every cache implements one interface, which the attention layers call::

    cache.attend(layer_idx, q, k, v, backend) -> out
      q    [batch, seq_q, heads, head_dim]      queries of the new tokens (rotated)
      k, v [batch, seq_q, kv_heads, head_dim]   keys/values of the new tokens (rotated)
      out  [batch, seq_q, heads, head_dim]

plus its own per-step bookkeeping around the model's forward (for the contiguous cache:
``positions = cache.begin(num_new, mask)`` before, ``cache.advance()`` after). A cache is
built by a factory ``factory(model, batch, max_len)`` registered under its name, so
``llmlab.generate(..., kv_cache=name)`` can pick it. Taught in notebook 02 (contiguous)
and notebook 04 (paged).
"""
from __future__ import annotations

from typing import Callable

from .contiguous import ContiguousKVCache, kv_bytes_per_token, kv_cache_bytes

_FACTORIES: dict[str, Callable | None] = {"none": None, "contiguous": ContiguousKVCache.for_model}


def register(name: str, factory: Callable) -> None:
    """Make ``factory(model, batch, max_len)`` available as ``kv_cache=name``."""
    _FACTORIES[name] = factory


def available() -> list[str]:
    """Names accepted by ``kv_cache=`` (``"none"`` first: the no-cache baseline)."""
    return list(_FACTORIES)


def check_name(name: str) -> str:
    """``name`` if it is a known cache; ValueError listing the allowed names otherwise."""
    if not isinstance(name, str) or name not in _FACTORIES:
        raise ValueError(f"unknown kv_cache {name!r}; allowed: {available()}")
    return name


def create(name: str, model, batch: int, max_len: int):
    """A fresh cache called ``name`` for ``model`` (None for ``"none"``)."""
    factory = _FACTORIES[check_name(name)]
    return None if factory is None else factory(model, batch, max_len)


# Paged KV cache and its block manager (notebook 04).
from .block_manager import BlockManager, NoFreeBlocksError  # noqa: E402
from .paged import PagedKVCache, generate_paged  # noqa: E402

__all__ = ["ContiguousKVCache", "kv_bytes_per_token", "kv_cache_bytes", "register",
           "available", "check_name", "create", "BlockManager", "NoFreeBlocksError",
           "PagedKVCache", "generate_paged"]
