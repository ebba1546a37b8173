#!/usr/bin/env bash
# On a lent GPU machine: install the carried wheels (.whl/, see scripts/gpu_wheels.sh), then run
# the GPU tests and/or the GPU benchmarks, each under a deadline, logs into $OUT (default
# gpu-check/). Usage: scripts/gpu_check.sh [tests|engine|trainer|weights]...  (default: tests)
# One device call runs at most 10 minutes: one step per call (each may take up to 9). PYTEST_ARGS
# narrows the tests step (e.g. PYTEST_ARGS="tests/test_cluster.py tests/test_gsm8k.py" for the CLI
# runs alone). Exits with the worst step's status. A step past its deadline gets SIGINT first, so
# pytest still prints which test it was in and its summary.
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
worst=0
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name (at most ${secs}s)"
  timeout -s INT -k 20 "$secs" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.txt"
  echo "== $name: exit $rc"
  [ "$rc" -gt "$worst" ] && worst=$rc
  return 0
}
for what in "${@:-tests}"; do
  case $what in
    tests)
      rm -rf /tmp/gpu-pytest
      # shellcheck disable=SC2086  # PYTEST_ARGS: paths and options, split on purpose
      step pytest-gpu 520 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 300 --durations=0 \
        --basetemp=/tmp/gpu-pytest ${PYTEST_ARGS:-}
      # the nodes' own logs (gone with the machine otherwise)
      find /tmp/gpu-pytest -name '*.log' -size -4M 2>/dev/null | tar czf "$OUT/node-logs.tgz" -T - 2>/dev/null ;;
    engine) step bench-engine 520 python3 bench/engine.py --device cuda ;;
    trainer) step bench-trainer 520 python3 bench/trainer.py --device cuda --shape qwen0.5b ;;
    weights) step bench-weights 520 python3 bench/weights.py --mib 64 --reps 3 --kinds shm ;;
    *) echo "gpu_check: unknown step $what (tests|engine|trainer|weights; one per device call)"; exit 2 ;;
  esac
done
exit "$worst"
