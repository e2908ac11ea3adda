"""What makes the engine right and fast on a GPU, checked where it can be on a CPU.

* The default dtype: bfloat16 on a GPU, float32 on a CPU; ``load_model`` and ``LLM`` take
  ``dtype=``, and the engine runs a bfloat16 model (tiny-llama here) within bfloat16's
  error of float32.
* No host sync per layer in decode: a step's block tables and lengths are built once
  (``prepare_paged_batch``), every layer's attention call receives those very tensors
  plus the longest length as a Python int, and nothing reads lengths back from the
  device; a kernel that reads blocks in place serves every decode of a step in one call.
  Counted over a 30-layer model with wrappers around llmlab's own functions.

The tests marked ``gpu`` drive the engine on CUDA (paged_triton decode, chunked prompts,
bfloat16) and run a decode step with torch's sync debug mode set to raise.
"""
import dataclasses
import functools

import pytest
import torch

import llmlab
import llmlab.attention as A
import llmlab.attention.paged as paged_attn
import llmlab.cache.packed as packed_mod
import llmlab.cache.paged as paged_mod
import llmlab.device as D
from llmlab.attention.paged import (attend_paged, check_paged_args, paged_attention_reference,
                                    prepare_paged_batch, takes_max_seqlen)
from llmlab.engine import LLM, SamplingParams
from llmlab.models.llama import CausalLM
from llmlab.prompts import encode_prompts

from .conftest import model_tolerance, rel_err
from .test_paged import make_paged

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


def count_calls(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper that records each call's arguments."""
    calls = []
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def record_logits(llm):
    """Keep every step's logits (the runner's forward is wrapped, not replaced)."""
    seen = []
    forward = llm.engine.runner.forward

    def recording(inputs):
        seen.append(forward(inputs))
        return seen[-1]

    llm.engine.runner.forward = recording
    return seen


@pytest.fixture(scope="module")
def tiny_tok():
    return llmlab.load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def deep():
    """tiny-llama's width with SmolLM2's 30 layers and GQA 4:1 (random weights)."""
    cfg = dataclasses.replace(llmlab.load_model("tiny-llama").config, num_layers=30,
                              num_heads=4, num_kv_heads=1)
    torch.manual_seed(0)
    return CausalLM(cfg, attention="sdpa").eval()


# -- dtype -------------------------------------------------------------------------------

def test_default_dtype_is_bfloat16_on_a_gpu_and_float32_on_a_cpu():
    assert D.default_dtype("cpu") == torch.float32
    gpu = D.default_dtype(torch.device("cuda"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        assert gpu == torch.float16          # no bfloat16 tensor cores before Ampere
    else:
        assert gpu == torch.bfloat16
    assert D.resolve_dtype(None, "cpu") == torch.float32
    assert D.resolve_dtype(None, torch.device("cuda")) == gpu
    assert D.resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8' is not supported; allowed"):
        D.resolve_dtype("fp8")


def test_load_model_takes_dtype_and_defaults_to_the_devices():
    assert llmlab.load_model("tiny-llama", device="cpu").dtype == torch.float32
    m = llmlab.load_model("tiny-llama", device="cpu", dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    # RoPE frequencies stay float32 whatever the weights are
    assert m.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32


def test_the_suite_pins_the_cpu_and_the_pin_can_be_lifted():
    assert D.default_device() == torch.device("cpu")     # tests/conftest.py pins it
    try:
        D.set_default_device(None)
        assert D.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
        with pytest.raises(ValueError, match="device='meta' is not supported"):
            D.set_default_device("meta")
    finally:
        D.set_default_device("cpu")
    assert D.default_device() == torch.device("cpu")


def test_llm_in_bfloat16_runs_within_bfloat16_error_of_float32(tiny_tok):
    prompts = prompts_of([7, 12, 3], seed=1)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        llm = LLM("tiny-llama", device="cpu", dtype=dtype, max_num_seqs=4, block_size=4,
                  num_blocks=64)
        assert llm.model.dtype == dtype and llm.engine.cache.k[0].dtype == dtype
        logits = record_logits(llm)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        runs[dtype] = logits, [o.outputs[0].token_ids for o in outs]
    (ref, ref_tokens), (got, got_tokens) = runs[torch.float32], runs[torch.bfloat16]
    assert all(t.dtype == torch.float32 for t in got)     # sampling sees float32 logits
    vocab = llmlab.load_model("tiny-llama").config.vocab_size
    assert all(len(t) == 4 and all(0 <= x < vocab for x in t) for t in got_tokens)
    # the prefill step reads the same prompts in both: compare every row; a decode step
    # only while both runs have produced the same tokens so far
    assert rel_err(got[0], ref[0]) <= model_tolerance(torch.bfloat16)
    assert rel_err(got[0], ref[0]) > 0                    # it did run in bfloat16
    for step in range(1, 4):
        same = [i for i in range(3) if got_tokens[i][:step] == ref_tokens[i][:step]]
        if same:
            assert rel_err(got[step][same], ref[step][same]) <= model_tolerance(torch.bfloat16)
    # greedy picks the argmax of the bfloat16 model's own logits
    assert [t[0] for t in got_tokens] == got[0].argmax(-1).tolist()


def test_llm_refuses_a_dtype_that_differs_from_a_loaded_model(tiny_tok):
    model = llmlab.load_model("tiny-llama", device="cpu")
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 but the model is already "
                                         r"loaded in torch.float32"):
        LLM(model, tiny_tok, dtype=torch.bfloat16)
    assert LLM(model, tiny_tok, dtype="float32", num_blocks=8).model is model


# -- per-step metadata -------------------------------------------------------------------

def test_prepare_paged_batch_checks_on_the_host_and_builds_int32_once():
    batch = prepare_paged_batch([5, 9, 0], [[3, 1], [0, 2, 4], []], block_size=4, device="cpu")
    assert batch.block_table.dtype == torch.int32 and batch.block_table.is_contiguous()
    assert batch.cache_seqlens.dtype == torch.int32
    assert batch.block_table.tolist() == [[3, 1, -1], [0, 2, 4], [-1, -1, -1]]
    assert batch.cache_seqlens.tolist() == [5, 9, 0]
    assert batch.max_seqlen_k == 9 and isinstance(batch.max_seqlen_k, int) and batch.batch == 3
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=9 exceeds what its block table "
                                         r"maps: 2 blocks × 4 slots"):
        prepare_paged_batch([5, 9], [[3, 1], [0, 2]], 4, "cpu")
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1 must be an int >= 0"):
        prepare_paged_batch([-1], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="2 lengths but 1 block tables"):
        prepare_paged_batch([1, 2], [[0]], 4, "cpu")


def test_a_promised_max_length_replaces_the_device_read(monkeypatch):
    k, v, table, lens, _ = make_paged([5, 17, 2], 4, 2, 16)
    q = torch.randn(3, 1, 4, 16, generator=torch.Generator().manual_seed(0))
    reads = count_calls(monkeypatch, paged_attn, "read_lengths")
    want = paged_attention_reference(q, k, v, lens, table)          # reads the lengths
    assert len(reads) == 1
    for name in ("paged", "paged_sdpa"):
        fn = A.get(name).with_kvcache
        got = fn(q, k, v, lens, table, max_seqlen_k=17)
        assert (got - want).abs().max().item() < 1e-5, name
    assert len(reads) == 1                                          # none since
    with pytest.raises(ValueError, match=r"max_seqlen_k=21 must be an int in 0..20"):
        check_paged_args(q, k, v, lens, table, max_seqlen_k=21)
    assert check_paged_args(q, k, v, lens, table) == 17


def test_a_backend_with_flash_attentions_five_arguments_still_serves_the_engine(
        monkeypatch, tiny_tok):
    def five_args(q, k_cache, v_cache, cache_seqlens, block_table, *, causal=True,
                  softmax_scale=None):
        return paged_attention_reference(q, k_cache, v_cache, cache_seqlens, block_table,
                                         causal=causal, softmax_scale=softmax_scale)

    assert not takes_max_seqlen(five_args)
    assert takes_max_seqlen(A.get("paged_triton").with_kvcache)
    assert takes_max_seqlen(A.get("paged_sdpa").with_kvcache)
    monkeypatch.setitem(A._REGISTRY, "five_args",
                        A.Backend("five_args", A.get("paged").forward, with_kvcache=five_args))
    model = llmlab.load_model("tiny-llama", attention="sdpa", device="cpu")
    ids = prompts_of([6, 9])
    mine = LLM(model, tiny_tok, paged_attention="five_args", block_size=4, num_blocks=32)
    base = LLM(model, tiny_tok, paged_attention="paged_sdpa", block_size=4, num_blocks=32)
    got = [o.outputs[0].token_ids for o in mine.generate(ids, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in base.generate(ids, GREEDY, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("backend,calls_per_step", [("paged_triton", 1), ("paged_sdpa", 2)])
def test_decode_metadata_is_prepared_once_per_step_not_per_layer(monkeypatch, deep, tiny_tok,
                                                                 backend, calls_per_step):
    """Ten decodes over 30 layers: the block tables are built once per pool call of the step
    (one call for the in-place kernel, groups of 8 for a gathering backend); each layer's
    call gets the prepared int32 tensors themselves and the longest length as an int; no
    length is read back from the device.

    What reaches the backend is counted; the arithmetic is paged_sdpa's for both (the
    interpreted kernel takes 30 ms a program; test_paged_triton and test_engine check it)."""
    llm = LLM(deep, tiny_tok, paged_attention=backend, max_num_seqs=10, block_size=4,
              num_blocks=64)
    eng = llm.engine
    for ids in prompts_of([3, 5, 2, 6, 4, 7, 3, 5, 2, 8], seed=2):
        eng.add_request(ids, GREEDY)
    eng.step()                                      # the prompts (varlen, not the pool)
    assert eng.stats.steps[-1].prefill_tokens == 45

    prepared = count_calls(monkeypatch, packed_mod, "prepare_paged_batch")
    reads = count_calls(monkeypatch, paged_attn, "read_lengths")
    layer_calls = []
    original = A.get(backend)
    compute = A.get("paged_sdpa").with_kvcache

    @functools.wraps(original.with_kvcache)
    def counted(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
        layer_calls.append((q.shape[0], cache_seqlens, block_table, kw.get("max_seqlen_k")))
        return compute(q, k_cache, v_cache, cache_seqlens, block_table, **kw)

    monkeypatch.setitem(A._REGISTRY, backend, dataclasses.replace(original, with_kvcache=counted))
    produced = eng.step()                           # a step of ten decodes
    assert len(produced) == 10 and eng.stats.steps[-1].decode_tokens == 10
    assert len(prepared) == calls_per_step
    assert len(reads) == 0
    assert len(layer_calls) == calls_per_step * 30
    groups = eng.runner.packed.step.pool_groups
    batches = [g.tables for g in groups]
    assert sum(b.batch for b in batches) == 10
    # one call over the whole pack reads q as it is; two calls gather and scatter rows
    assert [g.whole for g in groups] == [calls_per_step == 1] * calls_per_step
    for rows, seqlens, table, longest in layer_calls:
        b = next(b for b in batches if b.block_table is table)   # the very tensor prepared
        assert seqlens is b.cache_seqlens and rows == b.batch
        assert table.dtype == seqlens.dtype == torch.int32 and table.is_contiguous()
        assert isinstance(longest, int) and longest == b.max_seqlen_k
    if backend == "paged_triton":                   # one call per layer for the whole batch
        assert all(rows == 10 for rows, *_ in layer_calls)


def test_the_padded_layout_prepares_its_tables_once_per_forward(monkeypatch, deep, tiny_tok):
    prepared = count_calls(monkeypatch, paged_mod, "prepare_paged_batch")
    reads = count_calls(monkeypatch, paged_attn, "read_lengths")
    llm = LLM(deep, tiny_tok, scheduler="static", paged_attention="paged_sdpa", max_num_seqs=3,
              block_size=4, num_blocks=32)
    outs = llm.generate(prompts_of([3, 6, 4], seed=5), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    # the prompts' step is padded (one preparation for its 30 layers); the decode steps
    # after it have nothing to pad and take the packed layout
    assert len(prepared) == 1 and len(llm.stats.steps) == 4
    assert len(reads) == 0


def test_attend_paged_passes_the_length_only_to_a_function_that_takes_it():
    k, v, table, lens, _ = make_paged([3, 9], 4, 1, 16)
    q = torch.randn(2, 1, 2, 16, generator=torch.Generator().manual_seed(3))
    batch = prepare_paged_batch(lens.tolist(), [[b for b in row if b >= 0] for row in
                                                table.tolist()], 4, "cpu")
    seen = {}

    def strict(q, k_cache, v_cache, cache_seqlens, block_table, *, causal=True):
        seen["strict"] = block_table
        return paged_attention_reference(q, k_cache, v_cache, cache_seqlens, block_table)

    def wide(q, k_cache, v_cache, cache_seqlens, block_table, *, causal=True,
             max_seqlen_k=None):
        seen["wide"] = max_seqlen_k
        return paged_attention_reference(q, k_cache, v_cache, cache_seqlens, block_table)

    a = attend_paged(strict, q, k, v, batch)
    b = attend_paged(wide, q, k, v, batch)
    assert seen == {"strict": batch.block_table, "wide": 9}
    assert torch.equal(a, b)


# -- on a GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_llm_defaults_to_bfloat16_and_the_paged_kernel(tokenizer):
    llm = LLM("smollm2-135m", device="cuda", max_num_seqs=4)
    assert llm.model.dtype == D.default_dtype("cuda") and llm.model.device.type == "cuda"
    assert llm.engine.cache.backend == "paged_triton"
    assert llm.engine.cache.k[0].dtype == llm.model.dtype
    ref_llm = LLM(llmlab.load_model("smollm2-135m", attention="sdpa", device="cuda",
                                    dtype=torch.float32), tokenizer, max_num_seqs=4)
    prompts = ["What is the capital of France?", "Write a short poem about the sea.", "2+2="]
    got_logits, ref_logits = record_logits(llm), record_logits(ref_llm)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert rel_err(got_logits[0], ref_logits[0]) <= model_tolerance(llm.model.dtype)
    assert all(o.outputs[0].token_ids for o in got)


@pytest.mark.gpu
def test_gpu_engine_with_the_paged_kernel_gives_the_tokens_of_generate(tokenizer):
    # float32, so that the two paths may differ only in summation order
    model = llmlab.load_model("smollm2-135m", attention="sdpa", device="cuda",
                              dtype=torch.float32)
    prompts = encode_prompts(tokenizer, ["What is the capital of France?",
                                         "Name three primary colors.", "2+2="], chat=True)
    want = [g.token_ids for g in llmlab.generate(model, tokenizer, prompts, max_new_tokens=24,
                                                 kv_cache="contiguous", ignore_eos=True)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for chunked in (False, True):
        llm = LLM(model, tokenizer, paged_attention="paged_triton", max_num_seqs=3,
                  enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 2048)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, chunked
        if chunked:     # prompts longer than 16 tokens were continued chunk by chunk
            assert max(r.prefill_tokens + r.decode_tokens for r in llm.stats.steps) <= 16


@pytest.mark.gpu
def test_gpu_decode_step_never_waits_for_the_device(tokenizer):
    llm = LLM("smollm2-135m", device="cuda", max_num_seqs=8)
    eng = llm.engine
    for ids in prompts_of([30, 5, 70, 12, 9, 41, 3, 18], seed=9):
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()                  # prompts
    eng.step()                  # the first decode compiles the kernel
    forward = eng.runner.forward

    def strict(inputs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    eng.runner.forward = strict
    for _ in range(3):
        assert len(eng.step()) == 8
