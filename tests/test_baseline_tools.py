"""The helpers behind notebooks 00 and 01: profiling by part, figures, exercise checks."""
import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

import llmlab  # noqa: E402
from llmlab.exercises import nb01  # noqa: E402
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
    small = baseline.attention_cost(64, repeats=1)
    big = baseline.attention_cost(256, repeats=1)
    assert big["score_bytes"] == 16 * small["score_bytes"]
    assert big["peak_bytes"] >= big["score_bytes"]  # naive materializes [1, 9, N, N]
    sd = baseline.attention_cost(256, backend="sdpa", repeats=1)
    assert sd["peak_bytes"] < big["peak_bytes"]
    fig = baseline.plot_attention_cost([small, big, sd])
    assert len(fig.axes) == 2
    fig, r = baseline.explore_attention(128, "sdpa")
    assert r["n"] == 128 and fig.axes


def test_next_token_distribution(smollm2, tokenizer):
    fig, top = tour.next_token_distribution(smollm2, tokenizer, "What is the capital of France?",
                                            temperature=0.0, show=5)
    assert top[0][1] == 1.0 and sum(p for _, p in top) == 1.0
    fig, top = tour.next_token_distribution(smollm2, tokenizer, "What is the capital of France?",
                                            temperature=1.0, top_k=3, show=5)
    assert [p for _, p in top][3:] == [0.0, 0.0] and abs(sum(p for _, p in top) - 1) < 1e-5


def test_exercise_checks_accept_right_and_reject_wrong(capsys):
    assert nb01.check_token_passes(sum(30 + t for t in range(100)), 30, 100)
    assert not nb01.check_token_passes(129, 30, 100)
    assert not nb01.check_token_passes(..., 30, 100)
    assert nb01.check_score_bytes(9 * 8192 * 8192 * 4, 8192, 9)
    assert not nb01.check_score_bytes(8192 * 8192 * 4, 8192, 9)
    assert nb01.check_temperature(lambda x, t: torch.softmax(x / t, -1))
    assert not nb01.check_temperature(lambda x, t: torch.softmax(x * t, -1))
    assert not nb01.check_temperature(lambda x, t: None)
    out = capsys.readouterr().out
    assert "right" in out and "not yet" in out
