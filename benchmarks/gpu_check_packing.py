"""gpu_check's packing check: packed (THD) micro-batches = padded ones on the device, through Transformer Engine's
`cu_seqlens` attention when TE is installed (rlhf's own block-diagonal core otherwise, as on the CPU)."""

from __future__ import annotations

import dataclasses
import time

import torch


def packed_vs_padded(path: str, groups, dtype: torch.dtype, rows: int = 16, max_response: int = 96) -> dict:
    """Actor logprobs and one update's loss / grad norm with row micro-batches vs packed ones (same weights);
    max |logprob| difference and seconds per variant. fp32 should agree to ~1e-5, bf16 to bf16 rounding."""
    from transformers import AutoConfig

    from rlhf.models.builder import _use_transformer_engine
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.batch import ScoredBatch
    from rlhf.stages.config import AlgoConfig, UpdateConfig
    from rlhf.stages.roles import PolicyRole
    from rlhf.train.config import OptimConfig

    gen = torch.Generator().manual_seed(0)
    prompt, vocab = 8, AutoConfig.from_pretrained(path).vocab_size
    lengths = torch.randint(1, max_response + 1, (rows,), generator=gen)
    mask = torch.arange(max_response)[None] < lengths[:, None]
    zeros = torch.zeros(mask.shape)
    batch = ScoredBatch(tokens_bs=torch.randint(3, vocab, (rows, prompt + max_response), generator=gen),
                        prompt_lengths_b=torch.full((rows,), prompt), response_lengths_b=lengths,
                        response_mask_bt=mask, loss_mask_bt=mask, group_index_b=torch.arange(rows) // 4,
                        sample_index_b=torch.arange(rows) // 4, trajectory_index_b=None,
                        rollout_logprobs_bt=zeros,
                        policy_version_bt=torch.zeros(mask.shape, dtype=torch.int32),
                        truncated_b=torch.zeros(rows, dtype=torch.bool), scores_b=torch.zeros(rows),
                        baseline_scores_b=None, routed_experts_bslk=None, pad_token_id=0,
                        old_logprobs_bt=-torch.rand(mask.shape, generator=gen) * mask, ref_logprobs_bt=None,
                        values_bt=None, token_rewards_bt=zeros,
                        advantages_bt=torch.randn(mask.shape, generator=gen) * mask, returns_bt=None,
                        is_weights_bt=None, teacher_logprobs_bt=None, cov_selected_bt=None)
    algo = AlgoConfig()
    algo = dataclasses.replace(algo, rollout_correction=algo.rollout_correction.resolved(weights_shared=True))
    out: dict = {"transformer_engine": _use_transformer_engine(), "dtype": str(dtype)}
    logprobs = {}
    for name, budget in (("padded", 0), ("packed", 4 * (prompt + max_response))):
        update = UpdateConfig(micro_batch_size=4, max_tokens_per_microbatch=budget, optim=OptimConfig(lr=1e-12))
        role = PolicyRole("actor", RoleMesh("actor", ParallelLayout(), groups), path, total_steps=1, update=update,
                          params_dtype=dtype)
        start = time.perf_counter()
        logprobs[name] = role.logprobs(batch)
        metrics = role.update(batch, algo)
        out[f"{name}_s"] = time.perf_counter() - start
        out[f"{name}_pg_loss"], out[f"{name}_grad_norm"] = metrics["actor/pg_loss"], metrics["actor/grad_norm"]
    out["logprob_max_diff"] = float((logprobs["packed"] - logprobs["padded"]).abs().max())
    return out
