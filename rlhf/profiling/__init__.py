"""Step profiling for `rlhf profile` / `rlhf bench`: phase memory, collective counters, a step runner."""
