#!/usr/bin/env bash
# Builds what the GPU tests need (in build/gpu, with NCCL) and runs every `gpu` ctest on a machine
# with at least one NVIDIA GPU. Multi-rank tests (np2, np4) run several processes on one GPU when
# there are fewer GPUs than ranks: NCCL refuses two ranks of a communicator on one GPU of one host
# ("Duplicate GPU"), so each rank gets its own NCCL_HOSTID (tests/nccl/per_rank_hostid.sh), which
# makes NCCL treat the ranks as on different hosts.
#
#   scripts/gpu-check.sh            configure, build the gpu test targets, run `ctest -L gpu`
#   BUILD_DIR=... JOBS=... scripts/gpu-check.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build/gpu}"
jobs="${JOBS:-$(nproc)}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no usable NVIDIA GPU here (nvidia-smi is missing or lists none); run this on a GPU machine" >&2
  exit 2
fi
gpus="$(nvidia-smi -L | grep -c '^GPU ' || true)"
if [ "$gpus" -lt 1 ]; then
  echo "gpu-check: nvidia-smi lists no GPU; run this on a GPU machine" >&2
  exit 2
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "gpu-check: nvcc is not on PATH (the gpu tests include CUDA translation units); add CUDA's bin folder" >&2
  exit 2
fi
echo "gpu-check: $gpus GPU(s); building in $build"

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WITH_NCCL=ON -DWEFT_WITH_MPI=ON \
  -DWEFT_BUILD_EXAMPLES=OFF -DWEFT_BUILD_BENCHMARKS=OFF -DWEFT_GPU_TESTS_SHARE_GPU=ON
# Only the targets of gpu-labelled tests.
cmake --build "$build" -j "$jobs" --target test_nccl_backend test_grad_nccl test_tp_nccl_gpu test_cp_nccl_gpu \
  test_pipeline_nccl_gpu test_fsdp_nccl_gpu

# A hang is a failure with a name: ctest's per-test timeouts apply, and the whole run is bounded.
export WEFT_COMM_TIMEOUT="${WEFT_COMM_TIMEOUT:-120}"
timeout 290 ctest --test-dir "$build" -L gpu --output-on-failure --timeout 280
