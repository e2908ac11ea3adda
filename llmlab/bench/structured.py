"""python -m llmlab.bench structured [--quick]: what constrained decoding costs, on SmolLM2.

Two tables, measured in one run on the machine at hand:

* **mask time per token** against one decode step, along a real constrained output
  (SmolLM2's greedy answer under a JSON schema): the *naive scan* (every token of the
  49,152 walked through the DFA in Python at every step, :func:`brute_force_mask`), the
  *per-step walk* (the same walk vectorized with numpy but redone every step,
  :func:`walk_tokens`), llmlab's *token table* (each DFA state walked once and kept; a
  step is a lookup plus the few context-dependent tokens; the table's one-time build is
  printed beside it) and the *library* (llguidance). Medians over the output's tokens,
  with the 10th-90th percentile range.
* **decode tok/s** with the engine (``LLM``), unconstrained against constrained by each
  backend, at batch 1 and 8: ``--new-tokens`` per sequence under a schema long enough not
  to finish first (a list of up to 40 items), the unconstrained run with ``ignore_eos``;
  medians of ``--repeats`` runs, each repeat running every mode in turn so that load
  changes hit all alike. The target: constrained keeps >= 90% of unconstrained.

Taught in notebook 12.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ._common import header, save, table, timed_parser

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 24},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                       "maxItems": 4}},
          "required": ["name", "age", "city", "languages"]}
INVENTORY = {"type": "object", "additionalProperties": False,
             "properties": {"items": {"type": "array", "maxItems": 40, "items": {
                 "type": "object", "additionalProperties": False,
                 "properties": {"name": {"type": "string", "maxLength": 20},
                                "qty": {"type": "integer"}},
                 "required": ["name", "qty"]}}},
             "required": ["items"]}
PROMPT = ("Describe a fictional person as JSON with the fields name, age, city and languages.")
LIST_PROMPTS = ["List the items in a kitchen as JSON, with a quantity for each.",
                "List what a camper packs for a week as JSON, with quantities.",
                "List the furniture of an office as JSON, with quantities.",
                "List the fruit in a market stall as JSON, with quantities."]


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def _time_calls(fn, states, repeat: int = 1) -> list[float]:
    out = []
    for s in states:
        best = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn(s)
            best.append(time.perf_counter() - t)
        out.append(min(best))
    return out


def mask_costs(llm, tokens: list[int], scan_states: int) -> tuple[list[dict], dict]:
    """The mask rows of the first table, along ``tokens`` (a constrained output)."""
    from ..structured import compile_grammar
    from ..structured.table import TokenTable, brute_force_mask, token_classes, walk_tokens

    eng = llm.engine
    own = compile_grammar({"json_schema": PERSON, "backend": "llmlab"}, llm.tokenizer,
                          llm.model.config.vocab_size, eng.eos_token_id)
    lib = compile_grammar({"json_schema": PERSON, "backend": "llguidance"}, llm.tokenizer,
                          llm.model.config.vocab_size, eng.eos_token_id)
    dfa, vocab = own.dfa, own.vocab
    t = time.perf_counter()
    table = TokenTable(dfa, vocab).precompute()
    build_s = time.perf_counter() - t
    own.table = table                                   # the same table, now complete
    own._dep_masks.clear()
    # the states along the output, as (state, pending) of llmlab's matcher
    m = own.matcher()
    states = []
    for tok in tokens:
        states.append((m.state, m.pending))
        m.advance(tok)
    logits = torch.randn(llm.model.config.vocab_size)
    classes = token_classes(dfa, vocab)

    def table_step(sp):                 # what the engine does: a lookup, then the mask applied
        mm = own.matcher()
        mm.state, mm.pending = sp
        mm.mask_logits_(logits.clone())

    for sp in states:                   # warm: the run-time part is memoized per state too
        table_step(sp)
    table_s = _time_calls(table_step, states, repeat=3)
    walk_s = _time_calls(lambda sp: walk_tokens(dfa, vocab, sp[0], classes), states[:12])
    scan_states = [sp for sp in states[::max(1, len(states) // scan_states)]][:scan_states]
    scan_s = _time_calls(lambda sp: brute_force_mask(dfa, vocab, sp[0]), scan_states)
    lib_s = []
    lm = lib.matcher()
    for tok in tokens:
        row = logits.clone()
        t = time.perf_counter()
        lm.mask_logits_(row)
        lib_s.append(time.perf_counter() - t)
        lm.advance(tok)
    from ..structured.matcher import LLGuidanceGrammar, llguidance_tokenizer

    lib_compile = time.perf_counter()
    LLGuidanceGrammar.from_json_schema(PERSON, llguidance_tokenizer(
        llm.tokenizer, llm.model.config.vocab_size, eng.eos_token_id),
        llm.model.config.vocab_size, eng.eos_token_id).matcher()
    lib_compile = time.perf_counter() - lib_compile
    rows = []
    for name, xs, n, once in (("naive scan (Python, every step)", scan_s, len(scan_s), "-"),
                              ("per-step walk (numpy, every step)", walk_s, len(walk_s), "-"),
                              ("token table (llmlab)", table_s, len(table_s),
                               f"{build_s * 1e3:.0f} ms build, {dfa.num_states} states"),
                              ("llguidance", lib_s, len(lib_s),
                               f"{lib_compile * 1e3:.1f} ms compile")):
        rows.append({"mask": name, "median µs": statistics.median(xs) * 1e6,
                     "p10 µs": _pct(xs, 10) * 1e6, "p90 µs": _pct(xs, 90) * 1e6,
                     "states timed": n, "one-time": once})
    return rows, {"table_build_s": build_s, "dfa_states": dfa.num_states}


def decode_rates(llm, batches, new_tokens: int, repeats: int) -> list[dict]:
    from ..engine import SamplingParams

    modes = {"unconstrained": None, "llmlab": "llmlab", "llguidance": "llguidance"}
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": llm.chat_prompt([{"role": "user", "content": p}])[1]}
                   for p in (LIST_PROMPTS * batch)[:batch]]

        def params(backend):
            if backend is None:
                return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            return SamplingParams(temperature=0, max_tokens=new_tokens,
                                  structured={"json_schema": INVENTORY, "backend": backend})

        times: dict[str, list[float]] = {m: [] for m in modes}
        counts: dict[str, int] = {}
        for r in range(repeats + 1):                    # the first round warms up
            for mode, backend in modes.items():
                t = time.perf_counter()
                outs = llm.generate(prompts, params(backend), use_tqdm=False)
                dt = time.perf_counter() - t
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                counts[mode] = n
                if r:
                    times[mode].append(n / dt)
        base = statistics.median(times["unconstrained"])
        for mode in modes:
            xs = times[mode]
            rows.append({"batch": batch, "mode": mode, "tok/s": statistics.median(xs),
                         "min": min(xs), "max": max(xs), "tokens": counts[mode],
                         "vs unconstrained": f"{statistics.median(xs) / base:.0%}"})
    return rows


def main(argv: list[str]) -> int:
    args = timed_parser("structured", __doc__, "fewer repeats and tokens (a smoke run)", 3, 32,
                        argv)
    if args is None:
        return 0
    if args.quick:
        args.repeats, args.new_tokens = 1, 12
    from ..engine import LLM, SamplingParams

    header("structured outputs: mask cost and decode speed (smollm2-135m)")
    llm = LLM("smollm2-135m", max_num_seqs=8)
    out = llm.chat([{"role": "user", "content": PROMPT}],
                   SamplingParams(temperature=0, max_tokens=80,
                                  structured={"json_schema": PERSON, "backend": "llmlab"}),
                   use_tqdm=False)[0].outputs[0]
    print(f"the constrained output ({len(out.token_ids)} tokens, {out.finish_reason}): {out.text}")
    # one unconstrained decode step at batch 1, for scale
    steps = []
    for _ in range(max(3, args.repeats)):
        t = time.perf_counter()
        o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
                         use_tqdm=False)[0]
        steps.append((time.perf_counter() - t) / len(o.outputs[0].token_ids))
    step = statistics.median(steps)
    rows, info = mask_costs(llm, out.token_ids, scan_states=2 if args.quick else 4)
    for r in rows:
        r["share of a step"] = f"{r['median µs'] * 1e-6 / step:.2%}"
    print(f"\nmask per token, against one batch-1 decode step of {step * 1e3:.1f} ms "
          f"(median of {len(steps)}):")
    table(rows)
    rates = decode_rates(llm, (1, 8), args.new_tokens, args.repeats)
    print(f"\ndecode tok/s, {args.new_tokens} tokens per sequence, medians of {args.repeats} "
          f"(min-max):")
    table(rates)
    worst = min(float(r["vs unconstrained"].rstrip("%")) for r in rates
                if r["mode"] == "llguidance")
    print(f"\nllguidance keeps {worst:.0f}% of unconstrained tok/s at worst (target >= 90%); "
          f"llmlab's table: {min(float(r['vs unconstrained'].rstrip('%')) for r in rates if r['mode'] == 'llmlab'):.0f}%.")
    save("structured", {"mask": rows, "decode": rates, "step_s": step, **info})
    return 0
