"""python -m llmlab.bench <name> [options]: run one benchmark; ``list`` shows them.

Each benchmark is a module ``llmlab.bench.<name>`` with ``main(argv) -> int``. They
print measured numbers (with the device named) and ratios measured in the same run;
they are not tests.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import llmlab.bench as pkg


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print("usage: python -m llmlab.bench <name> [options]\nbenchmarks: " + ", ".join(names()))
        return 0
    name, rest = argv[0].replace("-", "_"), argv[1:]    # serve-http runs serve_http
    if name not in names():
        print(f"unknown benchmark {name!r}; allowed: {names()}", file=sys.stderr)
        return 2
    return importlib.import_module(f"llmlab.bench.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
