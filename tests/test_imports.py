"""Layering: every llmlab module imports on its own, and module-level imports form no cycle.

A module that only imports because something else happened to be imported first breaks
the day a student runs ``python -c "import llmlab.<module>"`` or a notebook imports in
another order. The first test imports each module in a fresh child process; the second
reads the import statements and looks for cycles, which is what makes order matter.
"""
from __future__ import annotations

import ast
import functools
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import llmlab

# The driver imports the third-party packages once (most of the start-up time: torch,
# transformers, ...) and then forks one child per module; llmlab itself is never imported
# in the driver, so each child starts without any llmlab module loaded, exactly as a fresh
# interpreter would. Whether a module's own imports of third-party packages succeed is
# tested by the driver importing them.
_DRIVER = r"""
import importlib, json, os, sys, traceback
names, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
failed = {}
for dep in preload:          # shared by the children; none of them is llmlab
    try:
        importlib.import_module(dep)
    except ImportError:
        pass                 # an optional dependency: the child that needs it reports it
assert not any(m == "llmlab" or m.startswith("llmlab.") for m in sys.modules)
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(w, traceback.format_exc()[-3000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if status or err:
        failed[name] = err or f"exit status {status}"
print(json.dumps(failed))
"""


def all_modules() -> list[str]:
    """Every module of the package, ``llmlab.kernels`` included."""
    names = {"llmlab"}
    names.update(m.name for m in pkgutil.walk_packages(llmlab.__path__, "llmlab."))
    return sorted(names)


def module_files() -> dict[str, Path]:
    """module name -> source file, for every module of :func:`all_modules`."""
    root = Path(llmlab.__file__).parent
    out = {}
    for name in all_modules():
        base = root.joinpath(*name.split(".")[1:])
        out[name] = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return out


@functools.lru_cache(maxsize=None)
def _file_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """:func:`module_level_imports` of one source file (parsed once per session)."""
    return module_level_imports(ast.parse(path.read_text(), str(path)))


def third_party_imports() -> list[str]:
    """The modules outside llmlab that llmlab's modules import when they are imported
    (sorted; what the import test's driver loads once before forking)."""
    found = set()
    for path in module_files().values():
        for node in _file_imports(path):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif not node.level and node.module:
                found.add(node.module)
    return sorted(m for m in found if m.split(".")[0] not in ("llmlab", "__future__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: at top level, in class
    bodies and in top-level if/try blocks; not in functions, not under TYPE_CHECKING."""
    found = []

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)

    visit(tree.body)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the llmlab modules its module-level imports execute.

    Importing ``a.b.c`` also runs the packages ``a.b`` and ``a``; those edges count
    unless the package is an ancestor of the importer (then it is already being imported
    and Python does not run it again).
    """
    files = module_files()
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in _file_imports(path):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
        edges = set()
        mine = set(_ancestors(name)) | {name}
        for t in targets:
            if t not in known:
                continue                       # not llmlab (or a name inside a module)
            for m in _ancestors(t) + [t]:
                if m in known and m not in mine:
                    edges.add(m)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def test_module_list_is_complete():
    names = all_modules()
    for expected in ("llmlab.generate", "llmlab.sampling", "llmlab.prompts",
                     "llmlab.engine.runner", "llmlab.kernels.flash_attn", "llmlab.bench.serve",
                     "llmlab.serve.app", "llmlab.serve.client", "llmlab.bench.serve_http"):
        assert expected in names
    assert all(p.exists() for p in module_files().values())


@pytest.mark.slow
def test_every_module_imports_on_its_own(tmp_path):
    names = all_modules()
    # run from an empty folder, as a student's interpreter outside the repository would
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(names),
                           json.dumps(third_party_imports())],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_cycle_finder_sees_a_cycle_through_a_package():
    # generate -> engine.sampler runs engine/__init__ -> engine.llm -> runner -> generate
    graph = {"p.generate": {"p.engine", "p.engine.sampler"}, "p.engine": {"p.engine.llm"},
             "p.engine.llm": {"p.engine.runner"}, "p.engine.runner": {"p.generate"},
             "p.engine.sampler": set()}
    assert find_cycles(graph) == [["p.engine", "p.engine.llm", "p.engine.runner", "p.generate"]]
    graph["p.engine.runner"] = set()
    assert find_cycles(graph) == []


def test_imports_are_read_as_python_runs_them():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ntry:\n    import c\n"
                     "except ImportError:\n    import d\ndef f():\n    import e\n"
                     "class K:\n    import g\n")
    got = [n.names[0].name for n in module_level_imports(tree)]
    assert got == ["a", "c", "d", "g"]


def test_no_import_cycles_among_llmlab_modules():
    graph = import_graph()
    assert "llmlab.prompts" in graph["llmlab.generate"]      # the graph is really built
    assert "llmlab.engine" in graph["llmlab"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_leaf_modules_import_nothing_from_the_engine_or_generate():
    graph = import_graph()
    for leaf in ("llmlab.sampling", "llmlab.prompts", "llmlab.traces"):
        assert graph[leaf] <= {"llmlab.sampling"}, (leaf, graph[leaf])



def _imports_anywhere(name: str) -> set[str]:
    """Every module named by an import statement in ``name``'s file, functions included."""
    path = module_files()[name]
    package = name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_registry_is_data_and_upcycle_does_not_reach_back_to_the_loader():
    assert not any(m.startswith("llmlab") or m.startswith(".")
                   for m in _imports_anywhere("llmlab.models.registry"))
    assert "llmlab.models.loader" not in _imports_anywhere("llmlab.models.upcycle")
    assert "llmlab.models.upcycle" in _imports_anywhere("llmlab.models.loader")


@pytest.mark.slow
def test_transformers_imports_from_the_repository_root(tmp_path):
    """transformers imports the hub's ``kernels`` library; no folder of the repository may
    shadow an installed top-level package for a process started in the root."""
    root = Path(llmlab.__file__).parent.parent
    ours = [p.name for p in root.iterdir() if (p / "__init__.py").exists() and p.name != "llmlab"]
    probe = "import importlib.util, sys; print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])"
    proc = subprocess.run([sys.executable, "-c", probe, *ours], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.stdout.strip() == "[]", f"repository folders shadowing installed packages: {proc.stdout}"
    proc = subprocess.run([sys.executable, "-c", "import transformers.activations"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
