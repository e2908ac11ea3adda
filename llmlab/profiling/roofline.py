"""The roofline: this machine's two ceilings, and where prefill and decode sit under them.

A kernel that does F FLOPs while moving B bytes to and from main memory has arithmetic
intensity I = F / B (FLOP per byte). It cannot run faster than the compute roof (peak
FLOP/s) nor than the memory roof (bandwidth · I); attainable = min(peak, bandwidth · I).
The two meet at the ridge point I* = peak / bandwidth: below it a kernel is memory-bound.

Prefill pushes many tokens through each weight matrix (a GEMM, high I: compute-bound);
decode pushes one token per sequence (a GEMV, I ≈ batch / 2 in float32: memory-bound),
which is why batching decode pays. The ceilings are *measured* here (a large copy, a
large matmul); the FLOP and byte counts are an analytic *model* (see
:mod:`llmlab.profiling.flops`). Taught in notebook 02.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..device import default_device, device_name, resolve_dtype
from .flops import attention_flops, linear_flops, weight_bytes
from .timer import time_fn


@dataclass(frozen=True)
class Ceilings:
    """Measured roofs of one device: bytes/s of a large copy and FLOP/s of a large matmul."""
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    device: str = ""

    @property
    def ridge_point(self) -> float:
        """FLOP per byte where the two roofs meet (below it: memory-bound)."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    def attainable(self, intensity: float) -> float:
        """The roofline: min(peak, bandwidth · intensity) in FLOP/s."""
        return min(self.peak_flops_per_s, self.bandwidth_bytes_per_s * intensity)


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device=None,
                      read_only: bool = False) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a buffer much larger than the caches.

    A copy reads ``nbytes`` and writes ``nbytes``: 2 · nbytes moved per copy. With
    ``read_only``, ``src.sum()`` instead: a pure read of ``nbytes``, what a decode step's
    weights need (a copy also writes, and its rate can be the lower one). The best of
    ``repeats`` runs is reported (the ceiling, not the average).
    """
    if nbytes < 2**20:
        raise ValueError(f"nbytes={nbytes} is too small to defeat the caches; use >= 1 MiB")
    dev = torch.device(device) if device is not None else default_device()
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    if read_only:
        t = time_fn(lambda: src.sum(), repeats=repeats, warmup=1, device=dev)
        return src.numel() * 4 / t.min_s
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), repeats=repeats, warmup=1, device=dev)
    return 2 * src.numel() * 4 / t.min_s


def measure_matmul_flops(n: int = 1024, dtype: str | torch.dtype = torch.float32,
                         repeats: int = 5, device=None) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul (2 · n³ FLOPs), the best of ``repeats``."""
    if n < 64:
        raise ValueError(f"n={n} is too small to reach the compute roof; use >= 64")
    dev = torch.device(device) if device is not None else default_device()
    dt = resolve_dtype(dtype)
    a = torch.randn(n, n, device=dev).to(dt)
    b = torch.randn(n, n, device=dev).to(dt)
    out = torch.empty(n, n, device=dev, dtype=dt)
    t = time_fn(lambda: torch.matmul(a, b, out=out), repeats=repeats, warmup=1, device=dev)
    return 2 * n**3 / t.min_s


def measure_ceilings(copy_bytes: int = 256 * 2**20, matmul_n: int = 1024,
                     dtype: str | torch.dtype = torch.float32, repeats: int = 5,
                     device=None) -> Ceilings:
    """Measure both roofs of ``device`` (default: CUDA if present, else CPU)."""
    dev = torch.device(device) if device is not None else default_device()
    return Ceilings(measure_bandwidth(copy_bytes, repeats, dev),
                    measure_matmul_flops(matmul_n, dtype, repeats, dev), device_name(dev))


@dataclass(frozen=True)
class Cost:
    """Analytic FLOPs and main-memory bytes of one forward pass (a model, not a measurement)."""
    flops: int
    bytes: int
    label: str = ""

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flops / self.bytes


def forward_cost(config: ModelConfig, batch: int, new_tokens: int, past_tokens: int = 0,
                 bytes_per_el: int = 4, logits_tokens: int = 1, label: str = "") -> Cost:
    """FLOPs and bytes of one cached forward: ``new_tokens`` per sequence after ``past_tokens``.

    Prefill is ``new_tokens = prompt_len, past_tokens = 0``; a decode step is
    ``new_tokens = 1, past_tokens = context``. Counted: every weight read once (batching
    shares it), the projections' input/output activations, the KV cache read
    (past + new) and written (new), and the lm_head for ``logits_tokens`` per sequence
    (generation needs only the last). Causal attention over the new tokens is counted
    exactly (query i sees past + i + 1 keys).
    """
    if batch < 1 or new_tokens < 1 or past_tokens < 0:
        raise ValueError(f"batch={batch}, new_tokens={new_tokens} must be >= 1 and "
                         f"past_tokens={past_tokens} >= 0")
    c = config
    h, d, L = c.hidden_size, c.head_dim, c.num_layers
    qd, kvd = c.num_heads * d, c.num_kv_heads * d
    experts = c.num_experts_per_tok if c.is_moe else 1
    shapes = [(h, qd), (h, kvd), (h, kvd), (qd, h)] + [(h, c.intermediate_size)] * (2 * experts) \
        + [(c.intermediate_size, h)] * experts
    tokens = batch * new_tokens
    lin_flops = sum(linear_flops(tokens, i, o) for i, o in shapes)
    act_bytes = sum(tokens * (i + o) for i, o in shapes) * bytes_per_el
    # causal: new query i sees past + i + 1 keys
    attn = attention_flops(batch, c.num_heads, new_tokens, past_tokens + new_tokens, d,
                           causal=True)
    lm_tokens = batch * min(logits_tokens, new_tokens)
    flops = L * (lin_flops + attn) + linear_flops(lm_tokens, h, c.vocab_size)
    kv_per_token = 2 * L * kvd * bytes_per_el
    nbytes = (weight_bytes(c, bytes_per_el) + L * act_bytes
              + batch * (past_tokens + new_tokens) * kv_per_token   # read the cache
              + batch * new_tokens * kv_per_token                   # write the new K, V
              + lm_tokens * (h + c.vocab_size) * bytes_per_el)
    return Cost(int(flops), int(nbytes), label)


def prefill_cost(config: ModelConfig, batch: int, prompt_len: int, bytes_per_el: int = 4) -> Cost:
    """The prefill forward: the whole prompt at once (a GEMM per weight)."""
    return forward_cost(config, batch, prompt_len, 0, bytes_per_el,
                        label=f"prefill b={batch} n={prompt_len}")


def decode_cost(config: ModelConfig, batch: int, context: int, bytes_per_el: int = 4) -> Cost:
    """One decode step: one new token per sequence after ``context`` cached ones (a GEMV)."""
    return forward_cost(config, batch, 1, context, bytes_per_el,
                        label=f"decode b={batch} ctx={context}")


@dataclass(frozen=True)
class RooflinePoint:
    """A measured run placed on the roofline: its modelled cost and its measured time."""
    cost: Cost
    seconds: float

    @property
    def label(self) -> str:
        return self.cost.label

    @property
    def intensity(self) -> float:
        return self.cost.intensity

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s (modelled FLOPs over measured seconds)."""
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        """Achieved bytes/s (modelled bytes over measured seconds)."""
        return self.cost.bytes / self.seconds

    def share_of_roof(self, ceilings: Ceilings) -> float:
        """Achieved FLOP/s over the attainable FLOP/s at this intensity (1.0 = on the roof)."""
        return self.flops_per_s / ceilings.attainable(self.intensity)


def time_prefill(model, batch: int, prompt_len: int, repeats: int = 3) -> RooflinePoint:
    """Measure one prefill forward (``batch`` × ``prompt_len`` random tokens, logits for the
    last position only) and place it on the roofline."""
    from ..cache.contiguous import ContiguousKVCache

    c = model.config
    ids = torch.randint(0, c.vocab_size, (batch, prompt_len), device=model.device,
                        generator=torch.Generator().manual_seed(0))
    cache = ContiguousKVCache.for_model(model, batch, prompt_len)

    def step():
        cache.reset()
        pos = cache.begin(prompt_len)
        model(ids, positions=pos, cache=cache, last_only=True)
        cache.advance()

    with torch.inference_mode():
        t = time_fn(step, repeats=repeats, warmup=1, device=model.device)
    nbytes = model.dtype.itemsize
    return RooflinePoint(prefill_cost(c, batch, prompt_len, nbytes), t.min_s)


def time_decode_step(model, batch: int, context: int, repeats: int = 3) -> RooflinePoint:
    """Measure one decode step (one new token per sequence after ``context`` cached ones)
    and place it on the roofline.

    The cache is marked as holding ``context`` tokens without running the prompt (its K/V
    stay zero): the step does the same work whatever values the cache holds.
    """
    from ..cache.contiguous import ContiguousKVCache

    c = model.config
    cache = ContiguousKVCache.for_model(model, batch, context + 1)
    ids = torch.randint(0, c.vocab_size, (batch, 1), device=model.device,
                        generator=torch.Generator().manual_seed(0))

    def step():
        cache.reset()
        if context:
            cache.begin(context)
            cache.advance()
        pos = cache.begin(1)
        model(ids, positions=pos, cache=cache, last_only=True)
        cache.advance()

    with torch.inference_mode():
        t = time_fn(step, repeats=repeats, warmup=1, device=model.device)
    nbytes = model.dtype.itemsize
    return RooflinePoint(decode_cost(c, batch, context, nbytes), t.min_s)
