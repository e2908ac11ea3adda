"""python -m llmlab.bench serve-http: the HTTP server under Poisson load, static vs continuous.

For each scheduler a real server (``python -m llmlab.serve``) is started in a
subprocess on a free localhost port. For each request rate of the sweep, the first
``--requests`` prompts of the trace (``data/traces/cpu.jsonl``) are sent at Poisson
arrival times (the same times for both schedulers), all streaming over real HTTP
(httpx), greedy, EOS ignored, each generating its trace output length capped at
``--max-tokens``. Measured at the client: TTFT, TPOT and end-to-end latency (p50, p90,
p99), throughput, goodput (requests per second whose TTFT met ``--ttft-target``), and
lost requests (no complete answer; must be 0). A rate is *sustained* when the p90 TTFT
stays within the target and nothing is lost; the report gives, per scheduler, the
largest rate sustained, and continuous over static, at ``--ttft-target`` and, read off
the same sweep, at 0.5, 1, 2, 4 and 8 s (:func:`sustained_by_target`).

The default run (smollm2-135m, 20 requests per rate, rates 0.5..8 req/s, at most 32
new tokens, 16 seats, p90 TTFT target 2 s) takes a few minutes on a 2-core CPU: about
80 s of arrivals per scheduler, plus draining and start-up. Taught in notebook 10.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from ..serve.client import poisson_arrivals, stream_completion, summarize
from ..serve.process import free_port, start_server, stop_server
from ..traces import TRACES_DIR, load_trace
from ._common import header, save, table

SCHEDULERS = ("static", "continuous")


async def run_load(base_url: str, model: str, bodies: list[dict], arrivals: list[float]) -> dict:
    """Send each body at its arrival time (seconds from now), all streaming; -> the
    results in order and the wall time until the last one ended."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0),
                                 limits=limits) as client:
        t0 = time.perf_counter()

        async def one(body, at):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await stream_completion(client, "/v1/completions", {"model": model, **body})

        results = await asyncio.gather(*(one(b, a) for b, a in zip(bodies, arrivals)))
    return {"results": list(results), "wall_s": time.perf_counter() - t0}


def request_bodies(trace, max_tokens: int) -> list[dict]:
    """Greedy, EOS ignored, each request's trace output length capped at ``max_tokens``."""
    return [{"prompt": r.prompt, "max_tokens": min(r.output_tokens, max_tokens),
             "temperature": 0, "ignore_eos": True} for r in trace]


def sustained_rate(rows: list[dict], target_s: float) -> float:
    """The largest rate whose p90 TTFT is within ``target_s`` with nothing lost (0.0 if
    none is). A rate that misses does not hide a higher one that meets the target: on
    a shared machine one slow run at a low rate is noise, not the knee."""
    ok = [r["rate"] for r in rows if not r["lost"] and r["ttft_p90_s"] <= target_s]
    return max(ok, default=0.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench serve-http",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trace", default=str(TRACES_DIR / "cpu.jsonl"))
    ap.add_argument("--requests", type=int, default=20, help="requests per rate")
    ap.add_argument("--rates", default="0.5,1,2,4,8", help="requests per second, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=32, help="cap on each output length")
    ap.add_argument("--ttft-target", type=float, default=2.0, help="p90 TTFT target, seconds")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="server seats")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--seed", type=int, default=0, help="of the arrival times")
    ap.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    ap.add_argument("--server-log", default=None, help="append the servers' output to this file")
    ap.add_argument("--gpu", action="store_true",
                    help="GPU-sized sweep (needs CUDA): 32 requests, rates 1..32, 64 tokens")
    args = ap.parse_args(argv)
    if args.gpu:
        args.requests, args.max_tokens = 32, 64
        args.rates, args.max_num_seqs, args.ttft_target = "1,2,4,8,16,32", 32, 0.5
    try:
        args.rates = sorted(float(x) for x in args.rates.split(","))
    except ValueError:
        raise ValueError(f"--rates={args.rates!r} must be numbers separated by commas") from None
    if not args.rates or min(args.rates) <= 0:
        raise ValueError(f"--rates={args.rates} must all be > 0")
    args.schedulers = args.schedulers.split(",")
    bad = [s for s in args.schedulers if s not in SCHEDULERS]
    if bad:
        raise ValueError(f"--schedulers: {bad}; allowed: {list(SCHEDULERS)}")
    for name in ("requests", "max_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.ttft_target > 0:
        raise ValueError(f"--ttft-target={args.ttft_target} must be > 0")
    return args


def _run(coro):
    """``asyncio.run(coro)``, also from inside a running event loop (a Jupyter kernel has
    one): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def rate_sweep(base_url: str, model: str, bodies: list[dict], rates: list[float],
               ttft_target_s: float, seed: int = 0, label: str = "",
               keep_results: bool = False, warmup: bool = True) -> list[dict]:
    """One load run per rate against a running server (a warm-up of two requests first,
    unless ``warmup=False``); -> a summary row per rate
    (:func:`~llmlab.serve.client.summarize`), with the raw
    :class:`~llmlab.serve.client.StreamResult` list under ``"results"`` if ``keep_results``."""
    if warmup:
        _run(run_load(base_url, model, bodies[:2], [0.0, 0.0]))

    rows = []
    for rate in rates:
        arrivals = poisson_arrivals(rate, len(bodies), seed=seed)
        run = _run(run_load(base_url, model, bodies, arrivals))
        s = summarize(run["results"], run["wall_s"], ttft_target_s)
        rows.append({"scheduler": label, "rate": rate, **s,
                     **({"results": run["results"]} if keep_results else {})})
        print(f"   {label:>10} @ {rate:g} req/s: p90 TTFT {s['ttft_p90_s']:.2f} s, "
              f"{s['throughput_tok_s']:.1f} tok/s, lost {s['lost']}", flush=True)
    return rows


def sweep(args, scheduler: str, bodies: list[dict], log) -> list[dict]:
    """One server with ``scheduler``; one load run per rate; -> a summary row per rate."""
    port = free_port()
    proc = start_server(args.model, scheduler, port,
                        ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024"],
                        log=log)
    try:
        return rate_sweep(f"http://127.0.0.1:{port}", args.model, bodies, args.rates,
                          args.ttft_target, args.seed, scheduler)
    finally:
        code = stop_server(proc)
        print(f"   {scheduler} server stopped by SIGINT (exit status {code})")


EXTRA_TARGETS = (0.5, 1.0, 2.0, 4.0, 8.0)    # p90 TTFT targets (s) the report also reads off


def sustained_by_target(rows: list[dict], schedulers, targets) -> list[dict]:
    """One row per p90 TTFT target: the largest rate each scheduler sustains within it
    (:func:`sustained_rate`) and continuous / static where both sustain one (None where
    static sustains no rate of the sweep: the ratio is undefined there, not infinite)."""
    out = []
    for t in sorted(set(targets)):
        row = {"p90 TTFT target s": t}
        for s in schedulers:
            row[f"{s} req/s"] = sustained_rate([r for r in rows if r["scheduler"] == s], t)
        if "continuous" in schedulers and "static" in schedulers:
            st = row["static req/s"]
            row["continuous / static"] = row["continuous req/s"] / st if st else None
        out.append(row)
    return out


def report(rows: list[dict], args) -> dict:
    """The table, and the largest rate each scheduler sustains within the target."""
    table([{"scheduler": r["scheduler"], "rate req/s": r["rate"],
            "TTFT p50/p90/p99 s": "/".join(f"{r[f'ttft_p{q}_s']:.2f}" for q in (50, 90, 99)),
            "TPOT p50/p90/p99 ms": "/".join(f"{r[f'tpot_p{q}_s'] * 1e3:.0f}" for q in (50, 90, 99)),
            "e2e p50/p90/p99 s": "/".join(f"{r[f'e2e_p{q}_s']:.2f}" for q in (50, 90, 99)),
            "tok/s": r["throughput_tok_s"], "goodput req/s": r["goodput_req_s"],
            "lost": r["lost"]} for r in rows])
    best = {s: sustained_rate([r for r in rows if r["scheduler"] == s], args.ttft_target)
            for s in args.schedulers}
    print(f"\n   largest rate sustained with p90 TTFT <= {args.ttft_target:g} s and nothing lost:")
    for s, v in best.items():
        print(f"     {s}: {v:g} req/s")
    if set(SCHEDULERS) <= set(best):
        if best["static"]:
            print(f"     continuous / static: {best['continuous'] / best['static']:.2f}x")
        else:
            print("     continuous / static: undefined (static sustains no rate of the sweep; "
                  "add lower --rates or raise --ttft-target)")
    print("   the same, read off the sweep at other targets (ratio '-': static sustains none):")
    table([{k: ("-" if v is None else v) for k, v in r.items()}
           for r in sustained_by_target(rows, args.schedulers,
                                        EXTRA_TARGETS + (args.ttft_target,))])
    print(f"   lost requests in all runs: {sum(r['lost'] for r in rows)}")
    return best


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import llmlab
    import torch

    if args.gpu and not torch.cuda.is_available():
        print("serve-http --gpu needs CUDA; nothing to do on this machine")
        return 0

    header(f"serve-http: {Path(args.trace).name}, {args.model}, {args.max_num_seqs} seats, "
           f"rates {args.rates} req/s")
    trace = load_trace(args.trace, args.requests, max_output=args.max_tokens)
    bodies = request_bodies(trace, args.max_tokens)
    tok = llmlab.load_tokenizer(args.model)
    lens = [len(tok(b["prompt"])["input_ids"]) for b in bodies]
    print(f"   {len(bodies)} requests per rate; prompt tokens {min(lens)}..{max(lens)}; output "
          f"tokens {min(b['max_tokens'] for b in bodies)}..{max(b['max_tokens'] for b in bodies)};"
          f" greedy, EOS ignored, streamed; Poisson arrivals (seed {args.seed}); "
          f"server threads: torch default ({os.cpu_count()} CPUs)")
    log = open(args.server_log, "a") if args.server_log else None
    try:
        rows = [r for s in args.schedulers for r in sweep(args, s, bodies, log)]
    finally:
        if log is not None:
            log.close()
    best = report(rows, args)
    payload = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows,
               "sustained_rate": best}
    save("serve_http", payload)
    if args.json:
        print(json.dumps(payload, indent=1, default=str))
    return 0 if all(r["lost"] == 0 for r in rows) else 1
