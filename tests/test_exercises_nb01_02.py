"""The build exercises of notebooks 01 and 02 beyond the registry's generic checks: the
backend adapter, the cache skeleton's bookkeeping, the diagnoses, and that a check leaves
the model and the registries as it found them, even when the student's code fails."""
import math
import re
from pathlib import Path

import pytest
import torch

from llmlab import attention as A
from llmlab import cache as kv_caches
from llmlab import exercises
from llmlab.exercises import nb01, nb02


def test_as_backend_transposes_and_refuses_what_it_cannot_do():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=g)              # [batch, seq, heads, d]
    k = torch.randn(2, 5, 2, 16, generator=g)
    fwd = nb01.as_backend(nb01._solution_naive_attention)
    want = A.get("naive").forward(q, k, k, causal=True)
    assert torch.allclose(fwd(q, k, k, causal=True), want, atol=1e-6)
    assert torch.allclose(fwd(q, k, k, causal=True, key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
                          want, atol=1e-6)
    pad = torch.ones(2, 5, dtype=torch.bool)
    pad[0, 0] = False
    with pytest.raises(ValueError, match="left-padded"):
        fwd(q, k, k, causal=True, key_padding_mask=pad)
    with pytest.raises(ValueError, match="softmax_scale=0.5"):
        fwd(q, k, k, causal=True, softmax_scale=0.5)
    assert torch.allclose(fwd(q, k, k, softmax_scale=1 / math.sqrt(16)), want, atol=1e-6)
    padded = nb01.as_backend(nb01._solution_padded_attention, padded=True)
    want = A.get("naive").forward(q, k, k, causal=True, key_padding_mask=pad)
    assert torch.allclose(padded(q, k, k, key_padding_mask=pad)[1], want[1], atol=1e-6)


def test_naive_attention_diagnoses_a_mask_applied_without_causal():
    def always_masked(q, k, v, causal=True):
        return nb01._solution_naive_attention(q, k, v, causal=True)

    v = exercises.check("nb01.naive_attention", always_masked)
    assert not v.passed and "causal=False" in v.message


def test_a_failure_inside_the_model_leaves_model_and_registry_clean():
    def breaks_at_full_size(q, k, v, causal=True):
        if q.shape[-1] != 16:            # the small cases use d = 16, SmolLM2 d = 64
            raise RuntimeError("only small tensors")
        return nb01._solution_naive_attention(q, k, v, causal)

    v = exercises.check("nb01.naive_attention", breaks_at_full_size)
    assert not v.passed and "only small tensors" in v.message
    assert "nb01-yours" not in A.available()
    model, _ = nb01.smollm2()
    assert {layer.self_attn.backend.name for layer in model.layers} == {"naive"}


def test_cache_skeleton_bookkeeping():
    c = nb02.KVCacheBase(num_layers=2, batch=3, num_kv_heads=2, head_dim=4, max_len=6)
    assert [tuple(t.shape) for t in c.k] == [(3, 2, 6, 4)] * 2 and c.length == 0
    assert c.begin(4).tolist() == [[0, 1, 2, 3]] * 3 and c.pending == 4
    c.length = 4
    assert c.begin(2).tolist() == [[4, 5]] * 3
    with pytest.raises(ValueError, match="do not fit"):
        c.begin(3)
    with pytest.raises(ValueError, match="num_new=0"):
        c.begin(0)
    mask = torch.ones(3, 2, dtype=torch.bool)
    c.begin(2, mask)                                   # all real: accepted
    mask[1, 0] = False
    with pytest.raises(ValueError, match="unpadded rows only"):
        c.begin(2, mask)
    with pytest.raises(ValueError, match="max_len=0"):
        nb02.KVCacheBase(1, 1, 1, 4, 0)
    for call in (lambda: c.append(0, None, None), lambda: c.attend(0, None, None, None, None),
                 c.advance):
        with pytest.raises(NotImplementedError):
            call()


def test_kv_cache_check_says_not_yet_for_the_shipped_skeleton_and_cleans_up():
    class Unwritten(nb02.KVCacheBase):
        pass

    v = exercises.check("nb02.kv_cache", Unwritten)
    assert not v.passed and "NotImplementedError" in v.message
    v = exercises.check("nb02.kv_cache", nb02._SolutionKVCache(1, 1, 1, 4, 4))   # an instance
    assert not v.passed and "class itself" in v.message

    class WrongAtFullSize(nb02._SolutionKVCache):      # right on small tensors, wrong in SmolLM2
        def attend(self, layer_idx, q, k, v, backend):
            out = super().attend(layer_idx, q, k, v, backend)
            return out if q.shape[-1] != 64 else out.roll(1, dims=2)   # heads mixed up

    v = exercises.check("nb02.kv_cache", WrongAtFullSize)
    assert not v.passed and "kv_cache=\"none\"" in v.message and "token" in v.message
    assert "nb02-yours" not in kv_caches.available()
    model, _ = nb01.smollm2()
    assert {layer.self_attn.backend.name for layer in model.layers} == {"naive"}


def test_step_ratio_uses_medians_of_the_windows():
    times = [0.5] + [0.5 + 0.1 * i for i in range(1, 11)]       # 10 steps of 0.1 s
    times[3] += 5.0                                              # one spike early on
    times[4:] = [t + 5.0 for t in times[4:]]                     # (shifts every later arrival)
    early, late, ratio = nb02._step_ratio(times, 3)
    assert early == pytest.approx(0.1) and late == pytest.approx(0.1) and ratio == pytest.approx(1.0)


# -- notebook 02 within its hour ----------------------------------------------------------------

def test_notebook_02_is_an_hour_and_checks_what_it_registers():
    """At most 2,500 words of prose and 6 exercises, each one the registry holds for 02."""
    from .test_notebook_budget import prose_words_and_checks as _prose_words_and_checks

    src = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "02_kv_cache_and_roofline.py"
    words, checks = _prose_words_and_checks(src)
    assert words <= 2500 and len(checks) <= 6, (words, sorted(checks))
    assert checks == set(exercises.names("02"))


def test_the_intensity_prediction_names_the_usual_miscounts():
    from llmlab.profiling.roofline import decode_cost

    want = decode_cost(nb02._smollm2_config(), 1, 128).intensity
    assert 0.45 < want < 0.55
    check = lambda a: exercises.check("nb02.predict_decode_intensity", a, measured=want)  # noqa: E731
    assert check(0.5).passed and check(want).passed
    for answer, words in ((2, "4 bytes"), (1, "bfloat16"), (0.25, "two FLOPs"), (39, "prefill")):
        v = check(answer)
        assert not v.passed and words in v.message, (answer, v.message)
    src = (Path(__file__).resolve().parents[1] / "notebooks" / "src"
           / "02_kv_cache_and_roofline.py").read_text()
    # the question comes before the cell that prints the model's intensity
    assert src.index('exercises.check("nb02.predict_decode_intensity"') < src.index(
        "decode step, batch 1: {decode_intensity:.2f}")


def test_no_intensity_is_on_screen_before_the_prediction():
    import re

    src = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "02_kv_cache_and_roofline.py"
    cells = re.split(r"(?m)^(?=# %%)", src.read_text())
    i = next(i for i, c in enumerate(cells) if "my_intensity = ..." in c)
    before = "".join(cells[i - 3:i])
    assert ".intensity" not in before and "0.5" not in before and "2 FLOPs" not in before


# -- notebook 02: the batch-16 decode step, predicted as a number -------------------------------

def _check_batch(answer, measured, **context):
    return exercises.check("nb02.predict_batch_decode", answer, measured=measured, **context)


@pytest.mark.parametrize("measured", [1.1, 2.0, 3.4])
def test_the_batch_prediction_passes_within_a_factor_of_two_of_the_run(measured):
    for answer in (measured, 2.0, measured * 1.9, max(1.0, measured / 1.9)):
        v = _check_batch(answer, measured)
        assert v.passed, (answer, measured, v.message)
        assert f"{measured:.2f}×" in v.message and "once" in v.message
    for answer in (measured * 2.1, measured / 2.1):
        assert not _check_batch(answer, measured).passed, (answer, measured)


def test_the_batch_prediction_names_the_usual_wrong_numbers():
    for answer, words in ((16, ("own weight read", "3.40×")), (12, ("own weight read",)),
                          (1 / 16, ("per token", "cannot take less time")),
                          (0.5, ("per token",)),
                          (1.2, ("bytes alone", "1.20× the bytes", "batch sweep")),
                          (1, ("other 15 sequences free", "own KV cache")),
                          (8, ("2.35 times the measured",))):
        v = _check_batch(answer, 3.4)
        assert not v.passed, answer
        assert all(w in v.message for w in words), (answer, v.message)
    for placeholder in (..., None, "c", "2", True, 0, -2.0, float("inf")):
        assert not _check_batch(placeholder, 3.4).passed, placeholder


def test_the_batch_prediction_follows_the_measured_ratio_and_batch():
    assert _check_batch(3.0, 3.4).passed and not _check_batch(3.0, 1.1).passed
    assert _check_batch(1.0, 1.1).passed and not _check_batch(1.0, 3.4).passed
    # a step for 16 sequences quicker than one for 1 fails unless the run itself says so
    assert _check_batch(0.95, 1.1).passed and not _check_batch(0.6, 1.1).passed
    assert "per token" in _check_batch(0.6, 1.1).message and _check_batch(0.6, 0.7).passed
    v = _check_batch(16, 12.0)                    # a run where the step grew with the batch
    assert v.passed and "busy" in v.message
    # QUICK runs compare batch 4 with batch 1: the messages and the proportional guess follow
    v = _check_batch(4, 1.9, batch=4)
    assert not v.passed and "4 sequences" in v.message and "batch-4 step" in v.message
    assert _check_batch(2, 1.9, batch=4).passed


def test_notebook_02_asks_for_the_batch_ratio_before_timing_it():
    src = (Path(__file__).resolve().parents[1] / "notebooks" / "src"
           / "02_kv_cache_and_roofline.py").read_text()
    cells = re.split(r"(?m)^(?=# %%)", src)
    placeholder = "my_prediction = ...  # YOUR ANSWER: a number"
    i = next(i for i, c in enumerate(cells) if "**Predict, then measure.** A decode step" in c)
    assert placeholder in cells[i + 1] and "exercises.ask(" not in src
    before = "".join(cells[i - 3:i])
    for giveaway in ("far less", "read once", "own weight", "16 single", "memory-bound"):
        assert giveaway not in before and giveaway not in cells[i], giveaway
    check = 'exercises.check("nb02.predict_batch_decode", my_prediction, measured=ratio'
    assert (src.index(placeholder) < src.index("cached_step_times(model, [CONTEXT + 1]")
            < src.index("ratio = 1 / batch_cmp.ratio") < src.index(check))
    assert "batch=batches[-1]" in src[src.index(check):src.index(check) + 120]
