#!/usr/bin/env bash
# On-policy distillation on CPU, from nothing: chain_sum data (2 terms, 1-2 digits); a teacher (4 layers, hidden
# 128) SFT'd long (1,500 steps) on 8,000 labelled problems and a student of the same shape SFT'd 650 steps on the
# same (held-out ~0.3: past the plateau, where the teacher's own curve turns up); then from
# the student, for equal steps at the same lr, each arm of ARMS (configs/distill_cpu.yaml):
#   grpo                          GRPO alone
#   sampled_mix / sampled_alone   + coef x clip(teacher - student) on the sampled token (algo.distill.estimator=sampled)
#   topk_mix / topk_alone         + the KL to the teacher's top-K tokens per position (estimator=topk, K=$TOPK)
# The RL prompts exclude the SFT and held-out problems (RL_UNSEEN=1, default; 0: drawn like the SFT set, so many
# are memorised). STAGE=prep makes the data and the two SFT'd models only, STAGE=rl reuses them and runs the arms
# (PARALLEL=1: all arms at once, under the same load; TAG: a suffix of the arms' run folders, for sweeps). Prints
# every arm's held-out accuracy per validation step with the training time so far (equal steps and equal wall
# time) and writes $OUT/summary$TAG.json.
# Usage: launch/distill_demo.sh [NPROC] (1). Legacy: DISTILL_MODE / DISTILL_ESTIMATOR pick the one distil arm.
set -euo pipefail
NPROC=${1:-1}
PYTHON=${PYTHON:-python}
OUT=${DEMO_DIR:-runs/distill}
RLHF=("$PYTHON" -m rlhf)
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/distill_cpu.yaml
TEACHER_SFT_STEPS=${TEACHER_SFT_STEPS:-1500}
STUDENT_SFT_STEPS=${STUDENT_SFT_STEPS:-650}
RL_LR=${RL_LR:-1e-4}
RL_STEPS=${RL_STEPS:-300}
RL_UNSEEN=${RL_UNSEEN:-1}
TOPK=${TOPK:-8}
STAGE=${STAGE:-all}
ARMS=${ARMS:-"grpo ${DISTILL_ESTIMATOR:-topk}_${DISTILL_MODE:-mix}"}
PARALLEL=${PARALLEL:-0}
TAG=${TAG:-}  # appended to each arm's run folder ($OUT/<arm>$TAG): several sweeps over one prep
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

COMMON=("run.output_dir=$OUT" "data.val_files=[$OUT/data/val.parquet]")
launch() { PYTHON=$PYTHON bash "$HERE/launch/torchrun.sh" "$NPROC" "$@"; }
if [[ $STAGE != rl ]]; then
  rm -rf "$OUT" && mkdir -p "$OUT/data"
  MAX_TERMS=2 NUM_SFT=8000 PYTHON="$PYTHON" bash "$HERE/launch/demo_data.sh" "$OUT/data" 4000 200
  if [[ $RL_UNSEEN == 1 ]]; then
    echo "== RL prompts: 4,000 distinct problems in neither the SFT nor the held-out set"
    "${RLHF[@]}" data make --task chain_sum --prompt-format expression --task-option min_terms=2 \
      --task-option max_terms=2 --task-option min_digits=1 --task-option max_digits=2 --num-prompts 4000 \
      --seed 30000000 --exclude "$OUT/data/sft.parquet" --exclude "$OUT/data/val.parquet" \
      --out "$OUT/data/rl_unseen.parquet"
  fi
  echo "== model: 4 layers hidden 128 (one char tokenizer); the teacher and the student start from it"
  "${RLHF[@]}" init-model --out "$OUT/init" --hidden 128 --layers 4 --heads 4 --kv-heads 4 --ffn 512 \
    --max-positions 64
  SFT_ARGS=("data.train_files=[$OUT/data/sft.parquet]" actor.optim.lr=3.0e-3 actor.optim.warmup_steps=20
            actor.micro_batch_size=64 algo.distill.enable=false)
  echo "== SFT the teacher ($TEACHER_SFT_STEPS steps) and the student ($STUDENT_SFT_STEPS steps)"
  launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_teacher "model.path=$OUT/init" \
    "sft.out_dir=$OUT/teacher" "sft.steps=$TEACHER_SFT_STEPS" "${SFT_ARGS[@]}"
  launch sft --config "$CONFIG" "${COMMON[@]}" run.name=sft_student "model.path=$OUT/init" \
    "sft.out_dir=$OUT/student" "sft.steps=$STUDENT_SFT_STEPS" sft.val_every=20 "${SFT_ARGS[@]}"
fi
[[ $STAGE == prep ]] && exit 0
RL_FILE=$OUT/data/rl.parquet
[[ $RL_UNSEEN == 1 ]] && RL_FILE=$OUT/data/rl_unseen.parquet
RL=("${COMMON[@]}" "model.path=$OUT/student" "data.train_files=[$RL_FILE]" "actor.optim.lr=$RL_LR"
    "trainer.total_steps=$RL_STEPS" actor.optim.warmup_steps=5 "algo.distill.teacher_path=$OUT/teacher")
arm_args() {
  case $1 in
    grpo) echo "algo.distill.enable=false" ;;
    sampled_mix|sampled_alone) echo "algo.distill.estimator=sampled algo.distill.mode=${1#sampled_}" ;;
    topk_mix|topk_alone) echo "algo.distill.estimator=topk algo.distill.topk=$TOPK algo.distill.mode=${1#topk_}" ;;
    *) echo "unknown arm $1 (grpo, sampled_mix, sampled_alone, topk_mix, topk_alone)" >&2; return 2 ;;
  esac
}
pids=()
for arm in $ARMS; do
  read -ra extra <<< "$(arm_args "$arm")"
  echo "== $arm from the student ($NPROC ranks): ${extra[*]}"
  if [[ $PARALLEL == 1 ]]; then
    launch train --config "$CONFIG" "${RL[@]}" "run.name=$arm$TAG" "${extra[@]}" > "$OUT/$arm$TAG.log" 2>&1 &
    pids+=($!)
  else
    launch train --config "$CONFIG" "${RL[@]}" "run.name=$arm$TAG" "${extra[@]}"
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
"$PYTHON" - "$OUT" "$TAG" $ARMS <<'PY'
import json, os, sys
from pathlib import Path
from rlhf.metrics import read_jsonl

out, arms = Path(sys.argv[1]), [arm + sys.argv[2] for arm in sys.argv[3:]]
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


curves = {name: curve(name) for name in arms}
kl = {name: [round(row[key], 3) for row in read_jsonl(out / name / "metrics.jsonl") for key in
             ("distill/reverse_kl", "distill/topk_kl") if key in row] for name in arms
      if not name.startswith("grpo")}
teacher, student = final_accuracy("sft_teacher"), final_accuracy("sft_student")
print(f"held-out accuracy: teacher (SFT) {teacher:.3f}, student (SFT) {student:.3f}")
print("step  " + "  ".join(f"{name} (acc, train s)" for name in arms))
for step in sorted(curves[arms[0]]):
    cells = [curves[name].get(step, (float("nan"), float("nan"))) for name in arms]
    print(f"{step:4d}  " + "  ".join(f"{a:.3f} {s:7.1f}" for a, s in cells))
summary = {"teacher": teacher, "student": student, "distill_kl": kl, "loadavg": os.getloadavg()} | curves
(out / f"summary{sys.argv[2]}.json").write_text(json.dumps(summary, indent=1))
PY
