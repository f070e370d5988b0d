"""GPU check of LoRA through vLLM (`lora.sync=adapter`, `rlhf.rollout.vllm_lora`), run by benchmarks/gpu_check.py:
the base pushed once, then two adapter versions, each generating with logprobs compared to PEFT's forward on the
same tokens; push and generation times and the device memory vLLM holds. Skipped (recorded) without vLLM.
`--smoke` runs it on CPU with vLLM's CPU build (a model with head_dim 32, which vLLM's CPU attention needs).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

from rlhf import platform

LORA_RL = {"enabled": True, "rank": 16, "alpha": 32.0}  # gpu_check's LoRA RL steps (0.5B shape, native engine)


def _peft_model(path: str, rank: int, alpha: float, targets: tuple[str, ...]):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha,
                                                      target_modules=[f"{t}_proj" for t in targets]))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.to(platform.current_device()).eval()


@torch.no_grad()
def _worst_logprob_diff(model, out, prompts: list[list[int]]) -> float:
    worst = 0.0
    for row in range(out.num_rollouts):
        prompt, response = prompts[int(out.prompt_index_r[row])], out.response(row)
        tokens = torch.tensor([prompt + response], device=platform.current_device())
        logits = model(tokens).logits[0, len(prompt) - 1:-1].double()
        want = torch.log_softmax(logits, -1).gather(-1, tokens[0, len(prompt):, None])[:, 0].cpu()
        worst = max(worst, float((out.response_logprobs_rt[row, :len(response)].double() - want).abs().max()))
    return worst


def vllm_lora(root: Path, path: str, groups, dtype: torch.dtype, batch: int, new_tokens: int) -> dict:
    """vLLM generating with two pushed adapter versions on a pushed base, against PEFT's fp32 forward."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed (pip install 'rlhf[gpu]')"}
    from transformers import AutoConfig

    from rlhf.models.config import LoraConfig
    from rlhf.rollout.factory import RolloutConfig, build_engine, close_engine
    from rlhf.rollout.sampling_params import SamplingParams
    from rlhf.rollout.types import PromptBatch
    from rlhf.rollout.vllm_engine import VllmEngineConfig
    from rlhf.rollout.vllm_weights import checkpoint_weights

    import torch.distributed as dist

    for name, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", 0), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(name, str(value))  # vLLM's external_launcher reads them (torchrun sets them)
    lora = LoraConfig(enabled=True, rank=16, alpha=32.0)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (16,), generator=generator).tolist() for _ in range(batch)]
    config = RolloutConfig(engine="vllm", vllm=VllmEngineConfig(kv_cache_gb=2.0 if platform.has_accelerator()
                                                                else 0.25))
    before = platform.allocated_memory_bytes()
    engine = build_engine(config, path, groups, dtype=dtype, lora=lora, adapter_folder=str(root / "lora_sync"),
                          adapter_slots=2)
    row: dict = {"dtype": str(dtype)[6:], "rank": lora.rank, "batch": batch, "new_tokens": new_tokens,
                 "engine_memory_gb": (platform.allocated_memory_bytes() - before) / 2**30}
    try:
        start = time.perf_counter()
        engine.load_weights(checkpoint_weights(path))
        row["base_push_s"] = time.perf_counter() - start
        model = _peft_model(path, lora.rank, lora.alpha, lora.targets)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=1, ignore_eos=True)
        responses = []
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if "lora_B" in name:
                            param.mul_(3.0)
            tensors = {n.replace(".default", ""): p.detach().cpu() for n, p in model.named_parameters()
                       if "lora_" in n}
            start = time.perf_counter()
            engine.load_adapter(tensors)
            row[f"adapter{version}_push_s"] = time.perf_counter() - start
            platform.synchronize()
            start = time.perf_counter()
            out = engine.generate(PromptBatch.from_token_lists(prompts), params)
            platform.synchronize()
            seconds = time.perf_counter() - start
            row[f"adapter{version}_tokens_per_s"] = int(out.response_lengths_r.sum()) / seconds
            row[f"adapter{version}_logprob_diff_max"] = _worst_logprob_diff(model, out, prompts)
            responses.append(out.response_tokens_rt)
        row["second_adapter_changed_tokens"] = not torch.equal(responses[0], responses[1])
        row["folders_kept"] = sorted(p.name for p in (root / "lora_sync").iterdir())
    finally:
        close_engine(engine)
    return row
