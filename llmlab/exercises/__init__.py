"""The workbook's exercises: a registry of named exercises, each with a checker.

Every notebook has exercises of four kinds:

- ``build``: the student writes a real piece of the technique (an attention backend, a KV
  cache, a block allocator, a scheduling step, an MoE dispatch, a parallel layer) with the
  library's own signature; the checker drops it into the running model and judges it by
  the model's output (max error, first differing token, broken invariant).
- ``predict``: the student commits a number or a choice before a cell measures it; the
  checker compares with the measurement within a stated tolerance and explains the gap.
- ``explain``: a multiple-choice "why" question; each wrong choice gets its own explanation.
- ``compute``: a number worked out by hand from the notebook's formulas.

Use from a notebook::

    from llmlab import exercises
    exercises.check("nb01.naive_attention", naive_attention)   # -> Verdict, shown in the cell

``exercises.names()`` lists them, ``exercises.get(name)`` returns one :class:`Exercise`.
``python -m llmlab.exercises`` lists them; ``--solutions`` checks every reference solution,
every placeholder and every known wrong variant.

A checker never raises: whatever the student's code does (raise, return None, return the
wrong shape) comes back as a :class:`Verdict` whose message says what is wrong, by how much,
and ends with a hint.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

KINDS = ("build", "predict", "explain", "compute")


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``passed`` and a message (what is wrong, by how much, a hint)."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return ("✅ right: " if self.passed else "❌ not yet: ") + self.message

    __repr__ = __str__


def right(message: str) -> Verdict:
    """A passing verdict."""
    return Verdict(True, message)


def wrong(problem: str, hint: str = "") -> Verdict:
    """A failing verdict: ``problem`` says what is wrong and by how much; ``hint`` what to try."""
    return Verdict(False, problem + (f" Hint: {hint}" if hint else ""))


def _raises_not_implemented(*args, **kwargs):
    raise NotImplementedError("write this function")


@dataclass
class Exercise:
    """One exercise of one notebook.

    ``checker(answer, **context) -> Verdict`` may let the student's exceptions propagate:
    :meth:`check` turns them into a verdict. ``wrong_variants`` maps a label to
    ``(answer, words)``: a realistic mistake, and words its failing message must contain;
    the tests and ``python -m llmlab.exercises --solutions`` run them.
    """

    name: str
    notebook: str
    title: str
    kind: str
    checker: Callable[..., Verdict]
    solution: Any
    placeholder: Any = None
    wrong_variants: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict)
    stretch: bool = False
    choices: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.choices is not None and (not self.choices or any(
                len(k) != 1 or not k.islower() for k in self.choices)):
            raise ValueError(f"exercise {self.name!r}: choices {list(self.choices)} should be "
                             "single lower-case letters")

    def check(self, answer: Any, **context) -> Verdict:
        """Judge ``answer``; never raises (a KeyboardInterrupt still stops the cell)."""
        if answer is None or answer is ...:
            return wrong("the answer is still the placeholder (None or ...).",
                         "replace it with your answer and run the cell again.")
        try:
            verdict = self.checker(answer, **context)
        except LibraryAnswer as exc:
            return wrong(f"your answer calls llmlab's own {exc.what}, which is what this build "
                         "asks you to write.",
                         "write the technique yourself from plain tensor operations; the "
                         "notebook's cells above show the pieces.")
        except NotImplementedError:
            return wrong("your code still raises NotImplementedError.",
                         "replace the `raise NotImplementedError` with your implementation.")
        except Exception as exc:  # the student's code raised inside the check
            return wrong(f"running your answer raised {type(exc).__name__}: {exc}",
                         "run your function on a small input by hand and read the traceback.")
        if not isinstance(verdict, Verdict):  # a checker bug, reported instead of raised
            return wrong(f"the checker of {self.name} returned {verdict!r} instead of a Verdict.")
        return verdict

    def __repr__(self) -> str:
        tag = " (stretch)" if self.stretch else ""
        return f"<Exercise {self.name}: {self.kind}{tag}, notebook {self.notebook}: {self.title}>"


_REGISTRY: dict[str, Exercise] = {}


def exercise(name: str, *, notebook: str, title: str, kind: str, solution: Any,
             placeholder: Any = None, wrong_variants: dict | None = None,
             stretch: bool = False, choices: dict[str, str] | None = None
             ) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    """Decorator: register the decorated checker as exercise ``name`` (``nbNN.short_name``).

    ``placeholder`` defaults to what the shipped notebook holds: a function that raises
    NotImplementedError for a build exercise (or any callable solution), else None.
    ``choices`` (letter -> option text) are the options a student sees: the notebook shows
    them with :func:`ask`, so the question and its checker share one source.
    """
    if placeholder is None and (kind == "build" or callable(solution)):
        placeholder = _raises_not_implemented

    def register(checker: Callable[..., Verdict]) -> Callable[..., Verdict]:
        if name in _REGISTRY:
            raise ValueError(f"exercise {name!r} is registered twice")
        _REGISTRY[name] = Exercise(name, notebook, title, kind, checker, solution, placeholder,
                                   dict(wrong_variants or {}), stretch,
                                   None if choices is None else dict(choices))
        return checker

    return register


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("nb"):
            importlib.import_module(f"{__name__}.{info.name}")


def names(notebook: str | None = None) -> list[str]:
    """Every exercise's name, in notebook order; ``notebook`` ("03" or "nb03") filters."""
    _load_all()
    prefix = None if notebook is None else "nb" + notebook.removeprefix("nb")[:2] + "."
    return [n for n in _REGISTRY if prefix is None or n.startswith(prefix)]


def get(name: str) -> Exercise:
    """The exercise called ``name``; a KeyError lists the names there are."""
    _load_all()
    if name not in _REGISTRY:
        raise KeyError(f"no exercise {name!r}; there are: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def check(name: str, answer: Any, **context) -> Verdict:
    """Check ``answer`` for exercise ``name``; the verdict shows itself in a notebook cell."""
    return get(name).check(answer, **context)


class Question:
    """A multiple-choice question as a notebook shows it: the title and the options.

    Displays as Markdown in Jupyter and as plain text elsewhere."""

    def __init__(self, exercise: Exercise):
        self.exercise = exercise

    def _lines(self) -> list[str]:
        ex = self.exercise
        return [f"- ({k}) {v}" for k, v in (ex.choices or {}).items()]

    def _repr_markdown_(self) -> str:
        title = self.exercise.title.removeprefix("explain: ").removeprefix("stretch: ")
        return f"**{title[:1].upper() + title[1:]}**\n\n" + "\n".join(self._lines())

    def __str__(self) -> str:
        return self.exercise.title + "\n" + "\n".join(self._lines())

    __repr__ = __str__


def ask(name: str) -> Question:
    """The question ``name`` with its options, for a notebook cell to display."""
    ex = get(name)
    if not ex.choices:
        raise ValueError(f"exercise {name!r} has no choices to show")
    return Question(ex)


class LibraryAnswer(Exception):
    """Raised when a build's answer calls the library's own implementation of that build."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@contextlib.contextmanager
def forbid(*functions: Callable):
    """Inside the block, calling any of ``functions`` raises :class:`LibraryAnswer`.

    A build's checker wraps the call of the student's code with it, so that a wrapper
    around llmlab's own implementation of the piece fails with a message saying so.
    Each function's code object is swapped, so a name the student imported earlier
    (``from llmlab.attention import flash_attention``) is caught too; the checker's own
    reference must be computed outside the block.
    """
    saved = []
    try:
        for fn in functions:
            fn = getattr(fn, "__func__", fn)
            what = f"`{fn.__module__}.{fn.__qualname__}`"

            names = fn.__code__.co_freevars
            # the swapped code runs with fn's globals and closure: it names nothing but a
            # builtin and a literal, and loads as many free variables as fn has cells
            src = ("def outer():\n" + "".join(f"    {n} = None\n" for n in names)
                   + "    def inner(*args, **kwargs):\n"
                   + "".join(f"        {n}\n" for n in names)
                   + "        raise __import__('llmlab.exercises', fromlist=['LibraryAnswer'])"
                   + f".LibraryAnswer({what!r})\n    return inner\n")
            scope: dict = {}
            exec(src, scope)
            saved.append((fn, fn.__code__))
            fn.__code__ = scope["outer"]().__code__
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code


# ---- helpers for checkers ------------------------------------------------------------------

def compare_tensors(got: Any, want, what: str, atol: float, rtol: float = 0.0) -> str | None:
    """None when ``got`` matches ``want`` within tolerance, else a sentence saying how not:
    wrong type, wrong shape, NaN, or the max absolute error and where it is."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{what} should be a tensor, got {type(got).__name__}."
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}."
    diff = (got.detach().double() - want.detach().double()).abs()
    if torch.isnan(diff).any():
        return f"{what} contains NaN at {int(torch.isnan(diff).sum())} places."
    bound = atol + rtol * want.detach().double().abs()
    if bool((diff > bound).any()):
        err = float(diff.max())
        at = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        return f"{what} differs from the reference: max |error| = {err:.3g} at index {at} (allowed {atol:g})."
    return None


def first_token_difference(got: Iterable[int], want: Iterable[int]) -> str | None:
    """None when the token lists are equal, else where they first differ."""
    got, want = list(got), list(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i} differs: yours {a}, the reference {b}."
    if len(got) != len(want):
        return f"you produced {len(got)} tokens, the reference {len(want)}."
    return None


def number_verdict(answer: Any, want: float, *, rel: float = 0.0, good: str, hint: str,
                   unit: str = "") -> Verdict:
    """Judge a number against ``want`` within relative tolerance ``rel``."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return wrong(f"the answer should be a finite number, got {answer!r}.", hint)
    if abs(answer - want) <= rel * abs(want) or answer == want:
        return right(good)
    factor = answer / want if want else math.inf
    return wrong(f"{answer:,g}{unit} is off: it is {factor:.3g}× the expected value.", hint)


def choice_verdict(answer: Any, right_choice: str, explanations: dict[str, str]) -> Verdict:
    """Judge a multiple-choice answer (a letter); every choice has its explanation."""
    letter = str(answer).strip().lower()[:1]
    if letter not in explanations:
        return wrong(f"{answer!r} is not one of the choices {sorted(explanations)}.",
                     "answer with the letter of one choice, e.g. \"b\".")
    if letter == right_choice:
        return right(explanations[letter])
    return wrong(f"({letter}) is not it: {explanations[letter]}", "read the choices again.")


# ---- kept for the checkers written before the registry --------------------------------------

def say(ok: bool, good: str, bad: str) -> bool:
    """Print the verdict (``good`` when right, ``bad`` otherwise) and return ``ok``."""
    print(Verdict(ok, good if ok else bad))
    return ok


def unanswered(answer) -> bool:
    """True for the placeholders a notebook starts with (``None`` or ``...``)."""
    return answer is None or answer is ...


def call_cases(fn: Callable, cases: Iterable[tuple], returns: str) -> tuple[list | None, str]:
    """Call the student's ``fn(*args)`` for each ``args`` in ``cases``.

    Returns (results, "") or, when it raised or returned None, (None, a message saying so;
    ``returns`` names what it should return, e.g. "an int").
    """
    try:
        got = [fn(*args) for args in cases]
    except Exception as exc:  # the student's code raised
        return None, f"your function raised {type(exc).__name__}: {exc}"
    if any(g is None for g in got):
        return None, f"your function returns None; return {returns}"
    return got, ""
