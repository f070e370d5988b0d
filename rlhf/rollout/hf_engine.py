"""`hf` engine: `transformers.generate` on an HF model; the parity reference and benchmark baseline."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel

from rlhf.errors import ConfigError
from rlhf.platform import current_device
from rlhf.rollout.engine import EngineLayout
from rlhf.rollout.sampling_params import SamplingParams, replica_seed
from rlhf.rollout.stops import stop_token_set, truncate_at_stop
from rlhf.rollout.types import PromptBatch, Rollouts


class HFEngine:
    """Runs `model.generate` on one rank (tp=1); each DP replica seeds its sampler with `seed + dp_rank`."""

    def __init__(self, model: PreTrainedModel, *, eos_token_ids: tuple[int, ...] = (),
                 layout: EngineLayout = EngineLayout()) -> None:
        if layout.tp != 1:
            raise ConfigError(f"rollout.engine=hf runs at tp=1 only, got tp={layout.tp}; use rollout.engine=native")
        self.model = model.eval()
        self.eos_token_ids = tuple(eos_token_ids)
        self.layout = layout
        self.policy_version = 0
        self._weights_released = False

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> Rollouts:
        if self._weights_released:
            raise RuntimeError("HFEngine.generate after sleep(release_weights=True): call load_weights first")
        stops = stop_token_set(params, self.eos_token_ids)
        config = self._generation_config(params, stops, prompts.pad_token_id)
        attention_mask_bt = (torch.arange(prompts.prompt_tokens_bt.shape[1])[None, :]
                             >= prompts.prompt_tokens_bt.shape[1] - prompts.prompt_lengths_b[:, None]).long()
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(replica_seed(params.seed, self.layout.dp_rank))
            out = self.model.generate(input_ids=prompts.prompt_tokens_bt, attention_mask=attention_mask_bt,
                                      generation_config=config)
        tokens_rt = out.sequences[:, prompts.prompt_tokens_bt.shape[1]:]
        logits_rtv = torch.stack(out.logits, dim=1).float()
        return self._to_rollouts(tokens_rt, logits_rtv, params, stops, prompts)

    def _generation_config(self, params: SamplingParams, stops: tuple[int, ...], pad: int) -> GenerationConfig:
        sampling = dict(do_sample=False) if params.greedy else dict(
            do_sample=True, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0)
        return GenerationConfig(max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                                eos_token_id=list(stops) or None, pad_token_id=pad, return_dict_in_generate=True,
                                output_logits=True, **sampling)

    def _to_rollouts(self, tokens_rt: torch.Tensor, logits_rtv: torch.Tensor, params: SamplingParams,
                     stops: tuple[int, ...], prompts: PromptBatch) -> Rollouts:
        lengths_r, reasons = truncate_at_stop(tokens_rt, stops)
        mask_rt = torch.arange(tokens_rt.shape[1])[None, :] < lengths_r[:, None]
        raw_rt = torch.log_softmax(logits_rtv, dim=-1).gather(-1, tokens_rt[..., None]).squeeze(-1)
        temperature = params.temperature if not params.greedy else 1.0
        scaled_rt = torch.log_softmax(logits_rtv / temperature, dim=-1).gather(-1, tokens_rt[..., None]).squeeze(-1)
        return Rollouts(response_tokens_rt=torch.where(mask_rt, tokens_rt, prompts.pad_token_id),
                        response_logprobs_rt=raw_rt * mask_rt, response_scaled_logprobs_rt=scaled_rt * mask_rt,
                        response_lengths_r=lengths_r, finish_reasons=reasons,
                        prompt_index_r=torch.arange(prompts.num_prompts).repeat_interleave(params.n),
                        policy_version=self.policy_version, pad_token_id=prompts.pad_token_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights in HF names; after `sleep(release_weights=True)` every parameter must be supplied.

        Every name and shape is checked before anything is written, so a bad update leaves the model as it was.
        """
        named = dict(self.model.named_parameters())
        weights = list(weights)
        for name, tensor in weights:
            if name not in named:
                raise ConfigError(f"HFEngine.load_weights: unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(named[name].shape):
                raise ConfigError(f"HFEngine.load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                  f"{tuple(named[name].shape)}")
        if self._weights_released:
            missing = sorted(set(named) - {name for name, _ in weights})
            if missing:
                raise ConfigError(f"HFEngine.load_weights after a weight release is missing {missing[:5]}")
        with torch.no_grad():
            for name, tensor in weights:
                named[name].copy_(tensor)
        self._weights_released = False
        self.policy_version += 1

    def sleep(self, release_weights: bool = False) -> None:
        """HF keeps no KV cache between calls; releasing weights leaves uninitialised storage to refill."""
        if release_weights:
            self.model.to_empty(device="meta")
            self._weights_released = True

    def wake(self, kv_cache: bool = True) -> None:
        """Re-allocate released weights (uninitialised until `load_weights`); there is no KV cache to restore."""
        if self._weights_released:
            self.model.to_empty(device=current_device())
