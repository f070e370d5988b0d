"""What a weight push into vLLM must satisfy: the tensors it takes (checked before the push) and a probe of what
landed (after it).

Probe: every vLLM layer is applied to a fixed pseudo-random vector through its own kernel (`quant_method.apply`
for linear layers, so it reads packed CPU weights too) and summed over the TP group; the same sums computed
from the pushed HF tensors must agree to the dtype's precision. Dummy, stale or partly loaded weights fail it.
MoE experts (vLLM's fused `w13_weight` [experts, 2 x intermediate / tp, hidden] and `w2_weight` [experts,
hidden, intermediate / tp], which its kernels read as they are) are probed per expert matrix the same way.
The probe costs one matrix-vector product per weight on each side.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.errors import WeightSyncError
from rlhf.platform.compat import vllm as vllm_compat

# |engine - expected| <= tolerance * sum(|W| |x|): fp32 kernels reorder sums; 16-bit kernels round products.
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class ProbeSum:
    """One vLLM layer (or loose parameter) applied to the probe vector and summed over the TP group.

    `hf_names`: the HF tensors it is built from (fused layers have several; experts: the HF prefix of the
    layer's experts); `kind`: linear | embedding | param | experts.
    """

    module: str
    kind: str
    hf_names: tuple[str, ...]
    value: float


def probe_vector(size: int) -> torch.Tensor:
    """The fixed fp32 probe input of a given width (same on every rank and on both sides of the check)."""
    return torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=torch.float32)


def checkpoint_shapes(hf_path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF folder's safetensors files (headers only)."""
    shapes = {}
    for file in sorted(Path(hf_path).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


def checkpoint_weights(hf_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF folder's safetensors files (what `rlhf generate --engine vllm` pushes)."""
    from safetensors import safe_open

    for file in sorted(Path(hf_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_push(weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]]
               ) -> dict[str, torch.Tensor]:
    """The pushed tensors by name, if they are exactly the checkpoint's names and shapes; else WeightSyncError."""
    pushed: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name not in shapes:
            raise WeightSyncError(f"vllm weight push: {name!r} is not a tensor of the engine's model "
                                  f"(expected HF names such as {next(iter(shapes))!r}); nothing was pushed")
        if tuple(tensor.shape) != shapes[name]:
            raise WeightSyncError(f"vllm weight push: {name!r} has shape {tuple(tensor.shape)}, the engine's "
                                  f"model has {shapes[name]}; nothing was pushed")
        if name in pushed:
            raise WeightSyncError(f"vllm weight push: {name!r} was given twice; nothing was pushed")
        pushed[name] = tensor
    missing = sorted(set(shapes) - set(pushed))
    if missing:
        raise WeightSyncError(f"vllm weight push: {len(missing)} tensors missing, first {missing[0]!r}; a push "
                              "must carry every tensor; nothing was pushed")
    return pushed


# HF names of one expert's (gate, up, down) projections: Qwen3-MoE / Qwen2-MoE, Mixtral.
EXPERT_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def expert_weight_names(prefix: str, weights: Mapping[str, torch.Tensor]) -> list[tuple[str, str, str]]:
    """(gate, up, down) HF weight names of every expert under `prefix` (`...mlp.experts`), in expert order."""
    for naming in EXPERT_NAMINGS:
        names, expert = [], 0
        while f"{prefix}.{expert}.{naming[0]}.weight" in weights:
            names.append(tuple(f"{prefix}.{expert}.{part}.weight" for part in naming))
            expert += 1
        if names:
            return names
    return []


def expected_sum(probe: ProbeSum, weights: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(value, scale) of `probe` computed from the pushed HF tensors; scale = the same sum over |W| and |x|."""
    value = scale = 0.0
    if probe.kind == "experts":  # down(silu(gate x) * up x) per expert, as the fused kernel computes it
        for gate, up, down in expert_weight_names(probe.hf_names[0], weights):
            w_gate, w_up, w_down = (weights[name].double() for name in (gate, up, down))
            x = probe_vector(w_gate.shape[1]).double()
            inner = torch.nn.functional.silu(w_gate @ x) * (w_up @ x)
            value += float((w_down @ inner).sum())
            scale += float((w_down.abs() @ inner.abs()).sum())
        return value, scale
    for name in probe.hf_names:
        if probe.kind == "param":
            tensor = weights[name].double().flatten()
            x = probe_vector(tensor.numel()).double()
            value, scale = value + float(tensor @ x), scale + float(tensor.abs() @ x.abs())
            continue
        weight = weights[f"{name}.weight"].double()
        x = probe_vector(weight.shape[1]).double()
        value, scale = value + float((weight @ x).sum()), scale + float((weight.abs() @ x.abs()).sum())
        bias = weights.get(f"{name}.bias")
        if bias is not None:
            value, scale = value + float(bias.double().sum()), scale + float(bias.double().abs().sum())
    return value, scale


def verify_probe(probes: list[ProbeSum], weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """WeightSyncError naming the first layer whose engine-side probe disagrees with the pushed tensors."""
    tolerance = PROBE_TOLERANCE[dtype]
    for probe in probes:
        if probe.kind == "experts" and not expert_weight_names(probe.hf_names[0], weights):
            raise WeightSyncError(f"vllm weight push: engine layer {probe.module!r} holds experts, the push carries "
                                  f"none under {probe.hf_names[0]!r}")
        if probe.kind != "experts" and any(_weight_name(probe, name) not in weights for name in probe.hf_names):
            raise WeightSyncError(f"vllm weight push: engine layer {probe.module!r} is built from "
                                  f"{list(probe.hf_names)}, which the push does not carry")
        value, scale = expected_sum(probe, weights)
        if abs(probe.value - value) > tolerance * max(scale, 1.0):
            raise WeightSyncError(f"vllm weight push did not land: engine layer {probe.module!r} probes to "
                                  f"{probe.value:.6g}, its pushed weights {list(probe.hf_names)} to {value:.6g}; "
                                  "the engine refuses to generate until a push succeeds")


def _weight_name(probe: ProbeSum, name: str) -> str:
    return name if probe.kind == "param" else f"{name}.weight"


def worker_reload(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside a vLLM worker: vLLM's in-place reload, then the weight processing it skips on a reload (of a
    tied head and of fused MoE experts: `vllm_compat.reprocess_after_reload`; the probe catches either)."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    vllm_compat.reprocess_after_reload(worker.model_runner.get_model())


def worker_probe(worker: Any) -> list[ProbeSum]:
    """Runs inside a vLLM worker (`collective_rpc`): the probe sums of its model, reduced over its TP group."""
    import torch.distributed as dist
    from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    tp_rank = get_tensor_model_parallel_rank()
    owner: dict[int, str] = {}  # parameter -> the first module holding it (a tied head's is the embedding)
    probes, values = [], []
    for wrapped_name, module in model.named_modules():
        name = wrapped_name.replace(".base_layer", "")  # with enable_lora, vLLM wraps each layer as `<name>.base_layer`
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in owner]
        owner.update({id(p): name for _, p in module.named_parameters(recurse=False) if id(p) not in owner})
        if vllm_compat.is_fused_experts(module):
            probes.append(("experts", name, (name.removesuffix(".routed_experts"),)))
            values.append(_experts_sum(module, tp_rank))
        elif isinstance(module, LinearBase):
            probes.append(("linear", name, _hf_names(name, packed)))
            values.append(_linear_sum(module, tp_rank))
        elif isinstance(module, VocabParallelEmbedding):
            probes.append(("embedding", name, (owner[id(module.weight)],)))
            values.append(_embedding_sum(module, head=isinstance(module, ParallelLMHead)))
        else:
            for param_name, param in own:
                probes.append(("param", f"{name}.{param_name}", (f"{name}.{param_name}",)))
                values.append(float(param.detach().double().flatten() @ probe_vector(param.numel()).double())
                              if tp_rank == 0 else 0.0)
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total, group=get_tp_group().cpu_group)
    return [ProbeSum(module=m, kind=k, hf_names=h, value=float(v)) for (k, m, h), v in zip(probes, total)]


def _hf_names(module_name: str, packed: Mapping[str, list[str]]) -> tuple[str, ...]:
    parent, _, leaf = module_name.rpartition(".")
    return tuple(f"{parent}.{part}" for part in packed[leaf]) if leaf in packed else (module_name,)


def _experts_sum(module: Any, tp_rank: int) -> float:
    """This rank's share of its experts: the probe token routed to each expert alone (weight 1) through the
    layer's own fused kernel (which reads prepacked CPU weights), its partial output summed."""
    hidden = module.w13_weight.shape[2]
    x = probe_vector(hidden).to(module.w13_weight.dtype)[None]
    weight = torch.ones(1, 1, dtype=torch.float32)
    total = 0.0
    for expert in range(module.w13_weight.shape[0]):
        ids = torch.full((1, 1), expert, dtype=torch.int32)
        total += float(module.quant_method.apply(module, x, weight, ids, None, None).double().sum())
    return total


def _linear_sum(module: Any, tp_rank: int) -> float:
    """This rank's share: its input slice through its kernel. Counted once over the group: a replicated layer,
    replicated kv heads, a row-parallel bias (added once after the all-reduce)."""
    width = getattr(module, "input_size_per_partition", module.input_size)  # replicated layers (MoE router)
    row_parallel = width < module.input_size
    replicated = not row_parallel and getattr(module, "output_size_per_partition",
                                              module.output_size) == module.output_size
    if replicated and tp_rank != 0:
        return 0.0
    x = probe_vector(module.input_size)[tp_rank * width if row_parallel else 0:][:width]
    y = module.quant_method.apply(module, x.to(module.params_dtype)[None]).double().flatten()
    bias = getattr(module, "bias", None)
    if bias is not None and not row_parallel:
        y = y + bias.double()
    replicas = getattr(module, "num_kv_head_replicas", 1)
    q_size = module.num_heads * module.head_size if replicas > 1 else y.numel()
    value = float(y[:q_size].sum() + y[q_size:].sum() / replicas)
    if bias is not None and row_parallel and tp_rank == 0:
        value += float(bias.double().sum())
    return value


def _embedding_sum(module: Any, head: bool) -> float:
    """The rows of this rank's shard that hold the original vocabulary (padding excluded); an output head
    through its own kernel (which may hold a packed copy), an input embedding by its table."""
    rows = module.shard_indices.num_org_elements
    x = probe_vector(module.embedding_dim)
    if head:
        logits = module.quant_method.apply(module, x.to(module.weight.dtype)[None]).double().flatten()
        return float(logits[:rows].sum())
    return float((module.weight[:rows].detach().double() @ x.double()).sum())
