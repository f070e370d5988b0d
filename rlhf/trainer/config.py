"""Config sections of the RL trainer (model, sampling, algorithm, roles, loop) and their cross-checks."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rlhf.algo.config import (AdvantageConfig, AdvantageKind, FilterGroupsConfig, KLConfig, OverlongBufferConfig,
                              PolicyLossConfig, RolloutCorrectionConfig, ValueLossConfig)
from rlhf.errors import ConfigError
from rlhf.models.config import MoeConfig, check_replay_mode
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.train.config import OptimConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16")  # names of torch dtypes; torch is imported only where tensors are built


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
        self.path, self.critic_path = os.path.expanduser(self.path), os.path.expanduser(self.critic_path)
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
    forwards, r2 the old-logprob forward's in the update)."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
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

    Every mini-batch is one optimizer step; `micro_batch_size` sequences go through one forward per DP rank.
    Skipping the separate old-logprob forward (actor, strictly on-policy: one epoch, one mini-batch) makes the
    update's own logprobs, detached, the old ones (ratio exactly 1, same gradient); KL in the reward and
    decoupled rollout correction read old logprobs, so they run that forward whatever the setting.
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1  # passes over each step's batch (PPO epochs)
    mini_batches: int = 1  # optimizer steps per epoch (the batch is split into this many)
    micro_batch_size: int = 8  # sequences per forward/backward on one DP rank (gradient accumulation)
    # actor: auto runs the separate old-logprob forward only when the update is not strictly on-policy
    recompute_old_logprobs: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for name in ("epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.recompute_old_logprobs not in (True, False, "auto"):
            raise ConfigError(f"recompute_old_logprobs={self.recompute_old_logprobs!r} must be auto, true or false")
        if self.recompute_old_logprobs is False and (self.epochs, self.mini_batches) != (1, 1):
            raise ConfigError(f"recompute_old_logprobs=false needs one on-policy update per batch, got epochs="
                              f"{self.epochs} and mini_batches={self.mini_batches}; set both to 1 or use auto")

    @property
    def old_logprobs_forward(self) -> bool:
        """Whether the update itself needs the separate old-logprob forward (auto: unless strictly on-policy)."""
        if self.recompute_old_logprobs == "auto":
            return (self.epochs, self.mini_batches) != (1, 1)
        return bool(self.recompute_old_logprobs)


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy: `offload` parks its weights on the host while the rollout engine runs;
    `micro_batch_size` sequences go through one forward per DP rank."""

    offload: bool = False  # park the reference weights on the host while the rollout engine runs
    micro_batch_size: int = 8  # sequences per reference forward on each DP rank

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"ref.micro_batch_size={self.micro_batch_size} must be >= 1")


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


ASYNC_MODES = ("off", "one_step_off")


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop: steps, validation cadence, logging. `logger`: where metrics go (`tensorboard=false` drops
    TensorBoard too); wandb and mlflow runs are named `project_name` / `experiment_name` (default: the run's
    name). `val_samples` validation generations per validation go to samples.jsonl and TensorBoard text.
    `dump_rollouts`: every `dump_every`-th step's scored rollouts as rollouts/step_<N>.parquet (`rlhf replay`).
    `plot`: every run ends by drawing `curve.png` in its folder (reward, validation, KL, response length per
    step; needs matplotlib). `async_mode=one_step_off` (split placement): the rollout ranks generate
    `max_staleness` batches ahead of the update (`rlhf.orchestration.async_schedule`); `partial_rollout_tokens` > 0:
    each batch's generation spans a weight push after that many tokens per row."""

    total_steps: int = 10  # RL steps to run (a resumed run continues up to this count)
    val_every: int = 0  # validate every N steps; 0: only before training and at the end
    val_before_train: bool = True  # validate once before the first step
    tensorboard: bool = True  # also write TensorBoard events to <run>/tensorboard
    plot: bool = True  # draw <run>/curve.png at the end (reward, validation, KL, response length; needs matplotlib)
    # metric writers: console, jsonl (metrics.jsonl, samples.jsonl), tensorboard, wandb, mlflow
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "rlhf"  # wandb / mlflow project
    experiment_name: str = ""  # wandb / mlflow run name; empty: the run folder's name
    val_samples: int = 4  # validation generations logged as text per validation (samples.jsonl, TensorBoard)
    dump_rollouts: bool = False  # write scored rollouts to <run>/rollouts/step_<N>.parquet (for rlhf replay)
    dump_every: int = 1  # dump every N-th step
    async_mode: str = "off"  # one_step_off: rollout ranks generate ahead of the update (split placement only)
    max_staleness: int = 1  # batches the rollout ranks run ahead (k-step-off); 1: one-step-off
    partial_rollout_tokens: int = 0  # tokens per row before a weight push lands mid-generation; 0: off

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"trainer.total_steps={self.total_steps} must be >= 1")
        if self.val_every < 0:
            raise ConfigError(f"trainer.val_every={self.val_every} must be >= 0 (0: only before and after)")
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger={self.logger} has unknown logger(s) {', '.join(map(str, unknown))}; "
                              f"choose from {', '.join(LOGGERS)}")
        if self.val_samples < 0:
            raise ConfigError(f"trainer.val_samples={self.val_samples} must be >= 0 (0: no generations logged)")
        if self.dump_every < 1:
            raise ConfigError(f"trainer.dump_every={self.dump_every} must be >= 1")
        if self.async_mode not in ASYNC_MODES:
            raise ConfigError(f"trainer.async_mode={self.async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
        if self.max_staleness < 1:
            raise ConfigError(f"trainer.max_staleness={self.max_staleness} must be >= 1 (1: one-step-off)")
        if self.partial_rollout_tokens < 0:
            raise ConfigError(f"trainer.partial_rollout_tokens={self.partial_rollout_tokens} must be >= 0 (0: off)")
        if self.dump_rollouts and self.async_mode != "off":
            raise ConfigError("trainer.dump_rollouts does not work with trainer.async_mode=one_step_off yet (rank 0 "
                              "may hold no trained batch); set one of them off")

    @property
    def is_async(self) -> bool:
        return self.async_mode != "off"

    @property
    def loggers(self) -> list[str]:
        """The metric writers in use (`tensorboard=false` drops TensorBoard from the list)."""
        return [name for name in self.logger if name != "tensorboard" or self.tensorboard]


@dataclass(kw_only=True)
class ReplayConfig:
    """`rlhf replay`: `rollouts` is the folder of step dumps to train on (`--rollouts`); `reward_norm` divides
    each step's scores by the running std of every score replayed so far (RunningMeanStd; signs are kept)."""

    rollouts: str = ""  # folder of step dumps (<run>/rollouts of a run with trainer.dump_rollouts); or --rollouts
    reward_norm: bool = False  # divide each step's scores by the running std of all scores replayed so far


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

    steps: int = 100  # optimizer steps
    batch_size: int = 64  # examples per optimizer step
    val_every: int = 0  # validate every N steps; 0: only at the end
    out_dir: str = ""  # export the SFT policy as an HF folder here; empty: no export

    def __post_init__(self) -> None:
        self.out_dir = os.path.expanduser(self.out_dir)
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"sft.steps={self.steps} and sft.batch_size={self.batch_size} must be >= 1")
