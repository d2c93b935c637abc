#!/usr/bin/env bash
# Builds weft with warnings as errors and runs every test (unit, multi-rank through mpiexec,
# consumer projects), then again under sanitizers, then fuzzes the readers of untrusted input for a
# minute each (scripts/fuzz.sh). Usage: scripts/test.sh [build-dir]   (default: build/test)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build/test}"
"$root/scripts/install-deps.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo NCCL_SOCKET_IFNAME=lo
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WARNINGS_AS_ERRORS=ON
cmake --build "$build" --parallel "$(nproc)"
# The multi-node tests (label multinode) each make a private cluster of 2 hosts on this machine
# (scripts/private_cluster.py, root only): say before the run whether they can, or why they are skipped.
if cluster_says="$(/usr/bin/python3 "$root/scripts/private_cluster.py" --hosts 2 -- true 2>&1)"; then
  echo "weft: the multinode tests run on a private cluster of 2 hosts (network namespaces, Slurm)"
else
  echo "weft: the multinode tests will be skipped: ${cluster_says:-exit status $?}"
fi
# GPU tests need a GPU: run them on a GPU machine with `ctest -L gpu`.
ctest --test-dir "$build" --output-on-failure --label-exclude gpu --parallel 1 --timeout 600
# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer, and the threaded ones under
# ThreadSanitizer (docs/testing.md). WEFT_SANITIZERS=0 skips them for a quick local run.
if [ "${WEFT_SANITIZERS:-1}" != 0 ]; then
  "$root/scripts/sanitize.sh" address "$build-asan"
  "$root/scripts/sanitize.sh" thread "$build-tsan"
fi
# The fuzzing harnesses, built with clang in their own tree, a minute each (docs/reliability.md).
# WEFT_FUZZ=0 skips them; WEFT_FUZZ_SECONDS shortens them.
if [ "${WEFT_FUZZ:-1}" != 0 ]; then
  "$root/scripts/fuzz.sh" "$build-fuzz"
fi
