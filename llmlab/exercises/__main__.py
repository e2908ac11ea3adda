"""``python -m llmlab.exercises [--solutions] [--only nb03]``: list or self-check the exercises.

With ``--solutions`` every exercise is checked three ways: its reference solution must pass,
its placeholder (what the shipped notebook holds) must get "not yet", and each known wrong
variant must fail with a message that names the mistake. Exits non-zero if any of that fails.
"""
from __future__ import annotations

import argparse
import sys
import time

from . import get, names


def self_check(name: str, solution: bool = True) -> list[str]:
    """The problems found in exercise ``name``'s checker (empty when all is well).

    ``solution=False`` leaves out the run of the reference solution (the placeholder and the
    wrong variants are still checked)."""
    ex = get(name)
    problems = []
    verdict = ex.check(ex.solution) if solution else None
    if verdict is not None and not verdict.passed:
        problems.append(f"the reference solution fails: {verdict.message}")
    verdict = ex.check(ex.placeholder)
    if verdict.passed or "not yet" not in str(verdict):
        problems.append(f"the placeholder is not told 'not yet': {verdict}")
    for label, (answer, words) in ex.wrong_variants.items():
        verdict = ex.check(answer)
        missing = [w for w in words if w.lower() not in verdict.message.lower()]
        if verdict.passed:
            problems.append(f"wrong variant '{label}' passes")
        elif missing:
            problems.append(f"wrong variant '{label}': message lacks {missing}: {verdict.message}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.exercises", description=__doc__.split("\n")[0])
    ap.add_argument("--solutions", action="store_true",
                    help="check each solution, placeholder and wrong variant")
    ap.add_argument("--only", default=None, help="one notebook, e.g. 03 or nb03")
    args = ap.parse_args(argv)
    todo = names(args.only)
    if not args.solutions:
        for name in todo:
            ex = get(name)
            tag = " (stretch)" if ex.stretch and "stretch" not in ex.title.lower() else ""
            print(f"{name:34s} {ex.kind:8s} {ex.notebook:32s} {ex.title}{tag}")
        print(f"{len(todo)} exercises")
        return 0
    failed = 0
    for name in todo:
        t = time.perf_counter()
        problems = self_check(name)
        n_wrong = len(get(name).wrong_variants)
        status = "ok  " if not problems else "FAIL"
        print(f"{status} {name:34s} solution, placeholder, {n_wrong} wrong variants "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
        for p in problems:
            print(f"     {p}")
        failed += bool(problems)
    print(f"{len(todo) - failed}/{len(todo)} exercises check out")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
