"""The policy roles: actor (trained), ref and teacher (frozen) — token logprobs and the PPO-family update."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from rlhf.algo.actor_loss import ActorLossInputs, actor_loss
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.distill import topk_distill_loss
from rlhf.errors import ConfigError
from rlhf.models.forward import TokenFn, token_entropy, token_logprobs
from rlhf.models.lm_head import LMHead, head_logprobs, head_sum_pi_squared, head_topk, hidden_output
from rlhf.models.routing_replay import RoutingReplay
from rlhf.stages.batch import RolloutBatch, ScoredBatch, SequenceBatch, gather_response, gather_response_k
from rlhf.stages.config import AlgoConfig
from rlhf.stages.distill_config import DistillKL
from rlhf.stages.model_role import ModelRole


class PolicyRole(ModelRole):
    """Actor (with an update) or reference (frozen): token logprobs, and the PPO-family update.

    With `fused_head` (default) the model hands back hidden states and the LM head runs fused with the
    logprob/entropy reduction on response tokens only (`rlhf.models.lm_head`); otherwise from full logits.
    Logprobs and entropy are of softmax(logits / `temperature`): the policy the rollouts were sampled from (as
    verl, OpenRLHF and TRL do), so PPO ratios and KL compare the distributions that produced the samples.
    """

    def __init__(self, *args, fused_head: bool = True, temperature: float = 1.0, routing_replay: str = "none",
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not temperature > 0:
            raise ConfigError(f"the policy's logprob temperature must be > 0, got {temperature}")
        self.fused_head, self.temperature = fused_head, temperature
        # R3: actor and ref replay the batch's (rollout) routing; R2: the actor records it in its old-logprob
        # forward (`logprobs`) and replays it in the update; the ref routes freely
        self.records_routing = routing_replay == "r2" and self.update_config is not None
        self.routing_replay: RoutingReplay | None = None
        if self.model is not None and (routing_replay == "r3" or self.records_routing):
            self.routing_replay = RoutingReplay(self.model)
            self.model.rlhf_routing_replay = self.routing_replay
        self.routing_metrics: dict[str, float] = {}  # of the last `logprobs`: router agreement with the batch's
        self.recorded_routing_bslk: torch.Tensor | None = None  # R2: the last `logprobs`' own routing

    def _output_mode(self) -> contextlib.AbstractContextManager:
        return hidden_output(self.model) if self.fused_head and self.model is not None else contextlib.nullcontext()

    def _token_fn(self, *, entropy_grad: bool = False, sum_pi_squared: bool = False, topk: int = 0) -> TokenFn:
        """(output, labels, wanted) -> [.., 2] logprob and entropy per position (+ sum_v pi(v)^2: [.., 3]); fused
        head: on the `wanted` (response-predicting) positions only, 0 elsewhere; any leading dims (`forward`).
        Labels `[.., 1 + K]` (the next token and K given ids) add the K ids' logprobs after the entropy; `topk`
        (a frozen teacher's forward) adds this model's own top-`topk` logprobs, then their ids (as fp32: exact
        below 2^24), from the same pass over the logits as the logprob (the entropy column is 0 there)."""
        def fn(output_sx: torch.Tensor, labels_s: torch.Tensor, wanted_s: torch.Tensor) -> torch.Tensor:
            if not self.fused_head:
                assert labels_s.dim() == wanted_s.dim() and not topk, "top-K distillation needs the fused head"
                logp_s = token_logprobs(output_sx, labels_s, self.tp_group, self.vocab_size, self.temperature)
                with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                    entropy_s = token_entropy(output_sx if entropy_grad else output_sx.detach(), self.tp_group,
                                              self.vocab_size, self.temperature)
                return torch.stack([logp_s, entropy_s], dim=-1)
            head = LMHead.of(self.model, self.tp_group, self.vocab_size)
            hidden_nh = output_sx[wanted_s]
            if topk:  # a frozen teacher: its top-K and the sampled token's logprob in one pass (no entropy: 0)
                assert labels_s.dim() == wanted_s.dim() and not sum_pi_squared, "a teacher scores plain labels"
                ids_nk, top_logp_nk, logp_n = head_topk(hidden_nh, head, topk, temperature=self.temperature,
                                                        labels_n=labels_s[wanted_s])
                columns = [logp_n[:, None], torch.zeros_like(logp_n)[:, None], top_logp_nk, ids_nk.float()]
            else:
                logp_nm, entropy_n = head_logprobs(hidden_nh, labels_s[wanted_s], head,
                                                   temperature=self.temperature, entropy_grad=entropy_grad)
                logp_nm = logp_nm if logp_nm.dim() == 2 else logp_nm[:, None]
                columns = [logp_nm[:, :1], entropy_n[:, None], logp_nm[:, 1:]]
                if sum_pi_squared:
                    columns.append(head_sum_pi_squared(hidden_nh, head, temperature=self.temperature)[:, None])
            stats_nk = torch.cat(columns, dim=-1)
            return stats_nk.new_zeros((*wanted_s.shape, stats_nk.shape[-1])).index_put((wanted_s,), stats_nk)

        return fn

    @staticmethod
    def _token_stats(stats_bsk: torch.Tensor, mb: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs_bt, entropy_bt) of the response tokens from `_token_fn`'s per-position outputs."""
        return gather_response(stats_bsk[..., 0], mb), gather_response(stats_bsk[..., 1], mb)

    def logprobs(self, batch: RolloutBatch, *, with_sum_pi_squared: bool = False, topk: int = 0) -> torch.Tensor:
        """Token logprobs `[B, T]` (`with_sum_pi_squared`, fused head only: `[B, T, 2]`, the second the position's
        sum_v pi(v)^2, which the optimal token baseline reads; `topk` > 0, fused head only: `[B, T, 1 + 2 topk]`,
        then this model's top-`topk` logprobs per position and their ids as fp32, for top-K distillation). Under routing replay R3 the forward routes as
        `batch.routed_experts_bslk` says (`routing_metrics`: how often the router's own choice agreed); under R2
        the actor routes freely and keeps its routing in `recorded_routing_bslk` for the update to replay."""
        assert self.fused_head or not (with_sum_pi_squared or topk), "needs the fused head (preflight)"

        def fn(stats_bsk: torch.Tensor, mb: SequenceBatch) -> torch.Tensor:
            logp_bt = gather_response(stats_bsk[..., 0], mb)
            if topk:
                return torch.cat([logp_bt[..., None], gather_response_k(stats_bsk[..., 2:], mb)], dim=-1)
            if not with_sum_pi_squared:
                return logp_bt
            return torch.stack([logp_bt, gather_response(stats_bsk[..., 2], mb)], dim=-1)

        replay = self.routing_replay
        if replay is not None:
            replay.clear()
            replay.record = self.records_routing
        source = dataclasses.replace(batch, routed_experts_bslk=None) if self.records_routing else batch
        with self._output_mode():
            result = self._forward(source, fn, self._token_fn(sum_pi_squared=with_sum_pi_squared, topk=topk),
                                   record_routing=self.records_routing)
        if self.records_routing:
            result, self.recorded_routing_bslk = result
        self.routing_metrics = {}
        if replay is not None and not self.records_routing and self.mesh.is_member:
            self.routing_metrics = replay.agreement(self.mesh.pgs.layout_all)
        if replay is not None:
            replay.clear()
            replay.record = False
        return result

    def update(self, batch: ScoredBatch, algo: AlgoConfig) -> dict[str, float]:
        use_kl_loss = algo.kl.use_as_loss
        entropy_grad = algo.policy_loss.entropy_coef > 0

        def loss_fn(output: torch.Tensor, mb: ScoredBatch, counts: GlobalCounts) -> tuple:
            logp_bt, entropy_bt = self._token_stats(output, mb)
            old_bt = mb.old_logprobs_bt if mb.old_logprobs_bt is not None else logp_bt.detach()  # on-policy
            inputs = ActorLossInputs(logprobs_bt=logp_bt, old_logprobs_bt=old_bt,
                                     advantages_bt=mb.advantages_bt, response_mask_bt=mb.response_mask_bt,
                                     ref_logprobs_bt=mb.ref_logprobs_bt if use_kl_loss else None,
                                     entropy_bt=entropy_bt, is_weights_bt=mb.is_weights_bt,
                                     cov_selected_bt=mb.cov_selected_bt)
            loss, metrics = actor_loss(inputs, algo.policy_loss, algo.kl, counts, algo.rollout_correction)
            out = {k: float(v) for k, v in metrics.as_dict("actor/").items()}
            if mb.teacher_topk_logprobs_btk is not None:  # top-K distillation: the student at the teacher's ids
                student_btk = gather_response_k(output[..., 2:], mb)
                assert student_btk.shape == mb.teacher_topk_logprobs_btk.shape, "extra_labels_bsk reached the head"
                term, distill_metrics = topk_distill_loss(
                    student_btk, mb.teacher_topk_logprobs_btk, mb.response_mask_bt, coef=algo.distill.coef,
                    reverse=algo.distill.kl is DistillKL.REVERSE, agg=algo.policy_loss.agg, counts=counts,
                    norm_length=algo.policy_loss.agg_norm_length)
                loss = loss + term
                out |= distill_metrics
            return loss, out

        # rejected tokens / filtered rows leave the loss and its counts
        batch = dataclasses.replace(batch, response_mask_bt=batch.loss_mask_bt)
        with self._output_mode():
            out = self._train(batch, loss_fn, "actor/", self._token_fn(entropy_grad=entropy_grad))
        if self.routing_replay is not None:
            self.routing_replay.clear()
        if out and use_kl_loss:
            out["actor/kl_coef"] = algo.kl.coef
        return out


    def sft_update(self, batch: SequenceBatch) -> dict[str, float]:
        """Supervised step(s) on the response tokens: token-mean NLL over the global batch (`rlhf sft`)."""
        def loss_fn(output: torch.Tensor, mb: SequenceBatch, counts: GlobalCounts) -> tuple:
            logp_bt, _ = self._token_stats(output, mb)
            loss = -(logp_bt * mb.response_mask_bt).sum() / max(counts.num_tokens, 1)
            return loss, {"sft/loss": float(loss.detach())}

        with self._output_mode():
            return self._train(batch, loss_fn, "actor/", self._token_fn())
