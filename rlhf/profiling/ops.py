"""Where compute time goes inside one phase: the torch-profiler op table grouped by kind, and achieved GFLOP/s.

FLOPs come from the model's shape, not from the profiler (PaLM's MFU convention):
- training (forward + backward) costs `6 * N` per token plus the attention scores and values,
  `12 * layers * heads * head_dim * seq` per token (the non-causal count, as PaLM's MFU counts it);
- decoding costs `2 * N` per generated token plus `4 * layers * heads * head_dim * context`.
`N` counts the weights that multiply (attention and MLP projections and the LM head), not the embedding table,
which is a lookup.

Op groups (by self CPU time; the op's name and whether it ran inside an optimizer step decide):
GEMM, attention, elementwise (every other compute op: norms, activations, softmax/loss, copies, fills),
optimizer (anything under `Optimizer.step` / megatron's step), communication (collectives) and framework
overhead (autograd engine nodes, views and allocations, record_function scopes' own time, and the wall time no
op accounts for: Python between ops).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rlhf.models.spec import ModelSpec

GROUPS = ("gemm", "attention", "elementwise", "optimizer", "communication", "framework")

_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::addmv",
         "aten::mv", "aten::dot", "aten::_addmm_activation", "aten::addbmm", "mkldnn::", "aten::mkldnn_")
_ATTENTION = ("attention", "flash", "aten::_efficient")
_OPTIMIZER = ("Optimizer.step", "Optimizer.zero_grad", "optimizer_step", "adam")
_COMMUNICATION = ("c10d::", "gloo:", "nccl:", "record_param_comms", "allreduce", "all_reduce", "all_gather",
                  "reduce_scatter")
_FRAMEWORK = ("autograd::", "aten::view", "aten::reshape", "aten::as_strided", "aten::t", "aten::transpose",
              "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
              "aten::detach", "aten::empty", "aten::empty_strided", "aten::resolve_", "aten::alias", "aten::lift",
              "aten::_unsafe_view", "aten::contiguous", "aten::numpy_T", "aten::split", "aten::chunk",
              "aten::unbind", "aten::narrow", "aten::broadcast_tensors", "aten::is_nonzero", "aten::item",
              "aten::_local_scalar_dense",
              "aten::result_type", "aten::set_", "aten::unflatten", "aten::flatten", "aten::stride", "aten::size",
              "[memory]", "ProfilerStep", "torch::autograd::", "detach_", "aten::_reshape_alias")


def matmul_peak_gflops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Median GFLOP/s of a size^3 matmul in `dtype` on this process's threads: the machine's physical limit on
    the model's dominant op. On CPU the faster of torch's GEMM and oneDNN's (`rlhf.platform.gemm`, which rlhf's
    fp32 GEMMs take): on an AMD EPYC torch's BLAS ran at less than half of what oneDNN reached."""
    from rlhf.platform import gemm

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    products = [lambda: a @ b]
    if dtype == torch.float32 and gemm.ENABLED:
        products.append(lambda: gemm.linear(a, b))
    return max(2 * size**3 / median_seconds(product, repeats, warmup=True) / 1e9 for product in products)


def median_seconds(call, repeats: int, *, warmup: bool = False) -> float:
    """Median wall seconds of `repeats` calls of `call` (after one untimed call when `warmup`)."""
    if warmup:
        call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a matmul: per layer the q/k/v/o projections and the (gated) MLP, plus the LM
    head. MoE layers count the `top_k` experts a token runs through, not all of them."""
    attention = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    total = 0
    for layer in range(spec.num_layers):
        if spec.moe is not None and spec.moe.moe_layers[layer]:
            mlp = 3 * spec.hidden_size * spec.moe.expert_ffn_hidden_size * spec.moe.top_k
            mlp += spec.hidden_size * spec.moe.num_experts  # the router
        else:
            mlp = 3 * spec.hidden_size * spec.ffn_hidden_size
        total += attention + mlp
    return total + spec.hidden_size * spec.vocab_size


def train_flops(spec: ModelSpec, num_tokens: int, seq_length: int) -> float:
    """Forward + backward FLOPs of `num_tokens` tokens in sequences of `seq_length` (see the module docstring)."""
    attention = 12 * spec.num_layers * spec.num_heads * spec.head_dim * seq_length
    return float(num_tokens) * (6 * matmul_params(spec) + attention)


def decode_flops(spec: ModelSpec, num_tokens: int, mean_context: float) -> float:
    """FLOPs of generating `num_tokens` tokens, each attending over `mean_context` cached positions on average."""
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * mean_context
    return float(num_tokens) * (2 * matmul_params(spec) + attention)


def op_group(name: str, under_optimizer: bool = False) -> str:
    """The group of a profiled op named `name` (see the module docstring)."""
    lowered = name.lower()
    if under_optimizer or any(lowered.startswith(p.lower()) for p in _OPTIMIZER) or "_foreach_" in lowered \
            or "fused_adam" in lowered:
        return "optimizer"
    if any(part in lowered for part in _COMMUNICATION):
        return "communication"
    if any(name.startswith(prefix) for prefix in _GEMM):
        return "gemm"
    if any(part in lowered for part in _ATTENTION):
        return "attention"
    if any(name == prefix or name.startswith(prefix + "_") or name.startswith(prefix + ".") or
           (prefix.endswith("::") and name.startswith(prefix)) for prefix in _FRAMEWORK):
        return "framework"
    if not name.startswith("aten::"):  # record_function scopes and Python-level annotations: their own time
        return "framework"
    return "elementwise"


@dataclass
class OpTime:
    """One profiled event's name, self CPU time (microseconds) and whether it ran inside an optimizer step."""

    name: str
    self_us: float
    under_optimizer: bool = False


def events_of(profiler) -> list[OpTime]:
    """Every CPU event of a finished `torch.profiler.profile`, with its self time and optimizer ancestry."""
    out = []
    for event in profiler.events():
        parent, under = event.cpu_parent, False
        while parent is not None and not under:
            under = op_group(parent.name) == "optimizer"
            parent = parent.cpu_parent
        out.append(OpTime(event.name, float(event.self_cpu_time_total), under))
    return out


def op_table(events: Iterable[OpTime], wall_s: float, *, top: int = 15) -> dict:
    """Group totals (seconds and share of `wall_s`; the wall time no op covers counts as framework) and the
    `top` (name, group) rows by self time."""
    rows: dict[tuple[str, str], list[float]] = {}
    for event in events:
        group = op_group(event.name, event.under_optimizer)
        entry = rows.setdefault((event.name, group), [0.0, 0])
        entry[0] += event.self_us / 1e6
        entry[1] += 1
    groups = dict.fromkeys(GROUPS, 0.0)
    for (_, group), (seconds, _) in rows.items():
        groups[group] += seconds
    untracked = max(wall_s - sum(groups.values()), 0.0)
    groups["framework"] += untracked
    ranked = sorted(rows.items(), key=lambda item: -item[1][0])[:top]
    share = (lambda seconds: seconds / wall_s) if wall_s > 0 else (lambda seconds: 0.0)
    return {"wall_s": wall_s, "untracked_s": untracked,
            "groups": {group: {"s": seconds, "share": share(seconds)} for group, seconds in groups.items()},
            "top": [{"op": name, "group": group, "calls": calls, "self_s": seconds, "share": share(seconds)}
                    for (name, group), (seconds, calls) in ranked]}


def format_op_table(title: str, table: dict, flops: float | None = None, peak_gflops: float | None = None) -> str:
    """The table as text: achieved GFLOP/s against the peak, group shares, then the top ops."""
    lines = [f"{title}: {table['wall_s']:.3f} s profiled"]
    if flops is not None and table["wall_s"] > 0:
        achieved = flops / table["wall_s"] / 1e9
        peak = f" of {peak_gflops:.1f} peak ({achieved / peak_gflops:.1%})" if peak_gflops else ""
        lines.append(f"  achieved {achieved:.2f} GFLOP/s{peak} ({flops / 1e9:.2f} GFLOP from the model shape)")
    lines.append("  " + "  ".join(f"{group} {value['share']:.1%}" for group, value in table["groups"].items()))
    lines.append(f"  {'op':48} {'group':13} {'calls':>6} {'self s':>8} {'share':>6}")
    for row in table["top"]:
        lines.append(f"  {row['op'][:48]:48} {row['group']:13} {row['calls']:6d} {row['self_s']:8.4f} "
                     f"{row['share']:6.1%}")
    return "\n".join(lines)


@dataclass
class PhaseOps:
    """A `rlhf.metrics.TIMER_OBSERVERS` member: runs the torch profiler over every occurrence of the named
    phases (`rlhf profile --ops`) and keeps their events and wall time; `table(phase)` summarises them."""

    phases: tuple[str, ...] = ("gen", "update_actor")
    events: dict[str, list[OpTime]] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    _open: tuple[str, object, float] | None = None

    def enter(self, name: str) -> None:
        if name in self.phases and self._open is None:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
            self._open = (name, profiler, time.perf_counter())

    def exit(self, name: str, seconds: float) -> None:
        if self._open is None or self._open[0] != name:
            return
        _, profiler, started = self._open
        wall_s = time.perf_counter() - started
        profiler.__exit__(None, None, None)
        self._open = None
        self.events.setdefault(name, []).extend(events_of(profiler))
        self.wall_s[name] = self.wall_s.get(name, 0.0) + wall_s

    def table(self, phase: str, top: int = 15) -> dict | None:
        return op_table(self.events[phase], self.wall_s[phase], top=top) if phase in self.events else None
