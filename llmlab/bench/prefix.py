"""python -m llmlab.bench prefix [--quick] [--repeats N] [--num-blocks N] [--engines ...] [--gpu]:
prefix caches and cache-aware admission on the shared-prefix traces (notebook 13).

Serves ``multiturn_chat`` (chat sessions, each turn sent when the previous answer ends:
:func:`llmlab.engine.sessions.run_sessions`) and ``fewshot`` (prompts sharing one of three
few-shot preambles) on SmolLM2; ``--trace multiturn_long`` serves 40 such sessions (157
turns, shorter answers), where a TTFT p90 rests on sixteen turns rather than four. Five
engines, in one run (``--engines`` picks some; ``none`` is always run, as the base): no
prefix cache, the hash cache and the radix cache under first-come-first-served admission,
and both caches under cache-aware admission (the longest cached prefix first, each request
overtaken at most ``--max-overtakes`` times). Per engine: the prefix hit rate, the prompt
tokens the forwards computed (and their share of the no-cache run's), TTFT p50 / p90 and
throughput. Each engine runs ``--repeats`` times, the engines interleaved in a rotating order; the
table shows medians with the range over repeats. Answers are greedy with EOS ignored, so
every engine generates the same tokens (checked).

The pool is ``--num-blocks`` blocks of ``--block-size`` tokens (default: 48 blocks of 16,
about two thirds of what the multi-turn trace's sessions hold at their longest, so the
caches must evict); ``--num-blocks 0`` uses the engine's default pool (no eviction).
:func:`llmlab.engine.sessions.simulate_sessions` replays a trace on the real scheduler and
cache with a step-cost model in a second, which is how to choose a pool before a run.
"""
from __future__ import annotations

import argparse
import statistics

from ..traces import load_trace
from ._common import header, save, table

ENGINES = (("none", None, "fcfs"), ("hash", "hash", "fcfs"), ("radix", "radix", "fcfs"),
           ("hash+cache-aware", "hash", "cache_aware"),
           ("radix+cache-aware", "radix", "cache_aware"))
TRACES = ("multiturn_chat", "fewshot")
ALL_TRACES = TRACES + ("multiturn_long",)
BASE = "none"


def _spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    med = statistics.median(xs) * scale
    if len(xs) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)}]"


def pick_engines(names: str | None) -> tuple:
    """The rows of :data:`ENGINES` named in ``names`` (comma-separated; None: all), with
    ``none`` always first: the other rows are compared with it."""
    if names is None:
        return ENGINES
    known = [name for name, *_ in ENGINES]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in wanted if n not in known]
    if bad or not wanted:
        raise ValueError(f"--engines={names!r}: unknown {bad or 'empty'}; allowed: "
                         f"{', '.join(known)} (comma-separated)")
    return tuple(e for e in ENGINES if e[0] == BASE or e[0] in wanted)


def run_trace(model, tok, trace: str, *, repeats: int, num_blocks: int | None,
              block_size: int, max_num_seqs: int, max_overtakes: int, time_scale: float,
              limit: int | None, engines: tuple = ENGINES) -> dict:
    """Each of ``engines`` (rows of :data:`ENGINES`) on one trace, ``repeats`` times;
    -> {engine: [SessionRun]}."""
    from ..engine import LLM
    from ..engine.sessions import sessions_of, run_sessions

    sessions = sessions_of(load_trace(trace, tokenizer=tok))[:limit]
    runs: dict[str, list] = {name: [] for name, *_ in engines}
    for r in range(repeats):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for name, cache, admission in order:
            llm = LLM(model, tok, prefix_cache=cache, admission=admission,
                      max_overtakes=max_overtakes, num_blocks=num_blocks,
                      block_size=block_size, max_num_seqs=max_num_seqs)
            run = run_sessions(llm, sessions, time_scale=time_scale)
            runs[name].append(run)
            print(f"   {trace} run {r + 1}/{repeats} {name:17s}: {run.wall_s:6.1f} s, "
                  f"{run.computed_prompt_tokens} prompt tokens computed", flush=True)
    return runs


def summary_rows(runs: dict) -> list[dict]:
    base = statistics.median(r.computed_prompt_tokens for r in runs[BASE])
    rows = []
    for name, rs in runs.items():
        computed = [r.computed_prompt_tokens for r in rs]
        rows.append({"engine": name,
                     "hit rate": f"{statistics.median(r.hit_rate for r in rs):.0%}",
                     "prompt tok sent": rs[0].prompt_tokens,
                     "computed": int(statistics.median(computed)),
                     "vs none": f"{statistics.median(computed) / base:.0%}",
                     "TTFT p50 ms": _spread([r.ttft(0.5) for r in rs], 1e3),
                     "TTFT p90 ms": _spread([r.ttft(0.9) for r in rs], 1e3),
                     "tok/s": _spread([r.throughput for r in rs], 1.0, "{:.1f}"),
                     "preempted": int(statistics.median(r.num_preemptions for r in rs))})
    return rows


def same_tokens(runs: dict) -> bool:
    """Every run of every engine generated the same tokens for every turn."""
    def key(run):
        return sorted((t.session, t.turn, tuple(t.output_token_ids)) for t in run.turns)
    first = key(runs[BASE][0])
    return all(key(r) == first for rs in runs.values() for r in rs)


def main(argv: list[str]) -> int:
    import torch

    import llmlab

    ap = argparse.ArgumentParser(prog="python -m llmlab.bench prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 sessions / 12 requests, 1 repeat")
    ap.add_argument("--model", default="smollm2-135m", help="a registered model name")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine (default 3)")
    ap.add_argument("--num-blocks", type=int, default=48,
                    help="KV blocks in the pool (default 48; 0: the engine's default pool)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-overtakes", type=int, default=8,
                    help="cache-aware: times a request may be overtaken (default 8)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply arrival and think times (smaller: more load)")
    ap.add_argument("--trace", choices=ALL_TRACES, action="append",
                    help=f"only this trace (repeatable; default {' and '.join(TRACES)})")
    ap.add_argument("--engines", default=None,
                    help="comma-separated engines to run besides none (default all five: "
                         + ", ".join(name for name, *_ in ENGINES) + ")")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--gpu", action="store_true", help="run on CUDA (needs a GPU)")
    args = ap.parse_args(argv)
    engines = pick_engines(args.engines)
    if args.repeats < 1 or args.num_blocks < 0 or args.time_scale <= 0:
        raise ValueError(f"--repeats={args.repeats} must be >= 1, --num-blocks="
                         f"{args.num_blocks} >= 0 and --time-scale={args.time_scale} > 0")
    if args.gpu and not torch.cuda.is_available():
        print("prefix --gpu needs CUDA; nothing to do on this machine")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, limit = (1, 4) if args.quick else (args.repeats, None)
    header("prefix caches and cache-aware admission on shared-prefix traces")
    device = "cuda" if args.gpu else "cpu"
    model = llmlab.load_model(args.model, attention="sdpa", device=device)
    tok = llmlab.load_tokenizer(args.model)
    num_blocks = args.num_blocks or None
    print(f"   pool: {num_blocks or 'the engine default'} blocks of {args.block_size} tokens; "
          f"{args.max_num_seqs} seats; torch threads {torch.get_num_threads()}")
    warm = llmlab.LLM(model, tok)           # first-call costs stay out of the table
    warm.generate(["Hello there, how are you today?"] * 2,
                  llmlab.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    results = {}
    for trace in args.trace or TRACES:
        runs = run_trace(model, tok, trace, repeats=repeats, num_blocks=num_blocks,
                         block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_overtakes=args.max_overtakes, time_scale=args.time_scale,
                         limit=limit if trace.startswith("multiturn") else
                         (None if limit is None else 3 * limit), engines=engines)
        rows = summary_rows(runs)
        turns = len(runs[BASE][0].turns)
        print(f"\n-- {trace}: {turns} requests, {repeats} run(s) per engine "
              f"(median [min-max]); same greedy tokens in every run: {same_tokens(runs)}")
        table(rows)
        med = {name: {"computed": statistics.median(r.computed_prompt_tokens for r in rs),
                      "p90": statistics.median(r.ttft(0.9) for r in rs)}
               for name, rs in runs.items()}
        if {"radix+cache-aware", "hash"} <= med.keys():
            share = med["radix+cache-aware"]["computed"] / med[BASE]["computed"]
            p90, hash_p90 = med["radix+cache-aware"]["p90"], med["hash"]["p90"]
            print(f"   radix+cache-aware computed {share:.0%} of the no-cache prompt tokens "
                  f"(target <= 50%: {'met' if share <= 0.5 else 'not met'}); TTFT p90 "
                  f"{p90 * 1e3:.0f} ms against hash's {hash_p90 * 1e3:.0f} ms "
                  f"({'lower' if p90 < hash_p90 else 'not lower'})")
        results[trace] = {"rows": rows, "medians": med, "same_tokens": same_tokens(runs)}
    save("prefix", {"args": vars(args), "results": results})
    return 0
