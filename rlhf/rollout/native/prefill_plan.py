"""How one admission's prompts are prefilled: packed forwards, each with its attention in padded groups.

A prefill forward runs its embedding, norms, linear layers and MLPs on the prompts' tokens packed end to end
(`[T, hidden]`: no padding rows, and the weights stream once for all of them); only attention (RoPE, the
KV-cache write, causal SDPA) needs prompts padded to a common length. So a forward packs prompts up to
`max_tokens` (its activation memory; a longer prompt gets a forward of its own), and its attention runs in
groups of similar lengths. A group costs, in token-equivalents, `overhead + prompts x longest`: one group pads
short prompts to the longest, one per length pays the per-call overhead every time; sorting by length and cutting
where lengths change, the cheapest split is found exactly by dynamic programming (`plan_groups`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# Fixed cost of one attention group per layer (about ten small ops: scatter, q/k norms, RoPE, cache write, SDPA,
# gather) against a padded token's share of them. On the rollout bench prompts (32 x 16-32 tokens; SmolLM2-135M
# fp32 and bf16, the tiny model) one group was fastest or tied (overheads 4 / 32 / 128 / 1e9 swept; a group per
# few lengths 3-30% slower); 256 keeps those prompts one group while 32 prompts of 16-1024 tokens pad ~5%.
ATTENTION_GROUP_OVERHEAD_TOKENS = 256.0


@dataclass(frozen=True)
class AttentionGroup:
    """Prompts `first..stop-1` of a forward (its tokens `start..end-1` in packed order), padded to `width`.

    `pad_rows` maps the group's packed tokens to rows of its `[prompts x width]` padded layout; None when no
    prompt is shorter than `width` (the layouts coincide)."""

    first: int
    stop: int
    start: int
    end: int
    width: int
    slots_p: torch.Tensor  # KV-cache slot of each of its prompts
    cache_rows: slice | torch.Tensor  # the same slots as a slice when consecutive (a view, not an index, writes)
    pad_rows: torch.Tensor | None

    @property
    def num_prompts(self) -> int:
        return self.stop - self.first

    def padded(self, packed_t: torch.Tensor) -> torch.Tensor:
        """The group's rows of `packed_t` [T, ...] -> [prompts, width, ...], zeros in the padding."""
        rows = packed_t[self.start:self.end]
        shape = (self.num_prompts, self.width, *rows.shape[1:])
        if self.pad_rows is None:
            return rows.view(shape)
        out = rows.new_zeros(self.num_prompts * self.width, *rows.shape[1:])
        return out.index_copy_(0, self.pad_rows, rows).view(shape)

    def packed(self, padded: torch.Tensor) -> torch.Tensor:
        """[prompts, width, ...] -> the group's real tokens [end - start, ...] in packed order."""
        flat = padded.reshape(self.num_prompts * self.width, *padded.shape[2:])
        return flat if self.pad_rows is None else flat.index_select(0, self.pad_rows)


@dataclass(frozen=True)
class PackedForward:
    """One prefill forward: `prompts` (the caller's indices, shortest first) packed into `tokens_t`."""

    prompts: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens_t: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    last_rows: torch.Tensor  # packed row of each prompt's last token

    @property
    def num_tokens(self) -> int:
        return self.tokens_t.shape[0]


def plan_prefill(tokens_pt: torch.Tensor, lengths: list[int], slots: list[int], max_tokens: int,
                 overhead: float | None = None) -> list[PackedForward]:
    """Prompts `tokens_pt` [P, W] (left-aligned: prompt p is `tokens_pt[p, :lengths[p]]`) going to cache slots
    `slots` -> packed forwards of at most `max_tokens` tokens each (a longer prompt alone), prompts by length;
    attention groups at `overhead` (None: `ATTENTION_GROUP_OVERHEAD_TOKENS`)."""
    overhead = ATTENTION_GROUP_OVERHEAD_TOKENS if overhead is None else overhead
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    forwards, current, total = [], [], 0
    for prompt in order:
        if current and total + lengths[prompt] > max_tokens:
            forwards.append(current)
            current, total = [], 0
        current.append(prompt)
        total += lengths[prompt]
    if current:
        forwards.append(current)
    return [_packed(tokens_pt, prompts, [lengths[p] for p in prompts], [slots[p] for p in prompts], overhead)
            for prompts in forwards]


def _packed(tokens_pt: torch.Tensor, prompts: list[int], lengths: list[int], slots: list[int],
            overhead: float) -> PackedForward:
    device = tokens_pt.device
    lengths_p = torch.tensor(lengths, device=device)
    columns = torch.arange(max(lengths), device=device)
    valid_pt = columns[None, :] < lengths_p[:, None]
    tokens_t = tokens_pt[torch.tensor(prompts, device=device), :len(columns)][valid_pt]
    ends = list(itertools.accumulate(lengths))
    groups = []
    for group in plan_groups(lengths, overhead):
        first, stop = group[0], group[-1] + 1
        assert group == list(range(first, stop)), "plan_groups keeps sorted prompts contiguous"
        width = lengths[stop - 1]
        start, end = ends[first - 1] if first else 0, ends[stop - 1]
        pad_rows = None
        if end - start != (stop - first) * width:
            pad_rows = (torch.arange(width, device=device)[None, :] < lengths_p[first:stop, None]).flatten()
            pad_rows = pad_rows.nonzero().squeeze(-1)
        slots_p = torch.tensor(slots[first:stop], device=device)
        consecutive = slots[first:stop] == list(range(slots[first], slots[first] + stop - first))
        groups.append(AttentionGroup(first=first, stop=stop, start=start, end=end, width=width, slots_p=slots_p,
                                     cache_rows=slice(slots[first], slots[stop - 1] + 1) if consecutive else slots_p,
                                     pad_rows=pad_rows))
    return PackedForward(prompts=tuple(prompts), lengths=tuple(lengths), tokens_t=tokens_t, groups=tuple(groups),
                         last_rows=torch.tensor(ends, device=device) - 1)


def plan_groups(lengths: list[int], overhead: float) -> list[list[int]]:
    """Indices of `lengths` grouped (each group's prompts sorted by length) at minimal `overhead + n x longest`."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if not order:
        return []
    # Candidate cut points: after the last prompt of each distinct length.
    ends = [i + 1 for i in range(len(order)) if i + 1 == len(order) or lengths[order[i]] != lengths[order[i + 1]]]
    best = [0.0] + [float("inf")] * len(ends)
    cut_from = [0] * (len(ends) + 1)
    for j, end in enumerate(ends, start=1):
        longest = lengths[order[end - 1]]
        for i in range(j):
            start = ends[i - 1] if i else 0
            cost = best[i] + overhead + (end - start) * longest
            if cost < best[j]:
                best[j], cut_from[j] = cost, i
    groups, j = [], len(ends)
    while j:
        i = cut_from[j]
        groups.append(order[ends[i - 1] if i else 0:ends[j - 1]])
        j = i
    return groups[::-1]
