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
