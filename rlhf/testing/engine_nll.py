"""Answer-token NLL on a bare `TrainEngine`: the loss the engine tests and `bench-engine` compare with transformers.

Not a training path (`rlhf sft` runs `rlhf.orchestration.sft` through the actor role). The loss is the token-mean NLL
over the answer tokens of the GLOBAL batch, computed as a token sum divided by the global answer-token count, so
it is exact for any DP size and micro-batching (see `rlhf.train.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from rlhf.errors import ConfigError
from rlhf.models.forward import token_logprobs
from rlhf.train.engine import StepResult, TrainEngine


@dataclass
class SftMicroBatch:
    """Right-padded prompt+answer rows; `answer_mask_bs` is 1 on the answer tokens the loss predicts."""

    tokens_bs: torch.Tensor
    answer_mask_bs: torch.Tensor
    num_global_answer_tokens: int


def sft_micro_batches(tokens_bs: torch.Tensor, answer_mask_bs: torch.Tensor, *, dp_rank: int, dp_size: int,
                      num_micro_batches: int) -> list[SftMicroBatch]:
    """This DP rank's contiguous rows of the GLOBAL batch, split into micro-batches carrying the global count."""
    num_rows = tokens_bs.shape[0]
    if num_rows % (dp_size * num_micro_batches):
        raise ConfigError(f"global batch of {num_rows} rows does not split into dp={dp_size} x "
                          f"{num_micro_batches} micro-batches; make the batch size a multiple of "
                          f"{dp_size * num_micro_batches}")
    count = int(answer_mask_bs[:, 1:].sum())  # position 0 is never predicted
    if count == 0:
        raise ConfigError("the SFT batch has no answer tokens after the first position; check answer_mask_bs")
    rows = slice(dp_rank * num_rows // dp_size, (dp_rank + 1) * num_rows // dp_size)
    return [SftMicroBatch(tokens_bs=tokens, answer_mask_bs=mask, num_global_answer_tokens=count)
            for tokens, mask in zip(tokens_bs[rows].chunk(num_micro_batches),
                                    answer_mask_bs[rows].chunk(num_micro_batches))]


def sft_loss(tp_group: dist.ProcessGroup, vocab_size: int) -> Callable:
    """loss_fn for `TrainEngine.train_step`: -sum(log p(answer token | prefix)) / global answer-token count."""

    def loss_fn(logits_bsv: torch.Tensor, batch: SftMicroBatch) -> tuple[torch.Tensor, dict]:
        next_tokens_bs = torch.roll(batch.tokens_bs, shifts=-1, dims=1)
        weights_bs = torch.roll(batch.answer_mask_bs, shifts=-1, dims=1).float()
        weights_bs[:, -1] = 0.0  # the last position predicts nothing
        logprobs_bs = token_logprobs(logits_bsv, next_tokens_bs, tp_group, vocab_size)
        nll_sum = -(logprobs_bs * weights_bs).sum()
        return nll_sum / batch.num_global_answer_tokens, {"sft/nll_sum": nll_sum.detach(),
                                                          "sft/num_tokens": weights_bs.sum()}

    return loss_fn


def sft_fused_loss(model: torch.nn.Module, tp_group: dist.ProcessGroup, vocab_size: int) -> Callable:
    """`sft_loss` through the fused LM head (`rlhf.models.lm_head`, the actor's path) on the answer tokens only;
    the model must hand back hidden states (`hidden_output`)."""
    from rlhf.models.lm_head import LMHead, head_logprobs

    def loss_fn(hidden_bsh: torch.Tensor, batch: SftMicroBatch) -> tuple[torch.Tensor, dict]:
        predicts_bs = torch.roll(batch.answer_mask_bs, shifts=-1, dims=1).bool()
        predicts_bs[:, -1] = False
        rows_n, positions_n = predicts_bs.nonzero(as_tuple=True)
        labels_n = batch.tokens_bs[rows_n, positions_n + 1]
        logprobs_n, _ = head_logprobs(hidden_bsh[rows_n, positions_n], labels_n, LMHead.of(model, tp_group, vocab_size))
        nll_sum = -logprobs_n.sum()
        return nll_sum / batch.num_global_answer_tokens, {"sft/nll_sum": nll_sum.detach(),
                                                          "sft/num_tokens": float(len(labels_n))}

    return loss_fn


def sft_step(engine: TrainEngine, micro_batches: list[SftMicroBatch], *, fused_head: bool = False) -> StepResult:
    """One optimizer step of SFT; `StepResult.loss` is the global batch's token-mean answer NLL. `fused_head`:
    through the fused LM head on the answer tokens (the actor's path) instead of the full logits."""
    vocab_size = engine.module.rlhf_spec.vocab_size
    if not fused_head:
        return engine.train_step(micro_batches, sft_loss(engine.pg_collection.tp, vocab_size))
    from rlhf.models.lm_head import hidden_output

    with hidden_output(engine.module):
        return engine.train_step(micro_batches, sft_fused_loss(engine.module, engine.pg_collection.tp, vocab_size))
