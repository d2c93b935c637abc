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
  phase_rows+=("$(printf '  %-34s %6d s  %6d s  %s' "$phase_name" $((SECONDS - phase_started)) \
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
skipped() { phase_rows+=("$(printf '  %-34s %6s    %6s    skipped (%s)' "$1" - - "$2")"); }
side_pid=""  # the sanitizer and fuzzing builds beside the main tests (below), while they run
stop_side_builds() {  # a failing run must not leave them running behind it
  if [ -n "$side_pid" ]; then kill -- -"$side_pid" 2>/dev/null || true; wait "$side_pid" 2>/dev/null || true; fi
  side_pid=""
}
summary() {
  local rc=$?
  stop_side_builds
  end_phase "$([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")"
  echo "weft: time per phase (wall, CPU of its processes):"
  printf '%s\n' "${phase_rows[@]}"
  printf '  %-34s %6d s\n' "total" "$SECONDS"
  rm -f "$phase_times"
}
trap summary EXIT

phase "install"
"$root/scripts/install-deps.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo NCCL_SOCKET_IFNAME=lo
phase "configure + build"
# Device code for one architecture (CUDA_ARCHS, default 90 as scripts/gpu-check.sh): nothing here
# runs it, and each further architecture costs every .cu file about half its compile time again
# (attention.cu: 28 s of CPU for 80 and 90, 18 s for 90). A plain CMake build keeps 80 and 90.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WARNINGS_AS_ERRORS=ON \
  "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90}"
cmake --build "$build" --parallel "$(nproc)"
# The multi-node tests (label multinode) each make a private cluster of 2 hosts on this machine
# (scripts/private_cluster.py, root only): say before the run whether they can, or why they are skipped.
if cluster_says="$(/usr/bin/python3 "$root/scripts/private_cluster.py" --hosts 2 -- true 2>&1)"; then
  echo "weft: the multinode tests run on a private cluster of 2 hosts (network namespaces, Slurm)"
else
  echo "weft: the multinode tests will be skipped: ${cluster_says:-exit status $?}"
fi
sanitizers="${WEFT_SANITIZERS:-1}" fuzz="${WEFT_FUZZ:-1}"
# The sanitizer trees and the fuzzing harnesses are built beside the main tests, in the CPU those
# leave idle: the main tests keep 2 cores less than a third busy (MPI start-up, deadlines waited
# out, stopped ranks), and these builds are most of the rest of the run. SCHED_IDLE runs them only
# when no test wants a core, so the tests' timing is what it is without them (docs/testing.md,
# "Where CI's time goes").
side_log="$build-side-builds.log"
if [ "$sanitizers" != 0 ] || [ "$fuzz" != 0 ]; then
  priority="nice 19"
  if chrt --idle 0 true 2>/dev/null; then priority="SCHED_IDLE, nice 19"; fi
  set -m  # its own process group, so that stop_side_builds ends the compilers too
  (
    set -e
    renice -n 19 -p "$BASHPID" >/dev/null
    chrt --idle -p 0 "$BASHPID" 2>/dev/null || true  # inherited by every compiler it starts
    if [ "$sanitizers" != 0 ]; then
      "$root/scripts/sanitize.sh" --build-only address "$build-asan"
      "$root/scripts/sanitize.sh" --build-only thread "$build-tsan"
    fi
    if [ "$fuzz" != 0 ]; then "$root/scripts/fuzz.sh" --build-only "$build-fuzz"; fi
  ) >"$side_log" 2>&1 </dev/null &
  side_pid=$!
  set +m
  echo "weft: building the sanitizer trees and fuzzing harnesses beside the main tests ($priority; log: $side_log)"
fi
phase "main tests"
# GPU tests need a GPU: run them on a GPU machine with scripts/gpu-check.sh. One test per core: a
# multi-rank test claims a core per rank (PROCESSORS), so on 2 cores the single-process tests run
# two at a time and each multi-rank test alone; the timing-sensitive ones (fault, bench, multinode,
# the watchdog's signals) are RUN_SERIAL on any machine.
ctest --test-dir "$build" --output-on-failure --label-exclude gpu --parallel "$(nproc)" --timeout 600
if [ -n "$side_pid" ]; then
  phase "sanitizer + fuzz builds, the rest"
  side_rc=0
  wait "$side_pid" || side_rc=$?
  side_pid=""  # nothing left to stop
  grep -E "^(sanitize.sh|fuzz:)" "$side_log" || true
  if [ "$side_rc" != 0 ]; then
    echo "weft: the sanitizer or fuzzing build failed (exit $side_rc); the end of $side_log:" >&2
    tail -n 60 "$side_log" >&2
    exit "$side_rc"
  fi
fi
# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer, and the threaded ones under
# ThreadSanitizer (docs/testing.md). WEFT_SANITIZERS=0 skips them for a quick local run.
if [ "$sanitizers" != 0 ]; then
  phase "ASan + UBSan tests"
  "$root/scripts/sanitize.sh" --tests-only address "$build-asan"
  phase "TSan tests"
  "$root/scripts/sanitize.sh" --tests-only thread "$build-tsan"
else
  end_phase ok
  skipped "ASan + UBSan tests" "WEFT_SANITIZERS=0"
  skipped "TSan tests" "WEFT_SANITIZERS=0"
fi
# The fuzzing harnesses, built with clang in their own tree, a minute each (docs/reliability.md).
# WEFT_FUZZ=0 skips them; WEFT_FUZZ_SECONDS shortens them.
if [ "$fuzz" != 0 ]; then
  phase "fuzz run"
  "$root/scripts/fuzz.sh" --run-only "$build-fuzz"
else
  end_phase ok
  skipped "fuzz run" "WEFT_FUZZ=0"
fi
