#!/bin/sh
# The gradient-reduction comparison in one invocation: weft, raw MPI and (when Debian's
# /usr/bin/python3 has torch) PyTorch DDP, in alternating rounds within one run.
#
#   bench/grad_sync/run.sh BUILD_DIR [--ranks 2] [--iterations 12] [--rounds 3] [--json FILE] [--model gpt2|mlp]
#                          [bench options]
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
model=gpt2
set -- $args
while [ $# -gt 0 ]; do
  case "$1" in --iterations) iterations=$2; shift 2 ;; --model) model=$2; shift 2 ;; *) shift ;; esac
done

# PyTorch DDP runs first, on its own (not from inside an MPI rank), right before weft and raw MPI,
# and its result goes to the benchmark, which reports all of them side by side. When DDP does not
# run, the benchmark is told why (--ddp-failed), so its table and JSON say so.
ddp_timeout=$((120 + 10 * (iterations + 1)))  # ddp_reference.py's own deadline, which reports the rank
result=$(mktemp /tmp/weft_ddp_XXXXXX)
errors=$(mktemp /tmp/weft_ddp_err_XXXXXX)
trap 'rm -f "$result" "$errors"' EXIT
reason=""
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  # The outer timeout only backs up the script's own deadline.
  status=0
  env GLOO_SOCKET_IFNAME=lo timeout -k 10 $((ddp_timeout + 30)) /usr/bin/python3 "$here/ddp_reference.py" \
    --ranks "$ranks" --model "$model" --iterations "$iterations" --warmup 1 --timeout "$ddp_timeout" --json "$result" \
    2>"$errors" || status=$?
  cat "$errors" >&2
  if [ "$status" -ne 0 ]; then
    reason=$(grep '^ddp_reference.py: FAILED: ' "$errors" | tail -n 1 | sed 's/^ddp_reference.py: FAILED: //')
    case "$status" in
      124|137) reason="ddp_reference.py killed by run.sh after $((ddp_timeout + 30)) s${reason:+: $reason}" ;;
      *) [ -n "$reason" ] || reason="ddp_reference.py exited with status $status" ;;
    esac
  fi
else
  reason="/usr/bin/python3 has no torch"
fi

# shellcheck disable=SC2086
if [ -z "$reason" ]; then
  set -- --ddp-result "$result" $args
else
  echo "run.sh: DDP is left out of this run: $reason" >&2
  set -- --ddp-failed "$reason" $args
fi

export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo GLOO_SOCKET_IFNAME=lo
# Not exec: the trap removes DDP's files once the benchmark has read them.
mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$ranks" "$bench" "$@"
