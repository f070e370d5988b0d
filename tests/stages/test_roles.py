"""Actor update on a fixed batch: the same loss and grad norm at DP=1 and DP=2, and with micro-batching."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from fixtures import make_tiny_setup, shared_engine_algo  # noqa: E402

from rlhf.parallel.groups import GroupCache, build_layout_groups  # noqa: E402
from rlhf.parallel.layout import ParallelLayout  # noqa: E402
from rlhf.parallel.meshes import RoleMesh  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402
from rlhf.train.config import OptimConfig  # noqa: E402
from rlhf.stages.batch import ScoredBatch  # noqa: E402
from rlhf.stages.config import UpdateConfig  # noqa: E402
from rlhf.stages.policy_role import PolicyRole  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=8, num_val=4)


def fixed_batch(size: int = 8) -> ScoredBatch:
    gen = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(2, 5, (size,), generator=gen)
    response_lengths = torch.randint(1, 6, (size,), generator=gen)
    width, resp = int((prompt_lengths + response_lengths).max()), int(response_lengths.max())
    tokens = torch.randint(4, 18, (size, width), generator=gen)
    mask = torch.arange(resp)[None, :] < response_lengths[:, None]
    return ScoredBatch(tokens_bs=tokens, prompt_lengths_b=prompt_lengths, response_lengths_b=response_lengths,
                       response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.arange(size) // 4,
                       sample_index_b=torch.arange(size) // 4, trajectory_index_b=None,
                       rollout_logprobs_bt=torch.zeros(mask.shape),
                       policy_version_bt=torch.zeros(mask.shape, dtype=torch.int32),
                       truncated_b=torch.zeros(size, dtype=torch.bool), scores_b=torch.zeros(size),
                       baseline_scores_b=None, reward_components_bk=None, routed_experts_bslk=None, pad_token_id=0,
                       old_logprobs_bt=-torch.rand(mask.shape, generator=gen) * 3 * mask, ref_logprobs_bt=None,
                       values_bt=None, token_rewards_bt=torch.zeros(mask.shape),
                       advantages_bt=torch.randn(mask.shape, generator=gen) * mask, returns_bt=None,
                       is_weights_bt=None, teacher_logprobs_bt=None,
                       cov_selected_bt=None)


def _update_at(paths, layouts_and_micro):
    cache = GroupCache()
    out = []
    for layout, micro in layouts_and_micro:
        mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
        role = PolicyRole("actor", mesh, paths["model"], total_steps=4,
                          update=UpdateConfig(micro_batch_size=micro, max_tokens_per_microbatch=0,  # row counts
                                              optim=OptimConfig(lr=1e-3)))
        out.append(role.update(fixed_batch(), shared_engine_algo()))
    # Skipping the old-logprob forward (on-policy) must give the update the recomputed path gives.
    layout = ParallelLayout(dp=2)
    on_policy = []
    for recompute in (True, False):
        mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
        role = PolicyRole("actor", mesh, paths["model"], total_steps=4,
                          update=UpdateConfig(micro_batch_size=2, max_tokens_per_microbatch=0,
                                              optim=OptimConfig(lr=1e-3),
                                              recompute_old_logprobs=recompute))
        batch = fixed_batch()
        batch = dataclasses.replace(batch, old_logprobs_bt=role.logprobs(batch) if recompute else None)
        on_policy.append(role.update(batch, shared_engine_algo()))
    return out, on_policy


def test_loss_is_the_same_for_dp1_dp2_and_micro_batching(tiny):
    runs = [(ParallelLayout(dp=1), 8), (ParallelLayout(dp=1), 2), (ParallelLayout(dp=2), 4),
            (ParallelLayout(dp=2), 1), (ParallelLayout(tp=2), 4)]
    both = run_distributed(_update_at, 2, tiny, runs, timeout_s=300)
    results = [b[0] for b in both]
    recomputed, skipped = both[0][1]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert skipped[key] == pytest.approx(recomputed[key], abs=1e-6), key
    assert skipped["actor/ppo_kl"] == 0.0
    by_run = [{**results[0][i], **results[1][i]} for i in range(len(runs))]
    # DP shards report shares; the world sum of the shares is the mini-batch value.
    dp2 = [{k: results[0][i][k] + results[1][i][k] if not k.endswith(("grad_norm", "lr", "skipped_steps"))
            else results[0][i][k] for k in results[0][i]} for i in (2, 3)]
    reference = by_run[0]
    for other in (by_run[1], *dp2, by_run[4]):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
            assert other[key] == pytest.approx(reference[key], abs=1e-6), key
    assert reference["actor/pg_loss"] != 0.0


def _reward_scores(paths, reward_path):
    from rlhf.stages.value_roles import RewardModelRole

    cache = GroupCache()
    out = []
    for layout in (ParallelLayout(dp=2), ParallelLayout(tp=2)):
        mesh = RoleMesh("reward", layout, build_layout_groups(layout, cache))
        role = RewardModelRole("reward", mesh, reward_path, update=None, total_steps=0, micro_batch_size=2,
                               value_head=True)
        out.append(role.scores(fixed_batch()).tolist())
    return out


def test_reward_model_scores_match_transformers_at_dp2_and_tp2(tiny, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(tiny["model"], num_labels=1, pad_token_id=0)
    torch.manual_seed(3)
    hf = AutoModelForSequenceClassification.from_config(config).float().eval()
    hf.save_pretrained(tmp_path / "rm")
    dp2, tp2 = run_distributed(_reward_scores, 2, tiny, str(tmp_path / "rm"), timeout_s=300)[0]
    batch = fixed_batch()
    with torch.no_grad():
        expected = [hf(batch.tokens_bs[i:i + 1, :int(batch.prompt_lengths_b[i] + batch.response_lengths_b[i])])
                    .logits[0, 0].item() for i in range(batch.size)]
    assert dp2 == pytest.approx(expected, abs=1e-5)
    assert tp2 == pytest.approx(expected, abs=1e-5)


def _fused_vs_full_logits(paths):
    from rlhf.algo.policy_loss import PolicyLossConfig

    cache = GroupCache()
    algo = shared_engine_algo(policy_loss=PolicyLossConfig(entropy_coef=0.05))  # the entropy gradient is exercised too
    out = {}
    for name, layout in (("tp1", ParallelLayout()), ("tp2", ParallelLayout(tp=2)), ("pp2", ParallelLayout(pp=2))):
        for fused in (False, True):
            mesh = RoleMesh("actor", layout, build_layout_groups(layout, cache))
            role = PolicyRole("actor", mesh, paths["model"], total_steps=4, fused_head=fused, temperature=0.7,
                              update=UpdateConfig(micro_batch_size=4, max_tokens_per_microbatch=0,
                                                  optim=OptimConfig(lr=1e-2)))
            before = role.logprobs(fixed_batch())
            metrics = role.update(fixed_batch(), algo)
            out[(name, fused)] = (before, metrics, role.logprobs(fixed_batch()))
    return out


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])  # tied: the head weight is the embedding (a copy on the last stage)
def test_fused_head_matches_full_logits_and_transformers_at_tp1_tp2_pp2(tiny, tmp_path, tied):
    """Both paths score at the sampling temperature (0.7 here): log_softmax(logits / 0.7) of transformers."""
    from transformers import AutoModelForCausalLM

    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    paths = dict(tiny)
    if tied:
        config = InitModelConfig(arch="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, tie_embeddings=True)
        paths["model"] = str(init_hf_model(config, build_char_tokenizer(), tmp_path / "tied"))
    ranks = run_distributed(_fused_vs_full_logits, 2, paths, timeout_s=300)
    batch = fixed_batch()
    hf = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tied
    with torch.no_grad():
        logp_bs = torch.log_softmax(hf(batch.tokens_bs).logits / 0.7, dim=-1)
    positions_bt = batch.response_positions_bt()
    labels_bt = batch.tokens_bs.gather(1, (positions_bt + 1).clamp(max=batch.tokens_bs.shape[1] - 1))
    expected_bt = logp_bs.gather(1, positions_bt[..., None].expand(-1, -1, logp_bs.shape[-1]))
    expected_bt = expected_bt.gather(2, labels_bt[..., None]).squeeze(-1) * batch.response_mask_bt
    for name in ("tp1", "tp2", "pp2"):
        full, fused = ranks[0][(name, False)], ranks[0][(name, True)]
        torch.testing.assert_close(fused[0], expected_bt, atol=1e-5, rtol=0)  # parity with transformers
        torch.testing.assert_close(fused[0], full[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(fused[2], full[2], atol=1e-5, rtol=0)  # the same update
        assert (fused[2] - fused[0]).abs().max() > 1e-3  # ... that did change the policy
        metrics = [{**ranks[0][(name, f)][1], **ranks[1][(name, f)][1]} for f in (False, True)]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert metrics[1][key] == pytest.approx(metrics[0][key], abs=1e-5), (name, key)


def test_trimmed_micro_batch_drops_only_shared_padding():
    batch = fixed_batch()
    rows = batch.select(slice(0, 2))
    trimmed = rows.trimmed()
    seq = int((rows.prompt_lengths_b + rows.response_lengths_b).max())
    assert trimmed.tokens_bs.shape == (2, seq) and torch.equal(trimmed.tokens_bs, rows.tokens_bs[:, :seq])
    width = int(rows.response_lengths_b.max())
    for name in ("response_mask_bt", "advantages_bt", "old_logprobs_bt", "rollout_logprobs_bt"):
        assert torch.equal(getattr(trimmed, name), getattr(rows, name)[:, :width]), name
    assert not rows.response_mask_bt[:, width:].any()  # what was cut held no response token
    assert torch.equal(trimmed.response_positions_bt(), rows.response_positions_bt()[:, :width])
    assert trimmed.ref_logprobs_bt is None and torch.equal(trimmed.prompt_lengths_b, rows.prompt_lengths_b)


def test_balanced_order_evens_out_dp_shards():
    from rlhf.stages.micro_batches import balanced_order

    lengths = torch.tensor([100, 90, 80, 70, 5, 4, 3, 2])  # contiguous halves: 340 vs 14 tokens
    order = balanced_order(lengths, 2)
    assert sorted(order.tolist()) == list(range(8))
    halves = lengths[order].view(2, 4).sum(1).tolist()
    assert max(halves) - min(halves) <= 10, halves
    assert torch.equal(order, balanced_order(lengths.clone(), 2)), "deterministic: every rank agrees"
    assert torch.equal(balanced_order(lengths, 1), torch.arange(8))
    assert torch.equal(balanced_order(lengths, 3), torch.arange(8))  # shards must be equal: left alone
