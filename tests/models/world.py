"""Rank-side helpers for the model tests: build+load at a layout, full logits/grads gathered in HF terms."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from rlhf.parallel.groups import GroupCache, build_layout_groups
from rlhf.parallel.layout import ParallelLayout
from rlhf.models.builder import build_gpt
from rlhf.models.forward import forward_backward, token_entropy, token_logprobs
from rlhf.models.hf_load import load_hf_weights, param_specs_for, stage_params
from rlhf.models.shard_rules import merge_shards


@dataclass
class MicroBatch:
    tokens_bs: torch.Tensor


def layout_model(path: str, tp: int, pp: int, cache: GroupCache, ep: int = 1, **build_kwargs):
    layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, pp=pp, ep=ep)
    groups = build_layout_groups(layout, cache)
    model = build_gpt(AutoConfig.from_pretrained(path), groups, **build_kwargs)
    load_hf_weights(model, path)
    return model, groups


def is_reporter(groups) -> bool:
    """The rank that reports for a layout: tp 0 of dp replica 0 on the last pipeline stage."""
    return groups.tp.rank() == 0 and groups.dp.rank() == 0 and groups.pp.rank() == groups.pp.size() - 1


def rl_loss(groups, vocab_size: int, scale: float = 1.0):
    """loss = scale * (-mean logprob - 0.1 mean entropy); reports full logits, logprobs and entropy."""
    def loss_fn(logits_bsv, micro_batch):
        logprobs = token_logprobs(logits_bsv, micro_batch.tokens_bs, groups.tp, vocab_size)
        entropy = token_entropy(logits_bsv, groups.tp, vocab_size)
        shards = [torch.empty_like(logits_bsv) for _ in range(groups.tp.size())]
        dist.all_gather(shards, logits_bsv.detach().contiguous(), group=groups.tp)
        hot = token_logprobs(logits_bsv, micro_batch.tokens_bs, groups.tp, vocab_size, temperature=2.0)
        report = {"logits": torch.cat(shards, -1)[..., :vocab_size], "logprobs": logprobs.detach(),
                  "entropy": entropy.detach(), "logprobs_t2": hot.detach(),
                  "entropy_t2": token_entropy(logits_bsv, groups.tp, vocab_size, temperature=2.0).detach()}
        return scale * (-logprobs.mean() - 0.1 * entropy.mean()), report
    return loss_fn


def hf_grads(model, groups) -> dict[str, np.ndarray]:
    """This stage's grads, reduced as megatron's DDP and `finalize_model_grads` do, gathered over tp and named
    like HF: dense grads averaged over dp; an expert's summed over its expert-dp replicas and divided by dp
    (its grad already holds every ep rank's tokens); q/k norms summed over tp (each rank saw its own heads).
    tp rank 0 of dp replica 0 keeps the dense grads, tp rank 0 of expert-dp replica 0 its experts'."""
    grads: dict[str, np.ndarray] = {}
    for param_spec, param in stage_params(model, param_specs_for(model)):
        grad = param.grad.clone()
        if "q_layernorm" in param_spec.name or "k_layernorm" in param_spec.name:
            dist.all_reduce(grad, group=groups.tp)
        expert = param_spec.expert is not None
        dist.all_reduce(grad, group=groups.expt_dp if expert else groups.dp)
        grad /= groups.dp.size()
        shards = [torch.empty_like(param) for _ in range(groups.tp.size())]
        dist.all_gather(shards, grad, group=groups.tp)
        if groups.tp.rank() == 0 and (groups.expt_dp if expert else groups.dp).rank() == 0:
            for name, tensor in merge_shards(param_spec, shards, model.rlhf_spec).items():
                grads[name] = grads.get(name, 0) + tensor.numpy()
    return grads


def numpy_report(reports: list[dict]) -> dict[str, np.ndarray]:
    """Every micro-batch's report joined along the batch dimension."""
    return {key: torch.cat([report[key] for report in reports]).numpy() for key in reports[0]}


def value_head_round_trip(path: str, out_root: str, cache: GroupCache, tokens, name: str = "value-llama",
                          tp: int = 2, pp: int = 2) -> dict:
    """At tp x pp: value model from a causal LM (fresh head) -> export -> reload (score.weight) -> values."""
    import os

    from rlhf.models.hf_export import export_hf

    def values_of(model, groups):
        def loss_fn(values_bs1, micro_batch):
            return values_bs1.sum() * 0, {"values": values_bs1.detach()}
        return forward_backward(model, [MicroBatch(tokens)], loss_fn, groups, forward_only=True)

    model, groups = layout_model(path, tp, pp, cache, value_head=True)
    values = values_of(model, groups)
    exported = os.path.join(out_root, name)
    export_hf(model, exported)
    reloaded, _ = layout_model(exported, tp, pp, cache, value_head=True)
    reloaded_values = values_of(reloaded, groups)
    if not is_reporter(groups):
        return {}
    return {"values": values[0]["values"].numpy(), "reloaded_values": reloaded_values[0]["values"].numpy()}


def padded_logits(path: str, cache: GroupCache, tokens_bs, valid_bs) -> dict:
    """Full logits at tp2 x pp2 for a batch with padding, using `padded_inputs` positions and mask."""
    from rlhf.models.forward import padded_inputs

    @dataclass
    class PaddedBatch:
        tokens_bs: torch.Tensor
        position_ids_bs: torch.Tensor
        attention_mask_b1ss: torch.Tensor

    model, groups = layout_model(path, 2, 2, cache)
    positions_bs, mask_b1ss = padded_inputs(valid_bs)
    reports = forward_backward(model, [PaddedBatch(tokens_bs, positions_bs, mask_b1ss)],
                               rl_loss(groups, model.rlhf_spec.vocab_size), groups, forward_only=True)
    return {"logits": reports[0]["logits"].numpy()} if is_reporter(groups) else {}


def record_hf_reads() -> set[str]:
    """Record (in this process) the names of every HF tensor the loader opens a slice of."""
    from rlhf.models.hf_load import HfFolder

    names: set[str] = set()
    original = HfFolder.slice

    def recording_slice(self, name: str):
        names.add(name)
        return original(self, name)

    HfFolder.slice = recording_slice
    return names


@dataclass
class PaddedMicroBatch:
    tokens_bs: torch.Tensor
    padding_mask_bs: torch.Tensor  # True on padding: left out of the loss and of the router losses


def router_loss_step_grads(path: str, cache: GroupCache, tp: int, ep: int, router_losses: dict) -> dict:
    """One TrainEngine step's grads (HF names, this rank's share) on 4 rows of 7 tokens with padding, split over
    dp, one micro-batch per row (the router losses are per micro-batch: every layout must cut alike): the loss
    is the mean -logprob over every real token, plus the router losses (`MoeConfig` fields)."""
    from rlhf.models.config import MoeConfig
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, pp=1, ep=ep)
    groups = build_layout_groups(layout, cache)
    model = build_gpt(AutoConfig.from_pretrained(path), groups, moe_kwargs=MoeConfig(**router_losses).build_kwargs())
    load_hf_weights(model, path)
    tokens = torch.randint(0, model.rlhf_spec.vocab_size, (4, 7), generator=torch.Generator().manual_seed(5))
    padding = torch.zeros(4, 7, dtype=torch.bool)
    padding[0, 5:] = padding[2, :2] = True
    num_real = int((~padding).sum())

    def loss_fn(logits_bsv, micro_batch):
        logprobs = token_logprobs(logits_bsv, micro_batch.tokens_bs, groups.tp, model.rlhf_spec.vocab_size)
        return -(logprobs * ~micro_batch.padding_mask_bs).sum() / num_real, {}

    engine = TrainEngine(model, groups, OptimConfig(lr=1e-3, total_steps=1, clip_grad=0.0))
    rows = range(groups.dp.rank(), 4, groups.dp.size())
    engine.train_step([PaddedMicroBatch(tokens[row:row + 1], padding[row:row + 1]) for row in rows], loss_fn)
    grads: dict[str, np.ndarray] = {}
    for param_spec, param in stage_params(model, param_specs_for(model)):
        shards = [torch.empty_like(param.main_grad) for _ in range(groups.tp.size())]
        dist.all_gather(shards, param.main_grad.contiguous(), group=groups.tp)
        if groups.tp.rank() == 0 and (groups.expt_dp if param_spec.expert is not None else groups.dp).rank() == 0:
            grads.update({name: t.numpy() for name, t in merge_shards(param_spec, shards, model.rlhf_spec).items()})
    return grads
