"""What the exercises of notebooks 06 and 07 rely on beyond the generic registry tests
(tests/test_exercises.py runs every solution, placeholder and wrong variant): sending a
notebook-defined function to spawned ranks, swapping the parallel layers' forward passes,
and checker messages for answers of the wrong form."""
import pickle
import traceback

import pytest
import torch

from llmlab import exercises
from llmlab.layers import linear
from llmlab.parallel import launch
from llmlab.parallel.portable import PortableFunction, is_importable, portable

NOTEBOOK_CELL = '''
import torch
import torch.distributed as dist
from llmlab.layers.linear import all_reduce

SCALE = 3.0
LOOKUP = {"a": [1, 2]}


def helper(t):
    return t * SCALE


@torch.no_grad()
def summed(n):
    x = torch.full((n,), float(dist.get_rank() + 1)) if dist.is_initialized() else torch.ones(n)
    return [float(v) for v in all_reduce(helper(x))] if dist.is_initialized() else helper(x).tolist()


def uses_lookup():
    return LOOKUP["a"] + [len(str(SCALE))]


def fails():
    x = 1
    return x / 0


def factorial(n):
    return 1 if n <= 1 else n * factorial(n - 1)
'''


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """The functions of a notebook cell: defined in ``__main__``, source readable from a file."""
    path = tmp_path_factory.mktemp("nb") / "cell_1.py"
    path.write_text(NOTEBOOK_CELL)
    ns = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL, str(path), "exec"), ns)
    return ns


def test_a_notebook_function_travels_by_source_with_what_it_reads(cell):
    assert not is_importable(cell["summed"]) and is_importable(linear.all_reduce)
    packed = portable(cell["summed"])
    assert isinstance(packed, PortableFunction)
    kinds = {name: ref[0] for name, ref in packed.refs.items()}
    assert kinds == {"torch": "module", "dist": "module", "all_reduce": "import", "helper": "function"}
    assert packed.refs["helper"][1].refs["SCALE"][0] == "value"
    assert packed.source.startswith("def summed(")  # the decorator is dropped
    again = pickle.loads(pickle.dumps(packed))
    assert again(2) == [3.0, 3.0]  # no process group: the single-process branch
    assert pickle.loads(pickle.dumps(portable(cell["uses_lookup"])))() == [1, 2, 3]
    assert pickle.loads(pickle.dumps(portable(cell["factorial"])))(5) == 120
    assert portable(linear.all_reduce) is linear.all_reduce  # importable: sent by name


def test_a_traceback_from_a_sent_function_points_at_its_own_lines(cell):
    again = pickle.loads(pickle.dumps(portable(cell["fails"])))
    with pytest.raises(ZeroDivisionError) as info:
        again()
    last = traceback.extract_tb(info.tb)[-1]
    assert last.name == "fails" and last.lineno == NOTEBOOK_CELL.splitlines().index("    return x / 0") + 1
    assert last.line == "return x / 0"


def test_what_cannot_travel_is_refused_with_its_name(cell):
    with pytest.raises(ValueError, match="lambda"):
        portable(lambda: 1)
    lock = __import__("threading").Lock()
    ns = {"__name__": "__main__", "LOCK": lock}
    src = "def locked():\n    return LOCK.locked()\n"
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    exec(compile(src, f.name, "exec"), ns)
    with pytest.raises(ValueError, match="global 'LOCK'"):
        portable(ns["locked"])
    with pytest.raises(ValueError, match="must be importable .* lambda"):
        launch(lambda: 1, 2)


@pytest.mark.slow
def test_launch_runs_a_notebook_function_on_two_ranks(cell):
    from llmlab.parallel.comm import time_allreduce
    from llmlab.parallel.workers import run_sequence

    summed, timing = launch(run_sequence, 2, [(portable(cell["summed"]), (3,)),
                                              (time_allreduce, ([256, 4096], 5))])
    assert summed == [9.0, 9.0, 9.0]  # (1 + 2) × SCALE on every element
    assert [r["bytes"] for r in timing] == [256, 4096]
    assert all(r["us_min"] <= r["us_q1"] <= r["us"] <= r["us_q3"] <= r["us_max"] for r in timing)
    assert launch(cell["summed"], 2, 2) == [9.0, 9.0]  # launch packs a notebook fn itself


def test_use_parallel_forwards_swaps_and_restores():
    def mine(x, weight, bias):
        return x

    assert linear._FORWARDS == {"column": None, "row": None}
    with linear.use_parallel_forwards(column=mine):
        assert linear._FORWARDS["column"] is mine and linear._FORWARDS["row"] is None
        # a layer that is not split ignores the swap
        layer = linear.ColumnParallelLinear(4, 6, tp_rank=0, tp_size=1)
        torch.nn.init.ones_(layer.weight)
        assert layer(torch.ones(2, 4)).shape == (2, 6)
    assert linear._FORWARDS == {"column": None, "row": None}
    with pytest.raises(ValueError, match="row=3 must be a function"):
        with linear.use_parallel_forwards(row=3):
            pass


def test_checkers_answer_the_wrong_form_clearly():
    v = exercises.check("nb07.tensor_parallel_linear", lambda x, w, b: x)
    assert not v.passed and "pair of functions" in v.message
    v = exercises.check("nb07.tensor_parallel_block", "not a function")
    assert not v.passed and "expected a function" in v.message
    v = exercises.check("nb06.moe_dispatch", lambda x, logits, k, *w: x[:1])
    assert not v.passed and "shape (1, 16)" in v.message and "(37, 16)" in v.message
    v = exercises.check("nb06.capacity_drop", lambda e, n, cf: [True])
    assert not v.passed and "bool tensor" in v.message
    v = exercises.check("nb06.predict_drops", "lots")
    assert not v.passed and "percentage" in v.message
    assert "not yet" in str(exercises.check("nb07.predict_what_shrinks", "e"))


def test_a_placeholder_is_told_not_yet_without_starting_processes(monkeypatch):
    import sys

    launch_module = sys.modules["llmlab.parallel.launch"]  # the package re-exports the function
    started = []
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: started.append(a))
    for name in ("nb07.tensor_parallel_linear", "nb07.tensor_parallel_block",
                 "nb07.sequence_parallel_norm"):
        ex = exercises.get(name)
        v = ex.check(ex.placeholder)
        assert not v.passed and "NotImplementedError" in v.message
    assert started == []


def test_the_moe_checker_forbids_the_library_only_while_it_runs():
    """A wrapper around llmlab's own routing fails with a message naming it, and afterwards the
    library's functions run again (the model's dispatch and the notebook's cells use them)."""
    from llmlab.exercises import nb06
    from llmlab.layers import moe as M

    v = exercises.check("nb06.moe_dispatch", nb06._library_wrapper)
    assert not v.passed and "llmlab's own" in v.message and "moe.route" in v.message
    x, logits, ws = nb06._small_case(9, 4, seed=2)
    weights, experts = M.route(logits, 2)
    assert torch.allclose(M.dispatch_grouped(x, weights, experts, *ws),
                          M.dispatch_loop(x, weights, experts, *ws), atol=1e-5)


def test_the_block_checker_names_the_mistakes_it_can_see_on_one_rank():
    """The diagnosis of the tensor-parallel block, without processes: every rank's partial
    sums are simulated in this process, so each mistake's output is known exactly."""
    from llmlab.exercises import nb07
    from llmlab.models import load_model

    layer = load_model("tiny-llama").layers[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 64, generator=g)
    pos = torch.arange(6).expand(2, 6)
    with torch.inference_mode():
        want = layer(x, pos)
        cands = dict((text.split(":")[0], value) for text, value in
                     nb07._block_candidates(layer, x, pos, rank=1, tp=2))
        # the sum over ranks of the simulated parts is the layer itself
        parts = [nb07._block_parts(layer, x, pos, r, 2) for r in range(2)]
        x1 = x + sum(p[0] for p in parts)
        assert torch.allclose(x1 + sum(p[1](x1) for p in parts), want, atol=1e-5)
    assert len(cands) == 5 and all(v is not None for v in cands.values())
    for value in cands.values():  # every mistake changes the output
        assert float((value - want).abs().max()) > 1e-3
    flops = nb07._block_flops(layer, 12, 2)
    assert flops["sharded"] * 2 == flops["full"] and flops["kv_extra"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant, words", [
    ("_tp_block_residual_in_the_sum", ("residual", "2 times")),
    ("_tp_block_kv_computed_whole", ("all 4 KV heads", "MFLOP")),
])
def test_the_block_checker_on_real_ranks_names_two_more_mistakes(variant, words):
    from llmlab.exercises import nb07

    v = exercises.check("nb07.tensor_parallel_block", getattr(nb07, variant))
    assert not v.passed and all(w in v.message for w in words), v.message


@pytest.mark.slow
def test_a_decode_step_account_adds_up_on_two_ranks():
    """decode_account_on_ranks: the parts of each rank's step add up to its median step, the
    collectives are the model's (2 per layer + the embedding's all-reduce + the logits
    all-gather), and tp = 2 calls about as many other operators as one process."""
    from llmlab.parallel.workers import decode_account_on_ranks

    one = launch(decode_account_on_ranks, 1, "tiny-llama", 8, 5, 1, 2)
    two = launch(decode_account_on_ranks, 2, "tiny-llama", 8, 5, 1, 2)
    assert [a.rank for a in two] == [0, 1] and all(a.tp == 2 and a.threads == 1 for a in two)
    assert one[0].collectives == 0 and one[0].inside_collectives_s == 0
    for a in two:
        assert a.collectives == 2 * 2 + 1 + 1 and a.inside_collectives_s > 0
        assert a.matmul_s > 0 and a.matmul_ops == one[0].matmul_ops
        # the same layers' operators, plus a few for the split embedding and the gathered logits
        assert one[0].other_ops <= a.other_ops < 1.25 * one[0].other_ops
        assert a.matmul_s + a.other_s + a.inside_collectives_s == pytest.approx(a.median_s)
        assert len(a.step_s) == len(a.collective_s) == 5 and a.op_overhead_s > 0


@pytest.mark.slow
def test_the_mlp_stack_splits_in_two_and_clocks_arrivals():
    """mlp_stack_on_ranks: SmolLM2's MLPs at tp = 2 (its heads do not split in two): one
    all-reduce per layer, the same operator calls as one process, parts that add up, and the
    time before the other rank arrived within the time inside the all-reduces."""
    from llmlab.parallel.workers import mlp_stack_on_ranks

    (one,) = launch(mlp_stack_on_ranks, 1, "smollm2-135m", 5, 1, 3)
    two = launch(mlp_stack_on_ranks, 2, "smollm2-135m", 5, 1, 3)
    assert one.collectives == 0 and one.arrival_wait_s == [0.0] * 5
    assert [a.rank for a in two] == [0, 1] and all(a.tp == 2 and a.threads == 1 for a in two)
    for a in two:
        assert a.collectives == 30 and a.matmul_ops == one.matmul_ops == 90
        assert a.other_ops == one.other_ops
        assert len(a.matmul_runs) == 3 and a.matmul_s == pytest.approx(sorted(a.matmul_runs)[1])
        assert a.matmul_s + a.other_s + a.inside_collectives_s == pytest.approx(a.median_s)
        assert len(a.arrival_wait_s) == 5
        assert all(0 <= w <= c + 1e-6 for w, c in zip(a.arrival_wait_s, a.collective_s))


# -- notebook 07 within its hour, and its appendix 07b -------------------------------------------

def test_the_shrink_prediction_is_judged_against_the_run():
    """The right letter follows the run: the matmuls' timed comparison and the counted calls."""
    from llmlab.profiling import compare

    faster = compare([22e-3, 22.4e-3, 22.2e-3, 22.1e-3], [12e-3, 12.2e-3, 11.9e-3, 12.1e-3])
    tie = compare([22e-3, 22.4e-3, 22.2e-3], [22.3e-3, 22.1e-3, 22.2e-3])
    check = lambda a, **kw: exercises.check("nb07.predict_what_shrinks", a, **kw)  # noqa: E731
    assert check("b", matmuls=faster, calls=(360, 360)).passed
    v = check("a", matmuls=faster, calls=(360, 360))
    assert not v.passed and "360 operator calls" in v.message and "(b)" in v.message
    assert check("d", matmuls=tie, calls=(360, 360)).passed      # a run whose matmuls tie
    assert not check("b", matmuls=tie, calls=(360, 360)).passed


def test_notebook_07_is_an_hour_and_07b_holds_the_rest():
    """A core notebook: at most 2,500 words of prose and 6 exercises. 07b sorts right after 07
    (build.py's prefix "07" builds both), has its solutions, runs alone without the model's
    weights, and holds the bfloat16 bytes, the 70B degrees and the sequence-parallel stretch."""
    from pathlib import Path

    from .test_notebook_budget import prose_words_and_checks as _prose_words_and_checks

    src_dir = Path(__file__).resolve().parents[1] / "notebooks" / "src"
    core, appendix = src_dir / "07_tensor_parallelism.py", src_dir / "07b_tensor_parallelism_at_scale.py"
    words, checks = _prose_words_and_checks(core)
    assert words <= 2500 and len(checks) <= 6, (words, sorted(checks))
    names = sorted(p.name for p in src_dir.glob("[0-9]*.py"))
    assert names.index(appendix.name) == names.index(core.name) + 1
    assert (src_dir / "solutions" / f"{appendix.stem}_solutions.py").exists()
    in_b = {n for n in exercises.names("07") if exercises.get(n).notebook == appendix.stem}
    assert in_b == {"nb07.allreduce_bytes", "nb07.valid_degrees", "nb07.sequence_parallel_norm"}
    assert all(exercises.get(n).kind != "build" or exercises.get(n).stretch for n in in_b)
    _, checks_b = _prose_words_and_checks(appendix)
    assert checks_b == in_b and not checks & in_b
    in_core = {n for n in exercises.names("07") if exercises.get(n).notebook == core.stem}
    assert checks == in_core
    text = core.read_text()   # the prediction is committed before the tp = 2 run
    assert text.index('exercises.ask("nb07.predict_what_shrinks")') < text.index("launch(run_sequence, 2")
    text_b = appendix.read_text()
    assert "load_model" not in text_b and "import os" not in text_b   # no weights, no QUICK


def test_no_option_of_the_shrink_prediction_is_on_screen_before_it():
    """The three cells before the question state none of its options' content."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "07_tensor_parallelism.py"
    cells = re.split(r"(?m)^(?=# %%)", src.read_text())
    i = next(i for i, c in enumerate(cells) if 'exercises.ask("nb07.predict_what_shrinks")' in c)
    before = "".join(cells[i - 3:i]).lower()
    for words in ("as many", "halve", "same number", "no faster", "operator calls"):
        assert words not in before.split("**exercise (predict, then measure).**")[0], words
