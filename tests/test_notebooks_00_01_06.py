"""Notebooks 00, 01 and 06 beyond the registry's checks: the workbook's map names every
notebook, nb01's score-bytes answer is not computed before its exercise and its fixed takeaway
holds against the cost model, no notebook cell asserts (expect() states what a run shows), and
nb06's loop-vs-grouped sentence is written from the comparisons' verdicts."""
import ast
import importlib.util
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SRC = NOTEBOOKS / "src"


def parse(text: str) -> list:
    """The cells of a notebook source, as notebooks/build.py reads them."""
    spec = importlib.util.spec_from_file_location("notebook_build_parse", NOTEBOOKS / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.parse(text)


def _src(prefix: str) -> str:
    (path,) = SRC.glob(f"{prefix}_*.py")
    return path.read_text()


def test_the_map_names_every_notebook_with_what_it_needs_first():
    text = _src("00")
    assert "Planned" not in text and "not written yet" not in text
    rows = dict(re.findall(r"^# \| (\d\db?) \|(.*)\|\s*$", text, flags=re.M))
    numbers = {p.name.split("_")[0] for p in SRC.glob("[0-9]*.py")}
    assert set(rows) == numbers, sorted(numbers ^ set(rows))
    for number, row in rows.items():
        needs = row.rsplit("|", 1)[-1].strip()
        assert needs == "—" if number == "00" else re.fullmatch(r"\d\db?(, \d\db?)*", needs), (number, needs)
        if needs != "—":
            assert all(n in numbers and n < number for n in needs.split(", ")), (number, needs)


def _code_before(src: str, marker: str) -> str:
    assert marker in src, marker
    return src[:src.index(marker)]


def test_nb01_computes_no_score_matrix_size_before_its_exercise():
    head = _code_before(_src("01"), 'exercises.check("nb01.score_bytes"')
    assert "score_bytes" not in head
    assert not re.search(r"\b9\s*\*\s*\w+\s*\*\*\s*2|\*\*\s*2\s*/\s*2\s*\*\*\s*20", head)
    assert "attention_cost(" not in head and "explore_attention(" not in head


def test_nb01_takeaway_matches_the_cost_model():
    """The takeaway's fixed numbers: L over the intensity at 8 and at 96 tokens."""
    import llmlab
    from llmlab.profiling.roofline import forward_cost

    cfg = llmlab.load_model("smollm2-135m").config
    text = _src("01")
    m = re.search(r"give L/(\d\.\d) at 8 tokens and L/(\d\.\d) at 96", text)
    assert m, "the takeaway's L/x numbers"
    for n, shown in zip((8, 96), m.groups()):
        assert f"{n / forward_cost(cfg, 1, n).intensity:.1f}" == shown, (n, shown)


@pytest.mark.parametrize("prefix", ["00", "01", "06"])
def test_no_cell_asserts(prefix):
    """A notebook states what its run was meant to show with expect(): a note for a student,
    a failure under the tests; a bare assert would crash a student's run on a noisy machine."""
    for cell in parse(_src(prefix)):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not asserts, (prefix, cell.source.splitlines()[asserts[0] - 1])


def test_pair_sentence_writes_ties_as_ties_and_names_a_resolved_difference():
    from llmlab.profiling import compare
    from llmlab.viz.moe import pair_sentence

    tie = compare([1.0, 1.1, 0.9, 1.05, 0.95], [1.02, 0.98, 1.08, 0.92, 1.0], "loop", "grouped")
    fast = compare([1.20, 1.21, 1.22, 1.2, 1.21], [1.0, 1.01, 1.0, 1.02, 1.01], "loop", "grouped")
    slow = compare([1.0, 1.01, 1.0, 1.02, 1.01], [1.20, 1.21, 1.22, 1.2, 1.21], "loop", "grouped")
    assert not tie.resolved and fast.verdict == "faster" and slow.verdict == "slower"
    only_ties = pair_sentence([1, 16], [tie, tie])
    assert only_ties == (f"loop and grouped do not differ at this noise at any size measured: "
                         f"1 token ({tie.interval()}), 16 tokens ({tie.interval()})")
    assert "faster" not in only_ties
    mixed = pair_sentence([1, 16, 128], [fast, tie, slow])
    assert f"grouped is faster than loop at 1 token ({fast.interval()})" in mixed
    assert "loop is faster than grouped at 128 tokens (1.20×" in mixed
    assert "do not differ at this noise at 16 tokens" in mixed
    with pytest.raises(ValueError):
        pair_sentence([1, 16], [tie])
