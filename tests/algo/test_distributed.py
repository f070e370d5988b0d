"""Across DP ranks (gloo): global counts, whitening, every estimator and policy loss (every aggregation mode, with
IS weights), rollout corrections and running stats equal the single-process values."""

import torch
import torch.distributed as dist

from rlhf.algo.advantages import AdvantageInputs, compute_advantages
from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.config import AdvantageConfig, KLConfig, LossAggMode, PolicyLossConfig, PolicyLossKind
from rlhf.algo.groups import Groups
from rlhf.algo.policy_loss import policy_loss
from rlhf.algo.policy_loss_cov import COVARIANCE_KINDS, covariance_selection
from rlhf.algo.running_stats import RunningMeanStd
from rlhf.algo.value_loss import explained_variance
from rlhf.algo.actor_loss import ActorLossInputs, actor_loss
from rlhf.algo.correction_config import RolloutCorrectionConfig
from rlhf.algo.rollout_correction import rollout_correction
from rlhf.testing.distributed import run_distributed

SHARDS = [(0, 2), (2, 6), (6, 8)]  # uneven DP shards of whole groups of 2
NEW_ESTIMATORS = ["opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"]


def _global_batch():
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([5, 1, 0, 4, 5, 3, 2, 5])
    mask = (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return {name: torch.randn(8, 5, generator=gen, dtype=torch.float64) for name in
            ["rewards", "values", "old_logp", "direction", "advantages", "rollout_shift"]} | {
        "mask": mask, "components": torch.randn(8, 2, generator=gen, dtype=torch.float64),
        "sum_pi_squared": torch.rand(8, 5, generator=gen, dtype=torch.float64),
        "weights": torch.rand(8, 5, generator=gen, dtype=torch.float64) * 2}


CORRECTIONS = {"token_tis": RolloutCorrectionConfig(enable=True, rollout_is="token", rollout_is_threshold=1.5),
               "seq_tis_seq_mis": RolloutCorrectionConfig(enable=True, rollout_is="sequence", rollout_rs="sequence",
                                                          rollout_is_threshold=3.0),
               "icepop": RolloutCorrectionConfig(enable=True, rollout_is=None, rollout_rs="token",
                                                 rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
               "verl_chained_rs": RolloutCorrectionConfig(enable=True, rollout_is="token",
                                                          rollout_is_threshold="0.5_2.0",
                                                          rollout_rs="token_k1,seq_mean_k3",
                                                          rollout_rs_threshold="0.3_1.5,0.1"),
               "batch_normalized": RolloutCorrectionConfig(enable=True, rollout_is="sequence", rollout_is_threshold=3.0,
                                                           rollout_is_batch_normalize=True, rollout_rs="seq_max_k2",
                                                           rollout_rs_threshold=0.8)}
BYPASS = RolloutCorrectionConfig(enable=True, bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                 rollout_is_threshold=1.5, rollout_rs="token_k2", rollout_rs_threshold=0.3)


def _correction_diffs(full, rows, group):
    """The step computes weights and masks on the global batch; each DP shard's loss on its rows sums to the
    full-batch loss (value and gradient), with counts of the kept tokens."""
    diffs = {}
    rollout_logp = full["old_logp"] + 0.5 * full["rollout_shift"]
    for name, config in CORRECTIONS.items():
        correction = rollout_correction(full["old_logp"], rollout_logp, full["mask"], config)
        keep = correction.keep_mask_bt.double()
        weights = correction.weights_bt
        counts = GlobalCounts.of(keep[rows], group=group)
        theta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

        def loss_of(sel, counts):
            logp = full["old_logp"][sel] + theta * full["direction"][sel]
            inputs = ActorLossInputs(logprobs_bt=logp, old_logprobs_bt=full["old_logp"][sel],
                                     advantages_bt=full["advantages"][sel], response_mask_bt=keep[sel],
                                     is_weights_bt=None if weights is None else weights[sel])
            return actor_loss(inputs, PolicyLossConfig(clip_low=0.1, clip_high=0.3), KLConfig(), counts)[0]

        local = loss_of(rows, counts)
        (local_grad,) = torch.autograd.grad(local, theta)
        summed = torch.stack([local.detach(), local_grad])
        dist.all_reduce(summed, group=group)
        reference = loss_of(slice(None), GlobalCounts.of(keep))
        (grad,) = torch.autograd.grad(reference, theta)
        diffs[name] = (summed - torch.stack([reference.detach(), grad])).abs().max().item()
    diffs["bypass_reinforce"] = _bypass_diff(full, rows, group)
    return diffs


def _bypass_diff(full, rows, group):
    """Bypass: weights and rejection from pi_theta / pi_rollout inside each shard's loss, global counts."""
    counts = GlobalCounts.of(full["mask"][rows], group=group)
    theta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    rollout_logp = full["old_logp"] + 0.5 * full["rollout_shift"]

    def loss_of(sel, counts):
        inputs = ActorLossInputs(logprobs_bt=full["old_logp"][sel] + theta * full["direction"][sel],
                                 old_logprobs_bt=rollout_logp[sel], advantages_bt=full["advantages"][sel],
                                 response_mask_bt=full["mask"][sel])
        return actor_loss(inputs, PolicyLossConfig(), KLConfig(), counts, BYPASS)[0]

    local = loss_of(rows, counts)
    (local_grad,) = torch.autograd.grad(local, theta)
    summed = torch.stack([local.detach(), local_grad])
    dist.all_reduce(summed, group=group)
    reference = loss_of(slice(None), GlobalCounts.of(full["mask"]))
    (grad,) = torch.autograd.grad(reference, theta)
    return (summed - torch.stack([reference.detach(), grad])).abs().max().item()


def _advantage_diffs(full, rows, group):
    diffs = {}
    for kind in ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", *NEW_ESTIMATORS]:
        config = AdvantageConfig(kind=kind, gamma=0.9, lam=0.7, gdpo_reward_keys=["a", "b"])

        def inputs(sel, batch=full, kind=kind):
            groups = Groups.contiguous(batch["mask"][sel].shape[0], 2)
            return AdvantageInputs(token_rewards_bt=batch["rewards"][sel], response_mask_bt=batch["mask"][sel],
                                   values_bt=batch["values"][sel], groups=groups,
                                   reward_components_bk=batch["components"][sel],
                                   old_logprobs_bt=batch["old_logp"][sel],
                                   sum_pi_squared_bt=batch["sum_pi_squared"][sel], is_weights_bt=batch["weights"][sel])

        sharded = compute_advantages(config, inputs(rows), dp_group=group).advantages_bt
        reference = compute_advantages(config, inputs(slice(None))).advantages_bt[rows]
        diffs[kind] = (sharded - reference).abs().max().item()
    return diffs


def _loss_diffs(full, rows, group):
    diffs = {}
    counts = GlobalCounts.of(full["mask"][rows], group=group)
    diffs["counts"] = float(counts != GlobalCounts.of(full["mask"]))
    for kind in PolicyLossKind:
        for mode in LossAggMode:
            config = PolicyLossConfig(kind=kind, agg=mode, agg_norm_length=5, clip_low=0.1, clip_high=0.3,
                                      clip_cov_ratio=0.2, clip_cov_lb=-5.0, kl_cov_ratio=0.2)
            selected = None
            if kind in COVARIANCE_KINDS:  # chosen once on the global batch, as the step does
                selected = covariance_selection(config, full["advantages"], full["old_logp"], full["mask"],
                                                torch.Generator().manual_seed(3))
            theta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

            def loss_of(sel, config=config, selected=selected):
                logp = full["old_logp"][sel] + theta * full["direction"][sel]
                return policy_loss(logp, full["old_logp"][sel], full["advantages"][sel], full["mask"][sel], config,
                                   counts, is_weights_bt=full["weights"][sel],
                                   cov_selected_bt=None if selected is None else selected[sel])

            local_loss, local_metrics = loss_of(rows)
            (local_grad,) = torch.autograd.grad(local_loss, theta)
            summed = torch.stack([local_loss.detach(), local_grad, local_metrics.pg_clipfrac,
                                  local_metrics.pg_clipfrac_lower, local_metrics.ppo_kl])
            dist.all_reduce(summed, group=group)
            full_loss, full_metrics = loss_of(slice(None))
            (full_grad,) = torch.autograd.grad(full_loss, theta)
            expected = torch.stack([full_loss.detach(), full_grad, full_metrics.pg_clipfrac,
                                    full_metrics.pg_clipfrac_lower, full_metrics.ppo_kl])
            diffs[f"{kind}/{mode}"] = (summed - expected).abs().max().item()
    return diffs


def _stats_diffs(full, rows, group):
    local = explained_variance(full["values"][rows], full["rewards"][rows], full["mask"][rows], group=group)
    reference = explained_variance(full["values"], full["rewards"], full["mask"])
    stream = full["rewards"].flatten()
    shard_stats = RunningMeanStd()
    shard_stats.update(full["rewards"][rows].flatten())
    synced = shard_stats.sync(group)
    return {"explained_variance": (local - reference).abs().item(),
            "running_mean": abs(synced.mean - stream.mean().item()),
            "running_var": abs(synced.var - stream.var(unbiased=False).item()),
            "running_count": abs(synced.count - stream.numel())}


def _check_rank():
    full = _global_batch()
    start, stop = SHARDS[dist.get_rank()]
    rows = slice(start, stop)
    group = dist.group.WORLD
    return (_advantage_diffs(full, rows, group) | _loss_diffs(full, rows, group) | _stats_diffs(full, rows, group)
            | _correction_diffs(full, rows, group))


def test_dp_shards_reproduce_the_full_batch():
    for rank, diffs in enumerate(run_distributed(_check_rank, len(SHARDS), timeout_s=120)):
        assert len(diffs) == 3 + len(NEW_ESTIMATORS) + 1 + len(PolicyLossKind) * len(LossAggMode) + 4 \
            + len(CORRECTIONS) + 1
        for name, diff in diffs.items():
            assert diff <= 1e-9, (rank, name, diff)
