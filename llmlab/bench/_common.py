"""Helpers shared by the benchmarks: a header naming the device, and table printing."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..device import describe


def header(title: str) -> None:
    info = describe()
    print(f"== {title} ==")
    print("   " + "; ".join(f"{k}: {v}" for k, v in info.items()))


def table(rows: list[dict], floatfmt: str = "{:.4g}") -> None:
    """Print rows (dicts; a key some rows lack is blank in them) as an aligned text table."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[k for k in keys]] + [[floatfmt.format(r[k]) if isinstance(r.get(k), float)
                                    else str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def save(name: str, payload: dict) -> Path | None:
    """Write results as JSON under $LLMLAB_RESULTS (if set), for `make gpu-check`."""
    out = os.environ.get("LLMLAB_RESULTS")
    if not out:
        return None
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": describe(), **payload}, indent=1, default=str))
    return path


def timed_parser(name: str, doc: str, quick: str, repeats: int, new_tokens: int,
                 argv: list[str], add=None, min_repeats: int = 1):
    """The options every generation benchmark shares (``--quick``, ``--repeats`` (median),
    ``--new-tokens``, ``--threads``, ``--gpu``) plus those ``add(parser)`` adds; parsed and
    checked (``--repeats`` at least ``min_repeats``, before anything is built). ``--threads``
    is applied to torch here. None (after saying so) for ``--gpu`` on a machine without
    CUDA: ``make gpu-check`` passes ``--gpu`` to every benchmark."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog=f"python -m llmlab.bench {name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--repeats", type=int, default=repeats,
                    help=f"median of this many runs (default {repeats})")
    ap.add_argument("--new-tokens", type=int, default=new_tokens,
                    help=f"tokens generated per run (default {new_tokens})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--gpu", action="store_true", help="run on CUDA (needs a GPU)")
    if add is not None:
        add(ap)
    args = ap.parse_args(argv)
    if args.repeats < min_repeats or args.new_tokens < 2:
        raise ValueError(f"--repeats={args.repeats} must be >= {min_repeats} and --new-tokens="
                         f"{args.new_tokens} >= 2")
    if args.gpu and not torch.cuda.is_available():
        print(f"{name} --gpu needs CUDA; nothing to do on this machine")
        return None
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
