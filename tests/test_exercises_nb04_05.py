"""Notebooks 04 and 05 beyond the registry's generic checks (tests/test_exercises.py runs every
solution, placeholder and wrong variant): the random-operation test of block allocators, the
engine run behind the allocator check, the scheduler dry run behind the schedule check, and
the figures and models the two notebooks draw."""
import matplotlib
import pytest

from llmlab import exercises
from llmlab.cache import waste
from llmlab.exercises import nb04, nb05
from llmlab.viz import paged as pviz
from llmlab.viz import serving

matplotlib.use("Agg")


# -- notebook 04 --------------------------------------------------------------------------------

def test_random_block_ops_exercise_every_path_of_the_library_allocator():
    report = nb04.random_block_ops()                 # the library's allocator, prefix caching on
    assert report.ops == 10_000
    assert report.prefix_hits > 100 and report.copies > 100
    assert report.refusals > 10 and report.evictions > 10 and report.forks > 100


@pytest.mark.parametrize("broken, words", [
    (nb04._NoDecrement, "too high"),
    (nb04._FreesShared, "num_free"),
])
def test_random_block_ops_names_the_broken_invariant(broken, words):
    with pytest.raises(nb04.BlockInvariantError, match=words):
        nb04.random_block_ops(broken, ops=2_000)


def test_random_block_ops_catches_a_share_that_is_not_counted():
    class NoIncref(nb04._SolutionBlockAllocator):
        def incref(self, block):
            pass

    with pytest.raises(nb04.BlockInvariantError, match="too low"):
        nb04.random_block_ops(NoIncref, ops=2_000)


def test_random_block_ops_refuses_a_bad_op_count():
    with pytest.raises(ValueError, match="ops=0"):
        nb04.random_block_ops(ops=0)


def test_the_allocator_check_serves_a_fork_and_a_preemption(smollm2, tokenizer):
    tokens, preemptions = nb04._engine_allocator_run(nb04._SolutionBlockAllocator, smollm2,
                                                     tokenizer)
    want, _ = nb04._engine_allocator_run(None, smollm2, tokenizer)
    assert len(tokens) == 4 and preemptions >= 1      # three prompts, one with n = 2
    assert tokens == want


def test_the_allocator_check_says_why_a_class_cannot_be_built():
    v = exercises.check("nb04.block_allocator", 42)
    assert not v.passed and "class" in v.message


def test_waste_simulation_counts_recomputed_tokens():
    reqs = waste.load_trace("sharegpt_like", limit=60)
    tight = waste.simulate(reqs, "paged", 4096, block_size=16)
    roomy = waste.simulate(reqs, "paged", 1 << 17, block_size=16)
    assert tight.preemptions > 0 and tight.recomputed_tokens >= tight.preemptions
    assert roomy.preemptions == 0 and roomy.recomputed_tokens == 0


def test_gpu_serving_model_is_labelled_and_favours_paging(tmp_path):
    reqs = waste.load_trace("sharegpt_like", limit=100)
    base, paged = pviz.gpu_serving_model(reqs)
    assert (base.policy, paged.policy) == ("max_len", "paged")
    assert paged.mean_running > base.mean_running and paged.tokens_per_s > base.tokens_per_s
    assert base.kv_slots == paged.kv_slots > 10_000
    fig = pviz.plot_gpu_serving_model([base, paged])
    assert "MODEL" in fig.texts[0].get_text()
    with pytest.raises(ValueError, match="no room"):
        pviz.gpu_serving_model(reqs, memory_fraction=0.3)


def test_notebook_04_figures_draw(tmp_path):
    reqs = waste.load_trace("sharegpt_like", limit=40)
    caps = (1024, 2048)
    capped = [waste.simulate(reqs, "max_len", 16384, max_tokens=c) for c in caps]
    paged = waste.simulate(reqs, "paged", 16384)
    pviz.plot_cap_sweep(capped, caps, paged).savefig(tmp_path / "caps.png")
    with pytest.raises(ValueError, match="caps"):
        pviz.plot_cap_sweep(capped, caps[:1], paged)
    sweep = waste.block_size_sweep(reqs, 16384, block_sizes=(4, 16))
    fig = pviz.plot_block_size_tradeoff(16, sweep, {4: 2.0, 16: 1.0}, "cpu",
                                        {4: (1.5, 2.5), 16: (0.9, 1.2)})
    assert fig.axes[1].get_ylim()[1] >= 2.5
    fig = pviz.plot_prefix_cache([[0.2, 0.3, 0.25], [0.2, 0.21, 0.3]], [[0.2, 0.3, 0.2], [0.1]],
                                 0.5, [0, 96])
    assert "96 cached" in fig.axes[0].get_xticklabels()[1].get_text()


# -- notebook 05 --------------------------------------------------------------------------------

def test_dry_run_counts_what_the_engine_counts():
    """The scheduler without the model takes the same steps as the engine with it."""
    import llmlab
    from llmlab.engine import LLM, SamplingParams

    model = llmlab.load_model("tiny-llama", attention="sdpa")
    tok = llmlab.load_tokenizer("tiny-llama")
    prompt_lens, outs = [5, 9, 3, 12, 7, 4], [6, 2, 9, 4, 5, 3]
    prompts = [list(range(100 * i + 10, 100 * i + 10 + n)) for i, n in enumerate(prompt_lens)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    for policy in ("continuous", "static"):
        llm = LLM(model, tok, scheduler=policy, max_num_seqs=3, num_blocks=10, block_size=4,
                  enable_prefix_caching=False)
        llm.generate(prompts, params, use_tqdm=False)
        run = serving.dry_run(prompt_lens, outs, policy, max_num_seqs=3, num_blocks=10,
                              block_size=4)
        assert run.output_tokens == outs and not run.finished_twice
        assert run.iterations == len(llm.stats.steps)
        assert run.stats.computed_tokens == llm.stats.computed_tokens
        assert run.stats.num_preemptions == llm.stats.num_preemptions
        assert [r.occupancy for r in run.stats.steps] == [r.occupancy for r in llm.stats.steps]
    assert run.stats.padding_tokens > 0                  # static pads its prompts


def test_dry_run_reports_a_stall_and_bad_input():
    def idle(sched, now):
        return nb05.SchedulerOutput()

    with pytest.raises(serving.SchedulerStall, match="nothing was scheduled"):
        serving.dry_run([4, 4], [2, 2], idle)
    with pytest.raises(ValueError, match="equal length"):
        serving.dry_run([4], [2, 2])


def test_schedule_check_reports_what_the_function_raised():
    v = exercises.check("nb05.schedule", lambda sched, now: sched.nothing)
    assert not v.passed and "AttributeError" in v.message


def test_notebook_05_figures_draw(tmp_path):
    run = serving.dry_run([5, 9, 3], [4, 2, 6], "static", max_num_seqs=2)
    serving.plot_occupancy({"static": run.stats}, 2).savefig(tmp_path / "occ.png")
    fig = serving.plot_rounds({"a": [1.0, 2.0, 1.5], "b": [3.0, 3.5, 2.5]}, "tok/s")
    assert "3 runs" in fig.axes[0].get_xlabel()
    with pytest.raises(ValueError, match="non-empty"):
        serving.plot_rounds({"a": []}, "tok/s")


def test_load_sweep_gives_percentiles_with_intervals_at_each_rate(tmp_path):
    import llmlab
    from llmlab.engine import LLM

    model = llmlab.load_model("tiny-llama", attention="sdpa")
    tok = llmlab.load_tokenizer("tiny-llama")
    llms = {p: LLM(model, tok, scheduler=p, max_num_seqs=2, num_blocks=64, block_size=4)
            for p in ("static", "continuous")}
    prompts = [[5 + i, 6, 7] for i in range(6)]
    outs = [3, 9, 2, 6, 4, 8]
    caps = {p: serving.capacity(e, prompts, outs) for p, e in llms.items()}
    assert all(c > 0 for c in caps.values())
    rows = serving.load_sweep(llms, prompts, outs, [50.0, 5000.0])
    assert [(r["policy"], r["rate"]) for r in rows] == [
        ("static", 50.0), ("continuous", 50.0), ("static", 5000.0), ("continuous", 5000.0)]
    for r in rows:
        assert r["requests"] == 6 and r["output_tokens"] == sum(outs)
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] <= r["tpot_p99_s"]
        lo, hi = r["ttft_p99_ci"]
        assert lo <= r["ttft_p99_s"] <= hi and r["stall_max_s"] > 0
    serving.plot_load_sweep(rows, capacities=caps).savefig(tmp_path / "load.png")
    with pytest.raises(ValueError, match="rates"):
        serving.load_sweep(llms, prompts, outs, [0.0])
    with pytest.raises(ValueError, match="equal length"):
        serving.load_sweep(llms, prompts, outs[:2], [1.0])
