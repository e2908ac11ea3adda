"""The helpers behind notebooks 00, 01 and 02: step timings, profiling by operator and by
part, the attention cost, and their figures."""
import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import llmlab  # noqa: E402
from llmlab.profiling.breakdown import profile_by_operator, time_by_part  # noqa: E402
from llmlab.viz import baseline, tour  # noqa: E402


def test_time_by_part_covers_the_forward_pass():
    model = llmlab.load_model("tiny-llama")
    ids = torch.randint(0, 1000, (1, 32))
    parts = time_by_part(model, ids)
    assert {"attention", "mlp", "lm_head", "norms", "embed_tokens", "other"} <= set(parts)
    assert all(v >= 0 for v in parts.values()) and parts["attention"] > 0
    assert not model.layers[0].self_attn._forward_hooks  # hooks removed afterwards


def test_profile_by_operator_finds_matmuls():
    model = llmlab.load_model("tiny-llama")
    ids = torch.randint(0, 1000, (1, 16))
    with torch.inference_mode():
        rows = profile_by_operator(lambda: model(ids), row_limit=50)
    names = {r.name for r in rows}
    assert names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "aten::linear"}
    assert rows == sorted(rows, key=lambda r: r.self_ms, reverse=True)


def test_attention_cost_sees_the_n_squared_matrix():
    small = baseline.attention_cost(64, repeats=2)
    big = baseline.attention_cost(256, repeats=2)
    assert big["score_bytes"] == 16 * small["score_bytes"]
    assert big["peak_bytes"] >= big["score_bytes"]  # naive materializes [1, 9, N, N]
    assert len(big["times_s"]) == 2
    assert min(big["times_s"]) <= big["seconds"] <= max(big["times_s"])
    sd = baseline.attention_cost(256, backend="sdpa", repeats=1)
    assert sd["peak_bytes"] < big["peak_bytes"]
    fig = baseline.plot_attention_cost([small, big, sd])
    assert len(fig.axes) == 2
    fig, r = baseline.explore_attention(128, "sdpa")
    assert r["n"] == 128 and fig.axes
    with pytest.raises(ValueError, match="backend='nope'"):
        baseline.explore_attention(128, "nope")
    with pytest.raises(ValueError, match="repeats=0"):
        baseline.attention_cost(64, repeats=0)


def test_step_times_with_and_without_a_cache():
    model = llmlab.load_model("tiny-llama")
    no_cache = baseline.forward_step_times(model, [4, 16], repeats=3)
    cached = baseline.cached_step_times(model, [4, 16], repeats=3, batch=2)
    for rows, label in ((no_cache, "no cache"), (cached, "KV cache")):
        assert [r.n for r in rows] == [4, 16] and rows[0].label == label
        for r in rows:
            assert len(r.times_s) == 3 and r.lo_s <= r.median_s <= r.hi_s
    ax = baseline.plot_step_times([no_cache, cached])
    assert len(ax.collections) == 2          # one min-max band per series
    with pytest.raises(ValueError, match="length 1 must be an int in 2"):
        baseline.cached_step_times(model, [1])
    with pytest.raises(ValueError, match="batch=0"):
        baseline.forward_step_times(model, [4], batch=0)


def test_generation_totals_add_up_the_steps():
    steps = [baseline.Timing(n, [n * 1e-3] * 5) for n in (4, 8, 16)]   # 1 ms per token
    tot = baseline.generation_totals(steps, prompt_len=4, new_tokens=5, cached=False)
    assert tot.tolist() == pytest.approx(np.cumsum([4e-3, 5e-3, 6e-3, 7e-3, 8e-3]).tolist())
    flat = [baseline.Timing(n, [2e-3] * 5) for n in (4, 16)]
    tot = baseline.generation_totals(flat, 4, 5, cached=True, prefill=baseline.Timing(4, [9e-3]))
    assert tot.tolist() == pytest.approx([9e-3, 11e-3, 13e-3, 15e-3, 17e-3])
    with pytest.raises(ValueError, match="measured for 4..16"):
        baseline.generation_totals(steps, 4, 20, cached=False)
    with pytest.raises(ValueError, match="prefill"):
        baseline.generation_totals(flat, 4, 5, cached=True)
    assert baseline.fit_exponent([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert baseline.fit_line([0, 1, 2], [1, 3, 5]) == pytest.approx((1.0, 2.0))
    ax = baseline.plot_generation_totals(np.arange(1, 6), {"no cache": tot}, {"no cache": tot})
    assert len(ax.figure.axes) == 2          # the token-pass axis on the right


def test_operator_medians_and_parts_by_length():
    model = llmlab.load_model("tiny-llama")
    ids = torch.randint(0, 1000, (1, 16))
    with torch.inference_mode():
        ops = baseline.operator_medians(lambda: model(ids), repeats=3, row_limit=4)
    assert len(ops) == 4 and ops == sorted(ops, key=lambda r: r["median_ms"], reverse=True)
    assert all(r["lo_ms"] <= r["median_ms"] <= r["hi_ms"] and r["calls"] >= 1 for r in ops)
    parts = baseline.parts_by_length(model, [8, 32], repeats=3)
    assert set(parts) == {8, 32} and len(parts[8]["_totals"]) == 3
    assert set(baseline.PARTS) <= set(parts[32])
    fig = baseline.plot_parts(parts)
    assert len(fig.axes) == 2


def test_profile_writes_nothing_to_stderr(capfd):
    model = llmlab.load_model("tiny-llama")
    ids = torch.randint(0, 1000, (1, 8))
    with torch.inference_mode():
        profile_by_operator(lambda: model(ids), row_limit=3)
    assert capfd.readouterr().err == ""


def test_next_token_distribution(smollm2, tokenizer):
    fig, top = tour.next_token_distribution(smollm2, tokenizer, "What is the capital of France?",
                                            temperature=0.0, show=5)
    assert top[0][1] == 1.0 and sum(p for _, p in top) == 1.0
    fig, top = tour.next_token_distribution(smollm2, tokenizer, "What is the capital of France?",
                                            temperature=1.0, top_k=3, show=5)
    assert [p for _, p in top][3:] == [0.0, 0.0] and abs(sum(p for _, p in top) - 1) < 1e-5


def test_colour_prompt_leads_with_colours(smollm2, tokenizer):
    from llmlab.exercises.nb00 import COLOUR_PROMPT

    _, top = tour.next_token_distribution(smollm2, tokenizer, COLOUR_PROMPT, 1.0, show=5,
                                          chat=False)
    colours = ("blue", "crim", "gold", "pink", "orange", "red", "green", "purple")
    assert sum(any(c in t for c in colours) for t, _ in top) >= 4, top
