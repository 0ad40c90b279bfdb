# One virtualenv, made by this Makefile on first use, so a fresh clone installs itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-integration bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvguard demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration tests/e2e

bench: $(STAMP)
	for b in bench/bench_*.py; do $(BIN)/python $$b; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
