"""Paged KV storage, the PyTorch paged-attention reference, and the paged cache in the model."""
import pytest
import torch

import llmlab
import llmlab.attention as A
from llmlab.attention import naive_attention
from llmlab.attention.paged import gather_kv, paged_attention_reference, paged_attention_sdpa
from llmlab.cache.block_manager import NoFreeBlocksError
from llmlab.cache.paged import PagedKVCache
from llmlab.generate import generate_paged

from .conftest import FRANCE, on_kernel_device


def make_paged(lens, block_size, kv_heads, head_dim, seed=0, spare=3):
    """Random K/V for sequences of ``lens`` tokens, scattered over a shuffled block pool.

    Returns the pool, block table, lengths and the dense per-sequence K/V.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    dense = []
    for i, (n, nb) in enumerate(zip(lens, need)):
        blocks = [perm.pop() for _ in range(nb)]
        table[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        idx = torch.tensor(blocks)
        dense.append((k_cache[idx].reshape(-1, kv_heads, head_dim)[:n],
                      v_cache[idx].reshape(-1, kv_heads, head_dim)[:n]))
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), dense


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seq_q,causal", [(1, True), (4, True), (3, False)])
def test_reference_matches_dense_attention(block_size, seq_q, causal):
    lens = [5, 17, 4, 33]
    heads, kv_heads, d = 6, 2, 8
    k_cache, v_cache, table, seqlens, dense = make_paged(lens, block_size, kv_heads, d)
    q = torch.randn(len(lens), seq_q, heads, d, generator=torch.Generator().manual_seed(3))
    out = paged_attention_reference(q, k_cache, v_cache, seqlens, table, causal=causal)
    assert out.shape == q.shape
    for i, (k, v) in enumerate(dense):
        ref = naive_attention(q[i:i + 1], k[None], v[None], causal=causal)
        assert (out[i:i + 1] - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv_heads", [3, 1, 6])
def test_paged_sdpa_matches_the_reference(kv_heads):
    """Whole blocks + one SDPA call give the reference's output: decodes, new tokens on a
    cached prefix, a table cut to the row's own blocks, and -1 past a row's blocks."""
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(2, 12, 4, kv_heads, 8, generator=g)      # 12 blocks of 4 slots
    table = torch.tensor([[5, 2, 9, 0], [7, 1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([13, 6], dtype=torch.int32)      # not multiples of the block size
    q = torch.randn(2, 1, 6, 8, generator=g)
    ref = paged_attention_reference(q, kp, vp, lens, table)
    assert (paged_attention_sdpa(q, kp, vp, lens, table) - ref).abs().max() < 1e-5
    q3 = torch.randn(1, 3, 6, 8, generator=g)            # 3 new tokens on a cached prefix
    ref3 = paged_attention_reference(q3, kp, vp, lens[:1], table[:1])
    assert (paged_attention_sdpa(q3, kp, vp, lens[:1], table[:1]) - ref3).abs().max() < 1e-5
    got2 = paged_attention_sdpa(q[1:], kp, vp, lens[1:], table[1:, :2])
    assert (got2 - ref[1:]).abs().max() < 1e-5
    assert A.get("paged_sdpa").with_kvcache is paged_attention_sdpa


@pytest.mark.parametrize("fn", [paged_attention_reference, paged_attention_sdpa])
def test_rows_that_see_no_key_are_zero(fn):
    k_cache, v_cache, table, _, _ = make_paged([2, 6], 4, 1, 8)
    seqlens = torch.tensor([2, 6], dtype=torch.int32)
    q = torch.randn(2, 4, 2, 8)
    out = fn(q, k_cache, v_cache, seqlens, table)
    assert torch.all(out[0, :2] == 0) and out[0, 2:].abs().sum() > 0   # left pads of row 0
    assert not torch.isnan(out).any()


def test_gather_follows_the_block_table():
    cache = torch.arange(6 * 2, dtype=torch.float32).view(6, 2, 1, 1)   # slot value = slot id
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    got = gather_kv(cache, table, 5).flatten().tolist()
    assert got == [8, 9, 2, 3, 6]


def test_bad_paged_arguments_are_refused():
    k_cache, v_cache, table, seqlens, _ = make_paged([5, 9], 4, 2, 8)
    q = torch.randn(2, 1, 6, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention_reference(torch.randn(2, 1, 5, 8), k_cache, v_cache, seqlens, table)
    with pytest.raises(ValueError, match="block_table must be"):
        paged_attention_reference(q, k_cache, v_cache, seqlens, table[:1])
    with pytest.raises(ValueError, match="exceeds what the block table maps"):
        paged_attention_reference(q, k_cache, v_cache, torch.tensor([5, 99]), table)
    with pytest.raises(ValueError, match="needs a paged KV cache"):
        A.get("paged").forward(q, q, q)
    assert {"paged", "paged_triton"} <= set(A.available())
    assert A.get("paged_triton").with_kvcache is not None


def test_write_by_slot_mapping_skips_minus_one():
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=3, block_size=2)
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    cache.write(0, k, -k, torch.tensor([5, -1, 0]))
    flat = cache.k[0].view(-1, 2)[:, 0].tolist()
    assert flat == [3.0, 0, 0, 0, 0, 1.0]
    assert cache.v[0].view(-1, 2)[5, 0].item() == -1.0


@pytest.fixture(scope="module")
def tiny():
    return llmlab.load_model("tiny-llama")


def test_paged_cache_logits_match_no_cache(tiny):
    """Ragged prompts, left-padded prefill, then decode steps: logits as without a cache."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 11, 6)]
    cache = PagedKVCache.for_model(tiny, num_blocks=20, block_size=4)
    bm = cache.manager
    for sid, p in enumerate(prompts):
        assert bm.allocate(sid, p) == 0
    positions = cache.prepare([0, 1, 2], [len(p) for p in prompts])
    ids = torch.zeros(3, 11, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 11 - len(p):] = torch.tensor(p)
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        logits = tiny(ids, positions=positions, cache=cache, last_only=True)[:, -1]
        for step in range(5):
            for sid, s in enumerate(seqs):
                ref = tiny(torch.tensor([s]))[0, -1]
                assert (logits[sid] - ref).abs().max().item() < 1e-4, (step, sid)
            nxt = logits.argmax(-1).tolist()
            for sid, t in enumerate(nxt):
                seqs[sid].append(t)
                bm.append_slot(sid, t)
            positions = cache.prepare([0, 1, 2], [1, 1, 1])
            logits = tiny(torch.tensor(nxt)[:, None], positions=positions, cache=cache,
                          last_only=True)[:, -1]
    bm.check_invariants()


def test_fork_copy_on_write_in_the_model(tiny):
    """Two branches forked from one prompt decode as if each had its own copy."""
    prompt = list(range(300, 310))                       # 10 tokens: block 2 half full
    cache = PagedKVCache.for_model(tiny, num_blocks=8, block_size=4)
    bm = cache.manager
    with torch.no_grad():
        bm.allocate("p", prompt)
        positions = cache.prepare(["p"], [10])
        tiny(torch.tensor([prompt]), positions=positions, cache=cache)
        bm.fork("p", "c")
        used_after_fork = bm.num_used_blocks
        branches = {"p": 7, "c": 9}
        cows = []
        for sid, tok in branches.items():
            _, cow = bm.append_slot(sid, tok)
            cows += [cow] if cow else []
        assert len(cows) == 1 and used_after_fork == 3 and bm.num_used_blocks == 4
        cache.copy_blocks(cows)
        positions = cache.prepare(["p", "c"], [1, 1])
        logits = tiny(torch.tensor([[7], [9]]), positions=positions, cache=cache)[:, -1]
        for row, tok in enumerate(branches.values()):
            ref = tiny(torch.tensor([prompt + [tok]]))[0, -1]
            assert (logits[row] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention", ["sdpa", "flash", "flash_triton", "paged"])
def test_packed_prefill_equals_each_prompt_alone(tiny, attention):
    """The engine's packed prefill: several prompts in one row (their attention through the
    layer backend's varlen form, or through the pool for a paged layer backend) give each
    prompt's logits as a forward over that prompt alone."""
    from llmlab.cache.packed import PackedPagedCache

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 2, 14, 5)]
    model = on_kernel_device(tiny) if attention == "flash_triton" else tiny
    dev = model.device
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=4)
    for sid, p in enumerate(prompts):
        cache.manager.allocate(sid, p)
    packed = PackedPagedCache(cache)
    before = model.attention
    model.set_attention(attention)
    try:
        with torch.inference_mode():
            pos = packed.prepare(list(range(4)), [len(p) for p in prompts])
            assert packed.step.fresh == [0, 1, 2, 3] and packed.step.fresh_max == 14
            x = model.embed_tokens(torch.tensor([t for p in prompts for t in p], device=dev)[None])
            for layer in model.layers:
                x = layer(x, pos, packed)
            got = model.lm_head(model.norm(x[0]))
            model.set_attention("naive")
            for i, p in enumerate(prompts):
                ref = model(torch.tensor([p], device=dev))[0]
                s, e = packed.step.cu[i], packed.step.cu[i + 1]
                assert (got[s:e] - ref).abs().max().item() < 1e-4, (attention, i)
    finally:
        model.set_attention(before)


def test_generate_paged_frees_every_block_when_a_step_fails(tiny, tokenizer):
    """An exception or an interrupt in the prefill or in a decode step reaches the caller;
    the cache holds no block afterwards and its prefix cache holds no unwritten K/V, so the
    next call gives the tokens of a fresh cache."""
    prompt = list(range(1000, 1030))                       # 30 tokens: 3 full blocks of 8
    want = generate_paged(tiny, tokenizer, [prompt], max_new_tokens=5, ignore_eos=True,
                          block_size=8)[0].token_ids
    cache = PagedKVCache.for_model(tiny, num_blocks=16, block_size=8)
    for error, fail_at in ((RuntimeError, 1), (KeyboardInterrupt, 1), (RuntimeError, 3)):
        calls = []

        def fail(module, args, _error=error, _at=fail_at):
            calls.append(1)
            if len(calls) == _at:
                raise _error("stop here")

        handle = tiny.layers[1].register_forward_pre_hook(fail)
        try:
            with pytest.raises(error, match="stop here"):
                generate_paged(tiny, tokenizer, [prompt], max_new_tokens=5, ignore_eos=True,
                               cache=cache)
        finally:
            handle.remove()
        assert cache.manager.num_used_blocks == 0, (error, fail_at)
        cache.manager.check_invariants()
        again = generate_paged(tiny, tokenizer, [prompt], max_new_tokens=5, ignore_eos=True,
                               cache=cache)[0]
        assert again.token_ids == want, (error, fail_at)
        assert cache.manager.num_used_blocks == 0


def test_generate_paged_reuses_a_cached_prefix(tiny, tokenizer):
    system = list(range(1000, 1040))                     # 40 shared tokens
    a, b = system + [5, 6, 7], system + [8, 9]
    cache = PagedKVCache.for_model(tiny, num_blocks=32, block_size=8)
    first = generate_paged(tiny, tokenizer, [a], max_new_tokens=4, cache=cache, ignore_eos=True)
    second = generate_paged(tiny, tokenizer, [b], max_new_tokens=4, cache=cache, ignore_eos=True)
    alone = generate_paged(tiny, tokenizer, [b], max_new_tokens=4, ignore_eos=True)
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 40
    assert second[0].token_ids == alone[0].token_ids
    assert cache.manager.num_used_blocks == 0            # everything freed (and cached)
    cache.manager.check_invariants()


def test_generate_paged_out_of_blocks_is_clear(tiny, tokenizer):
    with pytest.raises(NoFreeBlocksError, match="needs"):
        generate_paged(tiny, tokenizer, [[1] * 40], max_new_tokens=4, block_size=8, num_blocks=2)
    with pytest.raises(ValueError, match="backend='flash'"):
        generate_paged(tiny, tokenizer, "hi", backend="flash")
    with pytest.raises(ValueError, match="paged_attention='flash'; allowed: \\['paged'"):
        llmlab.generate(tiny, tokenizer, "hi", kv_cache="paged", paged_attention="flash")
    # a pool that holds the prompt (2 blocks of 8) but not the first new token's block
    cache = PagedKVCache.for_model(tiny, num_blocks=2, block_size=8)
    for prompt in ([1] * 40, [1] * 16):
        with pytest.raises(NoFreeBlocksError):
            llmlab.generate(tiny, tokenizer, [prompt], max_new_tokens=4, kv_cache=cache)
        assert cache.manager.num_used_blocks == 0


def test_smollm2_greedy_tokens_match_contiguous_or_baseline(smollm2, tokenizer):
    """Ragged batch of two prompts. The contiguous cache is itself tested against the
    no-cache baseline; without it (an older generate()) compare with the baseline."""
    prompts = [FRANCE, "Name three colours."]
    paged = generate_paged(smollm2, tokenizer, prompts, max_new_tokens=6, block_size=16)
    try:
        other = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=6,
                                kv_cache="contiguous")
    except (TypeError, ValueError):    # a generate() without the contiguous cache
        other = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=6)
    assert [g.token_ids for g in paged] == [g.token_ids for g in other]
    assert paged[0].text.startswith("The capital of France is Paris")


def test_viz_functions_draw(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from llmlab.cache import waste
    from llmlab.viz import paged as pviz

    shots = pviz.block_map_story()
    assert [len(s.tables) for s in shots] == [2, 2, 2, 3]
    assert shots[2].tables["C"][:2] == shots[1].tables["B"][:2]      # prefix hit
    assert shots[3].tables["C"][:2] == shots[3].tables["D"][:2]      # shared after fork
    assert shots[3].tables["C"][2] != shots[3].tables["D"][2]        # copied on write
    pviz.plot_block_map_story(shots).savefig(tmp_path / "story.png")
    reqs = [waste.TraceRequest(20, 30), waste.TraceRequest(50, 10), waste.TraceRequest(5, 60)]
    sweep = waste.block_size_sweep(reqs, 512, block_sizes=(4, 16, 64))
    fig = pviz.plot_block_size_tradeoff(16, sweep, {4: 2.0, 16: 1.0, 64: 0.8}, "cpu")
    assert "block 16" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="block_size=3"):
        pviz.plot_block_size_tradeoff(3, sweep, {}, "cpu")
    pviz.plot_waste_bars([waste.simulate(reqs, "max_len", 512)] + sweep)
    pviz.plot_sharing([waste.parallel_sampling_memory(reqs), waste.beam_search_memory(reqs)])
    pviz.plot_prefix_cache([1.0, 1.0], [1.0, 0.3], 0.5)


def test_exercise_checks_accept_right_and_reject_wrong():
    from llmlab import exercises

    assert exercises.check("nb04.slot_of", 10).passed               # table [7, 2, 9], token 6
    assert "block table" in exercises.check("nb04.slot_of", 6).message
    assert "integer" in exercises.check("nb04.slot_of", "ten").message
    assert exercises.check("nb04.wasted_slots", 32).passed          # 11 + 10 + 0 + 11
    assert "wastes nothing" in exercises.check("nb04.wasted_slots", 48).message
    assert exercises.check("nb04.cow_blocks", 5).passed
    assert not exercises.check("nb04.cow_blocks", 9).passed
    assert "not yet" in str(exercises.check("nb04.cow_blocks", ...))


def test_the_engine_option_that_picks_the_paged_attention():
    from llmlab.engine.runner import choose_paged_attention

    assert choose_paged_attention(None, torch.device("cpu")) == "paged_sdpa"
    assert choose_paged_attention(None, torch.device("cuda")) == "paged_triton"
    assert choose_paged_attention("paged", torch.device("cpu")) == "paged"
    with pytest.warns(DeprecationWarning, match="decode_attention= is now paged_attention="):
        assert choose_paged_attention(None, "cpu", decode_attention="gather") == "paged_sdpa"
    with pytest.raises(ValueError, match=r"paged_attention='sdpa'; allowed: \['paged', "):
        choose_paged_attention("sdpa", "cpu")
