#!/usr/bin/env bash
# Install DistFlow and its test tools into the current Python (use a venv if you like); as root
# with apt-get, also the system tools some tests use (scripts/test-deps.sh: pdsh, docker-compose,
# iproute2), so that the test suite itself never installs anything.
# On a machine without an NVIDIA GPU, torch's CPU build is installed FIRST, so that
# nothing pulls gigabytes of CUDA packages. vLLM/SGLang are never installed here: they
# pin their own torch (pip install -e '.[vllm]' on GPU hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch==$TORCH_VERSION (CUDA build)"
    "$PY" -m pip install "torch==$TORCH_VERSION"
  else
    echo "setup: no GPU, installing torch==$TORCH_VERSION (CPU build)"
    # The CPU index where it is reachable; a pre-seeded local CPU wheel otherwise.
    "$PY" -m pip install "torch==$TORCH_VERSION" \
      --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 15
  fi
fi
EXTRAS="dev,trackers,ft"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # cupy and NCCL built for the CUDA major version the installed torch uses (gpu = CUDA 12, gpu-cu13 = CUDA 13)
  CUDA_MAJOR=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
  if [ "$CUDA_MAJOR" = "13" ]; then EXTRAS="dev,trackers,ft,gpu-cu13"; else EXTRAS="dev,trackers,ft,gpu"; fi
fi
"$PY" -m pip install -e ".[$EXTRAS]"
# Bytecode for the package, written even under PYTHONDONTWRITEBYTECODE: every node process would
# otherwise compile DistFlow's modules again at its start.
"$PY" -m compileall -q distflow >/dev/null || true
"$PY" -c "import torch, distflow; print(f'setup: distflow {distflow.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # optional for DistFlow itself: if apt-get cannot install them, the tests that need them skip naming them
  bash scripts/test-deps.sh || echo "setup: test tools not installed (their tests will skip): rerun scripts/test-deps.sh"
else
  echo "setup: the system tools some tests use are installed by scripts/test-deps.sh (as root with apt-get)"
fi
