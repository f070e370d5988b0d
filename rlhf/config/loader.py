"""Build typed config dataclasses from YAML and dotted CLI overrides, with errors that name the key path.

Defaults live only in the dataclasses. Unknown keys are errors with a did-you-mean hint; values are checked
against the field's annotation (int, float, bool, str, Literal, Optional, list/tuple, dict, nested dataclass).
"""

from __future__ import annotations

import dataclasses
import os
import difflib
import enum
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rlhf.errors import ConfigError

T = TypeVar("T")


def local_folder(path: str) -> str:
    """A local folder as an absolute path (config.yaml then means the same from any working directory, e.g.
    for `rlhf export`); anything else (a hub id, an empty value) as given, with `~` expanded."""
    path = os.path.expanduser(path)
    return os.path.abspath(path) if path and os.path.isdir(path) else path


def _suggest(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(choices))}"


def _describe(tp: Any) -> str:
    """What a value of annotation `tp` looks like, for an error that names every arm of a union."""
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp`, converting where lossless (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value  # the owning dataclass parses it (with its own did-you-mean)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arm, path)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}={value!r} must be {' or '.join(_describe(a) for a in args if a is not type(None))}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}={value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r} must be a list")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a mapping")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}={value!r} must be of type {tp.__name__}")
    return value


def from_dict(cls: type[T], data: dict, path: str = "") -> T:
    """Instantiate dataclass `cls` from a nested mapping; `__post_init__` validation runs as usual."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(f"unknown config key '{full}'{_suggest(str(key), list(fields))}")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as err:
        raise ConfigError(f"{path or 'config'}: {err}") from None


def to_dict(config: Any) -> Any:
    """Plain nested dicts/lists (YAML-safe) from a config dataclass."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, enum.Enum):
        return config.value
    return config


def parse_override(text: str) -> tuple[list[str], Any]:
    """`actor.optim.lr=1e-6` -> (["actor", "optim", "lr"], 1e-06); values are parsed as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. mesh.rollout.tp=2)")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted override in the nested mapping `data` (creating sections as needed)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{key}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as configs/tiny_cpu.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """The config of type `cls` from an optional YAML file plus dotted overrides."""
    data = read_yaml(path) if path else {}
    return from_dict(cls, apply_overrides(data, list(overrides or [])))


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
