# The two commands that matter: `make demo` and `make test`. Both create .venv and install loom if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The oldest torch loom supports (pyproject's lower bound): the unit and distributed tests run on it too.
# Its wheel for Linux is the CUDA build (~4.7 GB installed with its libraries); it runs on a CPU.
TORCH_OLDEST ?= 2.11.0
VENV_OLDEST := .venv-torch$(TORCH_OLDEST)
STAMP_OLDEST := $(VENV_OLDEST)/.installed

.PHONY: demo test test-fast test-oldest lint bench setup clean gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "installing loom's dependencies into $(VENV) (~3 min the first time; quiet until done)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,mpi,triton,parquet,data,hf,track,fp8,eval,serve,ft]"
	touch $(STAMP)

$(STAMP_OLDEST): pyproject.toml
	test -x $(VENV_OLDEST)/bin/python || $(PY) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q --upgrade pip
	echo "torch==$(TORCH_OLDEST)" > $(VENV_OLDEST)/constraints.txt
	$(VENV_OLDEST)/bin/python -m pip install -q -c $(VENV_OLDEST)/constraints.txt -e ".[dev,mpi,triton,parquet,data,hf,track,fp8,eval,serve]"
	touch $(STAMP_OLDEST)

setup: $(STAMP)

# The demo's steps fit a time budget: 1,000 on a CPU with bf16 units, fewer on one without (loom.train.budget).
demo: $(STAMP)
	$(BIN)/loom train --train.time_budget_s=200

# Two test processes (pytest-xdist), each file whole in one of them (its module fixtures are built once):
# most tests wait on subprocesses, sockets or one core, so two at a time use the machine's cores better.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing writes loom's
# bytecode, and every new interpreter a test starts (MPI ranks, torchrun workers) compiled src/ again (~0.8 s of
# CPU each); compileall writes it (a file changed later is compiled again: its bytecode's timestamp says so). Only
# src: pytest rewrites and compiles the test files itself, and tests/ keeps no bytecode beside its sources.
test: $(STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The edit loop: the tests that start no process (tests/tiers.py marks the others 'processes' from what they use,
# and skips here one that starts a process through loom's code) and are not 'slow'; two pytest workers as above.
test-fast: $(STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not processes and not slow" --durations=10 tests

# The unit and distributed tests on the oldest supported torch, in a virtualenv of its own (.ci/run runs both).
test-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/python -m compileall -q src
	$(VENV_OLDEST)/bin/python -m pytest -q -n 2 --dist loadfile --durations=10 tests/unit tests/distributed

# The GPU acceptance kit (benchmarks/gpu_check.py): make gpu-check on a CUDA machine, ARGS=--cpu anywhere;
# ARGS="--plan first --export DIR" for the figures that matter first and the report in 4 flat files.
# Where $(PY) already has torch (with CUDA, unless ARGS=--cpu) and loom's dependencies, as on a GPU machine
# without a package index, the kit runs from the working tree with it: no virtualenv, no pip.
gpu-check:
	@if $(PY) benchmarks/gpu_check.py --probe $(filter --cpu,$(ARGS)); then \
		PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) benchmarks/gpu_check.py $(ARGS); \
	else \
		$(MAKE) --no-print-directory setup && $(BIN)/python benchmarks/gpu_check.py $(ARGS); \
	fi

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) .venv-torch* runs .pytest_cache
