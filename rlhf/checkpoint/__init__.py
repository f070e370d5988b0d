"""Checkpoints (format rlhf-checkpoint/3, DESIGN.md §10): the manager that saves, publishes, verifies and resumes
(`manager`), the published step folders and their manifests (`folders`), the integrity checks (`verify`:
checksums, tensor values, manifest schema, replicas), the durable writer (`write`) and the pickle-free state tree
file (`state_file`). Their API is importable from here."""

from rlhf.checkpoint.folders import (FORMAT, LATEST, MANIFEST, STEP_DIR, CorruptCheckpointError, check_root,
                                     find_latest, is_complete, rank_file, read_manifest, step_folders)
from rlhf.checkpoint.manager import CheckpointManager, Replicated, tensor_folders

__all__ = ["FORMAT", "LATEST", "MANIFEST", "STEP_DIR", "CheckpointManager", "CorruptCheckpointError", "Replicated",
           "check_root", "find_latest", "is_complete", "rank_file", "read_manifest", "step_folders", "tensor_folders"]
