import pytest

from llmlab.config import ModelConfig

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)


def test_rope_theta_both_spellings():
    old = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5})
    new = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 5e5}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.head_dim == 8 and old.queries_per_kv == 4


def test_smollm2_shape_and_parameter_count(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (1536, 49152, 1e5, True)
    n = sum(p.numel() for p in smollm2.parameters())
    assert c.num_parameters() == n == 134_515_008


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ModelConfig.from_hf_dict({**BASE, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict({**BASE, "num_local_experts": 4, "num_experts_per_tok": 5})


def test_moe_active_parameters():
    c = ModelConfig.from_hf_dict({**BASE, "num_local_experts": 8, "num_experts_per_tok": 2})
    expert = 3 * 64 * 128
    assert c.num_parameters() - c.num_parameters(active=True) == 2 * 6 * expert
