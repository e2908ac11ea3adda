"""Notebooks 13 (caching across requests) and 14 (long context), split from one notebook: each is
an hour (at most 2,500 words of prose, its further reading not counted, and at most 6 checked
exercises), and every exercise registered for it is checked in it and in its solutions."""
import re
from pathlib import Path

import pytest

from llmlab import exercises

from .test_notebook_budget import prose_words_and_checks as _prose_words_and_checks

SRC_DIR = Path(__file__).resolve().parents[1] / "notebooks" / "src"
NOTEBOOKS = {"13": "13_caching_across_requests", "14": "14_long_context"}


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_each_is_an_hour_and_checks_its_own_exercises(number):
    stem = NOTEBOOKS[number]
    words, checks = _prose_words_and_checks(SRC_DIR / f"{stem}.py")
    assert words <= 2500 and len(checks) <= 6, (stem, words, sorted(checks))
    registered = {n for n in exercises.names(number) if exercises.get(n).notebook == stem}
    assert registered == set(exercises.names(number)), "an nbNN exercise names another notebook"
    assert checks == registered, (sorted(checks ^ registered))
    _, solved = _prose_words_and_checks(SRC_DIR / "solutions" / f"{stem}_solutions.py")
    assert solved == registered, sorted(solved ^ registered)
    builds = [n for n in registered if exercises.get(n).kind == "build"
              and not exercises.get(n).stretch]
    assert builds, f"{stem} has no main build"


def test_the_split_left_nothing_behind():
    """The old notebook is gone, and the caching and long-context exercises sit apart."""
    assert not list(SRC_DIR.glob("13_kv_beyond*")) and not list(SRC_DIR.glob("solutions/13_kv*"))
    assert {n.split(".")[1] for n in exercises.names("13")} == {
        "radix_tree", "explain_partial_copy", "predict_computed_share"}
    assert {n.split(".")[1] for n in exercises.names("14")} == {
        "lse_merge", "kv_gib_128k", "explain_sinks", "sinks_attention"}


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_one_setup_cell_loads_the_model_once(number):
    """Imports live in the setup cell (a library answer may be imported after its exercise,
    never again), and SmolLM2 is loaded once."""
    text = (SRC_DIR / f"{NOTEBOOKS[number]}.py").read_text()
    assert text.count("llmlab.load_model(") == 1
    imported = re.findall(r"^(?:from \S+ )?import (.+)$", text, flags=re.M)
    names = [n.strip().split(" as ")[-1] for line in imported
             for n in line.split("#")[0].strip("()").split(",") if n.strip()]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert "## Further reading" in text.split("# %%")[-1], "further reading is the last cell"
