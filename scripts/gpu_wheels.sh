#!/usr/bin/env bash
# Fetch, on a machine with registry access, the wheels a lent GPU machine lacks (it reaches no
# registry): pyzmq, pydantic and cryptography with their dependencies, into .whl/ (git-ignored),
# for the device tool's `carry: [".whl"]`. The GPU image runs Python 3.12 (PYV=312 by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYV:-312}
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
  --abi "cp$PYV" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl pyzmq==27.3.0 pydantic==2.13.4 cryptography==48.0.0  # the versions CI tests with
ls .whl
