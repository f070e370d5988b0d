"""Typed payloads between the data loader, the rollout engine and the trainer (docs/design.md §2).

`PromptBatch` goes into `RolloutEngine.generate`, `Rollouts` comes out. Shapes are in the field suffixes:
`b` = prompts in the batch, `t` = tokens, `r` = rollouts (= prompts x samples per prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from rlhf.errors import ConfigError


class FinishReason(str, Enum):
    """Why a sequence stopped: an EOS/stop token (`stop`) or the `max_new_tokens` budget (`length`)."""

    STOP = "stop"
    LENGTH = "length"


@dataclass(kw_only=True)
class PromptBatch:
    """Left-padded prompts plus the per-prompt metadata the reward stage needs."""

    prompt_tokens_bt: torch.Tensor  # int64 [B, T], left-padded with `pad_token_id`
    prompt_lengths_b: torch.Tensor  # int64 [B], real tokens per row (right-aligned in prompt_tokens_bt)
    pad_token_id: int = 0
    data_sources: list[str] = field(default_factory=list)
    ground_truths: list[str | None] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    # int64 [B]: each prompt's own cap on new tokens (multi-turn: what is left of its row's token budget), at most
    # the sampling's max_new_tokens; None: max_new_tokens for every prompt. Engines that ignore it generate more
    # (the caller cuts); the native engine sizes its KV cache by it and vLLM stops there.
    max_new_tokens_b: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens_bt.dim() != 2 or self.prompt_lengths_b.dim() != 1:
            raise ConfigError(f"PromptBatch wants prompt_tokens_bt [B, T] and prompt_lengths_b [B]; got "
                              f"{tuple(self.prompt_tokens_bt.shape)} and {tuple(self.prompt_lengths_b.shape)}")
        num_prompts, width = self.prompt_tokens_bt.shape
        if self.prompt_lengths_b.shape[0] != num_prompts:
            raise ConfigError(f"PromptBatch has {num_prompts} prompts but {self.prompt_lengths_b.shape[0]} lengths")
        if num_prompts and (int(self.prompt_lengths_b.min()) < 1 or int(self.prompt_lengths_b.max()) > width):
            raise ConfigError(f"PromptBatch prompt lengths must lie in [1, {width}]; got "
                              f"{self.prompt_lengths_b.tolist()}")
        for name in ("data_sources", "ground_truths", "uids"):
            values = getattr(self, name)
            if values and len(values) != num_prompts:
                raise ConfigError(f"PromptBatch.{name} has {len(values)} entries for {num_prompts} prompts")
        caps = self.max_new_tokens_b
        if caps is not None and (caps.shape != (num_prompts,) or (num_prompts and int(caps.min()) < 1)):
            raise ConfigError(f"PromptBatch.max_new_tokens_b must be [B] = [{num_prompts}] caps >= 1; got "
                              f"{caps.tolist()}")

    @property
    def num_prompts(self) -> int:
        return self.prompt_tokens_bt.shape[0]

    def new_token_caps(self, max_new_tokens: int) -> list[int]:
        """Each prompt's cap on new tokens: its own (`max_new_tokens_b`) within the sampling's `max_new_tokens`."""
        if self.max_new_tokens_b is None:
            return [max_new_tokens] * self.num_prompts
        return [min(cap, max_new_tokens) for cap in self.max_new_tokens_b.tolist()]

    def prompt(self, index: int) -> list[int]:
        """The unpadded token ids of prompt `index`."""
        length = int(self.prompt_lengths_b[index])
        return self.prompt_tokens_bt[index, self.prompt_tokens_bt.shape[1] - length:].tolist()

    @classmethod
    def from_token_lists(cls, prompts: list[list[int]], pad_token_id: int = 0, **metadata) -> "PromptBatch":
        """Left-pad a list of token-id lists into a batch."""
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("PromptBatch.from_token_lists: every prompt needs at least one token")
        width = max((len(p) for p in prompts), default=1)
        tokens_bt = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens_bt[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        lengths_b = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return cls(prompt_tokens_bt=tokens_bt, prompt_lengths_b=lengths_b, pad_token_id=pad_token_id, **metadata)


@dataclass(kw_only=True)
class Rollouts:
    """Generated responses, right-padded, `samples_per_prompt` consecutive rows per prompt.

    `response_logprobs_rt` are raw log-softmax(logits) of the sampled tokens (what a training forward at
    temperature 1 computes); `response_scaled_logprobs_rt` use logits / temperature (equal when greedy), or
    None from an engine that cannot report them (vllm reports raw logprobs only).
    """

    response_tokens_rt: torch.Tensor  # int64 [R, T], right-padded with `pad_token_id`
    response_logprobs_rt: torch.Tensor  # fp32 [R, T], 0 on padding
    response_scaled_logprobs_rt: torch.Tensor | None  # fp32 [R, T], 0 on padding
    response_lengths_r: torch.Tensor  # int64 [R]
    finish_reasons: list[FinishReason]
    prompt_index_r: torch.Tensor  # int64 [R], row of the source prompt in the PromptBatch
    policy_version: int = 0
    pad_token_id: int = 0
    # int16 [R, S, L, K]: an MoE engine asked to record routing gives the experts each input token (prompt, then
    # response) was sent to in each routed layer, -1 where none was computed (the last token, padding)
    routed_experts_rslk: torch.Tensor | None = None

    def __post_init__(self) -> None:
        num_rollouts = self.response_tokens_rt.shape[0]
        for name in ("response_logprobs_rt", "response_scaled_logprobs_rt"):
            value = getattr(self, name)
            assert value is None or value.shape == self.response_tokens_rt.shape, (name, value.shape)
        assert self.response_lengths_r.shape == (num_rollouts,)
        assert self.prompt_index_r.shape == (num_rollouts,)
        assert len(self.finish_reasons) == num_rollouts

    @property
    def num_rollouts(self) -> int:
        return self.response_tokens_rt.shape[0]

    @property
    def response_mask_rt(self) -> torch.Tensor:
        """True on real response tokens."""
        positions_t = torch.arange(self.response_tokens_rt.shape[1])
        return positions_t[None, :] < self.response_lengths_r[:, None]

    def response(self, index: int) -> list[int]:
        return self.response_tokens_rt[index, :int(self.response_lengths_r[index])].tolist()
