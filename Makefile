# Set-up commands (the README's first two lines). Both install into .venv first:
# torch==2.13.0, unless .venv already has a torch (a user's own CUDA build, kept), before
# anything that depends on it, so pip never pulls another build; then tessera with its test
# extras.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/tessera train configs/demo.yaml --nproc 2

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python benchmarks/bench_training.py --quick

clean:
	rm -rf runs .pytest_cache
