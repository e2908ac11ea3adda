"""How nbval compares a notebook's printed errors: against a tolerance, not as text.

Cells tagged ``nbval-check-output`` (written ``# NBVAL_CHECK_OUTPUT`` in the source;
``build.py`` turns the comment into the tag) print parity errors (``max |Δ| 3.1e-07``) whose last
digits depend on the machine. Instead of rewriting every such number to one token (which
would also accept an error that grew from 1e-7 to 0.5), each small number a cell prints,
``d.ddde-XX`` or ``0.0e+00``, is compared with the number at the same place in the
committed output: the new value passes when it is at most ``RATIO`` times the committed
one, or below ``FLOOR``. A larger value is left as printed, so the cell fails and the
diff shows both numbers. Everything else is compared by nbval as usual (after
``sanitize.cfg``'s rewrites of addresses and timings).
"""
from __future__ import annotations

import copy
import os
import re

RATIO = 10.0   # a machine's round-off may differ by a few times, not by ten
# below this a float32 logit difference is round-off: an error printed as 0.0e+00 on one
# machine (or thread count) reads 4.4e-05 on another, where a matmul sums in another order
FLOOR = 1e-4
SMALL_NUMBER = re.compile(r"\b\d(?:\.\d+)?e-\d+\b|\b0(?:\.0+)?e\+00\b")


def within_tolerance(new: float, committed: float) -> bool:
    return new <= max(RATIO * committed, FLOOR)


def align_small_numbers(new_text: str, committed_text: str) -> str:
    """``new_text`` with each small number that is within tolerance of the committed
    number at the same place replaced by the committed text (so the texts compare
    equal there); numbers out of tolerance, or texts with a different count of small
    numbers, are left as they are."""
    new = list(SMALL_NUMBER.finditer(new_text))
    old = list(SMALL_NUMBER.finditer(committed_text))
    if not new or len(new) != len(old):
        return new_text
    out, pos = [], 0
    for n, o in zip(new, old):
        keep = o.group() if within_tolerance(float(n.group()), float(o.group())) else n.group()
        out += [new_text[pos:n.start()], keep]
        pos = n.end()
    return "".join(out) + new_text[pos:]


def _texts(output) -> list[tuple[object, str]]:
    """(container, key) of every text field of one output that may hold numbers."""
    if output.get("output_type") == "stream":
        return [(output, "text")]
    data = output.get("data") or {}
    return [(data, k) for k in ("text/plain", "text/html", "text/markdown") if k in data]


def align_outputs(test: list, ref: list) -> list:
    """A copy of the cell's new outputs with small numbers aligned to the committed ones."""
    if len(test) != len(ref):
        return test
    test = copy.deepcopy(test)
    for t, r in zip(test, ref):
        if t.get("output_type") != r.get("output_type"):
            continue
        for (tc, key), (rc, rkey) in zip(_texts(t), _texts(r)):
            if key == rkey and isinstance(tc[key], str) and isinstance(rc[rkey], str):
                tc[key] = align_small_numbers(tc[key], rc[rkey])
    return test


def _install() -> None:
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:                      # nbval not installed: nothing to compare
        return
    if getattr(IPyNbCell.compare_outputs, "_llmlab_tolerance", False):
        return
    original = IPyNbCell.compare_outputs

    def compare_outputs(self, test, ref, skip_compare=None):
        return original(self, align_outputs(test, ref), ref, skip_compare)

    compare_outputs._llmlab_tolerance = True
    IPyNbCell.compare_outputs = compare_outputs


_install()

# What a notebook's run was meant to show (llmlab.profiling.expect) is a check here: a
# student's run prints a note when a lesson is not resolved, a tested run fails. The
# notebook kernels inherit this environment.
os.environ.setdefault("LLMLAB_STRICT_LESSONS", "1")

# In a parallel run each worker's notebook kernels get its share of the cores
# (OMP_NUM_THREADS, which the kernels inherit). All cells of one notebook run on one
# worker, in order, in one kernel: `make test` distributes whole files (`--dist loadfile`).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    import llmlab.device

    llmlab.device.share_cores(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
