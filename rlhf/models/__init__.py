"""megatron-core GPT models built from HF configs, HF <-> megatron weight conversion, RL forward helpers."""
