#!/usr/bin/env bash
# Builds weft's tests with sanitizers and runs them (part of scripts/test.sh; run alone to look closer).
#   scripts/sanitize.sh [--build-only|--tests-only] address|thread [build-dir]
#   (--build-only: configure and build, run nothing; --tests-only: run what an earlier --build-only built.
#   scripts/test.sh builds the sanitizer trees beside the main tests, at idle priority, then runs them.)
#   scripts/sanitize.sh address [build-dir]   AddressSanitizer + UndefinedBehaviorSanitizer: every
#                                             unit and multi-rank test program, at one rank count
#                                             (default build/asan)
#   scripts/sanitize.sh thread [build-dir]    ThreadSanitizer: the tests of code that runs threads
#                                             (progress threads, the gradient synchronizer, the
#                                             communicator's async paths; default build/tsan)
# Findings in Open MPI's own libraries are suppressed (tests/sanitizers/*.supp says why, one by one);
# findings in weft's code fail the test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: scripts/sanitize.sh [--build-only|--tests-only] address|thread [build-dir]"
step=all
case "${1:-}" in
  --build-only) step=build; shift ;;
  --tests-only) step=tests; shift ;;
  -*) echo "scripts/sanitize.sh: unknown option '$1'; $usage" >&2; exit 2 ;;
esac
kind="${1:?$usage}"
supp="$root/tests/sanitizers"
case "$kind" in
  address)
    build="${2:-$root/build/asan}"
    flags="address,undefined"
    # Which tests: all but GPU, the consumer projects (separate builds), the private Slurm, those
    # that preload a library (the sanitizer's runtime must come first), the rank counts of a
    # multi-rank program other than the one chosen for this run (extra_ranks: the main build runs
    # them all; cmake/WeftTesting.cmake), and loops of short jobs that end at their first check
    # (launch_loop: process starts, slow here, not code the other tests leave unchecked), and the
    # programs that must not compile (compile: the compiler's diagnostics, which no sanitizer changes).
    excluded='gpu|consumer|slurm|preload|extra_ranks|extra_layouts|launch_loop|compile'
    # intercept_tls_get_addr=0: LeakSanitizer's own record of the threads' dynamic TLS blocks (kept
    # by intercepting __tls_get_addr) held a bogus range for a library loaded and unloaded during
    # an Open MPI run ("DTLS 6 at 0x3f84-0x400005086" in its thread log), which its tracer then
    # read and crashed on ("Tracer caught signal 11: addr=0x3f88", the np4 runs of test_comm
    # started with --bind-to none, as the tests start them; with the default binding it did not
    # happen). Without the interception the dynamic TLS blocks stay roots as what the dynamic
    # linker allocated (use_ld_allocations, on by default), so no leak check is lost.
    asan="detect_leaks=1:abort_on_error=0:exitcode=23:detect_stack_use_after_return=0:intercept_tls_get_addr=0"
    lsan="suppressions=$supp/lsan.supp:print_suppressions=0"
    # Leak reports must name the library that allocated, or Open MPI's own cannot be suppressed:
    # its libraries have no frame pointers (the slow unwinder walks them), and Open MPI and PMIx
    # unload their plugins at finalize (keep them loaded so their names stay in the stacks).
    with_open_mpi=(ASAN_OPTIONS="$asan:fast_unwind_on_malloc=0" LSAN_OPTIONS="$lsan:fast_unwind_on_malloc=0")
    # The unit tests load no Open MPI, so the fast unwinder names every frame of theirs; the slow
    # one made them up to 15x slower (test_layout 47 s against 3 s; test_tune 69 s against 36 s).
    without_open_mpi=(ASAN_OPTIONS="$asan:fast_unwind_on_malloc=1" LSAN_OPTIONS="$lsan:fast_unwind_on_malloc=1")
    export OMPI_MCA_mca_base_component_disable_dlclose=1 PMIX_MCA_mca_base_component_disable_dlclose=1
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    ;;
  thread)
    build="${2:-$root/build/tsan}"
    flags="thread"
    # The watchdog thread runs in every one of these (each communicator registers with it);
    # test_moe's asynchronous all_to_allv runs on the progress thread.
    # targets: the programs that hold those tests (test_comm and test_fsdp hold others too, which
    # select leaves out).
    targets=(test_progress_thread test_grad test_comm test_trace signal_program test_checkpoint test_fsdp test_moe)
    select=(--tests-regex '^(test_progress_thread|test_grad_.*|test_comm_behaviour\..*|test_ref_and_trace\..*|test_trace|test_trace_signals|test_checkpoint|test_fsdp_(schedule|hybrid|root)\..*|test_moe\..*)$'
            --label-exclude 'gpu|consumer|slurm')
    export TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:exitcode=23:second_deadlock_stack=1"
    ;;
  *) echo "scripts/sanitize.sh: unknown sanitizer '$kind' (address or thread)" >&2; exit 2 ;;
esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo
# One BLAS thread per process, as the tests' ranks use anyway: OpenBLAS starts its thread pool when
# the library loads, and a program that exits at once (an error path of weft-plan or train_gpt)
# could end while a pool thread was still inside the sanitizer's own thread start, whose
# allocation (glibc's pthread_getattr_np) LeakSanitizer then reported as a leak (weft_plan_cli
# failed 3 of 24 runs that way under ASan; 40 of 40 passed with one thread).
export OPENBLAS_NUM_THREADS=1
# The fault tests' repeated trials (fault_sigkill's 20 kills at random moments) look for timing,
# which the main build's run covers; here a few trials check the same paths under the sanitizer.
export WEFT_FAULT_MAX_TRIALS=4
# No CUDA in sanitizer builds (nvcc and the CUDA runtime do not take these flags); benchmarks'
# timing loops add build time and nothing the tests do not cover.
# -O1 -g1, the sanitizers' own advice, not RelWithDebInfo's -O2 -g: the instrumented build is most
# of CI's time, and these flags halve it (test_collectives.cpp: 74 s of CPU against 146 s under
# ASan + UBSan) while reports keep their function names and lines. Warnings are errors in the
# main build (scripts/test.sh); here they are reported only, since GCC's flow-based warnings
# (-Wmaybe-uninitialized and the like) change with the optimization level and the
# instrumentation, and a false positive of this tree's alone must not stop the sanitizers' run.
if [ "$step" != tests ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_SANITIZE="$flags" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DWEFT_WITH_NCCL=OFF -DWEFT_BUILD_BENCHMARKS=OFF -DWEFT_WARNINGS_AS_ERRORS=OFF >/dev/null
  started=$SECONDS
  if [ -n "${targets+x}" ]; then
    cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"
  else
    cmake --build "$build" --parallel "$(nproc)"
  fi
  echo "sanitize.sh $kind: built in $((SECONDS - started)) s"
fi
[ "$step" != build ] || exit 0
started=$SECONDS
trap 'echo "sanitize.sh $kind: tests ran $((SECONDS - started)) s"' EXIT
# LeakSanitizer's own tracer (the thread that stops the process to scan it at exit) can crash:
# "Tracer caught signal 11 ... LeakSanitizer has encountered a fatal error" after the test's checks
# all passed, and the leak check never runs (google/sanitizers#1353; here the dynamic TLS record
# above, now off). A test whose only failure is that crash runs once more, with LeakSanitizer's
# thread log on (every range it scans, so the log says which one it read); if the tracer crashes
# again, the test runs a third time without the leak check, every AddressSanitizer and UBSan check
# still on, and must pass, and the log names it as run without a leak check. A test that failed
# any other way (an assertion, a sanitizer's report, a timeout) is never rerun.
tracer_crashes() {  # the tests in ctest's output $1 that failed with the tracer's crash and nothing else
  awk 'function flush() { if (name != "" && crashed && !other) print name }
       / Test +#[0-9]+: / { flush(); name = ""; crashed = other = 0
                            if ($0 ~ /\*\*\*(Failed|Exception)/) { sub(/.* Test +#[0-9]+: /, ""); sub(/ .*/, ""); name = $0 }
                            next }
       /^ +Start +[0-9]+: / || /^[0-9]+% tests passed/ { flush(); name = "" }
       /LeakSanitizer has encountered a fatal error/ { crashed = 1 }
       /ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:|FAILED:|Timeout/ { other = 1 }
       END { flush() }' "$1"
}
ctest_run() { ctest --test-dir "$build" --output-on-failure --parallel 1 --timeout 900 "$@"; }
# only_tracer_crashes OUT: prints the tests that failed in the ctest run whose output is OUT when
# every one of them failed only by the tracer's crash; prints nothing otherwise.
only_tracer_crashes() {
  local failed crashed
  failed="$(sed -n 's/^[0-9]*://p' "$build/Testing/Temporary/LastTestsFailed.log" | sort)"
  crashed="$(tracer_crashes "$1" | sort)"
  if [ -n "$crashed" ] && [ "$failed" = "$crashed" ]; then echo "$crashed"; fi
}
# exactly NAME...: the alternation that matches those test names only (dots literal).
exactly() { printf '%s\n' "$@" | sed 's/[.]/[.]/g' | paste -sd'|'; }
run_tests() {
  local out rc=0 crashed again
  out="$(mktemp)"
  ctest_run "$@" | tee "$out" || rc=$?
  if [ "$rc" != 0 ] && crashed="$(only_tracer_crashes "$out")" && [ -n "$crashed" ]; then
    again="$(exactly $crashed)"
    echo "sanitize.sh $kind: LeakSanitizer's tracer crashed at the exit of $(echo $crashed); running them once more, with its thread log"
    rc=0
    (export LSAN_OPTIONS="${LSAN_OPTIONS:-}:verbosity=1:log_threads=1"
     ctest_run --tests-regex "^($again)\$") | tee "$out" || rc=$?
    if [ "$rc" != 0 ] && crashed="$(only_tracer_crashes "$out")" && [ -n "$crashed" ]; then
      again="$(exactly $crashed)"
      echo "sanitize.sh $kind: the tracer crashed again at the exit of $(echo $crashed); running them without the leak check (every other check on): leak check NOT RUN for $(echo $crashed)"
      rc=0
      (export ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}"
       ctest_run --tests-regex "^($again)\$") || rc=$?
    fi
  fi
  rm -f "$out"
  return "$rc"
}
if [ "$kind" = address ]; then
  rc=0
  # The unit tests are single processes: one per core (the timing-sensitive ones are RUN_SERIAL).
  (export "${without_open_mpi[@]}"; run_tests --label-regex '^unit$' --label-exclude "$excluded" --parallel "$(nproc)") || rc=$?
  (export "${with_open_mpi[@]}"; run_tests --label-exclude "unit|$excluded") || rc=$?
  exit "$rc"
fi
run_tests "${select[@]}"
