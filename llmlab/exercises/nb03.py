"""The exercises of notebook 03 (FlashAttention).

- ``nb03.online_softmax_step`` (build): fold one block of scores into the running max,
  sum and accumulator.
- ``nb03.flash_forward`` (build): the tiled forward with the online softmax, checked
  against the textbook formula at ragged lengths, for peak memory linear in N, and inside
  SmolLM2 as an attention backend. While the student's code runs, llmlab's own attention
  functions (and its online-softmax step) and torch's fused attention raise.
- ``nb03.predict_peak_memory`` (predict): how many times more memory naive needs.
- ``nb03.explain_loop_order`` (explain): why FlashAttention-2 swapped the loops.
- ``nb03.skipped_tiles`` (compute): the causal block schedule.
- ``nb03.break_even_block_q`` (compute; notebook 03b): the Br at which the HBM-traffic model's
  K/V re-reads tie with standard attention's S and P, the lower bound on a GPU tile.
- ``nb03.flash_triton_inner_loop`` (build, stretch; notebook 03b): the inner loop of a Triton
  kernel, registered only where Triton is installed (see
  :mod:`llmlab.exercises.flash_triton_skeleton`).

Shapes of the student's attention functions follow notebook 01: q [batch, heads, n_q, d],
k and v [batch, kv_heads, n_k, d]; query head h reads KV head h // (heads // kv_heads); the
causal mask is aligned bottom-right (query i sees key j when j <= i + n_k - n_q); scale 1/√d.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from . import (choice_verdict, compare_tensors, exercise, first_token_difference, forbid,
               number_verdict, right, wrong)
from ..attention.flash import CAUSAL_SKIPPED, block_schedule, online_softmax_update
from ..device import has_triton
from ..profiling.hbm import standard_attention_hbm, tiled_attention_hbm
from .nb01 import TorchAnswer, forbid_torch, library_attention

NB = "03_flash_attention"
NB_GPU = "03b_flash_attention_on_gpu"     # the optional GPU half: break-even Br, Triton stretch


def _torch_answer(exc: TorchAnswer):
    return wrong(f"your answer calls torch's {exc.what}: it does all of attention at once, "
                 "which is what this build asks you to write tile by tile.",
                 "loop over blocks of queries and keys with plain tensor operations (@, "
                 "masked_fill, amax, exp, sum) and your online-softmax step.")


# ---- a reference in float64 (and the mistakes it can imitate, to name them) ---------------

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        *, top_left: bool = False, keys: int | None = None,
                        scale: float | None = None, head_of: str = "group") -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v in float64, materializing the scores.

    q [batch, heads, n_q, d]; k, v [batch, kv_heads, n_k, d] -> [batch, heads, n_q, d].
    The keyword arguments reproduce mistakes so a checker can recognise them: ``top_left``
    aligns the causal mask top-left; ``keys`` keeps only the first ``keys`` keys; ``scale``
    replaces 1/√d; ``head_of="modulo"`` maps query head h to KV head h % kv_heads. Rows
    that see no key come back as zeros.
    """
    b, h, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if head_of == "group":
        idx = torch.arange(h) // (h // kv_heads)
    elif head_of == "modulo":
        idx = torch.arange(h) % kv_heads
    else:
        raise ValueError(f"head_of={head_of!r} is not one of ('group', 'modulo')")
    kk, vv = k.double()[:, idx], v.double()[:, idx]
    s = q.double() @ kk.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        allowed &= j <= (i if top_left else i + n_k - n_q)
    if keys is not None:
        allowed &= j < keys
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ vv


# ---- exercise 1: one online-softmax step ------------------------------------------------------

def _step_cases():
    g = torch.Generator().manual_seed(3)
    rows, cols, d = 4, 6, 5
    m = torch.randn(rows, generator=g, dtype=torch.float64)
    l = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
    acc = torch.randn(rows, d, generator=g, dtype=torch.float64)
    s = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3
    s[0] += 10          # row 0: the max grows a lot, so the old state must shrink
    s[1] -= 10          # row 1: the max stays, the new block adds little
    v = torch.randn(cols, d, generator=g, dtype=torch.float64)
    return m, l, acc, s, v


def _step_no_l_rescale(m, l, acc, scores, v_block):
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_block


def _step_no_acc_rescale(m, l, acc, scores, v_block):
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), acc + p @ v_block


def _step_block_max_only(m, l, acc, scores, v_block):
    m_new = scores.amax(dim=-1)                   # forgets the maximum seen so far
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_block


def _solution_online_softmax_step(m, l, acc, scores, v_block):
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)                  # shrinks what was summed against the old max
    p = torch.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_block


def _step_wraps_llmlab(m, l, acc, scores, v_block):
    return online_softmax_update(m, l, acc, scores, v_block)


@exercise("nb03.online_softmax_step", notebook=NB, kind="build",
          title="one online-softmax step: fold a block of scores into (m, l, acc)",
          solution=_solution_online_softmax_step,
          wrong_variants={
              "l not rescaled": (_step_no_l_rescale, ("l_new", "exp(m - m_new)")),
              "acc not rescaled": (_step_no_acc_rescale, ("acc_new", "exp(m - m_new)")),
              "block max instead of running max": (_step_block_max_only, ("m_new", "larger")),
              "wraps llmlab's step": (_step_wraps_llmlab, ("llmlab's own",
                                                           "online_softmax_update")),
          })
def _check_online_softmax_step(step: Callable) -> object:
    m, l, acc, s, v = _step_cases()
    want = online_softmax_update(m, l, acc, s, v)
    with forbid(online_softmax_update):
        got = step(m.clone(), l.clone(), acc.clone(), s.clone(), v.clone())
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return wrong(f"your step returned {type(got).__name__}; it should return a tuple "
                     "(m_new, l_new, acc_new).", "end with `return m_new, l_new, acc_new`.")
    hints = {
        "m_new": "m_new is the larger of the old running max and this block's row max "
                 "(torch.maximum(m, scores.amax(dim=-1))).",
        "l_new": "the old sum was taken against the old max: multiply it by exp(m - m_new) "
                 "before adding this block's Σ exp(s - m_new).",
        "acc_new": "rescale the old accumulator by exp(m - m_new) as well (one factor per "
                   "row, so alpha[:, None]), then add exp(s - m_new) @ v_block.",
    }
    for name, a, b in zip(("m_new", "l_new", "acc_new"), got, want):
        problem = compare_tensors(a, b, name, atol=1e-9)
        if problem:
            return wrong(problem, hints[name])
    return right("the running max, sum and accumulator all match (max |error| < 1e-9); that "
                 "rescaling is what keeps the tiled softmax exact.")


# ---- exercise 2: the tiled forward -----------------------------------------------------------

def _solution_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int,
                            block_n: int, causal: bool = True) -> torch.Tensor:
    """The tiled forward with an online softmax: q [b, h, n_q, d], k/v [b, kv_heads, n_k, d]."""
    b, h, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    groups = h // kv_heads
    # the query heads that share a KV head side by side: [b, kv_heads, groups, n_q, d]
    qg = q.reshape(b, kv_heads, groups, n_q, d) / math.sqrt(d)
    kg, vg = k[:, :, None], v[:, :, None]              # [b, kv_heads, 1, n_k, d]: broadcast
    offset = n_k - n_q                                   # bottom-right causal alignment
    out = torch.empty_like(qg)
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        q_blk = qg[..., i0:i1, :]
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_blk)
        last = min(n_k, i1 + offset) if causal else n_k   # keys past the diagonal: skipped
        for j0 in range(0, last, block_n):
            j1 = min(j0 + block_n, n_k)
            s = q_blk @ kg[..., j0:j1, :].transpose(-1, -2)          # one [Br, Bc] tile
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vg[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :] = acc / l[..., None]
    return out.reshape(b, h, n_q, d)


def _flawed_flash_forward(q, k, v, block_m, block_n, causal=True, *, mistake: str):
    """The solution with one realistic mistake (``mistake``), for the checker's tests."""
    b, h, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    groups = h // kv_heads
    qg = q.reshape(b, kv_heads, groups, n_q, d) / math.sqrt(d)
    kg, vg = k[:, :, None], v[:, :, None]
    offset = n_k - n_q
    full = qg @ kg.transpose(-1, -2) if mistake == "full scores" else None   # [.., n_q, n_k]
    out = torch.empty_like(qg)
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        q_blk = qg[..., i0:i1, :]
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_blk)
        last = min(n_k, i1 + offset) if causal else n_k
        if mistake == "floor blocks":                  # n // block instead of ceil(n / block)
            last = (last // block_n) * block_n
        for j0 in range(0, last, block_n):
            j1 = min(j0 + block_n, n_k)
            if full is not None:
                s = full[..., i0:i1, j0:j1]
            else:
                s = q_blk @ kg[..., j0:j1, :].transpose(-1, -2)
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                shift = 0 if mistake == "top-left" else offset
                s = s.masked_fill(cols > rows + shift, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            if mistake == "no rescale":
                l = l + p.sum(dim=-1)
                acc = acc + p @ vg[..., j0:j1, :]
            else:
                alpha = torch.exp(m - m_new)
                l = alpha * l + p.sum(dim=-1)
                acc = alpha[..., None] * acc + p @ vg[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :] = acc / l[..., None]
    return out.reshape(b, h, n_q, d)


def _naive_forward(q, k, v, block_m, block_n, causal=True):
    """llmlab's naive attention with this exercise's signature (the blocks unused)."""
    from ..attention import naive_attention

    return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


def _flash_wrapper(q, k, v, block_m, block_n, causal=True):
    """llmlab's own tiled forward between two transposes (blocks rounded to powers of two)."""
    from ..attention.flash import flash_attention

    return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


def _sdpa_forward(q, k, v, block_m, block_n, causal=True):
    """torch's fused attention with the KV heads repeated."""
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
        is_causal=causal)


def _materialized_tile_loop(q, k, v, block_m, block_n, causal=True):
    """The student's own dense attention, then a loop that copies it out block by block:
    the right numbers, N×N memory."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    out = torch.empty_like(q)
    for i0 in range(0, q.shape[2], block_m):
        w = e[..., i0:i0 + block_m, :]
        out[..., i0:i0 + block_m, :] = (w / w.sum(-1, keepdim=True)) @ vv
    return out


# (name, n_q, n_k, block_m, block_n, causal): each case adds one difficulty to the last
_CASES = (
    ("one key block", 24, 32, 8, 32, False),
    ("several key blocks", 32, 32, 8, 8, False),
    ("ragged lengths", 37, 37, 16, 8, False),
    ("causal, ragged", 37, 37, 16, 8, True),
    ("causal, 7 new queries over 45 keys", 7, 45, 4, 16, True),
)
_ATOL = 1e-4          # float32 against a float64 reference


def _qkv(n_q: int, n_k: int, *, batch: int = 2, heads: int = 4, kv_heads: int = 2, d: int = 16,
         seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_q, d, generator=g) * 2      # spread scores: the max moves
    k = torch.randn(batch, kv_heads, n_k, d, generator=g)
    v = torch.randn(batch, kv_heads, n_k, d, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double().cpu() - want).abs().max())


def _diagnose(got: torch.Tensor, q, k, v, case) -> tuple[str, str]:
    """Name the mistake a wrong output shows: (what, hint)."""
    _, n_q, n_k, block_m, block_n, causal = case

    def matches(**kw) -> bool:
        return _max_err(got, reference_attention(q, k, v, **kw)) < _ATOL

    if causal and matches(causal=False):
        return ("Your output equals attention with no causal mask at all.",
                "inside each tile set the scores of keys j > i + n_k - n_q to -inf.")
    if causal and n_q != n_k and matches(causal=True, top_left=True):
        return ("Your causal mask is aligned top-left (query i sees keys j <= i). With fewer "
                "queries than keys, the queries are the *last* n_q positions: the mask is "
                "aligned bottom-right, j <= i + n_k - n_q.",
                "add the offset n_k - n_q to the row index in the mask and in the last key "
                "block you visit.")
    if n_k % block_n and matches(causal=causal, keys=(n_k // block_n) * block_n):
        kept = (n_k // block_n) * block_n
        return (f"Your output ignores keys {kept}..{n_k - 1}: the last partial block of keys "
                f"is dropped (an off-by-one in the block loop bound: {n_k} // {block_n} = "
                f"{n_k // block_n} blocks, but {math.ceil(n_k / block_n)} are needed).",
                "loop `for j0 in range(0, n_k, block_n)` and cut the last block with "
                "min(j0 + block_n, n_k).")
    rows_bad = (got.detach().double().cpu() - reference_attention(q, k, v, causal=causal)
                ).abs().amax(dim=(0, 1, 3)) > _ATOL
    full_q = (n_q // block_m) * block_m
    if n_q % block_m and bool(rows_bad.any()) and not bool(rows_bad[:full_q].any()):
        return (f"Only rows {full_q}..{n_q - 1}, the last partial block of queries, are wrong.",
                "loop `for i0 in range(0, n_q, block_m)` and cut the last block with "
                "min(i0 + block_m, n_q).")
    if matches(causal=causal, scale=1.0):
        return ("Your output equals attention without the 1/√d scale.",
                "multiply the scores (or q) by 1 / math.sqrt(d).")
    if k.shape[1] != q.shape[1] and matches(causal=causal, head_of="modulo"):
        return ("Query head h reads KV head h % kv_heads; grouped-query attention groups "
                "neighbouring heads: head h reads KV head h // (heads // kv_heads).",
                "reshape q to [batch, kv_heads, heads // kv_heads, n_q, d].")
    if case[0] == "several key blocks":
        return ("With one key block your output is right, but once a row's keys span several "
                "blocks it is off: the state summed so far is not rescaled when the running "
                "max grows.",
                "when a block raises the row max from m to m_new, multiply l and acc by "
                "exp(m - m_new) before adding the block (no running-max rescale is the "
                "usual cause).")
    return ("", "compare your loop with the online-softmax step above, one block at a time, on "
                "a tiny input against reference_attention.")


def _peak_exponent(fn: Callable, ns=(256, 512, 1024), block: int = 64) -> tuple[float, list[int]]:
    """Fit peak bytes ∝ N^e of ``fn`` on causal self-attention at the lengths ``ns``."""
    from ..profiling import peak_memory

    peaks = []
    for n in ns:
        q, k, v = _qkv(n, n, batch=1, heads=2, kv_heads=1, d=16, seed=n)
        peaks.append(peak_memory(lambda: fn(q, k, v, block, block, causal=True),
                                 device="cpu").peak_bytes)
    x = torch.tensor([math.log(n) for n in ns], dtype=torch.float64)
    y = torch.tensor([math.log(max(p, 1)) for p in peaks], dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return slope, peaks


def as_backend(fn: Callable, block_m: int = 64, block_n: int = 64) -> Callable:
    """Wrap ``fn(q, k, v, block_m, block_n, causal)`` (q [batch, heads, n_q, d]) as an
    llmlab attention backend (q [batch, seq, heads, head_dim]; see :mod:`llmlab.attention`),
    ready for ``llmlab.attention.register(name, as_backend(fn))``. It runs one prompt at a
    time: a padding mask that hides a key is refused."""

    def forward(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
        if key_padding_mask is not None and not bool(key_padding_mask.all()):
            raise ValueError("this backend takes no padding: generate one prompt at a time")
        if softmax_scale is not None and abs(softmax_scale * math.sqrt(q.shape[-1]) - 1) > 1e-9:
            raise ValueError(f"softmax_scale={softmax_scale} is not 1/√d; this backend "
                             "always scales by 1/√d")
        # contiguous copies, so that a .view() in the student's code works as on the test inputs
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return fn(q, k, v, block_m, block_n, causal=causal).transpose(1, 2)

    return forward


def run_in_model(fn: Callable, model=None, tokenizer=None, block_m: int = 8, block_n: int = 4,
                 prompt: str = "The capital of France is", max_new_tokens: int = 6) -> dict:
    """Greedy-generate with SmolLM2 using ``fn`` as the attention of every layer (KV cache on:
    the prompt runs causal, each new token attends over the cache), then run the prompt and
    the generated tokens through the model once with ``fn`` and once with ``naive``.

    Returns the generated token ids, the tokens ``naive`` predicts at the same positions
    (greedy with a shared prefix: equal lists mean identical generations), and the max
    |Δ logits| between the two forwards. The model's backend is restored afterwards."""
    from .. import attention, generate, load_model, load_tokenizer

    model = model if model is not None else load_model("smollm2-135m", attention="naive")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer("smollm2-135m")
    name = "nb03.flash_forward"
    attention.register(name, as_backend(fn, block_m, block_n))
    before = model.attention
    prompt_ids = tokenizer(prompt)["input_ids"]
    try:
        with torch.inference_mode():
            got = generate(model.set_attention(name), tokenizer, prompt,
                           max_new_tokens=max_new_tokens, chat=False, kv_cache="contiguous")
            ids = torch.tensor([prompt_ids + got.token_ids[:-1]], device=model.device)
            logits = model(ids)[0]
            ref_logits = model.set_attention("naive")(ids)[0]
    finally:
        model.set_attention(before)
    reference = ref_logits[len(prompt_ids) - 1:].argmax(dim=-1).tolist()
    return {"tokens": got.token_ids, "reference": reference, "text": got.text,
            "max_logit_error": float((logits - ref_logits).abs().max())}


@exercise("nb03.flash_forward", notebook=NB, kind="build",
          title="the tiled FlashAttention forward with an online softmax",
          solution=_solution_flash_forward,
          wrong_variants={
              "no running-max rescale": (functools.partial(_flawed_flash_forward,
                                                           mistake="no rescale"), ("rescale",)),
              "off-by-one block bound": (functools.partial(_flawed_flash_forward,
                                                           mistake="floor blocks"),
                                         ("last partial block", "off-by-one")),
              "causal mask top-left": (functools.partial(_flawed_flash_forward, mistake="top-left"),
                                       ("top-left", "bottom-right")),
              "materializes the full score matrix": (
                  functools.partial(_flawed_flash_forward, mistake="full scores"),
                  ("N×N", "materializ")),
              "dense attention cut into row blocks": (_materialized_tile_loop,
                                                      ("N×N", "materializ")),
              "wraps llmlab's naive attention": (_naive_forward, ("llmlab's own",
                                                                  "naive_attention")),
              "wraps llmlab's flash_attention": (_flash_wrapper, ("llmlab's own",
                                                                  "flash_attention")),
              "wraps torch's fused attention": (_sdpa_forward, ("torch's fused attention",)),
          })
def _check_flash_forward(fn: Callable, model=None, tokenizer=None) -> object:
    try:    # the student's calls on the small cases; the model's own run comes after
        with forbid(*library_attention(), online_softmax_update), forbid_torch():
            verdict, slope = _check_flash_forward_cases(fn)
    except TorchAnswer as exc:
        return _torch_answer(exc)
    if verdict is not None:
        return verdict
    run = run_in_model(fn, model, tokenizer)
    diff = first_token_difference(run["tokens"], run["reference"])
    if diff or run["max_logit_error"] > 1e-3:
        return wrong(f"inside SmolLM2: {diff or 'same tokens'}; max |Δ logits| = "
                     f"{run['max_logit_error']:.2g} (allowed 1e-3).",
                     "the small cases pass, so look at what the model adds: float32 inputs, "
                     "9 query heads over 3 KV heads, head_dim 64.")
    return right(f"exact at ragged lengths and blocks that do not divide N (5 cases, max "
                 f"|error| < {_ATOL:g}); peak memory grows as N^{slope:.2f}, not N²; SmolLM2 "
                 f"with your attention generates the same {len(run['tokens'])} greedy tokens "
                 f"as naive (max |Δ logits| = {run['max_logit_error']:.1e}).")


def _check_flash_forward_cases(fn: Callable):
    """(a failing verdict or None, the fitted peak-memory exponent)."""
    for case in _CASES:
        name, n_q, n_k, block_m, block_n, causal = case
        q, k, v = _qkv(n_q, n_k)
        got = fn(q.clone(), k.clone(), v.clone(), block_m, block_n, causal=causal)
        problem = compare_tensors(got, reference_attention(q, k, v, causal=causal), "the output",
                                  atol=_ATOL)
        if problem:
            what, hint = ("", "") if "shape" in problem or "tensor" in problem else \
                _diagnose(got, q, k, v, case)
            if not hint:
                hint = "return [batch, heads, n_q, d], the shape of q."
            return wrong(f"case '{name}' (n_q={n_q}, n_k={n_k}, block_m={block_m}, "
                         f"block_n={block_n}, causal={causal}): {problem} {what}".rstrip(),
                         hint), None
    slope, peaks = _peak_exponent(fn)
    if slope > 1.5:
        return wrong(f"the output is right, but peak memory grows as N^{slope:.2f} "
                     f"({peaks[0] / 2**10:.0f} KiB at N=256, {peaks[-1] / 2**10:.0f} KiB at "
                     "N=1024): your function materializes something of size N×N (the full "
                     "score matrix, the probabilities, or a full mask).",
                     "only ever hold one [block_m, block_n] tile of scores; build the causal "
                     "mask per tile from torch.arange."), slope
    return None, slope


# ---- predict, explain, compute ---------------------------------------------------------------

PEAK_N, PEAK_D, PEAK_BLOCKS = 4096, 64, (256, 512)


@functools.lru_cache(maxsize=4)
def measure_peak_ratio(n: int = PEAK_N, d: int = PEAK_D, blocks: tuple[int, int] = PEAK_BLOCKS
                       ) -> float:
    """Peak memory of ``naive`` ÷ ``flash`` (llmlab's), one causal call, batch 1, one head,
    float32, on CPU: the measurement the prediction is compared with (byte counts do not
    vary between runs, so it is measured once per process)."""
    from ..attention import naive_attention
    from ..attention.flash import flash_attention
    from ..profiling import peak_memory

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, d, generator=g) for _ in range(3))
    naive = peak_memory(lambda: naive_attention(q, k, v, causal=True), device="cpu").peak_bytes
    flash = peak_memory(lambda: flash_attention(q, k, v, causal=True, block_q=blocks[0],
                                                block_k=blocks[1]), device="cpu").peak_bytes
    return naive / flash


@exercise("nb03.predict_peak_memory", notebook=NB, kind="predict",
          title="predict: how many times more peak memory does naive need than flash at N=4096?",
          solution=25.0,
          wrong_variants={"about the same": (1.0, ("N×N",)),
                          "N times more": (4096.0, ("N·d",))})
def _check_predict_peak_memory(answer, measured: float | None = None) -> object:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a positive number (a ratio), got {answer!r}.",
                     "write how many times more memory naive needs, e.g. 10.")
    ratio = measure_peak_ratio() if measured is None else float(measured)
    factor = answer / ratio
    why = ("naive holds N×N float32 matrices (scores, then probabilities: "
           f"2·N²·4 bytes = {2 * PEAK_N ** 2 * 4 / 2**20:.0f} MiB at N={PEAK_N}), flash holds "
           f"O(N·d) (Q, K, V copies and the output, about {4 * PEAK_N * PEAK_D * 4 / 2**20:.0f} "
           "MiB) plus one Br×Bc tile.")
    if 0.5 <= factor <= 2:
        return right(f"you said {answer:g}, measured {ratio:.1f}× (within a factor of 2): {why}")
    return wrong(f"you said {answer:g}, measured {ratio:.1f}×: your guess is {factor:.2g}× the "
                 f"measurement (a factor of 2 either way counts). {why}",
                 "count the bytes of the largest tensors each one keeps alive at once.")


LOOP_CHOICES = {
    "a": "It moves fewer HBM bytes than FlashAttention-1 at every SRAM size, so no kernel can "
         "lose by it.",
    "b": "Each query block becomes a program of its own, so one long prompt fills the GPU's "
         "SMs even at batch 1.",
    "c": "It can skip the tiles above the causal diagonal, which the K/V-outer order must "
         "compute.",
    "d": "The online softmax needs every score of a query row in one program, and only the "
         "query-outer order keeps them together.",
}

_LOOP_EXPLANATIONS = {
    "a": "No: the SRAM plot above says otherwise. FlashAttention-1's traffic falls as 1/M, "
         "and from 128 KiB up (164 and 228 KiB included) its curve lies below the Br = 128 "
         "line, which does not move with M. On bytes alone, a large SRAM favours "
         "FlashAttention-1's order.",
    "b": "Yes. With the outer loop over query blocks, each query block is an independent "
         "program, so the GPU has (N/Br)·batch·heads of them to spread over its SMs even when "
         "batch × heads is small (long sequences); each program owns its rows of O, so the "
         "partial output never goes back to HBM for a read-modify-write between key blocks; "
         "and the division by ℓ happens once at the end instead of after every key block.",
    "c": "No: both orders can skip the same tiles. A tile is masked when all its keys come "
         "after all its queries, whichever loop is outside, so a K/V-outer loop skips it as "
         "easily (it starts each key block's query loop at the diagonal); the FLOPs are the "
         "same.",
    "d": "No: the online softmax is what lets a row be processed one key block at a time, in "
         "either order. FlashAttention-1 keeps each row's m and ℓ in HBM and rescales that "
         "row of O there after every key block: it works, at the price of a read-modify-write "
         "of O per key block.",
}


@exercise("nb03.explain_loop_order", notebook=NB, kind="explain",
          title="explain: why did FlashAttention-2 put the query blocks in the outer loop?",
          solution="b", choices=LOOP_CHOICES,
          wrong_variants={"fewer bytes at every M": ("a", ("228 KiB",)),
                          "only it skips masked tiles": ("c", ("both orders",)),
                          "online softmax needs the row": ("d", ("one key block at a time",))})
def _check_explain_loop_order(answer) -> object:
    return choice_verdict(answer, "b", _LOOP_EXPLANATIONS)


@exercise("nb03.skipped_tiles", notebook=NB, kind="compute",
          title="causal skipping: tiles never loaded at N=1024, Br=Bc=128",
          solution=28, wrong_variants={"counted the diagonal": (36, ("strictly above",)),
                                       "half of all": (32, ("strictly above",))})
def _check_skipped_tiles(answer, n: int = 1024, block: int = 128) -> object:
    want = int((block_schedule(n, n, block, block, causal=True) == CAUSAL_SKIPPED).sum())
    blocks = n // block
    if answer == want:
        return right(f"{want} of {blocks ** 2} tiles are never loaded: every tile strictly "
                     "above the diagonal. The diagonal tiles are loaded and masked.")
    return wrong(f"{answer!r} is not it. There are {blocks} blocks per side; only the tiles "
                 "strictly above the diagonal are skipped (the diagonal ones are computed with "
                 "a mask).", "block_schedule(1024, 1024, 128, 128) shows them (0 = skipped).")


# ---- notebook 03b: the break-even Br, the floor under a GPU tile ---------------------------

BREAK_EVEN_N, BREAK_EVEN_D = 4096, 128


def break_even_block_q(d: int = BREAK_EVEN_D) -> int:
    """The Br at which FlashAttention-2's K/V re-reads, 2·N²·d/Br elements per head, equal
    the 4·N² elements standard attention moves for S and P (the N·d terms left out): d/2."""
    return d // 2


@exercise("nb03.break_even_block_q", notebook=NB_GPU, kind="compute",
          title="when does tiling pay in bytes? the break-even Br at d = 128",
          solution=break_even_block_q(),
          wrong_variants={"Br = d": (128, ("K and V",)), "d/4": (32, ("solve",)),
                          "2·d": (256, ("solve",))})
def _check_break_even_block_q(answer, d: int = BREAK_EVEN_D, n: int = BREAK_EVEN_N) -> object:
    want = break_even_block_q(d)
    std = standard_attention_hbm(n, d).total
    ratios = ", ".join(f"Br = {br}: {tiled_attention_hbm(n, d, br, 64).total / std:.2f}×"
                       for br in (want // 2, want, 2 * want))
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and answer == d:
        return wrong(f"Br = {answer} counts one re-read tensor: K and V are both re-read once "
                     "per query block, 2·N·d elements per pass, so the re-reads are 2·N²·d/Br.",
                     "set 2·N²·d/Br equal to 4·N² and solve for Br.")
    return number_verdict(answer, want, good=(
        f"Br = d/2 = {want}: below it the K/V re-reads, 2·N²·d/Br, outweigh the 4·N² elements "
        f"of S and P that standard attention writes and reads; above it tiling moves fewer "
        f"bytes. The model at N = {n}, d = {d}, tiled ÷ standard: {ratios} (the N·d terms put "
        "break-even itself a hair under 1). Real kernels use Br of 64 to 128, at or past this "
        "point, and gain the rest from never writing S and P."),
        hint="solve 2·N²·d/Br = 4·N² for Br (N cancels).")


# ---- stretch: the inner loop of a Triton kernel -----------------------------------------------

if has_triton():
    from .flash_triton_skeleton import (check_inner_loop as _check_inner_loop,
                                        _solution_inner_loop, wrong_inner_loops)

    exercise("nb03.flash_triton_inner_loop", notebook=NB_GPU, kind="build", stretch=True,
             title="the online-softmax inner loop of a Triton FlashAttention kernel",
             solution=_solution_inner_loop,
             wrong_variants=wrong_inner_loops())(_check_inner_loop)
