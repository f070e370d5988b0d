"""Config sections of the RL trainer (model, sampling, algorithm, roles, loop) and their cross-checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhf.algo.advantages import AdvantageConfig, AdvantageKind
from rlhf.algo.dapo import FilterGroupsConfig, OverlongBufferConfig
from rlhf.algo.kl import KLConfig
from rlhf.algo.policy_loss import PolicyLossConfig
from rlhf.algo.rollout_correction import RolloutCorrectionConfig
from rlhf.algo.value_loss import ValueLossConfig
from rlhf.errors import ConfigError
from rlhf.models.routing import MoeConfig
from rlhf.models.routing_replay import check_replay_mode
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.train.config import OptimConfig


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True)
class ModelConfig:
    """HF folders: `path` initialises actor, reference and rollout; the critic starts from `critic_path`
    (default: `path`, with a fresh value head). `recompute`: full activation recomputation in the actor.
    `fused_head`: actor/ref logprobs come from hidden states through a chunked, fused LM head on response
    tokens only, never materialising [tokens, vocab] logits (`rlhf.models.lm_head`); off = from full logits.
    `dtype`: the roles' parameter dtype (rollout included when it shares the actor's weights); with bfloat16,
    megatron's optimizer keeps fp32 master weights and gradients are reduced in fp32. `moe`: router losses and
    token dispatcher of MoE models (ignored for dense ones)."""

    path: str = ""
    critic_path: str = ""
    recompute: bool = False
    fused_head: bool = True
    dtype: str = "float32"  # parameters of every role; bfloat16 trains with fp32 master weights and fp32 grads
    moe: MoeConfig = field(default_factory=MoeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(kw_only=True)
class SamplingConfig:
    """Training rollouts (`n` samples per prompt) and validation decoding (greedy by default).

    `ignore_eos` makes training rollouts always run `max_new_tokens` (fixed-length benchmarks). The actor and
    reference score tokens at the sampling `temperature` (`logprob_temperature`), as verl does."""

    n: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    val_n: int = 1
    val_temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.train_params(0)
        self.val_params(0)

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the policy the training rollouts sample from (greedy rollouts: 1)."""
        return self.temperature if self.temperature > 0 else 1.0

    def train_params(self, step: int, gen_round: int = 0) -> SamplingParams:
        """Fresh seed per step (same on every rank; engines mix in their DP rank); extra generation rounds of a
        step (dynamic sampling) step by a prime, so they never reuse another step's seed."""
        seed = self.seed + 1_000 * step + 1_000_003 * gen_round
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, n=self.n, seed=seed,
                              ignore_eos=self.ignore_eos)

    def val_params(self, step: int) -> SamplingParams:
        greedy = self.val_temperature == 0
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.val_temperature,
                              top_p=1.0 if greedy else self.top_p, top_k=-1 if greedy else self.top_k,
                              n=self.val_n, seed=self.seed + 7 + 1_000 * step)


@dataclass(kw_only=True)
class AlgoConfig:
    """The RL algorithm: the advantage estimator picks it (gae = PPO with a critic), plus losses and KL;
    rollout correction for rollout != training numerics; DAPO's dynamic sampling (`filter_groups`) and
    overlong handling (`overlong_buffer` reward shaping, `overlong_filter`: truncated responses leave the loss);
    MoE routing replay (`routing_replay`: r3 replays the rollout's experts in the old-logprob, ref and update
    forwards, r2 the old-logprob forward's in the update)."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False
    routing_replay: str = "none"  # MoE: none | r2 | r3 (rlhf.models.routing_replay)

    def __post_init__(self) -> None:
        check_replay_mode(self.routing_replay)

    @property
    def uses_critic(self) -> bool:
        return self.advantage.kind == AdvantageKind.GAE

    @property
    def uses_ref(self) -> bool:
        return self.kl.coef > 0


@dataclass(kw_only=True)
class UpdateConfig:
    """One trained role: optimizer, and how each step's batch is split (epochs x mini-batches x micro-batches).

    Every mini-batch is one optimizer step; `micro_batch_size` sequences go through one forward per DP rank.
    `recompute_old_logprobs=False` (actor, strictly on-policy: one epoch, one mini-batch) skips the separate
    old-logprob forward: the update's own logprobs, detached, are the old ones (ratio exactly 1, same gradient);
    decoupled rollout correction still runs that forward (it compares pi_old with the rollout's policy).
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 8
    recompute_old_logprobs: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.recompute_old_logprobs and (self.epochs, self.mini_batches) != (1, 1):
            raise ConfigError(f"recompute_old_logprobs=false needs one on-policy update per batch, got epochs="
                              f"{self.epochs} and mini_batches={self.mini_batches}; set both to 1 or keep true")


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy: `offload` parks its weights on the host while the rollout engine runs."""

    offload: bool = False


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop: steps, validation cadence, logging."""

    total_steps: int = 10
    val_every: int = 0
    val_before_train: bool = True
    tensorboard: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"trainer.total_steps={self.total_steps} must be >= 1")
        if self.val_every < 0:
            raise ConfigError(f"trainer.val_every={self.val_every} must be >= 0 (0: only before and after)")


def check_batch_sizes(*, prompts_per_step: int, n: int, rollout_dp: int, role: str, role_dp: int,
                      update: UpdateConfig) -> None:
    """Every split of a step's rollouts must come out whole; the message names the numbers and the knob."""
    if prompts_per_step % rollout_dp:
        raise ConfigError(f"data.prompts_per_step={prompts_per_step} is not divisible by the rollout dp size "
                          f"{rollout_dp}; use a multiple of {rollout_dp}")
    rollouts = prompts_per_step * n
    per_mini = rollouts // update.mini_batches
    if rollouts % update.mini_batches or per_mini % role_dp or (per_mini // role_dp) % update.micro_batch_size:
        raise ConfigError(
            f"{role}: {rollouts} rollouts per step (data.prompts_per_step={prompts_per_step} x sampling.n={n}) "
            f"must split into {role}.mini_batches={update.mini_batches} x dp={role_dp} x "
            f"micro-batches of {role}.micro_batch_size={update.micro_batch_size}; "
            f"make {update.mini_batches}*{role_dp}*{update.micro_batch_size} divide {rollouts}")


@dataclass(kw_only=True)
class SftConfig:
    """`steps` optimizer steps of `batch_size` examples; validation every `val_every`; export to `out_dir`."""

    steps: int = 100
    batch_size: int = 64
    val_every: int = 0
    out_dir: str = ""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"sft.steps={self.steps} and sft.batch_size={self.batch_size} must be >= 1")
