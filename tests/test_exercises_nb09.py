"""Notebook 09's exercises beyond the generic registry tests: the accept/reject checker runs
the student's rule inside SmolLM2's speculative generation, its distribution test has the
power to tell each realistic mistake from the rule, and odd answers get messages."""
import pytest
import torch

import llmlab
from llmlab import exercises
from llmlab.exercises import nb09
from llmlab.speculative import SpeculativeConfig, accept_reject

WRONG = ["always accepts", "accepts with p(d), ignoring q", "resamples from p instead of (p - q)+",
         "forgets the bonus token", "off by one in the accepted count"]


@pytest.mark.slow
def test_the_reference_passes_inside_real_generation():
    v = exercises.check("nb09.accept_reject", nb09.reference_accept_reject)
    assert v.passed, v.message
    assert "plain greedy's" in v.message and " 0 drafts accepted" not in v.message
    assert " 0 rejected" not in v.message          # the prompt exercises both branches


@pytest.mark.parametrize("label", WRONG)
def test_each_realistic_mistake_fails_and_is_named(label):
    ex = exercises.get("nb09.accept_reject")
    answer, words = ex.wrong_variants[label]
    v = ex.check(answer)
    assert not v.passed
    assert all(w in v.message for w in words), v.message


def test_the_distribution_test_passes_the_rule_and_rejects_resampling_from_p():
    for seed in (1, 2):
        r = nb09.distribution_test(nb09.reference_accept_reject, draws=3000, seed=seed)
        assert min(r["p_accepted"], r["p_first"], r["p_second"]) > nb09.P_VALUE
        assert r["accepted"].sum() == 3000
    bad = nb09.distribution_test(nb09._resamples_from_p, draws=3000, seed=1)
    assert bad["p_first"] < 1e-8 and bad["p_accepted"] > nb09.P_VALUE


@pytest.mark.slow
def test_the_library_rule_through_the_adapter_gives_greedy_tokens(smollm2, tokenizer):
    """The hook the checker uses: the library's own accept_reject (and the reference through
    the one-sequence adapter) plugged into greedy speculation give plain greedy's tokens."""
    ref = llmlab.generate(smollm2, tokenizer, nb09.GREEDY_PROMPT, max_new_tokens=20,
                          kv_cache="contiguous").token_ids
    for fn in (accept_reject, nb09.as_library_rule(nb09.reference_accept_reject)):
        spec = SpeculativeConfig("ngram", num_tokens=3, accept_fn=fn)
        g = llmlab.generate(smollm2, tokenizer, nb09.GREEDY_PROMPT, max_new_tokens=20,
                            speculative=spec)
        assert g.token_ids == ref
        assert sum(g.speculative.accepted_per_step) > 0


def test_answers_of_the_wrong_form_get_messages():
    ex = exercises.get("nb09.accept_reject")
    assert "not yet" in str(ex.check(ex.placeholder))
    assert "pass your function" in ex.check(42).message
    v = ex.check(lambda p, q, drafts, generator=None: None)
    assert not v.passed and "non-empty list" in v.message
    v = ex.check(lambda p, q, drafts, generator=None: list(drafts) + [0, 0])
    assert not v.passed and "at most 3" in v.message
    v = ex.check(lambda p, q, drafts, generator=None: torch.tensor([1 / 0]))
    assert not v.passed and "ZeroDivisionError" in v.message


def test_predict_best_k_against_a_measurement():
    measured = {1: 1.2, 2: 1.45, 4: 1.5, 8: 1.1}
    assert exercises.check("nb09.predict_best_k", 4, measured=measured).passed
    assert exercises.check("nb09.predict_best_k", 2, measured=measured).passed   # within 5%
    v = exercises.check("nb09.predict_best_k", 8, measured=measured)
    assert not v.passed and "k = 4 gives 1.50x" in v.message
    assert "one of k" in exercises.check("nb09.predict_best_k", 3).message
    # without a measurement: the cost model, here with cheap, reliable drafts
    assert exercises.check("nb09.predict_best_k", 8, alpha=0.95, c=0.01).passed


# ---- the main build: one speculative step ----------------------------------------------------

STEP_WRONG = ["forgets the roll-back", "reads the token after draft i from row i + 1",
              "forgets the bonus token", "verifies one token per forward",
              "calls llmlab's own greedy_accept"]


@pytest.mark.slow
def test_the_reference_step_passes_and_every_branch_occurred():
    v = exercises.check("nb09.speculative_step", nb09.reference_speculative_step)
    assert v.passed, v.message
    assert "plain greedy's" in v.message
    assert " 0 steps took the bonus" not in v.message and " 0 rejected every" not in v.message
    assert " 0 drafts accepted" not in v.message and " 0 rolled back" not in v.message


@pytest.mark.parametrize("label", STEP_WRONG)
def test_each_step_mistake_fails_and_is_named(label):
    ex = exercises.get("nb09.speculative_step")
    answer, words = ex.wrong_variants[label]
    v = ex.check(answer)
    assert not v.passed
    assert all(w in v.message for w in words), v.message


def test_wrappers_around_llmlabs_verify_fail():
    """A step that hands the decision to llmlab's verify (the function speculative_token_ids
    uses) is refused, and the library works again after the check."""
    from llmlab import speculative

    def wraps_verify(model, cache, seq, draft, k):
        drafts = [int(d) for d in draft(seq, k)][:k]
        ids = torch.tensor([[seq[-1]] + drafts])
        start = cache.length
        logits = model.step(ids, cache.begin(ids.shape[1]), cache)[0]
        cache.advance()
        n, nxt = speculative.verify(logits, drafts, None, None, 0.0, None, None, None)
        cache.truncate(start + n + 1)
        return drafts[:n] + [nxt]

    v = exercises.check("nb09.speculative_step", wraps_verify)
    assert not v.passed and "llmlab's own" in v.message and "verify" in v.message
    assert speculative.greedy_accept([1, 2, 3], [1, 5]) == (1, 2)


def test_step_answers_of_the_wrong_form_get_messages():
    ex = exercises.get("nb09.speculative_step")
    assert "not yet" in str(ex.check(ex.placeholder))
    assert "pass your function" in ex.check("step").message

    def returns_nothing(model, cache, seq, draft, k):
        draft(seq, k)
        return []

    v = ex.check(returns_nothing)
    assert not v.passed and "non-empty list" in v.message

    def never_drafts(model, cache, seq, draft, k):
        return nb09.reference_speculative_step(model, cache, seq, lambda s, kk: [], k)

    v = ex.check(never_drafts)
    assert not v.passed and "draft(seq, k) 0 times" in v.message


def test_generate_with_step_is_plain_greedy_on_tiny_llama(tokenizer):
    """The loop the notebook runs a student's step in: with the reference step and prompt
    lookup it gives llmlab.generate's greedy tokens, and its statistics add up."""
    tiny = llmlab.load_model("tiny-llama")
    prompt = "Copy this list: apples, pears, plums, apples, pears, plums."
    ref = llmlab.generate(tiny, tokenizer, prompt, max_new_tokens=24, kv_cache="contiguous",
                          ignore_eos=True)
    tokens, stats = nb09.generate_with_step(nb09.reference_speculative_step, tiny,
                                            ref.prompt_token_ids, nb09.ngram_draft, k=3,
                                            max_new_tokens=24)
    assert tokens == ref.token_ids
    assert stats.num_generated == 24
    assert stats.num_generated <= 1 + sum(a + 1 for a in stats.accepted_per_step)
    assert all(0 <= a <= d <= 3 for a, d in zip(stats.accepted_per_step,
                                                 stats.drafted_per_step))


def test_the_noisy_oracle_spoils_one_draft_per_step_in_a_cycle():
    ref = list(range(100, 120))
    oracle = nb09.NoisyOracle(ref, prompt_len=5, vocab_size=1000)
    seq = [0] * 5 + ref[:2]
    spoiled = []
    for _ in range(6):
        out = oracle(seq, 4)
        spoiled.append([i for i, (a, b) in enumerate(zip(out, ref[2:6])) if a != b])
    assert spoiled == [[0], [1], [2], [3], [], []]


@pytest.mark.slow
def test_a_verify_of_nine_tokens_costs_far_less_than_nine_decode_steps(smollm2):
    """The early-exit explanation (d) says a verify of up to 9 tokens costs far less than
    k + 1 decode steps here: measured on SmolLM2 (best of 6 runs each, interleaved)."""
    from llmlab.cache import ContiguousKVCache

    cache = ContiguousKVCache.for_model(smollm2, 1, 120)
    ctx = torch.randint(0, 1000, (1, 100))
    best = {1: float("inf"), 9: float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # the thread's CPU time is then the forward's
    try:
        _time_forwards(smollm2, cache, ctx, best)
    finally:
        torch.set_num_threads(threads)
    assert best[9] < 5 * best[1], best


def _time_forwards(smollm2, cache, ctx, best):
    import time

    with torch.inference_mode():
        smollm2(ctx, positions=cache.begin(100), cache=cache)
        cache.advance()
        for _ in range(6):
            for w in best:
                t = time.thread_time()
                smollm2(ctx[:, -w:], positions=cache.begin(w), cache=cache)
                cache.advance()
                best[w] = min(best[w], time.thread_time() - t)
                cache.truncate(100)


def test_predict_best_k_calls_a_tie_with_the_fastest_right_and_a_resolved_loser_wrong():
    times = {1: [10.0, 10.2, 9.9], 2: [8.0, 8.1, 7.9], 4: [7.9, 8.3, 7.7], 8: [9.0, 9.1, 8.9]}
    measured = {k: 10.0 / sorted(v)[1] for k, v in times.items()}
    v4 = exercises.check("nb09.predict_best_k", 4, measured=measured, times=times)
    v2 = exercises.check("nb09.predict_best_k", 2, measured=measured, times=times)
    assert v4.passed and v2.passed and "cannot tell it from" in v2.message
    v8 = exercises.check("nb09.predict_best_k", 8, measured=measured, times=times)
    assert not v8.passed and "k = 4" in v8.message
