"""A tiny char-level Llama and a reasoning-gym chain_sum dataset, made locally for trainer tests."""

from __future__ import annotations

from pathlib import Path

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.make import MakeConfig, make_dataset
from rlhf.models.init import InitModelConfig, init_hf_model

NUM_EXPERTS = 4
# every role on row-count micro-batches (the token budgets default to auto: packed)
ROW_COUNTS = ["actor.max_tokens_per_microbatch=0", "critic.max_tokens_per_microbatch=0",
              "ref.max_tokens_per_microbatch=0", "reward.model_max_tokens_per_microbatch=0"]


def make_tiny_setup(root: Path, num_train: int = 64, num_val: int = 16, **model_dims) -> dict[str, str]:
    """`model_dims` override the tiny model's InitModelConfig (vLLM's CPU attention needs head_dim >= 32)."""
    tokenizer = build_char_tokenizer()
    dims = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                max_position_embeddings=64) | model_dims
    model = init_hf_model(InitModelConfig(**dims), tokenizer, root / "model")
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train = make_dataset(MakeConfig(task="chain_sum", num_samples=num_train, seed=1, prompt_format="expression",
                                    task_config=task), root / "train.jsonl")
    val = make_dataset(MakeConfig(task="chain_sum", num_samples=num_val, seed=10_000_000,
                                  prompt_format="expression", task_config=task), root / "val.jsonl")
    assert train and val
    return {"model": str(model), "train": str(root / "train.jsonl"), "val": str(root / "val.jsonl")}


def length_reward(root: Path, modulo: int = 2) -> str:
    """The `reward.function` override of a dense reward, len(response) % modulo, that ignores data_source (every
    update moves the weights; any data_source scores)."""
    path = root / f"length_reward_{modulo}.py"
    path.write_text("def score(data_source, solution, ground_truth, extra_info):\n"
                    f"    return float(len(solution) % {modulo})\n")
    return f"reward.function={path}:score"


def hf_response_logprobs(path: str, batch):
    """log softmax of transformers' full logits (model at `path`, fp32) at each position predicting a response
    token of `batch`, `[B, T, vocab]`: the reference the roles' fused head is checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp_bsv = torch.log_softmax(model(batch.tokens_bs).logits.float(), dim=-1)
    positions_bt = batch.response_positions_bt()
    return logp_bsv.gather(1, positions_bt[..., None].expand(-1, -1, logp_bsv.shape[-1]))


def hf_sampled_logprobs(path: str, batch):
    """Each sampled response token's logprob under the HF model at `path` (transformers, full logits), `[B, T]`,
    zero off the response mask."""
    positions_bt = batch.response_positions_bt()
    labels_bt = batch.tokens_bs.gather(1, (positions_bt + 1).clamp(max=batch.tokens_bs.shape[1] - 1))
    picked_bt = hf_response_logprobs(path, batch).gather(2, labels_bt[..., None]).squeeze(-1)
    return picked_bt * batch.response_mask_bt


def shared_engine_algo(**fields):
    """An `AlgoConfig` resolved as the trainer resolves it for an engine on the actor's own weights (rollout
    correction `auto` -> off): roles are only ever handed resolved configs."""
    import dataclasses

    from rlhf.stages.config import AlgoConfig

    algo = AlgoConfig(**fields)
    return dataclasses.replace(algo, rollout_correction=algo.rollout_correction.resolved(weights_shared=True))


def trainer_config(paths: dict[str, str], run_root: str, overrides: list[str] | None = None):
    """A small GRPO config over the tiny setup; `overrides` are dotted CLI-style settings."""
    from rlhf.config import from_dict
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.config.loader import apply_overrides

    data = {
        "dist": {"backend": "gloo", "timeout_s": 60},
        "run": {"output_dir": run_root, "name": "t"},
        "model": {"path": paths["model"]},
        "data": {"train_files": [paths["train"]], "val_files": [paths["val"]], "prompts_per_step": 4,
                 "max_prompt_length": 16},
        "sampling": {"n": 4, "max_new_tokens": 5},
        "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
        "actor": {"optim": {"lr": 1e-3}, "micro_batch_size": 4, "recompute_old_logprobs": True},  # logprob gates
        "critic": {"optim": {"lr": 1e-3}, "micro_batch_size": 4},
        "rollout": {"native": {"max_batch_size": 16, "max_seq_len": 32}},
        "trainer": {"total_steps": 2, "tensorboard": False, "plot": False},
    }
    return from_dict(RlhfConfig, apply_overrides(data, list(overrides or [])))


def run_trainer(paths: dict[str, str], run_root: str, overrides: list[str], on_scored=None) -> list[dict]:
    """Build and fit a Trainer on this (already initialised) world; returns the metrics history. `on_scored`:
    a hook given every trained `ScoredBatch` and its step."""
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    import torch.distributed as dist

    cfg = trainer_config(paths, run_root, overrides)
    preflight(cfg, dist.get_world_size())
    run_dir = setup_run(cfg.run, cfg, defer_config=True)
    try:
        trainer = Trainer(cfg, run_dir)
        if on_scored is not None:
            trainer.scored_hooks.append(on_scored)
        return trainer.fit()
    finally:
        close_run()


def rollout_batch(**fields):
    """A `RolloutBatch` for unit tests: `tokens_bs`, `prompt_lengths_b`, `response_mask_bt` and `group_index_b`
    given, the rest defaulted from them (lengths from the mask, zero logprobs and versions, no scores)."""
    import torch

    from rlhf.stages.batch import RolloutBatch

    mask_bt, size = fields["response_mask_bt"], fields["tokens_bs"].shape[0]
    defaults = dict(response_lengths_b=mask_bt.sum(-1), loss_mask_bt=mask_bt, sample_index_b=fields["group_index_b"],
                    rollout_logprobs_bt=torch.zeros(mask_bt.shape), truncated_b=torch.zeros(size, dtype=torch.bool),
                    policy_version_bt=torch.zeros(mask_bt.shape, dtype=torch.int32), scores_b=None,
                    baseline_scores_b=None, reward_components_bk=None, routed_experts_bslk=None, trajectory_index_b=None,
                    pad_token_id=0)
    return RolloutBatch(**(defaults | fields))


def scored_batch(**fields):
    """A `ScoredBatch` for unit tests: `rollout_batch`'s fields, zero token rewards and advantages unless given,
    no old / ref / teacher logprobs, values, returns or weights."""
    import dataclasses

    import torch

    from rlhf.stages.batch import RolloutBatch, ScoredBatch

    names = {field.name for field in dataclasses.fields(RolloutBatch)}
    batch = rollout_batch(**{k: v for k, v in fields.items() if k in names})
    zeros_bt = torch.zeros(batch.response_mask_bt.shape)
    scored = dict(old_logprobs_bt=None, ref_logprobs_bt=None, values_bt=None, token_rewards_bt=zeros_bt,
                  advantages_bt=zeros_bt, returns_bt=None, is_weights_bt=None,
                  teacher_logprobs_bt=None, cov_selected_bt=None)
    return ScoredBatch.of(batch, **(scored | {k: v for k, v in fields.items() if k not in names}))


def make_moe_setup(root: Path) -> dict[str, str]:
    """The tiny char-level setup as a Qwen3-MoE (4 experts, top-2) with decisive routers (no near-ties, so
    every layout routes each token alike)."""
    import torch
    from safetensors.torch import load_file, save_file

    paths = make_tiny_setup(root, num_train=8, num_val=4, arch="qwen3_moe", num_experts=NUM_EXPERTS,
                            num_experts_per_token=2, expert_intermediate_size=32)
    weights_path = Path(paths["model"]) / "model.safetensors"
    weights = load_file(weights_path)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = torch.randn(tensor.shape, generator=gen) * 0.5
    save_file(weights, weights_path, metadata={"format": "pt"})
    return paths
