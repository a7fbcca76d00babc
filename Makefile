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

.PHONY: serve test test-graph-pool lint install clean

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

# The tests of the captured regions again, with the CPU graph stand-ins enforcing the graph
# pool's rule (docs/architecture.md): CI runs it after `make test`.
GRAPH_POOL_TESTS := test/registered/e2e/test_cuda_graph_runner.py \
	test/registered/e2e/test_dspark_capped_graphs.py test/registered/e2e/test_overlap_schedule.py \
	test/registered/e2e/test_dspark_plain_decode.py test/registered/e2e/test_prefill_graphs.py \
	test/registered/e2e/test_dspark_sampled_graphs.py test/registered/e2e/test_dspark_v41.py \
	test/registered/distributed/test_tensor_parallel.py \
	test/registered/distributed/test_tensor_parallel_v41.py
test-graph-pool: $(VENV)/.installed
	$(PY) -m pytest -n $(PYTEST_WORKERS) --poison-stale-graph-outputs $(GRAPH_POOL_TESTS)

lint: $(VENV)/.installed
	$(PY) -m ruff check python test benchmark
	$(PY) -m ruff format --check python test benchmark
	$(PY) -m mypy python/sgl_dspark/srt python/sgl_dspark/kernels

clean:
	rm -rf $(VENV) build *.egg-info
