import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import llmlab  # noqa: E402,F401  (sets TRITON_INTERPRET before any kernel import)

FRANCE = "What is the capital of France?"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    return llmlab.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer():
    return llmlab.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from llmlab.models.registry import model_dir

    return AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")),
                                                dtype=torch.float32).eval()


def hf_model(name):
    from transformers import AutoModelForCausalLM

    from llmlab.models import resolve

    return AutoModelForCausalLM.from_pretrained(str(resolve(name)), dtype=torch.float32).eval()
