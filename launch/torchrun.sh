#!/usr/bin/env bash
# Single-node launch: `launch/torchrun.sh [NPROC] <rlhf command> [args...]`, e.g.
#   launch/torchrun.sh 4 doctor
#   launch/torchrun.sh train --config configs/tiny_cpu.yaml
# NPROC defaults to the number of visible GPUs, or 4 local CPU ranks (gloo) when there are none.
# A failure ends with one line naming the error (printed once, last) and an exit code by class: 1 unexpected,
# 2 bad input, 3 checkpoint, 4 training stopped, 5 ranks (rlhf/cli/failure.py; docs/troubleshooting.md).
set -euo pipefail
PYTHON=${PYTHON:-python}

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  NPROC=$1
  shift
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra devices <<< "$CUDA_VISIBLE_DEVICES"
  NPROC=${#devices[@]}
elif command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then
  NPROC=$(nvidia-smi -L | wc -l)
else
  NPROC=4
fi
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [NPROC] <rlhf command> [args...]" >&2
  exit 2
fi

# Single-node rendezvous on a free local port, so two runs on one machine do not collide.
PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m rlhf.cli.torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" \
  --master_port="$PORT" -m rlhf "$@"
