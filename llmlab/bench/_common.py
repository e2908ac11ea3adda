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
    """Print rows (dicts with the same keys) as an aligned text table."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[k for k in keys]] + [[floatfmt.format(r[k]) if isinstance(r[k], float) else str(r[k])
                                    for k in keys] for r in rows]
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
