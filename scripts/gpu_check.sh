#!/usr/bin/env bash
# On a lent GPU machine: install the carried wheels (.whl/, see scripts/gpu_wheels.sh), then run
# the GPU tests and/or the GPU benchmarks, each under a deadline, logs into $OUT (default
# gpu-check/). Usage: scripts/gpu_check.sh [tests|engine|trainer|weights|all]...  (default: tests)
# One device call runs at most 10 minutes: split the steps over calls where needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl pyzmq pydantic cryptography >"$OUT/pip.txt" 2>&1 \
    || { echo "gpu_check: installing the carried wheels failed (see $OUT/pip.txt)"; exit 2; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, without installing it
python3 - >"$OUT/env.txt" 2>&1 <<'PY'
import torch, transformers, sys
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
cat "$OUT/env.txt"
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name (at most ${secs}s)"
  timeout "$secs" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.txt"
  echo "== $name: exit $rc"
}
for what in "${@:-tests}"; do
  case $what in
    tests) step pytest-gpu 540 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 300 ;;
    engine) step bench-engine 540 python3 bench/engine.py --device cuda ;;
    trainer) step bench-trainer 540 python3 bench/trainer.py --device cuda --shape qwen0.5b ;;
    weights) step bench-weights 540 python3 bench/weights.py --mib 64 --reps 3 --kinds shm ;;
    all) "$0" tests engine trainer weights ;;
    *) echo "gpu_check: unknown step $what (tests|engine|trainer|weights|all)"; exit 2 ;;
  esac
done
