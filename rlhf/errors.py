"""Exceptions for user-facing errors. `assert` is reserved for internal invariants."""


class RlhfError(Exception):
    """Base class of every error rlhf raises on purpose."""


class ConfigError(RlhfError, ValueError):
    """Bad user input (config value, layout, CLI argument): the message names the value and the fix."""


class CollectiveMismatchError(RlhfError, RuntimeError):
    """Ranks disagreed on the collective they were about to run (names, shapes, dtypes or count)."""


class DataError(RlhfError, ValueError):
    """A malformed dataset record, named by file and line."""


class RewardError(RlhfError, RuntimeError):
    """A reward function raised or returned NaN/inf for a sample, named by its index."""


class CheckpointError(RlhfError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model it is loaded into."""


class NonFiniteError(RlhfError, RuntimeError):
    """A train step produced a NaN/inf loss or gradient under a `nan_policy` of "abort"; names the step."""
class WeightSyncError(RlhfError, RuntimeError):
    """The rollout engine's weights differ from the trainer's after a sync, or a push was refused: names the tensor."""


class ProcessGroupError(RlhfError, RuntimeError):
    """The ranks could not form the world (a rank missing, rank 0 unreachable): names the address and the count."""
