"""python -m llmlab.bench quant [--quick] [--threads N]: weight-only quantization against float32.

smollm2-135m with every scheme of :func:`llmlab.quantize` (int8, int4 with groups of 32,
GGUF Q4_1, fp8) and the float32 model, in one run, schemes interleaved in every repeat:

* decode tokens/s at batch 1 and 8 (greedy, contiguous KV cache, a 32-token prompt,
  ``ignore_eos`` so every run does the same work; decode = tokens after the first / their time);
* prefill tokens/s (one forward over a 256-token prompt);
* weight bytes as stored, and what decode reads per second against this machine's
  measured copy bandwidth (the memory roof of notebook 02);
* KLD (nats/token) and top-1 agreement against float32 over the workbook's evaluation text.

Each timing is the median of ``--repeats`` runs after a warm-up, with the min-max spread.
Where ``llama_cpp`` is importable and a GGUF file is given (``--gguf``), llama.cpp runs it
too and the ratio is printed; otherwise it says why not. Taught in notebook 08.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ._common import header, save, table

PROMPT_LEN, PREFILL_LEN = 32, 256
TARGETS = {"int8": 1.5, "int4": 2.0}     # batch-1 decode tokens/s over float32's
KLD_TARGET = {"int8": 1e-3}


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


def _llama_cpp(gguf: str | None, prompt_ids: list[int], new_tokens: int, threads: int | None):
    """llama.cpp decode tokens/s on ``gguf``, or a string saying why it did not run."""
    try:
        import llama_cpp
    except ImportError:
        return "llama.cpp not installed"
    if not gguf:
        return "llama.cpp installed, but no --gguf file given"
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads or torch.get_num_threads(),
                          verbose=False)
    llm.eval(prompt_ids)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return new_tokens / (time.perf_counter() - t0)


def bench(new_tokens: int, repeats: int, quality_tokens: int, gguf: str | None,
          threads: int | None, lm_head: str = "int8") -> dict:
    import llmlab
    from llmlab.quant import eval as qeval
    from llmlab.quant import weight_nbytes

    from ..profiling.roofline import measure_bandwidth
    from .decode import prompts

    tok = llmlab.load_tokenizer("smollm2-135m")
    base = llmlab.load_model("smollm2-135m", attention="sdpa")
    models = {"fp32": base}
    for scheme in ("int8", "int4", "q4_1", "fp8"):
        models[scheme] = llmlab.quantize(base, scheme, lm_head=lm_head)
    bw = measure_bandwidth()
    print(f"   measured copy bandwidth: {bw / 1e9:.1f} GB/s; lm_head/embedding: {lm_head} in every "
          "quantized scheme; packed CPU kernels take bfloat16 activations")

    batches = {1: prompts(tok, 1), 8: prompts(tok, 8)}
    eval_ids = qeval.eval_token_ids(tok)
    prefill_ids = torch.tensor([(eval_ids * 2)[:PREFILL_LEN]])
    for m in models.values():     # warm-up: kernel packing, thread pools, allocator
        _decode_rate(m, tok, batches[1], 4)
        _prefill_rate(m, prefill_ids[:, :32])

    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, m in models.items():   # interleaved: a noisy minute hits every scheme
            for b, ids in batches.items():
                samples.setdefault((name, f"decode b{b}"), []).append(_decode_rate(m, tok, ids, new_tokens))
            samples.setdefault((name, "prefill"), []).append(_prefill_rate(m, prefill_ids))

    quality = qeval.compare_logits(base, {k: v for k, v in models.items() if k != "fp32"},
                                   eval_ids[:quality_tokens], window=512)

    def med(name, what):
        return statistics.median(samples[(name, what)])

    rows = []
    fp_bytes = weight_nbytes(base)
    for name, m in models.items():
        nbytes = weight_nbytes(m)
        d1 = med(name, "decode b1")
        spread = samples[(name, "decode b1")]
        q = quality.get(name)
        rows.append({"scheme": name, "weight MB": nbytes / 1e6, "x smaller": fp_bytes / nbytes,
                     "decode b1 tok/s": d1, "b1 min-max": f"{min(spread):.1f}-{max(spread):.1f}",
                     "x fp32 b1": d1 / med("fp32", "decode b1"),
                     "decode b8 tok/s": med(name, "decode b8"),
                     "x fp32 b8": med(name, "decode b8") / med("fp32", "decode b8"),
                     "prefill tok/s": med(name, "prefill"),
                     "x fp32 prefill": med(name, "prefill") / med("fp32", "prefill"),
                     "b1 GB/s": nbytes * d1 / 1e9, "of copy BW": nbytes * d1 / bw,
                     "KLD": q.kld if q else 0.0, "top-1": q.top1 if q else 1.0,
                     "ppl": q.ppl if q else next(iter(quality.values())).ppl_ref})
    table(rows)
    print(f"\n   quality over the first {min(quality_tokens, len(eval_ids))} tokens of "
          f"{qeval.EVAL_TEXT.name}; timings: median of {repeats} after a warm-up")
    verdicts = []
    for r in rows:
        if r["scheme"] in TARGETS:
            ok = r["x fp32 b1"] >= TARGETS[r["scheme"]]
            kt = KLD_TARGET.get(r["scheme"])
            kok = kt is None or r["KLD"] <= kt
            verdicts.append(f"{r['scheme']}: {r['x fp32 b1']:.2f}x fp32 batch-1 decode "
                            f"(target >= {TARGETS[r['scheme']]}x: {'met' if ok else 'missed'})"
                            + (f", KLD {r['KLD']:.2e} (target <= {kt:g}: {'met' if kok else 'missed'})"
                               if kt else ""))
    for v in verdicts:
        print("   " + v)
    print("   roofline: decode reads every weight once per step, so its rate follows the bytes; "
          "prefill reuses each weight for all prompt tokens and stays near float32's rate "
          "(x fp32 prefill column)")
    lc = _llama_cpp(gguf, batches[1][0], new_tokens, threads)
    if isinstance(lc, str):
        print("   " + lc)
    else:
        q4 = [r for r in rows if r["scheme"] == "q4_1"][0]["decode b1 tok/s"]
        print(f"   llama.cpp on {gguf}: {lc:.1f} tok/s at batch 1; llmlab q4_1 = {q4 / lc:.2f}x")
    return {"rows": rows, "bandwidth_bytes_per_s": bw, "targets": verdicts,
            "llama_cpp": lc}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 repeat, 256 quality tokens")
    ap.add_argument("--repeats", type=int, default=5, help="median of this many runs (default 5)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    ap.add_argument("--quality-tokens", type=int, default=100_000,
                    help="tokens of the evaluation text for KLD (default: all of it)")
    ap.add_argument("--gguf", default=None, help="a GGUF file for the llama.cpp comparison")
    ap.add_argument("--lm-head", default="int8", help="int8 (default), bf16 or fp32: the tied "
                    "embedding / lm_head of the quantized models")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2:
        raise ValueError(f"--repeats={args.repeats} must be >= 1 and --new-tokens="
                         f"{args.new_tokens} >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    new, repeats, qtok = args.new_tokens, args.repeats, args.quality_tokens
    if args.quick:
        new, repeats, qtok = 16, 1, 256
    header(f"quant: smollm2-135m weight-only quantization vs float32, {PROMPT_LEN}-token prompt, "
           f"{new} new tokens, prefill {PREFILL_LEN} tokens")
    payload = bench(new, repeats, qtok, args.gguf, args.threads, args.lm_head)
    save("quant", payload)
    return 0
