"""Prompt records to token ids: chat prompts through the tokenizer's chat template, then the length policy.

Chat prompts are rendered with `add_generation_prompt=True` and encoded without extra special tokens (the
template places them); text prompts are encoded as they are, with the tokenizer's default special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.data.config import DataConfig
from rlhf.data.records import Prompt, PromptRecord
from rlhf.errors import ConfigError, DataError


@dataclass(kw_only=True)
class TokenizedPrompts:
    """Kept records with their token ids (unpadded, `lengths[i] == len(token_ids[i])`)."""

    records: list[PromptRecord]
    token_ids: list[list[int]]
    lengths: list[int]
    num_filtered: int
    num_truncated: int


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    """Token ids of one prompt (chat list via the chat template with the generation prompt, or plain text)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template but the dataset has chat prompts; "
                          "use a tokenizer with a chat template or text prompts")
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _apply_length_policy(ids: list[int], record: PromptRecord, config: DataConfig) -> list[int] | None:
    limit = config.max_prompt_length
    if len(ids) <= limit:
        return ids
    if config.truncation == "error":
        raise DataError(
            f"prompt index {record.index} (data_source={record.data_source!r}) has {len(ids)} tokens > "
            f"data.max_prompt_length={limit}; raise the limit or set data.truncation to filter, left or right")
    if config.truncation == "filter":
        return None
    return ids[-limit:] if config.truncation == "left" else ids[:limit]


def tokenize_records(records: Sequence[PromptRecord], tokenizer: Any,
                     config: DataConfig) -> TokenizedPrompts:
    """Encode every record and apply the length policy; an empty prompt or nothing left is a `DataError`."""
    kept, token_ids, num_filtered, num_truncated = [], [], 0, 0
    for record in records:
        ids = encode_prompt(record.prompt, tokenizer)
        if not ids:
            raise DataError(f"prompt index {record.index} (data_source={record.data_source!r}) encodes to 0 tokens")
        fitted = _apply_length_policy(ids, record, config)
        if fitted is None:
            num_filtered += 1
            continue
        num_truncated += len(fitted) < len(ids)
        kept.append(record)
        token_ids.append(fitted)
    if not kept:
        raise DataError(f"all {len(records)} prompts are longer than data.max_prompt_length="
                        f"{config.max_prompt_length} and were filtered out")
    return TokenizedPrompts(records=kept, token_ids=token_ids, lengths=[len(ids) for ids in token_ids],
                            num_filtered=num_filtered, num_truncated=num_truncated)


def left_pad(token_ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts right-aligned for generation: `(tokens_bt` int64 left-padded with `pad_id`, `lengths_b)`."""
    lengths_b = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    width = int(lengths_b.max()) if len(token_ids) else 0
    tokens_bt = torch.full((len(token_ids), width), pad_id, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        if ids:
            tokens_bt[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.int64)
    return tokens_bt, lengths_b
