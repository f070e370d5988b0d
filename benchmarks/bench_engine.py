"""SFT train step: rlhf `TrainEngine` (megatron DDP + optimizer + schedule) vs transformers + torch AdamW.

Same HF weights, same global batch split into the same micro-batches, same loss (answer-token NLL over the
global token count), AdamW with the same hyperparameters, clip 1.0, fp32, one gloo rank, one thread each.
Sides take turns step by step (who goes first rotates); the table shows median seconds per step and the
largest loss difference between the trajectories (they train the same model the same way, so it stays small).
`--autocast` adds two sides: rlhf with `optim.autocast=bfloat16` (bf16 matmuls, fp32 weights/grads/Adam) and the
peer under `torch.autocast` bf16 (fp32 weights and AdamW, loss in fp32), and the bf16-vs-fp32 answer-token logprob
differences of one forward on the same weights.
Writes benchmarks/results/engine.json (summary: peer step time / rlhf step time, > 1 means rlhf is faster; and each
side's GFLOP/s over its median timed step, from the model shape, as a fraction of the matmul peak measured here).
`--ops` profiles one more step of each side afterwards (torch profiler, not timed with the others): achieved
GFLOP/s against the measured matmul peak and the op table grouped as GEMM / attention / elementwise / optimizer
/ framework (`rlhf.profiling.ops`). `--model smollm2` trains SmolLM2-135M instead of the random Llama.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from _machine import machine_info
from rlhf.testing.distributed import run_distributed

LR, BETAS, EPS, CLIP = 1e-4, (0.9, 0.95), 1e-8, 1.0


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads // 2, max_position_embeddings=args.seq,
                       tie_word_embeddings=False)


def make_batch(args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    position = torch.arange(args.seq).unsqueeze(0)
    answer_start = torch.randint(args.seq // 4, args.seq // 2, (args.batch, 1), generator=generator)
    return tokens, (position >= answer_start).long()


class PeerTrainer:
    """transformers model + torch AdamW with grad accumulation: what a plain PyTorch SFT loop does."""

    def __init__(self, path: str, autocast: torch.dtype | None = None) -> None:
        self.autocast = autocast
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        decay = [p for p in self.model.parameters() if p.dim() > 1]
        no_decay = [p for p in self.model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                           lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, num_micro_batches: int) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        count = mask[:, 1:].sum()
        total = 0.0
        for micro_tokens, micro_mask in zip(tokens.chunk(num_micro_batches), mask.chunk(num_micro_batches)):
            with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                logits = self.model(micro_tokens).logits
            logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            picked = logprobs.gather(-1, micro_tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(picked * micro_mask[:, 1:]).sum() / count
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return total


def _profiled(step, spec, tokens: torch.Tensor) -> dict:
    """One `step()` under the torch profiler: its op table and the step's FLOPs from the model shape."""
    from rlhf.profiling.ops import events_of, op_table, train_flops

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        step()
        wall_s = time.perf_counter() - started
    table = op_table(events_of(profiler), wall_s)
    table["flops"] = train_flops(spec, tokens.numel(), tokens.shape[1])
    return table


def _engine(path: str, groups, args: argparse.Namespace, autocast: str):
    from transformers import AutoConfig

    from rlhf.models.builder import build_gpt
    from rlhf.models.hf_load import load_hf_weights
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    model = build_gpt(AutoConfig.from_pretrained(path), groups)
    load_hf_weights(model, path)
    return TrainEngine(model, groups, OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, clip_grad=CLIP,
                                                  total_steps=args.steps + 1, autocast=autocast))


def _logprob_fidelity(engine, args: argparse.Namespace) -> dict:
    """Answer-token logprobs of one batch with the forward in bf16 autocast vs fp32, on the same weights."""
    from rlhf.testing.engine_nll import sft_micro_batches

    tokens, mask = make_batch(args, seed=10_000)
    batches = sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=args.micro_batches)
    from rlhf.models.lm_head import hidden_output

    fused = args.head == "fused"
    loss_fn = _answer_logprobs(engine, fused)
    results = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        engine.autocast_dtype = dtype
        with hidden_output(engine.module) if fused else contextlib.nullcontext():
            results[name] = torch.cat([out["logprobs"] for out in engine.forward_only(batches, loss_fn)])
    engine.autocast_dtype = torch.bfloat16
    diff = (results["bf16"] - results["fp32"]).abs()
    ratio = (results["bf16"] - results["fp32"]).exp()  # the PPO ratio bf16 / fp32 per token
    return {"tokens": diff.numel(), "max_abs_logprob_diff": float(diff.max()),
            "mean_abs_logprob_diff": float(diff.mean()), "max_abs_ratio_minus_1": float((ratio - 1).abs().max())}


def _answer_logprobs(engine, fused_head: bool):
    """forward_only fn: the answer tokens' logprobs, through the fused head on hidden states or from logits."""
    from rlhf.models.forward import token_logprobs
    from rlhf.models.lm_head import LMHead, head_logprobs

    tp_group, vocab_size = engine.pg_collection.tp, engine.module.rlhf_spec.vocab_size

    def fn(output, batch):
        predicts_bs = torch.roll(batch.answer_mask_bs, -1, dims=1).bool()
        predicts_bs[:, -1] = False
        if fused_head:
            rows_n, positions_n = predicts_bs.nonzero(as_tuple=True)
            logprobs_n, _ = head_logprobs(output[rows_n, positions_n], batch.tokens_bs[rows_n, positions_n + 1],
                                          LMHead.of(engine.module, tp_group, vocab_size))
        else:
            logprobs_n = token_logprobs(output, torch.roll(batch.tokens_bs, -1, dims=1), tp_group,
                                        vocab_size)[predicts_bs]
        return logprobs_n.sum(), {"logprobs": logprobs_n}

    return fn


def _bench_rank(path: str, args: argparse.Namespace) -> tuple[list[dict], dict, dict | None, float]:
    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.testing.engine_nll import sft_micro_batches, sft_step

    groups = build_layout_groups(ParallelLayout(tp=1, pp=1, dp=1))
    engines = {"rlhf": _engine(path, groups, args, "none")}
    if args.autocast:
        engines["rlhf_bf16"] = _engine(path, groups, args, "bfloat16")
    peers = {"peer": PeerTrainer(path)}
    if args.autocast:
        peers["peer_bf16"] = PeerTrainer(path, torch.bfloat16)
    spec = engines["rlhf"].module.rlhf_spec
    order = [*peers, *engines]

    def run(side: str, tokens: torch.Tensor, mask: torch.Tensor) -> float:
        if side in peers:
            return peers[side].step(tokens, mask, args.micro_batches)
        batches = sft_micro_batches(tokens, mask, dp_rank=0, dp_size=1, num_micro_batches=args.micro_batches)
        return sft_step(engines[side], batches, fused_head=args.head == "fused").loss

    records = []
    for step in range(args.steps + 1):  # step 0 is warm-up, not recorded
        tokens, mask = make_batch(args, seed=step)
        for side in order[step % len(order):] + order[:step % len(order)]:  # rotate who goes first
            started, cpu_started = time.perf_counter(), time.process_time()
            loss = run(side, tokens, mask)
            if step > 0:
                records.append({"side": side, "step": step, "time_s": time.perf_counter() - started,
                                "cpu_s": time.process_time() - cpu_started, "loss": loss})
    ops = {}
    if args.ops:
        tokens, mask = make_batch(args, seed=args.steps + 1)
        for side in reversed(order):
            ops[side] = _profiled(lambda: run(side, tokens, mask), spec, tokens)
    fidelity = _logprob_fidelity(engines["rlhf_bf16"], args) if args.autocast else None
    from rlhf.profiling.ops import train_flops

    return records, ops, fidelity, train_flops(spec, args.batch * args.seq, args.seq)


def summarize(records: list[dict], args: argparse.Namespace) -> tuple[list[dict], dict]:
    tokens_per_step = args.batch * args.seq
    rows = []
    sides = list(dict.fromkeys(r["side"] for r in records))
    for side in sorted(sides, key=lambda s: not s.startswith("peer")):
        times = [r["time_s"] for r in records if r["side"] == side]
        cpu_times = [r["cpu_s"] for r in records if r["side"] == side]
        rows.append({"side": side, "median_s": statistics.median(times), "min_s": min(times),
                     "median_cpu_s": statistics.median(cpu_times),
                     "tokens_per_s": tokens_per_step / statistics.median(times), "times_s": times,
                     "losses": [r["loss"] for r in records if r["side"] == side]})
    by_side = {row["side"]: row for row in rows}
    peer, rlhf = by_side["peer"], by_side["rlhf"]
    summary = {"step_time_peer_over_rlhf": peer["median_s"] / rlhf["median_s"],
               "cpu_time_peer_over_rlhf": peer["median_cpu_s"] / rlhf["median_cpu_s"],
               "step_time_peer_over_rlhf_min": peer["min_s"] / rlhf["min_s"],
               "max_loss_diff": max(abs(a - b) for a, b in zip(peer["losses"], rlhf["losses"]))}
    if "rlhf_bf16" in by_side:
        bf16 = by_side["rlhf_bf16"]
        summary |= {"step_time_peer_over_rlhf_bf16": peer["median_s"] / bf16["median_s"],
                    "cpu_time_peer_over_rlhf_bf16": peer["median_cpu_s"] / bf16["median_cpu_s"],
                    "step_time_peer_over_rlhf_bf16_min": peer["min_s"] / bf16["min_s"],
                    "step_time_rlhf_over_rlhf_bf16": rlhf["median_s"] / bf16["median_s"],
                    "max_loss_diff_bf16_vs_fp32": max(abs(a - b) for a, b in zip(rlhf["losses"], bf16["losses"]))}
    if "peer_bf16" in by_side:
        peer_bf16 = by_side["peer_bf16"]
        summary |= {"step_time_peer_bf16_over_rlhf_bf16": peer_bf16["median_s"] / bf16["median_s"],
                    "cpu_time_peer_bf16_over_rlhf_bf16": peer_bf16["median_cpu_s"] / bf16["median_cpu_s"],
                    "step_time_peer_bf16_over_rlhf_bf16_min": peer_bf16["min_s"] / bf16["min_s"],
                    "max_loss_diff_bf16_peer_vs_rlhf": max(abs(a - b) for a, b in zip(peer_bf16["losses"],
                                                                                       bf16["losses"]))}
    return rows, summary


def matmul_peaks() -> dict[str, float]:
    """The measured one-thread matmul peak here, GFLOP/s, per dtype (the sides run on one thread)."""
    from _machine import matmul_peak_gflops

    torch.set_num_threads(1)
    return {"fp32": matmul_peak_gflops(), "bf16": matmul_peak_gflops(dtype=torch.bfloat16)}


def timed_fraction_of_peak(rows: list[dict], flops: float, peaks: dict[str, float]) -> dict:
    """Each side's GFLOP/s over its median timed step (no profiler running) against the peak of its GEMMs' dtype."""
    result = {"matmul_peak_gflops_fp32": peaks["fp32"], "matmul_peak_gflops_bf16": peaks["bf16"]}
    for row in rows:
        peak = peaks["bf16" if row["side"].endswith("_bf16") else "fp32"]
        gflops = flops / row["median_s"] / 1e9
        result |= {f"{row['side']}_timed_gflops": gflops, f"{row['side']}_timed_fraction_of_peak": gflops / peak}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=("random", "smollm2"), default="random",
                        help="random: a Llama of --hidden/--layers/--heads/--vocab; smollm2: SmolLM2-135M")
    parser.add_argument("--head", choices=("fused", "logits"), default="fused",
                        help="rlhf's loss: the fused LM head on answer tokens (the actor's path) or full logits")
    parser.add_argument("--autocast", action="store_true",
                        help="a third side: rlhf with optim.autocast=bfloat16, and its logprob fidelity vs fp32")
    parser.add_argument("--ops", action="store_true", help="profile one more step per side: op table, GFLOP/s")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as path:
        if args.model == "smollm2":
            from transformers import AutoConfig

            from rlhf.models.smollm2 import smollm2_hf_folder

            path = str(smollm2_hf_folder())
            args.vocab = AutoConfig.from_pretrained(path).vocab_size
        else:
            torch.manual_seed(0)
            LlamaForCausalLM(model_config(args)).save_pretrained(path)
        records, ops, fidelity, flops = run_distributed(_bench_rank, 1, path, args, timeout_s=3600)[0]
    rows, summary = summarize(records, args)
    peaks = matmul_peaks()
    summary |= timed_fraction_of_peak(rows, flops, peaks)
    print(f"{'side':>10} {'median s/step':>14} {'min s':>8} {'median cpu s':>13} {'tokens/s':>9}")
    for row in rows:
        print(f"{row['side']:>10} {row['median_s']:>14.3f} {row['min_s']:>8.3f} {row['median_cpu_s']:>13.3f} "
              f"{row['tokens_per_s']:>9.0f}")
    for key, value in summary.items():
        print(f"{key}: {value:.3g}")
    print(f"load average (1 min) at start {load_at_start:.2f}, at end {os.getloadavg()[0]:.2f}")
    if fidelity:
        summary["bf16_logprob_fidelity"] = fidelity
        print("bf16 autocast vs fp32 logprobs: " + ", ".join(f"{k} {v:.3g}" for k, v in fidelity.items()))
    if ops:
        from rlhf.profiling.ops import format_op_table

        for side, table in ops.items():
            table["peak_gflops"] = peak = peaks["bf16" if side.endswith("_bf16") else "fp32"]
            table["achieved_gflops"] = table["flops"] / table["wall_s"] / 1e9
            print(format_op_table(f"{side} train step (profiled)", table, table["flops"], peak))
    result = {"name": "engine", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": machine_info() | {"threads": 1, "load_avg_1m": os.getloadavg()[0],
                                           "load_avg_1m_at_start": load_at_start},
              "config": {k: v for k, v in vars(args).items() if k != "out"} | {"lr": LR, "clip": CLIP},
              "rows": rows, "summary": summary, "ops": ops}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
