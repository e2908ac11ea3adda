"""oneDNN-prepacked linears: same results as F.linear to float32 rounding, the same greedy
tokens through the engine, and a stale packed copy is never used."""
import pytest
import torch
from torch import nn

import llmlab
from llmlab.engine import LLM, SamplingParams
from llmlab.layers.prepack import (PrepackedLinear, prepack_linears, prepack_supported,
                                   unpack_linears)

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


@pytest.mark.parametrize("shape", [(1, 3), (5,), (2, 9), (1, 37), (64,)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80, bias=bias)
    x = torch.randn(*shape, 96)
    with torch.no_grad():
        ref = lin(x)
        assert prepack_linears(nn.Sequential(lin), min_rows=8) == 1
        assert isinstance(lin, PrepackedLinear)
        out = lin(x)
    assert out.shape == ref.shape
    rows = x.numel() // 96
    if rows < 8:              # below min_rows the plain F.linear runs: bit for bit
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_repacked_and_unpack_restores():
    torch.manual_seed(1)
    lin = nn.Linear(64, 48)
    model = nn.Sequential(lin)
    x = torch.randn(32, 64)
    prepack_linears(model)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2.0)                         # in place: a new version
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)
        lin.weight = nn.Parameter(torch.zeros(48, 64))   # replaced: a new tensor
        assert torch.equal(lin(x), lin.bias.expand(32, 48))
    assert not torch.equal(before, lin(x).detach())
    assert unpack_linears(model) == 1 and type(lin) is nn.Linear and "_packed" not in vars(lin)
    with pytest.raises(ValueError, match="min_rows=0"):
        prepack_linears(model, min_rows=0)


def test_autograd_takes_the_plain_path():
    lin = nn.Linear(16, 8)
    prepack_linears(nn.Sequential(lin), min_rows=1)
    x = torch.randn(20, 16, requires_grad=True)
    lin(x).sum().backward()                        # the oneDNN op has no backward
    assert x.grad is not None and lin.weight.grad is not None


def test_prepacked_model_gives_the_same_greedy_tokens(tokenizer):
    model = llmlab.load_model("smollm2-135m")     # its own copy: the session model stays plain
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was",
               "List three colours of the rainbow:"] * 4          # 16 rows: decode is packed too
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    with torch.inference_mode():
        x = torch.tensor([ids[1] * 3])
        plain = model(x)
        llm = LLM(model, tokenizer, max_num_seqs=16, prepack_weights=True)
        assert llm.prepacked == 30 * 7 + 1          # every projection and the LM head
        assert model.lm_head.weight is model.embed_tokens.weight   # still tied
        err = (model(x) - plain).abs().max().item()
    assert err < 1e-3, f"max |logit error| {err:.2e}"
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))
    unpack_linears(model)
    for o, p in zip(outs, ids):
        ref = llmlab.generate(model, tokenizer, [p], max_new_tokens=12)[0].token_ids
        assert o.outputs[0].token_ids == ref


def test_llm_prepacks_only_what_it_loaded(smollm2, tokenizer):
    llm = LLM(smollm2, tokenizer)                  # a model passed in is not changed unasked
    assert llm.prepacked == 0
    assert not any(isinstance(m, PrepackedLinear) for m in smollm2.modules())
    with pytest.raises(ValueError, match="prepack_weights='yes'"):
        LLM(smollm2, tokenizer, prepack_weights="yes")
