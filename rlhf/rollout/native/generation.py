"""One `generate` call of the native engine: slot bookkeeping, prefill admission, decode steps, output rows."""

from __future__ import annotations

from collections import deque

import torch

from rlhf.rollout.native.forward import Decoder
from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.sampler import sample
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts


class Generation:
    """Rollout row r = prompt * n + sample; slot s holds row `row_s[s]` (-1 when free)."""

    def __init__(self, decoder: Decoder, cache: KVCache, prompts: PromptBatch, params: SamplingParams,
                 stops: tuple[int, ...], generator: torch.Generator) -> None:
        self.decoder, self.cache, self.prompts, self.params = decoder, cache, prompts, params
        self.generator = generator
        device = cache.device
        num_rows, width = prompts.num_prompts * params.n, params.max_new_tokens
        self.tokens_rt = torch.full((num_rows, width), prompts.pad_token_id, dtype=torch.long, device=device)
        self.logprobs_rt = torch.zeros((num_rows, width), dtype=torch.float32, device=device)
        self.scaled_logprobs_rt = torch.zeros_like(self.logprobs_rt)
        self.lengths_r = torch.zeros(num_rows, dtype=torch.long)
        self.reasons: list[FinishReason | None] = [None] * num_rows
        self.stops = torch.tensor(stops, dtype=torch.long, device=device)
        num_slots = cache.num_slots
        self.row_s = torch.full((num_slots,), -1, dtype=torch.long, device=device)
        self.token_s = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.position_s = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.generated_s = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.free = list(range(num_slots))
        self.num_active = 0
        self.pending = deque(range(prompts.num_prompts))
        self.right_pt, self.lengths_p = _right_aligned_to_left(prompts, device)

    def run(self, policy_version: int) -> Rollouts:
        while self.pending or self.num_active:
            if self.pending and len(self.free) >= self.params.n:
                self._admit()
            if self.num_active:
                self._decode()
        n = self.params.n
        return Rollouts(response_tokens_rt=self.tokens_rt, response_logprobs_rt=self.logprobs_rt,
                        response_scaled_logprobs_rt=self.scaled_logprobs_rt, response_lengths_r=self.lengths_r,
                        finish_reasons=list(self.reasons),
                        prompt_index_r=torch.arange(self.prompts.num_prompts).repeat_interleave(n),
                        policy_version=policy_version, pad_token_id=self.prompts.pad_token_id)

    def _admit(self) -> None:
        """Prefill as many waiting prompts as there are free groups of n slots; copy each to its samples."""
        n = self.params.n
        count = min(len(self.pending), len(self.free) // n)
        prompt_ids = [self.pending.popleft() for _ in range(count)]
        self.free.sort()
        slots, self.free = self.free[:count * n], self.free[count * n:]
        lengths = self.lengths_p[prompt_ids]
        tokens = self.right_pt[prompt_ids, :int(lengths.max())]
        logits_pv = self.decoder.prefill(tokens, lengths, torch.tensor(slots[::n]), self.cache)
        for group, length in enumerate(lengths.tolist()):
            self.cache.copy_slot(slots[group * n], slots[group * n + 1:(group + 1) * n], length)
        slots_k = torch.tensor(slots, device=self.row_s.device)
        device = self.row_s.device
        self.row_s[slots_k] = (torch.tensor(prompt_ids, device=device)[:, None] * n
                               + torch.arange(n, device=device)).flatten()
        self.position_s[slots_k] = lengths.repeat_interleave(n)
        self.generated_s[slots_k] = 0
        self.num_active += len(slots)
        self._record(slots_k, logits_pv.repeat_interleave(n, dim=0))

    def _decode(self) -> None:
        occupied = (self.row_s >= 0).nonzero().squeeze(-1)
        span = int(occupied[-1]) + 1
        logits_kv = self.decoder.decode(self.token_s[:span], self.position_s[:span], self.cache, occupied)
        self.position_s[occupied] += 1
        self._record(occupied, logits_kv)

    def _record(self, slots_k: torch.Tensor, logits_kv: torch.Tensor) -> None:
        """Sample one token per slot, write it to the slot's row, and free the slots that finished."""
        picked = sample(logits_kv, self.params, self.generator)
        rows_k, steps_k = self.row_s[slots_k], self.generated_s[slots_k]
        self.tokens_rt[rows_k, steps_k] = picked.tokens_k
        self.logprobs_rt[rows_k, steps_k] = picked.logprobs_k
        self.scaled_logprobs_rt[rows_k, steps_k] = picked.scaled_logprobs_k
        self.generated_s[slots_k] = steps_k + 1
        self.token_s[slots_k] = picked.tokens_k
        stopped_k = torch.isin(picked.tokens_k, self.stops)
        done_k = stopped_k | (steps_k + 1 >= self.params.max_new_tokens)
        if not bool(done_k.any()):
            return
        for slot, row, steps, stopped in zip(slots_k[done_k].tolist(), rows_k[done_k].tolist(),
                                             steps_k[done_k].tolist(), stopped_k[done_k].tolist()):
            self.lengths_r[row] = steps + 1
            self.reasons[row] = FinishReason.STOP if stopped else FinishReason.LENGTH
            self.free.append(slot)
        done_slots = slots_k[done_k]
        self.row_s[done_slots] = -1
        self.position_s[done_slots] = 0
        self.token_s[done_slots] = 0
        self.num_active -= len(done_slots)


def _right_aligned_to_left(prompts: PromptBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts -> prompts starting at column 0 (positions then equal column indices)."""
    width = prompts.prompt_tokens_bt.shape[1]
    lengths_p = prompts.prompt_lengths_b.to(torch.long)
    columns_pt = (torch.arange(width)[None, :] + (width - lengths_p)[:, None]).clamp(max=width - 1)
    shifted_pt = prompts.prompt_tokens_bt.gather(1, columns_pt)
    valid_pt = torch.arange(width)[None, :] < lengths_p[:, None]
    return shifted_pt.masked_fill(~valid_pt, prompts.pad_token_id).to(device), lengths_p.to(device)
