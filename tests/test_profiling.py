import time

import pytest
import torch

import llmlab.attention as A
from llmlab.config import ModelConfig
from llmlab.profiling.flops import attention_pairs
from llmlab.profiling import (RequestMetrics, Timer, attention_flops, linear_bytes, linear_flops,
                              model_flops_per_token, peak_memory, summarize, time_fn, weight_bytes)


def test_timer_measures_wall_time():
    with Timer("cpu") as t:
        time.sleep(0.05)
    assert 0.045 < t.seconds < 0.5
    r = time_fn(lambda: time.sleep(0.01), repeats=3)
    assert len(r.times_s) == 3 and r.median_s >= 0.009
    with pytest.raises(ValueError, match="repeats=0"):
        time_fn(lambda: None, repeats=0)


def test_time_interleaved_runs_each_function_in_turn():
    from llmlab.profiling import time_interleaved
    calls = []
    res = time_interleaved({"a": lambda: calls.append("a"),
                            "b": lambda: (calls.append("b"), time.sleep(0.01))}, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3             # warm-ups, then rounds
    assert len(res["a"].times_s) == len(res["b"].times_s) == 3
    assert res["b"].median_s >= 0.009 > res["a"].median_s
    with pytest.raises(ValueError, match="repeats=0"):
        time_interleaved({"a": lambda: None}, repeats=0)


def test_peak_memory_sees_a_temporary():
    n = 1024

    def work():
        big = torch.ones(n, n)          # 4 MiB, freed before returning
        return big.sum()

    r = peak_memory(work, "cpu")
    assert n * n * 4 <= r.peak_bytes < 3 * n * n * 4
    assert float(r.result) == n * n


def test_naive_attention_peak_grows_with_scores():
    q = torch.randn(1, 512, 4, 16)
    r = peak_memory(lambda: A.naive_attention(q, q, q), "cpu")
    assert r.peak_bytes >= 4 * 512 * 512 * 4  # at least one [1, 4, N, N] float32 matrix


def test_flop_and_byte_counters():
    assert linear_flops(3, 4, 5) == 2 * 3 * 4 * 5
    assert linear_bytes(1, 10, 20, 2) == 2 * (200 + 10 + 20)
    assert attention_flops(1, 1, 8, 8, 4) == 4 * 64 * 4
    assert attention_flops(1, 1, 8, 8, 4, causal=True) == 4 * 4 * 8 * 9 // 2
    # the count equals the real matmuls' multiply-adds
    q = torch.randn(1, 1, 8, 4)
    macs = q.shape[2] * q.shape[2] * q.shape[3] * 2  # QKᵀ and PV
    assert attention_flops(1, 1, 8, 8, 4) == 2 * macs


@pytest.mark.parametrize("q_len,kv_len", [(8, 8), (3, 8), (1, 8), (8, 3), (5, 0)])
def test_causal_pairs_are_the_unmasked_entries_of_the_bottom_right_mask(q_len, kv_len):
    # query i sees keys j <= i + kv_len - q_len (the last query sees every key)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    assert attention_pairs(q_len, kv_len, causal=True) == int(allowed.sum())
    assert attention_pairs(q_len, kv_len) == q_len * kv_len
    assert attention_flops(2, 3, q_len, kv_len, 4, causal=True) == 4 * 2 * 3 * 4 * int(allowed.sum())


def test_prefill_and_continued_prefill_agree_on_attention_work():
    # a prompt of 8 in one pass = 3 tokens, then 5 more over the 3 cached: same pairs
    whole = attention_pairs(8, 8, causal=True)
    assert whole == attention_pairs(3, 3, causal=True) + attention_pairs(5, 8, causal=True)
    assert whole == 8 * 9 // 2 > 8 * 8 // 2       # the diagonal is counted
    with pytest.raises(ValueError, match="q_len=-1"):
        attention_pairs(-1, 4)


def test_model_counters_on_smollm2_config():
    c = ModelConfig.from_file("data/models/smollm2-135m/config.json")
    assert weight_bytes(c, 4) == 4 * c.num_parameters()
    f = model_flops_per_token(c, context=0)
    assert abs(f - 2 * c.num_parameters()) / f < 0.01  # ≈ 2 FLOPs per parameter


def test_request_metrics():
    m = RequestMetrics(prompt_tokens=10, output_tokens=5, ttft_s=0.2, e2e_s=1.0)
    assert m.tpot_s == pytest.approx(0.2) and m.tokens_per_s == pytest.approx(5.0)
    s = summarize([m, RequestMetrics(3, 1, 0.1, 0.1)], wall_s=2.0)
    assert s["tokens_per_s"] == 3.0 and s["ttft_mean_s"] == pytest.approx(0.15)


def test_summary_percentiles_and_the_worst_stall_between_tokens():
    ms = [RequestMetrics(4, 3, 0.01 * (i + 1), 0.5, max_gap_s=0.02 * (i + 1)) for i in range(100)]
    s = summarize(ms)
    assert s["ttft_p50_s"] == pytest.approx(0.50, abs=0.011)
    assert s["ttft_p99_s"] == pytest.approx(0.99, abs=0.011) and s["stall_max_s"] == pytest.approx(2.0)
    assert s["tpot_p99_s"] >= s["tpot_p50_s"]


def test_a_sequences_worst_stall_is_its_longest_gap_between_tokens():
    from llmlab.engine.sequence import Request, SamplingParams, Sequence

    req = Request(0, None, [1, 2], SamplingParams(max_tokens=4), arrival_time=0.0)
    seq = Sequence(0, req, 0, [1, 2])
    seq.output_token_ids, seq.token_times = [5, 6, 7, 8], [0.1, 0.2, 0.7, 0.75]
    m = seq.metrics()
    assert m.max_gap_s == pytest.approx(0.5) and m.ttft_s == pytest.approx(0.1)
