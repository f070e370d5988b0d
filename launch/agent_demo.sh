#!/usr/bin/env bash
# The tool-use demo (`make demo-agent`), from nothing: multiplication data, a 2-layer char-level chat model, SFT
# on records that call a calculator for 30% of first turns and copy its result into the answer, then multi-turn
# GRPO (the built-in tool loop, exact-match reward on the final turn) on unlabelled prompts. Prints the curve:
# held-out greedy accuracy (val), training reward, tool calls per trajectory; writes runs/demo_agent/curve.json.
# Usage: launch/agent_demo.sh [NPROC] (default 2 gloo ranks); SFT_STEPS / RL_STEPS override the lengths.
set -euo pipefail
NPROC=${1:-2}
PYTHON=${PYTHON:-python}
OUT=${DEMO_DIR:-runs/demo_agent}
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/agent_cpu.yaml
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== data: 3-digit x 2-digit multiplications (SFT records, RL prompts, held-out prompts)"
"$PYTHON" "$HERE/launch/agent_demo_data.py" "$OUT/data"
echo "== model: 2-layer char-level chat Llama, hidden 64"
"$PYTHON" -m rlhf init-model --out "$OUT/model0" --chat --hidden 64 --layers 2 --heads 4 --kv-heads 4 --ffn 256 \
  --max-positions 192
echo "== SFT: call the calculator sometimes, copy its result ($NPROC ranks)"
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" sft --config "$CONFIG" "run.output_dir=$OUT" run.name=sft \
  "model.path=$OUT/model0" "data.train_files=[$OUT/data/sft.jsonl]" "sft.out_dir=$OUT/sft_model" \
  "sft.steps=${SFT_STEPS:-2000}" sft.batch_size=64 actor.micro_batch_size=32 multiturn.enable=false \
  actor.optim.lr=3.0e-3 actor.optim.warmup_steps=20
echo "== multi-turn GRPO with the calculator from the SFT policy ($NPROC ranks)"
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" train --config "$CONFIG" "run.output_dir=$OUT" \
  run.name=grpo "model.path=$OUT/sft_model" "data.train_files=[$OUT/data/rl.jsonl]" \
  "data.val_files=[$OUT/data/val.jsonl]" "multiturn.tool_config=$HERE/configs/tools/calculator.yaml" \
  "trainer.total_steps=${RL_STEPS:-60}"
"$PYTHON" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "grpo/metrics.jsonl").read_text().splitlines()]
keys = {"val": "val/score/mean@1", "reward": "critic/score/mean", "tool_calls": "multiturn/tool_calls_mean",
        "tool_errors": "multiturn/tool_errors_mean", "turns": "multiturn/turns_mean"}
curve = [{"step": row["step"], **{name: row[key] for name, key in keys.items() if key in row}} for row in rows]
(out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
print("step   val  reward  tool_calls  tool_errors")
for row in curve:
    cells = [f"{row.get(name, float('nan')):.3f}" for name in ("val", "reward", "tool_calls", "tool_errors")]
    print(f"{row['step']:4d}  " + "  ".join(cells))
PY
