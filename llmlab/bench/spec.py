"""python -m llmlab.bench spec [--quick]: speculative decoding against KV-cache greedy, batch 1.

smollm2-135m in the device's default dtype, greedy, up to ``--new-tokens`` new tokens per
prompt (stopping at the end-of-sequence token; speculation gives the same tokens, checked,
so equal work). Two prompt sets: *edit* (rewrite or correct a given text: the answer copies
the prompt, where n-gram drafts shine) and *chat* (open questions: little to copy). For
each draft method (``ngram``, ``early_exit``) and k, in one run:

* speedup: the baseline's median time over speculation's (medians of ``--repeats`` runs
  per prompt, summed over the set; each repeat runs the baseline and every configuration
  in turn, so load changes hit all alike), and whether every token matched;
* acceptance rate (accepted / drafted) and tokens per target forward;
* c, the draft's cost per drafted token relative to one baseline decode step, and the
  verify step's cost relative to it;
* the cost model speedup ≈ E[tokens per step] / (1 + k·c), which assumes verifying k+1
  tokens costs one decode step (true where decode is memory-bound; a CPU pays more:
  the verify/step column).

Taught in notebook 09.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..device import default_dtype
from ..speculative import cost_model_speedup
from ._common import header, save, table, timed_parser

EDIT_PROMPTS = [     # a paragraph to correct, answered by copying it with a few changes
    "Fix the typos in this paragraph and write out the corrected paragraph: The library in our "
    "town opened in 1965. Every week, hundreds of peple come to borrow books, read newspapers "
    "and use the computers. The childrens section has story time on Saturday mornings, and the "
    "libarians help students with their homework after school. Last year the town council voted "
    "to extend the opening hours, so the library now closes at eight in the evening instead of six.",
    "Correct the spelling mistakes in this text and return the corrected text only: Yesterday I "
    "went to the libary to borow a book about the histroy of Rome. The librarian was very "
    "helpfull and showed me were the books were. I found a big book with many pictures of old "
    "buildings, and I also took a smaller book about the Roman army. I will return them both "
    "next week.",
    "Fix the grammar in this paragraph and write it out again: My brother and me goes to the "
    "park every Sunday. We plays football with our friends, and after the game we eats ice "
    "cream near the lake. Last week it were raining, so we stayed at home and watched a film "
    "about a dog who find his way home.",
]
CHAT_PROMPTS = [
    "What are three good habits for staying healthy?",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue?",
]
CONFIGS = [("ngram", 2), ("ngram", 4), ("ngram", 8), ("early_exit", 2), ("early_exit", 4)]
TARGET = 1.5            # n-gram on the edit prompts, CPU: speedup over KV-cache greedy


def _run(model, tok, prompt: str, new_tokens: int, spec) -> tuple[float, object]:
    import llmlab

    t0 = time.perf_counter()
    g = llmlab.generate(model, tok, prompt, max_new_tokens=new_tokens, kv_cache="contiguous",
                        speculative=spec)
    return time.perf_counter() - t0, g


def bench(new_tokens: int, repeats: int, configs, early_layers: int, device,
          attention: str) -> dict:
    import llmlab

    tok = llmlab.load_tokenizer("smollm2-135m")
    model = llmlab.load_model("smollm2-135m", attention=attention, device=device)
    print(f"   early_exit draft: the first {early_layers} of {model.config.num_layers} layers "
          f"+ final norm + lm_head; llmlab attention backend: {attention}; "
          f"median of {repeats} runs per prompt")
    _run(model, tok, "Hi", 4, None)                        # warm-up
    _run(model, tok, "Hi", 4, {"method": "early_exit", "num_layers": early_layers})
    specs = [None]
    for method, k in configs:
        spec = {"method": method, "num_tokens": k}
        if method == "early_exit":
            spec["num_layers"] = early_layers
        specs.append(spec)
    rows, summary = [], []
    for set_name, prompts in (("edit", EDIT_PROMPTS), ("chat", CHAT_PROMPTS)):
        # times[j][i]: runs of config j on prompt i. Each repeat runs every config in turn,
        # so a change in the machine's load hits the baseline and speculation alike.
        times = [[[] for _ in prompts] for _ in specs]
        last = [[None] * len(prompts) for _ in specs]
        for i, p in enumerate(prompts):
            for _ in range(repeats):
                for j, spec in enumerate(specs):
                    sec, last[j][i] = _run(model, tok, p, new_tokens, spec)
                    times[j][i].append(sec)
        med = [[statistics.median(t) for t in per_cfg] for per_cfg in times]
        per_repeat = [[sum(t[r] for t in per_cfg) for r in range(repeats)] for per_cfg in times]
        base_ids = [g.token_ids for g in last[0]]
        base_tokens = sum(len(t) for t in base_ids)
        base_s = sum(med[0])
        step_s = base_s / base_tokens                      # one decode step, prefill spread in
        rows.append({"prompts": set_name, "method": "KV-cache greedy", "k": 0,
                     "tok/s": base_tokens / base_s, "speedup": 1.0, "spread": "", "same": True,
                     "accept": float("nan"), "tok/fwd": 1.0, "c": float("nan"),
                     "verify/step": 1.0, "model x": 1.0,
                     "model(v) x": 1.0})
        for j, (method, k) in enumerate(configs, start=1):
            stats = [g.speculative for g in last[j]]
            same = all(g.token_ids == ref for g, ref in zip(last[j], base_ids))
            acc = sum(sum(st.accepted_per_step) for st in stats)
            drafted = sum(sum(st.drafted_per_step) for st in stats)
            gen = sum(st.num_generated for st in stats)
            fwd = sum(st.target_forwards for st in stats)
            c = sum(st.draft_s for st in stats) / drafted / step_s if drafted else 0.0
            per_step = gen / fwd                           # E[tokens per target forward]
            speedup = base_s / sum(med[j])
            ratios = [b / x for b, x in zip(per_repeat[0], per_repeat[j])]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            model_x = cost_model_speedup(per_step, k, c)
            rate = acc / drafted if drafted else 0.0
            verify = sum(st.target_s for st in stats) / fwd / step_s
            model_v = cost_model_speedup(per_step, k, c, verify)
            rows.append({"prompts": set_name, "method": method, "k": k,
                         "tok/s": gen / sum(med[j]), "speedup": speedup, "spread": spread,
                         "same": same,
                         "accept": rate, "tok/fwd": per_step, "c": c, "verify/step": verify,
                         "model x": model_x, "model(v) x": model_v})
            summary.append({"prompts": set_name, "method": method, "k": k, "speedup": speedup,
                            "speedup_min_max": [min(ratios), max(ratios)],
                            "same_tokens": same, "acceptance": rate,
                            "tokens_per_forward": per_step, "draft_cost": c,
                            "verify_cost": verify, "cost_model_speedup": model_x,
                            "cost_model_speedup_measured_verify": model_v})
    table(rows, floatfmt="{:.3g}")
    print("   speedup: median times summed over the set; spread: min-max over repeats of the "
          "set's total time, each repeat timing every configuration in turn")
    print("   accept: accepted/drafted; tok/fwd: tokens per target forward (prefill counted); "
          "c: draft cost per drafted token / one decode step; verify/step: a target forward "
          "of k+1 tokens / one decode step; model x: tok/fwd / (1 + k*c); model(v) x: "
          "tok/fwd / (verify/step + k*c)")
    best = max((r for r in summary if r["prompts"] == "edit" and r["method"] == "ngram"),
               key=lambda r: r["speedup"], default=None)
    if best is not None:
        met = best["speedup"] >= TARGET and best["same_tokens"]
        print(f"   n-gram on edit prompts: best {best['speedup']:.2f}x at k={best['k']}, "
              f"identical tokens: {best['same_tokens']} (target >= {TARGET}x: "
              f"{'met' if met else 'missed'})")
    return {"rows": rows, "summary": summary, "new_tokens": new_tokens, "repeats": repeats,
            "early_exit_layers": early_layers}


def main(argv: list[str]) -> int:
    def more(ap):
        ap.add_argument("--early-layers", type=int, default=8,
                        help="layers of the early-exit draft (default 8 of 30)")
        ap.add_argument("--attention", default="sdpa",
                        help="llmlab attention backend (default sdpa)")

    args = timed_parser("spec", __doc__, "24 new tokens, 1 repeat, k in {2, 4}", 3, 64, argv, more)
    if args is None:
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs, new, repeats = CONFIGS, args.new_tokens, args.repeats
    if args.quick:
        configs = [c for c in CONFIGS if c[1] in (2, 4)]
        new, repeats = 24, 1
    header(f"spec: smollm2-135m, {str(default_dtype(device)).removeprefix('torch.')}, greedy, "
           f"batch 1, up to {new} new tokens, speculative vs KV-cache greedy")
    payload = bench(new, repeats, configs, args.early_layers, device, args.attention)
    save("spec", payload)
    return 0
