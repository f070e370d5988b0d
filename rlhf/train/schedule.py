"""Stand-in for `rlhf.models.forward.forward_backward` until the models branch commits it (same contract).

Runs micro-batches through megatron's pipeline schedule with each `loss_fn` value taken as-is: megatron
divides a 2-tuple loss by the micro-batch count, which is undone here so the caller owns all scaling.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from rlhf.errors import ConfigError
from rlhf.platform import megatron_compat

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict]]


def _forward_step(loss_fn: LossFn, num_micro_batches: int, data_iterator: Any, model: Any) -> tuple:
    micro_batch = next(data_iterator)
    tokens_bs = micro_batch.tokens_bs
    positions_bs = getattr(micro_batch, "position_ids_bs", None)
    if positions_bs is None:
        positions_bs = torch.arange(tokens_bs.shape[1], device=tokens_bs.device).expand_as(tokens_bs)
    output = model(tokens_bs, positions_bs, attention_mask=None)

    def loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
        value, metrics = loss_fn(output_tensor, micro_batch)
        return value * num_micro_batches, metrics

    return output, loss


def forward_backward(model: Any, micro_batches: list, loss_fn: LossFn, pg_collection: Any, *,
                     forward_only: bool = False) -> list[dict]:
    """Run `micro_batches` (each with `tokens_bs`, one shared shape) through the schedule; last stage's metrics."""
    megatron_compat.apply()
    shapes = {tuple(mb.tokens_bs.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ConfigError(f"micro-batches must share one [batch, seq] shape for the pipeline, got {sorted(shapes)}")
    batch_size, seq_length = shapes.pop()
    pp = pg_collection.pp.size()
    schedule = get_forward_backward_func(pp_size=pp, vp_size=None)
    extra = {"p2p_communicator": P2PCommunicator(pp_group=pg_collection.pp, config=model.config)} if pp > 1 else {}
    return schedule(forward_step_func=partial(_forward_step, loss_fn, len(micro_batches)),
                    data_iterator=iter(micro_batches), model=[model], num_microbatches=len(micro_batches),
                    seq_length=seq_length, micro_batch_size=batch_size, forward_only=forward_only,
                    pg_collection=pg_collection, **extra)
