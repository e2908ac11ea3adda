"""Attention backends behind one signature, chosen by name.

Every backend computes softmax(Q Kᵀ · scale + mask) V with FlashAttention's argument
names and shapes:

    backend(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None)
      q  [batch, seq_q, heads, head_dim]
      k  [batch, seq_k, kv_heads, head_dim]    (heads % kv_heads == 0: grouped-query)
      v  [batch, seq_k, kv_heads, head_dim]
      key_padding_mask  [batch, seq_k] bool, True where the key is a real token
      returns [batch, seq_q, heads, head_dim]

``causal`` is aligned bottom-right, as in FlashAttention 2.1+: query i of seq_q may see
key j when j <= i + (seq_k - seq_q), so a single decode query sees the whole cache.

Every backend also has a varlen form (packed sequences, ``cu_seqlens``; the serving
engine's prefill calls it), and the paged ones a with-KV-cache form (``cache_seqlens``,
``block_table``); see :func:`register` and :class:`Backend`.

>>> import llmlab.attention as A
>>> A.available()[:2]
['naive', 'sdpa']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .reference import (causal_mask, expand_kv, naive_attention, sdpa_attention,
                        varlen_by_sequence)


@dataclass(frozen=True)
class Backend:
    """One registered backend: its forms of the same computation (see :func:`register`)."""

    name: str
    forward: Callable  # the dense/padded form above
    description: str = ""
    varlen: Callable | None = None  # flash_attn_varlen_func-shaped (register fills one in)
    with_kvcache: Callable | None = None  # flash_attn_with_kvcache-shaped, if provided


_REGISTRY: dict[str, Backend] = {}


def register(name: str, forward: Callable, *, description: str = "",
             varlen: Callable | None = None, with_kvcache: Callable | None = None) -> Backend:
    """Add (or replace) the backend ``name``; every model layer can then use it by name.

    ``forward(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None)`` is the
    dense form (shapes in the module docstring); ``register("mine", my_attention)`` is
    enough for ``model.set_attention("mine")``, the KV caches and the serving engine.
    ``varlen`` is the packed form the engine's prefill calls; without one, ``forward``
    runs on one sequence at a time (:func:`~llmlab.attention.reference.varlen_by_sequence`).
    ``with_kvcache`` reads K/V through a block table (the paged backends of notebook 04).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name {name!r} must be a non-empty string")
    if not callable(forward):
        raise ValueError(f"forward for backend {name!r} must be callable; got "
                         f"{type(forward).__name__}")
    backend = Backend(name=name, forward=forward, description=description,
                      varlen=varlen if varlen is not None else varlen_by_sequence(forward),
                      with_kvcache=with_kvcache)
    _REGISTRY[name] = backend
    return backend


def unregister(name: str) -> bool:
    """Remove a backend added by :func:`register` (a checker's temporary one, say); returns
    whether it was there."""
    return _REGISTRY.pop(name, None) is not None


def available() -> list[str]:
    """Names of the registered backends, in registration order."""
    _load_optional()
    return list(_REGISTRY)


def get(name: str) -> Backend:
    """The backend called ``name``; ValueError listing the allowed names otherwise."""
    _load_optional()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {list(_REGISTRY)}")
    return _REGISTRY[name]


def paged_backends() -> list[str]:
    """Names of the backends that read K/V through a block table (a with-KV-cache form)."""
    _load_optional()
    return [name for name, b in _REGISTRY.items() if b.with_kvcache is not None]


register("naive", naive_attention,
         description="explicit QKᵀ, mask, softmax, ·V; materializes [batch, heads, N, N]")
register("sdpa", sdpa_attention,
         description="torch.nn.functional.scaled_dot_product_attention")

_OPTIONAL = ("llmlab.attention.flash", "llmlab.attention.paged", "llmlab.attention.split_kv")
_loaded = False


def _load_optional() -> None:
    """Import the backend modules added by later notebooks, if they are present."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for mod in _OPTIONAL:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


__all__ = ["Backend", "register", "unregister", "available", "get", "paged_backends", "naive_attention",
           "sdpa_attention", "causal_mask", "expand_kv", "varlen_by_sequence"]
