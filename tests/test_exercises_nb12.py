"""Notebook 12's questions beyond the registry's generic checks: the two predictions are judged
against what was measured or parsed (right answers pass, typical wrong ones fail and are told
why), no option's content is on screen in the cells just before a question, and the dropped
token-boundary question is gone everywhere while its lesson stays in the prose and the build."""
import re
from pathlib import Path

import pytest

from llmlab import exercises
from llmlab.exercises import nb12

SRC = Path(__file__).resolve().parents[1] / "notebooks" / "src"
STEM = "12_structured_outputs"


def _cells(path: Path) -> list[str]:
    return re.split(r"(?m)^(?=# %%)", path.read_text())


def _before(marker: str, n: int = 3) -> str:
    """The text of the ``n`` cells before the first cell of notebook 12 holding ``marker``."""
    cells = _cells(SRC / f"{STEM}.py")
    i = next(i for i, c in enumerate(cells) if marker in c)
    return "".join(cells[max(0, i - n):i])


# ---- the share of the vocabulary allowed inside a string ---------------------------------------

@pytest.mark.parametrize("measured, right, wrong", [
    (0.987, "d", ("a", "b", "c")),        # SmolLM2: almost every token fits inside a string
    (0.05, "b", ("a", "c", "d")),         # a vocabulary full of quotes would land elsewhere
    (0.30, "c", ("a", "b", "d")),
])
def test_predict_allowed_fraction_follows_the_measurement(measured, right, wrong):
    assert nb12.fraction_letter(measured) == right
    v = exercises.check("nb12.predict_allowed_fraction", right, measured=measured)
    assert v.passed and f"{measured:.1%}" in v.message
    for letter in wrong:
        v = exercises.check("nb12.predict_allowed_fraction", letter, measured=measured)
        assert not v.passed, letter
        assert f"the measured share is {measured:.1%}, option ({right})" in v.message


def test_predict_allowed_fraction_refuses_what_is_not_a_choice():
    v = exercises.check("nb12.predict_allowed_fraction", "e", measured=0.987)
    assert not v.passed and "not one of the choices" in v.message


def test_the_fraction_is_asked_before_the_table_and_checked_after_the_measurement():
    src = (SRC / f"{STEM}.py").read_text()
    ask = src.index('exercises.ask("nb12.predict_allowed_fraction")')
    check = src.index('exercises.check("nb12.predict_allowed_fraction"')
    assert ask < src.index('exercises.check("nb12.token_table"') < check
    head = _before('exercises.ask("nb12.predict_allowed_fraction")')
    assert not re.search(r"\d+\s*%", head), "a share is on screen before the question"
    assert "almost any" not in head and "almost everything" not in head


# ---- the naive tool-call stream ----------------------------------------------------------------

def test_predict_naive_tool_stream_follows_what_the_parser_forwards():
    shown = nb12.naive_arguments(nb12.CALL)
    assert shown == '{"city":"Paris","unit":"celsius"}}'
    assert nb12.stream_letter(shown, shown[:-1]) == "b"
    v = exercises.check("nb12.predict_naive_tool_stream", "b")
    assert v.passed and "wrapper" in v.message
    for letter in ("a", "c", "d"):
        v = exercises.check("nb12.predict_naive_tool_stream", letter)
        assert not v.passed, letter
        assert "option (b)" in v.message and "wrapper's closing brace" in v.message
    assert "answer with a letter" in exercises.check("nb12.predict_naive_tool_stream",
                                                     "z").message


def test_the_tool_stream_options_are_not_on_screen_before_the_question():
    head = _before('exercises.ask("nb12.predict_naive_tool_stream")')
    for option in nb12._STREAM_CHOICES.values():
        assert option not in head
    assert 'one more "}"' not in head and "not JSON" not in head


# ---- the token-boundary question: dropped, its lesson kept -------------------------------------

def test_the_token_boundary_question_is_gone_everywhere():
    name = "nb12.explain_token_boundaries"
    assert name not in exercises.names("12")
    for path in (SRC / f"{STEM}.py", SRC / "solutions" / f"{STEM}_solutions.py",
                 Path(nb12.__file__)):
        assert name not in path.read_text(), path.name
    assert [exercises.get(n).kind for n in exercises.names("12")] == [
        "build", "predict", "predict", "build"]


def test_why_the_first_character_is_not_enough_is_told_and_checked():
    src = (SRC / f"{STEM}.py").read_text()
    told = src.index("look at each token's first character")
    assert told < src.index("## Build: the token table")
    prose = src[told:src.index("# %%", told)]
    assert "'ité'" in prose and "`é`" in prose and "where a token ends" in prose
    _, words = exercises.get("nb12.token_table").wrong_variants["first character only"]
    assert "part-way" in words


def test_the_examples_in_the_prose_hold_for_smollm2():
    """`'is'` and `'ité'` are single SmolLM2 tokens that both start with a letter the city
    allows after "Par"; only the first survives the walk, and `'",'` goes on past the string."""
    dfa, vocab = nb12.exercise_dfa()
    from llmlab import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    mid = dfa.walk(dfa.start, '{"city":"Par')
    for text in ("is", "ité", '",'):
        assert len(tok.encode(text, add_special_tokens=False)) == 1, text
    assert dfa.step(mid, "i") >= 0 and dfa.walk(mid, "is") >= 0
    assert dfa.walk(mid, "ité") == -1
    after_city = dfa.walk(dfa.start, '{"city":"Paris')
    assert dfa.walk(after_city, '",') >= 0 and not dfa.accepting[dfa.walk(after_city, '",')]
