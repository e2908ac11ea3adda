"""The exercise registry: every checker accepts its solution, says "not yet" to the
placeholder, and fails each known wrong variant with a message that names the mistake."""
from pathlib import Path

import pytest

from llmlab import exercises
from llmlab.exercises import KINDS, Exercise, Verdict, compare_tensors, exercise, wrong
from llmlab.exercises.__main__ import self_check

from .conftest import THOROUGH

ALL = exercises.names()
REPO = Path(__file__).resolve().parents[1]


def test_registry_lists_exercises_with_metadata():
    assert len(ALL) == len(set(ALL)) > 0
    for name in ALL:
        ex = exercises.get(name)
        assert isinstance(ex, Exercise) and ex.name == name
        assert ex.kind in KINDS and ex.title and ex.notebook[:2].isdigit()
        assert name.startswith("nb" + ex.notebook[:2] + ".")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="there are"):
        exercises.get("nb99.nothing")


def test_each_notebook_has_a_build_exercise():
    """Every notebook after the tour (00) has a main build that is not a stretch."""
    shipped = {p.name[:2] for p in (REPO / "notebooks" / "src").glob("[0-9][0-9]_*.py")} - {"00"}
    built = {exercises.get(n).notebook[:2] for n in ALL
             if exercises.get(n).kind == "build" and not exercises.get(n).stretch}
    assert len(shipped) >= 10
    assert shipped - built == set(), f"notebooks without a main build: {sorted(shipped - built)}"


# checkers that run SmolLM2 or spawn processes take seconds each: `make test-fast` skips them
SLOW_CHECKERS = {"nb02.kv_cache", "nb04.block_allocator", "nb07.tensor_parallel_linear",
                 "nb07.sequence_parallel_norm", "nb08.group_quantize", "nb09.accept_reject",
                 "nb11.fixed_shape_attend", "nb11.predict_outside_share",
                 "nb07.tensor_parallel_block", "nb02.decode_loop", "nb04.paged_attention",
                 "nb04.append_slot", "nb09.speculative_step", "nb10.engine_loop",
                 "nb14.lse_merge", "nb14.sinks_attention", "nb13.radix_tree",
                 "nb13.predict_computed_share", "nb12.token_table"}


# A slow checker's reference solution is run by its solution notebook (nbval, in `make test`):
# here `make test` checks its placeholder and wrong variants, `make test-thorough` all three.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CHECKERS
                                  else n for n in ALL])
def test_solution_placeholder_and_wrong_variants(name):
    assert self_check(name, solution=THOROUGH or name not in SLOW_CHECKERS) == []


def test_every_exercise_is_checked_in_its_solution_notebook():
    """What lets `make test` leave the slow checkers' reference solutions to nbval."""
    import re

    for name in ALL:
        nb = exercises.get(name).notebook
        src = REPO / "notebooks" / "src" / "solutions" / f"{nb}_solutions.py"
        assert src.exists(), f"{name}: no solution notebook {src.name}"
        assert re.search(rf"exercises\.check\(\s*[\"']{re.escape(name)}[\"']", src.read_text()), \
            f"{name} is not checked in {src.name}"


def test_build_exercises_have_two_wrong_variants():
    thin = [n for n in ALL if exercises.get(n).kind == "build" and not exercises.get(n).stretch
            and len(exercises.get(n).wrong_variants) < 2]
    assert thin == []


def test_check_never_raises_and_self_check_catches_a_broken_checker():
    @exercise("nb99.selftest", notebook="99_test", title="t", kind="build", solution=lambda: 1,
              wrong_variants={"two": (lambda: 2, ("two",))})
    def _check(fn):
        got = fn()
        return Verdict(True, "ok") if got == 1 else wrong(f"got {got}, expected 1")

    try:
        ex = exercises.get("nb99.selftest")
        assert ex.check(lambda: 1).passed
        v = ex.check(lambda: 1 / 0)
        assert not v.passed and "ZeroDivisionError" in v.message
        assert "not yet" in str(ex.check(ex.placeholder))
        assert "NotImplementedError" in ex.check(ex.placeholder).message
        # the wrong variant's message does not contain "two": self_check reports it
        assert any("lacks" in p for p in self_check("nb99.selftest"))
    finally:
        exercises._REGISTRY.pop("nb99.selftest", None)


def test_compare_tensors_names_the_error():
    import torch

    want = torch.zeros(2, 3)
    assert compare_tensors(want.clone(), want, "out", 1e-6) is None
    got = want.clone()
    got[1, 2] = 0.5
    msg = compare_tensors(got, want, "out", 1e-6)
    assert "0.5" in msg and "(1, 2)" in msg
    assert "shape" in compare_tensors(torch.zeros(3), want, "out", 1e-6)
    assert "tensor" in compare_tensors([0.0], want, "out", 1e-6)


def _choice_questions():
    return [exercises.get(n) for n in ALL if exercises.get(n).kind == "explain"]


def test_every_explain_question_has_its_options_in_the_registry():
    missing = [ex.name for ex in _choice_questions() if not ex.choices]
    assert missing == [], f"explain exercises without choices: {missing}"
    for ex in _choice_questions():
        assert ex.solution in ex.choices, ex.name
        assert "(" + ex.solution + ")" in exercises.ask(ex.name)._repr_markdown_()


def test_options_do_not_give_the_answer_away():
    """The right option is the longest in at most a third of the questions, and no letter is
    right in more than half of them."""
    qs = [ex for ex in _choice_questions() if ex.choices]
    assert len(qs) >= 8
    longest = [ex.name for ex in qs
               if all(len(ex.choices[ex.solution]) > len(v) for k, v in ex.choices.items()
                      if k != ex.solution)]
    assert len(longest) <= len(qs) / 3, f"right option is the longest in {longest}"
    letters = [ex.solution for ex in qs]
    worst = max(set(letters), key=letters.count)
    assert letters.count(worst) <= len(qs) / 2, f"({worst}) is right in {letters.count(worst)}/{len(qs)}"


def test_notebooks_show_the_registry_options():
    """A notebook asks its explain questions with exercises.ask, not options typed in Markdown."""
    for ex in _choice_questions():
        src = (REPO / "notebooks" / "src" / f"{ex.notebook}.py").read_text()   # its own: 04b, not 04
        assert f'exercises.ask("{ex.name}")' in src, f"{ex.notebook} does not ask {ex.name}"


def test_forbid_catches_a_wrapper_around_the_library():
    import torch

    from llmlab.attention import naive_attention

    def wrapper(q, k, v):
        return naive_attention(q, k, v)

    q = torch.randn(1, 2, 3, 4)
    with exercises.forbid(naive_attention):
        try:
            wrapper(q, q, q)
        except exercises.LibraryAnswer as exc:
            assert "naive_attention" in exc.what
        else:
            raise AssertionError("forbid let the library run")
    assert naive_attention(q, q, q).shape == q.shape   # restored after the block

    @exercise("nb99.forbidden", notebook="99_test", title="t", kind="build",
              solution=lambda: 1)
    def _check(fn):
        with exercises.forbid(naive_attention):
            fn()
        return Verdict(True, "ok")

    try:
        v = exercises.check("nb99.forbidden", lambda: wrapper(q, q, q))
        assert not v.passed and "llmlab's own" in v.message and "naive_attention" in v.message
    finally:
        exercises._REGISTRY.pop("nb99.forbidden", None)
