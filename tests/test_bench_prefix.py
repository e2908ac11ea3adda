"""bench prefix on tiny-llama: the table of every engine, measured in one run (slow: it
serves the multi-turn trace five times)."""
import pytest


@pytest.mark.slow
def test_bench_prefix_prints_every_engine(capsys):
    from llmlab.bench import prefix

    assert prefix.main(["--quick", "--model", "tiny-llama", "--trace", "multiturn_chat",
                        "--time-scale", "0.02"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "hash", "radix", "hash+cache-aware", "radix+cache-aware"):
        assert f"\n{name.rjust(17)}  " in out
    assert "same greedy tokens in every run: True" in out
    assert "TTFT p90" in out and "of the no-cache prompt tokens" in out
    with pytest.raises(ValueError, match="--repeats=0 must be >= 1"):
        prefix.main(["--repeats", "0"])
