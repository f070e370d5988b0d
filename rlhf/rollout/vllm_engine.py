"""`vllm` engine: a colocated vLLM `LLM` in this very process (`external_launcher`), slept around training.

Written against vLLM's documented API (PLATFORM.md) and exercised only with a stand-in so far: it has not
yet run against a real vLLM. vLLM is imported lazily; without it, a ConfigError says how to install it.
Weights arrive in HF names (full tensors; vLLM shards them for its own tp). Sequence around training,
following the memory-friendly order (`rlhf.trainer.memory`): `sleep(release_weights=True)` -> train ->
`wake(kv_cache=False)` -> `load_weights(...)` -> `wake()` (KV cache; else re-acquired by the next `generate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.errors import ConfigError
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.sampling_params import SamplingParams, replica_seed
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts

INSTALL_HINT = ("rollout.engine=vllm needs vLLM, which is not installed: on a CUDA machine run "
                "`pip install 'rlhf[gpu]'` (or `pip install vllm`), or use rollout.engine=native")


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(INSTALL_HINT) from error
    return vllm


@dataclass(kw_only=True)
class VllmEngineConfig:
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 4096
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"rollout gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_model_len < 1:
            raise ConfigError(f"rollout max_model_len={self.max_model_len} must be >= 1")


class VllmEngine:
    """One vLLM replica spanning this process's rollout TP group (every rank runs the same calls)."""

    def __init__(self, hf_path: str, *, config: VllmEngineConfig = VllmEngineConfig(),
                 layout: EngineLayout = EngineLayout(), vllm_module: Any = None) -> None:
        self.vllm = vllm_module or import_vllm()
        self.layout = layout
        self.policy_version = 0
        self.llm = self.vllm.LLM(model=hf_path, tensor_parallel_size=layout.tp,
                                 distributed_executor_backend="external_launcher", enable_sleep_mode=True,
                                 load_format="dummy", gpu_memory_utilization=config.gpu_memory_utilization,
                                 max_model_len=config.max_model_len, dtype=config.dtype,
                                 seed=replica_seed(0, layout.dp_rank))
        self._asleep: set[str] = set()

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> Rollouts:
        if "weights" in self._asleep:
            raise RuntimeError("VllmEngine.generate while the weights sleep: call wake() and load_weights()")
        if "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        requests = [{"prompt_token_ids": prompts.prompt(i)} for i in range(prompts.num_prompts)]
        outputs = self.llm.generate(requests, self._sampling_params(params), use_tqdm=False)
        return rollouts_from_outputs(outputs, params, prompts.pad_token_id, self.policy_version)

    def _sampling_params(self, params: SamplingParams) -> Any:
        return self.vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                        top_k=params.top_k, max_tokens=params.max_new_tokens,
                                        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                        seed=replica_seed(params.seed, self.layout.dp_rank), logprobs=0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors, streamed into the vLLM model (its loader fuses qkv / gate_up and shards)."""
        if "weights" in self._asleep:
            raise RuntimeError("VllmEngine.load_weights while the weights sleep: call wake() first")
        vllm_model(self.llm).load_weights(weights)
        self.policy_version += 1

    def sleep(self, release_weights: bool = False) -> None:
        """Level 1 offloads weights to host and drops the KV cache; level 2 drops both (reload after wake)."""
        self.llm.sleep(level=2 if release_weights else 1)
        self._asleep = {"weights", "kv_cache"}

    def wake(self, kv_cache: bool = True) -> None:
        """Re-acquire weight memory, then the KV cache unless `kv_cache=False` (before a weight push; the next
        generate re-acquires it lazily)."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if kv_cache and "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")


def vllm_model(llm: Any) -> torch.nn.Module:
    """The model inside an in-process (external_launcher) vLLM engine: the one place its internals are read."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def rollouts_from_outputs(outputs: list, params: SamplingParams, pad_token_id: int,
                          policy_version: int) -> Rollouts:
    """vLLM RequestOutputs (one per prompt, n completions each) -> right-padded Rollouts."""
    completions = [(index, c) for index, out in enumerate(outputs) for c in out.outputs]
    width = params.max_new_tokens
    tokens_rt = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    logprobs_rt = torch.zeros((len(completions), width), dtype=torch.float32)
    reasons = []
    for row, (_, completion) in enumerate(completions):
        ids = list(completion.token_ids)
        tokens_rt[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs_rt[row, :len(ids)] = torch.tensor([step[token].logprob for step, token
                                                     in zip(completion.logprobs, ids)])
        reasons.append(FinishReason.STOP if completion.finish_reason == "stop" else FinishReason.LENGTH)
    return Rollouts(response_tokens_rt=tokens_rt, response_logprobs_rt=logprobs_rt,
                    response_scaled_logprobs_rt=None,
                    response_lengths_r=torch.tensor([len(c.token_ids) for _, c in completions], dtype=torch.long),
                    finish_reasons=reasons, prompt_index_r=torch.tensor([i for i, _ in completions], dtype=torch.long),
                    policy_version=policy_version, pad_token_id=pad_token_id)


def hf_named_weights(megatron_weights: Iterable[tuple[str, torch.Tensor]], hf_config: Any) -> Iterator[
        tuple[str, torch.Tensor]]:
    """Full (tp=1) megatron tensors -> HF names and layouts, the form vLLM's `load_weights` takes."""
    from rlhf.dist.layout import ParallelLayout
    from rlhf.models.param_specs import param_specs
    from rlhf.models.shard_rules import merge_shards
    from rlhf.models.spec import ModelSpec

    spec = ModelSpec.from_hf(hf_config)
    by_name = {p.name: p for p in param_specs(hf_config, ParallelLayout()) if not p.tied_copy}
    for name, tensor in megatron_weights:
        if name not in by_name:
            raise ConfigError(f"hf_named_weights: {name!r} is not a parameter of this model")
        yield from merge_shards(by_name[name], [tensor], spec).items()


