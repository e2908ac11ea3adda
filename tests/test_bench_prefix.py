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


def test_engines_pick_a_subset_with_none_first():
    from llmlab.bench.prefix import pick_engines

    assert [e[0] for e in pick_engines("radix+cache-aware,hash")] == \
        ["none", "hash", "radix+cache-aware"]
    assert len(pick_engines(None)) == 5
    with pytest.raises(ValueError, match="'radixx'.*allowed: none, hash"):
        pick_engines("radixx")


@pytest.mark.slow
def test_bench_prefix_runs_the_long_trace_on_a_subset(capsys):
    from llmlab.bench import prefix

    assert prefix.main(["--quick", "--model", "tiny-llama", "--trace", "multiturn_long",
                        "--engines", "hash,radix+cache-aware", "--time-scale", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "\n             hash  " in out and "\n            radix  " not in out
    assert "same greedy tokens in every run: True" in out and "TTFT p90" in out
