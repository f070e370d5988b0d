"""`TrainBatch`: prompt + response sequences and everything scored about them, ready for the actor and critic.

Sequences are **right-padded** `prompt + response` rows, so a causal model needs no attention mask or shifted
positions (padding only ever follows real tokens). Per-token RL tensors are response-aligned `[B, T]`: column j
is the j-th response token, whose logprob the model predicts at sequence position `prompt_len + j - 1`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts


@dataclass(kw_only=True)
class TrainBatch:
    tokens_bs: torch.Tensor  # int64 [B, S] prompt + response, right-padded with pad_token_id
    prompt_lengths_b: torch.Tensor  # int64 [B]
    response_lengths_b: torch.Tensor  # int64 [B]
    response_mask_bt: torch.Tensor  # bool [B, T] real response tokens
    group_index_b: torch.Tensor  # int64 [B] the prompt each row answers (GRPO/RLOO groups, contiguous)
    rollout_logprobs_bt: torch.Tensor  # fp32 [B, T] logprobs the rollout engine sampled with
    truncated_b: torch.Tensor | None = None  # bool [B] the response hit max_new_tokens (finish reason `length`)
    policy_version_bt: torch.Tensor | None = None  # int32 [B, T] policy version that sampled each token (0 on pad)
    scores_b: torch.Tensor | None = None  # fp32 [B] sequence reward
    baseline_scores_b: torch.Tensor | None = None  # fp32 [B] greedy-rollout reward of the prompt (ReMax)
    old_logprobs_bt: torch.Tensor | None = None  # fp32 [B, T] actor before the update
    ref_logprobs_bt: torch.Tensor | None = None  # fp32 [B, T] frozen reference
    values_bt: torch.Tensor | None = None  # fp32 [B, T] critic
    token_rewards_bt: torch.Tensor | None = None  # fp32 [B, T] score at the last token (+ KL penalty)
    advantages_bt: torch.Tensor | None = None  # fp32 [B, T]
    returns_bt: torch.Tensor | None = None  # fp32 [B, T] critic targets
    is_weights_bt: torch.Tensor | None = None  # fp32 [B, T] rollout-correction weights on the policy loss
    loss_mask_bt: torch.Tensor | None = None  # bool [B, T] tokens in the actor loss (None: response_mask_bt)
    sample_index_b: torch.Tensor | None = None  # int64 [B] dataset index of the row's prompt (rollout dumps)
    # int16 [B, S, L, K] experts of each input token per routed layer (-1 unknown): routing replay (MoE)
    routed_experts_bslk: torch.Tensor | None = None
    pad_token_id: int = 0

    @property
    def size(self) -> int:
        return self.tokens_bs.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask_bt.shape[1]

    @property
    def padding_mask_bs(self) -> torch.Tensor:
        """True on the padding after each sequence (what MoE routers leave out of their losses)."""
        positions_s = torch.arange(self.tokens_bs.shape[1], device=self.tokens_bs.device)
        return positions_s[None, :] >= (self.prompt_lengths_b + self.response_lengths_b)[:, None]

    def response_positions_bt(self) -> torch.Tensor:
        """Sequence position whose logits predict each response token (clamped on padding)."""
        offsets_t = torch.arange(self.response_width, device=self.prompt_lengths_b.device)
        positions_bt = self.prompt_lengths_b[:, None] - 1 + offsets_t[None, :]
        return positions_bt.clamp(0, self.tokens_bs.shape[1] - 1)

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_n, position_n) of the position predicting each real response token, in `[B, T]` mask order."""
        mask_bt = self.response_mask_bt.bool()
        rows_bt = torch.arange(self.size, device=mask_bt.device)[:, None].expand_as(mask_bt)
        return rows_bt[mask_bt], self.response_positions_bt()[mask_bt]

    def trimmed(self) -> "TrainBatch":
        """Without the padding columns all rows share: tokens cut after the longest sequence, per-token fields
        after the longest response. Rows are right-padded and the model causal, so kept positions are unchanged."""
        if self.size == 0:
            return self
        seq_width = max(int((self.prompt_lengths_b + self.response_lengths_b).max()), 2)
        response_width = max(int(self.response_lengths_b.max()), 1)
        updates = {"tokens_bs": self.tokens_bs[:, :seq_width]}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_bt") and isinstance(value, torch.Tensor):
                updates[field.name] = value[:, :response_width]
            elif field.name.endswith("_bslk") and isinstance(value, torch.Tensor):
                updates[field.name] = value[:, :seq_width]
        return dataclasses.replace(self, **updates)

    def to(self, device: torch.device) -> "TrainBatch":
        """Every tensor field on `device` (the step's global batch lives on the host; roles compute on theirs)."""
        updates = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **updates)

    def select(self, rows: torch.Tensor | slice) -> "TrainBatch":
        """The rows `rows` of every per-sample field."""
        updates = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                updates[field.name] = value[rows]
        return dataclasses.replace(self, **updates)

    def shard(self, index: int, count: int) -> "TrainBatch":
        """Contiguous 1/count of the rows (a DP rank's share); count must divide the batch."""
        assert self.size % count == 0, (self.size, count)
        per = self.size // count
        return self.select(slice(index * per, (index + 1) * per))

    def chunks(self, size: int, *, ragged: bool = False) -> list["TrainBatch"]:
        """Consecutive row blocks of `size` (`ragged`: the last one may be smaller)."""
        assert ragged or self.size % size == 0, (self.size, size)
        return [self.select(slice(start, start + size)) for start in range(0, self.size, size)]


def gather_response(values_bs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Per-position values `[B, S]` (position s predicting token s+1) -> response-aligned `[B, T]`, 0 on padding."""
    picked_bt = values_bs.gather(1, batch.response_positions_bt())
    return picked_bt * batch.response_mask_bt


def scatter_response(values_n: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Values of the real response tokens (`response_index` order) -> response-aligned `[B, T]`, 0 on padding."""
    mask_bt = batch.response_mask_bt.bool()
    return values_n.new_zeros(mask_bt.shape).masked_scatter(mask_bt, values_n)


def _sampled_logprobs(rollouts: Rollouts) -> torch.Tensor:
    """Logprobs under the distribution the tokens were sampled from (logits / temperature), which the training
    forward reproduces; engines that only report raw logprobs (vLLM) give those."""
    scaled = rollouts.response_scaled_logprobs_rt
    return scaled if scaled is not None else rollouts.response_logprobs_rt


def build_train_batch(prompts: PromptBatch, rollouts: Rollouts) -> TrainBatch:
    """Join each rollout with its prompt into right-padded sequences."""
    prompt_index_r = rollouts.prompt_index_r
    prompt_lengths_r = prompts.prompt_lengths_b[prompt_index_r]
    lengths_r = prompt_lengths_r + rollouts.response_lengths_r
    width = max(int(lengths_r.max()) if rollouts.num_rollouts else 1, 2)
    tokens_rs = torch.full((rollouts.num_rollouts, width), rollouts.pad_token_id, dtype=torch.long)
    for row in range(rollouts.num_rollouts):
        prompt = prompts.prompt(int(prompt_index_r[row]))
        response = rollouts.response(row)
        tokens_rs[row, :len(prompt) + len(response)] = torch.tensor(prompt + response, dtype=torch.long)
    mask_rt = rollouts.response_mask_rt
    truncated_r = torch.tensor([reason is FinishReason.LENGTH for reason in rollouts.finish_reasons],
                               dtype=torch.bool)
    return TrainBatch(tokens_bs=tokens_rs, prompt_lengths_b=prompt_lengths_r.clone(),
                      response_lengths_b=rollouts.response_lengths_r.clone(), response_mask_bt=mask_rt,
                      group_index_b=prompt_index_r.clone(),
                      rollout_logprobs_bt=_sampled_logprobs(rollouts).float() * mask_rt, truncated_b=truncated_r,
                      policy_version_bt=mask_rt.int() * rollouts.policy_version, pad_token_id=rollouts.pad_token_id,
                      routed_experts_bslk=_routing(rollouts, width))


def _routing(rollouts: Rollouts, width: int) -> torch.Tensor | None:
    """The rollout's recorded experts (if it recorded them) at the batch's sequence width (-1 beyond)."""
    routed = rollouts.routed_experts_rslk
    if routed is None or routed.shape[1] >= width:
        return None if routed is None else routed[:, :width]
    pad = routed.new_full((routed.shape[0], width - routed.shape[1], *routed.shape[2:]), -1)
    return torch.cat([routed, pad], dim=1)
