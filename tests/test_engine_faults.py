"""The engine survives faults: an exception or KeyboardInterrupt injected at each phase of a
step (schedule, forward, sample, finish), a property test that interrupts random steps of
random workloads, aborts, closed streams, consistent stop-string streaming, and token ids
outside the vocabulary. After every fault the next call gives a fresh engine's greedy
tokens, no block is held once idle, and the block manager's invariants hold.

Faults are injected by wrapping the engine's own phase functions (and a forward pre-hook
on a decoder layer, so the forward stops half-way with some layers' K/V written)."""
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmlab
from llmlab.engine import LLM, SamplingParams
from llmlab.engine.llm import settled_length

from .conftest import FRANCE, PROPERTY_EXAMPLES

PHASES = ("schedule", "forward", "sample", "finish")
POLICIES = {                              # name -> LLM keyword arguments
    "continuous": dict(scheduler="continuous"),
    "static": dict(scheduler="static"),
    "chunked": dict(scheduler="continuous", enable_chunked_prefill=True,
                    max_num_batched_tokens=8),
}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def token_lists(lengths, seed=0, prefix=0):
    """Random prompts; the first ``prefix`` tokens are shared (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 40000, (prefix,), generator=g).tolist()
    return [head + torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


def make_llm(tiny, tok, policy="continuous", **kw):
    args = dict(max_num_seqs=3, block_size=4, num_blocks=48, **POLICIES[policy])
    args.update(kw)
    return LLM(tiny, tok, **args)


def fresh_tokens(tiny, tok, prompts, params, policy="continuous", **kw):
    """What a new engine (same configuration) generates: the reference after a fault."""
    outs = make_llm(tiny, tok, policy, **kw).generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def tokens_of(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@contextmanager
def fault(llm, phase, at=0, exc=KeyboardInterrupt):
    """Raise ``exc`` the ``at``-th time (from 0) the engine passes through ``phase``.

    schedule: after the scheduler has allocated blocks and reserved slots; forward: at
    the last decoder layer, after the earlier layers wrote their K/V; sample: before
    sampling; finish: after one sequence's token was appended (and maybe finished), before
    the others of the step. Yields a list that holds True once the fault has fired.
    """
    eng, fired, calls = llm.engine, [], [0]

    def due():
        calls[0] += 1
        if calls[0] == at + 1:
            fired.append(True)
            raise exc

    if phase == "schedule":
        real = eng.scheduler.schedule

        def schedule(now=float("inf")):
            out = real(now)
            due()
            return out

        eng.scheduler.schedule = schedule
        undo = lambda: delattr(eng.scheduler, "schedule")        # noqa: E731
    elif phase == "forward":
        handle = eng.model.layers[-1].register_forward_pre_hook(lambda m, a: due())
        undo = handle.remove
    elif phase == "sample":
        real = eng._sample

        def sample(logits, seqs):
            due()
            return real(logits, seqs)

        eng._sample = sample
        undo = lambda: delattr(eng, "_sample")                   # noqa: E731
    elif phase == "finish":
        real = eng._append

        def append(seq, tok, now):
            real(seq, tok, now)
            due()

        eng._append = append
        undo = lambda: delattr(eng, "_append")                   # noqa: E731
    else:
        raise ValueError(f"phase={phase!r}; allowed: {PHASES}")
    try:
        yield fired
    finally:
        undo()


def assert_idle_and_consistent(llm):
    eng, bm = llm.engine, llm.engine.cache.manager
    assert not eng.has_unfinished() and eng.requests == {}
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert bm.seq_ids() == []
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


# -- a fault at each phase --------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("at", [0, 3])
def test_a_fault_at_each_phase_leaves_the_llm_usable(tiny, tiny_tok, policy, phase, at):
    prompts = token_lists([3, 9, 6, 1], seed=at, prefix=9)       # shared full blocks
    want = fresh_tokens(tiny, tiny_tok, prompts, GREEDY, policy)
    llm = make_llm(tiny, tiny_tok, policy)
    exc = KeyboardInterrupt() if at == 0 else RuntimeError(f"injected at {phase}")
    with fault(llm, phase, at, exc) as fired:
        with pytest.raises(type(exc)) as info:
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert fired and info.value is exc                 # the caller gets the very exception
    assert_idle_and_consistent(llm)
    if phase in ("schedule", "forward") and at == 0:
        # the first forward never completed: no block may be findable by a later prompt
        assert llm.engine.cache.manager.allocator.num_cached == 0
    assert tokens_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert_idle_and_consistent(llm)
    assert tokens_of(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == want[::-1]


def test_a_failed_step_keeps_the_engine_requests(tiny, tiny_tok):
    """At the engine level nothing is lost: the step's sequences are recomputed."""
    prompts = token_lists([5, 8, 2], seed=4, prefix=4)
    want = fresh_tokens(tiny, tiny_tok, prompts, GREEDY)
    llm = make_llm(tiny, tiny_tok)
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.step()
    with fault(llm, "forward"), pytest.raises(KeyboardInterrupt):
        eng.step()
    assert not eng.scheduler.running and len(eng.scheduler.waiting) == 3
    assert eng.cache.manager.num_free_blocks == eng.cache.manager.num_blocks
    eng.run(reqs)
    assert [[c.token_ids for c in eng.output(r).outputs] for r in reqs] == want
    assert_idle_and_consistent(llm)


def test_an_interrupt_while_forking_n_completions(tiny, tiny_tok):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=11, ignore_eos=True)
    prompts = token_lists([6, 3], seed=2)
    want = fresh_tokens(tiny, tiny_tok, prompts, sp, max_num_seqs=6)
    llm = make_llm(tiny, tiny_tok, max_num_seqs=6)
    with fault(llm, "finish", at=1), pytest.raises(KeyboardInterrupt):   # mid-fork
        llm.generate(prompts, sp, use_tqdm=False)
    assert_idle_and_consistent(llm)
    assert tokens_of(llm.generate(prompts, sp, use_tqdm=False)) == want
    eng = llm.engine             # at the engine level the request starts over from its prompt
    reqs = [eng.add_request(p, sp) for p in prompts]
    with fault(llm, "finish", at=1), pytest.raises(KeyboardInterrupt):
        eng.run(reqs)
    eng.run(reqs)
    assert [[c.token_ids for c in eng.output(r).outputs] for r in reqs] == want
    assert_idle_and_consistent(llm)


def test_smollm2_survives_an_interrupt_mid_forward(smollm2, tokenizer):
    sp = SamplingParams(temperature=0, max_tokens=6)
    convs = [[{"role": "user", "content": q}] for q in (FRANCE, FRANCE + " One word.")]
    llm = LLM(smollm2, tokenizer, max_num_seqs=2, block_size=4, num_blocks=32)
    want = tokens_of(llm.chat(convs, sp, use_tqdm=False))
    fresh = LLM(smollm2, tokenizer, max_num_seqs=2, block_size=4, num_blocks=32)
    with fault(fresh, "forward", at=0), pytest.raises(KeyboardInterrupt):
        fresh.chat(convs, sp, use_tqdm=False)
    assert_idle_and_consistent(fresh)
    assert tokens_of(fresh.chat(convs, sp, use_tqdm=False)) == want
    assert tokenizer.decode(want[0][0]).startswith("The capital of France")


# -- random faults in random workloads ---------------------------------------------------------
# what the property test did (the README quotes it): calls made, engine steps completed,
# faults injected (each one survived), requests whose tokens were checked, requests lost
FAULT_LOG = {"examples": 0, "calls": 0, "steps": 0, "faults": 0, "requests": 0,
             "checked": 0, "lost": 0}


@st.composite
def workloads(draw):
    policy = draw(st.sampled_from(list(POLICIES)))
    num_blocks = draw(st.sampled_from([10, 16, 48]))            # 10: preemptions
    prefix = draw(st.sampled_from([0, 4, 9]))
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=5))
    seed = draw(st.integers(0, 1000))
    prompts = token_lists(lengths, seed=seed, prefix=prefix)
    max_tokens = draw(st.lists(st.integers(1, 7), min_size=len(prompts), max_size=len(prompts)))
    calls = draw(st.lists(st.tuples(
        st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=len(prompts)),
        st.tuples(st.sampled_from(PHASES + (None,)), st.integers(0, 8),     # None: no fault
                  st.sampled_from(["interrupt", "error"])),
        st.booleans()), min_size=2, max_size=5))
    return policy, num_blocks, prompts, max_tokens, calls


EXAMPLES = 30 * PROPERTY_EXAMPLES


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(work=workloads())
def random_interrupts_example(tiny, tiny_tok, work):
    """Calls (generate or a stream) on one engine, some with a fault at a random phase
    and step. A call that completes gives a fresh engine's tokens for every request; a
    call that fails raises its exception and leaves the engine idle and consistent."""
    policy, num_blocks, prompts, max_tokens, calls = work
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = fresh_tokens(tiny, tiny_tok, prompts, params, policy, num_blocks=num_blocks)
    llm = make_llm(tiny, tiny_tok, policy, num_blocks=num_blocks)
    FAULT_LOG["examples"] += 1
    for picks, plan, streamed in calls:
        FAULT_LOG["calls"] += 1
        FAULT_LOG["requests"] += len(picks)
        ps, sps = [prompts[i] for i in picks], [params[i] for i in picks]
        fired = []
        phase, at, kind = plan
        if phase is None:
            phase, at = "sample", 10**9
        exc = KeyboardInterrupt() if kind == "interrupt" else RuntimeError("injected")
        try:
            with fault(llm, phase, at, exc) as fired:
                if streamed:
                    got = {i: [] for i in range(len(ps))}
                    for ev in llm.stream(ps, sps):
                        got[ev.index].append(ev.token_id)
                    outs = [[got[i]] for i in range(len(ps))]
                else:
                    outs = tokens_of(llm.generate(ps, sps, use_tqdm=False))
        except (KeyboardInterrupt, RuntimeError) as e:
            assert fired and e is exc, "an exception the test did not inject"
            FAULT_LOG["faults"] += 1
        else:
            assert not fired
            lost = sum(o != want[i] for o, i in zip(outs, picks))
            FAULT_LOG["lost"] += lost
            FAULT_LOG["checked"] += len(picks)
            assert lost == 0
        FAULT_LOG["steps"] += len(llm.stats.steps)
        assert_idle_and_consistent(llm)
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == want
    FAULT_LOG["checked"] += len(prompts)


@pytest.mark.slow
def test_random_interrupts_never_lose_or_corrupt_a_request(tiny, tiny_tok):
    """The property test over 30 random workloads (150 in `make test-thorough`); then,
    that it really interrupted calls (at least 20 faults per 30) and lost nothing."""
    for key in FAULT_LOG:
        FAULT_LOG[key] = 0
    random_interrupts_example(tiny, tiny_tok)
    assert FAULT_LOG["examples"] == EXAMPLES
    assert FAULT_LOG["faults"] >= 20 * PROPERTY_EXAMPLES and FAULT_LOG["lost"] == 0, FAULT_LOG
    print("property test:", FAULT_LOG)


# -- abort, streams ------------------------------------------------------------------------
def test_abort_request_frees_blocks_and_dequeues(tiny, tiny_tok):
    prompts = token_lists([7, 5, 9], seed=8)
    want = fresh_tokens(tiny, tiny_tok, prompts, GREEDY)
    llm = make_llm(tiny, tiny_tok, max_num_seqs=2)           # the third request waits
    eng, bm = llm.engine, llm.engine.cache.manager
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.step()
    running, waiting = reqs[0].seqs[0], reqs[2].seqs[0]
    assert running in eng.scheduler.running and waiting in eng.scheduler.waiting
    held = len(bm.block_table(running.seq_id))
    free = bm.num_free_blocks
    assert eng.abort_request(reqs[0].request_id) and eng.abort_request(reqs[2].request_id)
    assert not eng.abort_request(reqs[0].request_id)           # already finished
    assert not eng.abort_request(12345)                         # unknown
    assert bm.num_free_blocks == free + held and not bm.has_seq(running.seq_id)
    assert running not in eng.scheduler.running and waiting not in eng.scheduler.waiting
    for r in (reqs[0], reqs[2]):
        out = eng.output(r)
        assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.output(reqs[0]).outputs[0].token_ids == want[0][0][:2]   # what it had
    eng.run(reqs)
    assert eng.output(reqs[1]).outputs[0].token_ids == want[1][0]
    assert_idle_and_consistent(llm)


@pytest.mark.parametrize("how", ["close", "break"])
def test_a_closed_stream_aborts_its_requests(tiny, tiny_tok, how):
    first = token_lists([6, 4, 8], seed=5)
    second = token_lists([3, 7], seed=6)
    ref = make_llm(tiny, tiny_tok, enable_prefix_caching=False)
    want = tokens_of(ref.generate(second, GREEDY, use_tqdm=False))
    want_stats = (len(ref.stats.steps), ref.stats.real_tokens)
    llm = make_llm(tiny, tiny_tok, enable_prefix_caching=False)
    if how == "close":
        it = llm.stream(first, GREEDY)
        events = [next(it) for _ in range(4)]
        it.close()
    else:                        # dropping the generator (garbage collection) closes it
        events = []
        for ev in llm.stream(first, GREEDY):
            events.append(ev)
            if len(events) == 4:
                break
    assert len(events) == 4 and not any(e.finished for e in events)
    assert_idle_and_consistent(llm)
    assert tokens_of(llm.generate(second, GREEDY, use_tqdm=False)) == want
    assert (len(llm.stats.steps), llm.stats.real_tokens) == want_stats   # nothing mixed in


def test_stream_deltas_add_up_to_the_final_text_across_stop_strings(tiny, tiny_tok):
    llm = make_llm(tiny, tiny_tok, max_num_seqs=4)
    prompt = token_lists([6], seed=0)[0]
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    free = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    # where each token's text starts: stops that begin inside one token and end in another
    ends = [len(tiny_tok.decode(free.token_ids[:k + 1], skip_special_tokens=True))
            for k in range(len(free.token_ids))]
    text, stops = free.text, []
    for k in range(1, len(ends) - 2):
        start = ends[k - 1] + 1                  # one character into token k
        stop = text[start:ends[k + 1] - 1]       # ... to one character before token k+2 ends
        if len(stop) >= 2 and text.find(stop) == start:
            stops.append(stop)
    assert len(stops) >= 3, "the free text gave too few multi-token stop strings"
    for stop in stops:
        p = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=stop)
        final = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert final.text == text[:text.find(stop)] and final.finish_reason == "stop"
        shown, deltas = "", []
        for ev in llm.stream([prompt], p):
            deltas.append(ev.text)
            shown += ev.text
            assert final.text.startswith(shown), f"shown past the stop string {stop!r}"
        assert shown == final.text, (stop, deltas)
        assert ev.finished and ev.finish_reason == "stop"
    assert_idle_and_consistent(llm)


def test_settled_length_holds_back_stop_prefixes_and_half_characters():
    assert settled_length("hello wor", ["world"]) == 6
    assert settled_length("hello w", ["xy", "wz"]) == 6
    assert settled_length("hello", ["zz"]) == 5
    assert settled_length("abc\ufffd\ufffd", []) == 3
    assert settled_length("ab", ["abc", "b"]) == 0     # "ab" may still become "abc"
    assert settled_length("", ["a"]) == 0


# -- bad input ------------------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_are_refused(tiny, tiny_tok):
    llm = make_llm(tiny, tiny_tok)
    vocab = tiny.config.vocab_size
    ok = token_lists([5], seed=3)[0]
    with pytest.raises(ValueError, match=f"prompt 1: token id {vocab} at position 1 is out of "
                                         f"range for a vocabulary of {vocab} tokens"):
        llm.generate([ok, [5, vocab]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token id -1 at position 0 is out of range"):
        llm.generate({"prompt_token_ids": [-1, 4]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token id 2.5 at position 1 is not an int"):
        llm.generate({"prompt_token_ids": [3, 2.5]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=f"allowed: 0..{vocab - 1}"):
        llm.engine.add_request([1, 10**6], GREEDY)
    assert_idle_and_consistent(llm)          # nothing was queued, not even the good prompt
    assert tokens_of(llm.generate([ok], GREEDY, use_tqdm=False)) == \
        fresh_tokens(tiny, tiny_tok, [ok], GREEDY)
