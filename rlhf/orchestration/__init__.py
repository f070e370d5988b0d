"""The orchestration floor, above every stage: the RL loop and its one step, SFT, export, offline replay, the checks
and builds done before any role exists (preflight), the run's console lines, and the root config schema."""
