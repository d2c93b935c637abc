#!/usr/bin/env bash
# The main job on a local default: builds weft, then on 4 MPI ranks of this machine runs the
# cluster health check (a float32 all-reduce, per-rank timings, pass/fail) and an nccl-tests-style
# all-reduce sweep. Extra arguments go to the health check (e.g. --bytes 512M --rounds 100).
# Usage: scripts/run.sh [health-check flags...]    Environment: RANKS (default 4), BUILD_DIR.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build/run}"
ranks="${RANKS:-4}"
"$root/scripts/install-deps.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo NCCL_SOCKET_IFNAME=lo
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" --parallel "$(nproc)" --target health_check allreduce_perf
launch=(mpiexec -n "$ranks" --oversubscribe --bind-to none)
echo "== cluster health check on $ranks local ranks"
# The default thresholds are the reference for 512 MiB across 64 H100 on InfiniBand; a CPU box
# moving 64 MiB through shared memory is judged by its own, much slower, yardstick.
"${launch[@]}" "$build/examples/health_check/health_check" --bytes 64M --warmup 3 --rounds 20 --expect-ms 1000 --fail-ms 5000 "$@"
echo "== all-reduce sweep on $ranks local ranks"
"${launch[@]}" "$build/bench/collectives/allreduce_perf" -b 8 -e 64M -f 8 -n 10 -w 2 -c 1
