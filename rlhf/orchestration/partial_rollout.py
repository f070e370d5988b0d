"""Partial rollouts (`trainer.partial_rollout_tokens` = P, with async): a batch's generation spans a weight push.

  step k-1 │ RolloutSide.start(j):     prompts ──► the first P tokens of every row, policy v_{k-2} (held)
  boundary │ weight push v_{k-1}
  step k   │ RolloutSide.generate(j):  the rows still running (prompt + their P tokens) ──► the rest, policy
           │                           v_{k-1} ──► merged Rollouts ──► RolloutBatch + rule rewards (exchanged at
           │                           step k's boundary)

Rows that stopped within P tokens are done; the others continue with the new weights (rows in flight are never
thrown away): each is resubmitted as prompt + its tokens so far for the remaining tokens (`continue_rollouts`,
native or vLLM). Every token keeps its logprob and the version that sampled it (`policy_version_bt`), so
staleness and rollout correction are per token. Greedy without a weight change, the continuation is the
uninterrupted generation token for token (tested on vLLM); sampled, it is a fresh draw with the batch's round-1
seed (an engine's per-request generator cannot be admitted P draws along), so rows are reproducible but not
those of an uninterrupted generation. A started batch is checkpointed (its first tokens, and the loader position
before its prompts, which a resume reads again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.data.loader import PromptLoader, PromptStep
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts


@dataclass(frozen=True)
class StartedBatch:
    """A batch whose first tokens are sampled: its prompts, the loader state before them, its seed index."""

    prompts: PromptStep
    loader_state: dict[str, Any]
    index: int
    rollouts: Rollouts


def continue_rollouts(engine: RolloutEngine, prompts: PromptBatch, first: Rollouts, params: SamplingParams,
                      width: int) -> tuple[Rollouts, torch.Tensor]:
    """The rows of `first` still running (finish reason length) resubmitted as prompt + their tokens so far, one
    sample each, for the remaining `width` - P tokens with the engine's current weights; then every row merged
    token by token with the version that sampled it (collective over the engine's tp group)."""
    running = [row for row in range(first.num_rollouts) if first.finish_reasons[row] is FinishReason.LENGTH]
    rest = None
    if running:
        prefixes = [prompts.prompt(int(first.prompt_index_r[row])) + first.response(row) for row in running]
        params = dataclasses.replace(params, n=1, max_new_tokens=width - first.response_tokens_rt.shape[1])
        rest = engine.generate(PromptBatch.from_token_lists(prefixes, pad_token_id=prompts.pad_token_id), params)
    return merge_rollouts(first, rest, running, width)


def merge_rollouts(first: Rollouts, rest: Rollouts | None, running: list[int],
                   width: int) -> tuple[Rollouts, torch.Tensor]:
    """Each row's first tokens followed by its continuation (`rest` row i continues row `running[i]`), and the
    policy version of every token `[R, width]`."""
    num_rows = first.num_rollouts
    tokens_rt = torch.full((num_rows, width), first.pad_token_id, dtype=torch.long)
    logprobs_rt = torch.zeros(num_rows, width)
    scaled = first.response_scaled_logprobs_rt is not None
    scaled_rt = torch.zeros(num_rows, width) if scaled else None
    versions_rt = torch.zeros(num_rows, width, dtype=torch.int32)
    lengths_r = first.response_lengths_r.clone()
    reasons = list(first.finish_reasons)
    continued = {row: i for i, row in enumerate(running)}
    for row in range(num_rows):
        parts = [(first, row)] + ([(rest, continued[row])] if row in continued else [])
        offset = 0
        for source, index in parts:
            length = int(source.response_lengths_r[index])
            span = slice(offset, offset + length)
            tokens_rt[row, span] = source.response_tokens_rt[index, :length]
            logprobs_rt[row, span] = source.response_logprobs_rt[index, :length]
            if scaled:
                scaled_rt[row, span] = source.response_scaled_logprobs_rt[index, :length]
            versions_rt[row, span] = source.policy_version
            reasons[row] = source.finish_reasons[index]
            offset += length
        lengths_r[row] = offset
    merged = Rollouts(response_tokens_rt=tokens_rt, response_logprobs_rt=logprobs_rt,
                      response_scaled_logprobs_rt=scaled_rt, response_lengths_r=lengths_r, finish_reasons=reasons,
                      prompt_index_r=first.prompt_index_r.clone(), policy_version=first.policy_version,
                      pad_token_id=first.pad_token_id)
    return merged, versions_rt


def started_state(started: StartedBatch | None) -> dict[str, Any] | None:
    """A started batch as a checkpoint state tree (its prompts are re-read from the loader on resume)."""
    if started is None:
        return None
    rollouts = {field.name: getattr(started.rollouts, field.name) for field in dataclasses.fields(Rollouts)}
    rollouts["finish_reasons"] = [reason.value for reason in started.rollouts.finish_reasons]
    return {"loader_state": started.loader_state, "index": started.index, "rollouts": rollouts}


def restore_started(state: dict[str, Any] | None, loader: PromptLoader) -> StartedBatch | None:
    """The started batch of a checkpoint; the loader reads its prompts again and ends where it was saved."""
    if state is None:
        return None
    saved = loader.state_dict()
    loader.load_state_dict(state["loader_state"])
    prompts = loader.next_step()
    assert loader.state_dict() == saved, "the started batch's prompts are the last the loader gave"
    rollouts = Rollouts(**(state["rollouts"] | {"finish_reasons": [FinishReason(reason) for reason in
                                                                  state["rollouts"]["finish_reasons"]]}))
    return StartedBatch(prompts, state["loader_state"], state["index"], rollouts)
