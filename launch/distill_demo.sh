#!/usr/bin/env bash
# On-policy distillation on CPU, from nothing: chain_sum data (2 terms, 1-2 digits); a teacher (4 layers, hidden
# 128) SFT'd long on 8,000 labelled problems and a student of the same shape SFT'd briefly on the same; then from
# the student, GRPO alone and distillation (configs/distill_cpu.yaml; DISTILL_MODE=alone: the reverse KL is the
# whole advantage, mix: added to GRPO's) for equal steps at the same lr; prints both arms' held-out accuracy per
# validation step with the training time so far (equal steps and equal wall time) and writes
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
RL_STEPS=${RL_STEPS:-150}
DISTILL_MODE=${DISTILL_MODE:-mix}
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
    "trainer.total_steps=$RL_STEPS" actor.optim.warmup_steps=5)
echo "== GRPO alone from the student ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=grpo algo.distill.enable=false
echo "== distillation ($DISTILL_MODE) from the teacher ($NPROC ranks)"
launch train --config "$CONFIG" "${RL[@]}" run.name=distill "algo.distill.teacher_path=$OUT/teacher" \
  "algo.distill.mode=$DISTILL_MODE"
"$PYTHON" - "$OUT" <<'PY'
import json, os, sys
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


def final_accuracy(name):
    return [row["val/score/mean@1"] for row in read_jsonl(out / name / "metrics.jsonl")
            if "val/score/mean@1" in row][-1]


curves = {name: curve(name) for name in ("grpo", "distill")}
reverse_kl = [round(row["distill/reverse_kl"], 3) for row in read_jsonl(out / "distill" / "metrics.jsonl")
              if "distill/reverse_kl" in row]
teacher, student = final_accuracy("sft_teacher"), final_accuracy("sft_student")
print(f"held-out accuracy: teacher (SFT) {teacher:.3f}, student (SFT) {student:.3f}")
print("step  grpo (acc, train s)  distillation (acc, train s)")
for step in sorted(curves["grpo"]):
    (a, s), (b, t) = curves["grpo"][step], curves["distill"].get(step, (float("nan"), float("nan")))
    print(f"{step:4d}  {a:.3f} {s:7.1f}        {b:.3f} {t:7.1f}")
summary = {"teacher": teacher, "student": student, "distill/reverse_kl": reverse_kl,
           "loadavg": os.getloadavg()} | curves
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
