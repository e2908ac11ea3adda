"""The exercises of notebook 08 (quantization).

- ``nb08.group_quantize`` (build): group-wise asymmetric quantization, and the matmul that
  reads the quantized weight group by group, run as every linear layer of SmolLM2 (4 bits,
  groups of 64, which cross the shipped file's blocks of 32) and judged by the logits and
  greedy tokens against the same format computed by the checker.
- ``nb08.predict_int4_speedup`` (predict): batch-1 decode speedup of int4 over float32,
  from the float32 step's split (Amdahl's law), then compared with the measurement.
- ``nb08.predict_kld_order`` (predict): four formats (8 bits per row; 4 bits in groups of 32, of
  64, per row) ordered by the KLD they cost, against the notebook's sweep.
- ``nb08.q4_1_bytes_per_weight`` (compute, stretch): the storage cost of GGUF's Q4_1.

The student's pair ``(group_quantize, group_matmul)``:
``group_quantize(w [out, in], bits, group_size) -> (q [out, in] ints in 0..2^bits-1,
d [out, in/group], m [out, in/group])`` with w ≈ q·d + m per group of ``group_size``
consecutive inputs, and ``group_matmul(x [..., in], q, d, m) -> y [..., out]``, y = x·Ŵᵀ
for the dequantized Ŵ, computed group by group (each group's d multiplies that group's
partial dot product, its m the sum of that group's inputs) without building Ŵ.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from . import (_raises_not_implemented, choice_verdict, compare_tensors, exercise, forbid,
               first_token_difference, right, wrong)

NB = "08_quantization"
CHECK_GROUP = 64          # the SmolLM2 run: groups of 64 cross the shipped blocks of 32
LOGIT_ATOL = 2e-3         # the student's matmul against the checker's: summation order only


# ---- the reference -----------------------------------------------------------------------

def _solution_quantize(w, bits=4, group_size=32):
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    m = g.amin(dim=-1)
    d = (g.amax(dim=-1) - m) / (2 ** bits - 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))       # a constant group: codes 0
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 2 ** bits - 1)
    return q.to(torch.uint8).reshape(out_f, in_f), d, m


def _solution_matmul(x, q, d, m):
    out_f, in_f = q.shape
    groups = d.shape[1]
    xg = x.float().reshape(*x.shape[:-1], groups, in_f // groups)      # [..., G, g]
    qg = q.float().reshape(out_f, groups, in_f // groups)              # [out, G, g]
    partial = torch.einsum("...gk,ogk->...og", xg, qg)                 # [..., out, G]
    return (partial * d).sum(-1) + xg.sum(-1) @ m.T


SOLUTION = (_solution_quantize, _solution_matmul)


def _dequantize(q, d, m):
    """The checker's own Ŵ = q·d + m (float32 [out, in])."""
    out_f, in_f = q.shape
    g = q.float().reshape(out_f, d.shape[1], -1)
    return (g * d.float()[..., None] + m.float()[..., None]).reshape(out_f, in_f)


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
    # groups run down the columns (the output dim): d and m come out [out/group, in]
    qt, d, m = _solution_quantize(w.t().contiguous(), bits, group_size)
    return qt.t().contiguous(), d, m


def _matmul_forgets_minimum(x, q, d, m):
    out_f, in_f = q.shape
    groups = d.shape[1]
    xg = x.float().reshape(*x.shape[:-1], groups, in_f // groups)
    qg = q.float().reshape(out_f, groups, in_f // groups)
    return (torch.einsum("...gk,ogk->...og", xg, qg) * d).sum(-1)


def _matmul_minimum_per_row(x, q, d, m):
    # one minimum for the whole row: the groups' m summed, times the sum of all inputs
    out_f, in_f = q.shape
    groups = d.shape[1]
    xg = x.float().reshape(*x.shape[:-1], groups, in_f // groups)
    qg = q.float().reshape(out_f, groups, in_f // groups)
    return ((torch.einsum("...gk,ogk->...og", xg, qg) * d).sum(-1)
            + x.float().sum(-1, keepdim=True) * m.sum(-1) / groups)


def _wraps_llmlab(w, bits=4, group_size=32):
    from ..quant.formats import group_quantize
    return group_quantize(w, bits, group_size)


def _matmul_wraps_llmlab(x, q, d, m):
    from ..quant.formats import group_dequantize
    return x.float() @ group_dequantize(q, d, m).T


# ---- the check ---------------------------------------------------------------------------

def _library_pieces() -> tuple:
    """llmlab's own implementations of this build: calling them inside the check fails."""
    from ..kernels import cpu_gemv
    from ..quant import formats, linear

    return (formats.group_quantize, formats.group_dequantize, formats.q4_1_quantize,
            formats.q4_1_dequantize, linear.GroupLinear.dequantized_weight,
            cpu_gemv.gemv_unchecked, cpu_gemv.dequantize_unchecked)


def _small_case():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g) * 0.05
    w[3, 5] = 0.9                     # one outlier: its group's step grows, no other group's
    x = torch.randn(2, 5, 64, generator=g)
    return w, x


def _unpack(got, what):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return None, wrong(f"{what} returned {type(got).__name__}; it should return a tuple "
                           "(q, d, m).", "return q, d, m")
    return got, None


class _StudentLinear(nn.Module):
    """A linear layer that stores the student's (q, d, m) and calls the student's matmul."""

    def __init__(self, q, d, m, matmul):
        super().__init__()
        self.q, self.d, self.m, self.matmul = q, d, m, matmul
        self.out_features, self.in_features = q.shape

    def forward(self, x):
        y = self.matmul(x, self.q, self.d, self.m)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (*x.shape[:-1], self.out_features):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"group_matmul returned {shape} for x {tuple(x.shape)} and a "
                             f"[{self.out_features}, {self.in_features}] weight; expected "
                             f"{(*x.shape[:-1], self.out_features)}")
        return y


def _swap_linears(model, make):
    """A copy of ``model`` (sharing its tensors) whose decoder linears are ``make(weight)``."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    new = copy.deepcopy(model, memo)
    for layer in new.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight.detach()))
    return new.eval()


PROMPT = "What is the capital of France?"


@functools.lru_cache(maxsize=1)
def _smollm2():
    """SmolLM2, its tokenizer, the check's token ids and float32's log-probs over them."""
    import llmlab
    from ..quant import eval as qeval

    model = llmlab.load_model("smollm2-135m", attention="sdpa")
    tok = llmlab.load_tokenizer("smollm2-135m")
    ids = qeval.eval_token_ids(tok, 96)
    with torch.inference_mode():
        fp32_lp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)
    return model, tok, ids, fp32_lp


class _DenseLinear(nn.Module):
    """The checker's reference layer: x · Ŵᵀ with Ŵ dequantized by the checker."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w.T


def _check_small(quantize_fn, matmul_fn):
    """The pair on a small matrix: shapes, codes, round-trip error, the matmul. A Verdict
    when something is wrong, else None."""
    from ..quant.formats import group_quantize

    w, x = _small_case()
    want_q, want_d, want_m = group_quantize(w, 4, 16)
    with forbid(*_library_pieces()):
        got, bad = _unpack(quantize_fn(w.clone(), 4, 16), "group_quantize")
    if bad is not None:
        return bad
    q, d, m = got
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
                     "each code is a whole number of steps above the group's minimum.")
    back = _dequantize(q, d, m)
    step = want_d.repeat_interleave(16, dim=1)
    err = (back - w).abs()
    if (err > step * 0.5 + 1e-6).any():
        worst = (err / step).max().item()
        if torch.allclose(d.float(), want_d * 15 / 16, rtol=1e-4):
            return wrong(f"your step d is 15/16 of the right one, so the top codes overshoot: "
                         f"max error {worst:.2f} steps.", "16 codes make 15 steps: d = "
                         "(max - min) / (2^bits - 1).")
        if worst > 0.5 and (qf <= want_q.float()).all():
            return wrong(f"q·d + m misses w by up to {worst:.2f} of a step (rounding to nearest "
                         "keeps it under 0.5): your codes round down, so a weight can lose a "
                         "whole step.", "round to the nearest code instead of floor / int().")
        return wrong(f"q·d + m misses w by up to {worst:.2f} of a step (allowed 0.5).",
                     "per group of consecutive inputs of a row (along the input dimension): "
                     "the smallest weight is code 0, the largest code 2^bits - 1.")
    with forbid(*_library_pieces()):
        y = matmul_fn(x.clone(), q, d, m)
    want = x @ back.T
    problem = compare_tensors(y, want, "group_matmul(x [2, 5, 64], q, d, m)", atol=1e-4)
    if problem:
        if isinstance(y, torch.Tensor) and y.shape == want.shape:
            no_min = x @ (back - m.float().repeat_interleave(16, dim=1)).T
            if torch.allclose(y.float(), no_min, atol=1e-4):
                return wrong(problem + " It equals x·(q·d)ᵀ: the minimum m is missing.",
                             "Ŵ = q·d + m, so each group also adds m times the sum of that "
                             "group's inputs.")
        return wrong(problem, "y = x·Ŵᵀ with Ŵ = q·d + m: per group, d times the partial dot "
                     "product of x with q, plus m times the sum of that group's inputs.")
    return None


@exercise("nb08.group_quantize", notebook=NB, kind="build",
          title="group-wise quantization and the group-by-group matmul, as every linear "
                "layer of SmolLM2",
          solution=SOLUTION, placeholder=(_raises_not_implemented, _raises_not_implemented),
          wrong_variants={
              "truncates instead of rounding": ((_quantize_truncates, _solution_matmul),
                                                ("round", "whole step")),
              "divides the range by 2^bits": ((_quantize_2_to_the_bits, _solution_matmul),
                                              ("2^bits - 1",)),
              "groups along the output dimension": (
                  (_quantize_groups_along_outputs, _solution_matmul), ("input dimension",)),
              "forgets the minimum in the matmul": ((_solution_quantize, _matmul_forgets_minimum),
                                                    ("minimum",)),
              "one minimum per row": ((_solution_quantize, _matmul_minimum_per_row),
                                      ("that group's inputs",)),
              "wraps llmlab's quantizer": ((_wraps_llmlab, _solution_matmul), ("llmlab's own",)),
              "wraps llmlab's dequantizer": ((_solution_quantize, _matmul_wraps_llmlab),
                                             ("llmlab's own",)),
          })
def _check_group_quantize(answer) -> object:
    if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(map(callable, answer)):
        return wrong(f"pass a pair of functions (group_quantize, group_matmul); got "
                     f"{type(answer).__name__}.", "exercises.check(name, (group_quantize, "
                     "group_matmul))")
    quantize_fn, matmul_fn = answer
    bad = _check_small(quantize_fn, matmul_fn)
    if bad is not None:
        return bad
    # the real model: every decoder linear of SmolLM2 stored and run by the student's pair
    import llmlab

    model, tok, ids, fp32_lp = _smollm2()
    layers = []                                   # (float weight, the student's layer)

    def make(w):
        layers.append((w, _StudentLinear(*_unpack_or_raise(quantize_fn(w, 4, CHECK_GROUP)),
                                         matmul_fn)))
        return layers[-1][1]

    with forbid(*_library_pieces()):
        student = _swap_linears(model, make)
    # the codes of every layer: within half a step of the weights (the step from the range)
    for i, (w, layer) in enumerate(layers):
        g = w.reshape(w.shape[0], -1, CHECK_GROUP)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(CHECK_GROUP, dim=1)
        bad = _codes_problem(layer, w, step)
        if bad:
            return wrong(f"in SmolLM2's linear layer {i} of 210 ({tuple(w.shape)}), groups of "
                         f"{CHECK_GROUP}: {bad}", "check group_quantize on a [out, in] weight "
                         "whose input size is a multiple of the group, not equal to it.")
    dense = iter([_dequantize(layer.q, layer.d, layer.m) for _, layer in layers])
    reference = _swap_linears(model, lambda w: _DenseLinear(next(dense)))
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([ids]))[0]
    ref_tokens = llmlab.generate(reference, tok, PROMPT, max_new_tokens=8,
                                 kv_cache="contiguous").token_ids
    with forbid(*_library_pieces()):
        with torch.inference_mode():
            logits = student(torch.tensor([ids]))[0]
        tokens = llmlab.generate(student, tok, PROMPT, max_new_tokens=8,
                                 kv_cache="contiguous").token_ids
    problem = compare_tensors(logits, ref_logits, f"SmolLM2's logits over {len(ids)} tokens",
                              atol=LOGIT_ATOL)
    diff = first_token_difference(tokens, ref_tokens)
    if problem or diff:
        return wrong(f"with 4-bit groups of {CHECK_GROUP} in all 210 linear layers, your matmul "
                     "against x·Ŵᵀ on your own codes: " + (problem or "")
                     + (f" Greedy answer: {diff}" if diff else ""),
                     "your pair passed the small matrix; on the model x has leading dimensions "
                     "[batch, tokens, in] in prefill and [batch, 1, in] in decode.")
    err = (logits - ref_logits).abs().max().item()
    lp = torch.log_softmax(logits, -1)
    kld = (fp32_lp.exp() * (fp32_lp - lp)).sum(-1).mean().item()
    return right(f"all 210 linear layers of SmolLM2 stored as your 4-bit codes (groups of "
                 f"{CHECK_GROUP}) and run by your matmul: logits within {err:.1e} of x·Ŵᵀ, the "
                 f"same {len(tokens)} greedy tokens. What 4 bits cost here: KLD {kld:.1e} "
                 f"nats/token against float32 over {len(ids) - 1} tokens.")


def _unpack_or_raise(got):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise ValueError(f"group_quantize returned {type(got).__name__}; it should return "
                         "a tuple (q, d, m)")
    return got


def _codes_problem(layer, w, step) -> str | None:
    """None when the layer's (q, d, m) give back w within half a step, else what is wrong."""
    q, d, m = layer.q, layer.d, layer.m
    groups = w.shape[1] // CHECK_GROUP
    for name, t, shape in (("q", q, tuple(w.shape)), ("d", d, (w.shape[0], groups)),
                           ("m", m, (w.shape[0], groups))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"{name} has shape {got}, expected {shape}."
    err = (_dequantize(q, d, m) - w).abs()
    worst = (err / step.clamp_min(1e-12)).max().item()
    if (err > 0.5 * step * (1 + 1e-4) + 1e-7).any():
        return f"q·d + m misses the weights by up to {worst:.2f} of a step (allowed 0.5)."
    return None


# ---- predict: the int4 speedup ----------------------------------------------------------

# A run's numbers, used when the notebook passes none (fp32 decode step on a 2-core AMD EPYC
# VM, notebook 08, 2026-12-01; int4 with groups of 64 and the Q8_0 head)
REFERENCE_STEP = {"fp32_step_ms": 59.6, "outside_ms": 11.6, "bytes_ratio": 6.0}


def amdahl_speedup(fp32_step_ms: float, outside_ms: float, bytes_ratio: float) -> float:
    """The speedup if the matmuls' time shrank with their bytes and the rest stayed."""
    return fp32_step_ms / (outside_ms + (fp32_step_ms - outside_ms) / bytes_ratio)


@exercise("nb08.predict_int4_speedup", notebook=NB, kind="predict",
          title="predict: batch-1 decode speedup of int4 over float32",
          solution=amdahl_speedup(**REFERENCE_STEP),
          wrong_variants={"no faster": (1.0, ("memory-bound",)),
                          "the bytes ratio": (REFERENCE_STEP["bytes_ratio"], ("outside",)),
                          "bits ratio": (8.0, ("scales",))})
def _check_predict_int4_speedup(answer, fp32_step_ms: float | None = None,
                                outside_ms: float | None = None,
                                bytes_ratio: float | None = None,
                                measured: float | None = None) -> object:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a positive number (a ratio), got {answer!r}.",
                     "e.g. 3.0 for three times the tokens per second.")
    ctx = dict(REFERENCE_STEP)
    for key, value in (("fp32_step_ms", fp32_step_ms), ("outside_ms", outside_ms),
                       ("bytes_ratio", bytes_ratio)):
        if value is not None:
            ctx[key] = float(value)
    step, rest, ratio = ctx["fp32_step_ms"], ctx["outside_ms"], ctx["bytes_ratio"]
    model = amdahl_speedup(step, rest, ratio)
    how = (f"the {rest:.1f} ms outside the matmuls stay, the {step - rest:.1f} ms in them "
           f"shrink {ratio:.1f}×: {step:.1f} / ({rest:.1f} + {step - rest:.1f}/{ratio:.1f}) "
           f"= {model:.2f}×")
    if measured is not None:
        gap = float(measured) / model
        seen = (f" Measured: {float(measured):.2f}×, {gap:.0%} of that model"
                + ("; the rest of the gap is the 4-bit kernels reading their bytes at a lower "
                   "share of the bandwidth than float32's (the breakdown below)." if gap < 0.9
                   else "."))
    else:
        seen = ""
    near_model = abs(answer - model) <= 0.15 * model
    near_measured = measured is not None and abs(answer - measured) <= 0.15 * measured
    if near_model or near_measured:
        what = "the model" if near_model else "the measurement"
        return right(f"{answer:g}× is within 15% of {what}: {how}.{seen}")
    if answer <= 1.05:
        return wrong(f"{answer:g}× says int4 is no faster, but batch-1 decode is memory-bound: "
                     f"each step reads every weight once, and int4 reads {ratio:.1f}× fewer "
                     f"bytes. Amdahl's law: {how}.{seen}", "only the matmuls' part shrinks.")
    if abs(answer - 8) <= 0.4:
        return wrong(f"{answer:g}× is 32/4, the bits ratio: it ignores the scales and "
                     f"minimums and the 8-bit head (the bytes ratio is {ratio:.1f}×), and that "
                     f"the time outside the matmuls does not shrink. Amdahl's law: {how}.{seen}",
                     "split the float32 step into its two parts first.")
    if abs(answer - ratio) <= 0.1 * ratio:
        return wrong(f"{answer:g}× is the bytes ratio: it holds only if the whole step were "
                     f"matmuls, but the time outside them does not shrink. Amdahl's law: "
                     f"{how}.{seen}", "apply the bytes ratio to the matmuls' part only.")
    side = "above" if answer > model else "below"
    return wrong(f"{answer:g}× is {side} the model: {how}.{seen}",
                 "the step is the time outside the matmuls plus the time in them; only the "
                 "second shrinks with the bytes.")


# ---- predict: the order of four settings by KLD --------------------------------------------

KLD_SETTINGS = {"a": (8, None), "b": (4, 32), "c": (4, 64), "d": (4, None)}
# one recorded run of the notebook's sweep (KLD against float32), for a check without a run
REFERENCE_KLD = {(8, None): 3.9e-3, (4, 32): 0.0, (4, 64): 0.36, (4, None): 1.5}


def _setting(letter: str) -> str:
    bits, g = KLD_SETTINGS[letter]
    return f"({letter}) {bits} bits, " + ("one step per row" if g is None else f"groups of {g}")


def _pair_lesson(low: str, high: str) -> str:
    """Why setting ``low`` loses less than ``high`` (letters of KLD_SETTINGS)."""
    pair = {low, high}
    if "b" in pair:
        return ("groups of 32 along the input are the file's own Q4_1 blocks: the weights "
                "already lie on a 16-level grid per block, so 4 bits in those blocks recover "
                "them exactly (Check (1)'s round trip); no other setting sits on that grid")
    if pair == {"a", "d"}:
        return ("both have one step per row, and 8 bits give 256 levels across its range where "
                "4 bits give 16: a step 17 times finer")
    if pair == {"a", "c"}:
        return ("8 bits give 256 levels across a row's range, 4 bits 16 across a group's: a "
                "step 17 times finer, far more than groups of 64 gain over a whole row")
    return ("a group's step is its range / 15: one large weight in a row of 576 or 1,536 inputs "
            "stretches the step of the whole row, but in groups of 64 only that of its 63 "
            "neighbours")


@exercise("nb08.predict_kld_order", notebook=NB, kind="predict",
          title="predict: order four weight formats by the KLD they cost SmolLM2",
          solution="bacd",
          wrong_variants={"more bits first": ("abcd", ("own Q4_1 blocks",)),
                          "groups beat bits": ("bcad", ("256 levels",)),
                          "row beats groups": ("badc", ("stretches the step",))})
def _check_predict_kld_order(answer, grid: dict | None = None) -> object:
    """``answer``: the four letters of KLD_SETTINGS, lowest KLD first. ``grid``: the sweep's
    {(bits, group): {"kld": ...}} (or {(bits, group): kld}); without it a recorded run. Two
    settings whose KLDs are within 10% of each other may come in either order."""
    letters = "".join(str(answer).lower().split()).replace(",", "").replace("<", "")
    if isinstance(answer, bool) or sorted(letters) != sorted(KLD_SETTINGS):
        return wrong(f"answer the four letters a, b, c, d once each, lowest KLD first; got "
                     f"{answer!r}.", 'e.g. "dcba"')
    kld = {}
    for letter, key in KLD_SETTINGS.items():
        v = (grid or REFERENCE_KLD)[key]
        kld[letter] = float(v["kld"] if isinstance(v, dict) else v)
    measured = "".join(sorted(KLD_SETTINGS, key=kld.get))
    table = ", ".join(f"({x}) {kld[x]:.1e}" for x in measured)
    # the pairs the answer puts the wrong way round, beyond a 10% tie
    swapped = [(lo, hi) for i, lo in enumerate(measured) for hi in measured[i + 1:]
               if letters.index(hi) < letters.index(lo) and kld[hi] > 1.1 * kld[lo] + 1e-9]
    if not swapped:
        return right(f"{letters}: the measured KLDs, lowest first, are {table}. "
                     + " ".join(f"{_setting(lo)} below {_setting(hi)}: {_pair_lesson(lo, hi)}."
                                for lo, hi in zip(measured, measured[1:])))
    by_lesson: dict[str, list[str]] = {}
    for lo, hi in swapped:
        by_lesson.setdefault(_pair_lesson(lo, hi), []).append(
            f"{_setting(lo)} loses less than {_setting(hi)}")
    lessons = "; ".join(f"{' and '.join(pairs)}: {lesson}" for lesson, pairs in by_lesson.items())
    return wrong(f"{letters} puts {len(swapped)} pair(s) the wrong way round. Measured, lowest "
                 f"first: {table}. {lessons}.",
                 "for each pair ask what sets the step between two neighbouring levels, and "
                 "whether the weights already sit on some grid.")


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
