"""smollm2-135m upcycled into 8 experts: identical experts give the dense model's answer."""
import pytest
import torch

import llmlab
from llmlab.layers import moe_stats as S
from llmlab.layers.moe import moe_layers, set_dispatch
from llmlab.models import registry, resolve
from llmlab.models.upcycle import upcycle


@pytest.fixture(scope="module")
def moe8():
    return llmlab.load_model("smollm2-135m-moe8")


def test_registry_builds_it_from_smollm2_files(moe8, smollm2):
    assert registry.MODELS["smollm2-135m-moe8"].kind == "derived"
    assert resolve("smollm2-135m-moe8") == resolve("smollm2-135m")
    c = moe8.config
    assert (c.num_experts, c.num_experts_per_tok, c.num_layers) == (8, 2, 30)
    assert c.num_parameters() > 5 * smollm2.config.num_parameters()  # ~692M reachable
    assert c.num_parameters(active=True) < 2 * smollm2.config.num_parameters()  # ~214M active
    moe = moe_layers(moe8)[0]
    assert moe.w_gate.shape == (8, 1536, 576) and moe.w_gate.stride(0) == 0  # shared, not copied
    assert torch.equal(moe.w_up[3], smollm2.layers[0].mlp.up_proj.weight)
    again = llmlab.load_model("smollm2-135m-moe8")
    assert torch.equal(moe_layers(again)[5].gate.weight, moe_layers(moe8)[5].gate.weight)  # seeded


PROMPT = "The capital of France is"


def test_identical_experts_give_the_dense_greedy_output(smollm2, tokenizer):
    moe = upcycle(smollm2)  # shares smollm2's tensors: no extra memory
    want = llmlab.generate(smollm2, tokenizer, PROMPT, max_new_tokens=3, chat=False)
    set_dispatch(moe, "grouped")
    got = llmlab.generate(moe, tokenizer, PROMPT, max_new_tokens=3, chat=False)
    assert got.token_ids == want.token_ids and "Paris" in got.text
    ids = torch.tensor([want.prompt_token_ids + want.token_ids])
    with torch.no_grad():
        ref = smollm2(ids)
        set_dispatch(moe, "loop")  # the reference strategy: same logits, same argmax
        logits = moe(ids)
        assert (logits - ref).abs().max().item() <= 1e-3
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        # dense dispatch (8x the MLP work) on the prompt alone
        set_dispatch(moe, "dense")
        n = len(want.prompt_token_ids)
        assert (moe(ids[:, :n]) - ref[:, :n]).abs().max().item() <= 1e-3


def test_perturbed_experts_differ_and_route(smollm2, tokenizer):
    a = upcycle(smollm2, expert_noise=0.3, noise_seed=1)
    b = upcycle(smollm2, expert_noise=0.3, noise_seed=1)
    m = moe_layers(a)[2]
    assert not torch.equal(m.w_up[0], m.w_up[1]) and m.w_gate.stride(0) == 0
    assert torch.equal(m.w_up, moe_layers(b)[2].w_up)  # the seed fixes the perturbation
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        set_dispatch(a, "loop")
        loop = a(ids)
        set_dispatch(a, "grouped")
        grouped = a(ids)
        dense = smollm2(ids)
    assert (loop - grouped).abs().max() <= 1e-3  # same routing, same answer
    assert (grouped - dense).abs().max() > 1e-2  # different experts, different function
    loads = S.layer_loads(a)
    assert loads.shape == (30, 8) and set(loads.sum(1).tolist()) == {2 * ids.shape[1]}
    assert all(r.balance_loss >= 0.0099 for r in S.routing_report(a))


def test_bad_upcycling_requests(smollm2):
    with pytest.raises(ValueError, match="already a MoE"):
        upcycle(llmlab.load_model("tiny-mixtral"))
    with pytest.raises(ValueError, match="top_k=9"):
        upcycle(smollm2, num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="expert_noise=-1"):
        upcycle(smollm2, expert_noise=-1)
    with pytest.raises(ValueError, match=r"\['expert_noise'\] apply only to derived models"):
        llmlab.load_model("tiny-llama", expert_noise=0.1)
