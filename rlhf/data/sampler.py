"""A seeded, epoch-aware, resumable prompt sampler sharded over data-parallel ranks.

Each epoch is one permutation of the dataset (seeded by `(seed, epoch)`), cut into global batches of
`global_batch_size` prompts; the tail that does not fill a batch is dropped. DP rank r takes the r-th
contiguous slice of each global batch, so the global order never depends on the DP size and a run can
resume on a different DP size from the same `state_dict()`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlhf.errors import CheckpointError, ConfigError

_IDENTITY_KEYS = ("num_samples", "global_batch_size", "seed", "shuffle")


class PromptSampler:
    """Yields this DP rank's dataset indices for each step; `state_dict()` records the position. `batch_key`
    names the config key the batch size came from in error messages."""

    def __init__(self, *, num_samples: int, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, batch_key: str = "data.prompts_per_step") -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ConfigError(f"{batch_key}={global_batch_size} must be a positive multiple of "
                              f"the data-parallel size {dp_size}")
        if seed < 0:
            raise ConfigError(f"data.seed={seed} must be >= 0")
        if num_samples < global_batch_size:
            raise ConfigError(f"the dataset has {num_samples} prompts, fewer than {batch_key}="
                              f"{global_batch_size}; use a larger dataset or a smaller batch")
        self.num_samples, self.global_batch_size, self.seed, self.shuffle = \
            num_samples, global_batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batches_per_epoch = num_samples // global_batch_size
        self.epoch, self.step_in_epoch = 0, 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def global_batch(self, epoch: int, step_in_epoch: int) -> list[int]:
        """Dataset indices of one whole global batch (every DP rank's slices, in rank order)."""
        assert 0 <= step_in_epoch < self.batches_per_epoch, step_in_epoch
        start = step_in_epoch * self.global_batch_size
        return self._epoch_order(epoch)[start:start + self.global_batch_size].tolist()

    def next_indices(self) -> list[int]:
        """This rank's indices for the next step, then advance (rolling into the next epoch when due)."""
        batch = self.global_batch(self.epoch, self.step_in_epoch)
        per_rank = self.global_batch_size // self.dp_size
        self.step_in_epoch += 1
        if self.step_in_epoch == self.batches_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return batch[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    @property
    def consumed_batches(self) -> int:
        """Global batches handed out since the start of training."""
        return self.epoch * self.batches_per_epoch + self.step_in_epoch

    def state_dict(self) -> dict[str, Any]:
        """Position plus what defines the order; independent of the DP size."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; a different dataset size, batch, seed or shuffle is a `CheckpointError`."""
        differing = [f"{key}: checkpoint {state.get(key)!r} vs now {getattr(self, key)!r}"
                     for key in _IDENTITY_KEYS if state.get(key) != getattr(self, key)]
        if differing:
            raise CheckpointError("the data sampler state does not match this run (" + "; ".join(differing) + ")")
        if not 0 <= state["step_in_epoch"] < self.batches_per_epoch or state["epoch"] < 0:
            raise CheckpointError(f"the data sampler state is out of range: epoch {state['epoch']}, "
                                  f"step {state['step_in_epoch']} of {self.batches_per_epoch}")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
