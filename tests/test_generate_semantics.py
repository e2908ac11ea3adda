"""One generation semantics: a short prompt batched with a long one gets exactly the tokens
it would get alone, on every path (no cache, contiguous, paged, the serving engine, tensor
parallelism), including where the long one runs into the end of the context."""
import contextlib
import dataclasses

import pytest
import torch

import llmlab
from llmlab.engine import LLM, SamplingParams
from llmlab.generate import generate_token_ids
from llmlab.prompts import encode_prompts
from llmlab.stopping import finish_reason, token_budget

from .conftest import FRANCE

PATHS = [dict(kv_cache="none"), dict(kv_cache="contiguous"),
         dict(kv_cache="paged", block_size=8), dict(kv_cache="paged", block_size=4,
                                                    paged_attention="paged_sdpa")]


@contextlib.contextmanager
def context_of(model, ctx):
    """The model with its context cut to ``ctx`` tokens: the same rule as at 2,048 or 8,192
    tokens, at a size a CPU runs in seconds."""
    full = model.config
    model.config = dataclasses.replace(full, max_position_embeddings=ctx)
    try:
        yield model
    finally:
        model.config = full


def short_and_long(ctx, room, seed=0):
    """A 5-token prompt and one that leaves ``room`` tokens of the ``ctx``-token context."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, ctx - room)]


def test_the_stopping_rule():
    kw = dict(eos_token_id=2, ignore_eos=False, max_tokens=4, max_len=10)
    assert finish_reason(2, 1, 5, **kw) == "stop"
    assert finish_reason(2, 1, 5, **{**kw, "ignore_eos": True}) is None
    assert finish_reason(7, 4, 8, **kw) == "length"           # max_tokens
    assert finish_reason(7, 2, 10, **kw) == "length"          # the context is full
    assert finish_reason(7, 2, 9, **kw) is None
    assert token_budget(3, 4, 10) == 4 and token_budget(8, 4, 10) == 2
    with pytest.raises(ValueError, match="prompt of 10 tokens does not fit the context of 10"):
        token_budget(10, 4, 10)


def test_tiny_llama_short_beside_long_on_every_path(tiny, tiny_tok):
    """The long prompt has room for 4 tokens, the short one gets all 12, batched as alone,
    with the same finish reasons, on every path."""
    ctx = 160
    prompts = short_and_long(ctx, room=4)
    want = None
    with context_of(tiny, ctx):
        for kw in PATHS:
            batched = llmlab.generate(tiny, tiny_tok, prompts, max_new_tokens=12,
                                      ignore_eos=True, **kw)
            alone = [llmlab.generate(tiny, tiny_tok, [p], max_new_tokens=12, ignore_eos=True,
                                     **kw)[0] for p in prompts]
            got = [(g.token_ids, g.finish_reason) for g in batched]
            assert got == [(g.token_ids, g.finish_reason) for g in alone], kw
            assert [len(t) for t, _ in got] == [12, 4] and {r for _, r in got} == {"length"}
            want = want or got
            assert got == want, kw                  # and every path agrees with the others
        llm = LLM(tiny, tiny_tok, max_num_seqs=2, block_size=8, num_blocks=64)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == want


def test_seeded_sampling_batched_as_alone(tiny, tiny_tok):
    """Each prompt samples from its own generator seeded with ``seed``."""
    prompts = short_and_long(64, room=40, seed=2)
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    for cache in ("contiguous", "paged"):
        batched = llmlab.generate(tiny, tiny_tok, prompts, kv_cache=cache, **kw)
        alone = [llmlab.generate(tiny, tiny_tok, [p], kv_cache=cache, **kw)[0] for p in prompts]
        assert [g.token_ids for g in batched] == [g.token_ids for g in alone], cache
    other = llmlab.generate(tiny, tiny_tok, prompts[:1], **{**kw, "seed": 12})[0]
    assert other.token_ids != alone[0].token_ids


@pytest.mark.slow
def test_smollm2_short_beside_long_on_every_path(smollm2, tokenizer):
    """The real model, its context cut to leave the long prompt room for 3 tokens."""
    long_text = ("Here is a list of the planets of the solar system, from the closest to the "
                 "sun to the farthest, with one fact about each of them, please.")
    prompts = encode_prompts(tokenizer, [FRANCE, long_text], chat=True)
    ctx = len(prompts[1]) + 3
    assert len(prompts[0]) + 6 < ctx
    want = None
    with context_of(smollm2, ctx):
        for kw in PATHS[:3]:
            batched = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=6, **kw)
            alone = [llmlab.generate(smollm2, tokenizer, [p], max_new_tokens=6, **kw)[0]
                     for p in prompts]
            got = [(g.token_ids, g.finish_reason) for g in batched]
            assert got == [(g.token_ids, g.finish_reason) for g in alone], kw
            want = want or got
            assert got == want, kw
    assert len(want[1][0]) == 3 and want[1][1] == "length"
    assert len(want[0][0]) == 6 and tokenizer.decode(want[0][0]).startswith("The capital")
    llm = LLM(smollm2, tokenizer, max_num_seqs=2, block_size=16, num_blocks=16,
              max_model_len=ctx)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == want


@pytest.mark.slow
def test_tensor_parallel_short_beside_long(tiny):
    """Two ranks run the same loop: batched as alone, and as one process (at tiny-llama's
    real context of 2,048 tokens: the ranks load the model from its files)."""
    from llmlab.parallel import launch
    from llmlab.parallel.generate import greedy_on_ranks

    ctx = tiny.config.max_position_embeddings
    prompts = short_and_long(ctx, room=3, seed=5)
    out = launch(greedy_on_ranks, 2, "tiny-llama", prompts, 6)
    batched, alone = out[:2], out[2:]
    assert batched == alone and [len(t) for t in batched] == [6, 3]
    one = generate_token_ids(tiny, prompts, 6, kv_cache="contiguous")
    assert [r.token_ids for r in one] == batched
