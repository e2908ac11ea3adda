"""The exercises of notebook 08 (quantization).

- ``nb08.group_quantize`` (build): group-wise asymmetric quantize / dequantize, checked on
  a small matrix, then run on every linear layer of SmolLM2 and judged by the model's
  next-token distributions and greedy tokens against float32.
- ``nb08.predict_int4_speedup`` (predict): batch-1 decode tokens/s of int4 over float32.
- ``nb08.explain_group_size`` (explain): why small groups lower the 4-bit error.
- ``nb08.q4_1_bytes_per_weight`` (compute, stretch): the storage cost of GGUF's Q4_1.

The student's pair ``(group_quantize, group_dequantize)`` has the library's signatures:
``group_quantize(w [out, in], bits, group_size) -> (q [out, in] ints in 0..2^bits-1,
d [out, in/group], m [out, in/group])`` and ``group_dequantize(q, d, m) -> [out, in]``,
with w ≈ q·d + m per group of ``group_size`` consecutive inputs.
"""
from __future__ import annotations

import functools

import torch

from . import (_raises_not_implemented, choice_verdict, compare_tensors, exercise,
               first_token_difference, right, wrong)
from ..quant.formats import group_dequantize, group_quantize

NB = "08_quantization"
KLD_LIMIT = 1e-4          # nats/token: the checker's bar for 4-bit groups of 32 on SmolLM2


# ---- realistic mistakes -----------------------------------------------------------------

def _quantize_truncates(w, bits=4, group_size=32):
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / (2 ** bits - 1)
    q = torch.floor((g - lo[..., None]) / d[..., None]).clamp(0, 2 ** bits - 1)
    return q.reshape(out_f, in_f).to(torch.uint8), d, lo


def _quantize_2_to_the_bits(w, bits=4, group_size=32):
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / (2 ** bits)          # 16 steps for 16 codes: the top code is never used
    q = torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 2 ** bits - 1)
    return q.reshape(out_f, in_f).to(torch.uint8), d, lo


def _quantize_groups_along_outputs(w, bits=4, group_size=32):
    # groups run down the columns (output dim) instead of along the rows
    q, d, m = group_quantize(w.t().contiguous(), bits, group_size) if w.shape[0] % group_size == 0 \
        else group_quantize(w, bits, group_size)
    return q.t().contiguous(), d, m


def _dequantize_groups_along_outputs(q, d, m):
    if d.shape[0] != q.shape[0]:    # came from the transposed quantizer
        return group_dequantize(q.t().contiguous(), d, m).t()
    return group_dequantize(q, d, m)


SOLUTION = (group_quantize, group_dequantize)


# ---- the check ---------------------------------------------------------------------------

def _small_case():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g) * 0.05
    w[3, 5] = 0.9                     # one outlier: its group's step grows, no other group's
    return w


def _unpack(got, what):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return None, wrong(f"{what} returned {type(got).__name__}; it should return a tuple "
                           "(q, d, m).", "return q, d, m")
    return got, None


@functools.lru_cache(maxsize=1)
def _smollm2_and_reference():
    import llmlab
    from ..quant import eval as qeval

    model = llmlab.load_model("smollm2-135m", attention="sdpa")
    tok = llmlab.load_tokenizer("smollm2-135m")
    ids = qeval.eval_token_ids(tok, 96)
    with torch.inference_mode():
        ref_lp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)
    ref_tokens = llmlab.generate(model, tok, "What is the capital of France?", max_new_tokens=8,
                                 kv_cache="contiguous").token_ids
    return model, tok, ids, ref_lp, ref_tokens


@exercise("nb08.group_quantize", notebook=NB, kind="build",
          title="group-wise asymmetric quantize / dequantize, run on every SmolLM2 layer",
          solution=SOLUTION, placeholder=(_raises_not_implemented, _raises_not_implemented),
          wrong_variants={
              "truncates instead of rounding": ((_quantize_truncates, group_dequantize),
                                                ("round", "whole step")),
              "divides the range by 2^bits": ((_quantize_2_to_the_bits, group_dequantize),
                                              ("2^bits - 1",)),
              "groups along the output dimension": (
                  (_quantize_groups_along_outputs, _dequantize_groups_along_outputs),
                  ("input dimension",)),
          })
def _check_group_quantize(answer, bits: int = 4, group_size: int = 32) -> object:
    if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(map(callable, answer)):
        return wrong(f"pass a pair of functions (group_quantize, group_dequantize); got "
                     f"{type(answer).__name__}.", "exercises.check(name, (group_quantize, "
                     "group_dequantize))")
    quantize_fn, dequantize_fn = answer
    w = _small_case()
    got, bad = _unpack(quantize_fn(w.clone(), 4, 16), "group_quantize")
    if bad:
        return bad
    q, d, m = got
    want_q, want_d, want_m = group_quantize(w, 4, 16)
    for name, t, ref in (("q", q, want_q), ("d", d, want_d), ("m", m, want_m)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            hint = ("one (d, m) pair per group of consecutive inputs in a row: groups run along "
                    "the input dimension (the last one), the dimension the matmul sums over."
                    if name != "q" else "q has the weight's shape.")
            return wrong(f"{name} has shape {shape}; for w [48, 64] and group_size=16 it should "
                         f"be {tuple(ref.shape)}.", hint)
    qf = q.float()
    if qf.min() < 0 or qf.max() > 15 or not torch.equal(qf, qf.round()):
        return wrong(f"the codes should be integers in 0..15 for 4 bits; yours span "
                     f"{qf.min().item():g}..{qf.max().item():g}.",
                     "q = round((w - m) / d), clamped to 0..2^bits - 1.")
    back = dequantize_fn(q, d, m)
    if not isinstance(back, torch.Tensor) or back.shape != w.shape:
        return wrong("group_dequantize should return a tensor of the weight's shape "
                     f"{tuple(w.shape)}.", "w_hat = q·d + m, with d and m repeated over each group.")
    step = want_d.repeat_interleave(16, dim=1)
    err = (back.float() - w).abs()
    if (err > step * 0.5 + 1e-6).any():
        worst = (err / step).max().item()
        if torch.allclose(d.float(), want_d * 15 / 16, rtol=1e-4):
            return wrong(f"your step d is 15/16 of the right one, so codes overshoot: max error "
                         f"{worst:.2f} steps.", "16 codes make 15 steps: d = (max - min) / "
                         "(2^bits - 1).")
        if worst > 0.5 and (qf <= want_q.float()).all():
            return wrong(f"the max error is {worst:.2f} of a step (rounding to nearest keeps it "
                         "under 0.5): your codes round down, so a weight can lose a whole step.",
                         "round((w - m) / d) instead of floor / int().")
        return wrong(f"the round trip misses by up to {worst:.2f} of a step (allowed 0.5).",
                     "per group of consecutive inputs (along the input dimension): m = min, "
                     "d = (max - min)/(2^bits - 1), q = round((w - m)/d).")
    # the real model: every decoder linear layer of SmolLM2 through the student's functions
    from ..quant import fake_quantize
    import llmlab

    model, tok, ids, ref_lp, ref_tokens = _smollm2_and_reference()
    fq = fake_quantize(model, lambda w: dequantize_fn(*quantize_fn(w, bits, group_size)))
    with torch.inference_mode():
        lp = torch.log_softmax(fq(torch.tensor([ids]))[0], -1)
    kld = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
    tokens = llmlab.generate(fq, tok, "What is the capital of France?", max_new_tokens=8,
                             kv_cache="contiguous").token_ids
    diff = first_token_difference(tokens, ref_tokens)
    if kld > KLD_LIMIT or diff:
        return wrong(f"on SmolLM2 with {bits}-bit groups of {group_size}: KLD {kld:.2e} "
                     f"nats/token over {len(ids) - 1} tokens (allowed {KLD_LIMIT:g})"
                     + (f"; greedy answer: {diff}" if diff else "."),
                     "the shipped weights sit on a 4-bit grid of groups of 32 along the input "
                     "dimension; a correct quantizer finds that grid again.")
    return right(f"all 210 linear layers of SmolLM2 through your functions: KLD {kld:.1e} "
                 f"nats/token over {len(ids) - 1} tokens, same 8 greedy tokens as float32.")


# ---- predict: the int4 speedup ----------------------------------------------------------

def bytes_bound_speedup() -> float:
    """float32 weight bytes over int4 (groups of 32, Q8_0 lm_head) bytes: the roofline's
    bound on the batch-1 decode speedup."""
    from ..config import ModelConfig
    from ..models.registry import model_dir
    from ..quant.eval import group_format_bytes

    cfg = ModelConfig.from_file(model_dir("smollm2-135m"))
    fp32 = group_format_bytes(cfg, 32, None, head_bytes=4.0)
    return fp32 / group_format_bytes(cfg, 4, 32)


@exercise("nb08.predict_int4_speedup", notebook=NB, kind="predict",
          title="predict: batch-1 decode tokens/s of int4 over float32",
          solution=5.5,
          wrong_variants={"no faster": (1.0, ("memory-bound",)),
                          "bits ratio": (8.0, ("scales",))})
def _check_predict_int4_speedup(answer, measured: float | None = None) -> object:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a positive number (a ratio), got {answer!r}.",
                     "e.g. 3.0 for three times the tokens per second.")
    bound = bytes_bound_speedup()
    want = bound if measured is None else float(measured)
    what = "measured" if measured is not None else "the bytes bound"
    why = (f"decode is memory-bound: each step reads every weight once, so the bound is the "
           f"bytes ratio, {bound:.1f}x (4-bit codes plus float scales per group of 32, a Q8_0 "
           f"lm_head, float32 norms).")
    if abs(answer - want) <= 0.3 * want:
        extra = "" if measured is None else \
            (f" The gap to the {bound:.1f}x bound: the work outside the matmuls, which "
             "quantization does not shrink, and matrix-vector kernels that read their "
             "small weights below the copy bandwidth (the step breakdown below).")
        return right(f"{answer:g}x is within 30% of {what} {want:.2f}x. {why}{extra}")
    if answer < want:
        return wrong(f"{answer:g}x is below {what} {want:.2f}x: {why}",
                     "count the bytes per weight before and after.")
    return wrong(f"{answer:g}x is above {what} {want:.2f}x: 32/4 = 8 ignores the scales and "
                 f"minimums and the lm_head; {why}",
                 "the bytes ratio is an upper bound; measured speedups fall below it.")


# ---- explain: group size ----------------------------------------------------------------

_GROUP_CHOICES = {
    "a": "smaller groups store more scales, so they cost more bits per weight, not fewer.",
    "b": "the step of a group is set by its own range; an outlier weight stretches the "
         "step of its 31 neighbours only, not of the 576 weights of its row (LLM.int8() "
         "found such outliers concentrated in a few feature dimensions).",
    "c": "rounding to nearest works for any group size; its error is at most half a step, "
         "and the step is what the group size changes.",
    "d": "the matmul reads slightly more scales with small groups; it is not faster.",
}


@exercise("nb08.explain_group_size", notebook=NB, kind="explain",
          title="explain: why does 4-bit with groups of 32 beat 4-bit with one scale per row?",
          solution="b",
          wrong_variants={"fewer bits": ("a", ("more bits",)), "faster": ("d", ("not faster",))})
def _check_explain_group_size(answer) -> object:
    return choice_verdict(answer, "b", _GROUP_CHOICES)


# ---- compute (stretch): Q4_1's bytes per weight ---------------------------------------------

@exercise("nb08.q4_1_bytes_per_weight", notebook=NB, kind="compute", stretch=True,
          title="stretch: how many bytes does GGUF's Q4_1 store per weight?",
          solution=0.625,
          wrong_variants={"codes only": (0.5, ("scale",)),
                          "forgot the minimum": (0.5625, ("minimum",))})
def _check_q4_1_bytes(answer) -> object:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return wrong(f"the answer should be a number of bytes, got {answer!r}.",
                     "bytes of one block / 32.")
    if abs(answer - 0.625) < 1e-3:
        return right("20 bytes per block of 32: 16 bytes of 4-bit codes, a float16 scale d and a "
                     "float16 minimum m. 0.625 bytes = 5 bits per weight.")
    if abs(answer - 0.5) < 1e-3:
        return wrong("0.5 counts the 4-bit codes only; each block also stores a float16 scale "
                     "and a float16 minimum.", "(16 + 2 + 2) / 32.")
    if abs(answer - 0.5625) < 1e-3:
        return wrong("0.5625 counts the codes and the scale d but forgot the float16 minimum m.",
                     "(16 + 2 + 2) / 32.")
    return wrong(f"{answer:g} is not it.", "a block: 32 codes of 4 bits, d and m in float16.")
