"""``make gpu-check``'s runner: it fails when any step fails or runs out of time, and
records the machine, date and versions (the steps themselves need CUDA; the runner not)."""
import json
import sys

import pytest
import torch

from llmlab.bench import _gpu_check as G


def step(name, code):
    return G.Step(name, [sys.executable, "-c", code])


def test_a_failing_step_fails_the_check_and_every_step_is_logged(tmp_path):
    steps = [step("ok", "print('all good')"),
             step("broken", "import sys; print('boom'); sys.exit(3)"),
             step("after", "print('still run')")]
    results = G.run_steps(steps, tmp_path, budget=120)
    assert [r.returncode for r in results] == [0, 3, 0]
    assert [r.passed for r in results] == [True, False, True]
    assert G.exit_code(results) == 1
    assert G.exit_code(results[:1]) == 0 and G.exit_code([]) == 1
    assert "all good" in (tmp_path / "ok.txt").read_text()
    assert "boom" in (tmp_path / "broken.txt").read_text()
    summary = json.loads(G.write_summary(tmp_path, results, 120).read_text())
    assert summary["passed"] is False
    assert [s["passed"] for s in summary["steps"]] == [True, False, True]
    for key in ("date", "python", "torch", "triton", "platform"):
        assert summary["machine"][key], key
    assert summary["machine"]["torch"] == torch.__version__


@pytest.mark.slow
def test_the_time_budget_is_enforced(tmp_path):
    steps = [step("slow", "import time; print('started', flush=True); time.sleep(60)"),
             step("never", "print('unreachable')")]
    results = G.run_steps(steps, tmp_path, budget=3)
    assert results[0].timed_out and not results[0].passed and results[0].seconds < 30
    assert "started" in (tmp_path / "slow.txt").read_text()
    assert results[1].returncode is None and not results[1].passed
    assert "not run" in (tmp_path / "never.txt").read_text()
    assert G.exit_code(results) == 1


def test_the_default_steps_cover_tests_benchmarks_and_notebooks():
    from llmlab.bench.__main__ import names

    steps = G.default_steps()
    assert [s.name for s in steps] == ["tests"] + [f"bench_{n}" for n in names()] + ["notebooks"]
    assert all("--gpu" in s.argv for s in steps if s.name.startswith("bench_"))
    assert "-m" in steps[0].argv and "gpu" in steps[0].argv
    assert [s.name for s in G.default_steps(("notebooks", "benchmarks"))] == ["tests"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_fails(tmp_path, capsys):
    assert G.main(["--out", str(tmp_path / "gpu")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer to --gpu")
def test_every_benchmark_accepts_gpu_and_says_it_needs_cuda(capsys):
    """``make gpu-check`` passes --gpu to every benchmark: none may refuse the option.

    In this process through the same ``main`` that ``python -m llmlab.bench`` calls (one
    child process per benchmark spent 40 s importing torch twelve times); one benchmark
    goes through the real command line as well."""
    import subprocess

    from llmlab.bench.__main__ import main, names

    for name in names():
        try:
            code = main([name, "--gpu"])
        except SystemExit as e:            # argparse refusing the option exits
            code = e.code
        out, err = capsys.readouterr()
        assert code == 0, f"{name}: {err[-2000:]}"
        assert "CUDA" in out, f"{name} --gpu printed: {out[-500:]}"
    res = subprocess.run([sys.executable, "-m", "llmlab.bench", names()[0], "--gpu"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "CUDA" in res.stdout, res.stderr[-2000:]
