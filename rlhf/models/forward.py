"""Forward helpers the RL roles need: token logprobs and entropy straight from vocab-parallel logits (the
full vocab is never gathered), values, and forward(-backward) over megatron's pipeline schedules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from rlhf import platform
from rlhf.errors import ConfigError
from rlhf.models.packing import PackedMicroBatch
from rlhf.platform.compat import megatron as megatron_compat
from rlhf.platform.packed_attention import packed_seq_params

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict]]
# (output_sx, labels_s, wanted_s) -> per-token outputs [s, k] (any leading dims): the model output reduced to
# what the loss reads, token by token, so that at cp > 1 only those few numbers cross the cp ranks. `labels_s` is
# the next token, or `[s, 1 + K]` when a (padded) micro-batch has `extra_labels_bsk` (K more ids to score per
# position: distillation's teacher top-K)
TokenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _ShiftedLogits:
    """Local logits shard minus the global row max, padded-vocab columns at -inf, and the global exp-sum."""

    shifted_bsv: torch.Tensor
    sum_exp_bs: torch.Tensor
    vocab_start: int


def _shift(logits_bsv: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int,
           temperature: float) -> _ShiftedLogits:
    local_vocab = logits_bsv.shape[-1]
    vocab_start = tp_group.rank() * local_vocab
    logits_bsv = logits_bsv.float() / temperature
    if vocab_start + local_vocab > vocab_size:  # padding columns never take part in a softmax
        is_pad = torch.arange(vocab_start, vocab_start + local_vocab, device=logits_bsv.device) >= vocab_size
        logits_bsv = logits_bsv.masked_fill(is_pad, float("-inf"))
    row_max = logits_bsv.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits_bsv - row_max
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1), group=tp_group)
    return _ShiftedLogits(shifted_bsv=shifted, sum_exp_bs=sum_exp, vocab_start=vocab_start)


def token_logprobs(logits_bsv: torch.Tensor, tokens_bs: torch.Tensor, tp_group: dist.ProcessGroup,
                   vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token] per position from this rank's vocab shard; differentiable.

    `tokens_bs[:, t]` is scored against `logits_bsv[:, t]`: pass the next tokens (labels), not the inputs.
    Returns [b, s] fp32.
    """
    shifted = _shift(logits_bsv, tp_group, vocab_size, temperature)
    local = tokens_bs - shifted.vocab_start
    owned = (local >= 0) & (local < logits_bsv.shape[-1])
    picked = shifted.shifted_bsv.gather(-1, local.clamp(0, logits_bsv.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target = reduce_from_tensor_model_parallel_region(picked * owned, group=tp_group)
    return target - shifted.sum_exp_bs.log()


def token_entropy(logits_bsv: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int,
                  temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position from this rank's vocab shard; [b, s] fp32."""
    shifted = _shift(logits_bsv, tp_group, vocab_size, temperature)
    finite = shifted.shifted_bsv.masked_fill(shifted.shifted_bsv.isinf(), 0.0)
    weighted = reduce_from_tensor_model_parallel_region((shifted.shifted_bsv.exp() * finite).sum(-1),
                                                        group=tp_group)
    return shifted.sum_exp_bs.log() - weighted / shifted.sum_exp_bs


def padded_inputs(valid_bs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids_bs, attention_mask_b1ss) for a batch with padding anywhere (`valid_bs` True on tokens).

    Positions count valid tokens only; the mask (True = blocked) is causal and hides padded keys, so each
    sequence sees exactly what it would see unpadded. Fully padded rows attend to themselves only.
    """
    positions_bs = (valid_bs.long().cumsum(dim=1) - 1).clamp(min=0)
    seq = valid_bs.shape[1]
    causal_ss = torch.ones(seq, seq, dtype=torch.bool, device=valid_bs.device).tril()
    allowed_bss = causal_ss.unsqueeze(0) & valid_bs.unsqueeze(1)
    allowed_bss |= torch.eye(seq, dtype=torch.bool, device=valid_bs.device).unsqueeze(0)
    return positions_bs, ~allowed_bss.unsqueeze(1)


def _masks_padding(model: Any, micro_batch: Any) -> bool:
    """MoE routers leave padding out of their losses when the micro-batch says where it is (`padding_mask_bs`,
    True on padding)."""
    return bool(model.config.num_moe_experts) and getattr(micro_batch, "padding_mask_bs", None) is not None


def routed_tokens(micro_batch: Any) -> int:
    """Tokens of `micro_batch` that the MoE router losses count: all but its padding."""
    padding = getattr(micro_batch, "padding_mask_bs", None)
    return micro_batch.tokens_bs.numel() if padding is None else int((~padding).sum())


def _wanted_bs(micro_batch: Any) -> torch.Tensor:
    """True at the positions of a padded micro-batch predicting a real response token."""
    rows_n, positions_n = micro_batch.response_index()
    wanted = torch.zeros_like(micro_batch.tokens_bs, dtype=torch.bool)
    wanted[rows_n, positions_n] = True
    return wanted


def _forward_step(loss_fn: LossFn, num_micro_batches: int, pg_collection: Any, token_fn: TokenFn | None,
                  autocast_dtype: Any, data_iterator: Any, model: Any) -> tuple:
    micro_batch = next(data_iterator)
    tokens_bs = micro_batch.tokens_bs
    positions_bs = getattr(micro_batch, "position_ids_bs", None)
    if positions_bs is None:
        positions_bs = torch.arange(tokens_bs.shape[1], device=tokens_bs.device).expand_as(tokens_bs)
    inputs = {"padding_mask": micro_batch.padding_mask_bs} if _masks_padding(model, micro_batch) else {}
    packed = isinstance(micro_batch, PackedMicroBatch)
    if packed:  # THD: attention and RoPE restart at every cu_seqlens boundary
        inputs["packed_seq_params"] = packed_seq_params(micro_batch.cu_seqlens_n, micro_batch.max_seqlen,
                                                         pg_collection.cp)
    replay = getattr(getattr(model, "module", model), "rlhf_routing_replay", None)
    if replay is not None:  # routing replay (rlhf.models.routing_replay): this micro-batch's experts
        replay.begin(micro_batch)
    with platform.autocast(autocast_dtype):  # the model only: loss_fn (and the fused head) stay in fp32
        output = model(tokens_bs, positions_bs, attention_mask=getattr(micro_batch, "attention_mask_b1ss", None),
                       **inputs)
    if autocast_dtype is not None and output.dtype == autocast_dtype:
        output = output.float()

    def loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if packed:  # the loss reads the rows as a padded forward gives them
            if token_fn is not None:  # per-token outputs on this cp rank's tokens, then the whole pack's
                output_tensor = micro_batch.gather_cp(
                    token_fn(output_tensor, micro_batch.labels_bs, micro_batch.wanted_bs), pg_collection.cp)
            assert micro_batch.local_index_l is None or token_fn is not None, "cp needs a token_fn"
            value, metrics = loss_fn(micro_batch.unpack(output_tensor), micro_batch.rows)
        else:
            if token_fn is not None:
                labels_bs = torch.roll(tokens_bs, shifts=-1, dims=1)
                extra_bsk = getattr(micro_batch, "extra_labels_bsk", None)
                if extra_bsk is not None:
                    labels_bs = torch.cat([labels_bs[..., None], extra_bsk], dim=-1)
                output_tensor = token_fn(output_tensor, labels_bs, _wanted_bs(micro_batch))
            value, metrics = loss_fn(output_tensor, micro_batch)
        # megatron divides each micro-batch loss by the micro-batch count and multiplies it by cp (its losses
        # are local-token means); undo both: loss_fn decides scaling, and every cp rank computes the whole loss
        return value * num_micro_batches / pg_collection.cp.size(), metrics

    return output, loss


def forward_backward(model: Any, micro_batches: list, loss_fn: LossFn, pg_collection: Any, *,
                     forward_only: bool = False, token_fn: TokenFn | None = None,
                     autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """Run `micro_batches` through megatron's schedule (1F1B when pp > 1); returns loss_fn's metrics dicts.

    Each micro-batch has `tokens_bs` and optionally `position_ids_bs` and `attention_mask_b1ss` (True =
    blocked; see `padded_inputs`; default: plain causal), or is a `PackedMicroBatch` (its rows reach loss_fn
    with the output unpacked to their layout); with pp > 1 all share one shape (at cp > 1 the local shard's: the
    p2p tensors are `[T / cp, b, h]`). `forward_only` runs without grad. `loss_fn(output, micro_batch) -> (loss,
    metrics)` runs on the last stage, `output` being this rank's vocab shard of the logits [b, s, v/tp] (or values
    [b, s, 1]); gradients accumulate into `.grad` (or `.main_grad` under megatron DDP) with `loss` taken as-is.
    Other stages get an empty list. With `token_fn`, `loss_fn` reads `token_fn(output, labels, wanted)`
    `[b, s, k]` instead of the output (required at cp > 1, where it runs on this cp rank's tokens and is gathered
    over `pg_collection.cp`). `autocast_dtype` runs the model's forward (and so its matmuls' backward) under
    autocast to that dtype.
    """
    megatron_compat.apply()
    pp = pg_collection.pp.size()
    shapes = {tuple(mb.tokens_bs.shape) for mb in micro_batches}
    if pp > 1 and len(shapes) != 1:
        raise ConfigError(f"micro-batches must share one [batch, seq] shape for the pipeline, got {sorted(shapes)}")
    batch_size, seq_length = max(shapes)  # without a pipeline, shapes may differ (nothing is preallocated)
    # megatron's p2p shapes are [seq_length / cp, b, h]: at cp > 1 `tokens_bs` is already this cp rank's shard
    seq_length *= pg_collection.cp.size()
    schedule = get_forward_backward_func(pp_size=pp, vp_size=None)
    p2p = P2PCommunicator(pp_group=pg_collection.pp, config=model.config) if pp > 1 else None
    extra = {"p2p_communicator": p2p} if p2p is not None else {}
    # autocast casts each weight once for all micro-batches (the weights change only after this call)
    with torch.no_grad() if forward_only else contextlib.nullcontext(), platform.autocast_weight_cache(autocast_dtype):
        return schedule(forward_step_func=partial(_forward_step, loss_fn, len(micro_batches), pg_collection,
                                                  token_fn, autocast_dtype),
                        data_iterator=iter(micro_batches), model=[model], num_microbatches=len(micro_batches),
                        seq_length=seq_length, micro_batch_size=batch_size, forward_only=forward_only,
                        pg_collection=pg_collection, **extra)
