"""python -m llmlab.bench moe [--quick] [--gpu]: one MoE layer, three dispatch strategies.

A Mixtral-shaped MoE layer (8 SwiGLU experts, top-2, intermediate = 3.5 × hidden) scaled
down 8× (hidden 512, intermediate 1792) on CPU, full size (4096 / 14336, bfloat16) with
``--gpu``. Tokens from 1 to 4096 go through ``dense`` (every expert on every token),
``loop`` (per-expert gather) and ``grouped`` (sort by expert, one GEMM per expert).
A second table holds the tokens fixed and grows the number of experts at top-2: the
grouped path's time per token should stay roughly flat while dense grows with E.
Times are the best of a few repeats (the least disturbed by other work on the machine).
Taught in notebook 06.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..device import device_name
from ..layers.moe import DISPATCH, SparseMoE
from ..profiling import time_fn
from . import _common

CPU_SHAPE = dict(hidden=512, inter=1792)      # Mixtral 8x7B / 8
GPU_SHAPE = dict(hidden=4096, inter=14336)    # Mixtral 8x7B


@dataclass
class MoELayerCase:
    tokens: int
    hidden: int = 512
    inter: int = 1792
    experts: int = 8
    top_k: int = 2
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0


def make_layer(case: MoELayerCase) -> tuple[SparseMoE, torch.Tensor]:
    """A randomly initialized (seeded) SparseMoE and input x [tokens, hidden]."""
    g = torch.Generator().manual_seed(case.seed)
    layer = SparseMoE(case.hidden, case.inter, case.experts, case.top_k)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    x = torch.randn(case.tokens, case.hidden, generator=g)
    return layer.to(case.device, case.dtype).eval(), x.to(case.device, case.dtype)


def time_dispatch(layer: SparseMoE, x: torch.Tensor, dispatch: str, repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds for one forward of ``layer`` on ``x`` with ``dispatch``."""
    layer.dispatch = dispatch
    with torch.inference_mode():
        return time_fn(lambda: layer(x), repeats=repeats, warmup=1, device=x.device).min_s


def sweep_tokens(tokens: list[int], shape: dict, device: str, dtype, repeats: int,
                 check: bool = True) -> list[dict]:
    """Time the three strategies at each token count; ``check`` also measures max |Δ| vs loop."""
    rows = []
    for n in tokens:
        layer, x = make_layer(MoELayerCase(n, device=device, dtype=dtype, **shape))
        err = float("nan")
        if check:
            with torch.inference_mode():
                layer.dispatch = "loop"
                ref = layer(x).float()
                err = 0.0
                for name in DISPATCH:
                    layer.dispatch = name
                    err = max(err, (layer(x).float() - ref).abs().max().item())
        t = {name: time_dispatch(layer, x, name, repeats) for name in DISPATCH}
        rows.append({"tokens": n, "dense ms": t["dense"] * 1e3, "loop ms": t["loop"] * 1e3,
                     "grouped ms": t["grouped"] * 1e3, "dense/grouped": t["dense"] / t["grouped"],
                     "loop/grouped": t["loop"] / t["grouped"], "max |Δ| vs loop": f"{err:.1e}"})
    return rows


def sweep_experts(experts: list[int], tokens: int, shape: dict, device: str, dtype,
                  repeats: int) -> list[dict]:
    """Time dense and grouped dispatch at ``tokens`` tokens, top-2, for each number of experts."""
    rows = []
    for e in experts:
        layer, x = make_layer(MoELayerCase(tokens, experts=e, device=device, dtype=dtype, **shape))
        t = {name: time_dispatch(layer, x, name, repeats) for name in ("dense", "grouped")}
        params = 3 * shape["hidden"] * shape["inter"]
        rows.append({"experts": e, "tokens": tokens, "params (M)": e * params / 1e6, "active (M)": 2 * params / 1e6,
                     "dense µs/token": t["dense"] / tokens * 1e6,
                     "grouped µs/token": t["grouped"] / tokens * 1e6,
                     "dense/grouped": t["dense"] / t["grouped"]})
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench moe")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller sizes")
    ap.add_argument("--gpu", action="store_true", help="full Mixtral layer size on CUDA, bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    if args.gpu:
        if not torch.cuda.is_available():
            print("moe --gpu needs CUDA (none here); run without --gpu for the CPU configuration")
            return 0
        device, dtype, shape = "cuda", torch.bfloat16, GPU_SHAPE
    else:
        device, dtype, shape = "cpu", torch.float32, CPU_SHAPE
    tokens = [1, 64, 512] if args.quick else [1, 16, 64, 256, 512, 1024, 4096]
    experts = [2, 8, 32] if args.quick else [2, 4, 8, 16, 32]
    fixed = 512
    _common.header(f"MoE dispatch: one layer, hidden {shape['hidden']}, intermediate "
                   f"{shape['inter']}, 8 experts, top-2, {str(dtype).replace('torch.', '')}")
    rows = sweep_tokens(tokens, shape, device, dtype, args.repeats)
    _common.table(rows)
    print(f"\n-- {fixed} tokens, top-2, growing the number of experts ({device_name(device)}) --")
    erows = sweep_experts(experts, fixed, shape, device, dtype, args.repeats)
    _common.table(erows)
    big = [r for r in rows if r["tokens"] >= 512]
    if big:
        worst = min(r["dense/grouped"] for r in big)
        print(f"\ngrouped vs dense at >= 512 tokens: at least {worst:.1f}x faster "
              f"(the FLOP ratio is E/k = 4x)")
    _common.save("moe", {"shape": shape, "tokens": rows, "experts": erows})
    return 0
