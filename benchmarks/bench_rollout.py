"""Rollout throughput: rlhf's native engine vs `transformers.generate` (the `hf` engine) and real vLLM (its CPU
build, `make install-vllm`; compiled, vLLM's default, and eager), same weights/prompts.

Two models: a tiny Qwen2-style model (head_dim 32: vLLM's CPU attention has no smaller kernel) and SmolLM2-135M. Batch of 32 prompts, 64 sampled tokens each (EOS
ignored so both engines do the same work), alternating repeats, medians. Optionally (`--mcore`) megatron-core's
own static-KV-cache inference forward (GPTModel + StaticInferenceContext, argmax only: a lower bound on its
cost) as the evaluated alternative. `--dtype bfloat16` runs every engine in bf16 (the native engine's packed
GEMMs then use AMX / AVX512-BF16 where the CPU has them); `--n` samples per prompt (batch_size / n prompts, so the
decode batch stays batch_size rows; the native engine prefills each prompt once and copies it to its samples).
Each engine's sampled-token logprobs (its last timed run) are compared with the fp32 training forward on the same
tokens (max / mean absolute difference). Prints a table and writes benchmarks/results/rollout.json.
ms per decode step = (time for all new tokens - time for the first token alone, i.e. prefill) / (new - 1).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_info, matmul_peak_gflops  # noqa: E402

from rlhf.rollout.hf_engine import HFEngine  # noqa: E402
from rlhf.rollout.sampling_params import SamplingParams  # noqa: E402
from rlhf.rollout.types import PromptBatch, Rollouts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"


def _init_world() -> None:
    from rlhf.testing.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def _model_folder(name: str, workdir: str) -> str:
    if name == "smollm2":
        from rlhf.models.smollm2 import smollm2_hf_folder

        return str(smollm2_hf_folder())
    from rlhf.testing.tiny_models import tiny_hf_model

    path = os.path.join(workdir, "tiny")
    tiny_hf_model("qwen2", seed=0, num_heads=2, num_kv_heads=2).save_pretrained(path)
    return path


def _engines(path: str, batch_size: int, max_seq_len: int, vllm_modes: list[str], with_hf: bool = True,
             dtype: str = "float32") -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.rollout.factory import RolloutConfig, build_engine, eos_token_ids
    from rlhf.rollout.native import NativeEngineConfig

    pgs = build_layout_groups(ParallelLayout())
    native = build_engine(RolloutConfig(native=NativeEngineConfig(max_batch_size=batch_size,
                                                                  max_seq_len=max_seq_len)), path, pgs,
                          dtype=getattr(torch, dtype))
    engines = {"native": native}
    if with_hf:
        engines["hf"] = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)),
                                 eos_token_ids=eos_token_ids(path))
    if vllm_modes:
        from rlhf.rollout.vllm_engine import VllmEngine, VllmEngineConfig
        from rlhf.rollout.vllm_weights import checkpoint_weights

        for mode in vllm_modes:
            config = VllmEngineConfig(dtype=dtype, kv_cache_gb=1.0, max_model_len=max_seq_len,
                                      enforce_eager=mode == "eager")
            engine = VllmEngine(path, config=config, eos_token_ids=eos_token_ids(path))
            engine.load_weights(checkpoint_weights(path))
            engines[f"vllm_{mode}"] = engine
    return engines


def _prompts(vocab_size: int, num_prompts: int, seed: int, lengths: tuple[int, int] = (16, 32)) -> PromptBatch:
    """Random prompts of `lengths[0]..lengths[1]` tokens (uniform)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lengths[0], lengths[1] + 1, (num_prompts,), generator=generator).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    return PromptBatch.from_token_lists(prompts)


def flops_per_token(config, context: float) -> float:
    """Forward FLOPs of one token: 2 x matmul params (incl. LM head) + attention scores/values at `context`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = config.hidden_size * (q_width + 2 * kv_width) + q_width * config.hidden_size \
        + 3 * config.hidden_size * config.intermediate_size
    matmul_params = config.num_hidden_layers * per_layer + config.vocab_size * config.hidden_size
    return 2 * matmul_params + 4 * config.num_hidden_layers * context * q_width


def _batch_flops(config, batch: PromptBatch, new_tokens: int, n: int = 1) -> float:
    """Counting each prompt's prefill once (the n samples of a prompt share it) and n responses per prompt."""
    total = 0.0
    for length in batch.prompt_lengths_b.tolist():
        total += length * flops_per_token(config, length / 2)  # prefill: average causal context
        total += n * new_tokens * flops_per_token(config, length + new_tokens / 2)
    return total


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _time_generate(engine, batch: PromptBatch, params: SamplingParams) -> tuple[float, float, Rollouts]:
    """(wall seconds, this process's CPU seconds, rollouts): on a shared host the CPU time leaves out the time the
    process waited for a core (every engine here runs in this process, on one thread)."""
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    out = engine.generate(batch, params)
    return time.perf_counter() - start, _cpu_seconds() - cpu_start, out


def _logprob_error(path: str, batch: PromptBatch, rollouts: Rollouts) -> dict:
    """An engine's sampled-token logprobs against the fp32 training forward (megatron model, `token_logprobs`)
    on the same prompt + response tokens: max and mean absolute difference over every response token."""
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.forward import token_logprobs
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout

    hf_config, pgs = AutoConfig.from_pretrained(path), build_layout_groups(ParallelLayout())
    model = build_gpt(hf_config, pgs, params_dtype=torch.float32)
    load_hf_weights(model, path)
    errors = []
    with torch.no_grad():
        for row in range(rollouts.num_rollouts):
            prompt = batch.prompt_tokens_bt[int(rollouts.prompt_index_r[row])]
            prompt = prompt[prompt.shape[0] - int(batch.prompt_lengths_b[int(rollouts.prompt_index_r[row])]):]
            response = rollouts.response_tokens_rt[row, :int(rollouts.response_lengths_r[row])]
            tokens = torch.cat([prompt, response])[None]
            logits = model.eval()(tokens, torch.arange(tokens.shape[1])[None], None)
            expected = token_logprobs(logits[:, :-1].float(), tokens[:, 1:], pgs.tp, hf_config.vocab_size)
            errors.append((rollouts.response_logprobs_rt[row, :response.shape[0]]
                           - expected[0, prompt.shape[0] - 1:]).abs())
    errors_t = torch.cat(errors)
    return dict(logprob_max_abs_err=float(errors_t.max()), logprob_mean_abs_err=float(errors_t.mean()))


def bench_model(name: str, args, workdir: str, peaks: list[float]) -> list[dict]:
    """Alternating native/hf repeats; the matmul peak is re-measured every repeat (same load conditions)."""
    from transformers import AutoConfig

    path = _model_folder(name, workdir)
    config = AutoConfig.from_pretrained(path)
    engines = _engines(path, args.batch_size, args.max_seq_len, args.vllm, with_hf=not args.no_hf, dtype=args.dtype)
    batch = _prompts(config.vocab_size, args.batch_size // args.n, seed=0, lengths=tuple(args.prompt_lengths))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p, seed=0,
                            ignore_eos=True, n=args.n)
    for engine in engines.values():
        engine.generate(batch, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True))  # warm-up
    first_token = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=args.top_p, seed=0, ignore_eos=True,
                                 n=args.n)
    times: dict[str, list[float]] = {key: [] for key in engines}
    prefill: dict[str, list[float]] = {key: [] for key in engines}
    cpu: dict[str, list[float]] = {key: [] for key in engines}
    cpu_prefill: dict[str, list[float]] = {key: [] for key in engines}
    tokens, last = {}, {}
    order = list(engines)
    for repeat in range(args.repeats):
        peaks.append(matmul_peak_gflops(repeats=3, dtype=getattr(torch, args.dtype)))
        for key in (order if repeat % 2 == 0 else order[::-1]):
            seconds, cpu_seconds, last[key] = _time_generate(engines[key], batch, params)
            tokens[key] = int(last[key].response_lengths_r.sum())
            times[key].append(seconds)
            cpu[key].append(cpu_seconds)
            first, cpu_first, _ = _time_generate(engines[key], batch, first_token)
            prefill[key].append(first)
            cpu_prefill[key].append(cpu_first)
    if args.mcore:
        from _mcore_static import time_static_decode

        runs = [time_static_decode(engines["native"].model, batch, args.new_tokens) for _ in range(args.repeats)]
        times["mcore_static"], prefill["mcore_static"] = [t for t, _ in runs], [p for _, p in runs]
        tokens["mcore_static"] = tokens["native"]
    from rlhf.rollout.factory import close_engine

    for engine in engines.values():
        close_engine(engine)
    flops = _batch_flops(config, batch, args.new_tokens, args.n)
    rows = []
    for key in times:
        total, first = statistics.median(times[key]), statistics.median(prefill[key])
        rows.append(dict(model=name, engine=key, tokens=tokens[key], seconds=times[key], tok_s=tokens[key] / total,
                         prefill_ms=1e3 * first, ms_per_decode_step=1e3 * (total - first) / (args.new_tokens - 1),
                         model_gflop_s=flops / total / 1e9))
        if cpu.get(key):
            cpu_total, cpu_first = statistics.median(cpu[key]), statistics.median(cpu_prefill[key])
            rows[-1] |= dict(cpu_seconds=cpu[key], cpu_tok_s=tokens[key] / cpu_total, cpu_prefill_ms=1e3 * cpu_first,
                             cpu_ms_per_decode_step=1e3 * (cpu_total - cpu_first) / (args.new_tokens - 1))
        if key in last:
            rows[-1] |= _logprob_error(path, batch, last[key])
    return rows


def _summary(rows: list[dict], peak: float) -> dict:
    def tok_s(model, engine, field="tok_s"):
        return next(r[field] for r in rows if r["model"] == model and r["engine"] == engine)

    summary = {"matmul_peak_gflop_s": peak}
    for model in sorted({r["model"] for r in rows}):
        summary[f"native_tok_s_{model}"] = tok_s(model, "native")
        if any(r["model"] == model and r["engine"] == "hf" for r in rows):
            summary[f"native_vs_hf_{model}"] = tok_s(model, "native") / tok_s(model, "hf")
            summary[f"hf_tok_s_{model}"] = tok_s(model, "hf")
        native = next(r for r in rows if r["model"] == model and r["engine"] == "native")
        summary[f"fraction_of_peak_{model}"] = native["model_gflop_s"] / peak
        modes = [r["engine"] for r in rows if r["model"] == model and r["engine"].startswith("vllm_")]
        for mode in modes:
            summary[f"native_vs_{mode}_{model}"] = tok_s(model, "native") / tok_s(model, mode)
            summary[f"native_vs_{mode}_{model}_cpu_time"] = tok_s(model, "native", "cpu_tok_s") / tok_s(
                model, mode, "cpu_tok_s")
        if modes:  # against vLLM's faster mode
            summary[f"native_vs_vllm_{model}"] = tok_s(model, "native") / max(tok_s(model, m) for m in modes)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (batch_size / n prompts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="every engine's weights and activations (the matmul peak is measured in it too)")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers.generate out (the slowest side)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: the full distribution)")
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"),
                        help="prompt lengths, uniform in MIN..MAX tokens (agentic turns: wide spreads)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: on a shared 2-core host OpenMP spinning at 2 threads "
                             "makes every engine's timings collapse and swing")
    parser.add_argument("--mcore", action="store_true", help="also time megatron-core's static inference forward")
    parser.add_argument("--vllm", nargs="*", choices=["compiled", "eager"], default=None,
                        help="vLLM modes to time (default: both when vLLM is installed; none: --vllm alone)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.n < 1 or args.batch_size % args.n:
        parser.error(f"--n={args.n} must be a positive divisor of --batch-size={args.batch_size}")
    shortest, longest = args.prompt_lengths
    if not 1 <= shortest <= longest or longest + args.new_tokens > args.max_seq_len:
        parser.error(f"--prompt-lengths {shortest} {longest} must satisfy 1 <= MIN <= MAX and MAX + --new-tokens "
                     f"<= --max-seq-len={args.max_seq_len}")
    if args.vllm is None:
        args.vllm = ["compiled", "eager"] if importlib.util.find_spec("vllm") else []
        if not args.vllm:
            print("vLLM is not installed (make install-vllm): timing native and hf only")
    torch.set_num_threads(args.threads)  # before vLLM starts: it forbids changing the thread count later
    _init_world()
    peaks: list[float] = []
    with tempfile.TemporaryDirectory() as workdir:
        rows = [row for name in args.models for row in bench_model(name, args, workdir, peaks)]
    peak = statistics.median(peaks)
    print(f"{args.dtype} matmul peak (2048^3, {args.threads} threads, median of {len(peaks)}): {peak:.1f} GFLOP/s "
          f"(range {min(peaks):.1f}-{max(peaks):.1f})")
    print(f"{'model':8} {'engine':13} {'tok/s':>9} {'prefill ms':>10} {'ms/decode':>9} {'GFLOP/s':>8} {'of peak':>8} "
          f"{'CPU tok/s':>9} {'CPU ms/dec':>10} {'lp err max':>10} {'lp err mean':>11}")
    for row in rows:
        print(f"{row['model']:8} {row['engine']:13} {row['tok_s']:9.0f} {row['prefill_ms']:10.1f} "
              f"{row['ms_per_decode_step']:9.2f} {row['model_gflop_s']:8.2f} {row['model_gflop_s'] / peak:8.1%} "
              f"{row.get('cpu_tok_s', float('nan')):9.0f} {row.get('cpu_ms_per_decode_step', float('nan')):10.2f} "
              f"{row.get('logprob_max_abs_err', float('nan')):10.2e} "
              f"{row.get('logprob_mean_abs_err', float('nan')):11.2e}")
    summary = _summary(rows, peak)
    print(json.dumps(summary, indent=1))
    result = {"name": "rollout", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
