#!/usr/bin/env bash
# System packages the test suite uses (Debian/Ubuntu, as root with apt-get; scripts/setup.sh calls
# this then). Without them the tests that need them skip, naming the package.
#   slurm-wlm munge: tests/test_slurm.py starts a real one-host Slurm (slurmctld, slurmd, munged)
set -euo pipefail
PACKAGES="slurm-wlm munge"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: not root with apt-get; skipping ($PACKAGES): the tests needing them will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $PACKAGES || { apt-get update -q && apt-get install -y -q --no-install-recommends $PACKAGES; }
