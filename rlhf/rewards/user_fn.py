"""Load a user reward function given as `path/to/file.py:function_name` (verl's `compute_score` signature:
`fn(data_source, solution_str, ground_truth, extra_info) -> float`)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from rlhf.errors import ConfigError


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def load_user_function(spec: str, what: str = "reward function") -> Callable:
    """Import the file under a private module name and return the named callable; any problem is a ConfigError
    naming `what` it was meant to be."""
    path_text, _, name = spec.rpartition(":")
    if not path_text.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must be written 'path/to/file.py:function_name'")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{what} file {path_text!r} not found")
    module_name = "rlhf_user_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # lets the file's own dataclasses/pickling find their module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ConfigError(f"importing {what} file {path_text!r} failed: {_one_line(error)}") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{what} file {path_text!r} has no function {name!r}")
    return function
