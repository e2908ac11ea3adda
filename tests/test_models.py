"""The llmlab decoder against HF transformers on the same weights (the correctness oracle)."""
import pytest
import torch

import llmlab
from llmlab.models import registry

from .conftest import hf_model

PROMPT_64 = ("The history of the printing press begins in the fifteenth century, when Johannes "
             "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted "
             "from wine making. Within fifty years printers in more than two hundred cities had "
             "produced millions of books, and the cost of a single volume had fallen so far that "
             "students, merchants and clergy could all own small libraries of their own.")


def max_abs(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
def test_tiny_models_match_transformers(name):
    model = llmlab.load_model(name)
    hf = hf_model(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ours.shape == (2, 64, model.config.vocab_size)
    assert max_abs(ours, ref) <= 1e-4


def test_smollm2_matches_transformers_on_64_tokens(smollm2, tokenizer, hf_smollm2):
    ids = torch.tensor([tokenizer(PROMPT_64)["input_ids"][:64]])
    assert ids.shape == (1, 64)
    with torch.no_grad():
        ref = hf_smollm2(ids).logits
        for backend in ("naive", "sdpa"):
            smollm2.set_attention(backend)
            assert max_abs(smollm2(ids), ref) <= 1e-4, backend
    smollm2.set_attention("naive")


def test_padded_batch_matches_unpadded(smollm2, tokenizer):
    a = tokenizer("Short prompt.")["input_ids"]
    b = tokenizer("A somewhat longer prompt with more tokens in it.")["input_ids"]
    ids = torch.full((2, len(b)), 2)
    mask = torch.zeros_like(ids)
    ids[0, -len(a):], mask[0, -len(a):] = torch.tensor(a), 1
    ids[1], mask[1] = torch.tensor(b), 1
    with torch.no_grad():
        batched = smollm2(ids, attention_mask=mask)
        alone = smollm2(torch.tensor([a]))
    assert max_abs(batched[0, -len(a):], alone[0]) <= 1e-4


def test_set_attention_swaps_every_layer(smollm2):
    smollm2.set_attention("sdpa")
    assert {layer.self_attn.backend.name for layer in smollm2.layers} == {"sdpa"}
    smollm2.set_attention("naive")
    assert smollm2.attention == "naive"
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; allowed"):
        smollm2.set_attention("fast")


def test_bad_names_and_missing_models(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'; allowed: \['smollm2-135m'"):
        llmlab.load_model("gpt-5")
    with pytest.raises(ValueError, match="unknown attention backend"):
        llmlab.load_model("tiny-llama", attention="flashy")
    monkeypatch.setenv("LLMLAB_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m llmlab.models fetch smollm2-135m"):
        llmlab.load_model("smollm2-135m")


def test_position_past_context_is_refused():
    model = llmlab.load_model("tiny-llama")
    n = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"past the model's context of {n} tokens"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=torch.tensor([[n - 2, n - 1, n, n + 1]]))


def test_dtype_and_device_arguments():
    m = llmlab.load_model("tiny-llama", dtype="bfloat16", device="cpu")
    assert m.dtype == torch.bfloat16
    assert m.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype='float8'"):
        llmlab.load_model("tiny-llama", dtype="float8")


def test_model_files_live_under_data_models():
    assert registry.model_dir("smollm2-135m").parts[-3:] == ("data", "models", "smollm2-135m")
