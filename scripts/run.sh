#!/usr/bin/env bash
# The main job on a local default: builds weft, measures this machine's ranks (weft-plan --probe),
# trains GPT-2 with train_gpt on 4 local ranks in the layout weft's tuner picks for them (about a
# minute; every step prints its loss), and ends with weft-doctor's quick check of the same ranks
# (docs/doctor.md: GPUs, network, limits, Slurm, storage, collectives, GEMMs). The ranks are
# launched with srun under a private single-node Slurm where one starts here
# (scripts/private_slurm.py), with mpirun otherwise.
# The checkpoint (and the hardware description the tuner used) are kept in $BUILD_DIR/run-output/.
# Usage: scripts/run.sh [train_gpt flags...]    Environment: RANKS (default 4), STEPS (120), BUILD_DIR
# (default build/run; an existing build tree is built as it is configured).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build/run}"
ranks="${RANKS:-4}"
steps="${STEPS:-120}"
"$root/scripts/install-deps.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo NCCL_SOCKET_IFNAME=lo
# One BLAS thread per rank; with more ranks than cores, waiting ranks yield the core.
export OPENBLAS_NUM_THREADS=1
if [ "$ranks" -gt "$(nproc)" ]; then export OMPI_MCA_mpi_yield_when_idle=1; fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_BUILD_TESTS=OFF >/dev/null
fi
cmake --build "$build" --parallel "$(nproc)" --target train_gpt weft-plan weft-doctor
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
output="$build/run-output"
mkdir -p "$output"
model=(--layers 4 --hidden 128 --heads 4 --seq 128 --vocab 256)

# The job itself, given the launcher's command for $ranks ranks.
cat > "$work/job.sh" <<JOB
set -euo pipefail
launch=(\$LAUNCH)
echo "== launching with: \$LAUNCH"
echo "== measuring these $ranks ranks (weft-plan --probe): GEMMs at the model's shapes, collectives, p2p"
"\${launch[@]}" "$build/examples/weft_plan/weft-plan" --probe "$output/hardware.json" ${model[*]} --tied-embeddings --global-batch 16 >/dev/null
echo "== train_gpt on $ranks ranks in the tuner's layout, $steps steps"
"\${launch[@]}" "$build/examples/train_gpt/train_gpt" ${model[*]} --positions 128 --plan --hardware "$output/hardware.json" \
  --global-batch 16 --steps $steps --lr 2e-3 --warmup 5 --save "$output/gpt.safetensors" $*
echo "== checkpoint: $output/gpt.safetensors (the model) and $output/gpt.safetensors.optimizer; resume with --resume"
echo "== weft-doctor --quick on the same $ranks ranks"
# The storage is judged against this job's needs: its checkpoint (model and optimizer state) within
# the default 30 s, and its byte-level text (1 byte a token) at 10000 tokens/s a rank, above what
# a CPU rank trains on; 64 MB written and read back per directory keeps the check short.
checkpoint_size=\$(( \$(stat -c %s "$output/gpt.safetensors") + \$(stat -c %s "$output/gpt.safetensors.optimizer") ))
"\${launch[@]}" "$build/examples/weft_doctor/weft-doctor" --quick --storage-bytes 64M --data-dir "$output" \
  --checkpoint-dir "$output" --tokens-per-s 10000 --bytes-per-token 1 --checkpoint-size "\$checkpoint_size" \
  --json "$output/doctor.json"
echo "== weft-doctor's report: $output/doctor.json"
JOB
status=0
LAUNCH="srun --mpi=pmix -N 1 -n $ranks" /usr/bin/python3 "$root/scripts/private_slurm.py" --cpus "$ranks" -- \
  bash "$work/job.sh" || status=$?
if [ "$status" = 77 ]; then
  echo "(no private Slurm on this machine: launching with mpirun instead)"
  LAUNCH="mpirun -n $ranks --oversubscribe --bind-to none" bash "$work/job.sh"
else
  exit "$status"
fi
