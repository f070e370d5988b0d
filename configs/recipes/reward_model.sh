#!/usr/bin/env bash
# configs/recipes/reward_model.yaml on one node:
#   reward_model.sh MODEL_DIR RM_DIR TRAIN_FILE [VAL_FILE] [NPROC] [overrides...]
# RM_DIR is an HF sequence-classification folder (one label); extra key=value overrides go to rlhf train.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
USAGE="usage: $0 MODEL_DIR RM_DIR TRAIN_FILE [VAL_FILE] [NPROC] [overrides...]"
MODEL=${1:?$USAGE}
RM=${2:?$USAGE}
TRAIN=${3:?$USAGE}
VAL=${4:-}
NPROC=${5:-}
shift $(($# < 5 ? $# : 5))
bash "$HERE/launch/torchrun.sh" $NPROC train --config "$HERE/configs/recipes/reward_model.yaml" \
  "model.path=$MODEL" "reward.model_path=$RM" "data.train_files=$TRAIN" "data.val_files=[${VAL}]" "$@"
