#!/usr/bin/env bash
# configs/recipes/multi_node.yaml under Slurm, from the repository root:
#   multi_node.sh MODEL_DIR TRAIN_FILE [VAL_FILE] [NODES] [overrides...]
# Submits launch/slurm/multi_node.sbatch (8 GPUs per node; NCCL settings and MASTER_ADDR there). Paths must be
# visible from every node (a shared file system). Slurm's own output: ./slurm-rlhf-<job>.out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
USAGE="usage: $0 MODEL_DIR TRAIN_FILE [VAL_FILE] [NODES] [overrides...]"
MODEL=${1:?$USAGE}
TRAIN=${2:?$USAGE}
VAL=${3:-}
NODES=${4:-2}
shift $(($# < 4 ? $# : 4))
sbatch --nodes="$NODES" "$HERE/launch/slurm/multi_node.sbatch" train --config "$HERE/configs/recipes/multi_node.yaml" \
  "model.path=$MODEL" "data.train_files=$TRAIN" "data.val_files=[${VAL}]" "$@"
