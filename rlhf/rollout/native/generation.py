"""One `generate` call of the native engine: slot bookkeeping, prefill admission, decode steps, output rows.

Per decode step the only tensor work besides the forward and the sampler is two in-place updates and (with
stop tokens) one membership test; sampled tokens are kept per step and gathered into rows once at the end.
Slot lifetimes (start step, the deadline of the prompt's cap on new tokens) are tracked in Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from rlhf.rollout.native.forward import Decoder
from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.prefill_plan import plan_prefill
from rlhf.rollout.native.sampler import Sampled, sample
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts

@dataclass
class _Finished:
    row: int
    slot: int
    first_step: int  # decode step holding the row's 2nd token
    length: int


class Generation:
    """Rollout row r = prompt * n + sample; `slot_row[s]` is the row slot s decodes (-1 when free)."""

    def __init__(self, decoder: Decoder, cache: KVCache, prompts: PromptBatch, params: SamplingParams,
                 stops: tuple[int, ...], generator: torch.Generator, record_routing: bool = False) -> None:
        self.decoder, self.cache, self.prompts, self.params = decoder, cache, prompts, params
        # routing replay: experts per routed layer of each prompt token, and of each slot's token per decode step
        self.record_routing = record_routing
        self.prompt_routing: dict[int, torch.Tensor] = {}  # prompt -> [length, L, k]
        self.step_routing: list[torch.Tensor] = []  # decode step -> [span, L, k]
        self.generator = generator
        self.device = device = cache.device
        num_rows, self.num_slots = prompts.num_prompts * params.n, cache.num_slots
        self.first_rt = [torch.zeros(num_rows, dtype=dtype, device=device)
                         for dtype in (torch.long, torch.float32, torch.float32)]  # tokens/logprobs at step 0
        self.stops = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
        self.token_s = torch.zeros(self.num_slots, dtype=torch.long, device=device)
        self.position_s = torch.zeros(self.num_slots, dtype=torch.long, device=device)
        self.slot_row = [-1] * self.num_slots
        self.slot_first_step = [0] * self.num_slots
        self.slot_offset = [0] * self.num_slots  # a live slot's position at decode step t is offset + t
        self.slot_cap = [0] * self.num_slots  # a live slot's cap on new tokens (its prompt's)
        self.caps_p = prompts.new_token_caps(params.max_new_tokens)
        self.max_offset = 0  # over live slots: decode step t attends max_offset + t + 1 cache positions
        self.deadlines: dict[int, list[int]] = {}  # decode step -> slots reaching their cap there
        self.num_active, self.span = 0, 0  # occupied slots; 1 + the highest occupied slot
        self.steps: list[Sampled] = []
        self.finished: list[_Finished] = []
        self.reasons: list[FinishReason | None] = [None] * num_rows
        self.pending = deque(range(prompts.num_prompts))
        self.right_pt, self.lengths_p = _left_aligned(prompts, device)

    @property
    def free_slots(self) -> list[int]:
        return [slot for slot, row in enumerate(self.slot_row) if row < 0]

    def run(self, policy_version: int) -> Rollouts:
        while self.pending or self.num_active:
            if self.pending and len(self.free_slots) >= self.params.n:
                self._admit()  # may finish every admitted row at once (EOS first): loop again
            elif self.num_active:
                self._decode()
        return self._rollouts(policy_version)

    def _admit(self) -> None:
        """Prefill as many waiting prompts as there are free groups of n slots; copy each to its samples."""
        n, free = self.params.n, self.free_slots
        prompt_ids = [self.pending.popleft() for _ in range(min(len(self.pending), len(free) // n))]
        slots = free[:len(prompt_ids) * n]
        lengths = self.lengths_p[prompt_ids]
        logits_pv = self._prefill(prompt_ids, lengths, slots[::n])
        for group, length in enumerate(lengths.tolist()):
            self.cache.copy_slot(slots[group * n], slots[group * n + 1:(group + 1) * n], length)
        picked = sample(logits_pv.repeat_interleave(n, dim=0), self.params, self.generator)
        rows = [prompt * n + j for prompt in prompt_ids for j in range(n)]
        rows_k, slots_k = torch.tensor(rows, device=self.device), torch.tensor(slots, device=self.device)
        for buffer, values in zip(self.first_rt, (picked.tokens_k, picked.logprobs_k, picked.scaled_logprobs_k)):
            buffer[rows_k] = values
        self.token_s[slots_k] = picked.tokens_k
        self.position_s[slots_k] = lengths.repeat_interleave(n)
        stopped = self._stopped(picked.tokens_k)
        first_step = len(self.steps)
        self.num_active += len(slots)
        slot_lengths = [length for length in lengths.tolist() for _ in range(n)]
        for index, (slot, row) in enumerate(zip(slots, rows)):
            cap = self.caps_p[row // n]
            self.slot_row[slot], self.slot_first_step[slot], self.slot_cap[slot] = row, first_step, cap
            self.slot_offset[slot] = slot_lengths[index] - first_step
            if index in stopped or cap == 1:
                self._finish(slot, 1, index in stopped)
            else:
                self.deadlines.setdefault(first_step + cap - 2, []).append(slot)
        self._live_changed()

    def _live_changed(self) -> None:
        """After admissions or finishes: the slot span and the attended context of the live slots."""
        live = [slot for slot, row in enumerate(self.slot_row) if row >= 0]
        self.span = live[-1] + 1 if live else 0
        self.max_offset = max((self.slot_offset[slot] for slot in live), default=0)

    def _prefill(self, prompt_ids: list[int], lengths: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Prefill in packed forwards (`plan_prefill`); logits [P, V] in `prompt_ids` order."""
        parts, order = [], []
        tokens_pt = self.right_pt[prompt_ids]
        for packed in plan_prefill(tokens_pt, lengths.tolist(), slots, self.decoder.max_prefill_tokens):
            routing = [] if self.record_routing else None
            parts.append(self.decoder.prefill(packed, self.cache, routing))
            order.extend(packed.prompts)
            if routing is not None:
                routed_tlk = torch.stack(routing, dim=1).to(torch.int16).cpu()
                for prompt, rows in zip(packed.prompts, routed_tlk.split(list(packed.lengths))):
                    self.prompt_routing[prompt_ids[prompt]] = rows
        logits_pv = torch.cat(parts) if len(parts) > 1 else parts[0]
        return logits_pv[torch.tensor(order).argsort()]

    def _decode(self) -> None:
        """One token for every slot below `span` (free ones too: no compaction); finish rows that end here."""
        span, step = self.span, len(self.steps)
        context = self.max_offset + step + 1
        routing = [] if self.record_routing else None
        logits_kv = self.decoder.decode(self.token_s[:span], self.position_s[:span], context, self.cache, routing)
        if routing is not None:
            self.step_routing.append(torch.stack(routing, dim=1).to(torch.int16))
        picked = sample(logits_kv, self.params, self.generator)
        self.token_s[:span] = picked.tokens_k
        positions = self.position_s[:span].add_(1)
        if self.num_active < span:
            # Free slots below `span` are decoded too (their output is dropped); clamping keeps their position
            # inside the cache however long they stay free, while live rows never reach it (check_fits).
            positions.clamp_(max=self.cache.max_seq_len - 1)
        self.steps.append(picked)
        finished_before = len(self.finished)
        for slot in sorted(self._stopped(picked.tokens_k)):
            if self.slot_row[slot] >= 0:
                self._finish(slot, step - self.slot_first_step[slot] + 2, True)
        for slot in self.deadlines.pop(step, []):
            if self.slot_row[slot] >= 0 and self.slot_first_step[slot] + self.slot_cap[slot] - 2 == step:
                self._finish(slot, self.slot_cap[slot], False)
        if len(self.finished) != finished_before:
            self._live_changed()

    def _stopped(self, tokens_k: torch.Tensor) -> set[int]:
        if self.stops is None:
            return set()
        hits_k = torch.isin(tokens_k, self.stops)
        return set(hits_k.nonzero().squeeze(-1).tolist()) if bool(hits_k.any()) else set()

    def _finish(self, slot: int, length: int, stopped: bool) -> None:
        row = self.slot_row[slot]
        self.finished.append(_Finished(row=row, slot=slot, first_step=self.slot_first_step[slot], length=length))
        self.reasons[row] = FinishReason.STOP if stopped else FinishReason.LENGTH
        self.slot_row[slot] = -1
        self.position_s[slot] = 0  # a free slot must not widen the attention span
        self.num_active -= 1

    def _rollouts(self, policy_version: int) -> Rollouts:
        """Gather every row's tokens from the per-step records in one indexing op per field."""
        num_rows, width = len(self.reasons), self.params.max_new_tokens
        order = sorted(self.finished, key=lambda f: f.row)
        lengths_r = torch.tensor([f.length for f in order], dtype=torch.long)
        mask_rt = torch.arange(width)[None, :] < lengths_r[:, None]
        # Rollouts live on the host (the step's batch does): one device-to-host copy per field.
        outputs = [first.cpu()[:, None].expand(num_rows, width).clone() for first in self.first_rt]
        if self.steps and width > 1:
            steps_r = torch.tensor([f.first_step for f in order])[:, None] + torch.arange(width - 1)[None, :]
            steps_r = steps_r.clamp(max=len(self.steps) - 1)
            slots_r = torch.tensor([f.slot for f in order])[:, None]
            for output, field in zip(outputs, ("tokens_k", "logprobs_k", "scaled_logprobs_k")):
                records = [getattr(s, field) for s in self.steps]
                stacked = pad_sequence(records, batch_first=True).cpu()  # [steps, span]
                output[:, 1:] = stacked[steps_r, slots_r.clamp(max=stacked.shape[1] - 1)]
        tokens_rt, logprobs_rt, scaled_rt = (torch.where(mask_rt, output, 0) for output in outputs)
        n = self.params.n
        routed = self._routed_experts(order) if self.record_routing else None
        return Rollouts(response_tokens_rt=tokens_rt.masked_fill(~mask_rt, self.prompts.pad_token_id),
                        response_logprobs_rt=logprobs_rt, response_scaled_logprobs_rt=scaled_rt,
                        response_lengths_r=lengths_r, finish_reasons=list(self.reasons),
                        prompt_index_r=torch.arange(self.prompts.num_prompts).repeat_interleave(n),
                        policy_version=policy_version, pad_token_id=self.prompts.pad_token_id,
                        routed_experts_rslk=routed)

    def _routed_experts(self, order: list[_Finished]) -> torch.Tensor:
        """[R, prompt + response, L, k] int16: each row's prompt routing, then response token j's from decode
        step first_step + j (the step that fed it); -1 for the last token (never fed) and beyond."""
        n, lengths_p = self.params.n, self.lengths_p.tolist()
        width = max(lengths_p[f.row // n] + f.length for f in order)
        first = next(iter(self.prompt_routing.values()))
        routed = torch.full((len(order), width, *first.shape[1:]), -1, dtype=torch.int16)
        steps = pad_sequence(self.step_routing, batch_first=True, padding_value=-1).cpu() if self.step_routing else None
        for f in order:
            prompt_length = lengths_p[f.row // n]
            routed[f.row, :prompt_length] = self.prompt_routing[f.row // n]
            if f.length > 1:
                fed = torch.arange(f.first_step, f.first_step + f.length - 1)
                routed[f.row, prompt_length:prompt_length + f.length - 1] = steps[fed, f.slot]
        return routed


def _left_aligned(prompts: PromptBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts -> prompts starting at column 0 (positions then equal column indices)."""
    width = prompts.prompt_tokens_bt.shape[1]
    lengths_p = prompts.prompt_lengths_b.to(torch.long)
    columns_pt = (torch.arange(width)[None, :] + (width - lengths_p)[:, None]).clamp(max=width - 1)
    shifted_pt = prompts.prompt_tokens_bt.gather(1, columns_pt)
    valid_pt = torch.arange(width)[None, :] < lengths_p[:, None]
    return shifted_pt.masked_fill(~valid_pt, prompts.pad_token_id).to(device), lengths_p.to(device)
