"""python -m llmlab.models fetch NAME [NAME ...] [--force] | list"""
from __future__ import annotations

import argparse
import sys
import time

from . import registry
from .fetch import FetchError, fetch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download/convert or generate models")
    f.add_argument("names", nargs="+", choices=list(registry.MODELS))
    f.add_argument("--force", action="store_true", help="redo even if present and verified")
    sub.add_parser("list", help="list known models")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for spec in registry.MODELS.values():
            print(f"{spec.name:18s} {spec.description}")
        return 0
    for name in args.names:
        t = time.perf_counter()
        try:
            d = fetch(name, force=args.force)
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{name}: ready in {d} ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
