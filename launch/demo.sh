#!/usr/bin/env bash
# The CPU demo, from nothing: make reasoning-gym data, initialise a tiny model, SFT it briefly on 2,000
# labelled problems, then GRPO on unlabelled prompts, and beside it the equal-compute arm: SFT continued from
# the same SFT policy for as many optimizer steps as GRPO took; prints held-out accuracy of both and writes
# runs/demo/curve.png and summary.json. Usage: launch/demo.sh [NPROC] (default 2 gloo ranks);
# RL_CONFIG=configs/dapo_cpu.yaml runs the RL stage with DAPO instead of GRPO.
set -euo pipefail
NPROC=${1:-2}
PYTHON=${PYTHON:-python}
OUT=${DEMO_DIR:-runs/demo}
RLHF=("$PYTHON" -m rlhf)
HERE=$(cd "$(dirname "$0")/.." && pwd)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT/data"

PYTHON="$PYTHON" bash "$HERE/launch/demo_data.sh" "$OUT/data" 10000 500
echo "== model: 4-layer char-level Llama, hidden 128"
"${RLHF[@]}" init-model --out "$OUT/model0" --hidden 128 --layers 4 --heads 4 --kv-heads 4 --ffn 512 \
  --max-positions 64

COMMON=("run.output_dir=$OUT" "data.val_files=[$OUT/data/val.parquet]")
SFT_ARGS=("data.train_files=[$OUT/data/sft.parquet]" actor.optim.lr=3.0e-3 actor.optim.warmup_steps=20
          actor.micro_batch_size=64)
echo "== SFT on 2,000 labelled problems ($NPROC ranks)"
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" sft --config "$HERE/configs/demo_cpu.yaml" "${COMMON[@]}" run.name=sft \
  "model.path=$OUT/model0" "sft.out_dir=$OUT/sft_model" "${SFT_ARGS[@]}"
RL=${RL_CONFIG:-$HERE/configs/demo_cpu.yaml}
echo "== GRPO from the SFT policy, reward = exact answer ($NPROC ranks)"
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" train --config "$RL" "${COMMON[@]}" run.name=grpo \
  "model.path=$OUT/sft_model" "data.train_files=[$OUT/data/rl.parquet]"
# the equal-compute arm: as many optimizer steps as GRPO took (total_steps x epochs x mini_batches), from the same
# SFT policy (a fresh optimizer, so the same warmup), validated as often
RL_STEPS=$("${RLHF[@]}" config --config "$RL" | "$PYTHON" -c 'import sys, yaml; c = yaml.safe_load(sys.stdin)
print(c["trainer"]["total_steps"] * c["actor"]["epochs"] * c["actor"]["mini_batches"], c["trainer"]["val_every"])')
read -r SFT_MORE_STEPS VAL_EVERY <<< "$RL_STEPS"
echo "== SFT continued from the SFT policy for the same $SFT_MORE_STEPS optimizer steps ($NPROC ranks)"
PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" sft --config "$HERE/configs/demo_cpu.yaml" "${COMMON[@]}" \
  run.name=sft_more "model.path=$OUT/sft_model" "sft.steps=$SFT_MORE_STEPS" "sft.val_every=$VAL_EVERY" "${SFT_ARGS[@]}"
"$PYTHON" -m rlhf.orchestration.plot --sft "$OUT/sft" --rl "$OUT/grpo" --sft-more "$OUT/sft_more" --out "$OUT"
