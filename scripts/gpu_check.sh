#!/usr/bin/env bash
# On a lent GPU machine: install the carried wheels (.whl/, see scripts/gpu_wheels.sh), then run
# the GPU tests and/or the GPU benchmarks, each under a deadline, logs into $OUT (default
# gpu-check/). Usage: scripts/gpu_check.sh [all|tests|runs|engine|trainer|weights]... (default: all)
# One device call runs at most 10 minutes, so `all` (every single-GPU test, then each benchmark
# at a reduced size) fits in one, with this budget per part (seconds; a part that overruns gets
# SIGINT, then SIGKILL 5 s later, and the parts after it still run):
#   setup (wheels, versions) ~20 | tests 190 (every other GPU test; 27 at the time of writing)
#   | runs 140 (the `distflow run` GPU tests: test_gsm8k, test_cluster) | engine 110 | trainer 60
#   | weights 40  => <= 560 s
# so run it with the device tool's timeout_s=600. The whole script also stops starting parts
# once GPU_CHECK_BUDGET_S (default 575) seconds are spent: a part gets at most what is left.
# The `distflow run` tests take minutes each: in `all` the ones past 140 s are cut (their log
# says which); `scripts/gpu_check.sh runs` alone gives them 520 s. A part named alone
# (tests|runs|engine|trainer|weights) gets 520 s and the full-size benchmark.
# PYTEST_ARGS narrows the tests part (e.g. PYTEST_ARGS="tests/test_gpu_engine.py"). Exits with the
# worst part's status. A part past its deadline gets SIGINT first, so pytest still prints which
# test it was in and its summary. Tests that need two GPUs skip on the one-GPU machine.
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
budget=${GPU_CHECK_BUDGET_S:-575}
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local left=$((budget - SECONDS - 5))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, the check's budget (${budget}s) is spent"; worst=124; return 0
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (at most ${secs}s)"
  local t0=$SECONDS
  timeout -s INT -k 5 "$secs" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.txt"
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -gt "$worst" ] && worst=$rc
  return 0
}
RUNS="tests/test_gsm8k.py tests/test_cluster.py"  # GPU tests that start a whole `distflow run`
tests() {  # seconds: every GPU test but the runs
  rm -rf /tmp/gpu-pytest
  local ignore="" f
  for f in $RUNS; do ignore="$ignore --ignore=$f"; done
  # shellcheck disable=SC2086  # PYTEST_ARGS, ignore: paths and options, split on purpose
  step pytest-gpu "$1" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 120 --durations=0 \
    --basetemp=/tmp/gpu-pytest $ignore ${PYTEST_ARGS:-tests}
}
runs() {  # seconds: the `distflow run` GPU tests
  rm -rf /tmp/gpu-runs
  # shellcheck disable=SC2086  # RUNS: paths, split on purpose
  step pytest-gpu-runs "$1" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=0 \
    --basetemp=/tmp/gpu-runs $RUNS
  # the nodes' own logs (gone with the machine otherwise)
  find /tmp/gpu-runs -name '*.log' -size -4M 2>/dev/null | tar czf "$OUT/node-logs.tgz" -T - 2>/dev/null
}
for what in "${@:-all}"; do
  case $what in
    all)
      tests 190
      runs 140
      # bench/engine.py exits non-zero when CUDA graphs were asked for and not used
      step bench-engine 110 python3 bench/engine.py --device cuda --shape qwen0.5b --fixed-prompts 64 \
        --fixed-new 128 --prompts 128 --max-new 128 --slots 64 --no-hf-compile
      step bench-trainer 60 python3 bench/trainer.py --device cuda --shape qwen0.5b --reps 2
      step bench-weights 40 python3 bench/weights.py --mib 64 --reps 2 --kinds shm --cuda-gib 0.5 ;;
    tests) tests 520 ;;
    runs) runs 520 ;;
    engine) step bench-engine 520 python3 bench/engine.py --device cuda ;;
    trainer) step bench-trainer 520 python3 bench/trainer.py --device cuda --shape qwen0.5b ;;
    weights) step bench-weights 520 python3 bench/weights.py --mib 64 --reps 3 --kinds shm ;;
    *) echo "gpu_check: unknown part $what (all|tests|runs|engine|trainer|weights)"; exit 2 ;;
  esac
done
exit "$worst"
