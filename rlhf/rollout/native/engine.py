"""`native` engine: the megatron-core model in the rollout layout, KV-cached, with continuous slot refill.

Prompts are prefilled in batches straight into cache slots; the n samples of a prompt share its prefill
(the slot is copied, not recomputed). Every step decodes one token for all occupied slots; a finished
sequence frees its slot at once and the next waiting prompt is prefilled into free slots.
"""

from __future__ import annotations

from collections.abc import Iterable
import torch
import torch.distributed as dist

from rlhf.errors import ConfigError
from rlhf.models.lora import has_adapters
from rlhf.rollout.config import NativeEngineConfig
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.native.forward import Decoder
from rlhf.rollout.native.generation import Generation
from rlhf.rollout.native.kv_cache import KVCache
from rlhf.rollout.native.params import decoder_geometry, decoder_params
from rlhf.rollout.sampling_params import SamplingParams, replica_seed
from rlhf.rollout.stops import stop_token_set
from rlhf.rollout.types import PromptBatch, Rollouts


class NativeEngine:
    """Generates with a megatron GPTModel (pp=1) whose TP group is `tp_group` (None when tp=1)."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, config: NativeEngineConfig,
                 eos_token_ids: tuple[int, ...] = (), layout: EngineLayout = EngineLayout(),
                 tp_group: dist.ProcessGroup | None = None) -> None:
        self.model = model.eval()
        self.config, self.layout = config, layout
        self.eos_token_ids = tuple(eos_token_ids)
        self._weights_epoch = 0
        self.policy_version = 0
        geometry = decoder_geometry(model, vocab_size, layout.tp, layout.tp_rank)
        params = decoder_params(model)
        self.decoder = Decoder(params=params, geometry=geometry, tp_group=tp_group, tp_size=layout.tp,
                               max_seq_len=config.max_seq_len, pack_weights=config.pack_weights,
                               batch_hint=config.max_batch_size, fused_kernels=config.fused_kernels,
                               max_prefill_tokens=config.max_prefill_tokens)
        self.cache = KVCache(num_layers=geometry.num_layers, num_slots=config.max_batch_size,
                             num_kv_heads=geometry.num_groups, max_seq_len=config.max_seq_len,
                             head_dim=geometry.head_dim, dtype=params.embedding.dtype,
                             device=params.embedding.device)
        self._released_shapes: dict[str, torch.Size] = {}
        # routing replay (R3): rollouts carry each token's experts per routed layer (MoE models only)
        self.record_routing = False

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        """Every weight update sets the version (load_weights, shared-weight sync, resume): the next
        generate re-prepares the packed weights from the parameters."""
        self._policy_version = value
        self._weights_epoch += 1

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> Rollouts:
        if not self.cache.allocated:
            raise RuntimeError("NativeEngine.generate while asleep: call wake() first")
        if self._released_shapes:
            raise RuntimeError("NativeEngine.generate after a weight release: call load_weights() first")
        self.cache.check_fits(prompts.prompt_lengths_b.tolist(), prompts.new_token_caps(params.max_new_tokens),
                              params.n)
        generator = torch.Generator(device=self.cache.device)
        generator.manual_seed(replica_seed(params.seed, self.layout.dp_rank))
        stops = stop_token_set(params, self.eos_token_ids)
        with torch.inference_mode():
            if self.decoder.prepared_version != self._weights_epoch and has_adapters(self.model):
                self.decoder.params = decoder_params(self.model)  # LoRA: merge the current adapters again
            self.decoder.prepare(self._weights_epoch)
            run = Generation(self.decoder, self.cache, prompts, params, stops, generator,
                             record_routing=self.record_routing and self.decoder.routes)
            return run.run(policy_version=self.policy_version)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Megatron parameter names, already sharded for this engine's tp; copied in place."""
        named = dict(self.model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in named:
                    raise ConfigError(f"NativeEngine.load_weights: unknown parameter {name!r}")
                if name in self._released_shapes:
                    named[name].data = torch.empty(self._released_shapes[name], dtype=named[name].dtype,
                                                   device=named[name].device)
                if named[name].shape != tensor.shape:
                    raise ConfigError(f"NativeEngine.load_weights: {name} has shape {tuple(tensor.shape)}, "
                                      f"the engine's shard is {tuple(named[name].shape)} (wrong tp sharding?)")
                named[name].copy_(tensor)
                loaded.add(name)
        missing = sorted(set(self._released_shapes) - loaded)
        if missing:
            raise ConfigError(f"NativeEngine.load_weights after a weight release is missing {missing[:5]}")
        self._released_shapes = {}
        self.policy_version += 1

    def sleep(self, release_weights: bool = False) -> None:
        """Free the KV cache; with `release_weights`, also drop the parameter storage (reload before use).

        Only release weights when this engine owns its model copy (not when it shares the actor's).
        """
        self.cache.release()
        if release_weights:
            self.decoder.release()
            for name, param in self.model.named_parameters():
                self._released_shapes[name] = param.shape
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def wake(self, kv_cache: bool = True) -> None:
        """Re-allocate the KV cache (released weights come back through `load_weights`, which needs no wake)."""
        if kv_cache:
            self.cache.allocate()
