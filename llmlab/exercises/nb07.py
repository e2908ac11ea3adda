"""Exercises of notebook 07 (tensor parallelism).

The build exercise is ``nb07.tensor_parallel_block``: the student writes one decoder layer's
forward pass for one rank, ``(layer, x, positions, rank, tp) -> y``: it cuts the rank's
shard out of the full layer (whole query heads and the KV heads they read for q/k/v, the
matching input columns of o_proj; a slice of the MLP features for gate/up and the matching
columns of down_proj), runs attention and the MLP on that shard and sums the ranks' partial
outputs with the two all-reduces. The checker runs it on real processes
(``llmlab.parallel.launch``, gloo): layer 0 of the tiny Llama at tp = 2 (2 KV heads per rank)
on a seeded input, against the unsharded layer, with its FLOPs and collectives counted and
the usual mistakes named; then every layer of the tiny Llama at tp = 2 and of SmolLM2-135M at
tp = 3 runs the student's block, whose logits must match one process within 1e-4 and whose
greedy tokens must be the same. While it runs, llmlab's own parallel layers and the unsharded
modules' forward passes raise (``exercises.forbid``).

The warm-up ``nb07.tensor_parallel_linear`` has the student write the column- and
row-parallel forward passes ``(x, weight, bias) -> y`` alone, checked on small layers and
inside the tiny Llama at tp = 2. The student's functions are defined in a notebook, so they
travel to the ranks as source text (:mod:`llmlab.parallel.portable`).

``nb07.predict_what_shrinks`` asks, before the tp = 2 step is timed with a core per rank,
what splitting shrinks: the time inside the matrix multiplies, the number of operator calls,
both or neither; it is judged against the run (the matmuls' timed comparison and the counted
calls).

Notebook 07b (``07b_tensor_parallelism_at_scale``, the appendix) holds the bytes all-reduced
per token in bfloat16 (``nb07.allreduce_bytes``), the degrees Llama-2-70B allows
(``nb07.valid_degrees``) and the stretch exercise ``nb07.sequence_parallel_norm``, which
replaces an all-reduce by a reduce-scatter, as sequence parallelism does (Korthikanti et al.
2023).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ModelConfig
from ..parallel.comm import LLAMA2_70B, allreduce_per_token
from . import choice_verdict, compare_tensors, exercise, first_token_difference, right, wrong

NB = "07_tensor_parallelism"
NB_B = "07b_tensor_parallelism_at_scale"   # the appendix: bytes, degrees, sequence parallelism
TOL = 1e-4  # logits of tp ranks against one process (float32, summation order only)


def _bound(err: float) -> str:
    """A max error as the power of ten above it ("< 1e-05"), the same on any CPU: the exact
    value depends on the summation order of the machine's BLAS."""
    if err == 0:
        return "= 0"
    return f"< 1e{math.ceil(math.log10(err)) if math.log10(err) % 1 else int(math.log10(err)) + 1:+03d}"


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


# ---- 2. the column- and row-parallel forward passes (warm-up) ---------------------------------

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
    for model_name, tp, new_tokens in (("tiny-llama", 2, 6),):  # the block build runs SmolLM2
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
        done.append(f"{model_name} at tp={tp}: max |Δ logits| {_bound(err)}, the same "
                    f"{len(ref_tokens)} greedy tokens")
    return right("on real processes your layers give one process's answer. " + "; ".join(done)
                 + ". The only difference is the order of the summation. The build below uses "
                 "the same two ideas for a whole decoder layer.")


# ---- 3. a whole decoder layer, sharded by rank (the build exercise) ----------------------------

def _solution_tensor_parallel_block(layer, x, positions, rank, tp):
    attn, mlp = layer.self_attn, layer.mlp
    b, s, _ = x.shape
    d = attn.head_dim
    hq, hkv = attn.num_heads // tp, attn.num_kv_heads // tp  # whole heads on this rank
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)       # its query heads' features
    kv_rows = slice(rank * hkv * d, (rank + 1) * hkv * d)    # the KV heads they read
    h = layer.input_layernorm(x)
    q = F.linear(h, attn.q_proj.weight[q_rows]).view(b, s, hq, d)     # column-parallel
    k = F.linear(h, attn.k_proj.weight[kv_rows]).view(b, s, hkv, d)
    v = F.linear(h, attn.v_proj.weight[kv_rows]).view(b, s, hkv, d)
    q, k = attn.rotary(q, k, positions)
    heads = attn.backend.forward(q, k, v, causal=True)                # GQA within the rank
    partial = F.linear(heads.reshape(b, s, hq * d), attn.o_proj.weight[:, q_rows])  # row-parallel
    dist.all_reduce(partial)                                          # g: sum the ranks' parts
    x = x + partial
    inter = mlp.gate_proj.weight.shape[0] // tp
    cols = slice(rank * inter, (rank + 1) * inter)
    h = layer.post_attention_layernorm(x)
    act = F.silu(F.linear(h, mlp.gate_proj.weight[cols])) * F.linear(h, mlp.up_proj.weight[cols])
    partial = F.linear(act, mlp.down_proj.weight[:, cols])
    dist.all_reduce(partial)
    return x + partial


def _block_parts(layer, x, positions, rank, tp, *, kv_split=True, rows_for_row=False,
                 gather_kv=False):
    """This rank's (attention partial sum, function of the MLP's partial sum) without any
    collective; the wrong variants and the checker's diagnosis are built from it."""
    attn, mlp = layer.self_attn, layer.mlp
    b, s, _ = x.shape
    d = attn.head_dim
    hq, hkv = attn.num_heads // tp, attn.num_kv_heads // tp
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
    kv_rows = slice(rank * hkv * d, (rank + 1) * hkv * d) if kv_split else slice(None)
    h = layer.input_layernorm(x)
    q = F.linear(h, attn.q_proj.weight[q_rows]).view(b, s, hq, d)
    if gather_kv:  # every KV head computed, this rank's picked afterwards
        k = F.linear(h, attn.k_proj.weight)[..., kv_rows]
        v = F.linear(h, attn.v_proj.weight)[..., kv_rows]
    else:
        k, v = F.linear(h, attn.k_proj.weight[kv_rows]), F.linear(h, attn.v_proj.weight[kv_rows])
    k, v = k.reshape(b, s, -1, d), v.reshape(b, s, -1, d)
    q, k = attn.rotary(q, k, positions)
    heads = attn.backend.forward(q, k, v, causal=True).reshape(b, s, hq * d)
    o_w = attn.o_proj.weight[q_rows] if rows_for_row else attn.o_proj.weight[:, q_rows]
    attn_part = F.linear(heads, o_w)

    def mlp_part(y):
        inter = mlp.gate_proj.weight.shape[0] // tp
        cols = slice(rank * inter, (rank + 1) * inter)
        g = layer.post_attention_layernorm(y)
        act = F.silu(F.linear(g, mlp.gate_proj.weight[cols])) * F.linear(g, mlp.up_proj.weight[cols])
        d_w = mlp.down_proj.weight[cols] if rows_for_row else mlp.down_proj.weight[:, cols]
        return F.linear(act, d_w)

    return attn_part, mlp_part


def _tp_block_no_mlp_allreduce(layer, x, positions, rank, tp):
    a, mlp_part = _block_parts(layer, x, positions, rank, tp)
    dist.all_reduce(a)
    x = x + a
    return x + mlp_part(x)


def _tp_block_rows_and_columns_swapped(layer, x, positions, rank, tp):
    # o_proj and down_proj cut like q_proj and gate_proj: by rows (output features)
    a, mlp_part = _block_parts(layer, x, positions, rank, tp, rows_for_row=True)
    dist.all_reduce(a)
    x = x + a
    m = mlp_part(x)
    dist.all_reduce(m)
    return x + m


def _tp_block_kv_heads_not_split(layer, x, positions, rank, tp):
    # this rank's query heads, but every KV head: query head j now reads KV head j
    a, mlp_part = _block_parts(layer, x, positions, rank, tp, kv_split=False)
    dist.all_reduce(a)
    x = x + a
    m = mlp_part(x)
    dist.all_reduce(m)
    return x + m


def _tp_block_kv_computed_whole(layer, x, positions, rank, tp):
    a, mlp_part = _block_parts(layer, x, positions, rank, tp, gather_kv=True)
    dist.all_reduce(a)
    x = x + a
    m = mlp_part(x)
    dist.all_reduce(m)
    return x + m


def _tp_block_residual_in_the_sum(layer, x, positions, rank, tp):
    a, mlp_part = _block_parts(layer, x, positions, rank, tp)
    y = x + a
    dist.all_reduce(y)  # x is in every rank's term: added tp times
    z = y + mlp_part(y)
    dist.all_reduce(z)
    return z


def _tp_block_unsplit(layer, x, positions, rank, tp):
    # every rank runs the whole layer with full weights: right, and no parallelism at all
    attn, mlp = layer.self_attn, layer.mlp
    b, s, _ = x.shape
    h = layer.input_layernorm(x)
    q = F.linear(h, attn.q_proj.weight).view(b, s, attn.num_heads, attn.head_dim)
    k = F.linear(h, attn.k_proj.weight).view(b, s, attn.num_kv_heads, attn.head_dim)
    v = F.linear(h, attn.v_proj.weight).view(b, s, attn.num_kv_heads, attn.head_dim)
    q, k = attn.rotary(q, k, positions)
    x = x + F.linear(attn.backend.forward(q, k, v, causal=True).reshape(b, s, -1), attn.o_proj.weight)
    h = layer.post_attention_layernorm(x)
    act = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
    return x + F.linear(act, mlp.down_proj.weight)


def _tp_block_with_llmlab_layers(layer, x, positions, rank, tp):
    from ..layers.linear import column_parallel_forward, row_parallel_forward

    attn, mlp = layer.self_attn, layer.mlp
    b, s, _ = x.shape
    d = attn.head_dim
    hq, hkv = attn.num_heads // tp, attn.num_kv_heads // tp
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
    kv_rows = slice(rank * hkv * d, (rank + 1) * hkv * d)
    h = layer.input_layernorm(x)
    q = column_parallel_forward(h, attn.q_proj.weight[q_rows]).view(b, s, hq, d)
    k = column_parallel_forward(h, attn.k_proj.weight[kv_rows]).view(b, s, hkv, d)
    v = column_parallel_forward(h, attn.v_proj.weight[kv_rows]).view(b, s, hkv, d)
    q, k = attn.rotary(q, k, positions)
    heads = attn.backend.forward(q, k, v, causal=True).reshape(b, s, hq * d)
    x = x + row_parallel_forward(heads, attn.o_proj.weight[:, q_rows])
    inter = mlp.gate_proj.weight.shape[0] // tp
    cols = slice(rank * inter, (rank + 1) * inter)
    h = layer.post_attention_layernorm(x)
    act = F.silu(column_parallel_forward(h, mlp.gate_proj.weight[cols])) \
        * column_parallel_forward(h, mlp.up_proj.weight[cols])
    return x + row_parallel_forward(act, mlp.down_proj.weight[:, cols])


def _library_tp_pieces():
    """llmlab's own tensor-parallel layers and the unsharded modules' forward passes: during
    the check they raise, so a wrapper around them is told so."""
    from ..layers import linear as L
    from ..layers.attention import Attention
    from ..layers.mlp import MLP
    from ..models.llama import DecoderLayer
    from ..parallel import loader, model as tp_model

    return (L.column_parallel_forward, L.row_parallel_forward, L.ColumnParallelLinear.forward,
            L.RowParallelLinear.forward, L.VocabParallelEmbedding.forward,
            DecoderLayer.forward, Attention.forward, MLP.forward,
            tp_model.parallelize, tp_model.build_tp_model, loader.load_tp_model)


def _block_flops(layer, tokens: int, tp: int) -> dict:
    """Matrix-multiply FLOPs of the projections of one decoder layer for ``tokens`` tokens."""
    attn, mlp = layer.self_attn, layer.mlp
    hidden, d = attn.q_proj.weight.shape[1], attn.head_dim
    inter = mlp.gate_proj.weight.shape[0]
    full = 2 * tokens * (2 * hidden * attn.num_heads * d + 2 * hidden * attn.num_kv_heads * d
                         + 3 * hidden * inter)
    kv_extra = 2 * tokens * 2 * hidden * attn.num_kv_heads * d * (1 - 1 / tp)
    return {"full": full, "sharded": full / tp, "kv_extra": kv_extra}


def _diagnose_block(block, layer, x, positions, rank: int, tp: int) -> tuple[str | None, float]:
    """Run the student's block once on this rank; (a problem or None, max |error|)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..profiling.dispatch import count_c10d_ops
    from . import forbid

    with torch.inference_mode():
        want = layer(x, positions)  # the unsharded layer, before anything is forbidden
        with (forbid(*_library_tp_pieces()), FlopCounterMode(display=False) as flops,
              count_c10d_ops() as collectives):
            got = block(layer, x, positions, rank, tp)
    n_ar = collectives.get("allreduce", 0)
    others = {k: v for k, v in collectives.items() if k != "allreduce"}
    said = (f"your block made {n_ar} all-reduce{'s' if n_ar != 1 else ''}"
            + (f" and {sum(others.values())} other collectives ({', '.join(others)})" if others else ""))
    where = f"rank {rank} of {tp}"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return (f"{where} returned {shape}; the layer's output is {tuple(want.shape)}, the whole "
                "hidden vector of every token, the same on every rank.", math.inf)
    tol = 1e-4 * max(1.0, float(want.abs().max()))
    err = float((got.double() - want.double()).abs().max())
    if err <= tol:
        f = _block_flops(layer, x.shape[0] * x.shape[1], tp)
        done = flops.get_total_flops()
        if done >= f["sharded"] + 0.5 * (f["full"] - f["sharded"]):
            return (f"{where}: the output is right, but the rank did {done / 1e6:.1f} MFLOP of "
                    f"matrix multiplies, the whole layer's {f['full'] / 1e6:.1f}: each rank ran "
                    f"the whole layer, and nothing was split. A rank should compute only its "
                    f"1/{tp} of the heads and of the MLP features (about "
                    f"{f['sharded'] / 1e6:.1f} MFLOP).", err)
        if done >= f["sharded"] + 0.5 * f["kv_extra"]:
            kv = layer.self_attn.num_kv_heads
            return (f"{where}: the output is right, but the rank did {done / 1e6:.2f} MFLOP, "
                    f"{(done - f['sharded']) / 1e6:.2f} more than its share: it computed k and v "
                    f"for all {kv} KV heads. Its query heads read only {kv // tp} of them: "
                    f"project with those KV heads' rows of k_proj and v_proj alone (FLOPs "
                    "and KV-cache memory both split by tp).", err)
        if n_ar != 2 or others:
            return (f"{where}: the output is right, but {said}; Megatron's split needs exactly "
                    "two all-reduces per layer, after o_proj and after down_proj.", err)
        return None, err
    # a wrong output: which mistake gives it?
    problem = compare_tensors(got, want, f"{where}'s output", atol=tol)
    with torch.inference_mode():
        cand = _block_candidates(layer, x, positions, rank, tp)
    for text, value in cand:
        if value is not None and float((got - value).abs().max()) <= tol:
            return f"{where}: {text} ({said}.)", err
    if n_ar == 0:
        return (f"{problem} {said.capitalize()}: each rank returned its own partial sums. The "
                "outputs of o_proj and down_proj must be summed over the ranks.", err)
    return f"{problem} ({said}.)", err


def _block_candidates(layer, x, positions, rank: int, tp: int) -> list[tuple[str, torch.Tensor | None]]:
    """What this rank would return under each usual mistake, every rank simulated here."""
    def run(kv_split=True, attn_sum=True, mlp_sum=True, residual_in_sum=False):
        parts = [_block_parts(layer, x, positions, r, tp, kv_split=kv_split) for r in range(tp)]
        a_all = sum(p[0] for p in parts)
        x1 = [(tp * x if residual_in_sum else x) + (a_all if attn_sum else parts[r][0])
              for r in range(tp)]
        m = [parts[r][1](x1[r]) for r in range(tp)]
        if residual_in_sum:
            return sum(x1[r] + m[r] for r in range(tp))
        return x1[rank] + (sum(m) if mlp_sum else m[rank])

    hkv_ok = layer.self_attn.num_heads // tp % layer.self_attn.num_kv_heads == 0
    return [
        ("the attention's partial sums were never added: there is no all-reduce after o_proj, "
         "so each rank kept only its heads' share of the attention output.", run(attn_sum=False)),
        ("the MLP's partial sums were never added: there is no all-reduce after down_proj, so "
         "each rank kept only its features' share of the MLP output.", run(mlp_sum=False)),
        ("no all-reduce at all: each rank returned its own partial sums of both o_proj and "
         "down_proj.", run(attn_sum=False, mlp_sum=False)),
        ("the residual x was added on every rank before the all-reduce, so the sum holds it "
         f"{tp} times. Sum the partial products first, then add x once.", run(residual_in_sum=True)),
        ("the KV heads are not split per rank: this rank kept its query heads but every KV head, "
         "so its query head j read KV head j instead of the one its group shares. Each rank "
         "holds num_kv_heads / tp KV heads, the ones its own query heads read.",
         run(kv_split=False) if hkv_ok else None),
    ]


def _as_layer_forward(block, layer, rank, tp, x, positions, cache=None, key_padding_mask=None):
    return block(layer, x, positions, rank, tp)


def _ranks_check_tp_block(block, model_name: str, ids: torch.Tensor, new_tokens: int) -> dict:
    """Runs on every rank: one layer on a seeded input first, then (if every rank passed) the
    whole model with the student's block in every layer."""
    import functools as ft

    from ..models import load_model
    from ..parallel.generate import agree_on_tokens
    from . import forbid

    rank, tp = dist.get_rank(), dist.get_world_size()
    model = load_model(model_name)  # the whole model on every rank; the block uses its slices
    layer = model.layers[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, model.config.hidden_size, generator=g)
    positions = torch.arange(6).expand(2, 6)
    problem, err = _diagnose_block(block, layer, x, positions, rank, tp)
    problems = [None] * tp
    dist.all_gather_object(problems, problem)  # every rank decides alike whether to go on
    result = {"tp": tp, "problems": problems, "layer_err": err, "logits": None, "tokens": None,
              "heads": (layer.self_attn.num_heads // tp, layer.self_attn.num_kv_heads // tp)}
    if any(problems):
        return result
    for lay in model.layers:  # every layer runs the student's block; the model's code is unchanged
        lay.forward = ft.partial(_as_layer_forward, block, lay, rank, tp)
    with torch.inference_mode(), forbid(*_library_tp_pieces()):
        result["logits"] = model(ids)
        seq = ids[:1]
        tokens = []
        for _ in range(new_tokens):  # greedy, recomputing the prefix (the block has no cache)
            nxt = int(model(seq, last_only=True)[0, -1].argmax())
            nxt = agree_on_tokens([nxt])[0]
            tokens.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    result["tokens"] = tokens
    return result


def _precall_block(fn) -> None:
    """Call the answer once here (no process group) so a placeholder says "not yet" at once."""
    from ..models import load_model

    layer = load_model("tiny-llama").layers[0]
    x = torch.zeros(1, 2, layer.self_attn.q_proj.weight.shape[1])
    _precall([fn], (layer, x, torch.arange(2)[None], 0, 2))


def _run_block_on_ranks(fn, model_name: str, tp: int, new_tokens: int):
    """(result, None), or (None, verdict) when a rank raised or the ranks hung."""
    from ..parallel.launch import RankError, launch
    from ..parallel.portable import portable
    from . import LibraryAnswer

    ids, _, _ = _tp1_reference(model_name, new_tokens)
    try:
        sendable = portable(fn)
    except ValueError as exc:
        return None, wrong(f"your function cannot be sent to the ranks: {exc}",
                           "define it with def in a cell; create what it needs inside it.")
    try:
        return launch(_ranks_check_tp_block, tp, sendable, model_name, ids, new_tokens,
                      timeout_s=300), None
    except RankError as exc:
        last = exc.detail.strip().splitlines()[-1] if exc.detail.strip() else str(exc)
        if "LibraryAnswer" in last:
            raise LibraryAnswer(last.split("LibraryAnswer:", 1)[-1].strip()) from None
        if "NotImplementedError" in last:
            raise NotImplementedError(last) from None
        hint = "run it by hand on small tensors; read the rank's traceback below the check."
        if "shapes cannot be multiplied" in last or "size of tensor" in last:
            hint = ("a column-parallel weight (q, k, v, gate, up) keeps its rows, the rank's "
                    "output features; a row-parallel one (o_proj, down_proj) keeps its columns, "
                    "the input features of the rank's slice of activations. Mixing up row and "
                    "column gives exactly this shape error.")
        elif "NoneType" in last:
            hint = ("torch.distributed.all_reduce(t) sums t in place and returns None: call it, "
                    "then use t.")
        return None, wrong(f"rank {exc.rank} of {tp} raised {last}", hint)
    except TimeoutError:
        return None, wrong(f"the {tp} ranks did not finish within 300 s: probably some ranks "
                           "called an all-reduce that the others never reached.",
                           "every rank must make the same collective calls in the same order.")


@exercise("nb07.tensor_parallel_block", notebook=NB, kind="build",
          title="a decoder layer sharded by rank: attention heads and MLP features, two all-reduces",
          solution=_solution_tensor_parallel_block,
          wrong_variants={
              "no all-reduce after the MLP": (_tp_block_no_mlp_allreduce, ("down_proj", "all-reduce")),
              "row and column swapped in o_proj and down_proj":
                  (_tp_block_rows_and_columns_swapped, ("row", "column")),
              "KV heads not split per rank": (_tp_block_kv_heads_not_split,
                                              ("KV heads are not split",)),
              "every rank runs the whole layer": (_tp_block_unsplit, ("whole layer", "MFLOP")),
              "a wrapper around llmlab's own parallel layers": (_tp_block_with_llmlab_layers,
                                                               ("llmlab's own",)),
          })
def _check_tensor_parallel_block(fn):
    """``fn(layer, x [batch, seq, hidden], positions [batch, seq], rank, tp) -> [batch, seq,
    hidden]``: the decoder layer's output, computed from this rank's shard."""
    if not callable(fn):
        return wrong(f"expected a function (layer, x, positions, rank, tp) -> y; got "
                     f"{type(fn).__name__}.", "pass tensor_parallel_block itself.")
    _precall_block(fn)
    done = []
    for model_name, tp, new_tokens in (("tiny-llama", 2, 6), ("smollm2-135m", 3, 4)):
        res, verdict = _run_block_on_ranks(fn, model_name, tp, new_tokens)
        if verdict is not None:
            return verdict
        bad = [p for p in res["problems"] if p]
        if bad:
            return wrong(f"{model_name}'s layer 0 split over {tp} ranks, on a seeded input: "
                         f"{bad[0]}",
                         "q, k, v, gate and up keep this rank's rows (whole heads, with "
                         "num_kv_heads / tp KV heads); o_proj and down_proj keep the matching "
                         "columns and end in an all-reduce; the residual is added once.")
        _, ref_logits, ref_tokens = _tp1_reference(model_name, new_tokens)
        problem = compare_tensors(res["logits"], ref_logits, f"{model_name}'s logits at tp={tp}",
                                  atol=TOL)
        if problem:
            return wrong(f"{problem} Your block passes one layer but not the whole model.",
                         "check that nothing depends on the batch or sequence length.")
        diff = first_token_difference(res["tokens"], ref_tokens)
        if diff:
            return wrong(f"{model_name} at tp={tp}: greedy {diff}", "compare the logits first.")
        hq, hkv = res["heads"]
        err = float((res["logits"] - ref_logits).abs().max())
        done.append(f"{model_name} at tp={tp} ({hq} query and {hkv} KV heads per rank): layer 0 "
                    f"max |Δ| {_bound(res['layer_err'])}, every layer yours: max |Δ logits| "
                    f"{_bound(err)}, the same {len(ref_tokens)} greedy tokens")
    return right("your sharded layer, on real processes, gives one process's answer. "
                 + "; ".join(done) + f" (tolerance {TOL:g}). Each rank computed 1/tp of the "
                 "heads and MLP features and made two all-reduces per layer.")


# ---- 4. predict, then measure: all-reduces per token -----------------------------------------

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


# ---- 5. bytes all-reduced per token (compute) --------------------------------------------------

@exercise("nb07.allreduce_bytes", notebook=NB_B, kind="compute", solution=61 * 576 * 2,
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


# ---- 6. valid degrees (compute) ----------------------------------------------------------------

@exercise("nb07.valid_degrees", notebook=NB_B, kind="compute", solution=[1, 2, 4, 8],
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


# ---- 7. predict, then measure: what the split shrinks at tp = 2 ------------------------------

_SHRINK_CHOICES = {
    "a": "both halve: each rank does half of every layer's work",
    "b": "the matmul time falls, towards half; the number of calls stays the same",
    "c": "the matmul time stays the same; the number of calls halves",
    "d": "neither changes: the two cores read memory no faster together than one core alone, "
         "and every rank still runs every layer",
}


def _calls_sentence(calls: tuple[int, int] | None) -> str:
    if calls is None:
        return ("a rank makes as many operator calls as one process: the same layers, the same "
                "operators, each on a slice of the features")
    one, rank = calls
    return (f"the run counted {rank:,} operator calls on a rank against {one:,} in one process: "
            "the same layers, the same operators, each on a slice of the features")


@exercise("nb07.predict_what_shrinks", notebook=NB, kind="predict", solution="b",
          choices=_SHRINK_CHOICES,
          title="predict: at tp = 2, a core per rank, what happens to the matmul time and to "
                "the number of operator calls of a rank's step?",
          wrong_variants={"everything halves": ("a", ("as many operator calls",)),
                          "calls halve": ("c", ("as many operator calls",)),
                          "shared memory bus": ("d", ("matmul",))})
def _check_predict_what_shrinks(answer, matmuls=None, calls: tuple[int, int] | None = None):
    """``matmuls``: the run's Comparison of one process's matmul times (baseline) against a
    rank's; ``calls``: (one process's operator calls, a rank's), matmuls and others, the
    all-reduces not counted. Without them (the registry's self-check) the outcome a core per
    rank gives is assumed: the matmuls faster, the calls equal."""
    letter = str(answer).strip().lower()[:1]
    if letter not in _SHRINK_CHOICES:
        return wrong(f"{answer!r} is not one of the choices {sorted(_SHRINK_CHOICES)}.",
                     "answer with the letter of one choice, e.g. \"b\".")
    faster = True if matmuls is None else matmuls.verdict == "faster"
    measured = "" if matmuls is None else f" (in the matmuls, {matmuls.sentence()})"
    same_calls = calls is None or calls[0] == calls[1]
    right_choice = "b" if faster else "d"
    if not same_calls:  # the notebook's expect() reports it too; judge on the matmuls alone
        right_choice = "a" if faster else "c"
    matmul_part = (f"the matmul time fell{measured}: each rank reads half the weights, on its "
                   "own core" if faster else
                   f"the matmul time did not fall on this run{measured}: the two ranks read "
                   "memory no faster together than one process alone")
    why = (f"{matmul_part[:1].upper() + matmul_part[1:]}; {_calls_sentence(calls)}. Splitting "
           "shrinks each operator, not their number, and adds the all-reduces: with small "
           "matrices, that is why tp can lose.")
    if letter == right_choice:
        return right(f"({letter}) {_SHRINK_CHOICES[letter]}. {why}")
    return wrong(f"you chose ({letter}); on this run it is ({right_choice}). {why}",
                 "compare the counted calls and the matmul time of each bar in the account.")


# ---- 8. stretch: sequence-parallel RMSNorm -----------------------------------------------------

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


@exercise("nb07.sequence_parallel_norm", notebook=NB_B, kind="build", stretch=True,
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

