"""The questions of notebooks 01, 03, 06, 08, 09 and 11 that ask the student to think: the
predictions are judged against the run passed to them (right answers pass, typical wrong ones
fail and are told why), and no option's content is on screen in the cells just before its
question."""
import re
from pathlib import Path

import pytest

from llmlab import exercises
from llmlab.exercises import nb08, nb09, nb11

SRC = Path(__file__).resolve().parents[1] / "notebooks" / "src"


def _cells(stem: str) -> list[str]:
    return re.split(r"(?m)^(?=# %%)", (SRC / f"{stem}.py").read_text())


def _before(stem: str, marker: str, n: int = 3) -> str:
    """The text of the ``n`` cells before the first cell that contains ``marker``."""
    cells = _cells(stem)
    i = next(i for i, c in enumerate(cells) if marker in c)
    return "".join(cells[max(0, i - n):i])


def _after(stem: str, marker: str) -> str:
    cells = _cells(stem)
    i = next(i for i, c in enumerate(cells) if marker in c)
    return "".join(cells[i + 1:])


# ---- nb09: the batch at which speculation stops paying ------------------------------------------

def test_breakeven_batch_is_the_first_batch_below_one():
    assert nb09.breakeven_batch({1: 3.0, 2: 1.2, 4: 0.9, 8: 0.5}) == 4
    assert nb09.breakeven_batch({1: 3.0, 2: 1.2}) is None


@pytest.mark.parametrize("speedups, right, wrong", [
    ({1: 3.3, 2: 3.3, 4: 3.2, 8: 2.6, 16: 1.5, 32: 0.98, 64: 0.71, 128: 0.67}, {32, 64},
     {1, 4, 8, 16, 128}),
    # a machine with a lower ridge point crosses earlier; a clear crossing admits one batch only
    ({1: 3.3, 2: 3.1, 4: 2.2, 8: 0.8, 16: 0.7, 32: 0.67, 64: 0.67, 128: 0.67}, {8}, {4, 16, 128}),
])
def test_predict_batching_breakeven_follows_the_run(speedups, right, wrong):
    for b in right:
        assert exercises.check("nb09.predict_batching_breakeven", b, speedups=speedups).passed, b
    for b in wrong:
        v = exercises.check("nb09.predict_batching_breakeven", b, speedups=speedups)
        assert not v.passed, b
        assert "E[tokens]" in v.message


def test_predict_batching_breakeven_names_each_mistake():
    s = nb09.REFERENCE_BATCH_SPEEDUPS
    early = exercises.check("nb09.predict_batching_breakeven", 1).message
    assert "memory roof" in early and "3.33x" in early
    late = exercises.check("nb09.predict_batching_breakeven", 128).message
    assert "does not pay at every batch" in late and f"{s[32]:.2f}x" in late
    assert "not in the model's list" in exercises.check("nb09.predict_batching_breakeven",
                                                        3).message
    assert "an int" in exercises.check("nb09.predict_batching_breakeven", "32").message
    never = exercises.check("nb09.predict_batching_breakeven", 128, speedups={1: 3.0, 128: 1.2})
    assert not never.passed and "never falls below 1x" in never.message


def test_nb09_asks_the_batch_before_the_model_runs():
    before = _before("09_speculative_decoding", 'my_batch = ...')
    assert "k + 1 times" not in before and "compute-bound" not in before
    assert "batching_model(" not in before          # the model's rows come after the guess
    assert "nb09.explain_batching" not in (SRC / "09_speculative_decoding.py").read_text()


# ---- nb08: four formats ordered by KLD ---------------------------------------------------------

def test_predict_kld_order_follows_the_sweep():
    grid = {(8, None): {"kld": 4e-3}, (4, 32): {"kld": 0.0}, (4, 64): {"kld": 0.36},
            (4, None): {"kld": 1.5}, (3, 32): {"kld": 1.6}}
    assert exercises.check("nb08.predict_kld_order", "bacd", grid=grid).passed
    assert exercises.check("nb08.predict_kld_order", "b, a, c, d", grid=grid).passed
    v = exercises.check("nb08.predict_kld_order", "abcd", grid=grid)
    assert not v.passed and "own Q4_1 blocks" in v.message and "1 pair" in v.message
    v = exercises.check("nb08.predict_kld_order", "bacd", grid={**grid, (4, 64): {"kld": 2.0}})
    assert not v.passed and "stretches the step" in v.message   # the run decides, not the key
    # KLDs within 10% are a tie: either order passes
    tie = {**grid, (4, None): {"kld": 0.38}}
    assert exercises.check("nb08.predict_kld_order", "badc", grid=tie).passed


def test_predict_kld_order_names_each_mistake():
    v = exercises.check("nb08.predict_kld_order", "bcad")
    assert not v.passed and "256 levels" in v.message and "own Q4_1" not in v.message
    v = exercises.check("nb08.predict_kld_order", "dcba")
    assert not v.passed and "5 pair" in v.message
    assert v.message.count("own Q4_1 blocks") == 1                 # one lesson, said once
    assert "once each" in exercises.check("nb08.predict_kld_order", "abc").message
    assert "once each" in exercises.check("nb08.predict_kld_order", "aabc").message


def test_nb08_asks_the_order_before_the_sweep_and_explains_after():
    before = _before("08_quantization", "my_order = ...")
    assert "own blocks" not in before and "exact at 4 bits" not in before
    assert "sweep_bits_group(" not in before
    assert "own Q4_1 blocks" in _after("08_quantization", "my_order = ...")
    assert set(nb08.KLD_SETTINGS.values()) <= {(b, g) for b in (3, 4, 8) for g in (32, 64, None)}


# ---- nb11: the modelled gain of a CUDA graph ---------------------------------------------------

def test_predict_graph_gain_follows_the_run():
    run = {"calls": 1000, "t_op": 2e-6, "roof_s": 0.09e-3}       # a slower CPU: 2 ms of launches
    gain = nb11.graph_gain(**run)
    assert gain == pytest.approx(2e-3 / 0.1e-3)
    assert exercises.check("nb11.predict_graph_gain", 0.9 * gain, **run).passed
    assert not exercises.check("nb11.predict_graph_gain", nb11.graph_gain(
        **nb11.REFERENCE_GRAPH) / 2, **run).passed
    # kernels longer than the launches: the graph saves only the replay's difference
    assert nb11.graph_gain(100, 1e-6, 1e-3) == pytest.approx(1e-3 / 1.01e-3)


def test_predict_graph_gain_names_each_mistake():
    v = exercises.check("nb11.predict_graph_gain", 1.0)
    assert not v.passed and "same kernels" in v.message and "launches" in v.message
    v = exercises.check("nb11.predict_graph_gain", 1350)
    assert not v.passed and "number of calls" in v.message
    v = exercises.check("nb11.predict_graph_gain", 40)
    assert not v.passed and "above the model" in v.message and "roof" in v.message
    v = exercises.check("nb11.predict_graph_gain", 5)
    assert not v.passed and "below the model" in v.message
    assert "positive number" in exercises.check("nb11.predict_graph_gain", "12").message


def test_nb11_states_no_answer_before_the_prediction():
    before = _before("11_overhead_and_compilation", "my_gain = ...")
    assert "modelled gain" not in before and "OverheadModel(" not in before
    assert "explain_cuda_graphs" not in (SRC / "11_overhead_and_compilation.py").read_text()


# ---- the multiple-choice questions kept, and what is on screen before them ---------------------

def test_nb03_loop_order_options_are_misconceptions_the_plots_refute():
    ex = exercises.get("nb03.explain_loop_order")
    assert ex.solution == "b" and exercises.check(ex.name, "b").passed
    for letter, word in (("a", "228 KiB"), ("c", "both orders"), ("d", "one key block at a time")):
        v = exercises.check(ex.name, letter)
        assert not v.passed and word in v.message, letter
    before = _before("03_flash_attention", 'exercises.ask("nb03.explain_loop_order")')
    assert "program" not in before                          # (b)'s content
    assert "not smaller than FlashAttention-1's" not in before    # (a)'s refutation


def test_nb03_option_a_matches_the_sram_plot():
    """(a)'s feedback: from 128 KiB of SRAM up FlashAttention-1's modelled traffic is below the
    Br = 128 line (N = 8192, d = 64, as the notebook plots it)."""
    import matplotlib
    matplotlib.use("Agg")
    from llmlab.viz.flash import plot_traffic_vs_sram

    sram = [8, 16, 32, 64, 128, 164, 228]
    _, by = plot_traffic_vs_sram(8192, 64, sram)
    fa1, fa2 = by["FlashAttention-1"], by["FlashAttention-2 Br=128"]
    assert [m for m, a, b in zip(sram, fa1, fa2) if a < b] == [128, 164, 228]


def test_nb01_explains_the_intensity_after_its_question():
    stem = "01_baseline_where_time_goes"
    marker = "my_growth = ...  # YOUR ANSWER: a number"
    question = next(c for c in _cells(stem) if "**Predict, then count.**" in c)
    before = _before(stem, marker)
    assert question in before and "L = 96" in question and "L = 8" in question
    for shown in (before, question):
        assert "L/2" not in shown and "2 FLOPs per token" not in shown and "read once" not in shown
        assert ".intensity" not in shown and "FLOP/byte" not in shown
    after = _after(stem, marker)
    assert "2 FLOPs per token" in after and "exercises.ask(" not in (SRC / f"{stem}.py").read_text()
    src = (SRC / f"{stem}.py").read_text()
    # the answer is committed before any intensity is printed, and judged against the model's
    assert (src.index(marker) < src.index('exercises.check("nb01.predict_intensity_growth", '
                                          'my_growth, measured=growth)')
            < src.index("FLOP/byte ({bound}-bound)"))


def test_nb01_intensity_growth_prediction_names_each_misreading():
    from llmlab.exercises import nb01

    want = nb01.modelled_intensity_growth()
    assert 8 < want < 12                            # a little less than the 12× the tokens
    check = lambda a, m=want: exercises.check("nb01.predict_intensity_growth", a, measured=m)  # noqa: E731
    for answer in (12, 96 / 8, want, 10):
        assert check(answer).passed, answer
    assert exercises.check("nb01.predict_intensity_growth", 12).passed   # measured=None: the model
    for answer, words in ((1, ("once", "all L")), (1.2, ("constant",)), (0.5, ("faster",)),
                          (0.1, ("faster",)), (144, ("L²", "minority")), (100, ("L²",)),
                          (3, ("0.31 times",)), (24, ("times the model",))):
        v = check(answer)
        assert not v.passed, answer
        assert all(w in v.message for w in words), (answer, v.message)
    for placeholder in (..., None, "12", True, -12, float("nan")):
        assert not check(placeholder).passed, placeholder
    # the judgement follows the value passed in, not a value of its own
    assert check(1.0, m=1.0).passed and not check(12, m=1.0).passed
    assert check(144, m=140.0).passed and not check(12, m=140.0).passed
    assert "×140.0" in check(12, m=140.0).message


def test_nb06_shows_the_identity_only_after_its_question():
    stem = "06_mixture_of_experts"
    before = _before(stem, 'exercises.ask("nb06.explain_balance_loss")')
    assert "(Pᵢ − 1/N)" not in before and "excess" not in before
    assert "(Pᵢ − 1/N)" in _after(stem, 'exercises.ask("nb06.explain_balance_loss")')
    assert exercises.check("nb06.explain_balance_loss", "c").passed
    assert "not all 1/N" in exercises.check("nb06.explain_balance_loss", "b").message


def test_nb00_weights_question_applies_the_fact_and_names_each_misconception():
    ex = exercises.get("nb00.explain_weights")
    assert ex.solution == "c" and exercises.check(ex.name, "c").passed
    for letter, word in (("a", "same weights"), ("b", "16 levels"), ("d", "exactly")):
        v = exercises.check(ex.name, letter)
        assert not v.passed and word in v.message, letter
    assert max(ex.choices.values(), key=len) != ex.choices["c"]
