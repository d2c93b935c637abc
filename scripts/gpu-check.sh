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
#   GPU_CHECK_PARALLEL=4                 test slots for the tests (not the benchmarks): ctest -j
#
# Time on one H200 with 16 cores (measured where a GPU run measured it, docs/testing.md "GPU runs";
# estimated otherwise, as e, from the test's launches: about 3 s to start MPI, CUDA and NCCL):
#   build of the gpu targets (16 jobs; train_gpt.cpp is the longest file)     e 150 s
#   tests, in up to GPU_CHECK_PARALLEL slots at once (an np4 test takes 4, so it runs alone):
#     test_grad_nccl np1 1.2 s, np2 1.7 s, np4 3.3 s                              6 s
#     test_tp_nccl_gpu np1 2.6 s, np2 3.0 s, np4 4.4 s                           10 s
#     test_cp_nccl_gpu np1 1.2 s, np2 1.4 s, np4 2.4 s                            5 s
#     test_pipeline_nccl_gpu np2, np4 (with the 32 MiB boundaries of every schedule)  e 15 s
#     test_fsdp_nccl_gpu np1, np2, np4 (two-second held streams, several cases)   e 45 s
#     docs.snippet_data_parallel_nccl np1, np2                                  e 5 s
#     test_train_gpt_cuda (every CUDA operation against the CPU's, bf16 against fp32)  e 15 s
#     train_gpt_device.np2 (16 launches: CPU against GPU, dp2, tp2, tp2 + sp, cp2, pp2 1f1b and zb-h1, zero3 dp2 and tp2 + sp, curves, refusals)  e 70 s
#     train_gpt_device.np4 (3 launches: CPU against GPU as dp2 x tp2, and dp2 x tp2 + sp under zero3)  e 20 s
#     train_gpt_device_bf16 (5 launches: first step and 50 steps, bf16 against fp32)  e 20 s
#     train_gpt_device_resume (6 launches: 8 steps against 4 + resume + 4, fp32 and bf16)  e 25 s
#     train_gpt_device_sharding.np2 (11 launches of 2 ranks: dp2 against +zero1, +zero2, +zero3, +hsdp; zero3 resumed)  e 55 s
#     train_gpt_device_layouts.np2 (6 launches: tp2 + sp's and pp2's checkpoints, bf16 tp2 + sp and cp2)  e 26 s
#     in all about 250 s one after another; in 4 slots, the np4 tests alone: e 125 s
#   then alone (its deadline tests give connection setup 0.3 s):
#     test_nccl_backend np1 10.5 s, np2 46.9 s, np4 64.5 s                      122 s
#   benchmarks, one at a time after the tests (their numbers on a quiet GPU):
#     bench_allreduce_nccl.np1, health_check_nccl.np1                          e 20 s
#     bench_gpu_kernels (every operation at GPT-2 small's sizes)                e 20 s
#     bench_gpu_train (GPT-2 small, bf16, 6 steps of 8 x 1024 tokens)           e 15 s
#   total                                                                      e 470 s of the 480 s budget (configuring included)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build/gpu}"
jobs="${JOBS:-$(nproc)}"
budget="${BUDGET:-480}"
parallel="${GPU_CHECK_PARALLEL:-4}"
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
: >"$log"
# Three runs, each bounded by what is left of the budget: the tests in a few slots at once (they
# mostly wait on start-up and small kernels); then alone, one after another, test_nccl_backend
# (its deadline tests give connection setup 0.3 s) and the benchmarks (label bench), so that their
# numbers are the GPU's alone. Each run's LastTest.log is kept for the summary.
status=0
last_logs=()
phase=0
for selection in "-LE bench -E ^test_nccl_backend -j $parallel" "-R ^test_nccl_backend" "-L bench"; do
  phase=$((phase + 1))
  left=$((budget - (SECONDS - start)))
  if [ "$left" -le 10 ]; then status=124; break; fi
  set +e
  # shellcheck disable=SC2086  # the selection is several words
  timeout "$left" ctest --test-dir "$build" -L gpu $selection --output-on-failure \
    --timeout "$((left > 300 ? 300 : left))" 2>&1 | tee -a "$log"
  run_status=${PIPESTATUS[0]}
  set -e
  cp "$build/Testing/Temporary/LastTest.log" "$build/gpu-check-tests-$phase.log" 2>/dev/null || true
  last_logs+=("$build/gpu-check-tests-$phase.log")
  if [ "$run_status" -eq 124 ]; then status=124; break; fi
  if [ "$run_status" -ne 0 ]; then status=$run_status; fi
done

echo
echo "==== gpu-check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - start)) s of ${budget} s; build ${built} s) ===="
grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //' || true
# What the benchmarks and the large-boundary pipeline test printed.
grep -hE '^(pipeline p2p:|verdict:)|algbw|busbw' "${last_logs[@]}" 2>/dev/null | sort -u | head -40 || true
# train_gpt's CUDA operations, timed (bench/gpu_kernels), in the order they ran.
grep -h '^gpu kernel:' "${last_logs[@]}" 2>/dev/null | head -60 || true
# train_gpt on the GPU: against the CPU trainer (tests/train_gpt/device_check.py), bf16 against
# fp32 and resume (device_runs_check.py), and GPT-2 small's tokens/s and MFU (bench/gpu_train).
grep -hE '^(first-step loss|gradients|recompute|20 steps|bf16 first-step loss|bf16 gradients|bf16 50 steps|resume|zero1|zero2|zero3|hsdp|gpu train)[ :(]' \
  "${last_logs[@]}" 2>/dev/null | head -50 || true
grep -E 'tests passed|tests failed' "$log" || true
if [ "$status" -eq 124 ]; then
  echo "gpu-check: FAILED: the tests ran past the budget (${budget} s in all)"
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "gpu-check: FAILED"
  exit 1
fi
echo "gpu-check: OK"
