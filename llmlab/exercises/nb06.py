"""Exercises of notebook 06 (mixture of experts).

The build exercise is ``nb06.moe_dispatch``: the student writes Mixtral's routing (softmax
over the router logits, top-k, renormalize) and the grouped dispatch (sort the (token,
expert) pairs by expert, offsets, one matrix multiply per projection per expert). It is
judged cheapest first: small layers whose experts are all equal (each token's weights must
then add up to one, which exposes routing-weight mistakes), small layers with distinct
experts (against the library's routing and dispatch), a FLOP count (a dispatch that runs
every expert on every token is not sparse), and finally the MoE layers of two real models
with the student's function registered as their dispatch (``llmlab.layers.moe.
register_dispatch``): tiny-mixtral (random, 4 experts) and the upcycled SmolLM2
(``smollm2-135m-moe8``), both against dense dispatch within 1e-4.

The stretch exercise ``nb06.capacity_drop`` applies a capacity factor the way GShard and
the Switch Transformer do in training.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..layers.moe_stats import MIXTRAL_8X7B, simulate_capacity
from . import (choice_verdict, compare_tensors, exercise, first_token_difference, forbid, right,
               wrong)

NB = "06_mixture_of_experts"
TOL = 1e-4  # a model's logits with the student's dispatch against dense dispatch


# ---- 1. active parameters (compute) ------------------------------------------------------------

def _solution_active_params(config):
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o and k, v
    experts = config.num_experts_per_tok * 3 * h * config.intermediate_size
    per_layer = attention + experts + h * config.num_experts + 2 * h  # + router + 2 norms
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + embeddings + h


def _active_without_router(config):
    return _solution_active_params(config) - config.num_layers * config.hidden_size * config.num_experts


@exercise("nb06.active_params", notebook=NB, kind="compute",
          title="the parameters one token uses in a MoE model",
          solution=_solution_active_params,
          wrong_variants={"counts every expert": (lambda c: c.num_parameters(), ("all experts",)),
                          "forgot the router": (_active_without_router, ("router",))})
def _check_active_params(fn):
    """``fn(config) -> int``: embeddings, attention, norms, the router and top-k experts."""
    configs = [MIXTRAL_8X7B,
               dataclasses.replace(MIXTRAL_8X7B, num_experts=16, num_experts_per_tok=4),
               ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                           num_experts=8, num_experts_per_tok=2, model_type="mixtral")]
    for c in configs:
        got = fn(c)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return wrong(f"expected a number of parameters, got {got!r}.", "return an int.")
        want = c.num_parameters(active=True)
        if abs(got - want) < 1:  # an exact count
            continue
        where = f"{c.num_experts} experts, top-{c.num_experts_per_tok}, hidden {c.hidden_size}"
        if abs(got - c.num_parameters()) <= 1e-3 * want:
            problem = f"for {where} you counted all experts ({got:,.0f}); a token uses only top-k."
        elif abs(want - got - c.num_layers * c.hidden_size * c.num_experts) < 1:
            problem = f"for {where} you left out the router ({c.hidden_size} × {c.num_experts} per layer)."
        else:
            problem = f"for {where} you got {got:,.0f}, expected {want:,} ({got / want:.3f}×)."
        return wrong(problem, "per layer: q, k, v, o + k experts × 3·hidden·intermediate + the "
                              "router (hidden·E) + 2 norms; then the embedding(s) and the final norm.")
    m = MIXTRAL_8X7B
    return right(f"Mixtral 8x7B uses {m.num_parameters(active=True) / 1e9:.1f}B of its "
                 f"{m.num_parameters() / 1e9:.1f}B parameters per token.")


# ---- 2. routing and grouped dispatch (the build exercise) ---------------------------------------

def _solution_moe_dispatch(x, router_logits, top_k, w_gate, w_up, w_down):
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # the k weights sum to one
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    counts = torch.bincount(flat, minlength=w_gate.shape[0])
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    token = order // top_k  # the token of each sorted pair
    rows, pair_weights = x[token], weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        if a == b:
            continue
        h = F.silu(rows[a:b] @ w_gate[e].T) * (rows[a:b] @ w_up[e].T)
        y = (h @ w_down[e].T) * pair_weights[a:b, None].to(x.dtype)
        out.index_add_(0, token[a:b], y)
    return out


def _grouped(x, weights, experts, w_gate, w_up, w_down, start_at=None, sorted_weights=True):
    """The dispatch half of the wrong variants below (the mistakes are in the arguments)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0])
    starts = [0] + torch.cumsum(counts, 0).tolist()
    if start_at is not None:
        starts = start_at(counts)
    token = order // k
    rows = x[token]
    pw = weights.reshape(-1)[order] if sorted_weights else weights.reshape(-1)
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        a, b = starts[e], starts[e] + int(counts[e])
        if a >= b:
            continue
        h = F.silu(rows[a:b] @ w_gate[e].T) * (rows[a:b] @ w_up[e].T)
        out.index_add_(0, token[a:b][:len(h)], (h @ w_down[e].T) * pw[a:b, None][:len(h)])
    return out


def _route(logits, k, renormalize=True):
    w, e = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), e


def _no_renormalization(x, logits, k, *w):
    return _grouped(x, *_route(logits, k, renormalize=False), *w)


def _top1(x, logits, k, *w):
    return _grouped(x, *_route(logits, 1), *w)


def _offsets_off_by_one(x, logits, k, *w):
    # inclusive cumulative sums used as start offsets: expert e starts where e + 1 should
    return _grouped(x, *_route(logits, k), *w, start_at=lambda c: torch.cumsum(c, 0).tolist())


def _weights_not_sorted(x, logits, k, *w):
    return _grouped(x, *_route(logits, k), *w, sorted_weights=False)


def _every_expert(x, logits, k, w_gate, w_up, w_down):
    weights, experts = _route(logits, k)
    combine = torch.zeros(x.shape[0], w_gate.shape[0]).scatter_(1, experts, weights)
    return sum(F.linear(F.silu(F.linear(x, w_gate[e])) * F.linear(x, w_up[e]), w_down[e])
               * combine[:, e, None] for e in range(w_gate.shape[0]))


def _library_wrapper(x, logits, k, *w):
    from ..layers import moe as M

    return M.dispatch_grouped(x, *M.route(logits, k), *w)


def _library_pieces():
    """llmlab's own routing and dispatch (and the grouped GEMM under them): during a check
    they raise, so an answer that wraps them is told so."""
    from ..kernels import moe_gemm
    from ..layers import moe as M

    return (M.route, M.group_by_expert, M.dispatch_grouped, M.dispatch_loop, M.dispatch_dense,
            moe_gemm.grouped_swiglu, moe_gemm.grouped_gemm, moe_gemm.grouped_gemm_torch,
            moe_gemm.grouped_gemm_triton)


def _guarded(fn):
    """``fn`` with llmlab's own routing and dispatch forbidden while it runs."""
    def run(*args):
        with forbid(*_library_pieces()):
            return fn(*args)
    return run


def _small_case(tokens: int, experts: int, hidden: int = 16, inter: int = 24, equal: bool = False,
                seed: int = 0, never=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    if equal:  # one MLP copied to every expert
        ws = [(torch.randn(*s, generator=g) / s[1] ** 0.5).expand(experts, *s) for s in shapes]
    else:
        ws = [torch.randn(experts, *s, generator=g) / s[1] ** 0.5 for s in shapes]
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(never)] = -30.0  # experts nobody chooses: empty groups
    return x, logits, ws


def _reference(x, logits, k, ws):
    from ..layers.moe import dispatch_loop, route

    return dispatch_loop(x, *route(logits, k), *ws)


def _equal_experts_problem(fn) -> str | None:
    """With equal experts a token's output is (sum of its k weights) × the MLP's output."""
    k = 2
    x, logits, ws = _small_case(37, 6, equal=True, seed=1, never=(4,))
    got = _guarded(fn)(x, logits, k, *ws)
    want = F.linear(F.silu(F.linear(x, ws[0][0])) * F.linear(x, ws[1][0]), ws[2][0])
    problem = compare_tensors(got, want, "the output", atol=1e-5)
    if problem is None:
        return None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"with 37 tokens of hidden size 16 and 6 experts: {problem}"
    scale = (got * want).sum(-1) / (want * want).sum(-1)  # each token's total weight
    top = torch.topk(torch.softmax(logits, -1), k, dim=-1).values.sum(-1)
    if torch.allclose(scale, top, atol=1e-4):
        return (f"the routing weights are not renormalized: with all experts equal a token's "
                f"output should be the MLP's output × 1, but yours is × the sum of its top-{k} "
                f"probabilities (e.g. {float(top[0]):.2f}). Divide the k weights by their sum.")
    own, _ = _route(logits, k)  # [tokens, k]: each token's renormalized weights
    counts = torch.cartesian_prod(*[torch.arange(3.0)] * k)  # each pair run 0, 1 or 2 times
    combos = own @ counts.T  # [tokens, 3^k]: every total weight such mistakes can give a token
    if bool(((combos - scale[:, None]).abs() < 1e-4).any(1).all()):
        t = int((scale - 1).abs().argmax())
        return (f"some (token, expert) pairs were processed by no expert or by two: token {t} got "
                f"a total weight of {float(scale[t]):.2f} instead of 1, a sum of some of its own "
                "weights. Check the offsets: expert e owns the sorted rows offsets[e]:offsets[e+1], "
                "offsets[0] is 0 and offsets[E] is tokens·k.")
    if abs(float(scale.sum()) - scale.numel()) < 1e-2 * scale.numel():
        t = int((scale - 1).abs().argmax())
        return (f"the routing weights are attached to the wrong rows: all weights together still "
                f"sum to one per token on average, but token {t} got a total weight of "
                f"{float(scale[t]):.2f}. After sorting the (token, expert) pairs by expert, sort "
                "the weights with the same order.")
    return f"with all experts equal (each token's weights must add up to one): {problem}"


def _distinct_experts_problem(fn) -> str | None:
    for tokens, experts, k, never in ((37, 6, 2, (4,)), (1, 4, 2, ()), (20, 8, 3, (0, 7))):
        x, logits, ws = _small_case(tokens, experts, seed=tokens, never=never)
        want = _reference(x, logits, k, ws)
        got = _guarded(fn)(x, logits, k, *ws)
        problem = compare_tensors(got, want, "the output", atol=1e-5)
        if problem is None:
            continue
        where = f"{tokens} tokens, {experts} experts, top-{k}"
        one = _reference(x, logits, 1, ws)
        if isinstance(got, torch.Tensor) and compare_tensors(got, one, "", atol=1e-5) is None:
            return (f"{where}: your output is what top-1 routing gives: each token used one "
                    f"expert, but top_k is {k}. Take the top_k largest probabilities.")
        empty = f" (experts {list(never)} get no tokens)" if never else ""
        return (f"{where}{empty}: {problem} With equal experts your output was right, so the "
                "weights add up; check which expert processes which rows (offsets, and expert e's "
                "own w_gate[e], w_up[e], w_down[e]).")
    return None


def _flop_problem(fn) -> str | None:
    from torch.utils.flop_counter import FlopCounterMode

    tokens, experts, k, hidden, inter = 64, 8, 2, 16, 24
    x, logits, ws = _small_case(tokens, experts, hidden, inter, seed=5)
    with FlopCounterMode(display=False) as counter:
        _guarded(fn)(x, logits, k, *ws)
    flops = counter.get_total_flops()
    need = tokens * k * 2 * 3 * hidden * inter
    if flops > 1.5 * need:
        return (f"your dispatch did {flops / need:.1f}× the matrix-multiply FLOPs that top-{k} of "
                f"{experts} experts needs: it runs experts on tokens that did not choose them (the "
                "dense strategy). Give each expert only its own rows.")
    return None


@functools.lru_cache(maxsize=2)
def _model_and_reference(name: str):
    """(model, ids, logits with dense dispatch) for a MoE model; cached per process."""
    from ..layers.moe import set_dispatch
    from ..models import load_model, load_tokenizer

    model = load_model(name)
    if name == "tiny-mixtral":
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    else:
        ids = torch.tensor([load_tokenizer("smollm2-135m")("The capital of France is Paris, and the capital "
                                                 "of Italy is")["input_ids"]])
    set_dispatch(model, "dense")
    with torch.inference_mode():
        ref = model(ids)
    set_dispatch(model, "grouped")
    return model, ids, ref


def _model_problem(fn) -> tuple[str | None, list[str]]:
    from ..layers.moe import register_dispatch, set_dispatch, unregister_dispatch

    done = []
    name_in_registry = "nb06 exercise"
    register_dispatch(name_in_registry, _guarded(fn))  # the layer routes for its own records first
    try:
        for name in ("tiny-mixtral", "smollm2-135m-moe8"):
            model, ids, ref = _model_and_reference(name)
            set_dispatch(model, name_in_registry)
            try:
                with torch.inference_mode():
                    got = model(ids)
            finally:
                set_dispatch(model, "grouped")
            problem = compare_tensors(got, ref, f"{name}'s logits", atol=TOL)
            if problem:
                return f"{problem} (the same model with dense dispatch is the reference)", done
            diff = first_token_difference(got[0].argmax(-1).tolist(), ref[0].argmax(-1).tolist())
            if diff:
                return f"{name}: the greedy choice at each position differs: {diff}", done
            done.append(f"{name}: max |Δ logits| = {float((got - ref).abs().max()):.1e}")
    finally:
        unregister_dispatch(name_in_registry)
    return None, done


@exercise("nb06.moe_dispatch", notebook=NB, kind="build",
          title="top-k routing with renormalization and grouped dispatch",
          solution=_solution_moe_dispatch,
          wrong_variants={
              "no renormalization": (_no_renormalization, ("renormalized",)),
              "top-1 instead of top-2": (_top1, ("top-1", "top_k")),
              "offsets off by one": (_offsets_off_by_one, ("offsets",)),
              "weights applied to the wrong expert after sorting": (_weights_not_sorted,
                                                                    ("wrong rows", "sort")),
              "every expert on every token": (_every_expert, ("FLOPs", "did not choose")),
              "a wrapper around llmlab's own route and dispatch_grouped":
                  (_library_wrapper, ("llmlab's own",)),
          })
def _check_moe_dispatch(fn):
    """``fn(x [tokens, hidden], router_logits [tokens, E], top_k, w_gate [E, inter, hidden],
    w_up [E, inter, hidden], w_down [E, hidden, inter]) -> [tokens, hidden]``."""
    hint = ("softmax over the router logits, top-k, divide the k weights by their sum; then sort "
            "the flattened (token, expert) pairs by expert, count each expert's pairs, and run "
            "each expert once on its contiguous rows.")
    for stage in (_equal_experts_problem, _distinct_experts_problem, _flop_problem):
        problem = stage(fn)
        if problem:
            return wrong(problem, hint)
    problem, done = _model_problem(fn)
    if problem:
        return wrong(problem, hint)
    return right("your routing and grouped dispatch run the MoE layers of real models: "
                 + "; ".join(done) + f" (dense dispatch as the reference, tolerance {TOL:g}).")


# ---- 3. predict, then measure: drops with an unbiased router -------------------------------------

_DROP_SETUP = dict(num_experts=8, top_k=2, capacity_factor=1.0, tokens=512, skew=0.0)


def measured_drop_percent() -> float:
    """The measurement the prediction is checked against (the notebook's cell runs the same)."""
    from ..viz.moe import explore_routing

    _, stats = explore_routing(**_DROP_SETUP, show=False)
    return 100 * stats.drop_fraction


@exercise("nb06.predict_drops", notebook=NB, kind="predict", solution=5.0,
          title="percent of assignments dropped at capacity factor 1.0, unbiased router",
          wrong_variants={"nothing dropped": (0, ("chance",)), "a quarter": (25, ("too high",))})
def _check_predict_drops(answer, measured: float | None = None):
    """``answer``: percent of the 1024 assignments dropped; ``measured``: the notebook's value."""
    got = measured_drop_percent() if measured is None else float(measured)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return wrong(f"the answer should be a percentage (a number), got {answer!r}.", "e.g. 10.")
    mean = _DROP_SETUP["tokens"] * _DROP_SETUP["top_k"] / _DROP_SETUP["num_experts"]
    spread = math.sqrt(mean * (1 - 1 / _DROP_SETUP["num_experts"]))
    why = (f"each expert expects {mean:.0f} assignments, but with random routing its load "
           f"fluctuates by about ±{spread:.0f} (a binomial count), so about half the experts "
           "overflow a capacity of exactly the mean, while the others leave slots empty.")
    if abs(answer - got) <= 3.0:
        return right(f"measured {got:.1f}% dropped against your {answer:g}%: {why} That is why "
                     "training used capacity factors of 1.25 or more.")
    if answer < got:
        return wrong(f"measured {got:.1f}%, you said {answer:g}%: even an unbiased router "
                     f"overloads some experts by chance. {why}", "within 3 percentage points counts.")
    return wrong(f"measured {got:.1f}%, you said {answer:g}%: too high for an unbiased router; "
                 f"{why}", "within 3 percentage points counts.")


# ---- 4. explain: a balance loss near uniform with a lopsided load --------------------------------

_BALANCE_CHOICES = {
    "a": "averaging over the 30 layers hides it: the most lopsided layer's own loss is several "
         "times α",
    "b": "an untrained router's probabilities are all exactly 1/N, so every mean Pᵢ is 1/N and "
         "the loss is α whatever the counts fᵢ are",
    "c": "the excess over α is α·N·Σᵢ(fᵢ − 1/N)(Pᵢ − 1/N): top-k turns small leads in Pᵢ into "
         "big gaps in fᵢ; the product stays small",
    "d": "a short text gives too few tokens for the loss to be computed; a longer text would push "
         "it far above α",
}

_BALANCE = {
    "a": "each layer's own loss is printed above: even the largest stays below twice α, while "
         "its busiest expert carries several times the mean load. Averaging is not what hides it.",
    "b": "the printed mean probabilities Pᵢ of the most lopsided layer are not all 1/N: they "
         "spread visibly around it. A flat router is not what keeps the loss down.",
    "c": "since Σᵢ fᵢ = Σᵢ Pᵢ = 1, α·N·Σᵢ fᵢPᵢ = α + α·N·Σᵢ(fᵢ − 1/N)(Pᵢ − 1/N): a lopsided "
         "count fᵢ raises the loss only as far as its mean probability Pᵢ also leaves 1/N. Top-k "
         "sends every token to its two largest probabilities even when they lead by a hair, so "
         "the counts fᵢ spread several times more than the mean probabilities Pᵢ (the two "
         "printed rows), and the product of a large and a small deviation is small. The "
         "gradient with respect to Pᵢ is α·N·fᵢ, which is lopsided, so training still pushes "
         "the busy experts' probabilities down.",
    "d": "the loss is computed exactly from every token's routing, whatever the number of "
         "tokens; more tokens make the counts less noisy, they do not change the formula.",
}


@exercise("nb06.explain_balance_loss", notebook=NB, kind="explain", solution="c",
          title="why the balance loss stays close to α while the expert loads are lopsided",
          choices=_BALANCE_CHOICES,
          wrong_variants={"averaging over layers": ("a", ("own loss",)),
                          "probabilities exactly uniform": ("b", ("not all 1/N",)),
                          "too few tokens": ("d", ("exactly",))})
def _check_explain_balance_loss(answer):
    """(a) averaging over layers hides it; (b) exactly uniform probabilities; (c) the excess is
    a product of the count and the probability deviations; (d) too few tokens."""
    return choice_verdict(answer, "c", _BALANCE)


# ---- 5. stretch: dropping over capacity ------------------------------------------------------------

def _solution_keep_within_capacity(experts, num_experts, capacity_factor):
    """The library's own rule (llmlab.layers.moe_stats.simulate_capacity) is the reference."""
    return simulate_capacity(experts, num_experts, capacity_factor).kept


def _token_major(experts, num_experts, capacity_factor):
    tokens, k = experts.shape
    capacity = math.ceil(capacity_factor * tokens * k / num_experts)
    kept, used = torch.zeros(tokens, k, dtype=torch.bool), [0] * num_experts
    for t in range(tokens):
        for slot in range(k):
            e = int(experts[t, slot])
            if used[e] < capacity:
                used[e] += 1
                kept[t, slot] = True
    return kept


def _floor_capacity(experts, num_experts, capacity_factor):
    tokens, k = experts.shape
    capacity = math.floor(capacity_factor * tokens * k / num_experts)
    kept, used = torch.zeros(tokens, k, dtype=torch.bool), [0] * num_experts
    for slot in range(k):
        for t in range(tokens):
            e = int(experts[t, slot])
            if used[e] < capacity:
                used[e] += 1
                kept[t, slot] = True
    return kept


@exercise("nb06.capacity_drop", notebook=NB, kind="build", stretch=True,
          title="capacity-factor dropping with first choices first",
          solution=_solution_keep_within_capacity,
          wrong_variants={"token by token": (_token_major, ("first choice",)),
                          "rounded down": (_floor_capacity, ("round",))})
def _check_capacity_drop(fn):
    """``fn(experts [tokens, k], num_experts, capacity_factor) -> kept [tokens, k] bool``."""
    g = torch.Generator().manual_seed(3)
    skewed = torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1]), 2 * 45, replacement=True,
                               generator=g).reshape(45, 2)
    cases = [(torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]]), 2, 0.5), (skewed, 5, 1.0),
             (skewed, 5, 1.3), (torch.randint(0, 8, (101, 2), generator=g), 8, 1.25)]
    for experts, n, cf in cases:
        got = fn(experts.clone(), n, cf)
        want = simulate_capacity(experts, n, cf)
        where = f"{experts.shape[0]} tokens, {n} experts, top-{experts.shape[1]}, cf={cf}"
        if not isinstance(got, torch.Tensor) or got.shape != want.kept.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return wrong(f"{where}: expected a [tokens, k] bool tensor, got {shape}.",
                         "kept[t, j] says whether token t's j-th choice fits.")
        got = got.bool()
        if torch.equal(got, want.kept):
            continue
        per_expert = torch.bincount(experts[got], minlength=n)
        if int(per_expert.max()) > want.capacity or int(got.sum()) != int(want.kept.sum()):
            return wrong(f"{where}: you kept {int(got.sum())} assignments, at most "
                         f"{int(per_expert.max())} on one expert; the capacity is "
                         f"{want.capacity} slots per expert, so {int(want.kept.sum())} fit.",
                         "cf × the assignments a perfectly balanced expert gets, rounded up "
                         "(math.ceil).")
        return wrong(f"{where}: the right number fit, but not the right ones: e.g. token "
                     f"{int((got != want.kept).any(1).nonzero()[0])}. Slots go to every token's "
                     "first choice (in token order) before any second choice, as in GShard.",
                     "loop over the k choices outside, the tokens inside.")
    return right("first choices fill the slots before second choices, and nothing exceeds the "
                 "capacity. Mixtral's inference drops nothing; this is what training systems "
                 "(GShard, Switch) and fixed-shape expert-parallel kernels do.")
