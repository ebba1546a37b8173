#!/usr/bin/env bash
# The system tools some tests use, installed in one step. Idempotent: installs only what is
# missing. Debian/Ubuntu, as root with apt-get (scripts/setup.sh runs it there). Tests never
# install anything: without a tool, its tests skip naming it and this script.
#   pdsh            the pdsh launcher, for real (tests/test_deploy.py, tests/test_multihost.py)
#   docker-compose  deploy/docker-compose.yml resolved by a real `compose config` (tests/test_deploy.py);
#                   not needed where Docker's own `docker compose` plugin works
#   ip (iproute2)   several hosts in network namespaces (tests/test_multihost.py; these also need root)
#   slurmctld, slurmd, munged (slurm-wlm, munge)   a real one-host Slurm (tests/test_slurm.py, as root)
set -euo pipefail
TOOLS=("pdsh:pdsh" "docker-compose:docker-compose" "ip:iproute2" "slurmctld:slurm-wlm" "slurmd:slurm-wlm"
       "munged:munge")  # binary:Debian package

missing=()
for tool in "${TOOLS[@]}"; do
  bin=${tool%%:*} pkg=${tool#*:}
  if [ "$bin" = docker-compose ] && command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
    continue
  fi
  command -v "$bin" >/dev/null 2>&1 || [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "test-deps: pdsh, docker-compose, ip, slurmctld, slurmd, munged are installed"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: missing ${missing[*]}: install them as root (apt-get install ${missing[*]}); until then their tests skip" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "test-deps: apt-get install ${missing[*]}"
if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
  apt-get update -q  # a fresh machine has no package lists yet
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
