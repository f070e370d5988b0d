"""Every GPU check in one process (run by benchmarks/gpu_check.sh): model parity on the accelerator in fp32 and
bf16, native engine vs `transformers.generate` tokens/s on a ~0.5B Qwen2 config, a train step's MFU, the fused
LM head vs full logits (differences, time, memory), packed (THD) = padded micro-batches (TE's `cu_seqlens`
attention when installed), RL trainer steps on the device (full and LoRA) and LoRA through vLLM
(`gpu_check_lora.py`).

Each check records its numbers or its error, so one failure does not hide the others; the JSON goes to
`$OUT/gpu_check.json` (or `--out`). Random weights throughout: these are speed and numerics checks.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import _prompts, flops_per_token  # noqa: E402
from gpu_check_lora import LORA_RL, vllm_lora  # noqa: E402
from gpu_check_packing import packed_vs_padded  # noqa: E402

from rlhf import platform  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0  # datasheet dense bf16 peak (no sparsity)
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864)


def save_model(family: str, path: Path, *, scaled: bool = True, **config) -> str:
    """Tiny models get the scaled-up test init; large ones HF's own init (std 0.02), so logits stay sane."""
    from transformers import AutoModelForCausalLM

    from rlhf.testing.tiny_models import tiny_hf_config, tiny_hf_model

    torch.manual_seed(0)
    model = (tiny_hf_model(family, seed=0, **config) if scaled else
             AutoModelForCausalLM.from_config(tiny_hf_config(family, **config), dtype=torch.float32))
    model.config.max_position_embeddings = 2048
    model.save_pretrained(path)
    return str(path)


def mcore_model(path: str, groups, dtype: torch.dtype):
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights

    # build_gpt leaves megatron's torch-norm weights on the CPU when CUDA is present: move the whole model.
    model = build_gpt(AutoConfig.from_pretrained(path), groups, params_dtype=dtype).to(platform.current_device())
    load_hf_weights(model, path)
    return model


def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(platform.current_device()).eval()


@torch.no_grad()
def parity(path: str, groups, dtype: torch.dtype, vocab: int) -> dict:
    """Max |logit| and |logprob| difference of rlhf's megatron model vs HF, both in `dtype` on the device,
    and each against HF fp32 (the reference)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (4, 128), generator=generator).to(platform.current_device())
    positions = torch.arange(128, device=tokens.device).expand_as(tokens)
    ref = hf_model(path, torch.float32)(tokens).logits.float()
    hf = hf_model(path, dtype)(tokens).logits.float()
    model = mcore_model(path, groups, dtype).eval()
    ours = model(tokens, positions, attention_mask=None).float()[..., :vocab]

    def lp(logits_bsv):
        return torch.log_softmax(logits_bsv[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    return {"dtype": str(dtype), "max_abs_logit_rlhf_vs_hf": float((ours - hf).abs().max()),
            "max_abs_logit_rlhf_vs_hf_fp32": float((ours - ref).abs().max()),
            "max_abs_logit_hf_vs_hf_fp32": float((hf - ref).abs().max()),
            "max_abs_logprob_rlhf_vs_hf": float((lp(ours) - lp(hf)).abs().max()),
            "logit_scale": float(ref.abs().max())}


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        times.append(time.perf_counter() - start)
    return times


def hf_generate(model, batch, params) -> None:
    """Plain `model.generate` (sampling, EOS suppressed by min_new_tokens): the HF baseline, no logprobs."""
    device = platform.current_device()
    width = batch.prompt_tokens_bt.shape[1]
    mask_bt = (torch.arange(width)[None, :] >= width - batch.prompt_lengths_b[:, None]).long()
    model.generate(input_ids=batch.prompt_tokens_bt.to(device), attention_mask=mask_bt.to(device), do_sample=True,
                   temperature=params.temperature, top_k=0, max_new_tokens=params.max_new_tokens,
                   min_new_tokens=params.max_new_tokens, pad_token_id=batch.pad_token_id)


def engines_bench(path: str, groups, dtype: torch.dtype, args) -> dict:
    """Native engine (megatron model + KV cache, returns logprobs too) vs HF generate: same weights/prompts."""
    from transformers import AutoConfig

    from rlhf.rollout.factory import engine_layout
    from rlhf.rollout.native.engine import NativeEngine, NativeEngineConfig
    from rlhf.rollout.sampling_params import SamplingParams

    config = AutoConfig.from_pretrained(path)
    batch = _prompts(config.vocab_size, args.gen_batch, seed=0)
    params = SamplingParams(max_new_tokens=args.gen_tokens, temperature=1.0, seed=0, ignore_eos=True)
    native = NativeEngine(mcore_model(path, groups, dtype).eval(), vocab_size=config.vocab_size,
                          config=NativeEngineConfig(max_batch_size=args.gen_batch, max_seq_len=64 + args.gen_tokens),
                          eos_token_ids=(), layout=engine_layout(groups), tp_group=None)
    hf = hf_model(path, dtype)
    runs = {"native": lambda: native.generate(batch, params), "hf": lambda: hf_generate(hf, batch, params)}
    for run in runs.values():
        run()  # warm-up at full length
    times: dict[str, list[float]] = {key: [] for key in runs}
    for repeat in range(args.repeats):
        for key in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            times[key] += timed(runs[key], 1)
    tokens = args.gen_batch * args.gen_tokens
    row = {"dtype": str(dtype), "batch": args.gen_batch, "new_tokens": args.gen_tokens, "seconds": times}
    for key in runs:
        row[f"{key}_tok_s"] = tokens / statistics.median(times[key])
    row["native_over_hf"] = row["native_tok_s"] / row["hf_tok_s"]
    return row


def train_mfu(path: str, groups, args, fused: bool = False) -> dict:
    """bf16 forward+backward+AdamW on the 0.5B config through megatron's schedule; MFU vs the bf16 peak. The loss
    is the mean token logprob from full logits, or (`fused`) from hidden states through the fused LM head."""
    import contextlib

    from transformers import AutoConfig

    from rlhf.models.forward import forward_backward, token_logprobs
    from rlhf.models.lm_head import LMHead, head_logprobs, hidden_output

    config = AutoConfig.from_pretrained(path)
    model = mcore_model(path, groups, torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=platform.has_accelerator())
    tokens = torch.randint(3, config.vocab_size, (args.train_batch, args.train_seq), device=platform.current_device())

    class MicroBatch:
        tokens_bs = tokens

    def loss_fn(output, micro_batch):
        if fused:
            hidden_nh = output.reshape(-1, output.shape[-1])
            head = LMHead.of(model, groups.tp, config.vocab_size)
            return -head_logprobs(hidden_nh, micro_batch.tokens_bs.reshape(-1), head)[0].mean(), {}
        return -token_logprobs(output, micro_batch.tokens_bs, groups.tp, config.vocab_size).float().mean(), {}

    def step():
        with hidden_output(model) if fused else contextlib.nullcontext():
            forward_backward(model, [MicroBatch()], loss_fn, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed(step, 2)
    platform.reset_peak_memory()
    times = timed(step, args.repeats)
    flops = 3 * args.train_batch * args.train_seq * flops_per_token(config, args.train_seq / 2)
    seconds = statistics.median(times)
    return {"batch": args.train_batch, "seq": args.train_seq, "fused_head": fused, "seconds": times,
            "tflop_s": flops / seconds / 1e12, "mfu_vs_989": flops / seconds / 1e12 / H200_BF16_DENSE_TFLOPS,
            "tokens_per_s": args.train_batch * args.train_seq / seconds,
            "peak_memory_gib": platform.peak_memory_bytes() / 2**30}


def fused_head(groups, config: dict, args) -> dict:
    """Fused LM head vs full logits in bf16 (`config`'s vocab and width): max differences, time and peak extra
    memory of the logprob + entropy forward and the logprob backward over `--head-rows` tokens."""
    from rlhf.models.forward import token_entropy, token_logprobs
    from rlhf.models.lm_head import LMHead, head_logprobs

    device, vocab, width, rows = platform.current_device(), config["vocab_size"], config["hidden_size"], args.head_rows
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, width, device=device, generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, device=device, generator=gen) * 0.05).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    grad_n = torch.randn(rows, device=device, generator=gen)

    def full():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = (h @ w.t())[None]
        logp = token_logprobs(logits, labels[None], groups.tp, vocab)[0]
        with torch.no_grad():
            entropy = token_entropy(logits, groups.tp, vocab)[0]
        (logp * grad_n).sum().backward()
        return logp.detach(), entropy, h.grad, w.grad

    def fused(chunk_bytes: int = 0):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = head_logprobs(h, labels, LMHead(w, groups.tp, vocab), chunk_bytes=chunk_bytes)
        (logp * grad_n).sum().backward()
        return logp.detach(), entropy, h.grad, w.grad

    row: dict = {"rows": rows, "vocab": vocab, "hidden": width, "chunk_block_bytes": platform.fused_head_bytes()}
    chunked = lambda: fused(rows * vocab * 4 // 4)  # noqa: E731  four chunks, recomputed in the backward
    for name, fn in (("full", full), ("fused", fused), ("fused_4_chunks", chunked)):
        fn()
        platform.synchronize()
        base = platform.allocated_memory_bytes()
        platform.reset_peak_memory()
        row[f"{name}_seconds"] = timed(fn, args.repeats)
        row[f"{name}_peak_extra_gib"] = (platform.peak_memory_bytes() - base) / 2**30
    names = ("logprob", "entropy", "grad_hidden", "grad_weight")
    for name, a, b in zip(names, fused(), full()):
        row[f"max_abs_diff_{name}"] = float((a.float() - b.float()).abs().max())
        row[f"scale_{name}"] = float(b.float().abs().max())
    for name in ("fused", "fused_4_chunks"):
        row[f"{name}_speedup"] = statistics.median(row["full_seconds"]) / statistics.median(row[f"{name}_seconds"])
    return row


def _arith_prompts(path: Path, count: int) -> Path:
    """`a+b=` prompts with exact-match answers (reasoning-gym's record shape, no reasoning-gym needed)."""
    gen = torch.Generator().manual_seed(1)
    pairs = torch.randint(0, 10, (count, 2), generator=gen).tolist()
    lines = [json.dumps({"prompt": f"{a}+{b}=", "data_source": "reasoning_gym/chain_sum",
                         "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) for a, b in pairs]
    path.write_text("\n".join(lines) + "\n")
    return path


def char_model_folder(root: Path, config: dict) -> str:
    """`config`'s Qwen2 shape (HF init) over the char tokenizer: real text in, real rewards out, any model size."""
    from transformers import AutoModelForCausalLM

    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.testing.tiny_models import tiny_hf_config

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", **dict(config, vocab_size=len(tokenizer))),
                                             dtype=torch.float32)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    model.config.update(dict(ids, max_position_embeddings=2048))
    model.generation_config.update(**ids)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


def rl_steps(root: Path, args, model: str, prompts_per_step: int, new_tokens: int, dtype: str = "float32",
             lora: dict | None = None) -> dict:
    """The RL trainer on the device: GRPO + reference model (kl 0.04), native rollout, colocated memory phases,
    `--rl-steps` steps with the fused LM head and again with full logits; same seeds, so step-1 metrics agree.
    `lora`: the `lora` section (the ref is then the actor's base)."""
    from rlhf.config import from_dict
    from rlhf.orchestration.schema import RlhfConfig
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer
    from rlhf.orchestration.preflight import preflight

    root.mkdir(parents=True, exist_ok=True)
    prompts = _arith_prompts(root / "prompts.jsonl", prompts_per_step * (args.rl_steps + 1))
    # A dense reward (share of digits in the answer), so a random model's groups differ and the update moves.
    reward_file = root / "digits_reward.py"
    reward_file.write_text("def digits(data_source, solution_str, ground_truth, extra_info):\n"
                           "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n")
    rows = prompts_per_step * 4
    row: dict = {"rows": rows, "new_tokens": new_tokens, "dtype": dtype}
    for fused in (True, False):
        cfg = from_dict(RlhfConfig, {
            "run": {"output_dir": str(root / "runs"), "name": f"rl_fused{fused}"},
            "model": {"path": model, "fused_head": fused, "dtype": dtype},
            "data": {"train_files": [str(prompts)], "prompts_per_step": prompts_per_step, "max_prompt_length": 16},
            "sampling": {"n": 4, "max_new_tokens": new_tokens, "ignore_eos": True},
            "algo": {"advantage": {"kind": "grpo"}, "kl": {"coef": 0.04}},
            "reward": {"by_source": {"reasoning_gym/*": f"{reward_file}:digits"}},
            "actor": {"optim": {"lr": 1e-5}, "micro_batch_size": rows // 2},
            "rollout": {"native": {"max_batch_size": rows, "max_seq_len": 16 + new_tokens}},
            "trainer": {"total_steps": args.rl_steps, "tensorboard": False}, "lora": lora or {}})
        preflight(cfg, dist.get_world_size())
        trainer = Trainer(cfg, setup_run(cfg.run, cfg, prefix="gpu"))
        trainer.push_initial_weights()
        times, metrics = [], []
        try:
            for step in range(1, args.rl_steps + 1):
                platform.synchronize()
                start = time.perf_counter()
                metrics.append(trainer.run_step(step).local())
                platform.synchronize()
                times.append(time.perf_counter() - start)
        finally:
            close_run()
            del trainer
            gc.collect()  # megatron DDP's hooks form reference cycles: free the model before the next run
            platform.release_cached_memory()
        key = "fused" if fused else "full"
        row[f"{key}_seconds"] = times
        row[f"{key}_step1"] = {k: v for k, v in metrics[0].items()
                               if k.startswith(("actor/", "critic/", "timing", "memory/"))}
        row[f"{key}_last"] = {k: v for k, v in metrics[-1].items() if k.startswith(("timing", "memory/"))}
        row[f"{key}_all_finite"] = all(math.isfinite(v) for m in metrics for v in m.values())
    row["step1_abs_diff"] = {k: abs(row["fused_step1"][k] - row["full_step1"][k]) for k in row["fused_step1"]
                             if k.startswith(("actor/", "critic/"))}
    row["step1_max_abs_diff"] = max(row["step1_abs_diff"].values())
    return row


def matmul_tflops(dtype: torch.dtype, size: int = 8192) -> float:
    a = torch.randn(size, size, dtype=dtype, device=platform.current_device())
    b = torch.randn(size, size, dtype=dtype, device=platform.current_device())
    a @ b
    return 2 * size**3 / statistics.median(timed(lambda: a @ b, 10)) / 1e12


def run_check(results: dict, name: str, fn, *args) -> None:
    if not any(name.startswith(prefix) for prefix in results["config"]["only"]):
        return
    start = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as err:  # a failed check is recorded and the others still run
        results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    results[name]["check_s"] = time.perf_counter() - start
    Path(results["config"]["out"]).write_text(json.dumps(results, indent=1) + "\n")  # partial results survive
    print(f"[gpu_check] {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'seconds'})[:800]}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "gpu_check.json"))
    parser.add_argument("--gen-batch", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--head-rows", type=int, default=8192)
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=["matmul", "parity", "engine", "train", "head", "packed", "rl",
                                                      "lora"],
                        help="run the checks whose names start with these prefixes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device (tests the script on CPU)")
    args = parser.parse_args()
    big_config = QWEN2_05B
    if args.smoke:
        big_config = dict(QWEN2_05B, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
        args.gen_batch, args.gen_tokens, args.train_batch, args.train_seq, args.repeats = 4, 8, 2, 32, 1
        args.head_rows, args.rl_steps = 16, 2
    elif not platform.has_accelerator():
        raise SystemExit("gpu_check: no accelerator visible; run this on a GPU machine (or pass --smoke)")
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.parallel.runtime import distributed

    results: dict = {"name": "gpu_check", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     "machine": {"device": platform.device_name(), "torch": torch.__version__,
                                 "toolkit": torch.version.cuda}, "config": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with distributed("auto", timeout_s=600) as _, tempfile.TemporaryDirectory() as workdir:
        groups = build_layout_groups(ParallelLayout())
        root = Path(workdir)
        tiny = {fam: save_model(fam, root / fam) for fam in ("llama", "qwen2", "qwen3", "qwen3_moe")}
        big = save_model("qwen2", root / "qwen2_05b", scaled=False, **big_config)
        run_check(results, "matmul_bf16", lambda: {"tflop_s": matmul_tflops(torch.bfloat16, 256 if args.smoke else 8192)})
        for fam, path in tiny.items():
            for dtype in (torch.float32, torch.bfloat16):
                run_check(results, f"parity_{fam}_{str(dtype)[6:]}", parity, path, groups, dtype, 101)
        for dtype in (torch.float32, torch.bfloat16):
            run_check(results, f"parity_qwen2_05b_{str(dtype)[6:]}", parity, big, groups, dtype,
                      big_config["vocab_size"])
        for dtype in (torch.bfloat16, torch.float32):
            run_check(results, f"engine_qwen2_05b_{str(dtype)[6:]}", engines_bench, big, groups, dtype, args)
        run_check(results, "train_mfu_qwen2_05b_bf16", train_mfu, big, groups, args)
        run_check(results, "train_mfu_fused_head_qwen2_05b_bf16", train_mfu, big, groups, args, True)
        run_check(results, "head_fused_vs_full_qwen2_05b_vocab_bf16", fused_head, groups, big_config, args)
        for fam, dtype in (("qwen2", torch.float32), ("qwen3_moe", torch.float32), ("qwen2", torch.bfloat16)):
            run_check(results, f"packed_vs_padded_{fam}_{str(dtype)[6:]}", packed_vs_padded, tiny[fam], groups, dtype)
        from bench_e2e_vs_trl import tiny_model_folder

        run_check(results, "rl_steps_tiny", rl_steps, root / "rl_tiny", args, tiny_model_folder(root), 8, 32)
        rl_model = char_model_folder(root / "rl_05b_model", big_config)
        run_check(results, "rl_steps_qwen2_05b_shape_bf16", rl_steps, root / "rl_05b", args, rl_model, 16,
                  16 if args.smoke else 128, "bfloat16")
        run_check(results, "lora_rl_steps_qwen2_05b_shape_bf16", rl_steps, root / "rl_lora", args, rl_model, 16,
                  16 if args.smoke else 128, "bfloat16", LORA_RL)
        vllm_model = save_model("qwen2", root / "vllm_lora", num_heads=2, num_kv_heads=2) if args.smoke else big
        for dtype in (torch.float32, torch.bfloat16):
            run_check(results, f"lora_vllm_{str(dtype)[6:]}", vllm_lora, root / f"vllm_{str(dtype)[6:]}", vllm_model,
                      groups, dtype, 4 if args.smoke else 64, 8 if args.smoke else 64)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"[gpu_check] wrote {args.out}")


if __name__ == "__main__":
    main()
