# Two entry points: `make serve` (the shipped demo DeepSeek-V4.1 with its trained DSpark draft) and
# `make test` (the whole suite).
# Both create or reuse a virtualenv in $(VENV); `make serve` installs only what serving needs,
# `make test` (and `make lint`) add the test tools (the `test` extra).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Where a GPU torch is installed system-wide (ROCm or CUDA), the venv sees it and we never replace it.
VENV_FLAGS ?= --system-site-packages
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
HOST ?= 127.0.0.1
PORT ?= 30000

.PHONY: serve test lint install clean

install: $(VENV)/.installed

$(VENV)/.installed-serve: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install "triton==3.6.0"
	$(PIP) install -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-serve
	$(PIP) install -e ".[test]"
	touch $@

serve: $(VENV)/.installed-serve
	$(PY) -m sgl_dspark.launch_server --model-path demo --speculative-algorithm DSpark --host $(HOST) --port $(PORT)

test: $(VENV)/.installed
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check python test benchmark
	$(PY) -m ruff format --check python test benchmark
	$(PY) -m mypy python/sgl_dspark/srt python/sgl_dspark/kernels

clean:
	rm -rf $(VENV) build *.egg-info
