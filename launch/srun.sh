#!/usr/bin/env bash
# Launch inside a Slurm allocation without torchrun: every task runs `python -m rlhf ...`, and rlhf reads
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the node list itself (rlhf/parallel/runtime.py).
#   salloc -N 2 --ntasks-per-node=8 --gpus-per-node=8 launch/srun.sh train --config configs/my.yaml
set -euo pipefail
PYTHON=${PYTHON:-python}
TASKS_PER_NODE=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec srun --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1 "$PYTHON" -m rlhf "$@"
