#!/usr/bin/env bash
# Every GPU check, in one process, ~5 minutes on one H200: model parity (fp32/bf16, tiny Llama/Qwen2/Qwen3/Qwen3-MoE and a
# ~0.5B Qwen2 config), native engine vs transformers.generate tokens/s on the 0.5B config, a bf16 train step's MFU, and
# packed (THD, TE cu_seqlens) = padded micro-batches. Writes gpu_check.json and gpu_check.log under $OUT (default benchmarks/results).
# megatron-core (and transformers, if the machine's is older) can come as wheels in .whl/ (see the report).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import megatron.core, torch, transformers; from rlhf import platform; print('torch', torch.__version__,
  'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, platform.device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
timeout "${GPU_CHECK_TIMEOUT_S:-420}" "$PY" benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
