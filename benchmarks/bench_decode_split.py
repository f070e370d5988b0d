"""Where a native-engine decode step goes: the step against its parts, in process CPU time.

One decode step of the native engine (batch of slots x one token, the KV cache filled to `--context`) is timed
whole and in parts on the same weights and cache: the GEMMs alone (every layer's QKV, output projection with its
residual, SwiGLU and fc2 with its residual, then the LM head), decode attention over every layer's cache (and
over one layer's cache reused for every layer: cache-resident, so the difference is the cost of reading the KV
cache from memory), the RMSNorms, the LM head alone and the sampler. The fp32 matmul peak (2048^3) is measured
in the same way between repeats. `--dtype bfloat16`: the bf16 engine (and the bf16 peak).

Times are the process's CPU time (user + system, one torch thread): on a host shared with other work the wall
time counts the time this process waits for a core, the CPU time does not (it still counts what contention for
caches and memory costs). Parts are interleaved per repeat; medians. Writes benchmarks/results/decode_split.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info  # noqa: E402

from bench_rollout import _init_world, _model_folder, _prompts  # noqa: E402

from rlhf.rollout.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "decode_split.json"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_cpu_gflops(size: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = cpu_seconds()
    a @ b
    return 2 * size**3 / (cpu_seconds() - start) / 1e9


def _parts(engine, slots: int, context: int) -> tuple[dict, float]:
    """Callables of one decode step and its parts, and the step's GEMM FLOPs."""
    from rlhf.rollout.native.sampler import sample

    decoder, cache, geo = engine.decoder, engine.cache, engine.decoder.geometry
    hidden_size = decoder.params.embedding.shape[1]
    tokens = torch.randint(0, geo.vocab_size, (slots,))
    positions = torch.full((slots,), context - 1, dtype=torch.long)
    dtype = decoder.params.embedding.dtype
    x, residual = torch.randn(slots, hidden_size, dtype=dtype), torch.randn(slots, hidden_size, dtype=dtype)
    intermediate = torch.randn(slots, decoder.layers[0].fc2.weight.shape[1], dtype=dtype)
    params, generator = SamplingParams(max_new_tokens=2, temperature=1.0), torch.Generator().manual_seed(0)
    logits = decoder.decode(tokens, positions, context, cache)
    heads_per_group = geo.num_heads // geo.num_groups
    layer0 = decoder.layers[0]
    mixed = layer0.qkv(x).view(slots, geo.num_groups, heads_per_group + 2, geo.head_dim).contiguous()
    cos_sin = decoder.rope_t2d[positions]

    def gemms():
        for layer in decoder.layers:
            layer.qkv(x), layer.proj.add_to(residual, x), layer.swiglu(x), layer.fc2.add_to(residual, intermediate)
        decoder.output(x)

    def attention(reuse_one: bool):
        def run():
            for index in range(len(decoder.layers)):
                at = 0 if reuse_one else index
                decoder.fused_attention(mixed, cos_sin, cache.keys[at], cache.values[at], positions,
                                        geo.head_dim ** -0.5)
        return run

    parts = {"step": lambda: sample(decoder.decode(tokens, positions, context, cache), params, generator),
             "gemms": gemms, "lm_head": lambda: decoder.output(x),
             "rms_norms": lambda: [F.rms_norm(residual, (hidden_size,), layer0.input_norm, geo.eps)
                                   for _ in range(2 * len(decoder.layers) + 1)],
             "sampler": lambda: sample(logits, params, generator)}
    if decoder.fused_attention is not None:
        parts |= {"attention": attention(False), "attention_cache_resident": attention(True)}
    weights = sum(layer.qkv_weight.numel() + layer.proj_weight.numel() + layer.fc1_weight.numel()
                  + layer.fc2_weight.numel() for layer in decoder.params.layers) + decoder.params.output.numel()
    return parts, 2.0 * slots * weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=56, help="KV positions each slot attends (bench-rollout's "
                                                                  "32x64 averages 56)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="calls per part per repeat")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's weights, activations and KV cache (and the matmul peak's)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    _init_world()
    import tempfile

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.rollout.factory import RolloutConfig, build_engine
    from rlhf.rollout.native import NativeEngineConfig

    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as workdir, torch.inference_mode():
        path = _model_folder(args.model, workdir)
        engine = build_engine(RolloutConfig(native=NativeEngineConfig(max_batch_size=args.slots, max_seq_len=128)),
                              path, build_layout_groups(ParallelLayout()), dtype=getattr(torch, args.dtype))
        engine.generate(_prompts(engine.decoder.geometry.vocab_size, args.slots, seed=0),  # prepares the weights
                        SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True))
        parts, gemm_flops = _parts(engine, args.slots, args.context)
        times: dict[str, list[float]] = {name: [] for name in [*parts, "matmul_peak_gflop_s"]}
        for repeat in range(args.repeats):
            times["matmul_peak_gflop_s"].append(peak_cpu_gflops(dtype=getattr(torch, args.dtype)))
            for name in (list(parts) if repeat % 2 == 0 else list(parts)[::-1]):
                parts[name]()
                start = cpu_seconds()
                for _ in range(args.calls):
                    parts[name]()
                times[name].append(1e3 * (cpu_seconds() - start) / args.calls)
            loads.append(os.getloadavg()[0])
    ms = {name: statistics.median(values) for name, values in times.items() if name != "matmul_peak_gflop_s"}
    peak = statistics.median(times["matmul_peak_gflop_s"])
    summary = {"cpu_ms": ms, "share_of_step": {name: ms[name] / ms["step"] for name in ms if name != "step"},
               "gemm_gflop_s": gemm_flops / ms["gemms"] / 1e6, "matmul_peak_gflop_s": peak,
               "gemm_fraction_of_peak": gemm_flops / ms["gemms"] / 1e6 / peak,
               "step_bound_by_gemms_ms": gemm_flops / peak / 1e6}
    print(f"{args.model}, {args.slots} slots x 1 token, context {args.context}, CPU ms per decode step "
          f"(median of {args.repeats}), load {min(loads):.1f}-{max(loads):.1f}")
    for name, value in ms.items():
        print(f"  {name:26} {value:8.2f} ms  {value / ms['step']:6.1%}")
    print(f"  GEMMs {summary['gemm_gflop_s']:.1f} GFLOP/s = {summary['gemm_fraction_of_peak']:.0%} of the "
          f"{peak:.1f} GFLOP/s matmul peak; the GEMMs alone at peak: {summary['step_bound_by_gemms_ms']:.1f} ms")
    result = {"name": "decode_split", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "machine": machine_info() | {"load_avg_1m": loads},
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "times_ms": times, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
