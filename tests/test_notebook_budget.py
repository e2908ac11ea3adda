"""Every core notebook is about an hour of study: at most 2,500 words of prose (its further
reading not counted) and at most 6 checked exercises; the rest lives in an appendix
(``NNb_...``) that has its solutions and is built and run under nbval like the others.
Lessons are checked in the tests, not by a bare ``assert`` in a student's cell."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC_DIR = ROOT / "notebooks" / "src"
SOURCES = sorted(SRC_DIR.glob("[0-9][0-9]*.py"))
CORE = [p for p in SOURCES if re.match(r"\d\d_", p.name)]
APPENDICES = [p for p in SOURCES if re.match(r"\d\d[a-z]_", p.name)]
MAX_WORDS, MAX_CHECKS = 2500, 6


def prose_words_and_checks(path: Path) -> tuple[int, set[str]]:
    """Words in the markdown cells (up to each cell's "## Further reading") and the names of
    the exercises the notebook checks."""
    words, cell = 0, None
    for line in path.read_text().splitlines() + ["# %%"]:
        if line.startswith("# %%"):
            if cell is not None:
                words += len("\n".join(cell).split("## Further reading")[0].split())
            cell = [] if "[markdown]" in line else None
        elif cell is not None:
            cell.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    checks = set(re.findall(r"exercises\.check\(\s*[\"']([^\"']+)[\"']", path.read_text()))
    return words, checks


def questions_asked(path: Path) -> int:
    """How many questions the notebook shows with ``exercises.ask`` (each is study time on
    top of the check that judges its answer)."""
    return len(re.findall(r"exercises\.ask\(", path.read_text()))


def test_the_counter_counts_prose_and_checks(tmp_path):
    src = tmp_path / "99_x.py"
    src.write_text('# %% [markdown]\n# # Title\n#\n# one two three\n\n# %%\nx = 1  # not prose\n'
                   'exercises.check("nb99.a", f)\nexercises.check( "nb99.b", g)\n'
                   '# %% [markdown]\n# more words\n#\n# ## Further reading\n# - a link\n')
    assert prose_words_and_checks(src) == (7, {"nb99.a", "nb99.b"})
    assert questions_asked(src) == 0
    src.write_text(src.read_text() + '# %%\nexercises.ask("nb99.a")\n')
    assert questions_asked(src) == 1


def test_there_are_core_notebooks_and_appendices():
    assert len(CORE) >= 14 and len(APPENDICES) >= 2, [p.name for p in SOURCES]


@pytest.mark.parametrize("src", CORE, ids=lambda p: p.stem)
def test_a_core_notebook_is_an_hour(src):
    words, checks = prose_words_and_checks(src)
    asked = questions_asked(src)
    assert words <= MAX_WORDS, f"{src.name}: {words} words of prose, at most {MAX_WORDS}"
    assert len(checks) + asked <= MAX_CHECKS, (
        f"{src.name}: {len(checks)} checks {sorted(checks)} and {asked} questions shown")


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_each_notebook_is_built_with_its_solutions_and_asserts_no_lesson(src):
    assert (ROOT / "notebooks" / f"{src.stem}.ipynb").exists()
    assert (SRC_DIR / "solutions" / f"{src.stem}_solutions.py").exists()
    assert (ROOT / "notebooks" / "solutions" / f"{src.stem}_solutions.ipynb").exists()
    bare = [ln for ln in src.read_text().splitlines() if re.match(r"\s*assert\b", ln)]
    assert not bare, f"{src.name}: a lesson is checked by expect(), not assert: {bare}"
