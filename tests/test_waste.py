"""The KV-memory waste study: hand-checked small cases and the targets on the trace."""
import pytest

from llmlab.cache.waste import (TraceRequest, beam_search_memory, block_size_sweep, load_trace,
                                parallel_sampling_memory, simulate)


def test_single_request_accounting_by_hand():
    req = [TraceRequest(prompt_tokens=3, output_tokens=2)]
    # paged, block 4: step 1 holds 4 slots (3 prompt + 1 new), step 2 needs a second block
    r = simulate(req, "paged", budget_tokens=16, block_size=4)
    assert r.steps == 2 and r.finished == 1
    # used: 4 then 5; held: 4 then 8 (final length 5: 3 slots of block 2 are never used)
    assert r.used == pytest.approx((4 + 5) / 2)
    assert r.internal == pytest.approx((0 + 3) / 2) and r.reservation == 0
    # a 2-token prompt: step 1 holds 4 slots, uses 3, and the 4th is filled in step 2
    r2 = simulate([TraceRequest(2, 2)], "paged", budget_tokens=16, block_size=4)
    assert r2.reservation == pytest.approx((1 + 0) / 2) and r2.internal == 0
    assert r2.idle == pytest.approx(12)
    # max_len with a 6-token output cap: 3 + 6 = 9 slots reserved for the whole life
    m = simulate(req, "max_len", budget_tokens=16, max_tokens=6)
    assert m.used + m.reservation + m.internal == pytest.approx(9)
    assert m.internal == pytest.approx(9 - 5)
    assert m.waste > r.waste


def test_static_batch_holds_memory_until_the_longest_finishes():
    reqs = [TraceRequest(2, 1), TraceRequest(2, 6)]
    r = simulate(reqs, "batch_max", budget_tokens=64)
    assert r.steps == 6 and r.peak_running == 2
    # both reserve 8 slots for 6 steps; the short one is finished after step 1
    assert r.used + r.reservation + r.internal == pytest.approx(16)
    assert r.mean_running == pytest.approx((2 + 5 * 1) / 6)


def test_contiguous_pool_fragments_and_paging_does_not():
    reqs = [TraceRequest(10, 2), TraceRequest(10, 20), TraceRequest(10, 2), TraceRequest(30, 5)]
    r = simulate(reqs, "max_len", budget_tokens=90, max_tokens=20)
    assert r.external > 0          # the 40-slot hole layout blocks the 50-slot request
    p = simulate(reqs, "paged", budget_tokens=90, block_size=8)
    assert p.external == 0 and p.finished == 4


def test_preemption_when_blocks_run_out_loses_no_request():
    reqs = [TraceRequest(8, 40) for _ in range(6)]
    r = simulate(reqs, "paged", budget_tokens=128, block_size=8)
    assert r.preemptions > 0 and r.finished == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate([TraceRequest(1, 1)], "fifo", 16)
    with pytest.raises(ValueError, match="block_size=3"):
        simulate([TraceRequest(1, 1)], "paged", 16, block_size=3)
    with pytest.raises(ValueError, match="cannot hold a request"):
        simulate([TraceRequest(100, 1)], "paged", 16)
    with pytest.raises(ValueError, match="unknown trace 'nope'"):
        load_trace("nope")


def test_targets_on_the_sharegpt_like_trace():
    reqs = load_trace("sharegpt_like")
    a = simulate(reqs, "max_len", budget_tokens=16384)
    b = simulate(reqs, "batch_max", budget_tokens=16384)
    sweep = {r.block_size: r for r in block_size_sweep(reqs, 16384, block_sizes=(1, 16, 256))}
    assert 0.60 <= a.waste <= 0.80
    assert b.waste > sweep[16].waste
    assert sweep[16].waste <= 0.04
    assert sweep[1].waste < sweep[16].waste < sweep[256].waste
    assert sweep[16].mean_running >= 2.5 * a.mean_running
    assert a.finished == b.finished == sweep[16].finished == len(reqs)


def test_sharing_saves_memory_for_parallel_sampling_and_beam_search():
    reqs = load_trace("alpaca_like", limit=40)
    par = parallel_sampling_memory(reqs, n=4, block_size=16)
    beam = beam_search_memory(reqs, width=4, block_size=16)
    assert 0.02 < par.saving < 0.5 and par.cow_copies > 0
    assert beam.saving > par.saving
    # width 1 has nothing to share
    assert parallel_sampling_memory(reqs[:5], n=1).saving == pytest.approx(0.0)
