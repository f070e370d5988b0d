"""Prompt datasets in verl's schema (JSONL or parquet) read into typed `PromptRecord`s.

Schema per row: `prompt` (chat messages or text), `data_source`, `reward_model.ground_truth`, `extra_info`.
Every malformed row is a `DataError` naming the file and its 1-based line (JSONL) or row (parquet).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.errors import DataError

Prompt = str | list[dict[str, str]]
SUFFIXES = (".jsonl", ".parquet")


@dataclass(kw_only=True, frozen=True)
class PromptRecord:
    """One prompt with what its reward needs; `index` is its 0-based position in the dataset file."""

    prompt: Prompt
    data_source: str
    ground_truth: str | None
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int


def _check_prompt(prompt: Any, where: str) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: 'prompt' must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    messages = []
    for i, message in enumerate(prompt):
        well_formed = isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))
        if not well_formed:
            raise DataError(f"{where}: prompt message {i} must be {{'role': str, 'content': str}}, got {message!r:.80}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _ground_truth(row: dict[str, Any], where: str, require: bool) -> str | None:
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise DataError(f"{where}: 'reward_model' must be an object with 'ground_truth', got {reward_model!r:.80}")
    truth = (reward_model or {}).get("ground_truth")
    if truth is None:
        if require:
            raise DataError(f"{where}: missing reward_model.ground_truth (needed by rule rewards)")
        return None
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise DataError(f"{where}: reward_model.ground_truth must be a string or number, got {truth!r:.80}")
    return str(truth)


def record_from_row(row: Any, where: str, index: int, require_ground_truth: bool = True) -> PromptRecord:
    """Validate one verl-schema row (a dict) into a `PromptRecord`; `where` prefixes every error."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise DataError(f"{where}: missing 'prompt'")
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{where}: 'data_source' must be a non-empty string, got {data_source!r:.80}")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: 'extra_info' must be an object, got {extra_info!r:.80}")
    return PromptRecord(
        prompt=_check_prompt(row["prompt"], where),
        data_source=data_source,
        ground_truth=_ground_truth(row, where, require_ground_truth),
        extra_info=extra_info,
        index=index,
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{where}: not UTF-8 text (byte {error.start + 1})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several unrelated types for a bad file
        detail = " ".join(str(error).split())[:200]
        raise DataError(f"{path}: not a readable parquet file ({type(error).__name__}: {detail})") from None
    for row_number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {row_number}", row


def read_records(path: str | os.PathLike, require_ground_truth: bool = True) -> list[PromptRecord]:
    """Read a whole `.jsonl` or `.parquet` dataset; the first bad row raises a `DataError` naming it."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown dataset format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    records = [record_from_row(row, where, index, require_ground_truth)
               for index, (where, row) in enumerate(rows)]
    if not records:
        raise DataError(f"{path}: dataset is empty")
    return records


def record_to_row(record: PromptRecord) -> dict[str, Any]:
    """The verl-schema row of a record (inverse of `record_from_row`, without the index)."""
    return {
        "prompt": record.prompt,
        "data_source": record.data_source,
        "reward_model": {"style": "rule", "ground_truth": record.ground_truth},
        "extra_info": record.extra_info,
    }


def write_records(path: str | os.PathLike, records: Sequence[PromptRecord]) -> None:
    """Write records as `.jsonl` or `.parquet` atomically (temp file then rename): a failure leaves nothing."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown dataset format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    rows = [record_to_row(record) for record in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if path.suffix == ".jsonl":
            with open(tmp_name, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            for row in rows:  # parquet cannot store a struct with no fields; null reads back as {}
                row["extra_info"] = row["extra_info"] or None
            pq.write_table(pa.Table.from_pylist(rows), tmp_name)
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
