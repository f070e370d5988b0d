#!/usr/bin/env bash
# On-policy distillation on CPU, from nothing: chain_sum data (2 terms, 1-2 digits); a teacher (4 layers, hidden
# 128) SFT'd long on 8,000 labelled problems and a student of the same shape SFT'd briefly on the same; then from
# the student, GRPO alone and GRPO + distillation (configs/distill_cpu.yaml) for equal steps; prints both arms'
# held-out accuracy per validation step with the training time so far (equal steps and equal wall time) and writes
# runs/distill/summary.json. Usage: launch/distill_demo.sh [NPROC] (1).
set -euo pipefail
NPROC=${1:-1}
PYTHON=${PYTHON:-python}
OUT=${DEMO_DIR:-runs/distill}
RLHF=("$PYTHON" -m rlhf)
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/distill_cpu.yaml
TEACHER_SFT_STEPS=${TEACHER_SFT_STEPS:-1500}
STUDENT_SFT_STEPS=${STUDENT_SFT_STEPS:-400}
RL_LR=${RL_LR:-1e-4}
RL_STEPS=${RL_STEPS:-40}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT/data"

MAX_TERMS=2 NUM_SFT=8000 PYTHON="$PYTHON" bash "$HERE/launch/demo_data.sh" "$OUT/data" 4000 200
echo "== model: 4 layers hidden 128 (one char tokenizer); the teacher and the student start from it"
"${RLHF[@]}" init-model --out "$OUT/init" --hidden 128 --layers 4 --heads 4 --kv-heads 4 --ffn 512 \
  --max-positions 64

COMMON=("run.output_dir=$OUT" "data.val_files=[$OUT/data/val.parquet]")
SFT_ARGS=("data.train_files=[$OUT/data/sft.parquet]" actor.optim.lr=3.0e-3 actor.optim.warmup_steps=20
          actor.micro_batch_size=64 algo.distill.enable=false)
launch() { PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" "$@"; }
echo "== SFT the teacher ($TEACHER_SFT_STEPS steps) and the student ($STUDENT_SFT_STEPS steps)"
launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_teacher "model.path=$OUT/init" \
  "sft.out_dir=$OUT/teacher" "sft.steps=$TEACHER_SFT_STEPS" "${SFT_ARGS[@]}"
launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_student "model.path=$OUT/init" \
  "sft.out_dir=$OUT/student" "sft.steps=$STUDENT_SFT_STEPS" sft.val_every=20 "${SFT_ARGS[@]}"
RL=("${COMMON[@]}" "model.path=$OUT/student" "data.train_files=[$OUT/data/rl.parquet]" "actor.optim.lr=$RL_LR"
    "trainer.total_steps=$RL_STEPS")
echo "== GRPO alone from the student ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=grpo algo.distill.enable=false
echo "== GRPO + distillation from the teacher ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=distill "algo.distill.teacher_path=$OUT/teacher"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from rlhf.metrics import read_jsonl

out = Path(sys.argv[1])
def curve(name):
    """{step: (held-out accuracy, training seconds so far)}: the sum of timing_s/step up to that step."""
    points, seconds = {}, 0.0
    for row in read_jsonl(out / name / "metrics.jsonl"):
        seconds += row.get("timing_s/step", 0.0)
        if "val/score/mean@1" in row:
            points[row["step"]] = (row["val/score/mean@1"], round(seconds, 2))
    return points


curves = {name: curve(name) for name in ("grpo", "distill")}
teacher = [row["val/score/mean@1"] for row in read_jsonl(out / "sft_teacher" / "metrics.jsonl")
           if "val/score/mean@1" in row][-1]
print(f"teacher (SFT) held-out accuracy: {teacher:.3f}")
print("step  grpo (acc, train s)  grpo+distill (acc, train s)")
for step in sorted(curves["grpo"]):
    (a, s), (b, t) = curves["grpo"][step], curves["distill"].get(step, (float("nan"), float("nan")))
    print(f"{step:4d}  {a:.3f} {s:7.1f}        {b:.3f} {t:7.1f}")
(out / "summary.json").write_text(json.dumps({"teacher": teacher} | curves, indent=1))
PY
