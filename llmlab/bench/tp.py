"""python -m llmlab.bench tp [--quick] [--gpu]: tensor-parallel decode time per token and all-reduce cost.

CPU (default): SmolLM2-135M greedy decode with a KV cache as one process (1 and 2
threads) and as tp = 3 ranks of one thread each (tp = 2 is refused: 9 heads), plus
gloo all-reduce time against message size for 2 and 3 ranks. --gpu: NCCL, one GPU per
rank, for every valid degree up to the GPU count (needs at least 2 GPUs).
Taught in notebook 07.
"""
from __future__ import annotations

import argparse

import torch

from ._common import header, save, table

PROMPT = "Explain in two sentences why the sky is blue."


def _prompt_ids(model_name: str) -> tuple[list[int], int | None]:
    import llmlab
    from llmlab.generate import encode_prompts

    tok = llmlab.load_tokenizer(model_name)
    return encode_prompts(tok, [PROMPT], chat=True)[0], None  # no EOS stop: fixed token count


def run_cpu(quick: bool) -> dict:
    from llmlab.config import ModelConfig
    from llmlab.models import resolve
    from llmlab.parallel import check_tp_degree, launch
    from llmlab.parallel.comm import allreduce_per_token, time_allreduce
    from llmlab.parallel.workers import generate_on_ranks, run_sequence

    name = "smollm2-135m"
    cfg = ModelConfig.from_file(resolve(name))
    ids, _ = _prompt_ids(name)
    n_tok = 8 if quick else 24
    sizes = [256, 2304, 65536, 1 << 20] if quick else [256, 2304, 16384, 65536, 262144, 1 << 20, 4 << 20]
    rows, runs, ar = [], {}, {}
    for tp, threads in ((1, 1), (1, 2), (2, 1), (3, 1)):
        label = f"tp={tp}, {threads} thread{'s' if threads > 1 else ''}/rank"
        try:
            check_tp_degree(cfg, tp)
        except ValueError as exc:
            print(f"  {label}: refused: {str(exc).split(';')[-1].strip()}")
            continue
        calls = [(generate_on_ranks, (name, ids, n_tok))]
        if tp > 1:
            calls.append((time_allreduce, (sizes, 10 if quick else 30)))
        out = launch(run_sequence, tp, calls, threads=threads)
        run = out[0]
        runs[(tp, threads)] = run
        if tp > 1:
            ar[tp] = out[1]
        rows.append({"config": label, "ranks x threads": f"{tp}x{threads}",
                     "ms/token": run.s_per_token * 1e3, "prefill ms": run.prefill_s * 1e3,
                     "params/rank MiB": run.memory[0].param_bytes / 2**20,
                     "peak RSS/rank MiB": max(m.peak_bytes for m in run.memory) / 2**20})
    base = runs[(1, 1)].s_per_token
    for r, key in zip(rows, runs):
        r["speedup vs tp=1x1"] = base / runs[key].s_per_token
    same = all(run.tokens == runs[(1, 1)].tokens for run in runs.values())
    print(f"\nSmolLM2-135M greedy decode, {n_tok} tokens, prompt {len(ids)} tokens "
          f"(median decode step; same tokens in every configuration: {same})")
    table(rows)
    if 2 not in ar:  # smollm2 refuses tp=2, so measure 2-rank all-reduce on its own
        ar[2] = launch(time_allreduce, 2, sizes, 10 if quick else 30)
    print("\ngloo all-reduce, float32 message, median of the slowest rank (measured)")
    ar_rows = []
    for i, size in enumerate(sizes):
        row = {"bytes": ar[2][i]["bytes"]}
        for tp in sorted(ar):
            row[f"tp={tp} us"] = ar[tp][i]["us"]
            row[f"tp={tp} GB/s"] = ar[tp][i]["algbw_GBps"]
        ar_rows.append(row)
    table(ar_rows)
    acct = allreduce_per_token(cfg, 3)
    hid = [r for r in ar[3] if r["bytes"] == acct.message_bytes][0]["us"]
    comm_ms = acct.allreduces_per_token * hid / 1e3
    print(f"\nper token at tp=3: {acct.allreduces_per_token} all-reduces of {acct.message_bytes} B "
          f"(= {acct.per_token_bytes / 1024:.0f} KiB); at the measured {hid:.0f} us each that is "
          f"{comm_ms:.1f} ms of the measured {runs[(3, 1)].s_per_token * 1e3:.1f} ms/token")
    return {"decode": rows, "allreduce": ar_rows, "same_tokens": same,
            "tp3_comm_ms_per_token": comm_ms}


def run_gpu(quick: bool) -> dict | None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"tp --gpu needs at least 2 CUDA GPUs; this machine has {n}. Nothing to run.")
        return None
    from llmlab.config import ModelConfig
    from llmlab.models import resolve
    from llmlab.parallel import launch, valid_tp_degrees
    from llmlab.parallel.comm import time_allreduce
    from llmlab.parallel.workers import generate_on_ranks, run_sequence

    name = "smollm2-135m"
    cfg = ModelConfig.from_file(resolve(name))
    ids, _ = _prompt_ids(name)
    n_tok = 16 if quick else 64
    sizes = [2304, 65536, 1 << 20, 16 << 20]
    rows, ar_rows, base = [], [], None
    for tp in valid_tp_degrees(cfg, up_to=n):
        calls = [(generate_on_ranks, (name, ids, n_tok, "sdpa", "bfloat16"))]
        if tp > 1:
            calls.append((time_allreduce, (sizes, 20)))
        out = launch(run_sequence, tp, calls, device="cuda")
        run = out[0]
        base = base or run.s_per_token
        rows.append({"tp": tp, "ms/token": run.s_per_token * 1e3, "speedup": base / run.s_per_token,
                     "params/rank MiB": run.memory[0].param_bytes / 2**20})
        if tp > 1:
            ar_rows += [{"tp": tp, **r} for r in out[1]]
    print(f"\nSmolLM2-135M bf16 greedy decode on GPUs, {n_tok} tokens (NCCL)")
    table(rows)
    print("\nNCCL all-reduce")
    table(ar_rows)
    return {"decode": rows, "allreduce": ar_rows}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench tp", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and message sizes")
    ap.add_argument("--gpu", action="store_true", help="NCCL on CUDA GPUs (needs >= 2)")
    args = ap.parse_args(argv)
    header("tensor parallelism (llmlab.parallel)")
    payload = run_gpu(args.quick) if args.gpu else run_cpu(args.quick)
    if payload is not None:
        save("tp_gpu" if args.gpu else "tp", payload)
    return 0
