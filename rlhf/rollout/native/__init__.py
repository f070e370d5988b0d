"""rlhf's own rollout engine on the megatron-core model: batched prefill, KV-cached decode, slot refill."""

from rlhf.rollout.native.engine import NativeEngine, NativeEngineConfig

__all__ = ["NativeEngine", "NativeEngineConfig"]
