#!/usr/bin/env bash
# The demos' chain_sum data (reasoning-gym, 2-3 terms, 1-2 digits): RL prompts, 2,000 labelled SFT problems and
# held-out problems that appear in neither. Usage: launch/demo_data.sh OUT_DIR NUM_RL_PROMPTS NUM_VAL_PROMPTS
# (PYTHON names the interpreter with rlhf installed).
set -euo pipefail
OUT=$1
NUM_RL=$2
NUM_VAL=$3
RLHF=("${PYTHON:-python}" -m rlhf)
TASK=(--task chain_sum --prompt-format expression --task-option min_terms=2 --task-option max_terms=3
      --task-option min_digits=1 --task-option max_digits=2)
echo "== data: reasoning-gym chain_sum (2-3 terms, 1-2 digits)"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts "$NUM_RL" --seed 1 --out "$OUT/rl.parquet"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts 2000 --seed 20000000 --out "$OUT/sft.parquet"
"${RLHF[@]}" data make "${TASK[@]}" --num-prompts "$NUM_VAL" --seed 10000000 --exclude "$OUT/rl.parquet" \
  --exclude "$OUT/sft.parquet" --out "$OUT/val.parquet"
