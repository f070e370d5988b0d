"""megatron-core's own KV-cached inference forward (GPTModel + StaticInferenceContext), as evaluated for rollout.

Greedy argmax only, no sampling or stop handling, all prompts cut to the shortest length: a lower bound on
what an engine built on it would cost per step.
"""

from __future__ import annotations

import time

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from rlhf.rollout.types import PromptBatch


def time_static_decode(model: torch.nn.Module, batch: PromptBatch, new_tokens: int) -> tuple[float, float]:
    """Seconds for one prefill of the batch plus `new_tokens - 1` decode forwards, and for the prefill alone."""
    width = int(batch.prompt_lengths_b.min())
    tokens = batch.prompt_tokens_bt[:, -width:]
    context = StaticInferenceContext(tokens.shape[0], width + new_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(tokens, torch.arange(width)[None].expand_as(tokens), None, inference_context=context,
                       runtime_gather_output=True)
        prefill_s = time.perf_counter() - start
        for step in range(new_tokens - 1):
            context.sequence_len_offset += tokens.shape[1]
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            positions = torch.full_like(tokens, width + step)
            logits = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
    return time.perf_counter() - start, prefill_s
