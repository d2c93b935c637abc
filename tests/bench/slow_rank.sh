#!/bin/sh
# slow_rank.sh RANK LIBRARY PROGRAM ARGS...: runs PROGRAM, with LIBRARY preloaded on world rank RANK
# only (Open MPI's OMPI_COMM_WORLD_RANK), so one rank of a job is slow and the others are not.
rank=$1 library=$2
shift 2
if [ "${OMPI_COMM_WORLD_RANK:-}" = "$rank" ]; then
  LD_PRELOAD=$library
  export LD_PRELOAD
fi
exec "$@"
