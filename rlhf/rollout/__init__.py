"""Rollout engines (native on megatron-core, hf reference, colocated vLLM) and their typed payloads."""
