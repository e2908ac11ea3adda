"""Build the notebooks from their percent-format sources and execute them.

    python notebooks/build.py                 # all
    python notebooks/build.py 01 03           # those whose name starts with 01 or 03

Sources are ``notebooks/src/NN_name.py``: cells start with ``# %%`` (code) or
``# %% [markdown]`` (markdown, each line prefixed with ``# ``); a code cell's
``# NBVAL_CHECK_OUTPUT`` line becomes its ``nbval-check-output`` tag. The built notebook
``notebooks/NN_name.ipynb`` is executed top to bottom and saved with its outputs,
which is how it is committed. Solutions (``notebooks/src/solutions/*.py``) build into
``notebooks/solutions/``.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

HERE = Path(__file__).resolve().parent
# The longest cell of any notebook takes under two minutes on a 2-core CPU; one that runs
# five is hung (the same limit as `make test-notebooks`' --nbval-cell-timeout)
CELL_TIMEOUT_S = 300


# nbval's markers written in a source cell become the cell's tags, which nbval reads the
# same way: the student sees the code, not a comment about how the tests compare it
TAGS = {"# NBVAL_CHECK_OUTPUT": "nbval-check-output", "# NBVAL_IGNORE_OUTPUT": "nbval-ignore-output",
        "# NBVAL_SKIP": "nbval-skip"}


def parse(text: str) -> list:
    cells, kind, buf = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(buf).strip("\n")
        if kind == "md":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.splitlines()]
            cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
        elif body:
            lines = body.splitlines()
            tags = [TAGS[ln.strip()] for ln in lines if ln.strip() in TAGS]
            body = "\n".join(ln for ln in lines if ln.strip() not in TAGS).strip("\n")
            cell = nbformat.v4.new_code_cell(body)
            if tags:
                cell.metadata["tags"] = tags
            cells.append(cell)

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, buf = ("md" if "[markdown]" in line else "code"), []
        elif kind is not None:
            buf.append(line)
    flush()
    return cells


def build(src: Path, out: Path, execute: bool = True) -> float:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = parse(src.read_text())
    t = time.perf_counter()
    if execute:
        running = [-1]

        def started(cell, cell_index, **_):
            running[0] = cell_index

        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(out.parent)}},
                                on_cell_start=started)
        try:
            client.execute()
        except CellTimeoutError as e:      # a hung cell fails with its place, not forever
            raise SystemExit(f"{src.name}: cell {running[0]} did not finish within "
                             f"{CELL_TIMEOUT_S} s\n{e}") from None
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"{out.stem[:20]}-{i}"
    nbformat.write(nb, str(out))
    return time.perf_counter() - t


def main(argv: list[str]) -> int:
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    jobs = [(p, HERE / (p.stem + ".ipynb")) for p in sorted((HERE / "src").glob("[0-9]*.py"))]
    jobs += [(p, HERE / "solutions" / (p.stem + ".ipynb"))
             for p in sorted((HERE / "src" / "solutions").glob("[0-9]*.py"))]
    if argv:
        jobs = [j for j in jobs if any(j[0].stem.startswith(a) for a in argv)]
    for src, out in jobs:
        out.parent.mkdir(exist_ok=True)
        print(f"{out.relative_to(HERE)}: {build(src, out):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
