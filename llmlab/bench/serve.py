"""python -m llmlab.bench serve: a request trace served four ways, in one run.

1. HF transformers ``generate`` in padded static batches of ``max_num_seqs`` requests
   (left padding; each batch runs ``max_new_tokens`` = its longest requested output,
   which is what a padded static batch costs);
2. llmlab's engine with ``scheduler="static"`` (same batches, paged KV cache);
3. llmlab's engine with ``scheduler="continuous"`` (iteration-level scheduling, packed
   prefill, preemption by recompute);
4. the same with chunked prefill at a small token budget per step (``--chunk-budget``):
   the same work cut so that no step is long, which is what TPOT feels;
5. with ``--compile``, continuous with ``LLM(compile=True)``: every decode-only step runs
   a graph compiled per capture size and block-table width (notebook 11); its warm-up
   serves the whole trace once, so that every graph the trace needs is compiled (and
   timed apart: "compile s") before the measured rounds.

Every request of the trace (``data/traces/cpu.jsonl`` by default) arrives at time 0 and
generates exactly its ``output_tokens`` (greedy, EOS ignored, as serving benchmarks do),
so TTFT includes the time spent waiting for a seat. Reported: generated tokens/s
(useful tokens only), mean and p90 TTFT and TPOT, and the ratios. A sample of requests
is re-generated alone to check that batching did not change a single token.
Taught in notebook 05.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from ..models.registry import model_dir
from ..profiling.metrics import RequestMetrics, summarize
from ..traces import TRACES_DIR, TraceRequest, load_trace
from ._common import header, save, table

HF_NAME = "HF transformers, padded static"
CONT = "llmlab continuous"
STATIC = "llmlab static"
COMPILED = "llmlab continuous, compiled"


class _StepClock:
    """A transformers streamer that only records when each generation step ends."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:          # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(hf_model, tokenizer, trace: list[TraceRequest], batch_size: int) -> dict:
    """HF generate in padded static batches, in trace order; per-request metrics."""
    import copy

    from transformers.generation.streamers import BaseStreamer

    class Clock(_StepClock, BaseStreamer):
        pass

    tokenizer = copy.copy(tokenizer)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_cfg = copy.deepcopy(hf_model.generation_config)
    gen_cfg.eos_token_id = None            # run every row to max_new_tokens, like ignore_eos
    gen_cfg.do_sample = False
    gen_cfg.temperature, gen_cfg.top_p, gen_cfg.top_k = None, None, None
    metrics, tokens, positions = [], [], 0
    t0 = time.perf_counter()
    for start in range(0, len(trace), batch_size):
        batch = trace[start:start + batch_size]
        enc = tokenizer.pad({"input_ids": [r.prompt_token_ids for r in batch]},
                            return_tensors="pt").to(hf_model.device)
        longest = max(r.output_tokens for r in batch)
        clock = Clock()
        gen_cfg.max_new_tokens, gen_cfg.pad_token_id = longest, pad
        out = hf_model.generate(**enc, generation_config=gen_cfg, streamer=clock)
        gen = out[:, enc["input_ids"].shape[1]:]
        # the padded prompt once, then one position per row for every further token
        positions += len(batch) * (enc["input_ids"].shape[1] + longest - 1)
        for row, r in enumerate(batch):
            n = r.output_tokens
            tokens.append(gen[row, :n].tolist())
            metrics.append(RequestMetrics(len(r.prompt_token_ids), n,
                                          clock.times[0] - t0, clock.times[n - 1] - t0))
    wall = time.perf_counter() - t0
    return {"metrics": metrics, "tokens": tokens, "wall_s": wall, "positions": positions}


def run_llmlab(llm, trace: list[TraceRequest]) -> dict:
    """The trace through an llmlab ``LLM`` in one ``generate`` call; per-request metrics."""
    from ..engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_tokens, ignore_eos=True)
              for r in trace]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in trace], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} requests were rejected, e.g.: {bad[0]}")
    return {"metrics": [o.metrics for o in outs], "tokens": [o.outputs[0].token_ids for o in outs],
            "wall_s": wall, "stats": llm.stats, "positions": llm.stats.computed_tokens}


def _row(name: str, res: dict) -> dict:
    s = summarize(res["metrics"], res["wall_s"])
    return {"system": name, "tok/s": s["tokens_per_s"], "wall s": res["wall_s"],
            "TTFT mean s": s["ttft_mean_s"], "TTFT p90 s": s["ttft_p90_s"],
            "TPOT mean ms": s["tpot_mean_s"] * 1e3, "TPOT p90 ms": s["tpot_p90_s"] * 1e3}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with --gpu and --quick applied and every value checked."""
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACES_DIR / "cpu.jsonl"),
                    help="a trace name (data/traces) or the path of a JSONL trace")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="engine seats, and the size of the padded static batches")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=None, help="cap each request's output")
    ap.add_argument("--output-scale", type=float, default=1.0,
                    help="multiply every output length (keeps their spread)")
    ap.add_argument("--check", type=int, default=4, help="requests re-generated alone")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-hf", action="store_true", help="only the llmlab schedulers")
    ap.add_argument("--chunk-budget", type=int, default=128,
                    help="also run continuous with chunked prefill at this many tokens per "
                         "step (0: skip)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="serve the trace this many times per system, in rotating order; "
                         "report the median round (ratios are per round, so machine-load "
                         "drift between systems cancels)")
    ap.add_argument("--compile", action="store_true",
                    help="also run continuous with compile=True (the warm-up round compiles)")
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, 8 seats, outputs scaled by 1/4")
    ap.add_argument("--gpu", action="store_true", help="GPU-sized run (needs CUDA)")
    args = ap.parse_args(argv)
    args.device = "cpu"
    if args.gpu and torch.cuda.is_available():
        args.device = "cuda"
        args.trace = str(TRACES_DIR / "sharegpt_like.jsonl")
        args.requests, args.max_num_seqs, args.max_output = 200, 64, 256
    if args.quick:
        args.requests, args.max_num_seqs, args.output_scale = 16, 8, 0.25
        args.check = min(args.check, 2)
    if args.requests < 0 or args.output_scale <= 0:
        raise ValueError(f"--requests={args.requests} must be >= 0 (0: all) and "
                         f"--output-scale={args.output_scale} > 0")
    if args.chunk_budget < 0:
        raise ValueError(f"--chunk-budget={args.chunk_budget} must be >= 0 (0: skip)")
    for name in ("max_num_seqs", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def print_trace(trace: list[TraceRequest]) -> None:
    """One line: how many requests, their prompt and output lengths, how they are served."""
    outs = [r.output_tokens for r in trace]
    ins = [len(r.prompt_token_ids) for r in trace]
    print(f"   {len(trace)} requests; prompt tokens {min(ins)}..{max(ins)} (mean {sum(ins) / len(ins):.0f});"
          f" output tokens {min(outs)}..{max(outs)} (mean {sum(outs) / len(outs):.0f}); "
          f"torch threads {torch.get_num_threads()}; greedy, EOS ignored; all arrive at t=0")


def serve_rounds(serve, systems: list[str], trace: list[TraceRequest], warm: list[TraceRequest],
                 rounds: int) -> dict[str, list[dict]]:
    """Each system serves ``warm`` once (one-time setup), then ``trace`` ``rounds`` times;
    the order of the systems rotates every round so that drift in machine load is shared."""
    for name in systems:
        serve(name, warm)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(rounds):
        for name in systems[r % len(systems):] + systems[:r % len(systems)]:
            runs[name].append(serve(name, trace))
    return runs


def report_rounds(runs: dict[str, list[dict]], systems: list[str]) -> dict[str, list[float]]:
    """Print each round's wall time and continuous's per-round speedups; -> those ratios."""
    round_ratios: dict[str, list[float]] = {}
    print(f"   {len(runs[CONT])} rounds (each system's order rotates); wall s per round:")
    for name in systems:
        print(f"     {name}: " + ", ".join(f"{x['wall_s']:.1f}" for x in runs[name]))
    print("   per round, llmlab continuous tokens/s over:")
    for name in (n for n in systems if n != CONT):
        ratios = [o["wall_s"] / c["wall_s"]          # same tokens: a ratio of tokens/s
                  for c, o in zip(runs[CONT], runs[name])]
        round_ratios[name] = ratios
        print(f"     {name}: " + ", ".join(f"{x:.2f}×" for x in ratios)
              + f"  (median {statistics.median(ratios):.2f}×)")
    return round_ratios


def report_results(results: dict[str, dict], systems: list[str]) -> list[dict]:
    """The table of the median rounds, the speedups, and where they come from."""
    rows = [_row(k, v) for k, v in results.items()]
    table(rows)
    cont = results[CONT]
    tps = {r["system"]: r["tok/s"] for r in rows}
    print()
    for name, v in tps.items():
        if name != CONT:
            print(f"   {CONT} / {name}: {tps[CONT] / v:.2f}× tokens/s")
    # a speedup is (work saved) × (cost per unit of work): token positions are the work
    print("   the speedup split into work saved and time per token position:")
    for name in (n for n in systems if n != CONT):
        work = results[name]["positions"] / cont["positions"]
        speed = tps[CONT] / tps[name]
        print(f"     {name}: {results[name]['positions']} positions = {work:.2f}× continuous's "
              f"{cont['positions']}; measured {speed:.2f}×, so continuous spends {work / speed:.2f}× "
              "its time per position")
    for name in systems[systems.index(STATIC):]:
        st = results[name]["stats"]
        longest = max(r.end_s - r.start_s for r in st.steps)
        print(f"   {name}: {len(st.steps)} steps (longest {longest:.2f} s), {st.computed_tokens} "
              f"token positions computed for {st.real_tokens} real ({st.padding_tokens} pads), "
              f"{st.num_preemptions} preemptions")
    return rows


def check_parity(model, tok, trace: list[TraceRequest], results: dict[str, dict],
                 k: int) -> tuple[list[int], dict[str, int]]:
    """Re-generate ``k`` requests (spread over the trace) alone with ``llmlab.generate``;
    -> (their indices, how many each system got token for token)."""
    from ..generate import generate

    k = max(0, min(k, len(trace)))
    picks = sorted({round(i * (len(trace) - 1) / max(k - 1, 1)) for i in range(k)}) if k else []
    labels = {STATIC: "static", CONT: "continuous", HF_NAME: "HF", COMPILED: "compiled"}
    same = {"static": 0, "continuous": 0, "chunked": 0, "HF": 0, "compiled": 0}
    for i in picks:
        r = trace[i]
        ref = generate(model, tok, [r.prompt_token_ids], max_new_tokens=r.output_tokens,
                       kv_cache="contiguous", ignore_eos=True)[0].token_ids
        for name, res in results.items():
            same[labels.get(name, "chunked")] += res["tokens"][i] == ref
    return picks, same


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.gpu and args.device != "cuda":
        print("serve --gpu needs CUDA; nothing to do on this machine")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    import llmlab
    from ..engine import LLM

    header(f"serve: {Path(args.trace).name}, {args.model}, max_num_seqs={args.max_num_seqs}")
    tok = llmlab.load_tokenizer(args.model)
    trace = load_trace(args.trace, args.requests or None, max_output=args.max_output,
                       tokenizer=tok, output_scale=args.output_scale)
    print_trace(trace)
    model = llmlab.load_model(args.model, attention="sdpa", device=args.device)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir(args.model)),
                                                  dtype=model.dtype).to(args.device).eval()
    chunked = f"llmlab continuous, chunked prefill ({args.chunk_budget} tokens/step)"
    systems = ([HF_NAME] if hf is not None else []) + [STATIC, CONT] \
        + ([chunked] if args.chunk_budget else []) + ([COMPILED] if args.compile else [])

    def serve(name: str, requests: list[TraceRequest]) -> dict:
        if name == HF_NAME:
            return run_hf(hf, tok, requests, args.max_num_seqs)
        kw = {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk_budget} \
            if name == chunked else {}
        llm = LLM(model, tok, scheduler="static" if name == STATIC else "continuous",
                  max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                  compile=name == COMPILED, **kw)
        if name == COMPILED and requests is warm:    # compile every shape the trace visits
            from ..compile import graphs_compiled

            t0, g0 = time.perf_counter(), graphs_compiled()
            res = run_llmlab(llm, trace)
            print(f"   {COMPILED}: warm-up over the whole trace {time.perf_counter() - t0:.1f} s, "
                  f"{graphs_compiled() - g0} graphs compiled (not counted below)")
            return res
        return run_llmlab(llm, requests)

    # first calls pay one-time setup (allocator, GEMM kernels)
    warm = [dataclasses.replace(r, output_tokens=min(4, r.output_tokens))
            for r in trace[:args.max_num_seqs]]
    runs = serve_rounds(serve, systems, trace, warm, args.rounds)
    del hf
    round_ratios = report_rounds(runs, systems) if args.rounds > 1 else {}
    # the table shows each system's median round (by wall time)
    results = {name: sorted(rs, key=lambda x: x["wall_s"])[(len(rs) - 1) // 2]
               for name, rs in runs.items()}
    rows = report_results(results, systems)

    # correctness: a sample of requests generated alone must match token for token
    picks, same = check_parity(model, tok, trace, results, args.check)
    if picks:
        print(f"   greedy tokens equal to generating alone (requests {picks}): "
              f"continuous {same['continuous']}/{len(picks)}, static {same['static']}/{len(picks)}"
              + (f", chunked {same['chunked']}/{len(picks)}" if args.chunk_budget else "")
              + (f", compiled {same['compiled']}/{len(picks)}" if args.compile else "")
              + (f", HF batched {same['HF']}/{len(picks)}" if not args.skip_hf else ""))
    save("serve", {"trace": Path(args.trace).name, "requests": len(trace),
                   "max_num_seqs": args.max_num_seqs, "threads": torch.get_num_threads(),
                   "rows": rows, "rounds": args.rounds, "continuous_over_per_round": round_ratios,
                   "parity_checked": len(picks), "parity_same": same})
    return 0
