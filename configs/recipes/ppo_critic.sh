#!/usr/bin/env bash
# configs/recipes/ppo_critic.yaml on one node: ppo_critic.sh MODEL_DIR TRAIN_FILE [VAL_FILE] [NPROC] [overrides...]
# NPROC defaults to the visible GPUs (or 4 CPU ranks); extra key=value overrides are passed on to rlhf train.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${1:?usage: $0 MODEL_DIR TRAIN_FILE [VAL_FILE] [NPROC] [overrides...]}
TRAIN=${2:?usage: $0 MODEL_DIR TRAIN_FILE [VAL_FILE] [NPROC] [overrides...]}
VAL=${3:-}
NPROC=${4:-}
shift $(($# < 4 ? $# : 4))
bash "$HERE/launch/torchrun.sh" $NPROC train --config "$HERE/configs/recipes/ppo_critic.yaml" \
  "model.path=$MODEL" "data.train_files=$TRAIN" "data.val_files=[${VAL}]" "$@"
