"""Notebook 04's builds beyond the registry's generic checks: the paged attention read run by
the engine (against HF transformers, and refusing llmlab's own attention and torch's fused
one), the block-table update with copy-on-write behind ``LLM(append_slot=...)``, the
allocator behind ``LLM(allocator=...)``, and the trends the notebook's sentences state."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import llmlab.attention as attention
from llmlab import exercises
from llmlab.attention.paged import paged_attention_blocks, paged_attention_reference
from llmlab.cache import waste
from llmlab.cache.block_manager import (BlockAllocator, BlockManager, NoFreeBlocksError,
                                        append_to_table)
from llmlab.exercises import nb04

from .test_notebook_budget import prose_words_and_checks as _prose_words_and_checks

SRC_DIR = Path(__file__).resolve().parents[1] / "notebooks" / "src"
SRC = SRC_DIR / "04_paged_attention.py"
SRC_B = SRC_DIR / "04b_paging_fine_print.py"          # the optional appendix


# -- the paged attention read --------------------------------------------------------------

@pytest.mark.parametrize("bs, lens", [(1, [3, 1]), (4, [13, 6, 1]), (16, [37, 70, 16])])
def test_the_block_by_block_read_matches_the_gathering_reference(bs, lens):
    case = nb04._attention_case(bs, lens, seed=bs, shuffle=True)
    want = paged_attention_reference(*case)
    assert (paged_attention_blocks(*case) - want).abs().max() < 1e-5
    assert (nb04._solution_paged_attention(*case) - want).abs().max() < 1e-5


def test_the_block_by_block_read_is_decode_only():
    q, k, v, lens, table = nb04._attention_case(4, [8], seed=0)
    with pytest.raises(ValueError, match="seq_q must be 1"):
        paged_attention_blocks(q.expand(1, 2, -1, -1), k, v, lens, table)


def test_the_engine_run_of_the_check_equals_hf_transformers(smollm2, tokenizer, hf_smollm2):
    """The tokens the paged_attention check demands (llmlab's `paged` backend through the
    engine) are HF transformers' greedy tokens."""
    want = nb04._engine_attention_run("paged", smollm2, tokenizer)
    for prompt, got in zip(nb04._PROMPTS, want):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        hf = hf_smollm2.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
        assert hf[0, ids.shape[1]:].tolist() == got


def test_the_check_runs_the_students_function_in_every_layer(smollm2, tokenizer):
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return nb04._solution_paged_attention(*args, **kw)

    v = exercises.check("nb04.paged_attention", counted, model=smollm2, tokenizer=tokenizer)
    assert v.passed, v.message
    layers = smollm2.config.num_layers
    engine_calls = [s for s in calls if s[-1] == smollm2.config.head_dim]
    assert len(engine_calls) >= 9 * layers and all(s[1] == 1 for s in engine_calls)
    assert nb04.STUDENT_BACKEND not in attention.available()        # unregistered again
    assert re.search(r"max \|error\| \d", v.message)


@pytest.mark.parametrize("wrapper, words", [
    (lambda *a, **k: paged_attention_blocks(*a), "llmlab's own"),
    (lambda *a, **k: paged_attention_reference(*a), "llmlab's own"),
    (nb04._paged_wraps_fused, "fused attention"),
])
def test_wrappers_around_the_library_or_fused_attention_are_refused(wrapper, words):
    sdpa = F.scaled_dot_product_attention
    v = exercises.check("nb04.paged_attention", wrapper)
    assert not v.passed and words in v.message
    assert F.scaled_dot_product_attention is sdpa                   # restored after the check
    case = nb04._attention_case(4, [5], seed=1)
    assert paged_attention_blocks(*case).shape == case[0].shape     # and the library runs again


# -- the block-table update and the allocator ----------------------------------------------

def test_append_to_table_refuses_without_changing_anything():
    pool = BlockAllocator(2, 4)
    table = [pool.allocate(), pool.allocate()]
    pool.incref(1)
    with pytest.raises(NoFreeBlocksError):
        append_to_table(table, 6, pool, 4)
    assert table == [0, 1] and pool.ref_counts == [1, 2]


def test_the_block_manager_calls_its_append_slot_hook():
    seen = []

    def hook(table, n, pool, bs):
        seen.append((list(table), n))
        return append_to_table(table, n, pool, bs)

    bm = BlockManager(8, 4, append_slot=hook)
    bm.allocate("a", [1, 2, 3, 4, 5])
    assert bm.append_slot("a", 6) == (5, None) and seen == [([0, 1], 5)]
    bm.fork("a", "b")
    slot, cow = bm.append_slot("b", 7)
    assert cow == (1, 2) and slot == 2 * 4 + 2 and bm.block_table("b") == [0, 2]
    with pytest.raises(ValueError, match="append_slot must be a function"):
        BlockManager(8, 4, append_slot=3)


def test_llm_takes_an_allocator_class_and_an_append_slot(smollm2, tokenizer):
    from llmlab.engine import LLM

    llm = LLM(smollm2, tokenizer, num_blocks=8, block_size=4, enable_prefix_caching=False,
              allocator=nb04._SolutionBlockAllocator, append_slot=nb04._solution_append_slot)
    manager = llm.engine.cache.manager
    assert isinstance(manager.allocator, nb04._SolutionBlockAllocator)
    assert manager.allocator.num_blocks == 8
    assert llm.engine.scheduler.bm is manager


def test_the_append_slot_check_counts_copies_like_the_library(smollm2, tokenizer):
    tokens, copies = nb04._engine_append_run(nb04._solution_append_slot, smollm2, tokenizer)
    want, want_copies = nb04._engine_append_run(None, smollm2, tokenizer)
    assert tokens == want and copies == want_copies >= 1
    assert len(tokens) == 3 + 3                       # n=2 + one greedy, and three beams


def test_a_subclass_of_the_library_allocator_is_refused(smollm2, tokenizer):
    v = exercises.check("nb04.block_allocator", nb04._WrapsLibrary, model=smollm2,
                        tokenizer=tokenizer)
    assert not v.passed and "llmlab's own" in v.message and "BlockAllocator" in v.message


# -- what the notebook's sentences state -----------------------------------------------------

def test_the_compute_questions_in_the_notebook_match_the_registry():
    text = SRC.read_text()
    assert f"`{nb04.SLOT_TABLE}`" in text and f"token {nb04.SLOT_POSITION}" in text
    assert f"blocks of {nb04.SLOT_BLOCK_SIZE} tokens" in text
    *head, last = nb04.WASTE_LENGTHS
    text_b = SRC_B.read_text()
    assert f"{', '.join(map(str, head))} and {last} tokens" in text_b
    assert f"blocks of {nb04.WASTE_BLOCK_SIZE} slots" in text_b


def test_notebook_04_is_an_hour_and_04b_holds_the_rest():
    """A core notebook: at most 2,500 words of prose and 6 exercises. 04b sorts right after 04
    (build.py's prefix "04" builds both), has its solutions, and holds no main build: the
    workbook's per-notebook build test globs "NN_*", which 04b does not match."""
    words, checks = _prose_words_and_checks(SRC)
    assert words <= 2500 and len(checks) <= 6, (words, sorted(checks))
    names = sorted(p.name for p in SRC_DIR.glob("[0-9]*.py"))
    assert names.index(SRC_B.name) == names.index(SRC.name) + 1
    assert (SRC_DIR / "solutions" / "04b_paging_fine_print_solutions.py").exists()
    in_b = {n for n in exercises.names("04") if exercises.get(n).notebook == SRC_B.stem}
    assert in_b == {"nb04.wasted_slots", "nb04.explain_preemptions"}
    assert all(exercises.get(n).kind != "build" for n in in_b)
    _, checks_b = _prose_words_and_checks(SRC_B)
    assert checks_b == in_b and not checks & in_b
    assert "import llmlab\n" not in SRC_B.read_text()   # runs alone, and without the model


def test_the_paged_tail_is_mostly_reservation_as_the_notebook_says():
    reqs = waste.load_trace("sharegpt_like")
    f = waste.simulate(reqs, "paged", 16384, block_size=16).fractions()
    assert 0 < f["internal"] < 0.1 * f["reservation"]


def test_the_trace_means_are_the_shipped_trace_s():
    prompt, output = nb04.trace_means()
    assert abs(prompt - 153.5) < 0.1 and abs(output - 330.8) < 0.1
    assert "161 + 338" not in SRC.read_text()          # the paper's, not this trace's


def test_the_block_walk_slows_with_small_blocks():
    """The Play section's sentence: walking the table one block per step costs more steps, and
    time, with smaller blocks (CPU time of this thread, medians of 3)."""
    import time

    from llmlab.bench.paged import paged_decode_inputs

    def cpu_ms(bs):
        args = paged_decode_inputs(bs, batch=2, context=256)
        paged_attention_blocks(*args)
        runs = []
        for _ in range(3):
            t = time.thread_time()
            paged_attention_blocks(*args)
            runs.append(time.thread_time() - t)
        return sorted(runs)[1]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small, large = cpu_ms(4), cpu_ms(64)
    finally:
        torch.set_num_threads(threads)
    assert small > 3 * large
