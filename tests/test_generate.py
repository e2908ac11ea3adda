import pytest
import torch

import llmlab
from llmlab.engine.sampler import filter_logits, sample

from .conftest import FRANCE


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
