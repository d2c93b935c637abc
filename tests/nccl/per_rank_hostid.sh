#!/bin/sh
# Runs a test rank with an NCCL_HOSTID of its own (host name + MPI rank), so several ranks can
# share one GPU: NCCL's duplicate-GPU check compares (host id, bus id), and distinct host ids make
# the ranks look like different hosts (they then talk over sockets, not shared memory).
rank="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}"
NCCL_HOSTID="$(hostname)-rank$rank"
export NCCL_HOSTID
exec "$@"
