import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import copy  # noqa: E402

import llmlab  # noqa: E402,F401  (sets TRITON_INTERPRET before any kernel import)
import llmlab.device  # noqa: E402

FRANCE = "What is the capital of France?"
# `make test-thorough`: property tests draw five times the examples
THOROUGH = os.environ.get("LLMLAB_THOROUGH") == "1"
PROPERTY_EXAMPLES = 5 if THOROUGH else 1

# Unmarked tests build their tensors on the CPU and check against CPU references (HF
# transformers included): pin llmlab's default device there, so that a model loaded
# without device= meets them on a machine with CUDA too. Tests marked gpu ask for
# "cuda" by name.
llmlab.device.set_default_device("cpu")

# A parallel run (pytest -n N, as `make test` does): each worker takes its share of the
# cores, so that N workers do not each start a thread per core.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    llmlab.device.share_cores(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))

# Triton kernels run compiled where there is a GPU (llmlab sets TRITON_INTERPRET=1 only
# without one), in the interpreter elsewhere: kernel tests put their tensors here.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tolerance(dtype: torch.dtype) -> float:
    """The norm-wise relative error ``‖out − ref‖ / ‖ref‖`` allowed for attention whose
    inputs, probabilities and output are in ``dtype``, against a float32 (or float64)
    reference computed from the same rounded inputs.

    Rounding the probabilities and the output to ``dtype`` costs about half a unit of
    round-off u = eps / 2 (measured 0.5–0.6 u for float16 and bfloat16, d 64 and 128,
    1k–4k keys, causal or not); allowed: 2 u = eps, i.e. 9.8e-4 for float16 and 7.8e-3
    for bfloat16. float32 is limited by summation over thousands of keys: 16 eps ≈ 2e-6.
    """
    eps = torch.finfo(dtype).eps
    return 16 * eps if dtype == torch.float32 else eps


def model_tolerance(dtype: torch.dtype) -> float:
    """The norm-wise relative error allowed for a whole model's logits in ``dtype`` against
    the same weights in float32: weights and activations are rounded a few times per
    layer, so it is a few units of round-off (bfloat16, measured on the CPU: 3–6 u for
    tiny-llama's 2 layers and SmolLM2's 30); allowed: 12 u = 6 eps (0.047 for bfloat16)."""
    return 6 * torch.finfo(dtype).eps


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64."""
    out, ref = out.double(), ref.double().to(out.device)
    return ((out - ref).norm() / ref.norm()).item()


def on_kernel_device(model):
    """``model`` where the Triton kernels run: itself on a CPU-only machine, else a copy
    on CUDA (same weights and dtype), so its tensors reach a compiled kernel."""
    if model.device.type == KERNEL_DEVICE.type:
        return model
    return copy.deepcopy(model).to(KERNEL_DEVICE)


# Tests that load SmolLM2 (these fixtures) are slow, except the one marked `smoke`:
# `make test-fast` keeps a single SmolLM2 parity test.
SMOLLM2_FIXTURES = {"smollm2", "hf_smollm2"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ())) and \
                item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _close_figures():
    """Plots drawn by a test are closed after it, so a worker's figures do not pile up."""
    yield
    if "matplotlib.pyplot" in sys.modules:       # only where a test drew something
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture(scope="module")
def tiny():
    """The tiny random Llama with sdpa attention, fresh for each test module."""
    return llmlab.load_model("tiny-llama", attention="sdpa")


@pytest.fixture(scope="module")
def tiny_tok():
    return llmlab.load_tokenizer("tiny-llama")


@pytest.fixture(scope="session")
def smollm2():
    return llmlab.load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tokenizer():
    return llmlab.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from llmlab.models import resolve

    return AutoModelForCausalLM.from_pretrained(str(resolve("smollm2-135m")),
                                                dtype=torch.float32).eval()


def hf_model(name):
    from transformers import AutoModelForCausalLM

    from llmlab.models import resolve

    return AutoModelForCausalLM.from_pretrained(str(resolve(name)), dtype=torch.float32).eval()
