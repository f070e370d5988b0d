"""A state tree (nested dicts / lists / tuples of tensors, numpy arrays and plain values) as one safetensors file.

Tensors go into the safetensors body; the tree's structure and plain values go into its header as JSON
(`__metadata__["rlhf.state"]`). Reading parses JSON and raw tensor bytes only: nothing is unpickled, so a
state file from anywhere can never run code. Encoding is exact (tensor bytes, dtypes, float reprs, tuples).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from rlhf.errors import CheckpointError

STATE_KEY = "rlhf.state"
_SCALARS = (bool, int, float, str, type(None))


def _encode(value: Any, tensors: dict[str, torch.Tensor], storages: set[int], where: str) -> Any:
    """The JSON node for `value`; tensors are moved into `tensors` under fresh keys (views of shared storage copied)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in storages or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # safetensors stores whole, unshared storages
        if tensor.nbytes:
            storages.add(tensor.untyped_storage().data_ptr())
        key = str(len(tensors))
        tensors[key] = tensor
        return {"tensor": key}
    if isinstance(value, np.ndarray):
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(np.frombuffer(np.ascontiguousarray(value).tobytes(), np.uint8).copy())
        return {"ndarray": key, "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, tensors, storages, where), _encode(v, tensors, storages, f"{where}.{k}")]
                         for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, storages, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    raise TypeError(f"state value at {where} has type {type(value).__name__}; only tensors, numpy arrays, "
                    "dtypes, plain scalars and dict/list/tuple of them can be saved")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (kind, body), = node.items()
        if kind == "tensor":
            return tensors[body]
        if kind == "dtype":
            dtype = getattr(torch, body, None)
            if isinstance(dtype, torch.dtype):
                return dtype
        if kind == "dict":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
        if kind in ("list", "tuple"):
            items = [_decode(v, tensors) for v in body]
            return tuple(items) if kind == "tuple" else items
    if isinstance(node, dict) and "ndarray" in node:
        raw = tensors[node["ndarray"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()
    raise ValueError(f"unknown state node {str(node)[:80]}")


def encode_state(state: Any) -> bytes:
    """`state` as the bytes of one safetensors file (tensors in the body, the tree as JSON in the header)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, set(), "state")
    return save_tensors(tensors, metadata={STATE_KEY: json.dumps(tree)})


def _header_metadata(data: bytes) -> dict:
    (header_size,) = struct.unpack("<Q", data[:8])
    if len(data) < 8 + header_size:
        raise ValueError(f"header of {header_size} bytes exceeds the file's {len(data)} bytes")
    return json.loads(data[8:8 + header_size]).get("__metadata__") or {}


def decode_state(data: bytes, name: str) -> Any:
    """Inverse of `encode_state`; anything that is not such a file is a one-line CheckpointError naming `name`."""
    try:
        metadata = _header_metadata(data)
        if STATE_KEY not in metadata:
            raise ValueError(f"no {STATE_KEY!r} entry in its safetensors header")
        return _decode(json.loads(metadata[STATE_KEY]), load_tensors(data))
    except (ValueError, KeyError, TypeError, RecursionError, struct.error, SafetensorError) as error:
        raise CheckpointError(f"{name} is not an rlhf state file (safetensors with the state tree in its "
                              f"header): {type(error).__name__}: {str(error)[:200]}") from None


COUNT = "count"  # in a schema: an int >= 0 (never a bool)


def tree_problem(value: Any, schema: Any, where: str) -> str | None:
    """Why a decoded state tree breaks `schema` (a dict of required keys -> schemas, a type, or COUNT; `float`
    takes ints too), naming the first bad node as `where.key`; None when it fits."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where} is {type(value).__name__}, expected a dict"
        for key, sub in schema.items():
            problem = (f"{where}.{key} is missing" if key not in value else
                       tree_problem(value[key], sub, f"{where}.{key}"))
            if problem:
                return problem
        return None
    if schema == COUNT:
        fits = type(value) is int and value >= 0
    elif schema is float:
        fits = type(value) in (int, float)
    else:
        fits = type(value) is schema
    return None if fits else f"{where} is {str(value)[:40]!r}, expected {getattr(schema, '__name__', schema)}"
