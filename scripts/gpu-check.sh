#!/usr/bin/env bash
# Builds and runs every `gpu`-labelled test and benchmark (ctest -L gpu) on a machine with at
# least one NVIDIA GPU, within a time bound (8 minutes by default), and ends with a summary.
# Multi-rank tests (np2, np4) run several processes on one GPU when there are fewer GPUs than
# ranks: NCCL refuses two ranks of a communicator on one GPU of one host ("Duplicate GPU"), so each
# rank gets its own NCCL_HOSTID (tests/nccl/per_rank_hostid.sh), which makes NCCL treat the ranks
# as on different hosts.
#
#   scripts/gpu-check.sh                 configure build/gpu, build what the gpu tests run, run them
#   BUILD_DIR=... JOBS=... scripts/gpu-check.sh
#   BUDGET=480                           seconds for the whole script (build and tests)
#   CUDA_ARCHS="80;90"                   device code to build (default 90: H100/H200)
#   GPU_CHECK_BUILD_ONLY=1               configure and build only, no GPU needed (checks the script
#                                        and the gpu targets on a machine without one)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build/gpu}"
jobs="${JOBS:-$(nproc)}"
budget="${BUDGET:-480}"
archs="${CUDA_ARCHS:-90}"
build_only="${GPU_CHECK_BUILD_ONLY:-0}"
start=$SECONDS

# One line and exit 2 when this machine cannot run the tests.
if [ "$build_only" != 1 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: FAILED: no NVIDIA GPU here (nvidia-smi is not installed); run this on a GPU machine" >&2
    exit 2
  fi
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  if [ "$gpus" -lt 1 ]; then
    echo "gpu-check: FAILED: no NVIDIA GPU here (nvidia-smi lists none); run this on a GPU machine" >&2
    exit 2
  fi
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "gpu-check: FAILED: nvcc is not on PATH (the gpu tests include CUDA translation units); add CUDA's bin folder" >&2
  exit 2
fi
if [ "$build_only" = 1 ]; then
  echo "gpu-check: build only (GPU_CHECK_BUILD_ONLY=1); building in $build"
else
  echo "gpu-check: $gpus GPU(s) ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)); building in $build"
fi

mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WITH_NCCL=ON -DWEFT_WITH_MPI=ON \
  -DWEFT_BUILD_EXAMPLES=ON -DWEFT_BUILD_BENCHMARKS=ON -DWEFT_GPU_TESTS_SHARE_GPU=ON \
  "-DCMAKE_CUDA_ARCHITECTURES=$archs" >"$build/gpu-check-configure.log" 2>&1 ||
  { tail -20 "$build/gpu-check-configure.log" >&2; echo "gpu-check: FAILED: configuring $build (log: $build/gpu-check-configure.log)" >&2; exit 1; }

# Only the programs the gpu-labelled tests run: every path of the build tree in their commands
# (mpiexec's program argument included) that names a target. A test whose own program is not built
# yet (add_test(NAME x COMMAND x)) has no command in ctest's listing, so its add_test line in the
# generated CTestTestfile.cmake files gives it.
targets="$(ctest --test-dir "$build" -L gpu --show-only=json-v1 | python3 -c '
import json, os, re, sys
build = sys.argv[1]
written = {}
for folder, dirs, files in os.walk(build):
    dirs[:] = [d for d in dirs if d != "CMakeFiles"]
    if "CTestTestfile.cmake" in files:
        with open(os.path.join(folder, "CTestTestfile.cmake")) as f:
            for line in f:
                m = re.match(r"add_test\(\[=\[(.*?)\]=\] (.*)\)$", line.strip())
                if m:
                    written[m.group(1)] = re.findall(r"\"([^\"]*)\"", m.group(2))
names = set()
for test in json.load(sys.stdin).get("tests", []):
    for arg in test.get("command") or written.get(test["name"], []):
        if arg.startswith(build + "/"):
            names.add(os.path.basename(arg))
print("\n".join(sorted(names)))
' "$build")"
known="$(ninja -C "$build" -t targets all | sed -n 's/^\([A-Za-z0-9_.+-]*\): .*/\1/p' | sort -u)"
build_targets=()
for t in $targets; do
  if grep -qx -- "$t" <<<"$known"; then build_targets+=("$t"); fi
done
if [ "${#build_targets[@]}" -eq 0 ]; then
  echo "gpu-check: FAILED: no gpu-labelled test in $build (was CUDA/NCCL found? see $build/gpu-check-configure.log)" >&2
  exit 1
fi
echo "gpu-check: building ${#build_targets[@]} targets: ${build_targets[*]}"
cmake --build "$build" -j "$jobs" --target "${build_targets[@]}" >"$build/gpu-check-build.log" 2>&1 ||
  { grep -m 20 -E 'error|Error' "$build/gpu-check-build.log" >&2 || true; echo "gpu-check: FAILED: building the gpu targets (log: $build/gpu-check-build.log)" >&2; exit 1; }
built=$((SECONDS - start))
echo "gpu-check: built in ${built} s"
if [ "$build_only" = 1 ]; then
  echo "gpu-check: tests that would run: $(ctest --test-dir "$build" -L gpu -N | grep -c 'Test *#')"
  exit 0
fi

# A hang is a failure with a name: ctest's per-test timeouts apply, and the whole run is bounded
# by what is left of the budget.
export WEFT_COMM_TIMEOUT="${WEFT_COMM_TIMEOUT:-120}"
left=$((budget - built))
if [ "$left" -lt 60 ]; then
  echo "gpu-check: FAILED: the build took ${built} s of the ${budget} s budget; no time left for the tests (BUDGET=...)" >&2
  exit 1
fi
log="$build/gpu-check.log"
set +e
timeout "$left" ctest --test-dir "$build" -L gpu --output-on-failure --timeout "$((left > 300 ? 300 : left))" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e

echo
echo "==== gpu-check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - start)) s of ${budget} s; build ${built} s) ===="
grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //' || true
# What the benchmarks and the large-boundary pipeline test printed.
grep -hE '^(pipeline p2p:|verdict:)|algbw|busbw' "$build/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u | head -40 || true
# train_gpt's CUDA operations, timed (bench/gpu_kernels), in the order they ran.
grep -h '^gpu kernel:' "$build/Testing/Temporary/LastTest.log" 2>/dev/null | head -60 || true
# train_gpt on the GPU: against the CPU trainer (tests/train_gpt/device_check.py), and GPT-2 small's
# tokens/s and MFU (bench/gpu_train).
grep -hE '^(first-step loss|gradients|20 steps|gpu train)[ :(]' "$build/Testing/Temporary/LastTest.log" 2>/dev/null | head -20 || true
grep -E 'tests passed|tests failed' "$log" | tail -1 || true
if [ "$status" -eq 124 ]; then
  echo "gpu-check: FAILED: the tests ran past the budget (${budget} s in all)"
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "gpu-check: FAILED"
  exit 1
fi
echo "gpu-check: OK"
