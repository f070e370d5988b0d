"""Shared helpers for turning raw generated tokens into `Rollouts` fields (stop handling, padding)."""

from __future__ import annotations

import torch

from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason


def stop_token_set(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens that end a sequence: the request's stop tokens plus EOS unless `ignore_eos`."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    return tuple(sorted(stops))


def truncate_at_stop(tokens_rt: torch.Tensor, stops: tuple[int, ...]) -> tuple[torch.Tensor, list[FinishReason]]:
    """Length of each row up to and including its first stop token, and why it ended."""
    width = tokens_rt.shape[1]
    if not stops or width == 0:
        return torch.full((tokens_rt.shape[0],), width, dtype=torch.long), [FinishReason.LENGTH] * tokens_rt.shape[0]
    is_stop_rt = torch.isin(tokens_rt, torch.tensor(stops, dtype=tokens_rt.dtype))
    has_stop_r = is_stop_rt.any(dim=1)
    first_stop_r = torch.where(has_stop_r, is_stop_rt.int().argmax(dim=1) + 1, torch.full_like(has_stop_r, width,
                                                                                             dtype=torch.long))
    reasons = [FinishReason.STOP if hit else FinishReason.LENGTH for hit in has_stop_r.tolist()]
    return first_stop_r.long(), reasons
