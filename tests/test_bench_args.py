"""Benchmark options are checked before anything is built or timed."""
import pytest

from llmlab.bench import overhead
from llmlab.bench._common import timed_parser


def test_overhead_refuses_fewer_than_five_repeats_at_once():
    # step_breakdown takes a median of five or more: refused before any model is loaded
    with pytest.raises(ValueError, match="--repeats=3 must be >= 5"):
        overhead.main(["--repeats", "3"])


def test_timed_parser_checks_repeats_and_new_tokens():
    args = timed_parser("x", "doc", "quick", 5, 64, ["--repeats", "2"])
    assert args.repeats == 2 and args.new_tokens == 64
    with pytest.raises(ValueError, match="--repeats=0 must be >= 1"):
        timed_parser("x", "doc", "quick", 5, 64, ["--repeats", "0"])
    with pytest.raises(ValueError, match="--new-tokens=1 >= 2"):
        timed_parser("x", "doc", "quick", 5, 64, ["--new-tokens", "1"])
