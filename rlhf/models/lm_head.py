"""Token logprobs and entropy straight from final hidden states: the vocab-parallel LM head runs in row chunks
inside one autograd function, so the [tokens, vocab] logits never exist whole (forward or backward).

Why: for RL the logits are only reduced to two numbers per token (logprob of the taken token, entropy), but the
plain path writes and re-reads a [tokens, vocab] fp32 tensor a dozen times (shift, exp, entropy, and each op's
backward) — on CPU that was a third of SmolLM2's update step, on GPU it is the activation-memory peak for large
vocabularies. Here each chunk's logits live in cache; the backward recomputes them (one extra head matmul)
instead of storing them. Only the rows asked for are computed (response tokens, not the prompt).

TP: `weight` is this rank's vocab shard; the three per-row partial sums are combined with small all-reduces
over `tp_group`, and the hidden states' gradient is summed over it by `copy_to_tensor_model_parallel_region`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from rlhf.platform import fused_head_bytes, gemm
from rlhf.platform.compat import megatron as megatron_compat


class GPTModelWithHiddenOutput(GPTModel):
    """megatron's GPTModel that hands back the final (normed) hidden states `[b, s, h]` instead of logits while
    `return_hidden` is set (see `hidden_output`); everything else is GPTModel's."""

    return_hidden = False

    def _postprocess(self, hidden_states: torch.Tensor, **kwargs):
        if self.return_hidden and self.post_process:
            assert self.config.mtp_num_layers is None and not self.config.sequence_parallel
            return hidden_states.transpose(0, 1)
        return super()._postprocess(hidden_states=hidden_states, **kwargs)


@contextlib.contextmanager
def hidden_output(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model` (a `GPTModelWithHiddenOutput`) returns hidden states `[b, s, h]`."""
    assert isinstance(model, GPTModelWithHiddenOutput), type(model)
    model.return_hidden = True
    try:
        yield
    finally:
        model.return_hidden = False


@dataclass(frozen=True)
class LMHead:
    """Where this rank's vocab shard of the output layer is: `weight` rows are vocab ids
    `[vocab_start, vocab_start + weight.shape[0])`, of which ids >= `vocab_size` are padding."""

    weight: torch.Tensor
    tp_group: dist.ProcessGroup
    vocab_size: int

    @classmethod
    def of(cls, model: GPTModel, tp_group: dist.ProcessGroup, vocab_size: int) -> LMHead:
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)
        return cls(weight=weight, tp_group=tp_group, vocab_size=vocab_size)

    @property
    def vocab_start(self) -> int:
        return self.tp_group.rank() * self.weight.shape[0]

    @property
    def num_valid(self) -> int:
        """Rows of the local shard that are real vocab entries (the rest is padding to a tp multiple)."""
        return max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))


def head_logprobs(hidden_nh: torch.Tensor, labels_n: torch.Tensor, head: LMHead, *, temperature: float = 1.0,
                  entropy_grad: bool = False, chunk_bytes: int = 0,
                  block_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(h W^T / temperature)[label], entropy) per row, [n] fp32 each, over the whole vocab; labels
    `[n, m]` (m ids per row, e.g. the sampled token and a teacher's top-K) give logprobs `[n, m]`.

    Differentiable in `hidden_nh` and `head.weight`; the entropy only carries a gradient with `entropy_grad`
    (entropy bonus), otherwise it is a metric. At most `chunk_bytes` of fp32 logits exist at a time: when all
    rows fit in one chunk its logits are kept for the backward, otherwise each chunk is recomputed there.
    Elementwise work runs in `block_bytes` row blocks (cache-sized on a CPU). 0 = the platform's defaults.
    """
    default_chunk, default_block = fused_head_bytes()
    row_bytes = 4 * max(1, head.num_valid)
    chunk_rows = max(1, (chunk_bytes or default_chunk) // row_bytes)
    block_rows = max(1, min(chunk_rows, (block_bytes or default_block) // row_bytes))
    hidden_nh = copy_to_tensor_model_parallel_region(hidden_nh, group=head.tp_group)
    return _FusedHeadLogprobs.apply(hidden_nh, head.weight, labels_n, head, float(temperature), entropy_grad,
                                    chunk_rows, block_rows)


@torch.no_grad()
def head_sum_pi_squared(hidden_nh: torch.Tensor, head: LMHead, *, temperature: float = 1.0,
                        chunk_bytes: int = 0) -> torch.Tensor:
    """sum_v softmax(h W^T / temperature)(v)^2 per row, fp32 [n] (the optimal token baseline's input), in row
    chunks of at most `chunk_bytes` fp32 logits; over tp from each shard's (max, sum exp, sum exp^2)."""
    num_rows, num_valid = hidden_nh.shape[0], head.num_valid
    chunk_rows = max(1, (chunk_bytes or fused_head_bytes()[0]) // (4 * max(1, num_valid)))
    stats_3n = hidden_nh.new_zeros(3, num_rows, dtype=torch.float32)
    stats_3n[0].fill_(float("-inf"))
    for chunk in _spans(0, num_rows if num_valid else 0, chunk_rows):
        logits_cv = _chunk_logits(hidden_nh[chunk], head.weight[:num_valid], temperature)
        stats_3n[0, chunk] = logits_cv.max(dim=-1).values
        exp_cv = logits_cv.sub_(stats_3n[0, chunk, None]).exp_()
        stats_3n[1, chunk] = exp_cv.sum(dim=-1)
        stats_3n[2, chunk] = exp_cv.square_().sum(dim=-1)
    global_max_n = _all_reduce(stats_3n[0].clone(), dist.ReduceOp.MAX, head.tp_group)
    scale_n = (stats_3n[0] - global_max_n).nan_to_num(neginf=0.0).exp() * (stats_3n[1] > 0)
    sums_2n = _all_reduce(torch.stack([stats_3n[1] * scale_n, stats_3n[2] * scale_n.square()]), dist.ReduceOp.SUM,
                          head.tp_group)
    return sums_2n[1] / sums_2n[0].square()


@torch.no_grad()
def head_topk(hidden_nh: torch.Tensor, head: LMHead, k: int, *, temperature: float = 1.0, chunk_bytes: int = 0,
              labels_n: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids int64 [n, k], log softmax(h W^T / temperature) at those ids fp32 [n, k], at `labels_n` fp32 [n] or
    None without labels): each row's k most likely vocab ids, most likely first, in row chunks of at most
    `chunk_bytes` fp32 logits — one pass over the logits gives a frozen model's top-k and its logprob of the
    sampled token (a teacher's forward). Over tp each shard's own top-k (ids made global), its label logit (where
    it holds the label) and (max, sum exp) are combined: [n, k x tp] values cross the ranks, never logits."""
    num_rows, num_valid = hidden_nh.shape[0], head.num_valid
    chunk_rows = max(1, (chunk_bytes or fused_head_bytes()[0]) // (4 * max(1, num_valid)))
    local_k = min(k, num_valid)
    values_nk = hidden_nh.new_full((num_rows, k), float("-inf"), dtype=torch.float32)
    ids_nk = torch.zeros(num_rows, k, dtype=torch.int64, device=hidden_nh.device)
    stats_2n = hidden_nh.new_zeros(2, num_rows, dtype=torch.float32)
    stats_2n[0].fill_(float("-inf"))
    picked_n = None
    if labels_n is not None:
        local_n = labels_n - head.vocab_start
        owned_n = (local_n >= 0) & (local_n < num_valid)
        local_n = local_n.clamp(0, max(0, num_valid - 1))
        picked_n = hidden_nh.new_zeros(num_rows, dtype=torch.float32)
    for chunk in _spans(0, num_rows if local_k else 0, chunk_rows):
        logits_cv = _chunk_logits(hidden_nh[chunk], head.weight[:num_valid], temperature)
        top = logits_cv.topk(local_k, dim=-1)
        values_nk[chunk, :local_k], ids_nk[chunk, :local_k] = top.values, top.indices + head.vocab_start
        stats_2n[0, chunk] = top.values[:, 0]
        if picked_n is not None:
            picked_n[chunk] = logits_cv.gather(1, local_n[chunk, None])[:, 0] * owned_n[chunk]
        stats_2n[1, chunk] = logits_cv.sub_(stats_2n[0, chunk, None]).exp_().sum(dim=-1)
    global_max_n = _all_reduce(stats_2n[0].clone(), dist.ReduceOp.MAX, head.tp_group)
    scale_n = (stats_2n[0] - global_max_n).nan_to_num(neginf=0.0).exp() * (stats_2n[1] > 0)
    lse_n = global_max_n + _all_reduce(stats_2n[1] * scale_n, dist.ReduceOp.SUM, head.tp_group).log()
    if head.tp_group.size() > 1:  # every shard's candidates, then the global top-k among them
        values_nk = torch.cat(_all_gather(values_nk, head.tp_group), dim=1)
        ids_nk = torch.cat(_all_gather(ids_nk, head.tp_group), dim=1)
        top = values_nk.topk(k, dim=-1)
        values_nk, ids_nk = top.values, ids_nk.gather(1, top.indices)
    label_logp_n = None
    if picked_n is not None:
        label_logp_n = _all_reduce(picked_n, dist.ReduceOp.SUM, head.tp_group) - lse_n
    return ids_nk, values_nk - lse_n[:, None], label_logp_n


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    if group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _spans(start: int, stop: int, step: int) -> Iterator[slice]:
    for first in range(start, stop, step):
        yield slice(first, min(first + step, stop))


def _chunk_logits(hidden_ch: torch.Tensor, weight_vh: torch.Tensor, temperature: float) -> torch.Tensor:
    logits_cv = gemm.linear(hidden_ch, weight_vh).float()
    return logits_cv.div_(temperature) if temperature != 1.0 else logits_cv


class _FusedHeadLogprobs(torch.autograd.Function):
    """Forward keeps per row the local (max, sum exp, sum exp * logit, picked logit), all relative to the local
    max, and combines them over tp; backward turns each chunk's logits into softmax p in place and applies
    d logp / dz = onehot - p and d H / dz = -p (log p + H), then the two head matmuls."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, labels_n, head, temperature, entropy_grad, chunk_rows, block_rows):
        num_rows, num_valid = hidden_nh.shape[0], head.num_valid
        weight_vh = weight_vh[:num_valid]
        single = labels_n.dim() == 1
        local_n = (labels_n[:, None] if single else labels_n) - head.vocab_start  # [n, m] from here on
        owned_n = (local_n >= 0) & (local_n < num_valid)
        local_n = local_n.clamp(0, max(num_valid - 1, 0))
        stats = torch.zeros(3, num_rows, dtype=torch.float32, device=hidden_nh.device)  # max, sum, sum*z
        stats[0].fill_(float("-inf"))
        picked_nm = torch.zeros(local_n.shape, dtype=torch.float32, device=hidden_nh.device)
        kept_cv, scratch_bv = None, None
        for chunk in _spans(0, num_rows if num_valid else 0, chunk_rows):
            logits_cv = _chunk_logits(hidden_nh[chunk], weight_vh, temperature)
            if scratch_bv is None:
                scratch_bv = logits_cv.new_empty(min(block_rows, logits_cv.shape[0]), num_valid)
            for block in _spans(0, logits_cv.shape[0], block_rows):
                rows = slice(chunk.start + block.start, chunk.start + block.stop)
                max_b = logits_cv[block].max(dim=-1).values
                shifted_bv = logits_cv[block].sub_(max_b[:, None])
                exp_bv = torch.exp(shifted_bv, out=scratch_bv[:shifted_bv.shape[0]])
                stats[0, rows] = max_b
                stats[1, rows] = exp_bv.sum(dim=-1)
                stats[2, rows] = exp_bv.mul_(shifted_bv).sum(dim=-1)
                picked_nm[rows] = shifted_bv.gather(1, local_n[rows])
            kept_cv = logits_cv if chunk_rows >= num_rows else None  # one chunk: keep it for the backward
        local_max_n, local_sum_n, local_zsum_n = stats
        global_max_n = _all_reduce(local_max_n.clone(), dist.ReduceOp.MAX, head.tp_group)
        # every term relative to the global max, so with one rank this is exactly log-sum-exp of shifted logits
        offset_n = (local_max_n - global_max_n).nan_to_num(neginf=0.0)
        scale_n = torch.where(local_sum_n > 0, offset_n.exp(), torch.zeros_like(offset_n))
        sums_nj = torch.cat([torch.stack([local_sum_n * scale_n, (local_zsum_n + offset_n * local_sum_n) * scale_n],
                                         dim=1),
                             torch.where(owned_n, picked_nm + offset_n[:, None], torch.zeros_like(picked_nm))], dim=1)
        sums_nj = _all_reduce(sums_nj, dist.ReduceOp.SUM, head.tp_group)
        sum_exp_n, zsum_n, picked_nm = sums_nj[:, 0], sums_nj[:, 1], sums_nj[:, 2:]
        log_sum_n = sum_exp_n.log()
        logprobs_n = picked_nm - log_sum_n[:, None]
        logprobs_n = logprobs_n.squeeze(1) if single else logprobs_n
        entropy_n = log_sum_n - zsum_n / sum_exp_n
        # log p = logits - lse; kept logits are already shifted by the local max
        lse_n = global_max_n + log_sum_n - (local_max_n if kept_cv is not None else 0.0)
        ctx.save_for_backward(hidden_nh, weight_vh, local_n, owned_n, lse_n, entropy_n, kept_cv)
        ctx.config = (temperature, chunk_rows, block_rows, head.weight.shape[0])
        ctx.head_weight = head.weight
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_n)
        return logprobs_n, entropy_n

    @staticmethod
    def backward(ctx, grad_logprobs_n, grad_entropy_n):
        hidden_nh, weight_vh, local_n, owned_n, lse_n, entropy_n, kept_cv = ctx.saved_tensors
        temperature, chunk_rows, block_rows, weight_rows = ctx.config
        num_rows, num_valid = hidden_nh.shape[0], weight_vh.shape[0]
        grad_logprobs_nm = (torch.zeros(local_n.shape, dtype=torch.float32, device=lse_n.device)
                            if grad_logprobs_n is None else grad_logprobs_n.float().reshape(local_n.shape))
        # d log p(label_j) / dz = onehot(label_j) - p: the softmax part is weighted by the sum over the labels
        target_grad_nm = grad_logprobs_nm * owned_n
        grad_logprobs_n = grad_logprobs_nm.sum(dim=1)
        grad_hidden_nh = torch.empty_like(hidden_nh) if num_valid else torch.zeros_like(hidden_nh)
        grad_weight_vh = None
        # under DDP the weight gradient goes straight into the grad buffer (no [vocab, hidden] temporary)
        main_grad_vh = megatron_compat.main_grad_of(ctx.head_weight) if ctx.needs_input_grad[1] else None
        for chunk in _spans(0, num_rows if num_valid else 0, chunk_rows):
            # the kept logits become the gradient in place: this backward can run once (no retain_graph reuse)
            logits_cv = kept_cv if kept_cv is not None else _chunk_logits(hidden_nh[chunk], weight_vh, temperature)
            for block in _spans(0, logits_cv.shape[0], block_rows):
                rows = slice(chunk.start + block.start, chunk.start + block.stop)
                logp_bv = logits_cv[block].sub_(lse_n[rows, None])
                if grad_entropy_n is None:
                    grad_bv = logp_bv.exp_().mul_(-grad_logprobs_n[rows, None])
                else:  # dH/dz = -p (log p + H)
                    probs_bv = logp_bv.exp()
                    scale_bv = logp_bv.add_(entropy_n[rows, None]).mul_(-grad_entropy_n[rows, None])
                    grad_bv = logp_bv.copy_(probs_bv.mul_(scale_bv.sub_(grad_logprobs_n[rows, None])))
                grad_bv.scatter_add_(1, local_n[rows], target_grad_nm[rows])
                if temperature != 1.0:
                    grad_bv.div_(temperature)
            grad_cv = logits_cv.to(hidden_nh.dtype)
            grad_hidden_nh[chunk] = gemm.matmul(grad_cv, weight_vh)
            if main_grad_vh is not None:
                megatron_compat.add_weight_grad(hidden_nh[chunk], grad_cv, main_grad_vh[:num_valid])
            elif ctx.needs_input_grad[1]:
                partial_vh = grad_cv.t() @ hidden_nh[chunk]  # in the model's dtype (bf16 GEMMs stay bf16)
                if grad_weight_vh is None:  # several chunks accumulate in fp32
                    grad_weight_vh = partial_vh if kept_cv is not None else partial_vh.float()
                else:
                    grad_weight_vh.add_(partial_vh)
        if not ctx.needs_input_grad[1] or main_grad_vh is not None:
            grad_weight = None
        elif grad_weight_vh is not None and num_valid == weight_rows:
            grad_weight = grad_weight_vh.to(hidden_nh.dtype)
        else:  # padded vocab rows get no gradient
            grad_weight = hidden_nh.new_zeros(weight_rows, hidden_nh.shape[1])
            if grad_weight_vh is not None:
                grad_weight[:num_valid] = grad_weight_vh
        return grad_hidden_nh, grad_weight, None, None, None, None, None, None
