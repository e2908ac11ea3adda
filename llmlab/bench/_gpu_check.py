"""``make gpu-check``: everything that needs a CUDA GPU, in one command that fails when any
part fails, with its results written under ``results/gpu/``.

    python -m llmlab.bench._gpu_check [--out results/gpu] [--budget 480] [--skip notebooks]

Steps, in order: the ``gpu``-marked tests, every benchmark's ``--gpu`` mode, and every
notebook through nbval (on CUDA, as the notebooks choose the GPU where there is one).
Each step's output goes to the terminal and to ``<out>/<step>.txt``; benchmarks also save
their JSON there (``LLMLAB_RESULTS``). ``<out>/summary.json`` records the machine, the
date, the versions and each step's exit status and time. The exit status is 0 only when
every step passed within the time budget (seconds, for all steps together): a step that
runs out of time, and the steps never reached, count as failures.
"""
from __future__ import annotations

import argparse
import codecs
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STEPS = ("tests", "benchmarks", "notebooks")


@dataclass
class Step:
    name: str              # also the log file's name: <out>/<name>.txt
    argv: list[str]


@dataclass
class StepResult:
    name: str
    command: str
    returncode: int | None     # None: not run (out of time)
    seconds: float
    log: str
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def default_steps(skip: tuple[str, ...] = ()) -> list[Step]:
    """The GPU tests, each benchmark's --gpu mode, then every notebook through nbval."""
    from .__main__ import names

    py = sys.executable
    steps = []
    if "tests" not in skip:
        steps.append(Step("tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "tests"]))
    if "benchmarks" not in skip:
        steps += [Step(f"bench_{n}", [py, "-m", "llmlab.bench", n, "--gpu"]) for n in names()]
    if "notebooks" not in skip:
        steps.append(Step("notebooks", [py, "-m", "pytest", "-q", "-rfE", "notebooks"]))
    return steps


def _tee(step: Step, log: Path, timeout: float, env: dict) -> tuple[int | None, bool]:
    """Run one step, copying its output to the terminal and to ``log``; past ``timeout``
    seconds its whole process group (notebook kernels included) is killed."""
    with open(log, "wb") as f:
        f.write(("$ " + " ".join(step.argv) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        assert proc.stdout is not None

        def copy():
            text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
                sys.stdout.write(text.decode(chunk))
                sys.stdout.flush()
                f.write(chunk)

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        reader.join(timeout=10)
        if timed_out:
            msg = f"\n[gpu-check] {step.name}: killed after {timeout:.0f} s (out of time)\n"
            sys.stdout.write(msg)
            f.write(msg.encode())
    return rc, timed_out


def run_steps(steps: list[Step], out: Path, budget: float) -> list[StepResult]:
    """Run ``steps`` in order within ``budget`` seconds in all; log each to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LLMLAB_RESULTS": str(out)}
    start = time.monotonic()
    results = []
    for step in steps:
        log = out / f"{step.name}.txt"
        left = budget - (time.monotonic() - start)
        if left <= 1:
            log.write_text(f"[gpu-check] {step.name}: not run, the {budget:.0f} s budget "
                           "was spent\n")
            results.append(StepResult(step.name, " ".join(step.argv), None, 0.0, str(log), True))
            continue
        print(f"\n[gpu-check] == {step.name} ({left:.0f} s left) ==", flush=True)
        t0 = time.monotonic()
        rc, timed_out = _tee(step, log, left, env)
        results.append(StepResult(step.name, " ".join(step.argv), rc,
                                  round(time.monotonic() - t0, 1), str(log), timed_out))
    return results


def machine() -> dict:
    """The machine, date and versions, for the summary."""
    info: dict = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "host": platform.node(), "platform": platform.platform(),
                  "python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    try:
        import torch
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2 ** 30, 1)
            info["compute_capability"] = f"{props.major}.{props.minor}"
    except ImportError:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["git_commit"] = None
    return info


def write_summary(out: Path, results: list[StepResult], budget: float) -> Path:
    path = out / "summary.json"
    payload = {"machine": machine(), "budget_s": budget,
               "passed": all(r.passed for r in results),
               "steps": [{**asdict(r), "passed": r.passed} for r in results]}
    path.write_text(json.dumps(payload, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.bench._gpu_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/gpu", help="where logs and summary.json go")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    p.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps to leave out")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU; none here. On this machine run `make test` (which "
              "also builds every kernel for sm_80/sm_90) or `make gpu-compile`.", file=sys.stderr)
        return 2
    out = Path(args.out)
    results = run_steps(default_steps(tuple(args.skip)), out, args.budget)
    summary = write_summary(out, results, args.budget)
    print("\n[gpu-check] summary:")
    for r in results:
        state = "passed" if r.passed else \
            ("out of time" if r.timed_out else f"FAILED (rc {r.returncode})")
        print(f"  {r.name:<20} {state:<16} {r.seconds:7.1f} s   {r.log}")
    print(f"  written: {summary}")
    return exit_code(results)


def exit_code(results: list[StepResult]) -> int:
    """0 when every step passed in time, else 1."""
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
