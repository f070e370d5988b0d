"""Config sections of the RL stages (model, sampling, algorithm, the roles' updates) and their cross-checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rlhf.algo.config import (AdvantageConfig, AdvantageKind, FilterGroupsConfig, KLConfig, OverlongBufferConfig,
                              PolicyLossConfig, ValueLossConfig)
from rlhf.algo.correction_config import RolloutCorrectionConfig
from rlhf.config.loader import local_folder
from rlhf.errors import ConfigError
from rlhf.models.config import MoeConfig, check_replay_mode
from rlhf.stages.distill_config import DistillConfig
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.train.config import AUTOCASTS, OptimConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16")  # names of torch dtypes; torch is imported only where tensors are built
# a packing budget in tokens (0: row-count micro-batches) or `auto`, which the root config resolves to an int
# (`rlhf.orchestration.schema.resolve_token_budgets`) before anything reads it
TokenBudget = int | Literal["auto"]


@dataclass(kw_only=True)
class ModelConfig:
    """HF folders: `path` initialises actor, reference and rollout; the critic starts from `critic_path`
    (default: `path`, with a fresh value head). `recompute`: full activation recomputation in the actor.
    `fused_head`: actor/ref logprobs come from hidden states through a chunked, fused LM head on response
    tokens only, never materialising [tokens, vocab] logits (`rlhf.models.lm_head`); off = from full logits.
    `dtype`: the roles' parameter dtype (rollout included when it shares the actor's weights); with bfloat16,
    megatron's optimizer keeps fp32 master weights and gradients are reduced in fp32. `moe`: router losses and
    token dispatcher of MoE models (ignored for dense ones)."""

    path: str = ""  # HF folder (safetensors + tokenizer) of the actor, reference and rollout engine
    critic_path: str = ""  # HF folder the critic starts from; empty: `path` with a fresh value head
    recompute: bool = False  # full activation recomputation in the actor (less memory, one more forward)
    fused_head: bool = True  # logprobs through a chunked fused LM head on response tokens, never [tokens, vocab]
    dtype: str = "float32"  # parameters of every role; bfloat16 trains with fp32 master weights and fp32 grads
    moe: MoeConfig = field(default_factory=MoeConfig)

    def __post_init__(self) -> None:
        self.path, self.critic_path = local_folder(self.path), local_folder(self.critic_path)
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


@dataclass(kw_only=True)
class SamplingConfig:
    """Training rollouts (`n` samples per prompt) and validation decoding (greedy by default).

    `ignore_eos` makes training rollouts always run `max_new_tokens` (fixed-length benchmarks). The actor and
    reference score tokens at the sampling `temperature` (`logprob_temperature`), as verl does."""

    n: int = 4  # samples per prompt in training rollouts (GRPO/RLOO group size)
    max_new_tokens: int = 64  # response length limit (training and validation)
    temperature: float = 1.0  # training sampling temperature; 0 is greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 is off
    top_k: int = -1  # top-k filter; -1 is off
    seed: int = 0  # sampling seed (mixed with the step and the engine's DP rank)
    val_n: int = 1  # samples per validation prompt (mean@n, pass@n when > 1)
    val_temperature: float = 0.0  # validation temperature; 0 is greedy
    ignore_eos: bool = False  # training rollouts always run max_new_tokens (fixed-length benchmarks)

    def __post_init__(self) -> None:
        self._check_can_generate()
        self.train_params(0)
        self.val_params(0)

    def _check_can_generate(self) -> None:
        """Settings under which no rollout can be generated, named by their config keys (at config load)."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens={self.max_new_tokens!r} cannot generate: every response "
                              "needs at least one token; set it >= 1")
        if self.top_p <= 0:
            greedy = " (greedy)" if self.temperature == 0 else ""
            raise ConfigError(f"sampling.temperature={self.temperature:g}{greedy} with sampling.top_p={self.top_p:g} "
                              "cannot generate: top_p=0 keeps no token; use top_p=1.0 (top_p is ignored when "
                              "greedy) or a value in (0, 1]")
        if self.n < 1 or self.val_n < 1:
            raise ConfigError(f"sampling.n={self.n} and sampling.val_n={self.val_n} (samples per prompt) must be >= 1")
        if self.val_temperature == 0 and self.val_n > 1:
            raise ConfigError(f"sampling.val_n={self.val_n} with sampling.val_temperature=0 (greedy) gives "
                              f"{self.val_n} identical responses per prompt; use sampling.val_n=1 or "
                              "sampling.val_temperature > 0")

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
    forwards, r2 the old-logprob forward's in the update); on-policy distillation from teachers (`distill`)."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    overlong_filter: bool = False  # truncated responses (hit max_new_tokens) leave the loss
    # MoE routing replay: none; r3 replays the rollout's experts in every training forward; r2 the old-logprob
    # forward's experts in the update
    routing_replay: str = "none"

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

    Every mini-batch is one optimizer step; rows are bin-packed into packed (THD) micro-batches of at most
    `max_tokens_per_microbatch` tokens (verl's ppo_max_token_len_per_gpu; auto: `micro_batch_size` x the longest
    row a step can have), or with 0 go `micro_batch_size` sequences at a time through one forward per DP rank;
    `forward_max_tokens_per_microbatch` is the budget of the forward-only passes (old logprobs, values; verl's
    log_prob_max_token_len_per_gpu; 0: the update's).
    Skipping the separate old-logprob forward (actor, strictly on-policy: one epoch, one mini-batch) makes the
    update's own logprobs, detached, the old ones (ratio exactly 1, same gradient); KL in the reward and
    decoupled rollout correction read old logprobs, so they run that forward whatever the setting.
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1  # passes over each step's batch (PPO epochs)
    mini_batches: int = 1  # optimizer steps per epoch (the batch is split into this many)
    micro_batch_size: int = 8  # sequences per forward/backward on one DP rank (gradient accumulation)
    # packed micro-batches of at most this many tokens; auto: micro_batch_size x the longest row; 0: row counts
    max_tokens_per_microbatch: TokenBudget = "auto"
    forward_max_tokens_per_microbatch: int = 0  # forward-only passes' budget; 0: max_tokens_per_microbatch
    # actor: auto runs the separate old-logprob forward only when the update is not strictly on-policy
    recompute_old_logprobs: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for name in ("epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        check_token_budget("max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        check_token_budget("forward_max_tokens_per_microbatch", self.forward_max_tokens_per_microbatch,
                           allow_auto=False)
        if self.recompute_old_logprobs not in (True, False, "auto"):
            raise ConfigError(f"recompute_old_logprobs={self.recompute_old_logprobs!r} must be auto, true or false")
        if self.recompute_old_logprobs is False and (self.epochs, self.mini_batches) != (1, 1):
            raise ConfigError(f"recompute_old_logprobs=false needs one on-policy update per batch, got epochs="
                              f"{self.epochs} and mini_batches={self.mini_batches}; set both to 1 or use auto")

    @property
    def forward_tokens_per_microbatch(self) -> int:
        """The forward-only passes' token budget (0: row-count micro-batches)."""
        return self.forward_max_tokens_per_microbatch or self.max_tokens_per_microbatch

    @property
    def old_logprobs_forward(self) -> bool:
        """Whether the update itself needs the separate old-logprob forward (auto: unless strictly on-policy)."""
        if self.recompute_old_logprobs == "auto":
            return (self.epochs, self.mini_batches) != (1, 1)
        return bool(self.recompute_old_logprobs)


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy: `offload` parks its weights on the host while the rollout engine runs; its
    forwards take packed micro-batches of at most `max_tokens_per_microbatch` tokens (auto: `micro_batch_size` x
    the longest row, or the actor's forward-only budget where that is larger), or with 0 `micro_batch_size`
    sequences at a time on each DP rank. `autocast`: its forwards' matmuls in bf16 autocast (fp32 weights); auto:
    as the actor's `optim.autocast`, so on the step's first batch the KL term sees the same numerics on both sides."""

    offload: bool = False  # park the reference weights on the host while the rollout engine runs
    autocast: str = "auto"  # auto: the actor's optim.autocast; none; bfloat16
    micro_batch_size: int = 8  # sequences per reference forward on each DP rank
    # packed micro-batches of at most this many tokens; auto: micro_batch_size x the longest row, at least the
    # actor's forward-only budget; 0: row counts
    max_tokens_per_microbatch: TokenBudget = "auto"

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"ref.micro_batch_size={self.micro_batch_size} must be >= 1")
        check_token_budget("ref.max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        if self.autocast not in ("auto", *AUTOCASTS):
            raise ConfigError(f"ref.autocast={self.autocast!r} is not one of auto, {', '.join(AUTOCASTS)}")


def check_token_budget(key: str, budget: TokenBudget, *, allow_auto: bool = True) -> None:
    """A micro-batch token budget is auto (where allowed), 0 (row-count micro-batches) or a positive token count."""
    if budget == "auto" and allow_auto:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        auto = "auto, " if allow_auto else ""
        raise ConfigError(f"{key}={budget!r} must be {auto}0 (row-count micro-batches) or a token count >= 1")


def check_budget_fits(key: str, budget: int, longest_row: int, source: str) -> None:
    """A packing budget must hold the longest row a step can have (`source` says where that length comes from)."""
    if 0 < budget < longest_row:
        raise ConfigError(f"{key}={budget} is smaller than the longest row, {longest_row} tokens ({source}); "
                          f"raise {key} to at least {longest_row}")


def check_batch_sizes(*, prompts_per_step: int, n: int, rollout_dp: int, role: str, role_dp: int,
                      update: UpdateConfig) -> None:
    """Every split of a step's rollouts must come out whole; the message names the numbers and the knob."""
    if prompts_per_step % rollout_dp:
        raise ConfigError(f"data.prompts_per_step={prompts_per_step} is not divisible by the rollout dp size "
                          f"{rollout_dp}; use a multiple of {rollout_dp}")
    rollouts = prompts_per_step * n
    per_mini = rollouts // update.mini_batches
    micro = 1 if update.max_tokens_per_microbatch else update.micro_batch_size  # packing: any row count
    if rollouts % update.mini_batches or per_mini % role_dp or (per_mini // role_dp) % micro:
        raise ConfigError(
            f"{role}: {rollouts} rollouts per step (data.prompts_per_step={prompts_per_step} x sampling.n={n}) "
            f"must split into {role}.mini_batches={update.mini_batches} x dp={role_dp} x "
            f"micro-batches of {role}.micro_batch_size={update.micro_batch_size}; "
            f"make {update.mini_batches}*{role_dp}*{update.micro_batch_size} divide {rollouts}")
