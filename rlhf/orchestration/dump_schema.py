"""What a rollout dump (`rlhf.orchestration.rollout_dump`) must hold before replay trains on it: the footer (format,
metadata, each column's type) checked for every file up front, each row's values when its step is read. A dump
is input from disk like a dataset: every failure is one ConfigError line naming the file, row and column."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlhf.errors import ConfigError
from rlhf.stages.batch import PADDING_UID

FORMAT = "rlhf.rollouts/1"
FIX = "point --rollouts at the rollouts/ folder of a run trained with trainer.dump_rollouts=true"
MODEL_FIX = "replay with the model (tokenizer) the dump was made with"
# column -> (kind of value, one per response token): the columns replay reads
COLUMNS = {"step": ("integers", False), "policy_version": ("integers", True), "uid": ("integers", False),
           "group": ("integers", False), "data_source": ("strings", False), "prompt_ids": ("integers", True),
           "response_ids": ("integers", True), "rollout_logprobs": ("floats", True), "score": ("floats", False),
           "truncated": ("booleans", False)}
# multi-turn columns (checked where present): the loss mask per response token (absent: no interior zeros, every
# response token), the trajectory of a row in its group (the `fork` history only), each token's turn return-to-go
# (`multiturn.credit=turn` only)
OPTIONAL_COLUMNS = {"loss_mask": ("booleans", True), "trajectory": ("integers", False),
                    "turn_returns": ("floats", True)}
INT32_MAX = 2 ** 31 - 1  # policy versions are int32 in the batch
INT64_MAX = 2 ** 63 - 1  # uids and groups are int64
FLOAT32_MAX = 3.4028234663852886e38  # scores and log-probabilities are float32
LOGPROB_SLACK = 1e-4  # a log-probability is <= 0; this much above it is rounding


def _is_kind(arrow_type: Any, kind: str) -> bool:
    import pyarrow as pa

    return {"integers": pa.types.is_integer, "floats": pa.types.is_floating, "booleans": pa.types.is_boolean,
            "strings": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)}[kind](arrow_type)


def _column_ok(arrow_type: Any, kind: str, per_token: bool) -> bool:
    import pyarrow as pa

    if not per_token:
        return _is_kind(arrow_type, kind)
    return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and _is_kind(arrow_type.value_type,
                                                                                                kind)


def _metadata(path: Path, schema: Any) -> dict:
    raw = (schema.metadata or {}).get(b"rlhf")
    try:
        meta = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):  # also a 5000-digit number or deep nesting
        raise ConfigError(f"rollout dump {path} has 'rlhf' metadata that is not valid JSON; {FIX}") from None
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("format") != FORMAT:
        raise ConfigError(f"rollout dump {path} is not an rlhf rollout dump (format {meta.get('format')!r}, "
                          f"expected {FORMAT!r}); {FIX}")
    for key, least in (("pad_token_id", 0), ("response_width", 1)):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"rollout dump {path} metadata {key}={value!r} is not an integer >= {least}; {FIX}")
    return meta


def check_footer(path: Path, schema: Any) -> dict:
    """The dump's metadata (format, pad token, response width) once its footer is a dump's: JSON metadata, every
    column replay reads, each of its type."""
    meta = _metadata(path, schema)
    missing = [name for name in COLUMNS if name not in schema.names]
    if missing:
        raise ConfigError(f"rollout dump {path} lacks the column(s) {', '.join(missing)}; {FIX}")
    present = COLUMNS | {name: kind for name, kind in OPTIONAL_COLUMNS.items() if name in schema.names}
    for name, (kind, per_token) in present.items():
        arrow_type = schema.field(name).type
        if not _column_ok(arrow_type, kind, per_token):
            expected = f"a list of {kind} per row" if per_token else kind
            raise ConfigError(f"rollout dump {path} column {name} holds {arrow_type}, expected {expected}; {FIX}")
    return meta


def check_rows(path: Path, table: dict[str, list], meta: dict, *, vocab_size: int, max_positions: int) -> None:
    """Each row's values: no nulls, token ids in the vocabulary, prompt + response within the model's positions,
    one finite log-probability <= 0 and one int32 policy version per response token, a finite score."""
    for key, limit in (("pad_token_id", vocab_size - 1), ("response_width", max_positions)):
        if meta[key] > limit:
            raise ConfigError(f"rollout dump {path} metadata {key}={meta[key]} is above {limit} (model.path: "
                              f"vocabulary {vocab_size}, max_position_embeddings {max_positions}); {MODEL_FIX}")
    names = list(COLUMNS) + [name for name in OPTIONAL_COLUMNS if name in table]
    for row in range(len(table["score"])):
        for name in names:
            value = table[name][row]
            if value is None or (isinstance(value, list) and None in value):
                _fail(path, row, name, "a null value", FIX)
        _check_row(path, row, {name: table[name][row] for name in names}, vocab_size, max_positions)


def _check_row(path: Path, row: int, values: dict[str, Any], vocab_size: int, max_positions: int) -> None:
    prompt, response = values["prompt_ids"], values["response_ids"]
    if not prompt:
        _fail(path, row, "prompt_ids", "an empty prompt", FIX)
    for name in ("prompt_ids", "response_ids"):
        bad = next((i for i in values[name] if not 0 <= i < vocab_size), None)
        if bad is not None:
            _fail(path, row, name, f"token id {bad} is outside model.path's vocabulary of {vocab_size}", MODEL_FIX)
    if len(prompt) + len(response) > max_positions:
        _fail(path, row, "response_ids", f"{len(prompt)} prompt + {len(response)} response tokens exceed "
              f"model.path's max_position_embeddings={max_positions}", MODEL_FIX)
    for name in ("rollout_logprobs", "policy_version", "loss_mask", "turn_returns"):
        if name in values and len(values[name]) != len(response):
            _fail(path, row, name, f"{len(values[name])} values for a response of {len(response)} tokens", FIX)
    bad = next((v for v in values["rollout_logprobs"] if not (_finite32(v) and v <= LOGPROB_SLACK)), None)
    if bad is not None:
        _fail(path, row, "rollout_logprobs", f"log-probability {bad!r} is not a finite number <= 0", FIX)
    bad = next((v for v in values.get("turn_returns", ()) if not _finite32(v)), None)
    if bad is not None:
        _fail(path, row, "turn_returns", f"return {bad!r} is not a finite float32", FIX)
    bad = next((v for v in values["policy_version"] if not 0 <= v <= INT32_MAX), None)
    if bad is not None:
        _fail(path, row, "policy_version", f"policy version {bad} is outside [0, {INT32_MAX}]", FIX)
    check_score(path, row, values["score"])
    if not (0 <= values["uid"] <= INT64_MAX or values["uid"] == PADDING_UID):
        _fail(path, row, "uid", f"uid {values['uid']} is not a dataset index in [0, {INT64_MAX}] (or "
              f"{PADDING_UID}: a padding row)", FIX)
    for name in ("group", "trajectory"):
        if name in values and not -INT64_MAX - 1 <= values[name] <= INT64_MAX:
            _fail(path, row, name, f"{name} {values[name]} does not fit int64", FIX)


def check_score(path: Path, row: int, score: Any) -> None:
    """A score is a finite float32 (read alone too: a resumed replay refolds earlier dumps' scores)."""
    if score is None or not _finite32(score):
        _fail(path, row, "score", f"score {score!r} is not a finite float32", FIX)


def _finite32(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def _fail(path: Path, row: int, column: str, what: str, fix: str) -> None:
    raise ConfigError(f"rollout dump {path} row {row} column {column}: {what}; {fix}")
