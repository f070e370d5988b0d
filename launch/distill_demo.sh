#!/usr/bin/env bash
# On-policy distillation on CPU, from nothing: chain_sum data; a teacher (4 layers, hidden 128) SFT'd on 2,000
# labelled problems and a smaller student (2 layers, hidden 64) SFT'd briefly on the same; then from the student,
# GRPO alone and GRPO + distillation (configs/distill_cpu.yaml) for equal steps; prints the held-out accuracy of
# both arms per validation step and writes runs/distill/summary.json. Usage: launch/distill_demo.sh [NPROC] (1).
set -euo pipefail
NPROC=${1:-1}
PYTHON=${PYTHON:-python}
OUT=${DEMO_DIR:-runs/distill}
RLHF=("$PYTHON" -m rlhf)
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/distill_cpu.yaml
TEACHER_SFT_STEPS=${TEACHER_SFT_STEPS:-800}
STUDENT_SFT_STEPS=${STUDENT_SFT_STEPS:-100}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT/data"

PYTHON="$PYTHON" bash "$HERE/launch/demo_data.sh" "$OUT/data" 4000 200
echo "== models: teacher 4 layers hidden 128, student 2 layers hidden 64 (one char tokenizer)"
"${RLHF[@]}" init-model --out "$OUT/teacher0" --hidden 128 --layers 4 --heads 4 --kv-heads 4 --ffn 512 \
  --max-positions 64
"${RLHF[@]}" init-model --out "$OUT/student0" --hidden 64 --layers 2 --heads 4 --kv-heads 4 --ffn 256 \
  --max-positions 64

COMMON=("run.output_dir=$OUT" "data.val_files=[$OUT/data/val.parquet]")
SFT_ARGS=("data.train_files=[$OUT/data/sft.parquet]" actor.optim.lr=3.0e-3 actor.optim.warmup_steps=20
          actor.micro_batch_size=64 algo.distill.enable=false)
launch() { PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" "$@"; }
echo "== SFT the teacher ($TEACHER_SFT_STEPS steps) and the student ($STUDENT_SFT_STEPS steps)"
launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_teacher "model.path=$OUT/teacher0" \
  "sft.out_dir=$OUT/teacher" "sft.steps=$TEACHER_SFT_STEPS" "${SFT_ARGS[@]}"
launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_student "model.path=$OUT/student0" \
  "sft.out_dir=$OUT/student" "sft.steps=$STUDENT_SFT_STEPS" sft.val_every=20 "${SFT_ARGS[@]}"
RL=("${COMMON[@]}" "model.path=$OUT/student" "data.train_files=[$OUT/data/rl.parquet]")
echo "== GRPO alone from the student ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=grpo algo.distill.enable=false
echo "== GRPO + distillation from the teacher ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=distill "algo.distill.teacher_path=$OUT/teacher"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from rlhf.metrics import read_jsonl

out = Path(sys.argv[1])
curves = {name: {row["step"]: row["val/score/mean@1"] for row in read_jsonl(out / name / "metrics.jsonl")
                 if "val/score/mean@1" in row} for name in ("grpo", "distill")}
teacher = [row["val/score/mean@1"] for row in read_jsonl(out / "sft_teacher" / "metrics.jsonl")
           if "val/score/mean@1" in row][-1]
print(f"teacher (SFT) held-out accuracy: {teacher:.3f}")
print("step  grpo   grpo+distill")
for step in sorted(curves["grpo"]):
    print(f"{step:4d}  {curves['grpo'][step]:.3f}  {curves['distill'].get(step, float('nan')):.3f}")
(out / "summary.json").write_text(json.dumps({"teacher": teacher} | curves, indent=1))
PY
