"""python -m llmlab.bench quant [--quick] [--threads N]: weight-only quantization against float32.

smollm2-135m with every scheme of :func:`llmlab.quantize` (int8 rounded to nearest, and
int8 with per-channel scales folded into the norms (``equalize=True``) and GPTQ codes, both
calibrated on the workbook's calibration prose; int4 with groups of 32, GGUF Q4_1, fp8) and
the float32 model, in one run,
schemes interleaved in every repeat:

* decode tokens/s at batch 1 and 8 (greedy, contiguous KV cache, a 32-token prompt,
  ``ignore_eos`` so every run does the same work; decode = tokens after the first / their time);
* prefill tokens/s (one forward over a 256-token prompt);
* weight bytes as stored, and each scheme on notebook 02's roofline: the batch-1 decode
  rate the memory roof allows (measured copy bandwidth / weight bytes) and the share reached;
* KLD (nats/token), top-1 agreement and the perplexity change against float32 over the
  workbook's evaluation text, and greedy agreement on chat prompts;
* where a batch-1 decode step goes (:func:`step_breakdown`): the time outside the matmuls
  (the same step with every linear layer skipped) and in them, against their memory roof.

Each timing is the median of ``--repeats`` runs after a warm-up, with the min-max spread.
Where ``llama_cpp`` is importable, llama.cpp runs the shipped Q4_1 GGUF (``--gguf``, or the
one ``fetch`` keeps beside the model) on the same prompt and the ratio is printed;
otherwise it prints "llama.cpp not installed". Taught in notebook 08.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ._common import header, save, table, timed_parser

PROMPT_LEN, PREFILL_LEN = 32, 256
TARGETS = {"int8": 1.5, "int8 eq+gptq": 1.5, "int4": 2.0}   # batch-1 decode tok/s over fp32's
KLD_TARGET = {"int8": 1e-3, "int8 eq+gptq": 1e-3}
BREAKDOWN = ("fp32", "int8", "int4", "q4_1")    # schemes in the step breakdown


def _decode_rate(model, tok, ids: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s: batch × (new_tokens - 1) / (time after the first token)."""
    import llmlab

    t0 = time.perf_counter()
    outs = llmlab.generate(model, tok, ids, max_new_tokens=new_tokens, kv_cache="contiguous",
                           ignore_eos=True)
    secs = time.perf_counter() - t0
    ttft = outs[0].metrics.ttft_s
    return len(ids) * (new_tokens - 1) / (secs - ttft)


@torch.inference_mode()
def _prefill_rate(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(ids, last_only=True)
    return ids.numel() / (time.perf_counter() - t0)


@contextlib.contextmanager
def _linears_skipped():
    """Within the block every linear layer (float or quantized) returns zeros of the right
    shape without reading its weight: what is left of a decode step is everything else
    (norms, RoPE, attention, the KV cache, Python and the dispatcher)."""
    from torch import nn

    from llmlab.quant import QuantizedLinear

    def zeros(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)

    saved = nn.Linear.forward, QuantizedLinear.forward
    nn.Linear.forward = QuantizedLinear.forward = zeros
    try:
        yield
    finally:
        nn.Linear.forward, QuantizedLinear.forward = saved


@torch.inference_mode()
def _step_ms(model, prompt: list[int], steps: int) -> float:
    """Milliseconds per batch-1 decode step of the model alone (contiguous cache, no
    sampling): median over ``steps`` steps after two warm-up steps."""
    from ..generate import ContiguousBatch

    batch = ContiguousBatch(model, [prompt], 0, steps + 3)
    batch.prefill()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        batch.decode([0], [prompt[i % len(prompt)]])
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


def step_breakdown(models: dict, prompt: list[int], bandwidth: float, steps: int = 24,
                   repeats: int = 3) -> list[dict]:
    """Where a batch-1 decode step goes, per model: the whole step, the step with every
    linear layer skipped (:func:`_linears_skipped`), their difference (the matmuls), and
    the bandwidth the matmuls reach over the weight bytes they read. Medians of
    ``repeats`` interleaved runs; "step ms runs" lists each run's whole step."""
    from llmlab.quant import weight_nbytes

    whole: dict[str, list[float]] = {}
    rest: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, m in models.items():
            whole.setdefault(name, []).append(_step_ms(m, prompt, steps))
            with _linears_skipped():
                rest.setdefault(name, []).append(_step_ms(m, prompt, steps))
    rows = []
    for name, m in models.items():
        w, r = statistics.median(whole[name]), statistics.median(rest[name])
        mm = max(w - r, 1e-6)
        nbytes = weight_nbytes(m)
        rows.append({"scheme": name, "step ms": w, "outside matmuls ms": r, "matmuls ms": mm,
                     "step ms runs": list(whole[name]),
                     "matmul GB/s": nbytes / mm / 1e6, "of copy bw": nbytes / (mm / 1e3) / bandwidth,
                     "roof ms": nbytes / bandwidth * 1e3})
    return rows


def _find_gguf() -> str | None:
    """The shipped SmolLM2 Q4_1 GGUF, kept beside the converted model by
    ``python -m llmlab.models fetch smollm2-135m`` (None where an older fetch did not)."""
    from ..models.registry import model_dir

    kept = sorted(model_dir("smollm2-135m").glob("*.gguf"))
    return str(kept[0]) if kept else None


def llama_cpp_decode_rate(gguf: str | None, prompt_ids: list[int], new_tokens: int, repeats: int,
               threads: int | None):
    """llama.cpp decode tokens/s on ``gguf`` (median of ``repeats``, decode only), or a
    string saying why it did not run."""
    try:
        import llama_cpp
    except ImportError:
        return "llama.cpp not installed"
    gguf = gguf or _find_gguf()
    if not gguf:
        return ("llama.cpp installed, but no GGUF beside the model: pass --gguf, or re-run "
                "python -m llmlab.models fetch smollm2-135m --force (it keeps the file)")
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads or torch.get_num_threads(),
                          verbose=False)
    rates = []
    for _ in range(repeats + 1):               # the first is a warm-up
        llm.reset()
        llm.eval(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([llm.sample(temp=0.0)])
        rates.append(new_tokens / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def _measure(models: dict, tok, new_tokens: int, repeats: int, prefill_ids) -> dict:
    """{(scheme, "decode b1" | "decode b8" | "prefill"): [tokens/s per repeat]}."""
    from .decode import prompts

    batches = {1: prompts(tok, 1), 8: prompts(tok, 8)}
    for m in models.values():     # warm-up: kernel packing, thread pools, allocator
        _decode_rate(m, tok, batches[1], 4)
        _prefill_rate(m, prefill_ids[:, :32])
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, m in models.items():   # interleaved: a noisy minute hits every scheme
            for b, ids in batches.items():
                samples.setdefault((name, f"decode b{b}"), []).append(
                    _decode_rate(m, tok, ids, new_tokens))
            samples.setdefault((name, "prefill"), []).append(_prefill_rate(m, prefill_ids))
    return samples


def _rows(models: dict, samples: dict, quality: dict, greedy: dict, bw: float) -> list[dict]:
    from llmlab.quant import weight_nbytes

    def med(name, what):
        return statistics.median(samples[(name, what)])

    def spread(name, what):
        v = samples[(name, what)]
        return f"{min(v):.1f}-{max(v):.1f}"

    rows, fp_bytes = [], weight_nbytes(models["fp32"])
    for name, m in models.items():
        nbytes, d1 = weight_nbytes(m), med(name, "decode b1")
        q, g = quality.get(name), greedy.get(name)
        rows.append({"scheme": name, "weight MB": nbytes / 1e6, "x smaller": fp_bytes / nbytes,
                     "decode b1 tok/s": d1, "b1 min-max": spread(name, "decode b1"),
                     "x fp32 b1": d1 / med("fp32", "decode b1"),
                     "decode b8 tok/s": med(name, "decode b8"),
                     "b8 min-max": spread(name, "decode b8"),
                     "x fp32 b8": med(name, "decode b8") / med("fp32", "decode b8"),
                     "prefill tok/s": med(name, "prefill"),
                     "prefill min-max": spread(name, "prefill"),
                     "x fp32 prefill": med(name, "prefill") / med("fp32", "prefill"),
                     "roof b1 tok/s": bw / nbytes, "of roof": d1 * nbytes / bw,
                     "KLD": q.kld if q else 0.0, "top-1": q.top1 if q else 1.0,
                     "ppl delta": q.ppl_delta if q else 0.0,
                     "greedy agree": g.fraction if g else 1.0})
    return rows


def _verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["scheme"] in TARGETS:
            ok = r["x fp32 b1"] >= TARGETS[r["scheme"]]
            kt = KLD_TARGET.get(r["scheme"])
            kok = kt is None or r["KLD"] <= kt
            out.append(f"{r['scheme']}: {r['x fp32 b1']:.2f}x fp32 batch-1 decode "
                       f"(target >= {TARGETS[r['scheme']]}x: {'met' if ok else 'missed'})"
                       + (f", KLD {r['KLD']:.2e} (target <= {kt:g}: {'met' if kok else 'missed'})"
                          if kt else ""))
    return out


def bench(new_tokens: int, repeats: int, quality_tokens: int, gguf: str | None,
          threads: int | None, lm_head: str = "q8_0", greedy_tokens: int = 32) -> dict:
    import llmlab
    from llmlab.quant import eval as qeval

    from ..profiling.roofline import measure_bandwidth
    from .decode import prompts

    tok = llmlab.load_tokenizer("smollm2-135m")
    base = llmlab.load_model("smollm2-135m", attention="sdpa")
    models = {"fp32": base}
    for scheme in ("int8", "int4", "q4_1", "fp8"):
        models[scheme] = llmlab.quantize(base, scheme, lm_head=lm_head)
        if scheme == "int8":       # the same format: channel scales folded in, GPTQ codes
            models["int8 eq+gptq"] = llmlab.quantize(base, "int8", lm_head=lm_head,
                                                     rounding="gptq", equalize=True)
    bw = measure_bandwidth()
    from ..kernels import cpu_gemv

    print(f"   measured copy bandwidth: {bw / 1e9:.1f} GB/s; lm_head/embedding: {lm_head} in every "
          f"quantized scheme; q/k/v and gate/up fused; {cpu_gemv.describe()} (float32 "
          "activations) up to 8 rows, the float32 reference (dequantize + matmul) above")
    eval_ids = qeval.eval_token_ids(tok)
    prefill_ids = torch.tensor([(eval_ids * 2)[:PREFILL_LEN]])
    samples = _measure(models, tok, new_tokens, repeats, prefill_ids)
    quant_models = {k: v for k, v in models.items() if k != "fp32"}
    quality = qeval.compare_logits(base, quant_models, eval_ids[:quality_tokens], window=512)
    greedy = {}
    if greedy_tokens:
        ref = qeval.greedy_answers(base, tok, max_new_tokens=greedy_tokens)
        greedy = {k: qeval.greedy_agreement(
            ref, qeval.greedy_answers(m, tok, max_new_tokens=greedy_tokens))
            for k, m in quant_models.items()}
    rows = _rows(models, samples, quality, greedy, bw)
    table(rows)
    print(f"\n   decode = generated tokens after the first / their time (prefill excluded); "
          f"prefill = one {PREFILL_LEN}-token forward; median of {repeats} after a warm-up, "
          f"min-max beside it")
    print(f"   quality over the first {min(quality_tokens, len(eval_ids))} tokens of "
          f"{qeval.EVAL_TEXT.name}; greedy agree = share of fp32's greedy tokens reproduced "
          f"({len(qeval.CHAT_PROMPTS)} chat prompts, {greedy_tokens} tokens)")
    verdicts = _verdicts(rows)
    for v in verdicts:
        print("   " + v)
    print("   roofline (notebook 02): batch-1 decode reads every weight once per token, so its "
          "memory roof is bandwidth / weight bytes (roof b1 tok/s) and 'of roof' is the share "
          "reached; prefill reuses each weight for all prompt tokens and stays compute-bound "
          "(x fp32 prefill column)")
    print("\n   where a batch-1 decode step goes (model forward only, no sampling; 'outside "
          "matmuls' = the same step with every linear layer skipped):")
    prompt = prompts(tok, 1)[0]
    steps = step_breakdown({k: models[k] for k in BREAKDOWN}, prompt, bw,
                           repeats=max(1, min(repeats, 3)))
    table(steps)
    lc = llama_cpp_decode_rate(gguf, prompt, new_tokens, repeats, threads)
    if isinstance(lc, str):
        print("   " + lc)
    else:
        by = {r["scheme"]: r["decode b1 tok/s"] for r in rows}
        st = {r["scheme"]: r for r in steps}
        print(f"   llama.cpp on the same Q4_1 GGUF: {lc:.1f} tok/s decode at batch 1 "
              f"({1000 / lc:.1f} ms a step); llmlab q4_1 = {by['q4_1'] / lc:.2f}x, "
              f"int4 = {by['int4'] / lc:.2f}x of it. What separates llmlab's int4 step "
              f"({st['int4']['step ms']:.1f} ms) from it: {st['int4']['outside matmuls ms']:.1f} ms "
              f"outside the matmuls (Python, dispatch, small ops) and matmuls at "
              f"{st['int4']['of copy bw']:.0%} of copy bandwidth "
              f"({st['int4']['matmuls ms']:.1f} ms against a {st['int4']['roof ms']:.1f} ms roof)")
    return {"rows": rows, "steps": steps, "bandwidth_bytes_per_s": bw, "targets": verdicts,
            "llama_cpp": lc}


def main(argv: list[str]) -> int:
    def more(ap):
        ap.add_argument("--quality-tokens", type=int, default=100_000,
                        help="tokens of the evaluation text for KLD (default: all of it)")
        ap.add_argument("--gguf", default=None, help="a GGUF file for the llama.cpp comparison")
        ap.add_argument("--lm-head", default="q8_0", help="q8_0 (default), int8, int4, bf16 or "
                        "fp32: the tied embedding / lm_head of the quantized models")
        ap.add_argument("--greedy-tokens", type=int, default=32,
                        help="greedy tokens per chat prompt for the agreement column (0: skip)")

    args = timed_parser("quant", __doc__, "16 new tokens, 1 repeat, 256 quality tokens", 5, 64,
                        argv, more)
    if args is None:
        return 0
    new, repeats, qtok = args.new_tokens, args.repeats, args.quality_tokens
    if args.quick:
        new, repeats, qtok = 16, 1, 256
    header(f"quant: smollm2-135m weight-only quantization vs float32, {PROMPT_LEN}-token prompt, "
           f"{new} new tokens, prefill {PREFILL_LEN} tokens")
    payload = bench(new, repeats, qtok, args.gguf, args.threads, args.lm_head,
                    0 if args.quick else args.greedy_tokens)
    save("quant", payload)
    return 0
