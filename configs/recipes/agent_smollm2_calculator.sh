#!/usr/bin/env bash
# configs/recipes/agent_smollm2_calculator.yaml on one node: agent_smollm2_calculator.sh OUT_DIR [NPROC] [overrides...]
# Makes the multiplication data with a system turn describing the tool call, then multi-turn GRPO from
# SmolLM2-135M-Instruct (`make smollm2` converts it). NPROC defaults to the visible GPUs (or 4 CPU ranks).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:?usage: $0 OUT_DIR [NPROC] [overrides...]}
NPROC=${2:-}
shift $(($# < 2 ? $# : 2))
PYTHON=${PYTHON:-python}
SYSTEM='You can call a calculator. To use it, reply with exactly <tool_call>{"name":"calculator","arguments":{"expression":"EXPRESSION"}}</tool_call> and nothing else; its result comes back as a tool message. Then reply with the number alone.'
"$PYTHON" "$HERE/launch/agent_demo_data.py" "$OUT/data" --sft 0 --copy-records 0 --system "$SYSTEM"
MODEL=$("$PYTHON" -c 'from rlhf.models.smollm2 import smollm2_hf_folder; print(smollm2_hf_folder())')
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" $NPROC train --config "$HERE/configs/recipes/agent_smollm2_calculator.yaml" \
  "run.output_dir=$OUT" "model.path=$MODEL" "data.train_files=[$OUT/data/rl.jsonl]" \
  "data.val_files=[$OUT/data/val.jsonl]" "multiturn.tool_config=$HERE/configs/tools/calculator.yaml" "$@"
