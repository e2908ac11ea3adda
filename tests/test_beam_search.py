"""LLM.beam_search on tiny-llama: token for token equal to a plain-PyTorch beam search
(full recompute, no cache) for widths 1..4, with and without end-of-sequence beams and
length penalties; width 1 is greedy; the beams share KV blocks and free them all."""
import math

import pytest
import torch

import llmlab
from llmlab.engine import LLM, BeamSearchParams, SamplingParams

BS = 4          # block size


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, llmlab.load_tokenizer("tiny-llama"), max_num_seqs=8, block_size=BS,
               num_blocks=160)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def ref_beam_search(model, prompt, width, max_tokens, eos, ignore_eos=False,
                    length_penalty=1.0):
    """The textbook search, written out: every step recomputes each beam from scratch.
    -> [(tokens, cumulative logprob, score)], best first."""
    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        proposals = []
        for out, cum in live:
            logits = model(torch.tensor([prompt + out]))[0, -1].float()
            values, ids = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, tok in zip(values.tolist(), ids.tolist()):
                if tok == eos and not ignore_eos:
                    done.append((out + [tok], cum + lp))
                else:
                    proposals.append((out + [tok], cum + lp))
        proposals.sort(key=lambda b: b[1], reverse=True)
        live = proposals[:width]
    ranked = [(t, c, c / len(t) ** length_penalty) for t, c in done + live]
    ranked.sort(key=lambda b: b[2], reverse=True)
    return ranked[:width]


def assert_same_beams(got, want):
    assert [s.token_ids for s in got.sequences] == [t for t, _, _ in want]
    err = max(abs(s.cumulative_logprob - c) for s, (_, c, _) in zip(got.sequences, want))
    assert err < 1e-4, err
    assert all(math.isclose(s.score, sc, rel_tol=1e-5)
               for s, (_, _, sc) in zip(got.sequences, want))
    return err


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_beam_search_matches_the_reference(tiny, llm, width):
    prompts = prompts_of([9, 3], seed=width)
    outs = llm.beam_search(prompts, width, 6)
    errs = []
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt and len(out.sequences) == width
        want = ref_beam_search(tiny, prompt, width, 6, llm.engine.eos_token_id)
        errs.append(assert_same_beams(out, want))
        assert all(s.finish_reason == "length" for s in out.sequences)
        assert all(len(s.logprobs) == 6 and math.isclose(sum(s.logprobs), s.cumulative_logprob,
                                                         abs_tol=1e-4) for s in out.sequences)
    print(f"width {width}: max |cumulative logprob error| = {max(errs):.1e}")
    assert llm.engine.cache.manager.num_used_blocks == 0


def test_width_one_is_greedy(llm):
    prompt = prompts_of([7], seed=9)[0]
    beam = llm.beam_search([prompt], 1, 8, ignore_eos=True)[0].sequences[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert beam.token_ids == greedy.token_ids and beam.text == greedy.text


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_eos_beams_and_length_penalty_match_the_reference(tiny, llm, length_penalty):
    """Raise the end-of-sequence logit to the top of the range, so that some proposals end
    there: finished beams of different lengths are then ranked by the normalised score."""
    eos = llm.engine.eos_token_id
    handle = tiny.lm_head.register_forward_hook(
        lambda m, i, o: o.index_fill(-1, torch.tensor([eos]), 0.61))
    try:
        prompt = prompts_of([6], seed=3)[0]
        got = llm.beam_search([prompt], BeamSearchParams(3, 6, length_penalty=length_penalty))[0]
        want = ref_beam_search(tiny, prompt, 3, 6, eos, length_penalty=length_penalty)
    finally:
        handle.remove()
    assert_same_beams(got, want)
    ended = [s for s in got.sequences if s.finish_reason == "stop"]
    assert all(s.token_ids[-1] == eos for s in ended)
    if length_penalty == 0.0:       # raw sums: a short finished beam wins
        assert got.sequences[0].finish_reason == "stop"
    assert llm.engine.cache.manager.num_used_blocks == 0


def test_beams_share_blocks_and_free_them_all(llm):
    prompt, width, n = prompts_of([40], seed=1)[0], 4, 8
    bm = llm.engine.cache.manager
    out = llm.beam_search([prompt], width, n)[0]
    assert len(out.sequences) == width
    used = [bm.num_blocks - r.free_blocks for r in llm.stats.steps]
    unshared = width * -(-(len(prompt) + n) // BS)       # every beam with its own blocks
    print(f"peak blocks in use: {max(used)} (unshared: {unshared})")
    assert len(used) == n and max(used) < unshared
    # the prompt once, then per beam at most its own tail and one copied block
    assert max(used) <= -(-len(prompt) // BS) + width * (-(-n // BS) + 1)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_a_failed_search_frees_its_blocks(tiny, llm):
    calls = []

    def fail_on_third(m, i, o):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")

    handle = tiny.lm_head.register_forward_hook(fail_on_third)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            llm.beam_search(prompts_of([10, 5]), 3, 6)
    finally:
        handle.remove()
    assert llm.engine.cache.manager.num_used_blocks == 0
    llm.engine.cache.manager.check_invariants()


def test_params_object_equals_plain_numbers_and_bad_input_is_refused(llm):
    prompt = prompts_of([5], seed=2)[0]
    a = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3))[0]
    b = llm.beam_search([prompt], 2, 3)[0]
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    with pytest.raises(ValueError, match="beam_width=0 must be an int >= 1"):
        llm.beam_search([prompt], 0, 3)
    with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
        BeamSearchParams(2, 0)
    with pytest.raises(ValueError, match="length_penalty=nan must be a finite number"):
        BeamSearchParams(2, 3, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="needs max_tokens"):
        llm.beam_search([prompt], 2)
    with pytest.raises(ValueError, match="not both"):
        llm.beam_search([prompt], BeamSearchParams(2, 3), 3)
    with pytest.raises(ValueError, match="does not fit the context"):
        llm.beam_search([[5] * 2048], 2, 3)
    assert llm.engine.cache.manager.num_used_blocks == 0
