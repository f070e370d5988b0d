"""Read a prompt dataset (JSONL or parquet, verl's schema) and write generations as JSONL.

verl schema: `prompt` is chat messages or text, plus optional `data_source`, `reward_model.ground_truth`
and `extra_info.index`/`uid`. The tokenizer's chat template renders message prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import DataError


@dataclass(frozen=True)
class PromptRow:
    index: int
    prompt: str | list[dict[str, str]]
    data_source: str
    ground_truth: str | None
    uid: str


def _rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as f:
        for line_number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{line_number}: not valid JSON ({error.msg})") from error
    return rows


def read_prompts(path: str, prompt_key: str = "prompt", limit: int | None = None) -> list[PromptRow]:
    """Every row's prompt and metadata; a row without `prompt_key` is a DataError naming file and row."""
    source = Path(path)
    if not source.exists():
        raise DataError(f"prompt dataset {path} does not exist")
    prompts = []
    for index, row in enumerate(_rows(source)[:limit]):
        prompt = row.get(prompt_key)
        if not isinstance(prompt, (str, list)) or not prompt:
            raise DataError(f"{path} row {index}: field {prompt_key!r} must be text or chat messages")
        reward_model = row.get("reward_model") or {}
        extra = row.get("extra_info") or {}
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        prompts.append(PromptRow(index=index, prompt=prompt, data_source=str(row.get("data_source", "")),
                                 ground_truth=None if truth is None else str(truth),
                                 uid=str(extra.get("uid", extra.get("index", index)))))
    return prompts


def encode(prompt: str | list[dict[str, str]], tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
