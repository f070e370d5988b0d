"""Hermes/Qwen-style tool calls, found on the sampled token ids: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`. The markers are matched as token-id sequences (a special token each in a tool-aware tokenizer),
so text that merely looks like a marker inside other tokens is not a call; only the span between two markers is
decoded, to read its JSON. A malformed call is returned as a `ToolCall` with an `error` (the agent answers it
with that error and counts it), never raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlhf.errors import ConfigError

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call could not be read (then name may be empty)


class ToolCallParser:
    """Finds tool calls in a turn's sampled token ids for one tokenizer."""

    def __init__(self, tokenizer: Any, start: str = START, end: str = END) -> None:
        self.tokenizer = tokenizer
        self.start_ids = list(tokenizer.encode(start, add_special_tokens=False))
        self.end_ids = list(tokenizer.encode(end, add_special_tokens=False))
        if not self.start_ids or not self.end_ids or tokenizer.decode(self.start_ids) != start:
            raise ConfigError(f"the tokenizer cannot encode the tool-call markers {start!r} / {end!r} and decode "
                              "them back; use a tokenizer with tool-call tokens (e.g. Qwen's) or add them as "
                              "special tokens")

    def parse(self, token_ids: list[int], max_calls: int) -> list[ToolCall]:
        """Every `<tool_call>` span in order; beyond `max_calls` one call reporting the limit ends the list."""
        calls: list[ToolCall] = []
        at = _find(token_ids, self.start_ids, 0)
        while at >= 0:
            body_start = at + len(self.start_ids)
            end = _find(token_ids, self.end_ids, body_start)
            if len(calls) == max_calls:
                calls.append(ToolCall("", error=f"more than {max_calls} tool calls in one turn; make at most "
                                                f"{max_calls}"))
                break
            if end < 0:
                calls.append(ToolCall("", error=f"unterminated tool call: no {END} after {START}"))
                break
            calls.append(self._read(self.tokenizer.decode(token_ids[body_start:end])))
            at = _find(token_ids, self.start_ids, end + len(self.end_ids))
        return calls

    @staticmethod
    def _read(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as error:
            return ToolCall("", error=f"tool call is not valid JSON ({error}): {body[:80]!r}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("", error=f'tool call must be {{"name": str, "arguments": object}}, got {body[:80]!r}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], error=f"tool call arguments must be an object, got {arguments!r:.80}")
        return ToolCall(call["name"], arguments)


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    """Index of the first `needle` sequence in `haystack` at or after `start`, or -1."""
    first, width = needle[0], len(needle)
    for at in range(start, len(haystack) - width + 1):
        if haystack[at] == first and haystack[at:at + width] == needle:
            return at
    return -1
