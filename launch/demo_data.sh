#!/usr/bin/env bash
# The demos' chain_sum data (reasoning-gym, 2-3 terms, 1-2 digits): RL prompts, 2,000 labelled SFT problems and
# held-out problems that appear in neither. Usage: launch/demo_data.sh OUT_DIR NUM_RL_PROMPTS NUM_VAL_PROMPTS
# (PYTHON names the interpreter with rlhf installed; MAX_TERMS and NUM_SFT override 3 terms and 2,000 problems).
set -euo pipefail
OUT=$1
NUM_RL=$2
NUM_VAL=$3
RLHF=("${PYTHON:-python}" -m rlhf)
MAX_TERMS=${MAX_TERMS:-3}
NUM_SFT=${NUM_SFT:-2000}
TASK=(--task chain_sum --prompt-format expression --task-option min_terms=2 --task-option "max_terms=$MAX_TERMS"
      --task-option min_digits=1 --task-option max_digits=2)
echo "== data: reasoning-gym chain_sum (2-$MAX_TERMS terms, 1-2 digits)"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts "$NUM_RL" --seed 1 --out "$OUT/rl.parquet"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts "$NUM_SFT" --seed 20000000 --out "$OUT/sft.parquet"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts "$NUM_VAL" --seed 10000000 --exclude "$OUT/rl.parquet" \
  --exclude "$OUT/sft.parquet" --out "$OUT/val.parquet"
