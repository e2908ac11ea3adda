"""The static KV cache: every shape fixed, so one compiled decode step serves every position.

The contiguous cache (notebook 02) reads ``k[:, :, :length]``: a tensor whose shape grows
by one each step. A compiler that specializes on shapes (``torch.compile``, a CUDA graph)
would then see a new program at every position. Here nothing the step touches changes
shape with the position, as in gpt-fast's ``KVCache``:

* per layer ``k[layer]``, ``v[layer]`` are ``[batch, kv_heads, max_len + 1, head_dim]``;
  row ``b``'s token at position ``p`` lives in slot ``p`` (no left padding inside the
  cache); the extra last slot is a bin where padding tokens write, never read;
* the write is a scatter at a *tensor* of slots (``index_copy_`` along the slot axis),
  not a Python slice, so the position is data, not part of the program;
* attention reads all ``max_len`` slots under a mask ``slot <= position of the query``,
  built from the positions tensor: slots not written yet are masked out.

The price is that a decode step attends over ``max_len`` slots whatever the length (the
masked ones cost compute but change nothing), which is why ``max_len`` is sized to the
generation at hand, rounded up to a power of two (:func:`slots_for`) so that generations
of similar lengths share a compiled graph. On the CPU in float32, :meth:`StaticKVCache.attend`
calls ``llmlab::static_attend`` instead (``kernels/cpu_gemv_ops.cpp``, where a C++ compiler
builds it): the same write and read as one operator, which writes in place (a compiled
graph would otherwise copy each layer's cache) and reads only the slots a query sees; the
shapes stay fixed, so the graph does too. Taught in notebook 11.

Protocol (the contiguous cache's, so :class:`llmlab.generate.ContiguousBatch` drives it)::

    positions = cache.begin(num_new, attention_mask)   # host bookkeeping, before the step
    logits = model(ids, positions=positions, cache=cache, last_only=True)
    cache.advance()

Inside the step the cache uses only tensors: ``cache.slots`` [batch, num_new], where each
new token writes (its position; the bin for padding) and up to which it reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_gemv
from .contiguous import check_sizes


MIN_SLOTS = 256


def slots_for(length: int, context: int) -> int:
    """The static cache's ``max_len`` for sequences of up to ``length`` tokens: the next
    power of two, at least :data:`MIN_SLOTS`, at most the model's ``context``. Buckets
    keep the number of compiled graphs small (one per batch size and bucket) while a
    step attends over at most twice the slots it needs."""
    if not isinstance(length, int) or not 1 <= length <= context:
        raise ValueError(f"length={length!r} must be an int in 1..{context} (the context)")
    return min(context, max(MIN_SLOTS, 1 << (length - 1).bit_length()))


class StaticKVCache:
    """Preallocated K/V with fixed shapes ``[batch, kv_heads, max_len + 1, head_dim]``.

    ``lengths`` (host ints) counts each row's real tokens; ``begin`` turns a step's
    attention mask into positions and slots, ``attend`` (inside the forward) writes the
    new K/V at those slots and attends under the position mask, ``advance`` commits.
    K/V are kept in the model's dtype (no int8 variant).
    """

    name = "static"

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        check_sizes(num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, max_len=max_len)
        self.num_layers, self.batch, self.max_len = num_layers, batch, max_len
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (batch, num_kv_heads, max_len + 1, head_dim)          # + the bin slot
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slot_ids = torch.arange(max_len + 1, device=device)      # [max_len + 1]
        self.lengths = [0] * batch
        self.slots: torch.Tensor | None = None      # [batch, num_new] of the pending step
        self._pending = 0
        self._real: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "StaticKVCache":
        """A cache shaped for ``model`` (a CausalLM), on its device and in its dtype;
        ``max_len``: the longest sequence (prompt + new tokens) a row may reach."""
        c = model.config
        if max_len > c.max_position_embeddings:
            raise ValueError(f"max_len={max_len} is past the model's context of "
                             f"{c.max_position_embeddings} tokens")
        kv_heads = model.layers[0].self_attn.num_kv_heads
        return cls(c.num_layers, batch, kv_heads, c.head_dim, max_len,
                   dtype=model.dtype, device=model.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def length(self) -> int:
        """The longest row's real tokens (what the contiguous cache calls its length)."""
        return max(self.lengths)

    def reset(self) -> None:
        """Forget every token (the tensors are kept: stale slots are masked by position)."""
        self.lengths = [0] * self.batch
        self.slots, self._pending, self._real = None, 0, None

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of every row (speculative decoding's rollback):
        the slots past it are masked from now on and overwritten by later tokens."""
        if self._pending:
            raise ValueError("truncate() between begin() and advance(); call advance() first")
        if not isinstance(length, int) or not 0 <= length <= min(self.lengths):
            raise ValueError(f"length={length!r} must be an int in [0, {min(self.lengths)}] "
                             "(the tokens every row holds)")
        self.lengths = [length] * self.batch

    # -- host bookkeeping around one step ------------------------------------------------
    def begin(self, num_new: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Announce ``num_new`` tokens per row; returns their positions [batch, num_new].

        attention_mask [batch, num_new]: True for real tokens, False for padding (None:
        all real). A row's real tokens take its next positions; padding tokens write to
        the bin slot and are never read.
        """
        if self._pending:
            raise ValueError("begin() called twice without advance(); call advance() after "
                             "each forward")
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"num_new={num_new!r} must be a positive int")
        dev = self.slot_ids.device
        real = (torch.ones(self.batch, num_new, dtype=torch.bool) if attention_mask is None
                else attention_mask.to("cpu", torch.bool))
        if tuple(real.shape) != (self.batch, num_new):
            raise ValueError(f"attention_mask has shape {tuple(real.shape)}; expected "
                             f"(batch, num_new) = ({self.batch}, {num_new})")
        counts = real.sum(-1).tolist()
        if max(n + c for n, c in zip(self.lengths, counts)) > self.max_len:
            raise ValueError(f"{num_new} new tokens do not fit: rows hold {self.lengths} of "
                             f"max_len={self.max_len} slots")
        start = torch.tensor(self.lengths)[:, None]
        positions = (start + real.long().cumsum(-1) - 1).clamp_min(0)
        self.slots = torch.where(real, positions, self.max_len).to(dev)
        self._real, self._pending = counts, num_new
        return positions.to(dev)

    def advance(self) -> None:
        """Commit the tokens announced by :meth:`begin`."""
        if not self._pending:
            raise ValueError("advance() without begin(): nothing to commit")
        self.lengths = [n + c for n, c in zip(self.lengths, self._real)]
        self.slots, self._pending, self._real = None, 0, None

    # -- inside the step: tensors only ---------------------------------------------------
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend=None) -> torch.Tensor:
        """Write the new K/V at ``self.slots`` and attend over all slots, masked by position.

        q [batch, s, heads, head_dim]; k, v [batch, s, kv_heads, head_dim] (rotated).
        Returns [batch, s, heads, head_dim]. ``backend`` is not used: the masked read of a
        fixed number of slots is scaled_dot_product_attention with a boolean mask
        (:func:`static_attend`), or its C++ operator on the CPU (see the module's docstring).
        """
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if cpu_gemv.cxx_static_attend(kc, q):    # the same, in C++: in place, visible slots only
            return torch.ops.llmlab.static_attend(kc, vc, self.slots, q, k, v)
        return static_attend(kc, vc, self.slots, self.slot_ids, q, k, v)

    def __repr__(self) -> str:
        return (f"StaticKVCache(layers={self.num_layers}, batch={self.batch}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"lengths={self.lengths}, max_len={self.max_len}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


def static_attend(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  slot_ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """The static cache's write and read for one layer, in fixed shapes.

    k_cache, v_cache [batch, kv_heads, slots, head_dim] (written in place); slots
    [batch, s] long, where each new token writes (its position, or the bin for padding);
    slot_ids [slots] = arange; q [batch, s, heads, head_dim]; k, v [batch, s, kv_heads,
    head_dim]. Query i of row b sees slot j iff j <= slots[b, i] and j is not the bin
    (the last slot): its own position and every earlier one. (A padding query sees every
    slot; its output is never used.)
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    idx = slots[:, None, :, None].expand(b, kv, s, d)
    k_cache.scatter_(2, idx, k.transpose(1, 2).to(k_cache.dtype))
    v_cache.scatter_(2, idx, v.transpose(1, 2).to(v_cache.dtype))
    visible = (slot_ids[None, None, :] <= slots[:, :, None]) & \
        (slot_ids[None, None, :] < slot_ids.shape[0] - 1)              # [b, s, slots]
    groups = h // kv
    # GQA without copying K/V: the query heads sharing a KV head become extra query rows
    qg = q.reshape(b, s, kv, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv, groups * s, d)
    mask = visible[:, None, None, :, :].expand(b, kv, groups, s, -1).reshape(b, kv, groups * s, -1)
    out = F.scaled_dot_product_attention(qg, k_cache.to(q.dtype), v_cache.to(q.dtype),
                                         attn_mask=mask)
    return out.reshape(b, kv, groups, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h, d)


__all__ = ["StaticKVCache", "static_attend", "slots_for", "MIN_SLOTS"]
