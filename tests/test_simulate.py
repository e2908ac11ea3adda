"""llmlab.engine.simulate: the real scheduler over a simulated runner (no model)."""
import pytest

from llmlab.cache.block_manager import BlockManager
from llmlab.engine import simulate
from llmlab.engine.scheduler import Scheduler, SchedulerConfig
from llmlab.engine.sequence import Request, SamplingParams, Sequence


def test_viz_re_exports_the_engines_dry_run():
    from llmlab.viz import serving

    assert serving.dry_run is simulate.dry_run
    assert serving.DryRun is simulate.DryRun
    assert serving.SchedulerStall is simulate.SchedulerStall


def test_a_prompt_chunk_gets_no_token_and_a_finished_sequence_frees_its_blocks():
    config = SchedulerConfig("continuous", 4, 8, 64, enable_chunked_prefill=True)
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(config, bm)
    runner = simulate.SimulatedRunner(sched)
    req = Request(0, None, list(range(1, 13)), SamplingParams(temperature=0, max_tokens=2,
                                                               ignore_eos=True))
    seq = Sequence(0, req, 0, list(req.prompt_token_ids))
    req.seqs.append(seq)
    sched.add(seq)
    runner.execute(sched.schedule())               # 8 of the 12 prompt tokens
    assert seq.num_computed == 8 and seq.output_token_ids == []
    runner.execute(sched.schedule())               # the last 4: the first new token
    assert seq.num_computed == 12 and len(seq.output_token_ids) == 1
    runner.execute(sched.schedule())               # one decode: done
    assert seq.finished and runner.finished_order == [0] and not bm.has_seq(0)
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("seats", [1, 3, 8])
def test_continuous_never_needs_more_iterations_than_static(seats):
    prompts, outs = [5, 40, 7, 13, 22, 9], [30, 2, 17, 5, 41, 8]
    static = simulate.dry_run(prompts, outs, "static", max_num_seqs=seats)
    cont = simulate.dry_run(prompts, outs, "continuous", max_num_seqs=seats)
    assert static.output_tokens == cont.output_tokens == outs
    assert cont.iterations <= static.iterations
    assert cont.iterations >= -(-sum(outs) // seats)       # every seat busy is the floor
