"""The OpenAI sampling controls in the engine: presence / frequency / repetition penalties
and logprobs, against a plain-PyTorch reference on tiny-llama (full recompute, the
penalty formulas written out by hand), their validation, their visible effect, and
seeded n > 1 sampling with them."""
import pytest
import torch

import llmlab
from llmlab.engine import LLM, SamplingParams
from llmlab.sampling import apply_penalties

TOL = 1e-4          # logprobs: paged engine vs full recompute, float32


@pytest.fixture(scope="module")
def llm(tiny, tiny_tok):
    return LLM(tiny, tiny_tok, max_num_seqs=8, block_size=4, num_blocks=128)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


# -- the reference: no cache, no library sampler ---------------------------------------------

@torch.no_grad()
def ref_logits(model, ids):
    return model(torch.tensor([ids]))[0, -1].float()


def ref_penalize(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0,
                 wrong=None):
    """The formulas token by token. ``wrong`` picks a plausible mistake, to show the
    comparison catches it."""
    logits = logits.clone()
    rep_tokens = set(out) if wrong == "repetition on output only" else set(prompt) | set(out)
    for t in rep_tokens:
        x = logits[t]
        logits[t] = x / repetition if x > 0 else x * repetition
    counted = prompt + out if wrong == "presence/frequency on prompt too" else out
    for t in set(counted):
        logits[t] -= frequency * counted.count(t) + presence
    return logits


def ref_run(model, prompt, tokens=None, max_tokens=8, temperature=0.0, wrong=None, **pen):
    """Greedy tokens (or the given ``tokens``, teacher-forced) and the processed
    log-probabilities [step, vocab] each was chosen from."""
    out, lps = [], []
    for step in range(max_tokens if tokens is None else len(tokens)):
        logits = ref_penalize(ref_logits(model, prompt + out), prompt, out, wrong=wrong, **pen)
        lps.append(torch.log_softmax(logits / (temperature or 1.0), dim=-1))
        out.append(int(logits.argmax()) if tokens is None else tokens[step])
    return out, lps


def logprob_error(completion, ref_lps, num_top):
    """Max |engine - reference| over the reported logprobs; also checks which tokens are
    reported: the reference's top ``num_top`` and the chosen one."""
    err = 0.0
    for tok, got, ref in zip(completion.token_ids, completion.logprobs, ref_lps):
        want = set(torch.topk(ref, num_top).indices.tolist()) | {tok} if num_top else {tok}
        assert set(got) == want
        err = max(err, max(abs(v - float(ref[t])) for t, v in got.items()))
    cum = sum(float(ref[t]) for t, ref in zip(completion.token_ids, ref_lps))
    return max(err, abs(completion.cumulative_logprob - cum))


PENALTIES = [  # (presence, frequency, repetition): each one changes the greedy tokens here
    dict(presence=-1.5, frequency=0.6, repetition=1.0),   # repeats a token 3 times, then not
    dict(presence=0.0, frequency=0.0, repetition=0.35),   # pulls positive prompt tokens up
    dict(presence=0.7, frequency=0.2, repetition=1.8),
    dict(presence=0.0, frequency=0.0, repetition=1.0),    # none
]


def as_params(pen, **kw):
    return SamplingParams(presence_penalty=pen["presence"], frequency_penalty=pen["frequency"],
                          repetition_penalty=pen["repetition"], **kw)


def test_penalties_and_logprobs_match_the_reference_in_one_batch(tiny, llm):
    prompts = prompts_of([12, 5, 9, 7], seed=1)
    sps = [as_params(pen, temperature=0, max_tokens=8, ignore_eos=True, logprobs=n)
           for pen, n in zip(PENALTIES, (5, 0, 20, 3))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    worst = 0.0
    for prompt, pen, sp, out in zip(prompts, PENALTIES, sps, outs):
        c = out.outputs[0]
        ref_tokens, ref_lps = ref_run(tiny, prompt, **pen)
        assert c.token_ids == ref_tokens
        worst = max(worst, logprob_error(c, ref_lps, sp.logprobs))
    print(f"max |logprob error| = {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize("wrong", ["repetition on output only", "presence/frequency on prompt too"])
def test_the_comparison_catches_a_wrong_formula(tiny, llm, wrong):
    prompt = prompts_of([12], seed=1)[0]
    for pen in PENALTIES[:2]:
        got = llm.generate([prompt], as_params(pen, temperature=0, max_tokens=8,
                                               ignore_eos=True), use_tqdm=False)[0]
        bad, _ = ref_run(tiny, prompt, wrong=wrong, **pen)
        if got.outputs[0].token_ids != bad:
            return
    pytest.fail(f"the {wrong!r} variant gives the engine's tokens: the test cannot see it")


def test_penalties_in_llmlab_generate_match_the_engine(tiny, tiny_tok, llm):
    prompt = prompts_of([10], seed=4)[0]
    for pen in PENALTIES[:3]:
        want = llm.generate([prompt], as_params(pen, temperature=0, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)
        for kv_cache in ("none", "contiguous"):
            got = llmlab.generate(tiny, tiny_tok, [prompt], max_new_tokens=8, ignore_eos=True,
                                  kv_cache=kv_cache, presence_penalty=pen["presence"],
                                  frequency_penalty=pen["frequency"],
                                  repetition_penalty=pen["repetition"])
            assert got[0].token_ids == want[0].outputs[0].token_ids


def test_apply_penalties_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    prompts, outs = [[1, 2], [3], [4, 4]], [[5, 5, 1], [], [6]]
    pres, freq, rep = [0.5, -1.0, 2.0], [0.3, 0.0, -0.5], [1.2, 0.7, 1.0]
    both = apply_penalties(logits, prompts, outs, pres, freq, rep)
    for r in range(3):
        alone = apply_penalties(logits[r:r + 1], prompts[r:r + 1], outs[r:r + 1], pres[r],
                                freq[r], rep[r])
        ref = ref_penalize(logits[r], prompts[r], outs[r], pres[r], freq[r], rep[r])
        assert torch.allclose(both[r], alone[0]) and torch.allclose(both[r], ref)
    assert torch.equal(apply_penalties(logits, prompts, outs), logits)     # all off


@pytest.mark.parametrize("kw, match", [
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty=-3 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty="1"), "frequency_penalty='1'"),
    (dict(repetition_penalty=0), "repetition_penalty=0 must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty=inf"),
    (dict(logprobs=21), r"logprobs=21 must be None or an int in 0..20"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(logprobs=True), "logprobs=True"),
])
def test_bad_values_are_refused_by_name(tiny, tiny_tok, kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    penalties = {k: v for k, v in kw.items() if k.endswith("_penalty")}
    if penalties:      # llmlab.generate takes the penalties, through the same check
        with pytest.raises(ValueError, match=match):
            llmlab.generate(tiny, tiny_tok, [[5, 6]], max_new_tokens=2, **penalties)


def test_edge_values_are_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-3,
                   logprobs=0)
    assert SamplingParams(logprobs=20).logprobs == 20
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


def test_penalties_change_the_output_where_they_should(tiny, tiny_tok):
    llm = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=64)
    prompt = prompts_of([6], seed=2)[0]
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert len(set(plain.token_ids)) > 1
    # a negative presence penalty (+2 for any token already generated) repeats the first
    loop = llm.generate([prompt], SamplingParams(presence_penalty=-2, **greedy),
                        use_tqdm=False)[0].outputs[0]
    assert loop.token_ids == [plain.token_ids[0]] * 10
    # make one token the greedy choice everywhere; a large frequency penalty stops repeats
    x = plain.token_ids[1]
    bias = torch.zeros(tiny.config.vocab_size)
    bias[x] = 1.5
    handle = tiny.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    try:
        stuck = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
        freed = llm.generate([prompt], SamplingParams(frequency_penalty=2.0, **greedy),
                             use_tqdm=False)[0].outputs[0]
    finally:
        handle.remove()
    assert stuck.token_ids == [x] * 10
    assert freed.token_ids[0] == x and len(set(freed.token_ids)) == 10


def test_seeded_n_completions_with_penalties_and_logprobs(tiny, llm):
    """n = 3 sampled completions (forked prompt blocks) at temperature 0.7: each one's
    logprobs match the reference along its own tokens, and the same seed gives the same
    completions whatever shares the batch."""
    prompt = prompts_of([9], seed=5)[0]
    pen = dict(presence=0.4, frequency=0.3, repetition=1.3)
    sp = as_params(pen, n=3, temperature=0.7, top_p=0.9, max_tokens=6, seed=11,
                   ignore_eos=True, logprobs=2)
    a = llm.generate([prompt], sp, use_tqdm=False)[0]
    others = prompts_of([4, 13], seed=6)
    b = llm.generate([others[0], prompt, others[1]],
                     [SamplingParams(temperature=0.9, max_tokens=5, repetition_penalty=1.5),
                      sp, SamplingParams(temperature=0, max_tokens=7, logprobs=1)],
                     use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for ca, cb in zip(a.outputs, b.outputs):      # batch shapes change the last bits only
        assert [set(d) for d in ca.logprobs] == [set(d) for d in cb.logprobs]
        assert max(abs(d[t] - e[t]) for d, e in zip(ca.logprobs, cb.logprobs) for t in d) < 1e-5
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    worst = 0.0
    for c in a.outputs:
        _, ref_lps = ref_run(tiny, prompt, tokens=c.token_ids, temperature=0.7, **pen)
        worst = max(worst, logprob_error(c, ref_lps, 2))
    print(f"max |logprob error| (sampled, forked) = {worst:.2e}")
    assert worst < TOL
    assert llm.engine.cache.manager.num_used_blocks == 0


def test_logprobs_absent_unless_asked_and_streamed_when_asked(llm):
    prompt = prompts_of([5], seed=7)[0]
    off = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert off.logprobs is None and off.cumulative_logprob is None
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    done = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    events = list(llm.stream([prompt], sp))
    assert [e.logprobs for e in events] == done.logprobs
    assert all(len(d) == 1 for d in done.logprobs)     # greedy: the top one is the chosen one
