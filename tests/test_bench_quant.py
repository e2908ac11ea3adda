"""bench quant's measuring tools: the linear-free step and the step breakdown."""
import sys

import pytest
import torch

import llmlab
from llmlab.bench import quant as bq


@pytest.fixture(scope="module")
def tiny():
    return llmlab.load_model("tiny-llama", attention="sdpa")


def test_linears_skipped_zeroes_every_projection_and_restores_them(tiny):
    qm = llmlab.quantize(tiny, "int4", exact_top=0)   # a refined head recomputes its top logits
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        before = [tiny(ids), qm(ids)]
        with bq._linears_skipped():
            skipped = [tiny(ids), qm(ids)]
        after = [tiny(ids), qm(ids)]
    for b, s, a in zip(before, skipped, after):
        assert torch.count_nonzero(s) == 0          # lm_head skipped: all logits zero
        assert torch.count_nonzero(b) > 0 and torch.equal(a, b)


def test_step_breakdown_rows(tiny):
    models = {"fp32": tiny, "int4": llmlab.quantize(tiny, "int4")}
    rows = bq.step_breakdown(models, [1, 5, 9, 2, 7], bandwidth=10e9, steps=4, repeats=2)
    assert [r["scheme"] for r in rows] == ["fp32", "int4"]
    for r in rows:
        assert r["step ms"] > 0 and r["outside matmuls ms"] > 0 and r["matmuls ms"] > 0
        assert len(r["step ms runs"]) == 2                   # each run, for the spread
        assert min(r["step ms runs"]) <= r["step ms"] <= max(r["step ms runs"])
        assert r["roof ms"] == pytest.approx(llmlab.quant.weight_nbytes(models[r["scheme"]])
                                             / 10e9 * 1e3)
    assert rows[1]["roof ms"] < rows[0]["roof ms"]      # int4 reads fewer bytes


def test_llama_cpp_absent_is_said(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # import raises ImportError
    assert bq.llama_cpp_decode_rate(None, [1, 2, 3], 4, 1, 1) == "llama.cpp not installed"
