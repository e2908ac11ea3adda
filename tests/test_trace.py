"""The committed request traces: shape, lengths, determinism of the generator."""
import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

from llmlab.traces import TRACES_DIR, load_trace, trace_names

ROOT = Path(__file__).resolve().parents[1]


def _make_trace_module():
    spec = importlib.util.spec_from_file_location("make_trace", ROOT / "data" / "make_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_trace"] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_traces_exist_and_are_small():
    assert {"sharegpt_like", "alpaca_like", "cpu"} <= set(trace_names())
    total = sum(p.stat().st_size for p in TRACES_DIR.glob("*.jsonl"))
    assert total < 1_000_000


@pytest.mark.parametrize("name,n,lo_in,hi_in,lo_out,hi_out,mean_in,mean_out", [
    ("sharegpt_like", 300, 4, 1024, 4, 1024, 161.31, 337.99),
    ("alpaca_like", 300, 4, 256, 4, 512, 19.31, 58.45),
    ("cpu", 80, 16, 256, 8, 128, 64, 40),
])
def test_trace_lengths_follow_their_spec(name, n, lo_in, hi_in, lo_out, hi_out, mean_in, mean_out):
    reqs = load_trace(name)
    assert len(reqs) == n
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert all(lo_out <= r.output_tokens <= hi_out for r in reqs)
    assert all(lo_in - 4 <= r.prompt_tokens <= hi_in + 4 for r in reqs)
    assert abs(sum(r.prompt_tokens for r in reqs) / n / mean_in - 1) < 0.1
    assert abs(sum(r.output_tokens for r in reqs) / n / mean_out - 1) < 0.1
    assert len({r.prompt_tokens for r in reqs}) > 20           # varied lengths


def test_prompts_are_text_of_the_stated_token_count(tokenizer):
    for name in trace_names():
        for r in random.Random(0).sample(load_trace(name), 10):
            assert len(tokenizer(r.prompt)["input_ids"]) == r.prompt_tokens
            # chat traces hold the template's markup around the text (data/make_prefix_traces.py)
            assert (r.prompt[0].isupper() or r.prompt.startswith("<|im_")) and " " in r.prompt


def test_generator_is_deterministic(tokenizer, monkeypatch):
    mt = _make_trace_module()
    monkeypatch.setattr(mt, "fit_mu", lambda mean, sigma, lo, hi: math.log(mean))  # fast
    spec = mt.Spec("t", 5, 2.0, 30.0, (4, 64), 0.5, 20.0, (4, 64), 0.5, seed=3)
    writer = mt.PromptWriter(tokenizer)
    a, b = mt.make(spec, writer), mt.make(spec, writer)
    assert a == b and len(a) == 5
    assert all(abs(r["prompt_tokens"] - r["target_prompt_tokens"]) <= 4 for r in a)


def test_one_loader_by_name_or_path_with_scaling_and_tokens(tokenizer):
    from llmlab.bench import serve
    from llmlab.cache import waste

    assert waste.load_trace is load_trace and serve.load_trace is load_trace
    by_name = load_trace("cpu", 5)
    by_path = load_trace(TRACES_DIR / "cpu.jsonl", 5, tokenizer=tokenizer)
    assert by_name == by_path and len(by_name) == 5      # token ids are not compared
    assert by_name[0].prompt_token_ids is None
    assert by_path[0].prompt_token_ids == tokenizer(by_path[0].prompt,
                                                    add_special_tokens=False)["input_ids"]
    scaled = load_trace("cpu", 5, output_scale=0.25, max_output=10)
    for full, small in zip(by_name, scaled):
        assert small.output_tokens == min(10, max(1, round(full.output_tokens * 0.25)))
        assert small.prompt_tokens == full.prompt_tokens and small.id == full.id
    assert max(r.output_tokens for r in by_name) > 10     # the cap really applied


def test_bad_trace_arguments():
    with pytest.raises(ValueError, match=r"unknown trace 'nope'; allowed: \[.*'cpu'"):
        load_trace("nope")
    with pytest.raises(ValueError, match="limit=0 must be an int >= 1"):
        load_trace("cpu", 0)
    with pytest.raises(ValueError, match="output_scale=0 must be > 0"):
        load_trace("cpu", output_scale=0)
    with pytest.raises(ValueError, match="max_output=0 must be >= 1"):
        load_trace("cpu", max_output=0)
