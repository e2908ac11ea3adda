"""python -m llmlab.bench decode [--quick] [--gpu]: greedy decoding, with and without a KV cache, against HF.

smollm2-135m in the device's default dtype (float32 on CPU, bfloat16 on a GPU; HF gets the
same dtype), a 32-token prompt, 128 new tokens generated past any
end-of-sequence token (``ignore_eos``, so every run does the same work), batch 1 and 8.
Three generators in one run: llmlab without a cache (the O(T²) baseline; at batch 8 it
generates fewer tokens, said in the table), llmlab with the contiguous KV cache, and HF
transformers ``generate`` on the same safetensors files. Prints tokens/s, TTFT and TPOT,
the ratios against HF, and the weight bytes read per second against this machine's
measured copy bandwidth (the memory roof of decode). Each timing is the best of
``--repeats`` runs, HF and llmlab interleaved.

``--gpu``: the same on CUDA with batch 1, 8 and 64 (without CUDA it says so and exits).
Taught in notebook 02.
"""
from __future__ import annotations

import argparse
import time

import torch

from ..device import default_dtype
from ._common import header, save, table

PROMPT_LEN, NEW_TOKENS = 32, 128
TARGETS = {1: 1.2, 8: 1.0}  # llmlab-with-cache tokens/s over HF's, on CPU in float32

_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
         "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
         "wine making. Within fifty years printers in more than two hundred cities had produced "
         "millions of books, and the cost of a single volume had fallen so far that students, "
         "merchants and clergy could all own small libraries of their own.")


def prompts(tokenizer, batch: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """``batch`` different prompts of exactly ``length`` token ids (windows of one text)."""
    ids = tokenizer(_TEXT)["input_ids"]
    if len(ids) < length + batch:
        ids = ids * (1 + (length + batch) // len(ids))
    return [ids[i:i + length] for i in range(batch)]


class _TokenClock:
    """A transformers streamer that notes when each generated token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.t0 = 0.0
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first sends the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def run_hf(hf, ids: list[list[int]], new_tokens: int, device) -> tuple[float, float, list[list[int]]]:
    """-> (seconds, ttft_seconds, generated ids) for HF ``generate``, greedy, exactly ``new_tokens``."""
    from ..device import sync

    x = torch.tensor(ids, device=device)
    clock = _TokenClock() if x.shape[0] == 1 else None  # HF streamers take batch 1 only
    sync(device)
    t0 = time.perf_counter()
    if clock is not None:
        clock.t0 = t0
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                          pad_token_id=hf.generation_config.eos_token_id)
    sync(device)
    secs = time.perf_counter() - t0
    ttft = clock.times[0] if clock is not None and clock.times else float("nan")
    return secs, ttft, out[:, x.shape[1]:].tolist()


def run_llmlab(model, tokenizer, ids, new_tokens: int, kv_cache: str):
    import llmlab

    t0 = time.perf_counter()
    outs = llmlab.generate(model, tokenizer, ids, max_new_tokens=new_tokens, kv_cache=kv_cache,
                           ignore_eos=True)
    secs = time.perf_counter() - t0
    return secs, outs[0].metrics.ttft_s, [o.token_ids for o in outs]


def bench(batches: list[int], new_tokens: int, no_cache_tokens: dict[int, int], repeats: int,
          device: torch.device, attention: str) -> dict:
    import llmlab
    from transformers import AutoModelForCausalLM

    from ..models.registry import model_dir
    from ..profiling.flops import weight_bytes
    from ..profiling.roofline import measure_bandwidth

    tok = llmlab.load_tokenizer("smollm2-135m")
    model = llmlab.load_model("smollm2-135m", attention=attention, device=device)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")),
                                              dtype=model.dtype).to(device).eval()
    wbytes = weight_bytes(model.config, 4)
    bw = measure_bandwidth(device=device)
    print(f"   measured copy bandwidth: {bw / 1e9:.1f} GB/s; weights read per decode step: "
          f"{wbytes / 1e6:.0f} MB ({str(model.dtype).removeprefix('torch.')}); llmlab attention backend: {attention}")

    # warm-up: first calls pay one-off costs (allocator, thread pools, lazy imports)
    warm = prompts(tok, 1)
    run_hf(hf, warm, 4, device)
    run_llmlab(model, tok, warm, 4, "contiguous")

    rows, results = [], []
    for b in batches:
        ids = prompts(tok, b)
        best: dict[str, tuple] = {}
        for r in range(repeats):
            order = ("hf", "contiguous") if r % 2 == 0 else ("contiguous", "hf")
            for name in order:
                if name == "hf":
                    res = run_hf(hf, ids, new_tokens, device)
                else:
                    res = run_llmlab(model, tok, ids, new_tokens, name)
                if name not in best or res[0] < best[name][0]:
                    best[name] = res
        nc = no_cache_tokens[b]
        best["none"] = run_llmlab(model, tok, ids, nc, "none")
        same = all(a[:len(h)] == h[:len(a)] for a, h in zip(best["contiguous"][2], best["hf"][2]))
        hf_rate = b * new_tokens / best["hf"][0]
        for name, label, n in (("none", "llmlab, no cache", nc),
                               ("contiguous", "llmlab, KV cache", new_tokens),
                               ("hf", "HF transformers", new_tokens)):
            secs, ttft, _ = best[name]
            rate = b * n / secs
            tpot = (secs - ttft) / (n - 1) if ttft == ttft else float("nan")
            step_s = secs / n  # prefill included: honest for all three
            row = {"batch": b, "generator": label, "new tokens": n, "s": secs,
                   "tok/s": rate, "TTFT ms": ttft * 1e3, "TPOT ms": tpot * 1e3,
                   "weight GB/s": wbytes / step_s / 1e9, "of copy BW": wbytes / step_s / bw,
                   "x HF": rate / hf_rate}
            rows.append(row)
        results.append({"batch": b, "cache_over_hf": rows[-2]["tok/s"] / hf_rate,
                        "cache_over_none": rows[-2]["tok/s"] / rows[-3]["tok/s"],
                        "same_tokens_as_hf": same, "target": TARGETS.get(b)})
    table(rows)
    print()
    for r in results:
        tgt = f" (target >= {r['target']:.1f}x: {'met' if r['cache_over_hf'] >= r['target'] else 'missed'})" \
            if r["target"] and device.type == "cpu" else ""
        print(f"   batch {r['batch']}: llmlab with cache = {r['cache_over_hf']:.2f}x HF tokens/s{tgt}, "
              f"{r['cache_over_none']:.1f}x llmlab without cache; greedy tokens same as HF: "
              f"{r['same_tokens_as_hf']}")
    b1 = [row for row in rows if row["batch"] == 1 and row["generator"] == "llmlab, KV cache"]
    if b1:
        tpot = b1[0]["TPOT ms"] / 1e3
        print(f"   batch 1 decode: {wbytes / 1e6:.0f} MB of weights per token in {tpot * 1e3:.1f} ms "
              f"(TPOT) = {wbytes / tpot / 1e9:.1f} GB/s, {wbytes / tpot / bw:.0%} of the measured "
              f"copy bandwidth (the memory roof)")
    return {"rows": rows, "summary": results, "bandwidth_bytes_per_s": bw, "weight_bytes": wbytes,
            "attention": attention}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat")
    ap.add_argument("--gpu", action="store_true", help="the CUDA configuration (batch 1, 8, 64)")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs (default 2)")
    ap.add_argument("--attention", default="sdpa", help="llmlab attention backend (default sdpa)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu:
        if not torch.cuda.is_available():
            print("decode --gpu needs CUDA; none here (run without --gpu for the CPU benchmark)")
            return 0
        device, batches = torch.device("cuda"), [1, 8, 64]
        new, no_cache = NEW_TOKENS, {1: NEW_TOKENS, 8: NEW_TOKENS, 64: 32}
    else:
        device, batches = torch.device("cpu"), [1, 8]
        new, no_cache = NEW_TOKENS, {1: NEW_TOKENS, 8: 32}
    repeats = args.repeats
    if args.quick:
        new, repeats = 32, 1
        no_cache = {b: min(n, 16) for b, n in no_cache.items()}
    header(f"decode: smollm2-135m, {str(default_dtype(device)).removeprefix('torch.')}, greedy, {PROMPT_LEN}-token prompt, {new} new tokens")
    payload = bench(batches, new, no_cache, repeats, device, args.attention)
    save("decode" + ("_gpu" if args.gpu else ""), payload)
    return 0
