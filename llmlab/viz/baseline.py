"""Figures for notebook 01: where the time goes, and the N² cost of naive attention."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from .. import attention as A
from ..profiling import peak_memory, time_fn


def attention_cost(n: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                   backend: str = "naive", repeats: int = 3, seed: int = 0) -> dict:
    """Measure one causal attention call at sequence length ``n`` (batch 1, float32).

    Returns {"n", "backend", "seconds", "peak_bytes", "score_bytes"} where score_bytes is
    the size of one [1, heads, n, n] float32 score matrix (what naive materializes).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, heads, head_dim, generator=g)
    k = torch.randn(1, n, kv_heads, head_dim, generator=g)
    v = torch.randn(1, n, kv_heads, head_dim, generator=g)
    fn = A.get(backend).forward
    t = time_fn(lambda: fn(q, k, v, causal=True), repeats=repeats, warmup=1, device="cpu")
    mem = peak_memory(lambda: fn(q, k, v, causal=True), device="cpu")
    return {"n": n, "backend": backend, "seconds": t.median_s, "peak_bytes": mem.peak_bytes,
            "score_bytes": 4 * heads * n * n}


def plot_attention_cost(rows: list[dict], title: str = ""):
    """Time and peak memory against N (log-log), one line per backend, with an N² guide."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=80)
    for backend in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == backend]
        ns = [r["n"] for r in rs]
        a1.loglog(ns, [r["seconds"] * 1e3 for r in rs], "o-", label=backend)
        a2.loglog(ns, [r["peak_bytes"] / 2**20 for r in rs], "o-", label=backend)
    ns = sorted({r["n"] for r in rows})
    ref = [r for r in rows if r["n"] == ns[-1]]
    if ref and len(ns) > 1:
        top = max(r["peak_bytes"] for r in ref) / 2**20
        a2.loglog(ns, [top * (n / ns[-1]) ** 2 for n in ns], "k:", label="∝ N²")
    a1.set(xlabel="sequence length N", ylabel="time per call (ms)", title="time")
    a2.set(xlabel="sequence length N", ylabel="peak extra memory (MiB)", title="memory")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
        a.minorticks_off()
        a.legend(fontsize=8)
        a.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_parts(parts_by_n: dict[int, dict[str, float]]):
    """Stacked bars: share of forward time per part (attention, mlp, lm_head, ...) per N."""
    ns = sorted(parts_by_n)
    keys = ["attention", "mlp", "lm_head", "norms", "embed_tokens", "other"]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    bottom = [0.0] * len(ns)
    for k in keys:
        share = [parts_by_n[n].get(k, 0.0) / sum(parts_by_n[n].values()) for n in ns]
        ax.bar([str(n) for n in ns], share, bottom=bottom, label=k)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set(xlabel="prompt length N (one forward pass)", ylabel="share of time", ylim=(0, 1))
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig


def explore_attention(n: int = 512, backend: str = "naive"):
    """Widget callback: measure one attention call at N and show score memory vs measured."""
    r = attention_cost(n, backend=backend, repeats=2)
    fig, ax = plt.subplots(figsize=(6, 2.6), dpi=80)
    ax.barh(["score matrix [1,9,N,N] fp32", f"measured peak ({backend})"],
            [r["score_bytes"] / 2**20, r["peak_bytes"] / 2**20], color=["tab:gray", "tab:orange"])
    ax.set_xlabel("MiB")
    ax.set_title(f"N={n}: {r['seconds'] * 1e3:.1f} ms per call ({backend})")
    fig.tight_layout()
    return fig, r
