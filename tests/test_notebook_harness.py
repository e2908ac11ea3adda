"""How notebooks are checked: printed errors compared against a tolerance, a hung cell
failing with its name (nbval and ``notebooks/build.py``), and no kernel that can hang."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tolerance = load(NOTEBOOKS / "conftest.py", "nbval_tolerance")


def test_small_numbers_within_tolerance_take_the_committed_text():
    align = tolerance.align_small_numbers
    committed = "max |Δ| = 2.0e-07, below 1e-4: True"
    assert align("max |Δ| = 3.1e-07, below 1e-4: True", committed) == committed
    assert align("max |Δ| = 0.0e+00, below 1e-4: True", committed) == committed
    # a tenfold regression is kept as printed, so the comparison fails
    assert align("max |Δ| = 5.0e-01, below 1e-4: True", committed) == \
        "max |Δ| = 5.0e-01, below 1e-4: True"
    assert align("max |Δ| = 2.1e-04, below 1e-4: True", committed) != committed
    # an exact committed zero allows float32 round-off below the floor, and no more
    assert align("0.0e+00 vs 4.4e-05", "0.0e+00 vs 0e+00") == "0.0e+00 vs 0e+00"
    assert align("0.0e+00 vs 2e-04", "0.0e+00 vs 0e+00") == "0.0e+00 vs 2e-04"
    # above the floor, ten times the committed value is the limit
    assert align("3e-02", "4.0e-03") == "4.0e-03" and align("5e-02", "4.0e-03") == "5e-02"
    # a different count of numbers: nothing is aligned
    assert align("1e-07 2e-07", "max |Δ| = 2.0e-07") == "1e-07 2e-07"


def notebook(cells: list[tuple[str, str | None]]) -> nbformat.NotebookNode:
    """A notebook of code cells with committed stdout (None: not run)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    for i, (src, out) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(src)
        if out is not None:
            cell.execution_count = i + 1
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out)]
        nb.cells.append(cell)
    return nb


def run_nbval(tmp_path: Path, nb, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(NOTEBOOKS / "conftest.py", tmp_path / "conftest.py")
    nbformat.write(nb, str(tmp_path / "check.ipynb"))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--nbval-lax", "--nbval-current-env", "-p", "no:xdist",
                           str(tmp_path / "check.ipynb"), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_nbval_compares_printed_errors_against_the_committed_ones(tmp_path):
    checked = "# NBVAL_CHECK_OUTPUT\nprint(f'max |Δ| = {ERR:.1e}')"
    committed = "max |Δ| = 2.0e-07\n"
    ok = run_nbval(tmp_path, notebook([("ERR = 3e-7", ""), (checked, committed)]))
    assert ok.returncode == 0, ok.stdout[-2000:]
    bad = run_nbval(tmp_path, notebook([("ERR = 0.5", ""), (checked, committed)]))
    assert bad.returncode == 1 and "5.0e-01" in bad.stdout, bad.stdout[-2000:]


@pytest.mark.slow
def test_a_hung_cell_fails_nbval_with_its_name(tmp_path):
    nb = notebook([("x = 1", ""), ("import time\ntime.sleep(10**6)", ""), ("print(x)", "1\n")])
    out = run_nbval(tmp_path, nb, "--nbval-cell-timeout=3")
    assert out.returncode == 1
    assert "check.ipynb::Cell 1" in out.stdout and "Timeout of 3 seconds" in out.stdout


@pytest.mark.slow
def test_a_hung_cell_fails_the_notebook_build_with_its_name(tmp_path, monkeypatch):
    build = load(NOTEBOOKS / "build.py", "notebook_build")
    monkeypatch.setattr(build, "CELL_TIMEOUT_S", 3)
    src = tmp_path / "99_hang.py"
    src.write_text("# %%\nx = 1\n\n# %% [markdown]\n# text\n\n# %%\nimport time\n"
                   "time.sleep(10**6)\n")
    with pytest.raises(SystemExit, match=r"99_hang.py: cell 2 did not finish within 3 s"):
        build.build(src, tmp_path / "99_hang.ipynb")


def test_the_kernel_is_not_one_that_can_strand_a_request():
    """ipykernel 7.0-7.3 sent shell replies around its stream: a request that arrived
    meanwhile could sit unread while the kernel idled, and a notebook run hung forever."""
    from importlib.metadata import version

    major, minor = (int(x) for x in version("ipykernel").split(".")[:2])
    assert not (major == 7 and minor < 4), f"ipykernel {version('ipykernel')}: use >= 7.4"


def test_the_build_turns_nbval_markers_into_tags_the_student_does_not_read():
    build = load(NOTEBOOKS / "build.py", "notebook_build_tags")
    cells = build.parse("# %%\n# NBVAL_CHECK_OUTPUT\nprint(1)\n\n# %%\nx = 2\n")
    assert cells[0].source == "print(1)" and cells[0].metadata["tags"] == ["nbval-check-output"]
    assert "tags" not in cells[1].metadata


def test_every_committed_notebook_marks_compared_cells_by_tag_only():
    for path in sorted(NOTEBOOKS.glob("**/*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert not [c for c in code if "NBVAL_" in c.source], f"{path.name}: a marker comment"
        if path.parent == NOTEBOOKS:
            assert any("nbval-check-output" in c.metadata.get("tags", []) for c in code), \
                f"{path.name}: no compared cell"


@pytest.mark.slow
def test_nbval_compares_a_tagged_cell(tmp_path):
    nb = notebook([("ERR = 0.5", ""), ("print(f'max |Δ| = {ERR:.1e}')", "max |Δ| = 2.0e-07\n")])
    nb.cells[1].metadata["tags"] = ["nbval-check-output"]
    bad = run_nbval(tmp_path, nb)
    assert bad.returncode == 1 and "5.0e-01" in bad.stdout, bad.stdout[-2000:]
