#!/usr/bin/env bash
# Builds weft's libFuzzer harnesses (tests/fuzz/*.cpp) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer, and runs each from its seed corpus (tests/fuzz/<harness>/) for
# WEFT_FUZZ_SECONDS (default 60), WEFT_FUZZ_JOBS at a time (default: one per core). Fails on any
# crash, sanitizer report, leak, allocation over 1 GiB or input that takes over 1 s; the input that
# did it is kept in BUILD/artifacts/.
#   scripts/fuzz.sh [build-dir]          (default build/fuzz; separate from the gcc trees)
#   scripts/fuzz.sh [build-dir] NAME...  only those harnesses
#   scripts/fuzz.sh --build-only|--run-only [build-dir] [NAME...]
#                                        build and run nothing, or run what an earlier build made
#                                        (scripts/test.sh builds beside the main tests)
# Replay one input: BUILD/NAME FILE.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
step=all
case "${1:-}" in
  --build-only) step=build; shift ;;
  --run-only) step=run; shift ;;
  -*) echo "scripts/fuzz.sh: unknown option '$1' (--build-only or --run-only)" >&2; exit 2 ;;
esac
build="${1:-$root/build/fuzz}"
shift || true
seconds="${WEFT_FUZZ_SECONDS:-60}"
cxx="${WEFT_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}"
launcher=()
if command -v ccache >/dev/null; then launcher=(ccache); fi

harnesses=("$@")
if [ "${#harnesses[@]}" -eq 0 ]; then
  for source in "$root"/tests/fuzz/*.cpp; do harnesses+=("$(basename "$source" .cpp)"); done
fi
mkdir -p "$build/artifacts"

# The headers are compiled as the programs compile them, without MPI or CUDA (nothing here needs them).
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
       -DWEFT_HAS_MPI=0 -DWEFT_HAS_NCCL=0 -DWEFT_HAS_CUDA=0 -include "$root/tests/fuzz/source_location_shim.hpp"
       -I"$root/include" -I"$root/examples/common" -I"$root/examples" -I"$root/tests/fuzz")
if [ "$step" != run ]; then
  echo "fuzz: building ${harnesses[*]} with $cxx"
  printf '%s\n' "${harnesses[@]}" |
    xargs -P "$(nproc)" -I{} "${launcher[@]}" "$cxx" "${flags[@]}" "$root/tests/fuzz/{}.cpp" -o "$build/{}"
fi
[ "$step" != build ] || exit 0

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# One harness per core at a time: each still runs its full WEFT_FUZZ_SECONDS, in about half the
# wall time on 2 cores (CI runs seven).
run_one() {
  local name="$1" corpus="$build/corpus/$1" log="$build/$1.log" result
  mkdir -p "$corpus"  # new inputs go here, never into the seed folder
  if "$build/$name" "$corpus" "$root/tests/fuzz/$name" -max_total_time="$seconds" -rss_limit_mb=1024 \
       -malloc_limit_mb=1024 -timeout=1 -print_final_stats=1 -artifact_prefix="$build/artifacts/$name-" \
       >"$log" 2>&1; then
    result="ok"
  else
    result="FAILED (see $log and $build/artifacts/)"
    grep -E "ERROR|SUMMARY|runtime error|Test unit written" "$log" | head -20 || true
  fi
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  coverage="$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2 || true)"  # none when a seed crashes
  printf '%-26s %10s execs  %6s edges  %s\n' "$name" "${execs:-?}" "${coverage:-?}" "$result" >"$build/$name.result"
}
parallel="${WEFT_FUZZ_JOBS:-$(nproc)}"
for name in "${harnesses[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
  echo "fuzz: $name for $seconds s"
  rm -f "$build/$name.result"
  run_one "$name" &
done
wait
failed=0
for name in "${harnesses[@]}"; do
  if [ -s "$build/$name.result" ]; then
    line="$(cat "$build/$name.result")"
  else
    line="$name: no result (the harness did not finish)"
  fi
  case "$line" in *ok) ;; *) failed=1 ;; esac
  echo "fuzz: $line"
done
exit "$failed"
