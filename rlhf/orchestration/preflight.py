"""Everything decided from the config before a role is built: role layouts and their checks, the process groups,
and `preflight` (every input check, run before the run folder exists, so bad input writes nothing).

`preflight` needs no process group (`rlhf config --check` runs it in one process) and reports every problem at
once: independent checks each add theirs to a `Problems` list; a check whose input failed is skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlhf import platform
from rlhf.agents.rollout import MultiTurnRollout
from rlhf.algo.advantages import AdvantageKind, check_group_size
from rlhf.orchestration.schema import RlhfConfig, longest_row
from rlhf.data.loader import check_dataset_files, load_prompts
from rlhf.data.sampler import PromptSampler
from rlhf.errors import CheckpointError, ConfigError, DataError
from rlhf.loggers import check_loggers
from rlhf.models.config import MoeConfig
from rlhf.parallel.meshes import ROLES, ModelDims, RoleMeshes, build_role_meshes, plan_meshes
from rlhf.run_dir import get_logger
from rlhf.orchestration.async_schedule import check_async
from rlhf.orchestration.setting_checks import (check_algo_settings, check_context_parallel, check_lora,
                                               check_lora_adapter, check_metrics_endpoint, check_multiturn)
from rlhf.rollout.vllm_engine import INSTALL_HINT as VLLM_INSTALL_HINT
from rlhf.orchestration.checks import (check_kv_cache, check_model_folders, check_resume_path, check_reward_tokenizer,
                                       check_teacher_tokenizers, check_writable_folder, load_tokenizer,
                                       read_hf_config, teacher_folders)
from rlhf.stages.config import check_batch_sizes, check_budget_fits
from rlhf.stages.distill import check_topk, route_teachers
from rlhf.data.tokenize import TokenizedPrompts
from rlhf.stages.memory import check_sleep
from rlhf.stages.scoring import Scorer

log = get_logger("trainer")


class Problems:
    """The messages of failed input checks, in check order (each once); `raise_all` raises them together."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, or None with its input error (config, data, checkpoint path) recorded."""
        try:
            return fn(*args, **kwargs)
        except (ConfigError, DataError, CheckpointError) as error:
            if str(error) not in map(str, self.errors):
                self.errors.append(error)
            return None

    def raise_all(self) -> None:
        """One problem is raised as it is; several as one ConfigError listing them all, numbered."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            listed = "\n".join(f"  {number}. {error}" for number, error in enumerate(self.errors, 1))
            raise ConfigError(f"{len(self.errors)} problems in the config:\n{listed}")


@contextmanager
def collecting(problems: Problems | None) -> Iterator[Problems]:
    """The caller's collector, or (for a caller that wants the old raise-on-failure contract) a fresh one whose
    problems are raised together on exit."""
    own = problems if problems is not None else Problems()
    yield own
    if problems is None:
        own.raise_all()


def model_dims(path: str, label: str = "model.path") -> ModelDims:
    hf_config = read_hf_config(path, label)
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    return ModelDims(hf_config.num_hidden_layers, hf_config.num_attention_heads,
                     getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads, num_experts)


def mesh_config(cfg: RlhfConfig):
    """The mesh config with exactly the roles the run uses (ref only with KL, critic only with GAE, reward only
    with a reward model); a `mesh.roles` that names others is a ConfigError, not overwritten."""
    algo = cfg.algo
    needed = {"actor", "rollout"} | ({"ref"} if algo.uses_ref else set()) | ({"critic"} if algo.uses_critic else set())
    if cfg.reward.model_path:
        needed.add("reward")
    if algo.distill.enable:
        needed.add("teacher")
    roles = [role for role in ROLES if role in needed]
    if cfg.mesh.roles is not None and set(cfg.mesh.roles) != needed:
        why = {"ref": "algo.kl.coef > 0", "critic": "algo.advantage.kind=gae",
               "reward": "reward.model_path set", "teacher": "algo.distill.enable"}
        reasons = "; ".join(f"{role}: {why[role]}" for role in roles if role in why) or "no ref, critic or reward"
        raise ConfigError(f"mesh.roles={cfg.mesh.roles}, but this run uses {roles} ({reasons}): remove mesh.roles "
                          f"(the roles follow from algo and reward) or set mesh.roles={roles}")
    return dataclasses.replace(cfg.mesh, roles=roles)


def role_dims(cfg: RlhfConfig) -> dict[str, ModelDims]:
    """Models that differ from the policy (critic, reward model) are checked against their own sizes."""
    dims = {}
    if cfg.algo.uses_critic and cfg.model.critic_path:
        dims["critic"] = model_dims(cfg.model.critic_path, "model.critic_path")
    if cfg.reward.model_path:
        if cfg.algo.advantage.kind == AdvantageKind.REMAX:
            raise ConfigError("algo.advantage.kind=remax scores a greedy baseline with rule rewards; it cannot "
                              "be combined with reward.model_path yet")
        if cfg.algo.filter_groups.enable:
            raise ConfigError("algo.filter_groups.enable=true filters groups on rule rewards before training; it "
                              "cannot be combined with reward.model_path yet")
        dims["reward"] = model_dims(cfg.reward.model_path, "reward.model_path")
    if cfg.algo.distill.enable:  # one layout for every teacher: it must divide them all
        teachers = [model_dims(path, key) for key, path in teacher_folders(cfg)]
        dims["teacher"] = ModelDims(*(math.gcd(*numbers) for numbers in zip(*teachers)))
    return dims



def check_warmup(cfg: RlhfConfig, role: str) -> None:
    """A trained role's LR warmup ends before its last optimizer step (it used to fail at build, unnamed)."""
    update = getattr(cfg, role)
    optim = update.optim
    if optim.total_steps:
        total, source = optim.total_steps, f"{role}.optim.total_steps"
    else:
        total = cfg.trainer.total_steps * update.epochs * update.mini_batches
        source = (f"trainer.total_steps={cfg.trainer.total_steps} x {role}.epochs={update.epochs} x "
                  f"{role}.mini_batches={update.mini_batches}")
    if optim.warmup_steps >= total:
        raise ConfigError(f"{role}.optim.warmup_steps={optim.warmup_steps} must be < the {role}'s {total} optimizer "
                          f"steps ({source}); lower {role}.optim.warmup_steps or raise trainer.total_steps")


def check_batches(cfg: RlhfConfig, layouts: dict, problems: Problems | None = None) -> None:
    """Group size, every trained role's batch split and LR warmup (all problems, see `collecting`)."""
    with collecting(problems) as problems:
        problems.check(check_group_size, cfg.algo.advantage.kind, cfg.sampling.n)
        for role in ("actor", "critic"):
            if role in layouts:
                problems.check(check_batch_sizes, prompts_per_step=cfg.data.prompts_per_step, n=cfg.sampling.n,
                               rollout_dp=layouts["rollout"].dp, role=role, role_dp=layouts[role].dp,
                               update=getattr(cfg, role))
                problems.check(check_warmup, cfg, role)
        check_token_budgets(cfg, layouts, problems)


def check_token_budgets(cfg: RlhfConfig, layouts: dict, problems: Problems,
                        longest: tuple[int, str] | None = None) -> None:
    """Every packing budget holds the longest row a step can have (`schema.longest_row`; `longest`: (tokens,
    where) of rows known otherwise, `rlhf replay`'s dumps)."""
    longest, source = longest or longest_row(cfg)
    budgets = [("ref.max_tokens_per_microbatch", cfg.ref.max_tokens_per_microbatch, "ref"),
               ("reward.model_max_tokens_per_microbatch", cfg.reward.model_max_tokens_per_microbatch, "reward")]
    for role in ("actor", "critic"):
        update = getattr(cfg, role)
        budgets += [(f"{role}.max_tokens_per_microbatch", update.max_tokens_per_microbatch, role),
                    (f"{role}.forward_max_tokens_per_microbatch", update.forward_max_tokens_per_microbatch, role)]
    for key, budget, role in budgets:
        if role in layouts:
            problems.check(check_budget_fits, key, budget, longest, source)


def rollout_dtype(cfg: RlhfConfig) -> torch.dtype:
    return cfg.model.torch_dtype if cfg.rollout.dtype == "auto" else getattr(torch, cfg.rollout.dtype)


def shares_weights(cfg: RlhfConfig, layouts: dict) -> bool:
    """The colocated native engine in the actor's own layout and dtype generates with the actor's parameter
    tensors (a LoRA actor's adapters merged into its packed weights at each new policy version)."""
    return (cfg.rollout.engine == "native" and layouts["rollout"] == layouts["actor"]
            and rollout_dtype(cfg) == cfg.model.torch_dtype)


def resolved_sleep(cfg: RlhfConfig) -> str:
    return cfg.rollout.resolved_sleep(accelerator=platform.has_accelerator(),
                                      keeps_base=cfg.lora.enabled and cfg.lora.sync == "adapter")


def check_routing_replay(cfg: RlhfConfig, layouts: dict) -> None:
    """algo.routing_replay needs an MoE policy; r3 an engine that records routing; r2, and recompute, an actor
    at pp=1 (the replay hooks hold one micro-batch's routing at a time)."""
    mode = cfg.algo.routing_replay
    if mode == "none":
        return
    if not model_dims(cfg.model.path).num_experts:
        raise ConfigError(f"algo.routing_replay={mode} replays MoE routing, but model.path={cfg.model.path} is a "
                          f"dense model; set algo.routing_replay=none")
    if mode == "r3" and cfg.rollout.engine != "native":
        raise ConfigError(f"algo.routing_replay=r3 replays the rollout's routing, which rollout.engine="
                          f"{cfg.rollout.engine} cannot record; use rollout.engine=native, or algo.routing_replay=r2 "
                          f"(routing recorded in the old-logprob forward)")
    if cfg.model.recompute and layouts["actor"].pp > 1:  # 1F1B recomputes a micro-batch after the next's forward
        raise ConfigError(f"algo.routing_replay={mode} with model.recompute=true needs mesh.actor.pp=1, got pp="
                          f"{layouts['actor'].pp}; set model.recompute=false or mesh.actor.pp=1")
    if mode == "r2" and layouts["actor"].pp > 1:
        raise ConfigError(f"algo.routing_replay=r2 records routing at mesh.actor.pp=1 only, got pp="
                          f"{layouts['actor'].pp}; use algo.routing_replay=r3 or mesh.actor.pp=1")


def check_moe_settings(cfg: RlhfConfig) -> None:
    """model.moe.* changed from its defaults needs a model with experts (the policy, or the critic it builds)."""
    default = MoeConfig()
    changed = [f"model.moe.{f.name}={getattr(cfg.model.moe, f.name)!r}" for f in dataclasses.fields(MoeConfig)
               if getattr(cfg.model.moe, f.name) != getattr(default, f.name)]
    if not changed:
        return
    paths = [cfg.model.path] + ([cfg.model.critic_path] if cfg.algo.uses_critic and cfg.model.critic_path else [])
    if not any(model_dims(path).num_experts for path in paths):
        raise ConfigError(f"{', '.join(changed)} configure MoE routing, but model.path={cfg.model.path} is a dense "
                          "model (no experts): they would do nothing; unset them")


def plan_layouts(cfg: RlhfConfig, world_size: int) -> dict:
    """Every role's layout for `world_size` ranks (pure; a ConfigError when they cannot be planned)."""
    return plan_meshes(mesh_config(cfg), world_size, model_dims(cfg.model.path), role_dims(cfg))


def check_layouts(cfg: RlhfConfig, world_size: int, problems: Problems | None = None) -> dict | None:
    """Every role's layout for `world_size` ranks, with the batch-split and memory-phase rules checked (pure);
    None (with the problem recorded) when the layouts cannot be planned."""
    with collecting(problems) as problems:
        layouts = problems.check(plan_layouts, cfg, world_size)
        if layouts is None:
            return None
        check_batches(cfg, layouts, problems)
        problems.check(check_sleep, resolved_sleep(cfg), shares_weights(cfg, layouts))
        correction = cfg.algo.rollout_correction.resolved(weights_shared=shares_weights(cfg, layouts))
        problems.check(check_async, cfg, layouts, dataclasses.replace(cfg.algo, rollout_correction=correction))
        problems.check(check_routing_replay, cfg, layouts)
        problems.check(check_moe_settings, cfg)
        problems.check(check_multiturn, cfg)
        problems.check(check_algo_settings, cfg)
        problems.check(check_lora, cfg)
        problems.check(check_lora_adapter, cfg)
    return layouts


def build_meshes(cfg: RlhfConfig) -> RoleMeshes:
    """Create every role's process groups (collective over the world)."""
    return build_role_meshes(mesh_config(cfg), model_dims(cfg.model.path), timeout_s=cfg.dist.timeout_s,
                             role_dims=role_dims(cfg))


def check_engine_installed(cfg: RlhfConfig) -> None:
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(VLLM_INSTALL_HINT)


def position_models(cfg: RlhfConfig) -> list[tuple[str, str]]:
    """(key, folder) of every model that reads prompt + response: policy (actor, ref, rollout), critic, reward,
    teachers."""
    models = [("model.path", cfg.model.path)]
    if cfg.algo.uses_critic and cfg.model.critic_path:
        models.append(("model.critic_path", cfg.model.critic_path))
    if cfg.reward.model_path:
        models.append(("reward.model_path", cfg.reward.model_path))
    return models + teacher_folders(cfg)


def check_positions(cfg: RlhfConfig, longest_prompt: int, label: str) -> None:
    """The longest prompt + sampling.max_new_tokens fits every model's position table (past it, RoPE models
    train on positions they never saw: reward 0 and no word)."""
    needed = longest_prompt + cfg.sampling.max_new_tokens
    for key, path in position_models(cfg):
        positions = getattr(read_hf_config(path, key), "max_position_embeddings", None)
        if positions is not None and needed > positions:
            raise ConfigError(
                f"the longest prompt in {label} ({longest_prompt} tokens) + sampling.max_new_tokens="
                f"{cfg.sampling.max_new_tokens} = {needed} positions, but {key}={path!r} has max_position_embeddings="
                f"{positions}; lower sampling.max_new_tokens, or data.max_prompt_length with data.truncation=filter "
                f"(or left), to fit {positions}")


def length_policy_note(prompts: TokenizedPrompts, cfg: RlhfConfig, label: str) -> str | None:
    """One line counting the prompts data.truncation dropped or cut (they are not an error, but not silent)."""
    if not prompts.num_filtered and not prompts.num_truncated:
        return None
    total = len(prompts.records) + prompts.num_filtered
    done = (f"{prompts.num_filtered} dropped" if cfg.data.truncation == "filter"
            else f"{prompts.num_truncated} truncated ({cfg.data.truncation} end cut)")
    return (f"{label}: {done} of {total} prompts longer than data.max_prompt_length={cfg.data.max_prompt_length} "
            f"tokens (data.truncation={cfg.data.truncation})")


def check_distill_topk(cfg: RlhfConfig) -> None:
    """The top-K distillation estimator against the models' vocabularies and the head."""
    teachers = [(key, read_hf_config(path, key).vocab_size) for key, path in teacher_folders(cfg)]
    check_topk(cfg.algo.distill, read_hf_config(cfg.model.path).vocab_size, teachers, cfg.model.fused_head)


def _check_data(cfg: RlhfConfig, problems: Problems, batch_key: str) -> list[str]:
    """Tokenizer, prompt files, their lengths against the models and the KV cache, reward sources; the notes.
    `batch_key` names the setting the prompts per step come from."""
    problems.check(check_dataset_files, cfg.data.train_files, "data.train_files")
    if cfg.data.val_files:
        problems.check(check_dataset_files, cfg.data.val_files, "data.val_files")
    if problems.check(read_hf_config, cfg.model.path) is None:
        return []  # the data checks read the policy's tokenizer and positions
    tokenizer = problems.check(load_tokenizer, cfg.model.path)
    if tokenizer is None:
        return []
    problems.check(check_reward_tokenizer, cfg, tokenizer)
    problems.check(check_teacher_tokenizers, cfg, tokenizer)
    if cfg.algo.distill.enable:
        problems.check(check_distill_topk, cfg)
    if cfg.multiturn.enable:  # tool config, agent file, the template and the tool-call tokens
        problems.check(MultiTurnRollout.from_config, cfg.multiturn, tokenizer)
    train = problems.check(load_prompts, cfg.data.train_files, tokenizer, cfg.data)
    if train is not None:  # enough prompts for one step (the dp split is check_batch_sizes')
        problems.check(PromptSampler, num_samples=len(train.records), global_batch_size=cfg.data.prompts_per_step,
                       dp_rank=0, dp_size=1, seed=cfg.data.seed, batch_key=batch_key)
        if cfg.algo.distill.enable:
            problems.check(route_teachers, cfg.algo.distill, train.records)
    val = (problems.check(load_prompts, cfg.data.val_files, tokenizer, cfg.data, label="data.val_files")
           if cfg.data.val_files else None)
    sets = [(prompts, label) for prompts, label in ((train, "data.train_files"), (val, "data.val_files")) if prompts]
    if not sets:
        return []
    longest, label = max((max(prompts.lengths), label) for prompts, label in sets)
    problems.check(check_positions, cfg, longest, label)
    problems.check(check_kv_cache, cfg, longest)
    # the reward model scores training; rule rewards then only score validation
    records = ([] if cfg.reward.model_path or train is None else train.records) + (val.records if val else [])
    problems.check(Scorer(cfg.reward, tokenizer).check_sources, records)
    return [note for prompts, label in sets if (note := length_policy_note(prompts, cfg, label))]


def preflight(cfg: RlhfConfig, world_size: int, batch_key: str = "data.prompts_per_step") -> list[str]:
    """Every input check that needs no process group, run before the run folder exists: bad input writes nothing.
    All problems are raised at once (see `Problems.raise_all`); returns the notes worth a line (prompts the
    length policy dropped or cut). `batch_key`: the setting the prompts per step come from (`rlhf sft`'s own)."""
    problems = Problems()
    problems.check(check_metrics_endpoint, cfg)
    problems.check(check_writable_folder, cfg.run.output_dir, "run.output_dir")
    problems.check(check_resume_path, cfg.checkpoint.resume)
    problems.check(check_loggers, cfg.trainer.loggers)
    problems.check(check_engine_installed, cfg)
    problems.check(check_context_parallel, cfg)
    check_layouts(cfg, world_size, problems)
    problems.check(check_model_folders, cfg)
    notes = _check_data(cfg, problems, batch_key)
    problems.raise_all()
    return notes


def resolved_algo(cfg: RlhfConfig, layouts: dict):
    """The algorithm with rollout correction's `auto` decided: on unless the engine shares the actor's weights."""
    correction = cfg.algo.rollout_correction.resolved(weights_shared=shares_weights(cfg, layouts))
    if cfg.algo.rollout_correction.enable == "auto":
        log.info("rollout correction (auto): %s", "on, the rollout engine has its own weights" if correction.enable
                 else "off, the rollout engine samples with the actor's own weights")
    return dataclasses.replace(cfg.algo, rollout_correction=correction)
