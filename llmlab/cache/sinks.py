"""A rolling KV cache with attention sinks (StreamingLLM): keep the first ``sinks`` tokens
and the last ``window``, evict everything between.

Xiao, Tian, Chen, Han, Lewis, *Efficient Streaming Language Models with Attention Sinks*,
ICLR 2024 (arXiv:2309.17453). A model trained on finite contexts puts a large share of
its attention on the first tokens whatever they say (the softmax must put its mass
somewhere); a plain sliding window evicts them and perplexity collapses. Keeping a few of
them (4 in the paper) beside the window restores it, with a cache of fixed size.

Positions, as in the paper's section 3.2: RoPE is applied at positions *within the
cache*, not in the text. Query i sees ``c_i = min(i + 1, sinks + window)`` keys, at cache
positions ``0 .. c_i - 1``: the sinks at ``0 .. sinks-1``, then the window in order, the
query itself last. Keys are cached before RoPE and rotated at each step.

How: the cache asks the model to rotate every new token at position 0, where RoPE is the
identity (cos 0 = 1, sin 0 = 0, exactly), so q and k arrive un-rotated, and rotates them
itself. Scores depend only on the difference of the two positions, so for a chunk of
queries (each with its own window) the window keys use one common offset (their
distance to each query is the text's), and only the sinks' scores use each query's own
cache position. A chunk of C new tokens thus costs one pass; the result equals feeding
them one at a time (tested).

Layout, per layer: K (un-rotated) and V ``[batch, kv_heads, kept, head_dim]`` with
``kept <= sinks + window`` between steps; ``kept_index [kept]`` holds each kept token's
index in the text (the same in every layer and row). All rows of a batch are one length
(no padding). :func:`streaming_perplexity` runs a model over a long text through it.
Taught in notebook 14.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..attention.reference import group_queries, ungroup_queries


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., n, heads, head_dim]`` at ``positions [n]`` (HF Llama's rotate-half
    convention, as :mod:`llmlab.layers.rotary`), in float32 angles."""
    freqs = positions.float()[:, None] * inv_freq.float().to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)                       # [n, head_dim]
    cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def cache_positions(index: torch.Tensor, sinks: int, window: int | None) -> torch.Tensor:
    """The cache position of the query at text index ``index``: ``min(index, sinks +
    window - 1)`` (its own index while everything fits)."""
    if window is None:
        return index
    return index.clamp_max(sinks + window - 1)


def visible(query_index: torch.Tensor, key_index: torch.Tensor, sinks: int,
            window: int | None) -> torch.Tensor:
    """Bool [queries, keys]: key j is visible to query i when ``j <= i`` and j is a sink
    (``j < sinks``) or one of the last ``window`` tokens up to i (``j > i - window``)."""
    i, j = query_index[:, None], key_index[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & ((j < sinks) | (j > i - window))
    return ok


def check_sinks_window(sinks, window) -> None:
    """ValueError naming ``sinks`` (an int >= 0) or ``window`` (an int >= 1, or None for
    an unbounded cache) when it is not allowed."""
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r} must be an int >= 0")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window={window!r} must be an int >= 1, or None (keep every token)")


class SinkKVCache:
    """First ``sinks`` tokens + last ``window`` tokens per layer; RoPE at cache positions.

    ``window=None`` keeps every token (a full cache through the same code). The same
    per-step interface as :class:`~llmlab.cache.contiguous.ContiguousKVCache`::

        positions = cache.begin(num_new)       # zeros: the model's RoPE is the identity
        logits = model(ids, positions=positions, cache=cache)
        cache.advance()                        # evict what fell out of the window
    """

    name = "sinks"

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 inv_freq: torch.Tensor, sinks: int = 4, window: int | None = 256,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_sinks_window(sinks, window)
        self.num_layers, self.batch = num_layers, batch
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.sinks, self.window = sinks, window
        self.inv_freq = inv_freq.float().to(device)
        empty = torch.zeros(batch, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.k = [empty] * num_layers
        self.v = [empty] * num_layers
        self.kept_index = torch.zeros(0, dtype=torch.long, device=device)
        self.seen = 0                # tokens of the text so far (the next one's index)
        self._pending = 0
        self._keep: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, batch: int = 1, sinks: int = 4,
                  window: int | None = 256) -> "SinkKVCache":
        """A cache shaped for ``model`` (a CausalLM), with its RoPE frequencies."""
        attn = model.layers[0].self_attn
        return cls(model.config.num_layers, batch, attn.num_kv_heads, model.config.head_dim,
                   attn.rotary.inv_freq, sinks, window, dtype=model.dtype, device=model.device)

    @property
    def capacity(self) -> int | None:
        """Tokens kept between steps: ``sinks + window`` (None: unbounded)."""
        return None if self.window is None else self.sinks + self.window

    @property
    def length(self) -> int:
        """Tokens held now, per layer."""
        return int(self.kept_index.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V held now, all layers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, num_new: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Announce ``num_new`` tokens per row; returns their positions for the model:
        zeros [batch, num_new], so that q and k reach :meth:`attend` un-rotated."""
        if self._pending:
            raise ValueError("begin() called twice without advance(); call advance() after "
                             "each forward")
        if isinstance(num_new, bool) or not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"num_new={num_new!r} must be a positive int")
        if attention_mask is not None and self.seen == 0 and not bool(attention_mask.all()):
            raise ValueError("the sinks cache holds rows of one length: its prompts cannot "
                             "be padded (pass prompts of equal length, or one at a time)")
        new = torch.arange(self.seen, self.seen + num_new, device=self.kept_index.device)
        index = torch.cat([self.kept_index, new])
        last = self.seen + num_new - 1
        self._keep = None if self.window is None else \
            (index < self.sinks) | (index > last - self.window)
        self._pending = num_new
        return torch.zeros(self.batch, num_new, dtype=torch.long, device=new.device)

    def advance(self) -> None:
        """Commit the announced tokens and evict those no later query can see."""
        if not self._pending:
            raise ValueError("advance() without begin(): nothing to commit")
        new = torch.arange(self.seen, self.seen + self._pending, device=self.kept_index.device)
        index = torch.cat([self.kept_index, new])
        self.kept_index = index if self._keep is None else index[self._keep]
        self.seen += self._pending
        self._pending = 0

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend=None) -> torch.Tensor:
        """q [batch, s, heads, d]; k, v [batch, s, kv_heads, d], un-rotated (positions 0).

        Appends the new K/V, rotates the sinks at their cache positions and the window at
        one common offset, scores each query against what it sees, and keeps the
        survivors for the next step. Returns [batch, s, heads, d]. (``backend`` is
        ignored: the two score blocks are computed here, in plain PyTorch.)
        """
        s = q.shape[1]
        if s != self._pending:
            raise ValueError(f"attend got {s} new tokens but begin() announced {self._pending}")
        k_all = torch.cat([self.k[layer_idx], k.transpose(1, 2).to(self.k[layer_idx].dtype)], 2)
        v_all = torch.cat([self.v[layer_idx], v.transpose(1, 2).to(self.v[layer_idx].dtype)], 2)
        if self._keep is not None:
            self.k[layer_idx], self.v[layer_idx] = k_all[:, :, self._keep], v_all[:, :, self._keep]
        else:
            self.k[layer_idx], self.v[layer_idx] = k_all, v_all
        qi = torch.arange(self.seen, self.seen + s, device=q.device)       # query indices
        kj = torch.cat([self.kept_index, qi])                               # key indices
        return sink_window_attention(q, k_all.transpose(1, 2), v_all.transpose(1, 2), qi, kj,
                                     self.sinks, self.window, self.inv_freq)

    def __repr__(self) -> str:
        return (f"SinkKVCache(sinks={self.sinks}, window={self.window}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, held={self.length}, seen={self.seen})")


def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          query_index: torch.Tensor, key_index: torch.Tensor, sinks: int,
                          window: int | None, inv_freq: torch.Tensor,
                          softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of un-rotated queries over un-rotated keys, StreamingLLM's positions.

    q [batch, s, heads, d]; k, v [batch, n, kv_heads, d]; ``query_index [s]``,
    ``key_index [n]`` (increasing): the tokens' indices in the text. Query i sees
    :func:`visible` keys; RoPE puts it at ``min(i, sinks + window - 1)`` and sink j at j,
    and a window key j at ``i - (i - j)`` below the query (the distance in the text), so
    the window block rotates q at ``i - base`` and k at ``j - base`` for one ``base``.
    Returns [batch, s, heads, d].
    """
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    n_sink = int((key_index < sinks).sum())                # sinks come first: indices increase
    base = int(key_index[n_sink]) if n_sink < key_index.numel() else 0
    q_win = rope(q, query_index - base, inv_freq)
    k_win = rope(k[:, n_sink:], key_index[n_sink:] - base, inv_freq)
    q_sink = rope(q, cache_positions(query_index, sinks, window), inv_freq)
    k_sink = rope(k[:, :n_sink], key_index[:n_sink], inv_freq)   # a sink's position: its index
    # [b, kv, g*s, n] scores, each block from its own rotation
    scores = torch.cat([group_queries(q_sink, kv_heads) @ k_sink.permute(0, 2, 3, 1),
                        group_queries(q_win, kv_heads) @ k_win.permute(0, 2, 3, 1)], -1) * scale
    ok = visible(query_index, key_index, sinks, window)                     # [s, n]
    ok = ok[None, :, :].expand(group, s, -1).reshape(group * s, -1)         # group_queries' rows
    scores = scores.masked_fill(~ok, float("-inf"))
    out = F.softmax(scores.float(), dim=-1).to(v.dtype) @ v.transpose(1, 2)  # [b, kv, g*s, d]
    return ungroup_queries(out, s)


@torch.inference_mode()
def streaming_nll(model, token_ids, sinks: int = 4, window: int | None = 256,
                  chunk: int = 128) -> torch.Tensor:
    """Negative log-likelihood (nats) of each next token of ``token_ids`` (a list or
    [n] tensor), the text fed ``chunk`` tokens at a time through a :class:`SinkKVCache`.
    Returns float32 [n - 1]: entry t is -log p(token t+1 | what the cache kept)."""
    check_sinks_window(sinks, window)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be an int >= 1")
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError(f"token_ids has {ids.shape[1]} tokens; need at least 2")
    cache = SinkKVCache.for_model(model, 1, sinks, window)
    out = []
    for start in range(0, ids.shape[1] - 1, chunk):
        piece = ids[:, start:min(start + chunk, ids.shape[1] - 1)]
        logits = model.step(piece, cache.begin(piece.shape[1]), cache)
        cache.advance()
        target = ids[0, start + 1:start + 1 + piece.shape[1]]
        out.append(F.cross_entropy(logits[0].float(), target, reduction="none"))
    return torch.cat(out)


def streaming_perplexity(model, token_ids, sinks: int = 4, window: int | None = 256,
                         chunk: int = 128, skip: int = 0) -> float:
    """exp(mean NLL) of :func:`streaming_nll`, over the predictions after the first
    ``skip`` (e.g. only where the window has started to evict)."""
    nll = streaming_nll(model, token_ids, sinks, window, chunk)
    if not 0 <= skip < nll.numel():
        raise ValueError(f"skip={skip!r} must be in 0..{nll.numel() - 1}")
    return float(torch.exp(nll[skip:].mean()))


__all__ = ["SinkKVCache", "sink_window_attention", "streaming_nll", "streaming_perplexity",
           "rope", "cache_positions", "visible", "check_sinks_window"]
