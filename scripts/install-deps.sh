#!/usr/bin/env bash
# Installs the Debian packages weft's build, tests, examples and benchmarks need, if any are missing.
# Run as root (or with sudo available). Safe to run again: it does nothing when all are present.
set -euo pipefail
# slurm-wlm and munge: a private single-node Slurm for the srun launch test.
packages=(cmake ninja-build g++ openmpi-bin libopenmpi-dev catch2 librange-v3-dev libbenchmark-dev python3 python3-torch
          slurm-wlm munge)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "weft: installing missing packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
