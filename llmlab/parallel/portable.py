"""Send a function defined in a notebook to spawned ranks, by its source text.

:func:`~llmlab.parallel.launch` starts each rank as a fresh Python process (the ``spawn``
start method), and pickle sends a function by its module and name. A function defined in a
notebook lives in the kernel's ``__main__``, which a spawned process does not have, so
pickle cannot send it. :func:`portable` packs such a function as its source text plus what
its body reads from the notebook's globals:

* modules (``torch``, ``F``, ``dist``) by their name, imported again on the rank;
* functions and classes defined in a real module (``llmlab.layers.linear.all_reduce``) by
  their module and name, as pickle would;
* other notebook functions it calls, packed the same way (recursively);
* anything else (numbers, tensors, lists) pickled by value.

Closures are packed the same way (their free variables become globals of the rebuilt
function); decorators are dropped (the plain ``def`` travels); lambdas are refused, because
their source is not a statement of its own.
On the rank :meth:`PortableFunction.load` compiles the source with the notebook cell's file
name and line numbers, so a traceback from inside the student's code points at its lines.
Taught in notebook 07.
"""
from __future__ import annotations

import ast
import builtins
import dis
import importlib
import inspect
import linecache
import pickle
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Callable


def is_importable(fn: Any) -> bool:
    """True when pickle can send ``fn`` by reference: a module-level function of a real module."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if mod in (None, "__main__", "__mp_main__") or "<locals>" in qual or "<lambda>" in qual:
        return False
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return obj is fn


def _global_names(code: types.CodeType) -> set[str]:
    """Names the code (and the functions, classes, comprehensions nested in it) reads as globals."""
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _def_source(fn: types.FunctionType) -> tuple[str, int]:
    """(source of ``fn``'s ``def`` statement without its decorators, line number of the ``def``)."""
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise ValueError(f"cannot read the source of {fn.__qualname__!r} ({exc}); define it in a "
                         "notebook cell or a .py file") from None
    text = textwrap.dedent("".join(lines))
    tree = ast.parse(text)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != fn.__name__:
        raise ValueError(f"the source of {fn.__qualname__!r} is not a def statement of its own")
    body = text.splitlines(keepends=True)[node.lineno - 1:]  # drop decorator lines
    return "".join(body), start + node.lineno - 1


@dataclass
class PortableFunction:
    """A function packed as source text plus the globals it reads; call it like the original."""

    name: str
    source: str
    filename: str
    lineno: int
    refs: dict[str, tuple] = field(default_factory=dict)
    _loaded: Callable | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_loaded"] = None  # rebuilt on the other side
        return state

    def load(self) -> Callable:
        """The rebuilt function (compiled once per process)."""
        if self._loaded is None:
            ns: dict[str, Any] = {"__builtins__": builtins, "__name__": "__main__"}
            for key, ref in self.refs.items():
                kind = ref[0]
                if kind == "module":
                    ns[key] = importlib.import_module(ref[1])
                elif kind == "import":
                    obj = importlib.import_module(ref[1])
                    for part in ref[2].split("."):
                        obj = getattr(obj, part)
                    ns[key] = obj
                elif kind == "function":
                    ns[key] = ref[1].load()
                else:  # "value"
                    ns[key] = pickle.loads(ref[1])
            padded = "\n" * (self.lineno - 1) + self.source  # keep the original line numbers
            if self.filename not in linecache.cache:  # tracebacks can then show the lines
                linecache.cache[self.filename] = (len(padded), None,
                                                  padded.splitlines(keepends=True), self.filename)
            exec(compile(padded, self.filename, "exec"), ns)  # noqa: S102 - the user's own code
            self._loaded = ns[self.name]
        return self._loaded

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)


def portable(fn: Callable, _seen: dict | None = None) -> Callable:
    """``fn`` itself when pickle can send it by name, else a :class:`PortableFunction`.

    Raises ValueError naming what cannot be sent (a lambda, a global that pickle refuses).
    """
    if isinstance(fn, PortableFunction) or is_importable(fn):
        return fn
    fn = inspect.unwrap(fn)  # a decorated def travels as its plain def (decorators are dropped)
    if not isinstance(fn, types.FunctionType):
        raise ValueError(f"{fn!r} is not a plain function; only functions defined with def can "
                         "be sent to the ranks")
    if fn.__name__ == "<lambda>":
        raise ValueError("a lambda cannot be sent to the ranks by its source; define it with def")
    seen = {} if _seen is None else _seen
    if id(fn) in seen:
        return seen[id(fn)]
    source, lineno = _def_source(fn)
    packed = PortableFunction(fn.__name__, source, fn.__code__.co_filename, lineno)
    seen[id(fn)] = packed
    values: dict[str, Any] = {}
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            values[name] = fn.__globals__[name]
        elif not hasattr(builtins, name):
            pass  # not defined yet: the rank raises NameError, as the notebook would
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell: the enclosing function had not bound it yet
            pass
    for name, value in values.items():
        if value is fn:  # recursion: the def statement binds its own name when rebuilt
            continue
        packed.refs[name] = _ref(name, value, fn, seen)
    return packed


def _ref(name: str, value: Any, owner: Callable, seen: dict) -> tuple:
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, (types.FunctionType, type)) and is_importable(value):
        return ("import", value.__module__, value.__qualname__)
    if isinstance(value, types.FunctionType):
        return ("function", portable(value, seen))
    try:
        return ("value", pickle.dumps(value))
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        raise ValueError(f"{owner.__name__} reads the global {name!r} ({type(value).__name__}), "
                         f"which cannot be sent to the ranks ({type(exc).__name__}: {exc}); "
                         "create it inside the function instead") from None
