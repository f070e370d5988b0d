"""Batches, losses and engines shared by the engine tests (module-level: they run inside spawned ranks)."""

from __future__ import annotations

import torch

from tests.models.tiny import VOCAB, llama_config, save_hf_model


def save_tiny_llama(path: str) -> str:
    """A seeded tiny Llama (GQA, untied, vocab 101 so TP pads it) saved as an HF folder."""
    save_hf_model(llama_config(), path, seed=0)
    return path


def sft_batch(num_rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of prompt (3-5 tokens) + answer + right padding, and the answer mask."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_rows, seq_len), generator=generator)
    prompt = torch.randint(3, 6, (num_rows, 1), generator=generator)
    end = torch.randint(seq_len // 2, seq_len + 1, (num_rows, 1), generator=generator)
    position = torch.arange(seq_len).unsqueeze(0)
    return tokens, ((position >= prompt) & (position < end)).long()


def poisoned(loss_fn):
    """The same loss, times NaN: a step whose loss is not finite."""
    def loss(output, batch):
        value, metrics = loss_fn(output, batch)
        return value * float("nan"), metrics
    return loss


def nan_grads(loss_fn):
    """The same (finite) loss value, but NaN gradients: d sqrt(u)/du is inf at u = 0, times du/dlogits = 0."""
    def loss(output, batch):
        value, metrics = loss_fn(output, batch)
        return value + (output * 0).sum().sqrt(), metrics
    return loss


def hf_sft_loss(path: str, tokens: torch.Tensor, answer_mask: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The same answer-token mean NLL computed by transformers, and its per-position next-token logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens).logits.float(), dim=-1)[:, :-1]
    picked = logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    weights = answer_mask[:, 1:].float()
    return float(-(picked * weights).sum() / weights.sum()), picked
