"""The exercises of notebook 11 (overhead, fusion and compilation).

- ``nb11.fixed_shape_attend`` (build): the write and read of a static KV cache, in shapes
  that do not change with the position, so that one compiled graph serves every decode
  step. The checker tries it on small hand-made tensors (a padded row, grouped KV heads,
  a prefill chunk and a decode token), then runs SmolLM2's greedy generation with it
  against the contiguous cache, then compiles two of SmolLM2's layers around it with
  ``torch.compile(fullgraph=True)`` and decodes 256 positions: the same tokens as eager,
  and no graph compiled after the first.
- ``nb11.predict_outside_share`` (predict): the share of an eager decode step spent
  outside the matrix multiplies, for the int8 model at batch 1.
- ``nb11.predict_graph_gain`` (predict): the modelled gain of a CUDA graph at batch 1 on an
  H100's roofs, from the eager step's calls and this machine's t_op.
- ``nb11.add_rmsnorm_kernel`` (build, stretch): RMSNorm fused with the residual add, as a
  Triton kernel, run in the interpreter on rows that are not a power of two long.

The student's function for the build::

    fixed_shape_attend(k_cache, v_cache, slots, q, k, v) -> out

k_cache, v_cache [batch, kv_heads, max_len + 1, head_dim], written in place (the last slot
is a bin for padding tokens, never read); slots [batch, s] long: where each new token
writes (its position; ``max_len`` for a padding token); q [batch, s, heads, head_dim];
k, v [batch, s, kv_heads, head_dim] (rotated). Query i of row b attends to every slot
j <= slots[b, i] that is not the bin. Returns [batch, s, heads, head_dim].
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import (Verdict, choice_verdict, compare_tensors, exercise, first_token_difference,
               forbid, right, wrong)
from ..cache.static import StaticKVCache, static_attend

NB = "11_overhead_and_compilation"
PROMPTS = ("Explain in two sentences why the sky is blue.",
           "List three uses of a hash table.")
NEW_TOKENS = 12
COMPILED_POSITIONS = 256      # decode positions the compiled check runs after its warm-up
COMPILED_LAYERS = 2           # SmolLM2's first layers, compiled around the student's function


# ---- the reference and realistic mistakes -------------------------------------------------

def reference_fixed_shape_attend(k_cache, v_cache, slots, q, k, v):
    """Scatter the new K/V at ``slots``; attend over every slot under a position mask."""
    b, s, h, d = q.shape
    kv_heads, num_slots = k_cache.shape[1], k_cache.shape[2]
    where = slots[:, None, :, None].expand(b, kv_heads, s, d)   # slot of each new token
    k_cache.scatter_(2, where, k.transpose(1, 2).to(k_cache.dtype))
    v_cache.scatter_(2, where, v.transpose(1, 2).to(v_cache.dtype))
    slot_ids = torch.arange(num_slots, device=q.device)
    # a query sees its own slot and every earlier one, never the bin (the last slot)
    visible = (slot_ids <= slots[..., None]) & (slot_ids < num_slots - 1)   # [b, s, slots]
    groups = h // kv_heads
    keys = k_cache.repeat_interleave(groups, dim=1).to(q.dtype)            # [b, h, slots, d]
    values = v_cache.repeat_interleave(groups, dim=1).to(q.dtype)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(d)    # [b, h, s, slots]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = scores.softmax(-1) @ values                                     # [b, h, s, d]
    return out.transpose(1, 2)


def _cannot_see_itself(k_cache, v_cache, slots, q, k, v):
    b, s, h, d = q.shape
    where = slots[:, None, :, None].expand(b, k_cache.shape[1], s, d)
    k_cache.scatter_(2, where, k.transpose(1, 2))
    v_cache.scatter_(2, where, v.transpose(1, 2))
    slot_ids = torch.arange(k_cache.shape[2])
    visible = (slot_ids < slots[..., None]) | (slot_ids == 0)   # strict: its own slot is hidden
    groups = h // k_cache.shape[1]
    keys = k_cache.repeat_interleave(groups, dim=1)
    values = v_cache.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                         attn_mask=visible[:, None])
    return out.transpose(1, 2)


def _writes_a_copy(k_cache, v_cache, slots, q, k, v):
    b, s, h, d = q.shape
    where = slots[:, None, :, None].expand(b, k_cache.shape[1], s, d)
    k_all = k_cache.scatter(2, where, k.transpose(1, 2))         # out of place: lost next step
    v_all = v_cache.scatter(2, where, v.transpose(1, 2))
    slot_ids = torch.arange(k_cache.shape[2])
    visible = (slot_ids <= slots[..., None]) & (slot_ids < k_cache.shape[2] - 1)
    groups = h // k_cache.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.repeat_interleave(groups, 1),
                                         v_all.repeat_interleave(groups, 1),
                                         attn_mask=visible[:, None])
    return out.transpose(1, 2)


def _slices_by_length(k_cache, v_cache, slots, q, k, v):
    b, s, h, d = q.shape
    where = slots[:, None, :, None].expand(b, k_cache.shape[1], s, d)
    k_cache.scatter_(2, where, k.transpose(1, 2))
    v_cache.scatter_(2, where, v.transpose(1, 2))
    real = slots.masked_fill(slots == k_cache.shape[2] - 1, -1)
    n = int(real.max()) + 1                       # a Python int read from a tensor
    slot_ids = torch.arange(n)
    visible = slot_ids <= slots[..., None]
    groups = h // k_cache.shape[1]
    keys = k_cache[:, :, :n].repeat_interleave(groups, dim=1)
    values = v_cache[:, :, :n].repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                         attn_mask=visible[:, None])
    return out.transpose(1, 2)


def _library_wrapper(k_cache, v_cache, slots, q, k, v):
    return static_attend(k_cache, v_cache, slots, torch.arange(k_cache.shape[2]), q, k, v)


# ---- the cache around the student's function ------------------------------------------------

class StudentStaticCache(StaticKVCache):
    """:class:`StaticKVCache` whose per-layer write and read is the student's function."""

    name = "nb11_student_static"

    def __init__(self, fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fn = fn

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, fn=None) -> "StudentStaticCache":
        c = model.config
        kv_heads = model.layers[0].self_attn.num_kv_heads
        return cls(fn, c.num_layers, batch, kv_heads, c.head_dim, max_len,
                   dtype=model.dtype, device=model.device)

    def attend(self, layer_idx, q, k, v, backend=None):
        return self.fn(self.k[layer_idx], self.v[layer_idx], self.slots, q, k, v)


@functools.lru_cache(maxsize=1)
def smollm2():
    """SmolLM2-135M (float32) and its tokenizer, loaded once for the checkers."""
    import llmlab

    return (llmlab.load_model("smollm2-135m", attention="sdpa"),
            llmlab.load_tokenizer("smollm2-135m"))


def _small_case(seed: int = 0):
    """A padded batch of 2 with grouped KV heads: a prefill of 3 (row 1's first token is
    padding, written to the bin) and then one decode token per row."""
    g = torch.Generator().manual_seed(seed)
    b, h, kv, d, max_len = 2, 4, 2, 8, 11
    cache_shape = (b, kv, max_len + 1, d)
    steps = []
    for s, slots in ((3, [[0, 1, 2], [max_len, 0, 1]]), (1, [[3], [2]])):
        steps.append((torch.tensor(slots), torch.randn(b, s, h, d, generator=g),
                      torch.randn(b, s, kv, d, generator=g), torch.randn(b, s, kv, d, generator=g)))
    # stale values in the cache (as after a reset) must be masked, not relied on as zeros
    stale = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    return stale, steps, max_len


def _check_small(fn) -> str | None:
    (k0, v0), steps, max_len = _small_case()
    ref_k, ref_v, k_cache, v_cache = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    for i, (slots, q, k, v) in enumerate(steps):
        want = reference_fixed_shape_attend(ref_k, ref_v, slots, q, k, v)
        with forbid(static_attend):
            got = fn(k_cache, v_cache, slots, q, k, v)
        what = "the prefill of 3 tokens" if i == 0 else "the decode token after it"
        real = slots != max_len                       # a padding query's output is never used
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            return compare_tensors(got, want, f"your output for {what}", 1e-5)
        if (problem := compare_tensors(got[real], want[real], f"your output for {what}",
                                       1e-5)) is not None:
            return (problem + " A query sees the slot of its own position and every earlier "
                    "one; slots past it hold stale values and the last slot is the padding bin.")
        if (problem := compare_tensors(k_cache[:, :, :max_len], ref_k[:, :, :max_len],
                                       f"k_cache after {what}", 0)) is not None:
            return (problem + " Write each new key into k_cache itself (in place, at its slot), "
                    "so that the next step finds it.")
    return None


def _greedy(model, prompts, kv_cache) -> list[list[int]]:
    from ..generate import generate_token_ids

    return [r.token_ids for r in generate_token_ids(model, prompts, NEW_TOKENS,
                                                    kv_cache=kv_cache, ignore_eos=True)]


def _check_in_model(fn) -> str | None:
    from .. import cache as kv_caches

    model, tok = smollm2()
    from ..prompts import encode_prompts

    prompts = encode_prompts(tok, list(PROMPTS), chat=True)
    want = _greedy(model, prompts, "contiguous")
    kv_caches.register(StudentStaticCache.name, lambda m, b, n, **_: StudentStaticCache.for_model(
        m, b, n, fn=fn))
    try:
        with forbid(static_attend):
            got = _greedy(model, prompts, StudentStaticCache.name)
    finally:
        kv_caches.unregister(StudentStaticCache.name)
    for row, (g, w) in enumerate(zip(got, want)):
        if (diff := first_token_difference(g, w)) is not None:
            return (f"in SmolLM2's greedy generation (2 prompts of different lengths, padded), "
                    f"prompt {row}: {diff}")
    return None


def _check_compiled(fn) -> tuple[str | None, str]:
    """Compile SmolLM2's first layers around ``fn``; decode 256 positions; compare."""
    from ..compile import _allow_graphs, graphs_compiled, RECOMPILE_LIMIT

    model, tok = smollm2()
    _allow_graphs(RECOMPILE_LIMIT)
    batch, max_len = 2, 512
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog")] * batch)

    def first_layers(tokens, positions, cache):
        return model.step(tokens, positions, cache, None, "last", COMPILED_LAYERS)[:, -1]

    compiled = torch.compile(first_layers, fullgraph=True, dynamic=False)
    mine = StudentStaticCache.for_model(model, batch, max_len, fn=fn)
    ref = StaticKVCache.for_model(model, batch, max_len)
    with torch.inference_mode():
        for c in (mine, ref):                         # the prompt, eagerly
            positions = c.begin(ids.shape[1])
            with forbid(static_attend) if c is mine else _nothing():
                logits = first_layers(ids, positions, c)
            c.advance()
        token = logits.argmax(-1, keepdim=True)
        graphs_after_warmup = None
        worst = 0.0
        for step in range(COMPILED_POSITIONS + 1):
            positions = mine.begin(1)
            try:
                with forbid(static_attend):
                    got = compiled(token, positions, mine)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                return (f"torch.compile(fullgraph=True) could not trace your function into one "
                        f"graph: {type(exc).__name__}: {first[:300]}"), ""
            mine.advance()
            want = first_layers(token, ref.begin(1), ref)
            ref.advance()
            if step == 0:
                graphs_after_warmup = graphs_compiled()
            elif graphs_compiled() != graphs_after_warmup:
                return (f"the compiled step compiled a new graph at decode position "
                        f"{ids.shape[1] + step} after its warm-up: something in your function "
                        "changes with the position (a shape, or a Python value)."), ""
            worst = max(worst, float((got - want).abs().max()))
            if not torch.equal(got.argmax(-1), want.argmax(-1)):
                return (f"at decode position {ids.shape[1] + step} the compiled step's next token "
                        f"differs from eager's (max |logit error| {worst:.3g})."), ""
            token = want.argmax(-1, keepdim=True)
    return None, (f"compiled {COMPILED_LAYERS} layers once, then {COMPILED_POSITIONS} decode "
                  f"positions with 0 new graphs and eager's tokens (max |logit error| "
                  f"{worst:.2g})")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@exercise("nb11.fixed_shape_attend", notebook=NB, kind="build",
          title="build: a static cache's write and read in fixed shapes",
          solution=reference_fixed_shape_attend,
          wrong_variants={
              "cannot see itself": (_cannot_see_itself, ("differs", "own position")),
              "writes a copy": (_writes_a_copy, ("in place",)),
              "Python length": (_slices_by_length, ("one graph",)),
              "library": (_library_wrapper, ("llmlab's own",)),
          })
def _check_fixed_shape_attend(fn, **_) -> Verdict:
    if (problem := _check_small(fn)) is not None:
        return wrong(problem, "mask by position with a comparison of slot ids, not by slicing; "
                     "scatter_ writes in place.")
    if (problem := _check_in_model(fn)) is not None:
        return wrong(problem, "the small case passed: check the grouped KV heads "
                     "(query heads per KV head) and the dtype of what you write.")
    problem, done = _check_compiled(fn)
    if problem is not None:
        return wrong(problem, "every shape inside the step must be the same at every position: "
                     "keep the cache's full length and mask, and keep positions in tensors.")
    return right(f"the small cases match, SmolLM2's greedy tokens equal the contiguous "
                 f"cache's, and {done}.")


# ---- predict: the share of an eager step outside the matmuls ------------------------------------

_SHARE_CHOICES = {"a": "under 10%", "b": "10–30%", "c": "30–60%", "d": "over 60%"}


def share_letter(share: float) -> str:
    """The option of :data:`_SHARE_CHOICES` that holds ``share`` (a fraction)."""
    return "a" if share < 0.10 else "b" if share < 0.30 else "c" if share < 0.60 else "d"


@functools.lru_cache(maxsize=1)
def _measured_share() -> float:
    from ..profiling.overhead import make_decode_step, step_breakdown
    from ..quant import quantize

    model, _ = smollm2()
    q = quantize(model, "int8", rounding="rtn")
    return step_breakdown(make_decode_step(q, 1, 32), repeats=5).outside_share


@exercise("nb11.predict_outside_share", notebook=NB, kind="predict",
          title="predict: the share of an int8 batch-1 decode step outside the matmuls",
          solution="measured", choices=_SHARE_CHOICES,
          wrong_variants={"most of it": ("d", ("measured",))})
def _check_predict_outside_share(answer, measured: float | None = None, **_) -> Verdict:
    if measured is None:
        measured = _measured_share()
    want = share_letter(measured)
    if answer == "measured":                  # the reference solution: whatever was measured
        answer = want
    letter = str(answer).strip().lower()[:1]
    if letter not in _SHARE_CHOICES:
        return wrong(f"{answer!r} is not one of the choices {sorted(_SHARE_CHOICES)}.",
                     "answer with a letter, e.g. \"b\".")
    said = f"({letter}) {_SHARE_CHOICES[letter]}"
    if letter == want:
        return right(f"{said}: the measured share is {measured:.0%}. Every operator call costs "
                     "microseconds of Python and dispatch whatever its size, and the int8 "
                     "kernels made the matmuls short.")
    return wrong(f"you said {said}; the measured share is {measured:.0%}, option ({want}).",
                 "count the operator calls of a step and multiply by the cost of one call.")


# ---- predict: the modelled gain of a CUDA graph at batch 1 ---------------------------------------

# one recorded run (the eager step's calls, the micro-benchmark's t_op) and SmolLM2's bfloat16
# batch-1 decode on an H100's roofs, for a check without a run of its own
REFERENCE_GRAPH = {"calls": 1350, "t_op": 0.83e-6, "roof_s": 0.084e-3}
REPLAY_S = 10e-6             # the model's cost of launching one graph replay


def graph_gain(calls: int, t_op: float, roof_s: float) -> float:
    """Eager step / graph step in the notebook's model: eager pays max(roof, calls · t_op)
    (launches overlap the kernels), a replay the roof plus one launch."""
    return max(roof_s, calls * t_op) / (roof_s + REPLAY_S)


@exercise("nb11.predict_graph_gain", notebook=NB, kind="predict",
          title="predict: the modelled gain of a CUDA graph for SmolLM2 at batch 1 on an H100",
          solution=graph_gain(**REFERENCE_GRAPH),
          wrong_variants={"same kernels, no gain": (1.0, ("launches",)),
                          "the calls ratio": (1350.0, ("roof",)),
                          "launches only, no roof": (
                              REFERENCE_GRAPH["calls"] * REFERENCE_GRAPH["t_op"] / REPLAY_S,
                              ("roof",))})
def _check_predict_graph_gain(answer, calls: int | None = None, t_op: float | None = None,
                              roof_s: float | None = None) -> Verdict:
    """``calls``, ``t_op`` and ``roof_s`` from the notebook's run; without them a recorded run.
    Within 25% of the model counts."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a positive number (eager time / graph time), got "
                     f"{answer!r}.", "e.g. 2.0 for a graph step twice as fast.")
    ctx = dict(REFERENCE_GRAPH)
    for key, value in (("calls", calls), ("t_op", t_op), ("roof_s", roof_s)):
        if value is not None:
            ctx[key] = float(value)
    n, t, roof = ctx["calls"], ctx["t_op"], ctx["roof_s"]
    gain = graph_gain(n, t, roof)
    launches = n * t
    pace = ("longer than the kernels' {:.3f} ms roof, so the launches set the pace"
            if launches > roof else "shorter than the kernels' {:.3f} ms roof, which sets the "
            "pace").format(roof * 1e3)
    how = (f"eager: {n:.0f} launches × {t * 1e6:.2f} µs = {launches * 1e3:.2f} ms, {pace}; a "
           f"graph: the roof plus one replay, {roof * 1e3:.3f} + {REPLAY_S * 1e3:.3f} ms; gain "
           f"{max(launches, roof) * 1e3:.2f} / {(roof + REPLAY_S) * 1e3:.3f} = {gain:.1f}×")
    if abs(answer - gain) <= 0.25 * gain:
        return right(f"{answer:g}× is within 25% of the model: {how}. As the batch grows the "
                     "kernels lengthen and the same launches hide behind them.")
    if answer <= 1.5:
        return wrong(f"{answer:g}× says a graph hardly helps. It runs the same kernels, but at "
                     f"batch 1 their work is short and the CPU's launches are not: {how}.",
                     "compare the time of the launches with the time of the kernels.")
    if answer > 3 * gain and abs(answer - n) <= 0.2 * n:
        return wrong(f"{answer:g}× is the number of calls: a graph step is not one call's time, "
                     f"it still waits for its kernels' roof: {how}.",
                     "the graph removes the launches, not the kernels' work.")
    if answer > gain:
        return wrong(f"{answer:g}× is above the model: the graph step still takes its kernels' "
                     f"roof, which no launch trick removes: {how}.",
                     "divide the eager step's time by the roof plus one replay.")
    return wrong(f"{answer:g}× is below the model: {how}.",
                 "the eager step waits for its launches when they outlast the kernels.")


# ---- stretch: RMSNorm fused with the residual add, in Triton ------------------------------------

def _rmsnorm_reference(x, residual, weight, eps):
    h = x + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight, h


def _launch(kernel, x, residual, weight, eps):
    rows, n = x.shape
    # filled with NaN, so that an output the kernel never stores is seen as such
    out, h = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    block = 1 << (n - 1).bit_length()
    kernel[(rows,)](x, residual, weight, out, h, n, eps, BLOCK=block)
    return out, h


def _kernels():
    """The reference kernel and the wrong ones, built only when Triton is importable."""
    import triton
    import triton.language as tl

    @triton.jit
    def reference(X, R, W, OUT, H, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(R + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        h = x + r
        tl.store(H + row * n_cols + cols, h, mask=inside)
        mean_square = tl.sum(h * h, axis=0) / n_cols
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        out = h / tl.sqrt(mean_square + eps) * w
        tl.store(OUT + row * n_cols + cols, out, mask=inside)

    @triton.jit
    def mean_over_block(X, R, W, OUT, H, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        h = (tl.load(X + row * n_cols + cols, mask=inside, other=0.0)
             + tl.load(R + row * n_cols + cols, mask=inside, other=0.0))
        tl.store(H + row * n_cols + cols, h, mask=inside)
        w = tl.load(W + cols, mask=inside, other=0.0)
        out = h / tl.sqrt(tl.sum(h * h, axis=0) / BLOCK + eps) * w      # divides by BLOCK
        tl.store(OUT + row * n_cols + cols, out, mask=inside)

    @triton.jit
    def forgets_residual_out(X, R, W, OUT, H, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        h = (tl.load(X + row * n_cols + cols, mask=inside, other=0.0)
             + tl.load(R + row * n_cols + cols, mask=inside, other=0.0))
        w = tl.load(W + cols, mask=inside, other=0.0)
        out = h / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps) * w
        tl.store(OUT + row * n_cols + cols, out, mask=inside)          # H never written

    return reference, mean_over_block, forgets_residual_out


class _LazyKernel:
    """A stand-in that builds the Triton kernel on first use (Triton may be missing)."""

    def __init__(self, index: int):
        self.index = index

    def __getitem__(self, grid):
        return _kernels()[self.index][grid]


class _LibraryLauncher:
    """A 'kernel' whose launch runs llmlab's own fused kernel."""

    def __getitem__(self, grid):
        def launch(x, residual, weight, out, h, n, eps, BLOCK):
            from ..layers.fused import ops

            o, hh = ops("triton").add_rmsnorm(x, residual, weight, eps)
            out.copy_(o)
            h.copy_(hh)
        return launch


def _library_kernels():
    from ..layers.fused import ops

    return [ops("triton").add_rmsnorm]


@exercise("nb11.add_rmsnorm_kernel", notebook=NB, kind="build", stretch=True,
          title="stretch: RMSNorm fused with the residual add, in Triton",
          solution=_LazyKernel(0), placeholder=None,
          wrong_variants={"mean over BLOCK": (_LazyKernel(1), ("out differs",)),
                          "no residual out": (_LazyKernel(2), ("h differs",)),
                          "library": (_LibraryLauncher(), ("llmlab's own",))})
def _check_add_rmsnorm_kernel(kernel, **_) -> Verdict:
    from ..device import triton_interpreted

    try:
        import triton  # noqa: F401
    except ImportError:
        return wrong("Triton is not installed here (it is Linux-only), so the kernel cannot run.")
    if not hasattr(kernel, "__getitem__"):
        return wrong(f"pass the @triton.jit kernel itself, got {type(kernel).__name__}.")
    g = torch.Generator().manual_seed(0)
    device = "cpu" if triton_interpreted() else "cuda"
    for rows, n in ((3, 576), (2, 100), (1, 1000)):      # SmolLM2's hidden, then ragged widths
        x, r = (torch.randn(rows, n, generator=g).to(device) for _ in range(2))
        w = torch.rand(n, generator=g).to(device) + 0.5
        want_out, want_h = _rmsnorm_reference(x, r, w, 1e-5)
        with forbid(*_library_kernels()):
            out, h = _launch(kernel, x, r, w, 1e-5)
        for got, want, name in ((h, want_h, "h"), (out, want_out, "out")):
            if bool(torch.isnan(got).all()):
                return wrong(f"{name} differs: your kernel never stored {name} (it still holds "
                             f"the NaN the check filled it with; rows={rows}, hidden={n}).",
                             f"tl.store every element of {name}, masked past n_cols.")
            if (problem := compare_tensors(got, want, name, 1e-4, 1e-4)) is not None:
                return wrong(f"{problem} (rows={rows}, hidden={n})",
                             "mask the columns past n_cols on every load and store, and divide "
                             "the sum of squares by n_cols, not by BLOCK; store h too.")
    return right("h and the normalized output match PyTorch's at hidden sizes 576, 100 and 1000 "
                 "(not powers of two): one read of x and the residual, one write of each output.")
