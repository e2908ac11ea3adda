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


def _hf(cls_name: str, **kw) -> dict:
    """A config as transformers itself writes it (so the field spellings are real)."""
    import transformers

    small = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2)
    return getattr(transformers, cls_name)(**{**small, **kw}).to_dict()


@pytest.mark.parametrize("cls_name", ["LlamaConfig", "MixtralConfig", "Qwen2Config"])
def test_transformers_default_configs_are_accepted(cls_name):
    c = ModelConfig.from_hf_dict(_hf(cls_name))
    assert c.attention_bias == (cls_name == "Qwen2Config")    # qwen2's q/k/v biases


@pytest.mark.parametrize("cls_name, kw, match", [
    ("MistralConfig", {}, r"sliding_window=4096 is smaller than the context "
                          r"\(max_position_embeddings=131072\)"),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=1024),
     "sliding_window=1024 is smaller"),
    ("LlamaConfig", dict(max_position_embeddings=16384,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
     r"rope_(scaling|parameters)=.*RoPE type 'llama3' is not implemented"),
    ("LlamaConfig", dict(hidden_act="gelu"), r"hidden_act='gelu' is not implemented; allowed: "
                                             r"\['silu', 'swish'\]"),
    ("LlamaConfig", dict(mlp_bias=True), "mlp_bias=True is not implemented"),
    ("LlamaConfig", dict(attention_bias=True),
     "attention_bias=True is not implemented for model_type='llama'"),
])
def test_transformers_configs_the_decoder_does_not_implement_are_refused(cls_name, kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(_hf(cls_name, **kw))


@pytest.mark.parametrize("field, value, match", [
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling=.*'linear'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling=.*'yarn'"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     "rope_parameters=.*'dynamic'"),
    ("sliding_window", 512, "sliding_window=512"),
    ("hidden_act", "relu", "hidden_act='relu'"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("attention_bias", True, "attention_bias=True"),
])
def test_unimplemented_fields_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, field: value})


@pytest.mark.parametrize("field, value", [
    ("rope_scaling", None), ("rope_scaling", {"rope_type": "default"}),
    ("sliding_window", None), ("sliding_window", 2048),       # covers the whole context
    ("hidden_act", "silu"), ("mlp_bias", False), ("attention_bias", False),
])
def test_harmless_values_of_those_fields_are_accepted(field, value):
    assert ModelConfig.from_hf_dict({**BASE, field: value}).num_layers == 2


def test_qwen2_switched_off_window_is_ignored():
    d = {**BASE, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(d).attention_bias
    with pytest.raises(ValueError, match="sliding_window=512"):
        ModelConfig.from_hf_dict({**d, "use_sliding_window": True})
