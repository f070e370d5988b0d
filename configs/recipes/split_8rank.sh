#!/usr/bin/env bash
# configs/recipes/split_8rank.yaml on one node with 8 devices (PPO + critic + reward model, split placement):
#   split_8rank.sh MODEL_DIR RM_DIR TRAIN_FILE [VAL_FILE] [overrides...]
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
USAGE="usage: $0 MODEL_DIR RM_DIR TRAIN_FILE [VAL_FILE] [overrides...]"
MODEL=${1:?$USAGE}
RM=${2:?$USAGE}
TRAIN=${3:?$USAGE}
VAL=${4:-}
shift $(($# < 4 ? $# : 4))
bash "$HERE/launch/torchrun.sh" 8 train --config "$HERE/configs/recipes/split_8rank.yaml" \
  "model.path=$MODEL" "reward.model_path=$RM" "data.train_files=$TRAIN" "data.val_files=[${VAL}]" "$@"
