"""Choose the next token from full-vocabulary logits and report its raw and temperature-scaled logprobs.

Filters apply in the order `transformers` and vLLM use: temperature, then top-k, then top-p. A draw is an
inverse-CDF lookup (one uniform number per row: far cheaper on CPU than `multinomial` or an exponential
race over the vocabulary), driven by an explicit generator so every TP rank of a replica, holding identical
logits and an identically seeded generator, picks the same token. Over a large vocabulary the lookup is
two-level (block sums, then one block's CDF), which avoids a sequential cumsum over every token. On CPU with fp32
logits the kernel library draws (`rlhf.platform.sampling`): the same rule in one C pass per row, the probabilities
never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf.platform.sampling import draw_kernel
from rlhf.rollout.sampling_params import SamplingParams

BLOCK = 256  # tokens per block of the two-level draw
TWO_LEVEL_MIN_VOCAB = 8 * BLOCK
# top-p looks among this many most likely tokens per row first, then this many, then sorts the row
NUCLEUS_CANDIDATES = (256, 2048)


@dataclass(frozen=True)
class Sampled:
    tokens_k: torch.Tensor
    logprobs_k: torch.Tensor  # log_softmax(logits)[token]
    scaled_logprobs_k: torch.Tensor  # log_softmax(logits / temperature)[token]


def sample(logits_kv: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Sampled:
    if params.greedy:
        tokens_k = logits_kv.argmax(dim=-1)
        logprobs_k = torch.log_softmax(logits_kv, dim=-1).gather(-1, tokens_k[:, None]).squeeze(-1)
        return Sampled(tokens_k, logprobs_k, logprobs_k)
    unfiltered = params.top_k == -1 and params.top_p == 1.0
    kernel = draw_kernel(logits_kv)
    if kernel is not None and unfiltered:  # the draw and both logprobs in one C pass per row
        return Sampled(*kernel.draw(logits_kv.contiguous(), 1.0 / params.temperature, _uniform(logits_kv, generator)))
    if unfiltered and params.temperature == 1.0:
        # The draw's distribution is the raw one, so every drawn token has probability > 0 and its log is
        # the raw logprob: one softmax pass serves both.
        probs_kv = torch.softmax(logits_kv, dim=-1)
        tokens_k1 = _inverse_cdf(probs_kv, generator)
        logprobs_k = probs_kv.gather(-1, tokens_k1).log_().view(-1)
        return Sampled(tokens_k1.view(-1), logprobs_k, logprobs_k)
    scaled_kv = logits_kv / params.temperature if params.temperature != 1.0 else logits_kv
    filtered_kv = scaled_kv if unfiltered else _top_p(_top_k(scaled_kv, params.top_k), params.top_p)
    if kernel is not None:  # filtered: the kernel draws from the filtered logits (-inf: never drawn)
        tokens_k1 = kernel.draw(filtered_kv.contiguous(), 1.0, _uniform(logits_kv, generator))[0][:, None]
        probs_kv = None
    else:
        probs_kv = torch.softmax(filtered_kv, dim=-1)
        tokens_k1 = _inverse_cdf(probs_kv, generator)
    logprobs_k = torch.log_softmax(logits_kv, dim=-1).gather(-1, tokens_k1).view(-1)
    if params.temperature == 1.0:
        scaled_lp_k = logprobs_k
    elif unfiltered:  # the draw's distribution is the scaled one: its probabilities are already at hand
        scaled_lp_k = probs_kv.gather(-1, tokens_k1).log_().view(-1)
    else:
        scaled_lp_k = torch.log_softmax(scaled_kv, dim=-1).gather(-1, tokens_k1).view(-1)
    return Sampled(tokens_k1.view(-1), logprobs_k, scaled_lp_k)


def _uniform(logits_kv: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One uniform number in [0, 1) per row, from `generator` (the draw's only randomness)."""
    return torch.rand(logits_kv.shape[0], generator=generator, device=logits_kv.device, dtype=logits_kv.dtype)


def _inverse_cdf(probs_kv: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Token i [K, 1] with cdf[i-1] <= u < cdf[i]: zero-probability (filtered) tokens are never chosen."""
    uniform_k1 = _uniform(probs_kv, generator)[:, None]
    if probs_kv.shape[-1] >= TWO_LEVEL_MIN_VOCAB:
        return _two_level_draw(probs_kv, uniform_k1)
    cdf_kv = probs_kv.cumsum(dim=-1)
    return torch.searchsorted(cdf_kv, uniform_k1 * _below(cdf_kv[:, -1:]), right=True)


def _below(total_k1: torch.Tensor) -> torch.Tensor:
    """The float just below each total: u in [0, 1) times it rounds strictly below the total, so a lookup
    never runs past the last token with probability > 0 (as `u * total` could, by rounding up)."""
    return total_k1.nextafter(total_k1.new_zeros(()))


def _two_level_draw(probs_kv: torch.Tensor, uniform_k1: torch.Tensor) -> torch.Tensor:
    """Pick a block of BLOCK tokens by its mass, then a token inside it by the remaining mass."""
    rows, vocab = probs_kv.shape
    num_blocks = -(-vocab // BLOCK)
    padded_kv = F.pad(probs_kv, (0, num_blocks * BLOCK - vocab)) if vocab % BLOCK else probs_kv
    blocks_knb = padded_kv.view(rows, num_blocks, BLOCK)
    block_cdf_kn = blocks_knb.sum(dim=-1).cumsum(dim=-1)
    target_k1 = uniform_k1 * _below(block_cdf_kn[:, -1:])
    block_k1 = torch.searchsorted(block_cdf_kn, target_k1, right=True)
    before_k1 = torch.where(block_k1 > 0, block_cdf_kn.gather(-1, (block_k1 - 1).clamp(min=0)), 0.0)
    inner_cdf_kb = blocks_knb[torch.arange(rows, device=probs_kv.device), block_k1.view(-1)].cumsum(dim=-1)
    # The block's own cumsum may end a rounding error below its sum: keep the target under it.
    inner_k1 = torch.minimum(target_k1 - before_k1, _below(inner_cdf_kb[:, -1:]))
    return block_k1 * BLOCK + torch.searchsorted(inner_cdf_kb, inner_k1, right=True)


def _top_k(logits_kv: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits_kv.shape[-1]:
        return logits_kv
    kth_k1 = torch.topk(logits_kv, top_k, dim=-1).values[:, -1:]
    return logits_kv.masked_fill(logits_kv < kth_k1, float("-inf"))


def _top_p(logits_kv: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (at least one).

    On CPU, over a large vocabulary, the set is looked for among each row's most likely `NUCLEUS_CANDIDATES`
    tokens first (a partial top-k: 6-20x cheaper than sorting 49k tokens every step); rows whose set reaches past
    them try more, then are sorted whole (accelerators sort: no host sync per step). A token is kept when the
    mass strictly above it is below `top_p`, the rule transformers' warper applies to the ascending cumulative
    sum (the two can differ only where that mass lies within float rounding of `top_p`)."""
    if top_p >= 1.0:
        return logits_kv
    return _nucleus(logits_kv, top_p, 0) if logits_kv.device.type == "cpu" else _top_p_sorted(logits_kv, top_p)


def _nucleus(logits_kv: torch.Tensor, top_p: float, level: int) -> torch.Tensor:
    """`_top_p` among the `NUCLEUS_CANDIDATES[level]` most likely tokens of each row; rows whose set keeps the
    last candidate (it may reach past them) go to the next level, after the last one to the full sort."""
    if level == len(NUCLEUS_CANDIDATES) or 2 * NUCLEUS_CANDIDATES[level] > logits_kv.shape[-1]:
        return _top_p_sorted(logits_kv, top_p)
    values_kc, index_kc = torch.topk(logits_kv, NUCLEUS_CANDIDATES[level], dim=-1)  # descending
    probs_kc = torch.exp(values_kc - torch.logsumexp(logits_kv, dim=-1, keepdim=True))
    keep_kc = probs_kc.cumsum(dim=-1) - probs_kc < top_p  # the mass strictly above each candidate
    keep_kc[:, 0] = True
    out_kv = logits_kv.new_full(logits_kv.shape, float("-inf"))
    out_kv.scatter_(-1, index_kc, values_kc.masked_fill(~keep_kc, float("-inf")))
    past_k = keep_kc[:, -1]
    if bool(past_k.any()):
        out_kv[past_k] = _nucleus(logits_kv[past_k], top_p, level + 1)
    return out_kv


def _top_p_sorted(logits_kv: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p` by sorting the whole vocabulary (transformers' TopPLogitsWarper)."""
    sorted_kv, order_kv = torch.sort(logits_kv, dim=-1, descending=False)
    cumulative_kv = torch.softmax(sorted_kv, dim=-1).cumsum(dim=-1)
    drop_sorted_kv = cumulative_kv <= 1.0 - top_p
    drop_sorted_kv[:, -1] = False
    drop_kv = drop_sorted_kv.scatter(-1, order_kv, drop_sorted_kv)
    return logits_kv.masked_fill(drop_kv, float("-inf"))
