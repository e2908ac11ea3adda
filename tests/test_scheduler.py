"""The scheduler alone, with hand-made sequences (no model): seats, budget, policies,
preemption by recompute."""
import pytest

from llmlab.cache.block_manager import BlockManager
from llmlab.engine.scheduler import EMPTY, HELD, Scheduler, SchedulerConfig, SchedulerOutput
from llmlab.engine.sequence import Request, SamplingParams, Sequence, SequenceStatus


def make(n_seqs, prompt_len=5, max_tokens=4, start=0, n=1):
    seqs = []
    for i in range(start, start + n_seqs):
        req = Request(i, None, list(range(1, prompt_len + 1)),
                      SamplingParams(temperature=0 if n == 1 else 1.0, max_tokens=max_tokens, n=n))
        seq = Sequence(i, req, 0, list(req.prompt_token_ids))
        req.seqs.append(seq)
        seqs.append(seq)
    return seqs


def fake_step(sched, out, finish=()):
    """What the engine does after a forward: mark fed tokens computed, append a token."""
    for s in out.scheduled:
        s.seq.num_computed = s.seq.num_tokens
        s.seq.output_token_ids.append(7)
    for s in list(sched.running):
        if s.request.request_id in finish or len(s.output_token_ids) >= s.request.params.max_tokens:
            s.status = SequenceStatus.FINISHED_LENGTH
            sched.finish(s)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="allowed"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)


def test_continuous_fills_free_seats_every_step():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig("continuous", max_num_seqs=2), bm)
    for s in make(3):
        sched.add(s)
    out = sched.schedule()
    assert out.packed and [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.num_new for s in out.scheduled] == [5, 5]
    fake_step(sched, out, finish={0})                 # request 0 leaves after one token
    out = sched.schedule()
    # 1 decodes (1 token) and 2 joins in the same step with its whole prompt, packed
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [(1, 1), (2, 5)]
    assert out.num_padded_tokens == out.num_tokens == 6
    assert sched.occupancy(2) == [2, 1]               # request 2 took the freed seat 0
    bm.check_invariants()


def test_token_budget_limits_prefill_but_never_starves_a_long_prompt():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig("continuous", max_num_seqs=8, max_num_batched_tokens=12), bm)
    for s in make(3, prompt_len=5) + make(1, prompt_len=20, start=3):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]      # 5 + 5 <= 12 < 15
    fake_step(sched, out, finish={0, 1})
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [2]         # 5 + 20 > 12
    fake_step(sched, out, finish={2})
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [(3, 20)]   # alone: allowed


def test_static_waits_for_the_whole_batch_and_pads():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig("static", max_num_seqs=2), bm)
    seqs = make(2, prompt_len=3, max_tokens=1) + make(1, prompt_len=6, max_tokens=3, start=2)
    sched.add(seqs[2])
    sched.add(seqs[0])
    sched.add(seqs[1])
    out = sched.schedule()
    assert not out.packed and [s.seq.seq_id for s in out.scheduled] == [2, 0]
    assert out.num_tokens == 9 and out.num_padded_tokens == 12     # 3 pads for seq 0
    fake_step(sched, out)                                          # seq 0 done after 1 token
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [2]            # nobody joins
    assert sched.occupancy(2) == [2, HELD]
    fake_step(sched, out)
    out = sched.schedule()
    fake_step(sched, out)                                          # seq 2 done: batch over
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert sched.occupancy(2) == [1, EMPTY]


def test_preemption_frees_blocks_and_requeues_at_the_front():
    bm = BlockManager(4, 4, enable_prefix_caching=False)      # 16 token slots in all
    sched = Scheduler(SchedulerConfig("continuous", max_num_seqs=4), bm)
    seqs = make(2, prompt_len=8, max_tokens=6) + make(1, prompt_len=2, start=2)
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]    # 2 blocks each: pool full
    assert bm.num_free_blocks == 0
    fake_step(sched, out)
    out = sched.schedule()                 # both need a 3rd block: the newest (1) is preempted
    assert [s.seq_id for s in out.preempted] == [1]
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]        # front of the queue
    victim = seqs[1]
    assert victim.num_computed == 0 and victim.output_token_ids == [7]
    assert not bm.has_seq(1) and sched.num_preemptions == 1
    bm.check_invariants()
    fake_step(sched, out)
    for _ in range(20):                    # drain: the victim is recomputed with its tokens
        out = sched.schedule()
        if out.is_empty:
            break
        if any(s.seq.seq_id == 1 and s.num_new > 1 for s in out.scheduled):
            assert [s.num_new for s in out.scheduled if s.seq.seq_id == 1] == [9]
        fake_step(sched, out)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert bm.num_free_blocks == 4


def run_to_end(sched, limit=100):
    """Schedule and fake-step until nothing is left; returns each step's (seq, num_new)."""
    log = []
    for _ in range(limit):
        out = sched.schedule()
        if out.is_empty:
            return log
        log.append([(s.seq.seq_id, s.num_new) for s in out.scheduled])
        fake_step(sched, out)
    raise AssertionError("the scheduler did not finish")


def test_a_schedule_function_replaces_the_continuous_step():
    calls = []

    def same_as_builtin(self, now):
        calls.append(now)
        return Scheduler.schedule_continuous(self, now)

    def one_admission_per_step(self, now):
        """A hand-written policy: decodes first, then at most one waiting prompt."""
        out = SchedulerOutput(packed=True)
        self.schedule_decodes(out)
        if self.waiting and not out.preempted and self.bm.can_allocate(
                self.waiting[0].all_token_ids):
            self.admit(self.waiting[0], out)
        return out

    logs = {}
    for name, fn in (("default", None), ("same", same_as_builtin),
                     ("one", one_admission_per_step)):
        bm = BlockManager(64, 4, enable_prefix_caching=False)
        sched = Scheduler(SchedulerConfig("continuous", max_num_seqs=4), bm, schedule_fn=fn)
        for s in make(3, max_tokens=3):
            sched.add(s)
        logs[name] = run_to_end(sched)
        assert bm.num_free_blocks == 64
    assert logs["same"] == logs["default"] and len(calls) == len(logs["same"]) + 1
    assert logs["default"][0] == [(0, 5), (1, 5), (2, 5)]
    assert logs["one"][:2] == [[(0, 5)], [(0, 1), (1, 5)]]
    with pytest.raises(ValueError, match="schedule_fn must be a function"):
        Scheduler(SchedulerConfig(), BlockManager(4, 4), schedule_fn="fcfs")


def test_reset_sends_everything_back_to_waiting_without_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig("continuous", max_num_seqs=2), bm)
    seqs = make(3)
    for s in seqs:
        sched.add(s)
    fake_step(sched, sched.schedule())
    sched.schedule()                   # slots reserved for a step that then "fails":
    assert sched.in_prefill(seqs[0])   # it now looks half-way through a prompt, forever
    sched.reset([seqs[1], seqs[0], seqs[2]])
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2]      # running first, oldest first
    assert not sched.running and bm.num_free_blocks == 16 and bm.seq_ids() == []
    assert all(s.num_computed == 0 and s.status is SequenceStatus.WAITING and s.slot is None
               for s in seqs)
    assert sched.occupancy(2) == [EMPTY, EMPTY]
    assert seqs[0].output_token_ids == [7]                     # tokens kept: recomputed later
    log = run_to_end(sched)
    assert log[0] == [(0, 6), (1, 6)]                          # prompt + the token it had
    assert all(s.finished for s in seqs)
