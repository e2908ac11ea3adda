"""The vLLM-shaped API: SamplingParams validation, LLM arguments, input order, metrics,
chat template, streaming, and greedy parity with generating alone on smollm2-135m."""
import math

import pytest

import llmlab
from llmlab.engine import LLM, SamplingParams

from .conftest import FRANCE


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("tiny-llama", max_num_seqs=4, block_size=4, num_blocks=64)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.5), "temperature=-0.5 must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=0), "top_k=0 must be an int >= 1, or None / -1"),
    (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
    (dict(n=0), "n=0 must be an int >= 1"),
    (dict(n=2, temperature=0), "n=2 needs temperature > 0"),
    (dict(stop=[""]), "stop="),
    (dict(seed="7"), "seed='7' must be an int or None"),
])
def test_sampling_params_reject_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop="END")
    assert p.top_k is None and p.stop == ["END"] and p.temperature == 1.0 and p.max_tokens == 16
    assert SamplingParams(temperature=0).greedy and not p.greedy


def test_llm_rejects_bad_arguments(tiny_llm):
    with pytest.raises(ValueError, match=r"kv_cache='contiguous'; allowed: \['paged'\]"):
        LLM(tiny_llm.model, tiny_llm.tokenizer, kv_cache="contiguous")
    with pytest.raises(ValueError, match=r"scheduler='fifo'; allowed: \['static', 'continuous'\]"):
        LLM(tiny_llm.model, tiny_llm.tokenizer, scheduler="fifo")
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        LLM(tiny_llm.model, tiny_llm.tokenizer, block_size=12)
    with pytest.raises(ValueError, match="max_model_len=99999"):
        LLM(tiny_llm.model, tiny_llm.tokenizer, max_model_len=99999)
    with pytest.raises(ValueError, match=r"paged_attention='fast'; allowed: \['paged', "):
        LLM(tiny_llm.model, tiny_llm.tokenizer, paged_attention="fast")
    with pytest.raises(ValueError, match="one SamplingParams or a list of 2"):
        tiny_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="a prompt must be a string"):
        tiny_llm.generate([3.5], use_tqdm=False)


def test_generate_keeps_input_order_and_reports_metrics(tiny_llm):
    prompts = ["a " * n for n in (30, 2, 17, 5, 9, 1)]
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 1, 6, 2, 4)]
    outs = tiny_llm.generate(prompts, sp, use_tqdm=True)
    tok = tiny_llm.tokenizer
    for p, s, o in zip(prompts, sp, outs):
        assert o.prompt == p and o.prompt_token_ids == tok(p)["input_ids"]
        m = o.metrics
        assert m.output_tokens == len(o.outputs[0].token_ids) == s.max_tokens
        assert 0 < m.ttft_s <= m.e2e_s
        assert math.isnan(m.tpot_s) if s.max_tokens == 1 else m.tpot_s > 0
    assert outs[0].request_id < outs[1].request_id


def test_arrival_times_delay_the_first_token(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = tiny_llm.generate(["x y", "z"], sp, use_tqdm=False, arrival_times=[0.0, 0.3])
    start = tiny_llm.stats.steps[0].start_s
    late = outs[1].outputs[0].metrics
    # measured from its own arrival, and it could not start before it arrived
    assert late.ttft_s < 0.3
    assert tiny_llm.engine.now() - start >= 0.3


def test_chat_applies_the_template(tiny_llm):
    msgs = [{"role": "user", "content": "Hi there"}]
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    want = tiny_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.prompt == want
    assert out.prompt_token_ids == tiny_llm.tokenizer(want, add_special_tokens=False)["input_ids"]
    two = tiny_llm.chat([msgs, msgs], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tiny_llm.chat([{"text": "hi"}])


def test_stream_yields_the_same_tokens_as_generate(tiny_llm):
    prompts = ["one two three", "four"]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = tiny_llm.generate(prompts, sp, use_tqdm=False)
    got = {0: [], 1: []}
    text = {0: "", 1: ""}
    finished = []
    for ev in tiny_llm.stream(prompts, sp):
        got[ev.index].append(ev.token_id)
        text[ev.index] += ev.text
        if ev.finished:
            finished.append(ev.index)
    assert [got[0], got[1]] == [o.outputs[0].token_ids for o in want]
    assert [text[0], text[1]] == [o.outputs[0].text for o in want]
    assert sorted(finished) == [0, 1]


def test_smollm2_greedy_equals_generating_alone(smollm2, tokenizer):
    prompts = [FRANCE, "The three primary colors are", "def fibonacci(n):"]
    lens = [8, 6, 10]
    llm = LLM(smollm2, tokenizer, max_num_seqs=3, block_size=16, num_blocks=16)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lens],
                        use_tqdm=False)
    for p, n, o in zip(prompts, lens, outs):
        ref = llmlab.generate(smollm2, tokenizer, p, max_new_tokens=n, chat=False)
        assert o.outputs[0].token_ids == ref.token_ids, p
        assert o.outputs[0].text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert llm.stats.padding_tokens == 0 and len(llm.stats.steps) == max(lens)


def test_llm_takes_a_hand_written_schedule_function(tiny_llm):
    from llmlab.engine.scheduler import Scheduler

    calls = []

    def schedule(self, now):
        calls.append(now)
        return Scheduler._schedule_continuous(self, now)

    llm = LLM(tiny_llm.model, tiny_llm.tokenizer, scheduler=schedule, max_num_seqs=4,
              block_size=4, num_blocks=64)
    prompts = ["one two three", "four", "five six"]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    assert len(calls) == len(llm.stats.steps) and llm.engine.config.policy == "continuous"
