"""RL core: advantage estimators, policy/value losses, KL, loss aggregation, running stats (pure tensor code).

Shapes: response-aligned [B, T] tensors with `response_mask_bt` (1 on response tokens), sequence scores [B].
Losses take `GlobalCounts` of the whole step batch so micro-batch/DP shards sum to the full-batch loss.
The config sections and their enums are in `rlhf.algo.config` and `rlhf.algo.correction_config`, which load
without torch.
"""
