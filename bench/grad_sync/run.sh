#!/bin/sh
# The gradient-reduction comparison in one invocation: weft, raw MPI and (when Debian's
# /usr/bin/python3 has torch) PyTorch DDP, in alternating rounds within one run.
#
#   bench/grad_sync/run.sh BUILD_DIR [--ranks 2] [--iterations 12] [--rounds 3] [--json FILE] [bench options]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run.sh BUILD_DIR [--ranks N] [bench options]}
shift
ranks=2
args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    *) args="$args $1"; shift ;;
  esac
done
bench="$build/bench/grad_sync/weft_bench_grad_sync"
[ -x "$bench" ] || { echo "run.sh: $bench is not built (cmake --build $build --target weft_bench_grad_sync)" >&2; exit 2; }

iterations=12
set -- $args
while [ $# -gt 0 ]; do
  case "$1" in --iterations) iterations=$2; shift 2 ;; *) shift ;; esac
done

# PyTorch DDP runs first, on its own (not from inside an MPI rank), right before weft and raw MPI,
# and its result goes to the benchmark, which reports all of them side by side.
ddp=""
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  result=$(mktemp /tmp/weft_ddp_XXXXXX)
  if env GLOO_SOCKET_IFNAME=lo timeout -k 10 300 /usr/bin/python3 "$here/ddp_reference.py" --ranks "$ranks" \
       --iterations "$iterations" --warmup 1 --json "$result"; then
    ddp="--ddp-result $result"
  else
    echo "run.sh: the DDP reference failed; DDP is left out" >&2
  fi
else
  echo "run.sh: /usr/bin/python3 has no torch; DDP is left out" >&2
fi

export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo GLOO_SOCKET_IFNAME=lo
# shellcheck disable=SC2086
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$ranks" "$bench" $ddp $args
