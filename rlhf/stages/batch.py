"""The step's payloads: `RolloutBatch` (what the rollout side knows) and `ScoredBatch` (that plus what the training
side scored), both frozen `SequenceBatch`es: prompt + response rows with per-row and per-token tensors.

Sequences are **right-padded** `prompt + response` rows, so a causal model needs no attention mask or shifted
positions (padding only ever follows real tokens). Per-token RL tensors are response-aligned `[B, T]`: column j
is the j-th response token, whose logprob the model predicts at sequence position `prompt_len + j - 1`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Self

import torch

from rlhf.algo.groups import Groups
from rlhf.errors import CheckpointError
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts

PADDING_UID = -1  # sample_index_b of a padding row (`pad_to_multiple`): no dataset prompt, no data_source


@dataclass(frozen=True, kw_only=True)
class SequenceBatch:
    """Right-padded prompt + response rows: what every forward reads (`rlhf sft` trains on it as is)."""

    tokens_bs: torch.Tensor  # int64 [B, S] prompt + response, right-padded with pad_token_id
    prompt_lengths_b: torch.Tensor  # int64 [B]
    response_lengths_b: torch.Tensor  # int64 [B]
    response_mask_bt: torch.Tensor  # bool [B, T] real response tokens
    pad_token_id: int

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

    def trimmed(self) -> Self:
        """Without the padding columns all rows share: tokens cut after the longest sequence, per-token fields
        after the longest response. Rows are right-padded and the model causal, so kept positions are unchanged."""
        if self.size == 0:
            return self
        seq_width = max(int((self.prompt_lengths_b + self.response_lengths_b).max()), 2)
        response_width = max(int(self.response_lengths_b.max()), 1)
        updates = {"tokens_bs": self.tokens_bs[:, :seq_width]}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith(("_bt", "_btk")) and isinstance(value, torch.Tensor):
                updates[field.name] = value[:, :response_width]
            elif field.name.endswith("_bslk") and isinstance(value, torch.Tensor):
                updates[field.name] = value[:, :seq_width]
        return dataclasses.replace(self, **updates)

    def to(self, device: torch.device) -> Self:
        """Every tensor field on `device` (the step's global batch lives on the host; roles compute on theirs)."""
        updates = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **updates)

    def select(self, rows: torch.Tensor | slice) -> Self:
        """The rows `rows` of every per-sample field."""
        updates = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                updates[field.name] = value[rows]
        return dataclasses.replace(self, **updates)

    def shard(self, index: int, count: int) -> Self:
        """Contiguous 1/count of the rows (a DP rank's share); count must divide the batch."""
        assert self.size % count == 0, (self.size, count)
        per = self.size // count
        return self.select(slice(index * per, (index + 1) * per))

    def chunks(self, size: int, *, ragged: bool = False) -> list[Self]:
        """Consecutive row blocks of `size` (`ragged`: the last one may be smaller)."""
        assert ragged or self.size % size == 0, (self.size, size)
        return [self.select(slice(start, start + size)) for start in range(0, self.size, size)]


@dataclass(frozen=True, kw_only=True)
class RolloutBatch(SequenceBatch):
    """What the rollout side knows about its samples (`RolloutSide.generate`); None only where a run has none."""

    group_index_b: torch.Tensor  # int64 [B] the prompt each row answers (GRPO/RLOO groups, contiguous)
    sample_index_b: torch.Tensor  # int64 [B] dataset index of the row's prompt (PADDING_UID: a padding row)
    # int64 [B] the row's trajectory among its group's (multi-turn `fork` history: the rows of one trajectory
    # share it, and its advantage); None: every row is a trajectory of its own
    trajectory_index_b: torch.Tensor | None
    loss_mask_bt: torch.Tensor  # bool [B, T] sampled tokens to train on (single-turn: the response)
    rollout_logprobs_bt: torch.Tensor  # fp32 [B, T] logprobs the rollout engine sampled with
    policy_version_bt: torch.Tensor  # int32 [B, T] policy version that sampled each token (0 on pad)
    truncated_b: torch.Tensor  # bool [B] the response hit max_new_tokens (finish reason `length`)
    scores_b: torch.Tensor | None  # fp32 [B] sequence reward; None: a reward model scores it on the training side
    baseline_scores_b: torch.Tensor | None  # fp32 [B] greedy-rollout reward of the prompt (ReMax only)
    # fp32 [B, K] the scorer's components named by algo.advantage.gdpo_reward_keys, in that order (GDPO only)
    reward_components_bk: torch.Tensor | None
    # int16 [B, S, L, K] experts of each input token per routed layer (-1 unknown): MoE routing replay only
    routed_experts_bslk: torch.Tensor | None
    # fp32 [B, T] multi-turn `credit=turn`: each sampled token's turn return-to-go (0 elsewhere); None: the score
    # is the trajectory's on every token (the default, so single-turn builders need not name it)
    turn_returns_bt: torch.Tensor | None = None

    @property
    def trajectory_lengths_b(self) -> torch.Tensor:
        """int64 [B] response tokens of each row's whole trajectory (a forked one's rows summed: what its one
        `append` row would hold); overlong shaping reads it, so a trajectory's rows share one penalty."""
        if self.trajectory_index_b is None:
            return self.response_lengths_b
        trajectories = Groups.trajectories(self.group_index_b, self.trajectory_index_b)
        return trajectories.broadcast_b(trajectories.sum_g(self.response_lengths_b))


@dataclass(frozen=True, kw_only=True)
class ScoredBatch(RolloutBatch):
    """A rollout batch scored by the training side (`TrainSide.train`); `loss_mask_bt` is the actor's final one
    (rollout correction's rejections and overlong filtering applied). None: the run has no such role or stage."""

    old_logprobs_bt: torch.Tensor | None  # fp32 [B, T] actor before the update (None: strictly on-policy)
    ref_logprobs_bt: torch.Tensor | None  # fp32 [B, T] frozen reference
    values_bt: torch.Tensor | None  # fp32 [B, T] critic
    token_rewards_bt: torch.Tensor  # fp32 [B, T] score at the last token (+ KL penalty)
    advantages_bt: torch.Tensor  # fp32 [B, T]
    returns_bt: torch.Tensor | None  # fp32 [B, T] critic targets (GAE)
    is_weights_bt: torch.Tensor | None  # fp32 [B, T] rollout-correction weights on the policy loss
    teacher_logprobs_bt: torch.Tensor | None  # fp32 [B, T] distillation teachers' logprobs of the sampled tokens
    cov_selected_bt: torch.Tensor | None  # bool [B, T] Clip-Cov / KL-Cov: the step's tokens (covariance_selection)
    # distillation's top-K estimator: the teacher's K most likely ids at each response position (int64) and its
    # logprobs of them (fp32), [B, T, K]; None: estimator=sampled or no distillation
    teacher_topk_ids_btk: torch.Tensor | None = None
    teacher_topk_logprobs_btk: torch.Tensor | None = None

    @property
    def extra_labels_bsk(self) -> torch.Tensor | None:
        """int64 [B, S, K]: the teacher's top-K ids at the sequence position predicting each response token (0
        elsewhere), which the actor's fused head scores beside the next token (`forward`'s labels); None without."""
        ids_btk = self.teacher_topk_ids_btk
        if ids_btk is None:
            return None
        extra_bsk = ids_btk.new_zeros((*self.tokens_bs.shape, ids_btk.shape[-1]))
        rows_n, positions_n = self.response_index()
        extra_bsk[rows_n, positions_n] = ids_btk[self.response_mask_bt.bool()]
        return extra_bsk

    @classmethod
    def of(cls, batch: RolloutBatch, **scored: torch.Tensor | None) -> "ScoredBatch":
        """`batch` with the scored fields (and any rollout field given again, e.g. the final loss mask)."""
        rollout = {field.name: getattr(batch, field.name) for field in dataclasses.fields(RolloutBatch)}
        return cls(**(rollout | scored))


# The async checkpoint's in-flight batches: RolloutBatch's tensor fields and their dtypes (None where optional).
ROLLOUT_SCHEMA = {"tokens_bs": torch.int64, "prompt_lengths_b": torch.int64, "response_lengths_b": torch.int64,
                  "response_mask_bt": torch.bool, "group_index_b": torch.int64, "sample_index_b": torch.int64,
                  "trajectory_index_b": torch.int64, "loss_mask_bt": torch.bool, "rollout_logprobs_bt": torch.float32,
                  "policy_version_bt": torch.int32, "truncated_b": torch.bool, "scores_b": torch.float32,
                  "baseline_scores_b": torch.float32, "reward_components_bk": torch.float32,
                  "routed_experts_bslk": torch.int16,
                  "turn_returns_bt": torch.float32}


def rollout_state(batch: RolloutBatch) -> dict[str, Any]:
    """A rollout batch as a checkpoint state tree in `ROLLOUT_SCHEMA` (tensors and the pad id; no pickle)."""
    return {"pad_token_id": batch.pad_token_id} | {name: getattr(batch, name) for name in ROLLOUT_SCHEMA}


def rollout_from_state(state: dict[str, Any]) -> RolloutBatch:
    """Inverse of `rollout_state`; a tree of another schema is a CheckpointError naming the difference."""
    expected = set(ROLLOUT_SCHEMA) | {"pad_token_id"}
    state = {"trajectory_index_b": None, "turn_returns_bt": None,
             "reward_components_bk": None} | state  # absent: written before they existed
    if set(state) != expected:
        raise CheckpointError(f"the checkpoint's in-flight batch has fields {sorted(set(state) ^ expected)} this "
                              "version does not expect; resume it with the version that wrote it")
    for name, dtype in ROLLOUT_SCHEMA.items():
        if state[name] is not None and state[name].dtype != dtype:
            raise CheckpointError(f"the checkpoint's in-flight batch has {name} of dtype {state[name].dtype}, "
                                  f"this version expects {dtype}; resume it with the version that wrote it")
    return RolloutBatch(**state)


def pad_to_multiple(batch: RolloutBatch, multiple: int) -> RolloutBatch:
    """`batch` with empty rows appended up to a multiple of `multiple` rows (a multi-turn batch whose forked
    trajectories added rows): a pad token each, nothing to train on, each in a group of its own, uid PADDING_UID."""
    extra = -batch.size % multiple
    if not extra:
        return batch
    fill = {"tokens_bs": batch.pad_token_id, "prompt_lengths_b": 1, "response_lengths_b": 1, "routed_experts_bslk": -1,
            "sample_index_b": PADDING_UID}
    updates = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            rows = value.new_full((extra, *value.shape[1:]), fill.get(field.name, 0))
            if field.name == "group_index_b":
                rows = int(value.max()) + 1 + torch.arange(extra, dtype=value.dtype)
            updates[field.name] = torch.cat([value, rows])
    return dataclasses.replace(batch, **updates)


def gather_response(values_bs: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """Per-position values `[B, S]` (position s predicting token s+1) -> response-aligned `[B, T]`, 0 on padding."""
    picked_bt = values_bs.gather(1, batch.response_positions_bt())
    return picked_bt * batch.response_mask_bt


def gather_response_k(values_bsk: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """`gather_response` of K values per position: `[B, S, K]` -> response-aligned `[B, T, K]`, 0 on padding."""
    positions_btk = batch.response_positions_bt()[..., None].expand(-1, -1, values_bsk.shape[-1])
    return values_bsk.gather(1, positions_btk) * batch.response_mask_bt[..., None]


def scatter_response(values_n: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """Values of the real response tokens (`response_index` order) -> response-aligned `[B, T]`, 0 on padding."""
    mask_bt = batch.response_mask_bt.bool()
    return values_n.new_zeros(mask_bt.shape).masked_scatter(mask_bt, values_n)


def _sampled_logprobs(rollouts: Rollouts) -> torch.Tensor:
    """Logprobs under the distribution the tokens were sampled from (logits / temperature), which the training
    forward reproduces; engines that only report raw logprobs (vLLM) give those."""
    scaled = rollouts.response_scaled_logprobs_rt
    return scaled if scaled is not None else rollouts.response_logprobs_rt


def build_rollout_batch(prompts: PromptBatch, rollouts: Rollouts, *, sample_index_b: torch.Tensor,
                        scores_b: torch.Tensor | None, baseline_scores_b: torch.Tensor | None = None,
                        reward_components_bk: torch.Tensor | None = None,
                        policy_version_rt: torch.Tensor | None = None) -> RolloutBatch:
    """Join each rollout with its prompt into right-padded sequences; `policy_version_rt` (partial rollouts): the
    version of every token, else the engine's for all."""
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
    versions_rt = (mask_rt.int() * rollouts.policy_version if policy_version_rt is None
                   else policy_version_rt * mask_rt)
    return RolloutBatch(tokens_bs=tokens_rs, prompt_lengths_b=prompt_lengths_r.clone(),
                        response_lengths_b=rollouts.response_lengths_r.clone(), response_mask_bt=mask_rt,
                        group_index_b=prompt_index_r.clone(), sample_index_b=sample_index_b,
                        trajectory_index_b=None, loss_mask_bt=mask_rt,
                        rollout_logprobs_bt=_sampled_logprobs(rollouts).float() * mask_rt, truncated_b=truncated_r,
                        policy_version_bt=versions_rt, pad_token_id=rollouts.pad_token_id, scores_b=scores_b,
                        baseline_scores_b=baseline_scores_b, reward_components_bk=reward_components_bk,
                        routed_experts_bslk=_routing(rollouts, width))


def _routing(rollouts: Rollouts, width: int) -> torch.Tensor | None:
    """The rollout's recorded experts (if it recorded them) at the batch's sequence width (-1 beyond)."""
    routed = rollouts.routed_experts_rslk
    if routed is None or routed.shape[1] >= width:
        return None if routed is None else routed[:, :width]
    pad = routed.new_full((routed.shape[0], width - routed.shape[1], *routed.shape[2:]), -1)
    return torch.cat([routed, pad], dim=1)
