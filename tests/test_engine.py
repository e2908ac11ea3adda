"""The engine on tiny-llama: packed attention against the paged reference, outputs equal
to generating alone (both policies), preemption under a tiny block budget, rejection of
impossible requests, forks, stops, and 500 requests with none lost."""
import pytest
import torch

import llmlab
from llmlab.cache.packed import PackedPagedCache
from llmlab.cache.paged import PagedKVCache
from llmlab.engine import LLM, SamplingParams

from .conftest import on_kernel_device

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


def alone(model, tok, ids, n):
    return llmlab.generate(model, tok, [ids], max_new_tokens=n, kv_cache="contiguous",
                           ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("decode_group", [8, 1])
def test_packed_step_matches_padded_step(tiny, decode_group):
    """Fresh prompt + prefix-continued prompt + decodes in one packed row give the same
    logits as the padded layout of notebook 04's cache (decodes in one group, and one
    group each, sorted by length out of pack order)."""
    cfg = tiny.config
    logits = {}
    for layout in ("packed", "padded"):
        cache = PagedKVCache.for_model(tiny, 32, 4, enable_prefix_caching=False)
        bm = cache.manager
        ids = prompts_of([7, 9, 5])
        for sid, toks in enumerate(ids):
            bm.allocate(sid, toks)
        # step 1: prefill all three
        pos = cache.prepare([0, 1, 2], [7, 9, 5])
        width = pos.shape[1]
        x = torch.zeros((3, width), dtype=torch.long)
        for r, t in enumerate(ids):
            x[r, width - len(t):] = torch.tensor(t)
        with torch.inference_mode():
            tiny(x, positions=pos, cache=cache, last_only=True)
        # step 2: seq 0 decodes one token, seq 1 feeds 4 more, seq 2 decodes one
        new = {0: [11], 1: [12, 13, 14, 15], 2: [16]}
        for sid, toks in new.items():
            for t in toks:
                bm.append_slot(sid, t)
        with torch.inference_mode():
            if layout == "packed":
                packed = PackedPagedCache(cache, decode_group=decode_group)
                pos = packed.prepare([0, 1, 2], [1, 4, 1])
                assert len(packed.step.pool_groups) == 1 + (2 if decode_group == 1 else 1)
                flat = torch.tensor([t for sid in (0, 1, 2) for t in new[sid]])[None]
                x = tiny.embed_tokens(flat)
                for layer in tiny.layers:
                    x = layer(x, pos, packed)
                last = packed.step.cu_seqlens[1:].long() - 1
                logits[layout] = tiny.lm_head(tiny.norm(x[0, last]))
                assert packed.step.decode == [0, 2] and packed.step.continued == [1]
            else:
                pos = cache.prepare([0, 1, 2], [1, 4, 1])
                x = torch.zeros((3, 4), dtype=torch.long)
                for r, sid in enumerate((0, 1, 2)):
                    x[r, 4 - len(new[sid]):] = torch.tensor(new[sid])
                logits[layout] = tiny(x, positions=pos, cache=cache, last_only=True)[:, -1]
    assert cfg.vocab_size == logits["packed"].shape[-1]
    assert (logits["packed"] - logits["padded"]).abs().max() < 1e-4


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_outputs_equal_generating_alone(tiny, tiny_tok, policy):
    ids = prompts_of([3, 17, 8, 30, 1, 12])
    lens = [10, 3, 7, 5, 9, 4]
    llm = LLM(tiny, tiny_tok, scheduler=policy, max_num_seqs=3, block_size=4, num_blocks=64)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate(ids, params, use_tqdm=False)
    for p, n, o in zip(ids, lens, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == alone(tiny, tiny_tok, p, n)
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.cache.manager.num_used_blocks == 0
    stats = llm.stats
    assert max(r.num_seqs for r in stats.steps) == 3
    if policy == "continuous":
        assert stats.padding_tokens == 0
    else:
        assert stats.padding_tokens > 0


def test_tiny_block_budget_preempts_and_completes_everything(tiny, tiny_tok):
    ids = prompts_of([6, 9, 5, 11, 7, 8], seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    roomy = LLM(tiny, tiny_tok, max_num_seqs=6, block_size=4, num_blocks=64)
    want = [o.outputs[0].token_ids for o in roomy.generate(ids, params, use_tqdm=False)]
    assert roomy.stats.num_preemptions == 0
    tight = LLM(tiny, tiny_tok, max_num_seqs=6, block_size=4, num_blocks=8)   # 32 slots
    outs = tight.generate(ids, params, use_tqdm=False)
    assert tight.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.outputs[0].num_preemptions for o in outs) == tight.stats.num_preemptions
    tight.engine.cache.manager.check_invariants()
    assert tight.engine.cache.manager.num_used_blocks == 0


@pytest.mark.parametrize("paged_attention", ["paged", "paged_triton"])
def test_paged_backends_serve_decodes_and_chunks(tiny, tiny_tok, paged_attention):
    """The engine's GPU default reads the pool through the paged kernels (interpreted
    here): decodes in two length groups, and a prompt continued chunk by chunk."""
    ids = prompts_of([9, 3, 6], seed=7)
    model = on_kernel_device(tiny) if paged_attention == "paged_triton" else tiny
    llm = LLM(model, tiny_tok, max_num_seqs=3, block_size=4, num_blocks=32,
              max_num_batched_tokens=5, enable_chunked_prefill=True,
              paged_attention=paged_attention)
    llm.engine.runner.packed.decode_group = 2
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == alone(model, tiny_tok, p, 3)


def test_chunked_prefill_caps_every_step_and_changes_no_token(tiny, tiny_tok):
    ids = prompts_of([30, 5, 17, 23, 2, 11], seed=3)
    lens = [6, 4, 5, 3, 7, 2]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    steps = {}
    for chunked in (False, True):
        llm = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=128,
                  max_num_batched_tokens=8, enable_chunked_prefill=chunked)
        outs = llm.generate(ids, params, use_tqdm=False)
        for p, n, o in zip(ids, lens, outs):
            assert o.outputs[0].token_ids == alone(tiny, tiny_tok, p, n)
            assert o.metrics.ttft_s > 0
        steps[chunked] = llm.stats.steps
        assert llm.engine.cache.manager.num_used_blocks == 0
    # without chunking the 30-token prompt runs alone in one 30-token step
    assert max(r.prefill_tokens + r.decode_tokens for r in steps[False]) == 30
    assert max(r.prefill_tokens + r.decode_tokens for r in steps[True]) <= 8
    assert sum(r.prefill_tokens for r in steps[True]) == sum(len(p) for p in ids)
    assert any(r.prefill_tokens and r.decode_tokens for r in steps[True])   # mixed steps


def test_chunked_prefill_with_a_shared_prefix(tiny, tiny_tok):
    prefix = prompts_of([20], seed=5)[0]
    ids = [prefix + tail for tail in prompts_of([3, 6, 1], seed=6)]
    llm = LLM(tiny, tiny_tok, max_num_seqs=3, block_size=4, num_blocks=64,
              max_num_batched_tokens=6, enable_chunked_prefill=True)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == alone(tiny, tiny_tok, p, 5)
    assert llm.engine.cache.manager.stats.hits > 0     # later prompts reused the prefix
    llm.engine.cache.manager.check_invariants()


def test_chunked_prefill_under_a_tiny_block_budget(tiny, tiny_tok):
    ids = prompts_of([6, 9, 5, 11, 7, 8], seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [alone(tiny, tiny_tok, p, 12) for p in ids]
    tight = LLM(tiny, tiny_tok, max_num_seqs=6, block_size=4, num_blocks=8,
                max_num_batched_tokens=5, enable_chunked_prefill=True)
    outs = tight.generate(ids, params, use_tqdm=False)
    assert tight.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tight.engine.cache.manager.num_used_blocks == 0


def test_chunked_prefill_needs_the_continuous_scheduler(tiny, tiny_tok):
    with pytest.raises(ValueError, match="enable_chunked_prefill needs scheduler='continuous'"):
        LLM(tiny, tiny_tok, scheduler="static", enable_chunked_prefill=True)


def test_impossible_requests_are_rejected_alone(tiny, tiny_tok):
    llm = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=16, max_model_len=40)
    ok = prompts_of([5, 6])
    too_long = prompts_of([40])[0]
    outs = llm.generate([ok[0], too_long, ok[1]], SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)
    assert outs[1].error and "40 tokens" in outs[1].error and "context of 40" in outs[1].error
    assert outs[1].outputs == [] and outs[1].finished
    assert [len(o.outputs[0].token_ids) > 0 for o in (outs[0], outs[2])] == [True, True]
    small_pool = LLM(tiny, tiny_tok, block_size=4, num_blocks=6)          # 24 slots
    big = small_pool.generate(ok[:1], SamplingParams(temperature=0, max_tokens=30),
                              use_tqdm=False)[0]
    assert big.error and "needs 9 KV blocks but the pool has only 6" in big.error
    # max_model_len caps a sequence: 30-token prompt + 10 tokens = 40
    capped = llm.generate(prompts_of([30]), SamplingParams(temperature=0, max_tokens=30,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert capped.error is None
    assert len(capped.outputs[0].token_ids) == 10 and capped.outputs[0].finish_reason == "length"


def test_n_completions_fork_and_seeds(tiny, tiny_tok):
    llm = LLM(tiny, tiny_tok, max_num_seqs=8, block_size=4, num_blocks=64)
    p = prompts_of([10])[0]
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=5, ignore_eos=True)
    a = llm.generate([p], sp, use_tqdm=False)[0]
    # the same seed gives the same completions even with other requests in the batch
    b = llm.generate([prompts_of([4], seed=3)[0], p], [GREEDY, sp], use_tqdm=False)[1]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert all(len(c.token_ids) == 8 for c in a.outputs)
    assert llm.engine.cache.manager.num_used_blocks == 0


def test_stop_strings_eos_and_max_tokens(tiny, tiny_tok):
    llm = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=64)
    p = prompts_of([6])[0]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    cut = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[:free.text.find(stop)]
    assert cut.token_ids == free.token_ids[:len(cut.token_ids)]
    short = llm.generate([p], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert len(short.outputs[0].token_ids) == 2 and short.outputs[0].finish_reason == "length"


def test_eos_finishes_a_sequence(tiny, tiny_tok):
    """Make EOS the greedy choice by raising its logit; the sequence stops with 'stop'."""
    llm = LLM(tiny, tiny_tok, max_num_seqs=2, block_size=4, num_blocks=64)
    eos = llm.engine.eos_token_id
    head = tiny.lm_head
    bias = torch.zeros(tiny.config.vocab_size)
    bias[eos] = 1e4
    handle = head.register_forward_hook(lambda m, i, o: o + bias)
    try:
        out = llm.generate(prompts_of([5]), SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]
        kept = llm.generate(prompts_of([5]), SamplingParams(temperature=0, max_tokens=3,
                                                            ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    finally:
        handle.remove()
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason == eos
    assert kept.token_ids == [eos] * 3 and kept.finish_reason == "length"


def test_500_short_requests_none_lost_none_duplicated(tiny, tiny_tok):
    llm = LLM(tiny, tiny_tok, max_num_seqs=64, block_size=8, num_blocks=160,
              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 40000, (int(n),), generator=g).tolist()
           for n in torch.randint(1, 12, (500,), generator=g)]
    lens = torch.randint(1, 5, (500,), generator=g).tolist()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate(ids, params, use_tqdm=False)
    assert len(outs) == 500 and len({o.request_id for o in outs}) == 500
    assert [o.prompt_token_ids for o in outs] == ids           # input order kept
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert all(o.finished and o.error is None for o in outs)
    steps = llm.stats.steps
    # every prompt token fed once, every output token but the last fed once
    assert sum(r.decode_tokens + r.prefill_tokens for r in steps) == \
        sum(len(i) for i in ids) + sum(lens) - 500
    assert max(r.num_seqs for r in steps) <= 64
    assert llm.engine.cache.manager.num_used_blocks == 0


def test_explore_batching_shows_preemptions_and_finishes_everything(capsys):
    import matplotlib

    matplotlib.use("Agg")
    from llmlab.viz.serving import explore_batching, occupancy_grid, serve_demo

    fig = explore_batching(max_num_seqs=6, num_blocks=24)
    text = capsys.readouterr().out
    assert "24/24 requests finished, 0 rejected" in text
    assert " 0 preemptions" not in text
    assert len(fig.axes) == 2
    static = serve_demo(3, 64, scheduler="static", n=6)
    grid = occupancy_grid(static.stats, 3)
    assert grid.shape == (3, len(static.stats.steps)) and (grid == -2).any()   # held seats


def test_exercise_checks_reject_wrong_and_accept_right():
    from llmlab import exercises

    check = exercises.check
    assert not check("nb05.predict_stall", "2").passed
    assert check("nb05.predict_stall", 2.2, measured=2.0).passed
    assert not check("nb05.predict_stall", 1.0, measured=2.0).passed
    assert not check("nb05.cu_seqlens", lambda lens: None).passed
    assert not check("nb05.cu_seqlens", lambda lens: [0] + lens).passed
    assert "ZeroDivisionError" in check("nb05.cu_seqlens", lambda lens: 1 / 0).message
    assert check("nb05.cu_seqlens", lambda lens: torch.tensor([0] + lens).cumsum(0).int()).passed
    assert not check("nb05.static_steps", None).passed
    assert not check("nb05.static_steps", 173, output_lengths=[5, 60, 8, 12, 90],
                     batch_size=2).passed
    assert check("nb05.static_steps", 60 + 12 + 90, output_lengths=[5, 60, 8, 12, 90],
                 batch_size=2).passed
