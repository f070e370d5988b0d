"""Tiny models, batches and losses shared by the engine tests (module-level: run inside spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig

VOCAB = 96  # divisible by 2: TP1 and TP2 models have identical (unpadded) embeddings


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, rms_norm_eps=1e-5)


@dataclass
class TokenBatch:
    """Sequences, which target positions count, and the token count of the whole global batch."""

    tokens_bs: torch.Tensor
    loss_mask_bs: torch.Tensor
    num_global_tokens: int
    poison: bool = False


def global_batch(num_seqs: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_seqs, seq_len), generator=generator)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (num_seqs,), generator=generator)
    mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return tokens, mask


def split(tokens: torch.Tensor, mask: torch.Tensor, num_micro_batches: int, poison: bool = False) -> list:
    """Micro-batches of the given rows; the target count is over the rows given (callers pass global rows)."""
    count = int(mask[:, 1:].sum())
    return [TokenBatch(tokens_bs=t, loss_mask_bs=m, num_global_tokens=count, poison=poison)
            for t, m in zip(tokens.chunk(num_micro_batches), mask.chunk(num_micro_batches))]


def shard_rows(batches: list, dp_rank: int, dp: int) -> list:
    """This DP rank's rows of each micro-batch, keeping the global token count."""
    return [TokenBatch(tokens_bs=b.tokens_bs.chunk(dp)[dp_rank], loss_mask_bs=b.loss_mask_bs.chunk(dp)[dp_rank],
                       num_global_tokens=b.num_global_tokens, poison=b.poison) for b in batches]


def make_nll_loss(tp_group):
    """Token-sum NLL over masked targets divided by the GLOBAL target count (the RL loss normalisation)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    def loss_fn(logits_bsv: torch.Tensor, batch: TokenBatch):
        full_bsv = gather_from_tensor_model_parallel_region(logits_bsv, group=tp_group)
        logprobs = torch.log_softmax(full_bsv[:, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, batch.tokens_bs[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(picked * batch.loss_mask_bs[:, 1:]).sum() / batch.num_global_tokens
        if batch.poison:
            loss = loss * float("nan")
        return loss, {"nll_sum": loss.detach()}

    return loss_fn


_COLUMN = ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def shard_state(full: dict, tp: int, tp_rank: int) -> dict:
    """A TP1 megatron GPT state dict cut into this tp rank's shard (gate/up of fc1 split separately)."""
    out = {}
    for name, tensor in full.items():
        if name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
        elif name.endswith(_COLUMN):
            out[name] = tensor.chunk(tp, dim=0)[tp_rank]
        elif name.endswith(_ROW):
            out[name] = tensor.chunk(tp, dim=1)[tp_rank]
        else:
            out[name] = tensor
    return out
