"""The one door for device-specific code: device choice, distributed backend, memory stats, sync; `compat/` is
the one door to private names of torch, megatron-core and vLLM.

Nothing else in rlhf mentions CUDA or NCCL by name; `tests/test_device_door.py` enforces it. The functions live
in `rlhf.platform.device` and are imported on first use (PEP 562), so config checks name backends without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS = ("auto", "gloo", "nccl")


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module("rlhf.platform.device"), name)
