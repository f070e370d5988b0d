"""gpu_check's packing check: packed (THD) micro-batches = padded ones on the device, through Transformer Engine's
`cu_seqlens` attention when TE is installed (rlhf's own block-diagonal core otherwise, as on the CPU)."""

from __future__ import annotations

import dataclasses
import time

import torch
from bench_packing import PROMPT, variable_length_batch


def packed_vs_padded(path: str, groups, dtype: torch.dtype, max_response: int = 96) -> dict:
    """Actor logprobs and one update's loss / grad norm with row micro-batches vs packed ones (same weights);
    max |logprob| difference and seconds per variant. fp32 should agree to ~1e-5, bf16 to bf16 rounding."""
    from transformers import AutoConfig

    from rlhf.models.builder import _use_transformer_engine
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.meshes import RoleMesh
    from rlhf.stages.config import AlgoConfig, UpdateConfig
    from rlhf.stages.policy_role import PolicyRole
    from rlhf.train.config import OptimConfig

    batch = variable_length_batch(AutoConfig.from_pretrained(path).vocab_size, max_response)
    algo = AlgoConfig()
    algo = dataclasses.replace(algo, rollout_correction=algo.rollout_correction.resolved(weights_shared=True))
    out: dict = {"transformer_engine": _use_transformer_engine(), "dtype": str(dtype)}
    logprobs = {}
    for name, budget in (("padded", 0), ("packed", 4 * (PROMPT + max_response))):
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
