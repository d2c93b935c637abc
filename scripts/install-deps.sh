#!/usr/bin/env bash
# Installs the Debian packages weft's build, tests, examples and benchmarks need, if any are missing.
# Run as root (or with sudo available). Safe to run again: it does nothing when all are present.
set -euo pipefail
# slurm-wlm and munge: a private single-node Slurm for the srun launch tests and the main job.
# iproute2: the network namespaces of the private multi-node cluster (scripts/private_cluster.py).
# libopenblas-dev: train_gpt's GEMMs (and, through libblas.so.3, PyTorch's, for fair comparisons).
# clang-14 and libclang-rt-14-dev: the libFuzzer harnesses (scripts/fuzz.sh).
packages=(cmake ninja-build g++ openmpi-bin libopenmpi-dev catch2 librange-v3-dev libbenchmark-dev python3 python3-torch
          python3-pip slurm-wlm munge iproute2 libopenblas-dev clang-14 libclang-rt-14-dev)
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "weft: installing missing packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Hugging Face's safetensors for the system Python (Debian 12 has no package of it): the checkpoint
# tests open weft's files with it. One small wheel from PyPI; without it that one test is skipped.
if ! /usr/bin/python3 -c 'import safetensors' 2>/dev/null; then
  echo "weft: installing the safetensors Python package for /usr/bin/python3"
  $SUDO /usr/bin/python3 -m pip install --quiet --break-system-packages --root-user-action=ignore safetensors ||
    echo "weft: could not install safetensors; checkpoint_python_library will be skipped" >&2
fi
