"""python -m llmlab.bench overhead [--quick] [--gpu]: what a decode step spends outside the
matmuls, eager against compiled, per weight format, against HF transformers and llama.cpp.

SmolLM2-135M, one decode step after a 32-token context (compiled: on the 256-slot static
cache that a 32-token prompt with 64 new tokens gets), batch 1 and 8, for each scheme
(fp32; int8 and int4 weights, :func:`llmlab.quantize`) and mode (``eager``: the model's
forward on the contiguous cache; ``compiled``: :mod:`llmlab.compile`'s step on the static
cache; ``compiled+fused``: the same after :func:`llmlab.layers.fused.fuse_model`). Per
row it prints:

* decode tok/s of the step (batch / median step time; no sampling), and its spread;
* operator calls per step (:func:`llmlab.profiling.count_ops`: what crosses the dispatcher;
  a compiled graph's fused kernels are not operators) and the ms spent outside the
  matmuls (:func:`llmlab.profiling.step_breakdown`);
* % of the memory roof: the time the weights take to stream at this machine's measured
  bandwidth (one read of every weight byte per step, a model), over the step time. The
  bandwidth is the faster of a copy (bytes read and written) and a pure read (a ``sum``),
  both on 256 MiB, best of 5.

Then whole generations in one run (64 new tokens, tok/s with the prefill included):
llmlab eager and compiled against HF transformers ``generate`` (float32, its default
dynamic cache) at batch 1 and 8, and llama.cpp on the shipped Q4_1 GGUF where
``llama_cpp`` is importable. A scheme whose compiled step cannot be built says why in its
row. Taught in notebook 11.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..profiling.overhead import MIN_REPEATS
from ._common import header, save, table, timed_parser

CONTEXT = 32
# room for this many steps before a step rewinds its cache: 32 + 200 tokens fit the static
# cache's 256-slot bucket, the one ``generate`` compiles for a 32-token prompt and 64 new
# tokens (256 steps would need the 512-slot bucket, twice the attention reads)
STEPS = 200
STEP_SAMPLES = 3             # times --repeats: one decode step varies more than a generation
MODES = ("eager", "compiled", "compiled+fused")
_FUSED: dict = {}


def fused(model):
    """A copy of ``model`` with its layers fused (:func:`llmlab.layers.fused.fuse_model`,
    the PyTorch ops: one qkv and one gate_up matmul per layer), made once per model."""
    import copy

    from ..layers.fused import fuse_model

    if id(model) not in _FUSED:
        _FUSED[id(model)] = fuse_model(copy.deepcopy(model), "torch")
    return _FUSED[id(model)]


def step_rows(models: dict, batches: list[int], repeats: int, bandwidth: float) -> list[dict]:
    from ..profiling.overhead import count_ops, make_decode_step, step_breakdown
    from ..quant import weight_nbytes

    rows = []
    for scheme, model in models.items():
        roof_s = weight_nbytes(model) / bandwidth
        for mode in MODES:
            for b in batches:
                row = {"scheme": scheme, "mode": mode, "batch": b}
                try:
                    m = fused(model) if mode.endswith("fused") else model
                    step = make_decode_step(m, b, CONTEXT, steps=STEPS,
                                            compile=mode.startswith("compiled"))
                    t0 = time.perf_counter()
                    step()                                  # builds the graph when compiled
                    first_s = time.perf_counter() - t0
                    ops = count_ops(step)
                    br = step_breakdown(step, repeats=STEP_SAMPLES * repeats)
                except Exception as e:                      # noqa: BLE001 - reported in the row
                    rows.append({**row, "tok/s": f"not built: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:80]}"})
                    continue
                rows.append({**row, "tok/s": b / br.median_s,
                             "spread": f"{b / br.max_s:.1f}-{b / br.min_s:.1f}",
                             "ops/step": ops.total, "matmul ops": ops.matmul_calls,
                             "ms/step": br.median_s * 1e3, "ms outside matmuls": br.outside_s * 1e3,
                             "% memory roof": 100 * roof_s / br.median_s,
                             "first call s": first_s})
    return rows


def _generate_rate(fn, batch: int, new_tokens: int) -> float:
    """tok/s of one whole generation, prefill included (HF's batched ``generate`` has no
    first-token time to subtract): batch × new_tokens / seconds."""
    t0 = time.perf_counter()
    fn()
    return batch * new_tokens / (time.perf_counter() - t0)


def generation_rows(model, tok, batches: list[int], new_tokens: int, repeats: int,
                    threads: int | None) -> tuple[list[dict], object]:
    """Whole generations, interleaved per repeat: llmlab eager, llmlab compiled, HF."""
    import llmlab

    from ..models.registry import model_dir
    from .decode import prompts, run_hf
    from .quant import _find_gguf, llama_cpp_decode_rate
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")),
                                              dtype=model.dtype).eval().to(model.device)
    rows = []
    for b in batches:
        ids = prompts(tok, b, CONTEXT)

        def ours(**kw):
            llmlab.generate(model, tok, ids, max_new_tokens=new_tokens, ignore_eos=True, **kw)

        def theirs():
            run_hf(hf, ids, new_tokens, model.device)

        runs = {"llmlab eager": lambda: ours(kv_cache="contiguous"),
                "llmlab compiled": lambda: ours(compile=True), "HF transformers": theirs}
        rates = {k: [] for k in runs}
        for f in runs.values():                       # warm-up (and the compile)
            f()
        for _ in range(repeats):
            for k, f in runs.items():
                rates[k].append(_generate_rate(f, b, new_tokens))
        hf_rate = statistics.median(rates["HF transformers"])
        for k, r in rates.items():
            med = statistics.median(r)
            rows.append({"batch": b, "generator": k, "tok/s": med,
                         "spread": f"{min(r):.1f}-{max(r):.1f}", "vs HF": med / hf_rate})
    lc = llama_cpp_decode_rate(_find_gguf(), prompts(tok, 1, CONTEXT)[0], new_tokens, repeats,
                               threads)
    return rows, lc


def bench(quick: bool, repeats: int, new_tokens: int, threads: int | None) -> dict:
    import llmlab
    from ..profiling.overhead import measure_op_overhead
    from ..profiling.roofline import measure_bandwidth
    from ..cache.static import slots_for

    model = llmlab.load_model("smollm2-135m", attention="sdpa")
    tok = llmlab.load_tokenizer("smollm2-135m")
    models = {"fp32": model}
    if not quick:
        models["int8"] = llmlab.quantize(model, "int8")
        models["int4"] = llmlab.quantize(model, "int4")
    batches = [1] if quick else [1, 8]
    copy_bw, read_bw = measure_bandwidth(), measure_bandwidth(read_only=True)
    bw = max(copy_bw, read_bw)
    t_op = measure_op_overhead()
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s, read bandwidth {read_bw / 1e9:.1f} GB/s "
          f"(the memory roof: the faster); one tiny eager op t_op = {t_op * 1e6:.2f} µs; "
          f"torch threads {torch.get_num_threads()}")
    steps = step_rows(models, batches, repeats, bw)
    slots = slots_for(CONTEXT + STEPS, model.config.max_position_embeddings)
    print(f"\n-- one decode step (context {CONTEXT}; compiled: a static cache of {slots} "
          f"slots), median of {STEP_SAMPLES * repeats} --")
    table(steps, "{:.3g}")
    gens, lc = generation_rows(model, tok, batches, new_tokens, repeats, threads)
    print(f"\n-- whole generations (a {CONTEXT}-token prompt and {new_tokens} new tokens, "
          f"float32, prefill included), median of {repeats} --")
    table(gens, "{:.3g}")
    print(f"llama.cpp (Q4_1 GGUF, decode only, batch 1): "
          + (f"{lc:.1f} tok/s" if isinstance(lc, float) else lc))
    return {"steps": steps, "generations": gens, "llama_cpp": lc, "bandwidth": bw, "t_op": t_op}


def main(argv: list[str]) -> int:
    args = timed_parser("overhead", __doc__, "fp32 only, batch 1", 5, 64, argv,
                        min_repeats=MIN_REPEATS)   # what step_breakdown takes a median of
    if args is None:
        return 0
    header("overhead: eager vs compiled decode steps")
    save("overhead", bench(args.quick, args.repeats, args.new_tokens, args.threads))
    return 0
