"""Rendering new messages through the chat template, token-in/token-out, with the per-turn prefix check.

The model's own tokens are never re-encoded. Before each turn the conversation's messages (assistant turns as
their decoded text) are rendered by the template and tokenized — the *canonical* prompt — and checked against
the tokens the model has read so far (the trajectory's current row):
- the held tokens are a prefix of the canonical prompt: the next prompt is the canonical one (it only appends);
- they are not (a template that rewrites history, e.g. drops `<think>` blocks of earlier turns, or sampled
  tokens whose text re-encodes differently): a prefix mismatch, handled by the `HistoryPolicy`:
  `append` keeps the held tokens and appends only the new messages' rendering (the delta); `fork` starts a new
  training row holding exactly the canonical prompt, so every row is what the model read when it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.agents.config import HistoryPolicy
from rlhf.errors import ConfigError

Messages = list[dict[str, Any]]
_PROBE_USER, _PROBE_ASSISTANT = "rlhf-probe-user", "rlhf-probe-assistant"


@dataclass(frozen=True)
class NextPrompt:
    """The next turn's prompt tokens; `fork` says they start a new row; `mismatch` that the prefix check failed."""

    tokens: list[int]
    mismatch: bool
    fork: bool


class ChatRenderer:
    """The tokenizer's chat template applied to message lists, token-in/token-out (tokens are never decoded and
    encoded back for the row: only the new messages' text is encoded)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("multi-turn rollouts need a tokenizer with a chat template; this tokenizer has none "
                              "(set one, or use text prompts with a single-turn run)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self._assistant_suffix = self._end_of_assistant()

    def text(self, messages: Messages, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # jinja raises its own types (undefined role, a template raise_exception)
            roles = sorted({str(message.get("role")) for message in messages})
            raise ConfigError(f"the chat template cannot render roles {roles}: {error}; use a template that "
                              "supports tool messages or map tool results to a role it knows") from error

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: Messages) -> list[int]:
        """The first turn's prompt: the conversation rendered with the generation prompt."""
        return self.encode(self.text(messages, generation_prompt=True))

    def delta(self, new_messages: Messages) -> list[int]:
        """Tokens of `new_messages` as the template renders them after an assistant turn that ended with its
        stop token, up to the next generation prompt (what `append` adds after the held tokens)."""
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        base_text = self.text(base, generation_prompt=False)
        full_text = self.text(base + new_messages, generation_prompt=True)
        if not full_text.startswith(base_text):
            raise ConfigError("the chat template renders an earlier turn differently once messages follow it; "
                              "rlhf cannot render new messages alone with it")
        return self.encode(self._assistant_suffix + full_text[len(base_text):])

    def next_prompt(self, held: list[int], messages: Messages, new_messages: Messages,
                    policy: HistoryPolicy) -> NextPrompt:
        """The prompt of the next turn, given the tokens held so far and the whole conversation (ending with
        `new_messages`, already included in `messages`)."""
        canonical = self.prompt(messages)
        if canonical[:len(held)] == held:
            return NextPrompt(canonical, mismatch=False, fork=False)
        if policy is HistoryPolicy.FORK:
            return NextPrompt(canonical, mismatch=True, fork=True)
        return NextPrompt(held + self.delta(new_messages), mismatch=True, fork=False)

    def _end_of_assistant(self) -> str:
        """What the template writes after an assistant's content beyond the stop token the model sampled (e.g.
        ChatML's newline after `<|im_end|>`): the held tokens end at the stop token, the template goes on."""
        text = self.text([{"role": "user", "content": _PROBE_USER},
                          {"role": "assistant", "content": _PROBE_ASSISTANT}], generation_prompt=False)
        at = text.rfind(_PROBE_ASSISTANT)
        if at < 0:
            raise ConfigError("the chat template drops assistant content; multi-turn rollouts cannot use it")
        suffix = text[at + len(_PROBE_ASSISTANT):]
        eos = self.tokenizer.eos_token or ""
        return suffix[len(eos):] if eos and suffix.startswith(eos) else suffix
