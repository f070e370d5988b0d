"""A model role of an RL step on its mesh: a megatron GPT (LM or value head), optionally trained.

Each role's members run its DP shard of the global batch (`stages.batch`); per-sample outputs are gathered back so
every rank sees the whole batch (`exchange.gather_rows`). Non-members only take part in that gather. The roles
themselves: `policy_role` (actor, ref, teacher) and `value_roles` (critic, reward model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig

from rlhf.algo.aggregation import GlobalCounts
from rlhf.errors import ConfigError
from rlhf.parallel.meshes import RoleMesh
from rlhf.models.builder import build_gpt
from rlhf.models.forward import TokenFn, forward_backward
from rlhf.models.hf_load import load_hf_weights
from rlhf.models.config import LoraConfig
from rlhf.models.lora import adapter_dtype, adapters_disabled, apply_lora, base_identity, check_same_base
from rlhf.models.lora_peft import load_peft_folder
from rlhf.models.routing import RoutingRecorder
from rlhf.models.routing_replay import UNKNOWN
from rlhf.platform import current_device
from rlhf.train import offload as offload_lib
from rlhf.train.engine import StepResult, TrainEngine, autocast_dtype
from rlhf.stages.batch import SequenceBatch
from rlhf.stages.config import UpdateConfig
from rlhf.stages.exchange import gather_rows, is_contributor
from rlhf.stages.micro_batches import (balanced_order, by_length, micro_batches, pack_plan, packed_micro_batches,
                                       row_lengths)


class ModelRole:
    """A megatron GPT (LM or value head) on one role mesh, optionally trained by a `TrainEngine`."""

    def __init__(self, name: str, mesh: RoleMesh, hf_path: str, *, update: UpdateConfig | None,
                 total_steps: int, micro_batch_size: int | None = None, value_head: bool = False,
                 recompute: bool = False, seed: int = 1234, offload_frozen: bool = False,
                 params_dtype: torch.dtype = torch.float32, moe_kwargs: dict | None = None,
                 gather_group: torch.distributed.ProcessGroup | None = None, lora: LoraConfig | None = None,
                 base_of: ModelRole | None = None, max_tokens_per_microbatch: tuple[int, str] = (0, ""),
                 forward_autocast: tuple[str, str] = ("none", "")) -> None:
        """`micro_batch_size`: sequences per forward-only micro-batch (default: the update's micro-batch size);
        `max_tokens_per_microbatch`: (budget, its config key) of packed forward-only micro-batches (default: the
        update's forward budget; 0: row counts); `gather_group`: the ranks that gather this role's outputs
        (None: the world); `lora`: train adapters on the frozen base (`rlhf.models.lora`); `base_of`: a frozen
        role that is that LoRA role's base model, its adapters switched off (no second copy of the weights);
        `forward_autocast`: (autocast setting, its config key) of a frozen role's own forwards."""
        self.name, self.mesh, self.update_config = name, mesh, update
        self.micro_batch_size = micro_batch_size or (update.micro_batch_size if update is not None else 0)
        assert self.micro_batch_size > 0, f"{name}: a frozen role needs its own micro_batch_size"
        budgets = [max_tokens_per_microbatch[0]] + ([update.max_tokens_per_microbatch] if update is not None else [])
        assert all(isinstance(budget, int) for budget in budgets), \
            f"{name}: token budgets {budgets} reach a role resolved (RlhfConfig resolves auto; pass 0 for row counts)"
        self.forward_budget = max_tokens_per_microbatch
        if update is not None and not self.forward_budget[0]:
            key = "forward_max_tokens_per_microbatch" if update.forward_max_tokens_per_microbatch else \
                "max_tokens_per_microbatch"
            self.forward_budget = (update.forward_tokens_per_microbatch, f"{name}.{key}")
        self.gather_group = gather_group
        self.forward_autocast_dtype = (autocast_dtype(forward_autocast[0], params_dtype, forward_autocast[1])
                                       if update is None else None)
        self.params_dtype = params_dtype
        self.model: torch.nn.Module | None = None
        self.engine: TrainEngine | None = None
        self.offload_frozen = offload_frozen and update is None and base_of is None
        self._parked: offload_lib.Offloaded | None = None
        self.adapters_off = base_of is not None
        self.base_id = base_identity(hf_path) if lora is not None else None
        if not mesh.is_member:
            return
        hf_config = AutoConfig.from_pretrained(hf_path)
        self.vocab_size, self.hidden_size = hf_config.vocab_size, hf_config.hidden_size
        if base_of is not None:
            self.model = base_of.model
            return
        model = build_gpt(hf_config, mesh.pgs, value_head=value_head, recompute=recompute, seed=seed,
                          params_dtype=params_dtype, moe_kwargs=moe_kwargs,
                          transformer_engine=lora is None and mesh.layout.cp == 1)  # cp: rlhf's own core
        load_hf_weights(model, hf_path)
        if lora is not None:
            apply_lora(model, lora, dtype=adapter_dtype(lora))
            if lora.adapter_path:
                load_peft_folder(model, lora.adapter_path)
        if update is not None:
            self.engine = TrainEngine(model, mesh.pgs, update.optim, name=name, total_steps=total_steps)
            self.model = self.engine.module
        else:
            self.model = model.eval()
            for param in model.parameters():
                param.requires_grad_(False)

    @property
    def dp_rank(self) -> int:
        return self.mesh.pgs.dp.rank()

    @property
    def dp_size(self) -> int:
        return self.mesh.layout.dp

    @property
    def tp_group(self):
        return self.mesh.pgs.tp

    @property
    def offloads(self) -> bool:
        """Whether `offload` frees memory on this rank: a trained role with `optim.offload`, a frozen one with
        `offload_frozen` (ref.offload, reward.model_offload)."""
        if not self.mesh.is_member:
            return False
        return self.engine.config.offload if self.engine is not None else self.offload_frozen

    def offload(self, *, keep_params: bool = False) -> None:
        """Park this role's device memory on the host between its phases (see `offloads`)."""
        if self.engine is not None:
            self.engine.offload(keep_params=keep_params)
        elif self.offload_frozen and self.model is not None and self._parked is None:
            self._parked = offload_lib.offload_frozen(self.model)

    def reload(self) -> None:
        if self.engine is not None:
            self.engine.reload()
        elif self._parked is not None:
            offload_lib.reload_frozen(self._parked)
            self._parked = None

    def _forward(self, batch: SequenceBatch, fn: Callable[[torch.Tensor, SequenceBatch], torch.Tensor],
                 token_fn: TokenFn, record_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`fn(token_fn(output, ...) [b, s, k], micro_batch) -> [b, T]` over this rank's DP shard, gathered to the
        whole batch `[B, T]`; with `record_routing` also the forward's own experts `[B, S, L, k]` (R2, pp=1)."""
        if self._parked is not None:
            raise RuntimeError(f"the {self.name} model is offloaded; call reload() before using it")
        local: dict[str, torch.Tensor] | None = None
        balance = balanced_order(row_lengths(batch).cpu(), self.mesh.layout.dp)
        if self.mesh.is_member:
            order, micro = self._split(batch.select(balance), self.forward_budget,
                                       min(self.micro_batch_size, batch.size // self.dp_size), ragged=True)

            def step(output: torch.Tensor, micro_batch: SequenceBatch) -> tuple[torch.Tensor, dict]:
                out = fn(output, micro_batch).detach()
                if out.dim() >= 2:  # response-aligned [b, T, ...]: back to the batch's response width
                    out = torch.nn.functional.pad(out, (0, 0) * (out.dim() - 2)
                                                  + (0, batch.response_width - out.shape[1]))
                outs = {"out": out}
                if record_routing:  # this micro-batch's experts, at the batch's sequence width
                    routed = self.routing_replay.last_recorded_bslk(self.mesh.pgs.cp)[:, :batch.tokens_bs.shape[1]]
                    outs["routing"] = torch.nn.functional.pad(
                        routed, (0, 0, 0, 0, 0, batch.tokens_bs.shape[1] - routed.shape[1]), value=UNKNOWN)
                return output.new_zeros(()), outs

            with torch.no_grad(), adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext():
                if self.engine is not None:
                    outputs = self.engine.forward_only(micro, step, token_fn)
                else:
                    outputs = forward_backward(self.model, micro, step, self.mesh.pgs, forward_only=True,
                                               token_fn=token_fn, autocast_dtype=self.forward_autocast_dtype)
            if is_contributor(self.mesh.layout, torch.distributed.get_rank()):
                unsort = torch.argsort(order)
                local = {key: torch.cat([o[key] for o in outputs])[unsort].cpu()  # the batch lives on the host
                         for key in outputs[0]}
        values = gather_rows(None if local is None else local["out"], self.mesh.layout,
                             self.gather_group)[torch.argsort(balance)]
        if not record_routing:
            return values
        routed = gather_rows(None if local is None else local["routing"], self.mesh.layout,
                             self.gather_group)[torch.argsort(balance)]
        return values, routed

    def _micro_batches(self, shard: SequenceBatch, size: int, *, ragged: bool = False) -> list[SequenceBatch]:
        """`shard` in micro-batches of `size` rows on this role's layout (`micro_batches.micro_batches`)."""
        return micro_batches(shard, size, self.mesh.pgs, ragged=ragged)

    def _split(self, balanced: SequenceBatch, budget: tuple[int, str], size: int, *,
               ragged: bool = False) -> tuple[torch.Tensor, list]:
        """(row order, micro-batches) of this rank's DP shard of `balanced` (rows in `balanced_order`): packed by
        the token `budget` (value, config key) when set, else `size` rows sorted by length."""
        shard = balanced.shard(self.dp_rank, self.dp_size).to(current_device())
        if self.mesh.layout.cp > 1 and not budget[0]:
            raise ConfigError(f"the {self.name} role runs at cp={self.mesh.layout.cp}, which shards packed "
                              f"micro-batches only; set {budget[1] or 'its token budget'} > 0")
        if budget[0]:
            bins = pack_plan(row_lengths(balanced).cpu(), self.dp_size, *budget)[self.dp_rank]
            order = torch.tensor([row for rows in bins for row in rows], dtype=torch.int64)
            return order, packed_micro_batches(shard, bins, self.mesh.pgs, self._compute_dtype(), self.hidden_size)
        order = by_length(shard)
        return order, self._micro_batches(shard.select(order), size, ragged=ragged)

    def _compute_dtype(self) -> torch.dtype:
        """The dtype this role's linears compute in: its autocast's, else its weights'."""
        autocast = self.engine.autocast_dtype if self.engine is not None else self.forward_autocast_dtype
        return autocast or self.params_dtype

    def _train(self, batch: SequenceBatch, loss_fn: Callable[[torch.Tensor, SequenceBatch, GlobalCounts], tuple],
               prefix: str, token_fn: TokenFn) -> dict[str, float]:
        """Epochs x mini-batches of optimizer steps; returns this rank's metric sums (contributors only), with
        the routing of the update's forwards (`<prefix>moe/...`, the role's global values) for an MoE model."""
        cfg = self.update_config
        totals: dict[str, float] = {}
        num_steps = 0
        if not self.mesh.is_member:
            return totals
        contributor = is_contributor(self.mesh.layout, torch.distributed.get_rank())
        with RoutingRecorder(self.engine.module, keep_experts=False) as routing:
            for _ in range(cfg.epochs):
                for mini in batch.chunks(batch.size // cfg.mini_batches):
                    result = self._train_mini_batch(mini, loss_fn, token_fn)
                    num_steps += 1
                    if contributor:
                        for metrics in result.metrics:
                            for key, value in metrics.items():
                                totals[key] = totals.get(key, 0.0) + float(value)
                    totals[f"{prefix}grad_norm"] = totals.get(f"{prefix}grad_norm", 0.0) + result.grad_norm
                    totals[f"{prefix}skipped_steps"] = (totals.get(f"{prefix}skipped_steps", 0.0)
                                                        + float(result.skipped))
                    totals[f"{prefix}lr"] = result.lr
        routing_metrics = (routing.global_metrics(self.engine.module, self.mesh.pgs.layout_all, f"{prefix}moe/")
                           if routing.routers else {})
        # Loss metrics are shares of a mini-batch total: averaging over optimizer steps gives per-step values.
        out = {k: v / num_steps for k, v in totals.items() if k not in (f"{prefix}lr", f"{prefix}skipped_steps")}
        out[f"{prefix}lr"] = totals[f"{prefix}lr"]
        out[f"{prefix}skipped_steps"] = totals[f"{prefix}skipped_steps"]
        return out | routing_metrics if contributor else {}

    def _train_mini_batch(self, mini: SequenceBatch,
                          loss_fn: Callable[[torch.Tensor, SequenceBatch, GlobalCounts], tuple],
                          token_fn: TokenFn) -> StepResult:
        """One optimizer step on this rank's DP shard of `mini`. At cp > 1 the cp ranks of a DP rank share its
        rows, so the counts are over DP alone; each computes the same loss and DDP sums gradients over dp x cp."""
        balanced = mini.select(balanced_order(row_lengths(mini).cpu(), self.dp_size))
        shard = balanced.shard(self.dp_rank, self.dp_size)
        counts = GlobalCounts.of(shard.response_mask_bt.to(current_device()), group=self.mesh.pgs.dp)
        # the loss sums over rows with global counts, so their order (hence micro-batching or packing) is free
        cfg = self.update_config
        _, micro = self._split(balanced, (cfg.max_tokens_per_microbatch, f"{self.name}.max_tokens_per_microbatch"),
                               cfg.micro_batch_size)
        return self.engine.train_step(micro, lambda out, mb: loss_fn(out, mb, counts), token_fn)

    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        return self.engine.state_dict() | ({"lora_base": self.base_id} if self.base_id is not None else {})

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Collective over the role's mesh: the full weight and optimizer tensors this rank writes."""
        return self.engine.checkpoint_tensors() if self.engine is not None else {}

    def load_state_dict(self, state: dict[str, Any], folder_of: Callable[[str], Any]) -> None:
        if self.engine is not None:
            check_same_base(state.get("lora_base"), self.base_id, self.name)
            self.engine.load_state_dict(state, folder_of)
