"""Exercises of notebook 07 (tensor parallelism).

The build exercise is ``nb07.tensor_parallel_linear``: the student writes the forward passes
of the column- and row-parallel layers, ``(x, weight, bias) -> y``, with the all-reduce in
the right place. The checker runs them on real processes (``llmlab.parallel.launch``, gloo):
first on small seeded layers on two ranks (each rank's output against the full layer, with
messages that name the usual mistakes), then inside the tiny Llama at tp = 2 and SmolLM2-135M
at tp = 3 (its 9 heads do not split in two), whose logits must match one process within 1e-4
and whose greedy tokens must be the same. The student's functions are defined in a notebook,
so they travel to the ranks as source text (:mod:`llmlab.parallel.portable`).

The stretch exercise ``nb07.sequence_parallel_norm`` replaces an all-reduce by a
reduce-scatter, as sequence parallelism does (Korthikanti et al. 2023).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ModelConfig
from ..parallel.comm import LLAMA2_70B, allreduce_per_token
from . import choice_verdict, compare_tensors, exercise, first_token_difference, right, wrong

NB = "07_tensor_parallelism"
TOL = 1e-4  # logits of tp ranks against one process (float32, summation order only)


def _smollm2_config() -> ModelConfig:
    from ..models import resolve

    return ModelConfig.from_file(resolve("smollm2-135m"))


# ---- 1. which rows a column-parallel rank holds (warm-up) -------------------------------------

def _solution_column_shard(weight, rank, tp):
    return torch.chunk(weight, tp, dim=0)[rank]


@exercise("nb07.column_shard", notebook=NB, kind="compute",
          title="the block of an [out, in] weight a column-parallel rank holds",
          solution=_solution_column_shard,
          wrong_variants={
              "splits the input features": (lambda w, r, tp: torch.chunk(w, tp, dim=1)[r],
                                            ("output features", "rows")),
              "interleaved rows": (lambda w, r, tp: w[r::tp], ("contiguous block",)),
          })
def _check_column_shard(fn):
    """``fn(weight [out, in], rank, tp)`` -> the rows rank ``rank`` of ``tp`` holds."""
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for rank, tp in ((0, 3), (2, 3), (1, 4), (0, 1)):
        got = fn(w, rank, tp)
        want = w[rank * 12 // tp:(rank + 1) * 12 // tp]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return wrong(f"for rank={rank}, tp={tp} of a [12, 5] weight you returned {shape}; "
                         f"expected shape {tuple(want.shape)}.",
                         "a column-parallel layer splits the output features, which are the "
                         "rows of W in torch's [out, in] layout.")
        if not torch.equal(got, want):
            return wrong(f"right shape but the wrong rows for rank={rank}, tp={tp}: rank r holds "
                         "one contiguous block of out/tp rows.",
                         "rows r·out/tp up to (r+1)·out/tp; torch.chunk(weight, tp, dim=0)[rank].")
    return right("rank r holds W[r·out/tp : (r+1)·out/tp], the rows of its output features "
                 "(for q_proj: whole heads).")


# ---- 2. the column- and row-parallel forward passes (the build exercise) -----------------------

def _solution_column_forward(x, weight, bias):
    # every rank has the whole x: its rows of W give its slice of y, with no communication
    return F.linear(x, weight, bias)


def _solution_row_forward(x, weight, bias):
    y = F.linear(x, weight)  # a partial sum over this rank's input features
    dist.all_reduce(y)       # g: add the partial sums of all ranks (in place)
    return y if bias is None else y + bias  # the bias once, after the sum


def _allreduce_after_column(x, weight, bias):
    y = F.linear(x, weight, bias)
    dist.all_reduce(y)
    return y


def _row_without_allreduce(x, weight, bias):
    return F.linear(x, weight, bias)


def _row_bias_on_every_rank(x, weight, bias):
    y = F.linear(x, weight, bias)  # the bias inside each partial sum: added tp times
    dist.all_reduce(y)
    return y


def _placeholder(*args):
    raise NotImplementedError("write this function")


def _unpack_pair(answer):
    if isinstance(answer, dict):
        answer = (answer.get("column"), answer.get("row"))
    if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(map(callable, answer)):
        return None
    return tuple(answer)


def _precall(fns, *cases) -> None:
    """Call each function once in this process, so a placeholder says "not yet" at once;
    anything else it raises here (no process group yet) is left to the ranks."""
    for fn, args in zip(fns, cases):
        try:
            fn(*args)
        except NotImplementedError:
            raise
        except Exception:  # noqa: BLE001 - e.g. an all-reduce without a process group
            pass


def _small_layers(tp: int, rank: int):
    """Seeded full layers and their reference outputs; rank ``rank``'s shards of them."""
    g = torch.Generator().manual_seed(7)
    n_in, mid, n_out = 10, 12, 5  # mid splits evenly for tp = 1, 2, 3, 4
    x = torch.randn(3, n_in, generator=g)
    w1, b1 = torch.randn(mid, n_in, generator=g), torch.randn(mid, generator=g)
    h = torch.randn(3, mid, generator=g)
    w2, b2 = torch.randn(n_out, mid, generator=g), torch.randn(n_out, generator=g) + 2.0
    a, b = rank * mid // tp, (rank + 1) * mid // tp
    return dict(x=x, w1=w1, b1=b1, h=h, w2=w2, b2=b2, a=a, b=b)


def _diagnose_column(got, s, tp: int) -> str | None:
    x, w1, b1, a, b = s["x"], s["w1"], s["b1"], s["a"], s["b"]
    want = F.linear(x, w1[a:b], b1[a:b])
    problem = compare_tensors(got, want, "its output", atol=1e-5)
    if problem is None:
        return None
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        width = b - a
        summed = sum(F.linear(x, w1[r * width:(r + 1) * width], b1[r * width:(r + 1) * width])
                     for r in range(tp))
        if compare_tensors(got, summed, "", atol=1e-4) is None:
            return ("the column-parallel output is the sum of every rank's slice: an all-reduce "
                    "after the column layer adds different output features together. Each rank "
                    "keeps its own slice; the all-reduce belongs after the row layer.")
    elif isinstance(got, torch.Tensor) and got.shape[-1] == w1.shape[0]:
        return (f"the column-parallel output has all {w1.shape[0]} features; each rank should "
                f"return only its {b - a}: its slice stays split for the row layer.")
    return f"the column-parallel layer: {problem}"


def _diagnose_row(got, s, tp: int) -> str | None:
    h, w2, b2, a, b = s["h"], s["w2"], s["b2"], s["a"], s["b"]
    want = F.linear(h, w2, b2)
    problem = compare_tensors(got, want, "its output", atol=1e-4)
    if problem is None:
        return None
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        partial = F.linear(h[:, a:b], w2[:, a:b])
        for cand, msg in (
                (partial + b2, "the row-parallel output is only this rank's partial sum: there is "
                               "no all-reduce adding the other ranks' partial sums."),
                (partial, "the row-parallel output is only this rank's partial sum, without the "
                          "bias: no all-reduce adds the other ranks' partial sums."),
                (want + (tp - 1) * b2, f"the bias was added {tp} times: every rank added it "
                                       "before the all-reduce summed the ranks. Add it once, "
                                       "after the all-reduce."),
                (want - b2, "the row-parallel output lacks the bias: add it once, after the "
                            "all-reduce.")):
            if compare_tensors(got, cand, "", atol=1e-4) is None:
                return msg
    return f"the row-parallel layer: {problem}"


def _ranks_check_tp_linear(column, row, model_name: str, ids: torch.Tensor,
                           new_tokens: int) -> dict:
    """Runs on every rank: the small layers first, then (if every rank passed) the model."""
    from ..layers.linear import use_parallel_forwards
    from ..parallel.generate import greedy_generate
    from ..parallel.loader import load_tp_model

    rank, tp = dist.get_rank(), dist.get_world_size()
    s = _small_layers(tp, rank)
    with torch.inference_mode():
        col = column(s["x"], s["w1"][s["a"]:s["b"]], s["b1"][s["a"]:s["b"]])
        problem = _diagnose_column(col, s, tp)
        if problem is None:
            out = row(s["h"][:, s["a"]:s["b"]], s["w2"][:, s["a"]:s["b"]], s["b2"])
            problem = _diagnose_row(out, s, tp)
    problems = [None] * tp
    dist.all_gather_object(problems, problem)  # every rank decides alike whether to go on
    result = {"tp": tp, "problems": problems, "logits": None, "tokens": None}
    if any(problems):
        return result
    model = load_tp_model(model_name)
    with use_parallel_forwards(column=column, row=row), torch.inference_mode():
        result["logits"] = model(ids)
        result["tokens"] = greedy_generate(model, ids[0].tolist(), new_tokens).tokens
    return result


@functools.lru_cache(maxsize=4)
def _tp1_reference(model_name: str, new_tokens: int):
    """(ids [batch, seq], logits of one process, greedy tokens of one process); cached."""
    from ..generate import encode_prompts
    from ..models import load_model, load_tokenizer
    from ..parallel.generate import greedy_generate

    model = load_model(model_name)
    if model_name == "smollm2-135m":
        ids = torch.tensor(encode_prompts(load_tokenizer(model_name),
                                          ["What is the capital of France?"], chat=True))
    else:
        ids = torch.randint(0, model.config.vocab_size, (2, 10),
                            generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = model(ids)
    tokens = greedy_generate(model, ids[0].tolist(), new_tokens).tokens
    return ids, logits, tokens


def _run_on_ranks(column, row, model_name: str, tp: int, new_tokens: int):
    """Launch the check; (result, None) or (None, verdict) when a rank raised."""
    from ..parallel.launch import RankError, launch
    from ..parallel.portable import portable

    ids, _, _ = _tp1_reference(model_name, new_tokens)
    try:
        sendable = (portable(column), portable(row))
    except ValueError as exc:
        return None, wrong(f"your functions cannot be sent to the ranks: {exc}",
                           "define each with def in a cell; create what they need inside them.")
    try:
        return launch(_ranks_check_tp_linear, tp, *sendable, model_name, ids, new_tokens,
                      timeout_s=300), None
    except RankError as exc:
        last = exc.detail.strip().splitlines()[-1] if exc.detail.strip() else str(exc)
        if "NotImplementedError" in last:
            raise NotImplementedError(last) from None
        hint = "run it by hand on small tensors; read the rank's traceback below the check."
        if "NoneType" in last:
            hint = ("torch.distributed.all_reduce(t) sums t in place and returns None: call it, "
                    "then use t.")
        return None, wrong(f"rank {exc.rank} of {tp} raised {last}", hint)
    except TimeoutError:
        return None, wrong(f"the {tp} ranks did not finish within 300 s: probably some ranks "
                           "called an all-reduce that the others never reached.",
                           "every rank must make the same collective calls in the same order.")


@exercise("nb07.tensor_parallel_linear", notebook=NB, kind="build",
          title="column- and row-parallel forward passes, on real processes",
          solution=(_solution_column_forward, _solution_row_forward),
          placeholder=(_placeholder, _placeholder),
          wrong_variants={
              "all-reduce after the column layer instead of the row layer":
                  ((_allreduce_after_column, _row_without_allreduce), ("column", "all-reduce")),
              "no all-reduce": ((_solution_column_forward, _row_without_allreduce),
                                ("no all-reduce", "partial sum")),
              "row-parallel bias added on every rank":
                  ((_solution_column_forward, _row_bias_on_every_rank), ("bias", "times")),
          })
def _check_tensor_parallel_linear(answer):
    """``answer = (column_forward, row_forward)``, each ``(x, weight, bias) -> y``."""
    pair = _unpack_pair(answer)
    if pair is None:
        return wrong(f"expected a pair of functions (column_forward, row_forward); got "
                     f"{type(answer).__name__}.", "pass (column_parallel_forward, "
                     "row_parallel_forward).")
    column, row = pair
    s = _small_layers(2, 0)
    _precall(pair, (s["x"], s["w1"][:6], s["b1"][:6]), (s["h"][:, :6], s["w2"][:, :6], s["b2"]))

    done = []
    for model_name, tp, new_tokens in (("tiny-llama", 2, 6), ("smollm2-135m", 3, 4)):
        res, verdict = _run_on_ranks(column, row, model_name, tp, new_tokens)
        if verdict is not None:
            return verdict
        bad = [(r, p) for r, p in enumerate(res["problems"]) if p]
        if bad:
            r, p = bad[0]
            return wrong(f"on small layers split over {tp} ranks (rank {r}): {p}",
                         "the column layer needs no communication; the row layer's partial sums "
                         "need one all-reduce, and the bias is added once after it.")
        _, ref_logits, ref_tokens = _tp1_reference(model_name, new_tokens)
        problem = compare_tensors(res["logits"], ref_logits, f"{model_name}'s logits at tp={tp}",
                                  atol=TOL)
        if problem:
            return wrong(f"{problem} Your layers pass the small test but not the model.",
                         "check that nothing depends on the input's batch or sequence shape "
                         "(x is [batch, seq, in] in the model).")
        diff = first_token_difference(res["tokens"], ref_tokens)
        if diff:
            return wrong(f"{model_name} at tp={tp}: greedy {diff}", "compare the logits first.")
        err = float((res["logits"] - ref_logits).abs().max())
        done.append(f"{model_name} at tp={tp}: max |Δ logits| = {err:.1e}, the same "
                    f"{len(ref_tokens)} greedy tokens")
    return right("on real processes your layers give one process's answer. " + "; ".join(done)
                 + ". The only difference is the order of the summation.")


# ---- 3. predict, then measure: all-reduces per token -----------------------------------------

@exercise("nb07.predict_allreduces", notebook=NB, kind="predict", solution=61,
          title="all-reduces in one token's forward pass, SmolLM2 at tp = 3",
          wrong_variants={"one per layer": (30, ("two per layer",)),
                          "forgot the embedding": (60, ("embedding",))})
def _check_predict_allreduces(answer, measured: int | None = None):
    """``answer``: the number of all-reduces; ``measured``: what the tp = 3 run counted."""
    cfg = _smollm2_config()
    want = allreduce_per_token(cfg, 3).allreduces_per_token if measured is None else int(measured)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return wrong(f"the answer should be a number, got {answer!r}.", "count per layer, then layers.")
    source = "the run counted" if measured is not None else "the accounting gives"
    if answer == want:
        return right(f"{source} {want}: two per layer (after o_proj and after down_proj) × "
                     f"{cfg.num_layers} layers, plus one for the vocab-parallel embedding. "
                     "The count does not depend on tp.")
    layers = cfg.num_layers
    if answer == layers:
        why = "one per layer is too few: attention and the MLP each end in a row-parallel layer, two per layer."
    elif answer == 2 * layers:
        why = "two per layer is right, but the vocab-parallel embedding adds one more."
    elif answer in (4 * layers, 4 * layers + 1, 3 * layers, 3 * layers + 1):
        why = ("column-parallel layers (q, k, v, gate, up) send nothing in the forward pass: "
               "only the row-parallel o_proj and down_proj end in an all-reduce, two per layer.")
    else:
        why = f"{answer:g} is {answer / want:.2f}× what {source}."
    return wrong(f"{source} {want}; {why}", "which modules end in an all-reduce, and how many "
                 "layers are there? Then the embedding.")


# ---- 4. bytes all-reduced per token (compute) --------------------------------------------------

@exercise("nb07.allreduce_bytes", notebook=NB, kind="compute", solution=61 * 576 * 2,
          title="bytes all-reduced per token, SmolLM2 at tp = 3 in bfloat16",
          wrong_variants={"float32": (61 * 576 * 4, ("2 bytes",)),
                          "forgot the embedding": (60 * 576 * 2, ("embedding",))})
def _check_allreduce_bytes(answer):
    cfg = _smollm2_config()
    want = allreduce_per_token(cfg, 3, bytes_per_el=2).per_token_bytes
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return wrong(f"expected a number of bytes, got {answer!r}.", "count messages × bytes each.")
    val = int(answer)
    if val == want:
        return right(f"(2 × {cfg.num_layers} layers + 1 embedding) × {cfg.hidden_size} × 2 B = "
                     f"{want} B per token, whatever tp is.")
    if val == 2 * cfg.num_layers * cfg.hidden_size * 2:
        return wrong("you counted the two per layer; the vocab-parallel embedding adds one more.",
                     "each rank looks up only its vocabulary rows; an all-reduce assembles them.")
    if val == want * 2:
        return wrong("that is float32: bfloat16 is 2 bytes per element, not 4.", "halve it.")
    return wrong(f"{val} B is {val / want:.2f}× the expected value.",
                 "count all-reduces per layer (after o_proj and after down_proj), the layers, the "
                 "embedding's one, and the bytes of one hidden vector.")


# ---- 5. valid degrees (compute) ----------------------------------------------------------------

@exercise("nb07.valid_degrees", notebook=NB, kind="compute", solution=[1, 2, 4, 8],
          title="the tensor-parallel degrees this workbook accepts for Llama-2-70B",
          wrong_variants={"16 splits a KV head": ([1, 2, 4, 8, 16], ("do not split",)),
                          "missing 1": ([2, 4, 8], ("missing",))})
def _check_valid_degrees(degrees):
    from ..parallel.model import valid_tp_degrees

    want = valid_tp_degrees(LLAMA2_70B)
    try:
        got = sorted(int(d) for d in degrees)
    except (TypeError, ValueError):
        return wrong(f"expected a list of ints, got {degrees!r}.", "e.g. [1, 2].")
    if got == want:
        return right(f"{want}. The 8 KV heads are the limit: at tp = 16 a rank would hold half a "
                     "KV head (vLLM copies KV heads instead; this workbook refuses).")
    bad = sorted(set(got) - set(want))
    if bad:
        return wrong(f"{bad} do not split 64 query heads, 8 KV heads, 28672 MLP features and 32000 "
                     "vocabulary rows evenly.", "every rank needs whole heads: math.gcd.")
    return wrong(f"missing {sorted(set(want) - set(got))}.", "1 (no split) counts too.")


# ---- 6. explain: why tp = 3 is slower on this CPU ----------------------------------------------

_SLOWER = {
    "a": "each rank multiplies by a third of every weight matrix, so the arithmetic per "
         "rank shrinks by 3; the total work is the same as one process's.",
    "b": "a 2 KiB message should take microseconds, but every all-reduce waits until all "
         "three ranks reach it, and three single-threaded ranks share two cores, so one rank is "
         "always waiting for a core; that latency is paid 61 times per token. Meanwhile one "
         "process with two threads already uses both cores for every matmul.",
    "c": "the messages are tiny (one hidden vector, 2 KiB in float32): 61 of them are "
         "about 140 KiB per token, nothing for memory or a socket to carry; time, not bytes, is the cost.",
    "d": "each rank reads a third of the weights, so the weights fit a cache better, not worse.",
}


@exercise("nb07.explain_cpu_slowdown", notebook=NB, kind="explain", solution="b",
          title="why tp = 3 decodes slower than one process on two CPU cores",
          wrong_variants={"more FLOPs": ("a", ("third",)), "bandwidth": ("c", ("tiny",))})
def _check_explain_cpu_slowdown(answer):
    """(a) each rank does more arithmetic; (b) latency of 61 all-reduces with ranks sharing
    cores; (c) the all-reduces move too many bytes; (d) the weights no longer fit a cache."""
    return choice_verdict(answer, "b", _SLOWER)


# ---- 7. stretch: sequence-parallel RMSNorm -----------------------------------------------------

def _solution_sequence_parallel_norm(partial, weight, eps):
    tp = dist.get_world_size()
    mine = torch.empty_like(partial.chunk(tp, dim=0)[0])
    dist.reduce_scatter(mine, list(partial.contiguous().chunk(tp, dim=0)))  # sum, keep my tokens
    rms = torch.rsqrt(mine.pow(2).mean(-1, keepdim=True) + eps)
    return mine * rms * weight


def _norm_every_token(partial, weight, eps):
    x = partial.clone()
    dist.all_reduce(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _norm_before_sum(partial, weight, eps):
    tp = dist.get_world_size()
    x = partial * torch.rsqrt(partial.pow(2).mean(-1, keepdim=True) + eps) * weight
    mine = torch.empty_like(x.chunk(tp, dim=0)[0])
    dist.reduce_scatter(mine, list(x.contiguous().chunk(tp, dim=0)))
    return mine


def _ranks_check_sequence_norm(fn) -> list:
    rank, tp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    seq, hidden, eps = 6, 8, 1e-5
    partials = torch.randn(tp, seq, hidden, generator=g)
    weight = torch.rand(hidden, generator=g) + 0.5
    with torch.inference_mode():
        got = fn(partials[rank].clone(), weight, eps)
    full = partials.sum(0)
    want = (full * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + eps) * weight).chunk(tp)[rank]
    problem = compare_tensors(got, want, f"rank {rank}'s output", atol=1e-5)
    if problem and isinstance(got, torch.Tensor) and tuple(got.shape) == (seq, hidden):
        problem = (f"rank {rank} returned all {seq} tokens; in the sequence-parallel region each "
                   f"rank keeps only its {seq // tp} (a reduce-scatter, not an all-reduce).")
    elif problem and isinstance(got, torch.Tensor) and got.shape == want.shape:
        summed_norms = sum(p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) * weight
                           for p in partials).chunk(tp)[rank]
        if compare_tensors(got, summed_norms, "", atol=1e-5) is None:
            problem = ("you normalized each rank's partial sum and then added them; RMSNorm is "
                       "not linear: add the partial sums first (the reduce-scatter), then normalize.")
    problems = [None] * tp
    dist.all_gather_object(problems, problem)
    return problems


@exercise("nb07.sequence_parallel_norm", notebook=NB, kind="build", stretch=True,
          title="sequence parallelism: reduce-scatter, then RMSNorm on this rank's tokens",
          solution=_solution_sequence_parallel_norm,
          wrong_variants={"all-reduce, every token": (_norm_every_token, ("reduce-scatter",)),
                          "normalize before the sum": (_norm_before_sum, ("not linear",))})
def _check_sequence_parallel_norm(fn):
    """``fn(partial [seq, hidden], weight [hidden], eps) -> [seq/tp, hidden]``."""
    from ..parallel.launch import RankError, launch
    from ..parallel.portable import portable

    _precall([fn], (torch.zeros(4, 8), torch.ones(8), 1e-5))
    try:
        problems = launch(_ranks_check_sequence_norm, 2, portable(fn), timeout_s=120)
    except ValueError as exc:
        return wrong(f"your function cannot be sent to the ranks: {exc}", "define it with def.")
    except RankError as exc:
        last = exc.detail.strip().splitlines()[-1] if exc.detail.strip() else str(exc)
        if "NotImplementedError" in last:
            raise NotImplementedError(last) from None
        return wrong(f"rank {exc.rank} raised {last}",
                     "torch.distributed.reduce_scatter(output, list_of_tp_chunks) sums chunk r "
                     "of every rank into rank r's output.")
    bad = [p for p in problems if p]
    if bad:
        return wrong(bad[0], "reduce-scatter the [seq, hidden] partial sums along the sequence, "
                     "then RMSNorm the seq/tp tokens you got.")
    return right("each rank normalized its seq/tp tokens of the summed output. A reduce-scatter "
                 "moves half the bytes of an all-reduce (which is a reduce-scatter plus an "
                 "all-gather), and the norm's work and activations are split tp ways; the "
                 "all-gather is paid later, before the next column-parallel layer.")

