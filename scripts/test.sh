#!/usr/bin/env bash
# Builds weft with warnings as errors and runs every test (unit, multi-rank through mpiexec,
# consumer projects), then again under sanitizers, then fuzzes the readers of untrusted input for a
# minute each (scripts/fuzz.sh). Usage: scripts/test.sh [build-dir]   (default: build/test)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build/test}"

# Time per phase, printed as one summary at the end, on success and on failure, so that a CI log
# says where its time went: wall seconds, and the CPU seconds (user + sys) of the phase's processes,
# which other work on the machine does not inflate as it does the wall time.
phase_rows=()
phase_name=""
phase_times="$(mktemp)"
children_cpu() {  # sets cpu: user + sys seconds of every finished child of this shell so far
  times >"$phase_times"
  cpu="$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, t, "m"); sub("s$", "", t[2]); s += t[1] * 60 + t[2] }
                       printf "%.0f", s }' "$phase_times")"
}
end_phase() {  # end_phase STATUS: closes the phase that runs, if any
  [ -n "$phase_name" ] || return 0
  children_cpu
  phase_rows+=("$(printf '  %-30s %6d s  %6d s  %s' "$phase_name" $((SECONDS - phase_started)) \
                  $((cpu - phase_cpu)) "$1")")
  phase_name=""
}
phase() {  # phase NAME: the commands that follow belong to NAME
  end_phase ok
  phase_name="$1"
  phase_started=$SECONDS
  children_cpu
  phase_cpu=$cpu
}
skipped() { phase_rows+=("$(printf '  %-30s %6s    %6s    skipped (%s)' "$1" - - "$2")"); }
summary() {
  local rc=$?
  end_phase "$([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")"
  echo "weft: time per phase (wall, CPU of its processes):"
  printf '%s\n' "${phase_rows[@]}"
  printf '  %-30s %6d s\n' "total" "$SECONDS"
  rm -f "$phase_times"
}
trap summary EXIT

phase "install"
"$root/scripts/install-deps.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo NCCL_SOCKET_IFNAME=lo
phase "configure + build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WARNINGS_AS_ERRORS=ON
cmake --build "$build" --parallel "$(nproc)"
# The multi-node tests (label multinode) each make a private cluster of 2 hosts on this machine
# (scripts/private_cluster.py, root only): say before the run whether they can, or why they are skipped.
if cluster_says="$(/usr/bin/python3 "$root/scripts/private_cluster.py" --hosts 2 -- true 2>&1)"; then
  echo "weft: the multinode tests run on a private cluster of 2 hosts (network namespaces, Slurm)"
else
  echo "weft: the multinode tests will be skipped: ${cluster_says:-exit status $?}"
fi
phase "main tests"
# GPU tests need a GPU: run them on a GPU machine with `ctest -L gpu`. One test per core: a
# multi-rank test claims a core per rank (PROCESSORS), so on 2 cores the single-process tests run
# two at a time and each multi-rank test alone; the timing-sensitive ones (fault, bench, multinode,
# the watchdog's signals) are RUN_SERIAL on any machine.
ctest --test-dir "$build" --output-on-failure --label-exclude gpu --parallel "$(nproc)" --timeout 600
# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer, and the threaded ones under
# ThreadSanitizer (docs/testing.md). WEFT_SANITIZERS=0 skips them for a quick local run.
if [ "${WEFT_SANITIZERS:-1}" != 0 ]; then
  phase "ASan + UBSan build + tests"
  "$root/scripts/sanitize.sh" address "$build-asan"
  phase "TSan build + tests"
  "$root/scripts/sanitize.sh" thread "$build-tsan"
else
  end_phase ok
  skipped "ASan + UBSan build + tests" "WEFT_SANITIZERS=0"
  skipped "TSan build + tests" "WEFT_SANITIZERS=0"
fi
# The fuzzing harnesses, built with clang in their own tree, a minute each (docs/reliability.md).
# WEFT_FUZZ=0 skips them; WEFT_FUZZ_SECONDS shortens them.
if [ "${WEFT_FUZZ:-1}" != 0 ]; then
  phase "fuzz build + run"
  "$root/scripts/fuzz.sh" "$build-fuzz"
else
  end_phase ok
  skipped "fuzz build + run" "WEFT_FUZZ=0"
fi
