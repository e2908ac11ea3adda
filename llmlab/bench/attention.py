"""python -m llmlab.bench attention [--quick] [--gpu]: attention backends against naive.

CPU (default): causal self-attention, batch 1, 4 heads, head_dim 64, float32, N from
512 to 8192 (``--quick``: to 2048); backends naive, sdpa and flash (torch tiled, Br = 256,
Bc = 512). Prints time and peak memory of the attention call and their ratios against
naive. The flash_triton kernel needs CUDA to be timed (the interpreter is not a speed).

``--gpu``: bf16, causal, head_dim 64 and 128, N from 1024 to 32768 (16k tokens per batch):
naive (while its N² scores fit), torch SDPA forced to its flash backend, flash (torch)
up to 8192, and the flash_triton kernel; time, TFLOP/s against the chip's measured bf16
GEMM peak, and flash_triton's throughput relative to SDPA-flash. Taught in notebook 03.
"""
from __future__ import annotations

import argparse

import torch

from ._common import header, save, table

CPU_HEADS, HEAD_DIM = 4, 64
CPU_BLOCKS = (256, 512)     # Br, Bc for the torch flash backend on CPU
FLASH_TARGET = 0.05         # flash peak memory / naive peak memory at N = 8192 on CPU
GPU_TARGET = 0.8            # flash_triton throughput / SDPA-flash throughput at N >= 4096


def _qkv(batch: int, n: int, heads: int, d: int, dtype, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(batch, n, heads, d, generator=g).to(device=device, dtype=dtype)
                 for _ in range(3))


def run_cpu(quick: bool) -> dict:
    from llmlab.attention import get
    from llmlab.attention.flash import flash_attention
    from llmlab.profiling import peak_memory, time_fn

    sizes = [512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192]
    br, bc = CPU_BLOCKS
    backends = {
        "naive": lambda q, k, v: get("naive").forward(q, k, v, causal=True),
        "sdpa": lambda q, k, v: get("sdpa").forward(q, k, v, causal=True),
        f"flash (Br={br}, Bc={bc})": lambda q, k, v: flash_attention(q, k, v, causal=True,
                                                                   block_q=br, block_k=bc),
    }
    print(f"   causal, batch 1, {CPU_HEADS} heads, head_dim {HEAD_DIM}, float32; "
          "flash_triton: needs CUDA to be timed (CPU runs it in the Triton interpreter)")
    rows = []
    for n in sizes:
        q, k, v = _qkv(1, n, CPU_HEADS, HEAD_DIM, torch.float32, "cpu", seed=n)
        base = None
        for name, fn in backends.items():
            mem = peak_memory(lambda: fn(q, k, v), device="cpu").peak_bytes  # also the warm-up
            t = time_fn(lambda: fn(q, k, v), repeats=3 if n <= 2048 else 1, warmup=0,
                        device="cpu").median_s
            if base is None:
                base = (t, mem)
            rows.append({"N": n, "backend": name, "ms": t * 1e3, "peak MiB": mem / 2**20,
                         "time/naive": t / base[0], "mem/naive": mem / base[1]})
        del q, k, v
    table(rows)
    last = [r for r in rows if r["N"] == sizes[-1] and r["backend"].startswith("flash")][0]
    if sizes[-1] == 8192:
        ok = last["mem/naive"] <= FLASH_TARGET
        print(f"   target: flash peak memory at N=8192 <= {FLASH_TARGET:.0%} of naive: "
              f"{last['mem/naive']:.2%} -> {'met' if ok else 'NOT met'}")
    return {"rows": rows, "blocks": {"Br": br, "Bc": bc}, "heads": CPU_HEADS, "head_dim": HEAD_DIM}


def measured_bf16_peak(device: str = "cuda") -> float:
    """FLOP/s of a large bf16 GEMM on this GPU: the 'measured peak' TFLOP/s are quoted against."""
    from llmlab.profiling import time_fn

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = time_fn(lambda: a @ b, repeats=10, warmup=3, device=device).median_s
    return 2 * n**3 / t


def run_gpu(quick: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from llmlab.attention import get
    from llmlab.attention.flash import flash_attention
    from llmlab.kernels.flash_attn import flash_attn_func
    from llmlab.profiling import peak_memory, time_fn
    from llmlab.profiling.flops import attention_flops

    dev = "cuda"
    peak = measured_bf16_peak(dev)
    print(f"   measured bf16 GEMM peak: {peak / 1e12:.0f} TFLOP/s (8192³ matmul)")
    sizes = [1024, 4096, 8192] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    tokens = 16384
    free = torch.cuda.mem_get_info()[0]
    rows, ratios = [], []
    for d in (64, 128):
        heads = 2048 // d          # hidden size 2048, as in FlashAttention's benchmarks
        for n in sizes:
            batch = max(1, tokens // n)
            q, k, v = _qkv(batch, n, heads, d, torch.bfloat16, dev, seed=n + d)
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's layout
            flops = attention_flops(batch, heads, n, n, d, causal=True)

            def sdpa_flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

            cands = {"sdpa-flash": sdpa_flash,
                     "flash_triton": lambda: flash_attn_func(q, k, v, causal=True)}
            naive_bytes = 12 * batch * heads * n * n   # bf16 scores, fp32 softmax, copies
            if naive_bytes < 0.5 * free:
                cands["naive"] = lambda: get("naive").forward(q, k, v, causal=True)
            if n <= 8192:
                cands["flash (torch)"] = lambda: flash_attention(q, k, v, causal=True,
                                                                 block_q=128, block_k=128)
            got = {}
            for name, fn in cands.items():
                fn()  # compile / autotune / warm up
                mem = peak_memory(fn, device=dev).peak_bytes
                t = time_fn(fn, repeats=5 if name == "flash (torch)" else 20, warmup=2,
                            device=dev).median_s
                got[name] = (t, mem)
            base = got.get("naive")
            for name, (t, mem) in got.items():
                rows.append({"d": d, "N": n, "batch": batch, "backend": name, "ms": t * 1e3,
                             "TFLOP/s": flops / t / 1e12, "% of peak": 100 * flops / t / peak,
                             "peak MiB": mem / 2**20,
                             "time/naive": t / base[0] if base else float("nan"),
                             "mem/naive": mem / base[1] if base else float("nan")})
            r = got["sdpa-flash"][0] / got["flash_triton"][0]
            ratios.append({"d": d, "N": n, "flash_triton / sdpa-flash throughput": r,
                           "target": f">= {GPU_TARGET}" if n >= 4096 else "-",
                           "met": ("yes" if r >= GPU_TARGET else "NO") if n >= 4096 else "-"})
            del q, k, v, qt, kt, vt
            torch.cuda.empty_cache()
    table(rows)
    print()
    table(ratios)
    return {"rows": rows, "ratios": ratios, "measured_bf16_peak_flops": peak}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (CPU: N up to 2048)")
    p.add_argument("--gpu", action="store_true", help="the GPU configuration (needs CUDA)")
    args = p.parse_args(argv)
    header("attention: naive vs sdpa vs flash vs flash_triton (causal)")
    if args.gpu:
        if not torch.cuda.is_available():
            print("   --gpu needs CUDA; none here, nothing run")
            return 0
        save("attention_gpu", run_gpu(args.quick))
        return 0
    save("attention", run_cpu(args.quick))
    return 0
