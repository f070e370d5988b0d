#!/usr/bin/env bash
# Launch inside a Slurm allocation without torchrun: every task runs `python -m rlhf ...`, and rlhf reads
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the node list itself (rlhf/parallel/runtime.py).
#   salloc -N 2 --ntasks-per-node=8 --gpus-per-node=8 launch/srun.sh train --config configs/my.yaml
# A failure ends with one line naming the error (printed once, last) and an exit code by class: 1 unexpected,
# 2 bad input, 3 checkpoint, 4 training stopped, 5 ranks (rlhf/cli/failure.py). The tasks record their lines
# in a folder under RLHF_ERROR_PARENT (default: the working directory, which every node must see).
set -euo pipefail
PYTHON=${PYTHON:-python}
TASKS_PER_NODE=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
RLHF_ERROR_DIR=$(mktemp -d "${RLHF_ERROR_PARENT:-$PWD}/.rlhf-errors.XXXXXX")
export RLHF_ERROR_DIR
trap 'rm -rf "$RLHF_ERROR_DIR"' EXIT
status=0
srun --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1 "$PYTHON" -m rlhf "$@" || status=$?
"$PYTHON" -m rlhf.cli.failure "$RLHF_ERROR_DIR" "$status"
