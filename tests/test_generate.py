import pytest
import torch

import llmlab
from llmlab.engine import SamplingParams
from llmlab.parallel.generate import greedy_generate
from llmlab.prompts import check_token_ids
from llmlab.sampling import check_sampling_args, filter_logits, sample

from .conftest import FRANCE


@pytest.mark.smoke
def test_greedy_matches_transformers(smollm2, tokenizer, hf_smollm2):
    ours = llmlab.generate(smollm2, tokenizer, FRANCE, max_new_tokens=24)
    enc = tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    ref = hf_smollm2.generate(**enc, max_new_tokens=24, do_sample=False)
    ref = ref[0, enc["input_ids"].shape[1]:].tolist()
    assert ours.token_ids == ref
    assert "Paris" in ours.text
    assert ours.finish_reason == "stop" and ours.metrics.output_tokens == len(ref)


@pytest.mark.slow
def test_batch_gives_what_each_prompt_gets_alone(smollm2, tokenizer):
    prompts = [FRANCE, "Name three primary colors.", "2+2="]
    batch = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=8)
    for p, got in zip(prompts, batch):
        alone = llmlab.generate(smollm2, tokenizer, p, max_new_tokens=8)
        assert got.token_ids == alone.token_ids, p


def test_seeded_sampling_is_reproducible():
    model = llmlab.load_model("tiny-llama")
    tok = llmlab.load_tokenizer("smollm2-135m")
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, chat=False)
    a = llmlab.generate(model, tok, "Once upon a time", seed=7, **kw)
    b = llmlab.generate(model, tok, "Once upon a time", seed=7, **kw)
    c = llmlab.generate(model, tok, "Once upon a time", seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    k2 = filter_logits(logits, top_k=2)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = torch.softmax(logits, -1)[0]  # 0.636, 0.234, 0.086, ...
    kept = torch.isfinite(filter_logits(logits, top_p=0.8)[0])
    assert kept.tolist() == [True, True, False, False, False]
    assert p[:1].sum() < 0.8 <= p[:2].sum()
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
    assert int(sample(logits, 0.0)) == 0


def test_bad_generation_arguments(tokenizer):
    model = llmlab.load_model("tiny-llama")
    with pytest.raises(ValueError, match="temperature=-1"):
        llmlab.generate(model, tokenizer, "hi", temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        llmlab.generate(model, tokenizer, "hi", temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        llmlab.generate(model, tokenizer, "hi", max_new_tokens=0)
    long = "word " * (model.config.max_position_embeddings + 10)
    with pytest.raises(ValueError, match="does not fit the model's context of 2048 tokens"):
        llmlab.generate(model, tokenizer, long, chat=False)


def test_top_k_minus_one_means_no_filter_everywhere():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.equal(filter_logits(logits, top_k=-1), logits)
    assert SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(top_p=None).top_p == 1.0       # None is "no filter" in both APIs


@pytest.fixture(scope="module")
def tiny():
    return llmlab.load_model("tiny-llama")


BAD_SAMPLING = [
    (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature=-1), "temperature=-1"),
    (dict(temperature="0.5"), "temperature='0.5'"),
    (dict(top_k=-2), "top_k=-2 must be an int >= 1, or None / 0 / -1"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(top_k=True), "top_k=True"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(seed="7"), "seed='7' must be an int or None"),
]


@pytest.mark.parametrize("kw, match", BAD_SAMPLING)
def test_generate_and_sampling_params_refuse_the_same_values(kw, match, tiny, tokenizer):
    full = {"temperature": 1.0, **kw}       # sampling on, so every argument is read
    with pytest.raises(ValueError, match=match):
        SamplingParams(**full)
    with pytest.raises(ValueError, match=match):
        llmlab.generate(tiny, tokenizer, "hi", max_new_tokens=2, **full)


def test_each_api_names_its_own_token_limit(tiny, tokenizer):
    with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens=1.5 must be an int >= 1"):
        llmlab.generate(tiny, tokenizer, "hi", max_new_tokens=1.5)
    check_sampling_args(0.0, -1, None, 1, 3)                    # all allowed values
    check_sampling_args(0.7, 5, 1.0)


@pytest.mark.parametrize("ids, match", [
    ([1, 2, 49152], "token id 49152 at position 2 is out of range for a vocabulary of "
                    r"49152 tokens \(allowed: 0..49151\)"),
    ([-1, 5], "token id -1 at position 0 is out of range"),
    ([3, 4.0], "token id 4.0 at position 1 is not an int"),
])
def test_token_ids_are_range_checked_on_every_simple_path(ids, match, tiny, tokenizer):
    with pytest.raises(ValueError, match=match):
        check_token_ids(ids, tiny.config.vocab_size)
    with pytest.raises(ValueError, match=match):
        llmlab.generate(tiny, tokenizer, [ids], max_new_tokens=2)
    if all(isinstance(t, int) for t in ids):                  # the tensor-parallel loop
        with pytest.raises(ValueError, match=match):
            greedy_generate(tiny, ids, 2)
    # the model stays usable, and in-range ids of every integer type pass
    good = [1, torch.tensor(2), 49151]
    check_token_ids(good, tiny.config.vocab_size)
    assert len(llmlab.generate(tiny, tokenizer, [[1, 2, 49151]], max_new_tokens=2)[0].token_ids) == 2
