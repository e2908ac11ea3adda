"""python -m llmlab.bench paged [--quick] [--gpu]: KV memory waste on the traces and the
cost of paged decode attention per block size (notebook 04).

Prints (1) the waste study of :mod:`llmlab.cache.waste` on the ShareGPT-like trace —
waste and concurrent sequences for preallocation to the maximum length, to the batch's
longest request, and paging with block sizes 1..256 — and (2) the measured time of one
decode attention over a paged cache (PyTorch reference, and the Triton kernel where it
compiles, i.e. on CUDA) per block size, with the ratio to the dense (contiguous) naive
attention measured in the same run.
"""
from __future__ import annotations

import argparse

import torch

from ..attention import naive_attention
from ..attention.paged import paged_attention_reference, paged_attention_triton
from ..cache.waste import block_size_sweep, simulate
from ..profiling.timer import time_fn
from ..traces import load_trace
from ._common import header, save, table

BACKENDS = {"paged": paged_attention_reference, "paged_triton": paged_attention_triton}


def paged_decode_inputs(block_size: int, batch: int = 8, context: int = 512, heads: int = 9,
                        kv_heads: int = 3, head_dim: int = 64, device="cpu",
                        dtype=torch.float32, seed: int = 0):
    """Random decode inputs: q [batch, 1, heads, head_dim] and a shuffled paged pool holding
    ``context`` tokens per sequence. Returns (q, k_cache, v_cache, cache_seqlens, block_table)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = per_seq * batch
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, 1, heads, head_dim, generator=g)
    lens = torch.full((batch,), context, dtype=torch.int32)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            lens.to(**to), table.to(**to))


def time_paged_decode(block_size: int, backend: str = "paged", repeats: int = 5, **kw) -> float:
    """Median seconds of one paged decode attention (see :func:`paged_decode_inputs`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {list(BACKENDS)}")
    args = paged_decode_inputs(block_size, **kw)
    return time_fn(lambda: BACKENDS[backend](*args), repeats, device=args[0].device).median_s


def time_dense_decode(repeats: int = 5, **kw) -> float:
    """The same decode with K/V already contiguous ([batch, context, kv_heads, head_dim])."""
    q, k, v, lens, table = paged_decode_inputs(16, **kw)
    from ..attention.paged import gather_kv

    kd, vd = gather_kv(k, table, int(lens[0])), gather_kv(v, table, int(lens[0]))
    return time_fn(lambda: naive_attention(q, kd, vd, causal=True), repeats,
                   device=q.device).median_s


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench paged")
    ap.add_argument("--quick", action="store_true", help="smaller trace and shapes")
    ap.add_argument("--gpu", action="store_true", help="GPU-sized kernel timing (needs CUDA)")
    args = ap.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("paged --gpu needs CUDA; nothing to do on this machine")
        return 0
    header("PagedAttention: KV memory waste and paged decode cost")

    reqs = load_trace("sharegpt_like", limit=100 if args.quick else None)
    budget = 8192 if args.quick else 16384
    rows, payload = [], {"waste": [], "decode": []}
    base = [simulate(reqs, p, budget) for p in ("max_len", "batch_max")]
    for r in base + block_size_sweep(reqs, budget):
        f = r.fractions()
        row = {"policy": r.label, "waste": f"{r.waste:.1%}", "used": f"{f['used']:.1%}",
               "reservation": f"{f['reservation']:.1%}", "internal": f"{f['internal']:.1%}",
               "external": f"{f['external']:.1%}", "seqs": round(r.mean_running, 1),
               "vs max_len": f"{r.mean_running / base[0].mean_running:.2f}×"}
        rows.append(row)
        payload["waste"].append(row)
    print(f"\nShareGPT-like trace, {len(reqs)} requests, KV pool of {budget} tokens "
          "(all requests waiting at t=0):")
    table(rows)

    dev = "cuda" if args.gpu else "cpu"
    if args.gpu:
        shape = dict(batch=64, context=2048, heads=32, kv_heads=8, head_dim=128,
                     dtype=torch.float16, device=dev)
        backends = ["paged", "paged_triton"]
    else:
        shape = dict(batch=4 if args.quick else 8, context=256 if args.quick else 1024,
                     device=dev)
        backends = ["paged"]          # the interpreter's timing says nothing about the kernel
    dense = time_dense_decode(**shape)
    rows = []
    for bs in (8, 16, 32, 64, 128):
        for b in backends:
            t = time_paged_decode(bs, b, **shape)
            rows.append({"backend": b, "block": bs, "ms": round(t * 1e3, 3),
                         "vs dense naive": f"{t / dense:.2f}×"})
    print(f"\none decode attention, {shape}; dense naive attention: {dense * 1e3:.3f} ms")
    table(rows)
    payload["decode"] = rows
    payload["dense_ms"] = dense * 1e3
    save("paged", payload)
    return 0
