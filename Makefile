# The two commands that matter: `make demo` and `make test`. Both create .venv and install loom if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench setup clean gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,mpi,triton,parquet,data,hf,track]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/loom train

# Two test processes (pytest-xdist), each file whole in one of them (its module fixtures are built once):
# most tests wait on subprocesses, sockets or one core, so two at a time use the machine's cores better.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The GPU acceptance kit (benchmarks/gpu_check.py): make gpu-check on a CUDA machine, ARGS=--cpu anywhere.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
