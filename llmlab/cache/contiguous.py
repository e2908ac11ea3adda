"""The contiguous KV cache: one preallocated K and V tensor per layer.

Without a cache every generated token re-runs the model over the whole sequence. With
one, the prompt runs once (*prefill*, all prompt tokens in one forward) and each later
step feeds only the newest token (*decode*): its K and V are appended here, and its
single query attends to everything stored. Taught in notebook 02.

Layout, per layer: ``k[layer]`` and ``v[layer]`` are ``[batch, kv_heads, max_len, head_dim]``,
allocated once for the longest sequence the generation can reach, so no step allocates.
Rows of a batch are left-padded and share one write offset (``length``); a
``[batch, max_len]`` bool mask records which slots hold real tokens, and each row counts
its real tokens so the next position is known.

One step of the model with the cache::

    positions = cache.begin(num_new, attention_mask)   # announce the new tokens
    logits = model(ids, positions=positions, cache=cache, last_only=True)
    cache.advance()                                    # commit them

Inside the forward every attention layer calls ``cache.attend(layer_idx, q, k, v, backend)``,
the interface every cache in :mod:`llmlab.cache` implements.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig


KV_DTYPES = ("auto", "int8")   # "auto": K/V stored in the model's dtype


def check_sizes(**sizes: int) -> None:
    """ValueError naming the first of ``sizes`` (name=value) that is not a positive int."""
    for label, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive int")


def check_kv_dtype(kv_dtype) -> str:
    """``kv_dtype`` if it is one of :data:`KV_DTYPES` (None means ``"auto"``); ValueError else."""
    kv_dtype = "auto" if kv_dtype is None else kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; allowed: {list(KV_DTYPES)}")
    return kv_dtype


def kv_storage(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, kv_dtype: str,
               device) -> tuple[list, list, list, list]:
    """Zeroed K and V per layer of ``shape``, and their per-vector float32 scales (the shape
    without head_dim) when ``kv_dtype`` is "int8" (then K/V are stored as int8; else in
    ``dtype``, with no scales)."""
    int8 = kv_dtype == "int8"
    store = torch.int8 if int8 else dtype

    def zeros(sh, dt):
        return [torch.zeros(sh, dtype=dt, device=device) for _ in range(num_layers)]

    if not int8:
        return zeros(shape, store), zeros(shape, store), [], []
    return (zeros(shape, store), zeros(shape, store), zeros(shape[:-1], torch.float32),
            zeros(shape[:-1], torch.float32))


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q int8 [..., head_dim], scale float32 [...]), x ≈ q · scale.

    Symmetric, one scale per vector (one token of one KV head): scale = max|x| / 127, so
    each element is off by at most scale / 2. (The same rule as the per-channel int8
    weights of :mod:`llmlab.quant.formats`, along head_dim.)
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))     # an all-zero vector
    q = torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q int8 [..., head_dim], scale [...]) -> [..., head_dim] in ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)


def kv_bytes_per_token(config: ModelConfig, bytes_per_el: int = 2) -> int:
    """Bytes of K and V one token occupies across all layers: 2 · layers · kv_heads · head_dim · bytes.

    The 2 is K and V. ``bytes_per_el`` is 2 for float16/bfloat16, 4 for float32.
    """
    if bytes_per_el not in (1, 2, 4, 8):
        raise ValueError(f"bytes_per_el={bytes_per_el!r}; allowed: 1, 2, 4, 8")
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_el


def kv_cache_bytes(config: ModelConfig, batch: int, seq_len: int, bytes_per_el: int = 2) -> int:
    """Bytes of a cache holding ``batch`` sequences of ``seq_len`` tokens."""
    if batch < 1 or seq_len < 0:
        raise ValueError(f"batch={batch} must be >= 1 and seq_len={seq_len} >= 0")
    return batch * seq_len * kv_bytes_per_token(config, bytes_per_el)


class ContiguousKVCache:
    """Preallocated K/V per layer, ``[batch, kv_heads, max_len, head_dim]``.

    ``length`` slots (the same for every row) are filled; ``key_padding_mask[:, :length]``
    is True where a slot holds a real token (False for left padding, or for tokens fed
    to a row that already finished); ``real_lengths`` [batch] counts the real tokens.

    ``kv_dtype="int8"`` stores K and V as int8 with one float32 scale per token and KV
    head (:func:`quantize_kv`; ``k_scale[layer]``, ``v_scale[layer]`` are ``[batch,
    kv_heads, max_len]``), and dequantizes the filled slots to ``dtype`` whenever attention
    reads them (a plain PyTorch path): K/V take (head_dim + 4) / (2 · head_dim) of the
    bytes of float16, (head_dim + 4) / (4 · head_dim) of float32's.
    """

    name = "contiguous"

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_dtype: str = "auto"):
        check_sizes(num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, max_len=max_len)
        self.num_layers, self.batch, self.max_len = num_layers, batch, max_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_dtype, self.dtype = check_kv_dtype(kv_dtype), dtype
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k, self.v, self.k_scale, self.v_scale = kv_storage(num_layers, shape, dtype,
                                                                self.kv_dtype, device)
        self.key_padding_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.real_lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self._pending = 0            # tokens announced by begin(), written by attend()
        self._padded = False         # any False in key_padding_mask[:, :length + pending]?

    @classmethod
    def for_model(cls, model, batch: int, max_len: int,
                  kv_dtype: str = "auto") -> "ContiguousKVCache":
        """A cache shaped for ``model`` (a CausalLM), on its device and in its dtype.

        ``max_len`` counts slots, left padding included, so a batch may need more than
        the model's context (a short prompt beside a long one); each row's positions
        stay inside the context, which the model checks. The cache holds the KV heads
        this process computes: all of them, or a tensor-parallel rank's share.
        """
        c = model.config
        kv_heads = model.layers[0].self_attn.num_kv_heads
        return cls(c.num_layers, batch, kv_heads, c.head_dim, max_len,
                   dtype=model.dtype, device=model.device, kv_dtype=kv_dtype)

    # -- size ------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors, int8 scales included (the whole
        preallocation, used or not)."""
        return sum(t.numel() * t.element_size()
                   for t in self.k + self.v + self.k_scale + self.v_scale)

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots filled so far."""
        return self.nbytes * self.length // self.max_len

    # -- per-step bookkeeping ------------------------------------------------------------
    def reset(self) -> None:
        """Forget every token (the tensors are kept for reuse)."""
        self.key_padding_mask.zero_()
        self.real_lengths.zero_()
        self.length, self._pending, self._padded = 0, 0, False

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` slots: the rest are forgotten (their tensors are
        overwritten by later tokens). Speculative decoding (notebook 09) writes K/V for
        drafted tokens the target then rejects, and rolls the cache back with this."""
        if self._pending:
            raise ValueError("truncate() between begin() and advance(); call advance() first")
        if not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length={length!r} must be an int in [0, {self.length}] "
                             "(the slots filled so far)")
        self.key_padding_mask[:, length:] = False
        self.real_lengths = self.key_padding_mask[:, :length].sum(-1)
        self.length = length
        self._padded = not bool(self.key_padding_mask[:, :length].all())

    def begin(self, num_new: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Announce ``num_new`` tokens per row for the next forward; returns their positions.

        attention_mask [batch, num_new]: 1/True for real tokens, 0 for padding (None: all
        real). Positions count real tokens only, so a left-padded row starts at 0:
        returns positions [batch, num_new] (long).
        """
        if self._pending:
            raise ValueError("begin() called twice without advance(); call advance() after "
                             "each forward")
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"num_new={num_new!r} must be a positive int")
        end = self.length + num_new
        if end > self.max_len:
            raise ValueError(f"{num_new} new tokens do not fit: {self.length} of max_len="
                             f"{self.max_len} slots are used")
        slots = self.key_padding_mask[:, self.length:end]
        if attention_mask is None:
            slots.fill_(True)
            positions = self.real_lengths[:, None] + torch.arange(num_new, device=slots.device)
        else:
            if tuple(attention_mask.shape) != (self.batch, num_new):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; "
                                 f"expected (batch, num_new) = ({self.batch}, {num_new})")
            real = attention_mask.to(torch.bool)
            slots.copy_(real)
            self._padded = self._padded or not bool(real.all())
            positions = self.real_lengths[:, None] + real.long().cumsum(-1) - 1
            positions = positions.clamp_min(0)
        self._pending = num_new
        return positions

    def advance(self) -> None:
        """Commit the tokens announced by :meth:`begin` (after the forward wrote them)."""
        n = self._pending
        if not n:
            raise ValueError("advance() without begin(): nothing to commit")
        self.real_lengths += self.key_padding_mask[:, self.length:self.length + n].sum(-1)
        self.length += n
        self._pending = 0

    # -- the interface every cache implements --------------------------------------------
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend) -> torch.Tensor:
        """Store the new K/V of layer ``layer_idx`` and attend over everything stored.

        q [batch, seq_q, heads, head_dim]; k, v [batch, seq_q, kv_heads, head_dim] for
        the new tokens only, already rotated. Returns [batch, seq_q, heads, head_dim].
        """
        s = k.shape[1]
        if s != self._pending:
            raise ValueError(f"attend got {s} new tokens but begin() announced {self._pending}")
        start, end = self.length, self.length + s
        self.store(layer_idx, start, end, k, v)
        mask = self.key_padding_mask[:, :end] if self._padded else None
        k_all, v_all = self.read(layer_idx, end, q.dtype)
        if s > 1:
            return backend.forward(q, k_all, v_all, causal=True, key_padding_mask=mask)
        return decode_grouped(q, k_all, v_all, backend, mask)

    def store(self, layer_idx: int, start: int, end: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write the new tokens' K and V [batch, end - start, kv_heads, head_dim] of layer
        ``layer_idx`` into slots ``start`` .. ``end - 1`` (int8: quantized, with scales)."""
        for new, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            new = new.transpose(1, 2)                    # [batch, kv_heads, s, head_dim]
            if self.kv_dtype == "int8":
                new, scale = quantize_kv(new)
                scales[layer_idx][:, :, start:end] = scale
            cache[layer_idx][:, :, start:end] = new

    def read(self, layer_idx: int, end: int, dtype: torch.dtype):
        """K and V of the first ``end`` slots, [batch, end, kv_heads, head_dim] (int8:
        dequantized to ``dtype``)."""
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            t = cache[layer_idx][:, :, :end]
            if self.kv_dtype == "int8":
                t = dequantize_kv(t, scales[layer_idx][:, :, :end], dtype)
            out.append(t.transpose(1, 2))
        return out

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(layers={self.num_layers}, batch={self.batch}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"length={self.length}/{self.max_len}, {self.nbytes / 2**20:.1f} MiB"
                + (", int8" if self.kv_dtype == "int8" else "") + ")")


def decode_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend,
                   key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per sequence against the cache, without copying K/V per query head.

    q [batch, 1, heads, head_dim]; k, v [batch, seq_k, kv_heads, head_dim] (any strides);
    returns [batch, 1, heads, head_dim]. Under grouped-query attention the ``heads //
    kv_heads`` query heads that share a KV head are moved into the query-length axis, so
    the backend sees ``kv_heads`` heads with ``heads // kv_heads`` queries each and needs no
    repeated K/V. A single query sees every stored key, so no causal mask is needed.
    """
    b, _, h, d = q.shape
    kv = k.shape[2]
    groups = h // kv
    if groups == 1:
        return backend.forward(q, k, v, causal=False, key_padding_mask=key_padding_mask)
    # query head i uses KV head i // groups: [b, 1, kv·g, d] -> [b, g, kv, d]
    qg = q.reshape(b, kv, groups, d).transpose(1, 2)
    out = backend.forward(qg, k, v, causal=False, key_padding_mask=key_padding_mask)
    return out.transpose(1, 2).reshape(b, 1, h, d)
