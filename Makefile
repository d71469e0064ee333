# Two entry points, each doing its own setup in a local venv:
#   make demo   -- answer a question hidden deep in a long real text with SmolLM2 + MiniKV
#   make test   -- the test suite (GPU tests skip themselves without CUDA)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: `torch==2.13.0` resolves to the local CPU build on the CPU machines; a bare
# `torch` requirement would pull several GB of CUDA wheels. Keep an already-installed torch.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,demo,serve]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m minikv_compile.demo

# --durations=25: the slowest tests stand in CI's log, so that a slow one is seen when it lands.
# Two worker processes, a test file each at a time (--dist loadfile: a module's shared engines
# are compiled once, in one worker): most tests run on one core (compiles, the interpreter), so
# two of them fill the 2-core CI machine (773 -> 592 s there). JOBS=0 runs in one process.
JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info
