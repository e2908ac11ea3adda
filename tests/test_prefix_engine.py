"""The prefix caches in the engine (tiny-llama): greedy tokens with the radix cache equal those
without any cache, multi-turn sessions fed turn by turn, cache-aware admission and its bound,
and the simulated sessions the notebook's widget uses."""
import pytest
import torch

from llmlab.cache.block_manager import BlockManager
from llmlab.engine import LLM, SamplingParams
from llmlab.engine.scheduler import Scheduler, SchedulerConfig
from llmlab.engine.sequence import Request, Sequence
from llmlab.engine.sessions import Session, Turn, run_sessions, simulate_sessions
from llmlab.profiling.steps import StepCost


def ids_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (n,), generator=g).tolist()


def sessions(num=3, turns=3, seed=0):
    system = ids_of(11, seed)                     # shared by every session, not block-aligned
    out = []
    for s in range(num):
        first = Turn(system + ids_of(5 + s, seed + 10 + s), 4 + s, 0.0)
        rest = [Turn(ids_of(3 + k, seed + 100 * s + k), 3 + k, 0.0) for k in range(1, turns)]
        out.append(Session(f"s{s}", [first] + rest))
    return out


@pytest.mark.parametrize("block_size", [4])
def test_radix_gives_the_tokens_of_no_cache(tiny, tiny_tok, block_size):
    stem = ids_of(23, 1)
    first = [stem[:n] + ids_of(3, 50 + n) for n in (9, 23)]
    second = [stem[:n] + ids_of(4, 80 + n) for n in (6, 13, 21, 23)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = {}
    for mode in (None, "hash", "radix"):
        llm = LLM(tiny, tiny_tok, block_size=block_size, num_blocks=64, prefix_cache=mode)
        outs = llm.generate(first, params, use_tqdm=False) + \
            llm.generate(second, params, use_tqdm=False)
        got[mode] = [o.outputs[0].token_ids for o in outs]
        bm = llm.engine.cache.manager
        bm.check_invariants()
        if mode == "radix":
            assert bm.stats.hits % block_size != 0        # a match ended inside a block
            assert bm.stats.hits > 40
    assert got["radix"] == got[None] and got["hash"] == got[None]


def test_sessions_send_each_turn_after_the_previous_answer(tiny, tiny_tok):
    runs = {}
    for mode in (None, "hash", "radix"):
        llm = LLM(tiny, tiny_tok, block_size=4, num_blocks=128, prefix_cache=mode)
        runs[mode] = run_sessions(llm, sessions())
        llm.engine.cache.manager.check_invariants()
    run = runs["radix"]
    assert len(run.turns) == 9
    by = {(t.session, t.turn): t for t in run.turns}
    for (s, k), t in by.items():
        if k:
            prev = by[(s, k - 1)]
            assert t.arrival_s >= prev.arrival_s + prev.e2e_s - 1e-6   # after the answer
            assert t.prompt_tokens == prev.prompt_tokens + prev.output_tokens + 3 + k
    tokens = {m: sorted((t.session, t.turn, t.output_token_ids) for t in r.turns)
              for m, r in runs.items()}
    assert tokens["radix"] == tokens[None] == tokens["hash"]
    assert runs[None].computed_prompt_tokens == runs[None].prompt_tokens
    assert runs["radix"].computed_prompt_tokens < runs["hash"].computed_prompt_tokens \
        < runs[None].computed_prompt_tokens
    assert runs["radix"].computed_share < 0.5 and run.hit_rate > 0.5


def _waiting(bm, prompts):
    sched = Scheduler(SchedulerConfig(admission="cache_aware", max_overtakes=2), bm)
    for i, p in enumerate(prompts):
        req = Request(i, None, p, SamplingParams(max_tokens=1), 0.0)
        seq = Sequence(i, req, 0, list(p))
        req.seqs.append(seq)
        sched.add(seq)
    return sched


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_cache_aware_admission_takes_the_longest_cached_prefix_within_its_bound(mode):
    bm = BlockManager(64, 4, prefix_cache=mode)
    cached = list(range(100, 120))
    bm.allocate("warm", cached)
    bm.mark_computed("warm", 20)
    bm.free("warm")
    cold = [[7, 8, 9, 10, 11, 12, 13, 14, 15] for _ in range(2)]
    warm = [cached[:16] + [1, 2, 3] for _ in range(4)]
    sched = _waiting(bm, cold + warm)
    order = []
    while sched.waiting:
        seq = sched.next_waiting(0.0)
        sched._count_overtakes(seq)
        sched.waiting.remove(seq)
        order.append(seq.seq_id)
    # warm ones first, until the first cold one has been overtaken twice (the bound)
    assert order == [2, 3, 0, 1, 4, 5]
    fcfs = Scheduler(SchedulerConfig(), bm)
    assert fcfs.config.admission == "fcfs"
    with pytest.raises(ValueError, match="admission='lpm'; allowed"):
        SchedulerConfig(admission="lpm")
    with pytest.raises(ValueError, match="needs scheduler='continuous'"):
        SchedulerConfig(policy="static", admission="cache_aware")


def test_simulated_sessions_count_what_the_cache_saves():
    cost = StepCost(fixed_ms=20.0, per_row_ms=1.0, per_prompt_token_ms=5.0, num_steps=0,
                    rms_ms=0.0)
    runs = {m: simulate_sessions(sessions(4, 4), cost, prefix_cache=m, num_blocks=64,
                                 block_size=4)
            for m in (None, "hash", "radix")}
    assert runs[None].computed_prompt_tokens == runs[None].prompt_tokens
    assert runs["radix"].computed_prompt_tokens < runs["hash"].computed_prompt_tokens
    later = {m: sum(t.ttft_s for t in r.turns if t.turn) for m, r in runs.items()}
    assert later["radix"] < later["hash"] < later[None]       # follow-ups start sooner
    assert all(len(r.turns) == 16 for r in runs.values())
    tight = simulate_sessions(sessions(4, 4), cost, prefix_cache="radix", num_blocks=20,
                              block_size=4)
    assert tight.hit_rate < runs["radix"].hit_rate and len(tight.turns) == 16


def test_the_widget_callback_and_figures_draw_from_the_runs():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmlab.viz.prefix import explore_prefix_cache, plot_session_runs, tree_text

    cost = StepCost(20.0, 1.0, 5.0, 0, 0.0)
    fig = explore_prefix_cache(sessions(3, 3), cost, num_blocks=40, policy="radix",
                               block_size=4)
    assert "radix: hit rate" in fig._suptitle.get_text() and "(model)" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="policy='lru'; allowed"):
        explore_prefix_cache(sessions(), cost, 40, policy="lru", block_size=4)
    runs = {m: simulate_sessions(sessions(), cost, prefix_cache=m, num_blocks=64, block_size=4)
            for m in (None, "radix")}
    fig2 = plot_session_runs(runs)
    assert "step-cost model" in fig2._suptitle.get_text()
    plt.close("all")
    bm = BlockManager(16, 4, prefix_cache="radix")
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    bm.mark_computed("a", 6)
    bm.free("a")
    # the full block entered while it ran, the partial tail when it was freed
    assert tree_text(bm.radix).splitlines() == ["[0:4] lock 0 blocks [0]  '[1, 2, 3, 4]'",
                                                "  [4:6] lock 0 blocks [1]  '[5, 6]'"]


@pytest.mark.slow
def test_smollm2_multi_turn_with_radix_gives_the_tokens_of_no_cache(smollm2, tokenizer):
    from llmlab.engine.sessions import sessions_of
    from llmlab.traces import load_trace

    trace = sessions_of(load_trace("multiturn_chat", tokenizer=tokenizer))[:3]
    few = [Session(s.id, [Turn(t.token_ids, 8, 0.0) for t in s.turns[:3]]) for s in trace]
    runs = {}
    for mode in (None, "radix"):
        llm = LLM(smollm2, tokenizer, prefix_cache=mode, block_size=16, num_blocks=128,
                  admission="cache_aware" if mode else "fcfs")
        runs[mode] = run_sessions(llm, few, time_scale=0.0)
        llm.engine.cache.manager.check_invariants()
    tokens = {m: sorted((t.session, t.turn, t.output_token_ids) for t in r.turns)
              for m, r in runs.items()}
    assert tokens["radix"] == tokens[None] and len(tokens[None]) == 9
    assert runs["radix"].computed_share < 0.5 < runs[None].computed_share
