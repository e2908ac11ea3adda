"""Notebook 02's decode-loop build: what its checker sees of a loop, beyond the registry's
solution / placeholder / wrong-variant test (tests/test_exercises.py)."""
import pytest
import torch

from llmlab import exercises
from llmlab.exercises import nb02

pytestmark = pytest.mark.slow        # each check runs SmolLM2 for 32 tokens


def test_decode_loop_accepts_llmlabs_cache_and_names_a_broken_one():
    from llmlab.cache import ContiguousKVCache

    ex = exercises.get("nb02.decode_loop")
    v = ex.check(ex.solution, cache_cls=ContiguousKVCache)
    assert v.passed and "identical" in v.message
    v = ex.check(ex.solution, cache_cls=nb02._OverwritesSlotZero)
    assert not v.passed and "your cache fails" in v.message and "slot 0" in v.message


def test_decode_loop_refuses_a_wrapper_of_the_library_loop_and_restores_it():
    import llmlab

    ex = exercises.get("nb02.decode_loop")
    v = ex.check(nb02._loop_wraps_library)
    assert not v.passed and "llmlab's own" in v.message
    from llmlab.exercises.nb01 import smollm2

    model, tok = smollm2()
    out = llmlab.generate(model, tok, "Hello", max_new_tokens=2, ignore_eos=True)
    assert len(out.token_ids) == 2       # the library loop runs again after the check


def test_decode_loop_that_feeds_the_last_token_too_still_passes():
    """Feeding the last token (one forward more than needed) is wasteful, not wrong."""
    def loop(model, prompt_ids, n, cache_cls):
        cache = cache_cls.for_model(model, batch=1, max_len=len(prompt_ids) + n)
        ids = torch.tensor([prompt_ids])
        out = []
        for _ in range(n):
            logits = model(ids, positions=cache.begin(ids.shape[1]), cache=cache, last_only=True)
            cache.advance()
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
        return out

    v = exercises.check("nb02.decode_loop", loop)
    assert v.passed, v.message


def test_kv_cache_check_refuses_llmlabs_cache_inside():
    v = exercises.check("nb02.kv_cache", nb02._WrapsLibraryCache)
    assert not v.passed and "llmlab's own" in v.message
