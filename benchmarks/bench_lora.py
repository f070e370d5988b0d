"""LoRA vs full fine-tuning on one gloo rank: optimizer-step time, trained state, and what a weight sync moves.

Per setting (full, LoRA r in --ranks): the median TrainEngine step time over --repeats steps on a [batch, seq]
batch; the bytes of parameters, gradient buffers and Adam state (what the training side holds: exact, counted
from the tensors); the bytes a merged sync sends (every base weight, as `lora.sync=merged` does) and the bytes
of the adapters (what `lora.sync=adapter` sends); the time to build the merged weights once; and the measured
time of one weight sync into a native engine with its own copy of the model (merged: `WeightSync`; adapter:
`AdapterSync` after its one base push), each followed by the engine re-deriving its weights (`decoder_params`,
where an adapter engine merges W + (alpha / r) B A from its kept base). `--model PATH` takes the shape from an
HF folder (e.g. SmolLM2-135M; weights random: timings and bytes do not depend on them). Writes
benchmarks/results/lora.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from rlhf.testing.distributed import run_distributed

from _machine import machine_info  # benchmarks/ is the script's folder, first on sys.path

RESULTS = Path(__file__).parent / "results" / "lora.json"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _setting(hf_config: LlamaConfig, rank: int | None, args: argparse.Namespace) -> dict:
    from dataclasses import dataclass

    from rlhf.models.builder import build_gpt
    from rlhf.models.config import LoraConfig
    from rlhf.models.forward import token_logprobs
    from rlhf.models.lora import adapter_pairs, apply_lora
    from rlhf.parallel.groups import GroupCache, build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.models.hf_load import param_specs_for, stage_params
    from rlhf.models.lora import merged_weight
    from rlhf.train.config import OptimConfig
    from rlhf.train.engine import TrainEngine

    @dataclass
    class MicroBatch:
        tokens_bs: torch.Tensor

    groups = build_layout_groups(ParallelLayout.for_world(1), GroupCache())
    model = build_gpt(hf_config, groups)
    if rank is not None:
        apply_lora(model, LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank))
    engine = TrainEngine(model, groups, OptimConfig(lr=1e-4, total_steps=args.repeats + 1))
    tokens = torch.randint(0, hf_config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits_bsv, micro_batch):
        return -token_logprobs(logits_bsv, micro_batch.tokens_bs, groups.tp, hf_config.vocab_size).mean(), {}

    engine.train_step([MicroBatch(tokens)], loss_fn)  # warm-up (allocates Adam state)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.train_step([MicroBatch(tokens)], loss_fn)
        times.append(time.perf_counter() - start)
    trained = [p for p in model.parameters() if p.requires_grad]
    adam = [t for state in engine.optimizer.optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]
    start = time.perf_counter()
    merged = {spec.name: merged_weight(model, spec.local_name(hf_config.num_hidden_layers), param)
              for spec, param in stage_params(model, param_specs_for(model))}
    merge_s = time.perf_counter() - start
    sync_s = {mode: _sync_seconds(model, groups, hf_config, rank, mode, args.repeats)
              for mode in (("merged", "adapter") if rank is not None else ("merged",))}
    return {"setting": "full" if rank is None else f"lora_r{rank}", "step_s": statistics.median(times),
            "merged_sync_s": sync_s["merged"], "adapter_sync_s": sync_s.get("adapter"),
            "trained_params": sum(p.numel() for p in trained),
            "state_bytes": _nbytes(model.parameters()) + _nbytes(trained) + _nbytes(adam),
            "merged_sync_bytes": _nbytes(merged.values()),
            "adapter_bytes": _nbytes(p for _, p in adapter_pairs(model)) if rank is not None else None,
            "merge_s": merge_s if rank is not None else 0.0}


def _sync_seconds(model, groups, hf_config, rank: int | None, mode: str, repeats: int) -> float:
    """Median seconds of one sync into a native engine of its own (same layout, own tensors) plus its re-derive."""
    from rlhf.models.builder import build_gpt
    from rlhf.models.config import LoraConfig
    from rlhf.models.lora import apply_lora
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.reshard.lora_sync import AdapterSync
    from rlhf.reshard.sync import WeightSync
    from rlhf.rollout.config import NativeEngineConfig
    from rlhf.rollout.native.engine import NativeEngine
    from rlhf.rollout.native.params import decoder_params

    engine_model = build_gpt(hf_config, groups)
    layout, extra = ParallelLayout.for_world(1), {}
    if mode == "adapter":
        lora = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank)
        apply_lora(engine_model, lora)
        extra = {"lora": lora}
    engine = NativeEngine(engine_model, vocab_size=hf_config.vocab_size,
                          config=NativeEngineConfig(max_batch_size=1, max_seq_len=8, pack_weights=False))
    sync = (AdapterSync if mode == "adapter" else WeightSync)(model, layout, layout, engine, hf_config=hf_config,
                                                              **extra)
    sync.sync()  # adapter: the one base push
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync.sync()
        decoder_params(engine_model)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _world(args: argparse.Namespace) -> list[dict]:
    if args.model:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model)
        return [_setting(hf_config, rank, args) for rank in [None, *args.ranks]]
    hf_config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=512, tie_word_embeddings=False)
    return [_setting(hf_config, rank, args) for rank in [None, *args.ranks]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--model", default="", help="an HF folder whose shape to use (default: --hidden etc.)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = run_distributed(_world, 1, args, timeout_s=1800)[0]
    print(f"{'setting':<10} {'step ms':>9} {'trained params':>15} {'state MB':>9} {'merged sync MB':>15} "
          f"{'adapter MB':>11} {'merge ms':>9} {'merged sync ms':>15} {'adapter sync ms':>16}")
    for row in rows:
        adapter = "-" if row["adapter_bytes"] is None else f"{row['adapter_bytes'] / 2**20:.3f}"
        adapter_s = "-" if row["adapter_sync_s"] is None else f"{row['adapter_sync_s'] * 1e3:.1f}"
        print(f"{row['setting']:<10} {row['step_s'] * 1e3:>9.1f} {row['trained_params']:>15,} "
              f"{row['state_bytes'] / 2**20:>9.1f} {row['merged_sync_bytes'] / 2**20:>15.1f} {adapter:>11} "
              f"{row['merge_s'] * 1e3:>9.1f} {row['merged_sync_s'] * 1e3:>15.1f} {adapter_s:>16}")
    RESULTS.parent.mkdir(exist_ok=True)
    full, summary = rows[0], {}
    for row in rows[1:]:  # lora_r<rank>
        summary[f"merged_over_adapter_bytes_{row['setting']}"] = row["merged_sync_bytes"] / row["adapter_bytes"]
        summary[f"full_over_lora_state_{row['setting']}"] = full["state_bytes"] / row["state_bytes"]
        summary[f"merged_over_adapter_sync_s_{row['setting']}"] = row["merged_sync_s"] / row["adapter_sync_s"]
    RESULTS.write_text(json.dumps({"name": "lora", "date": datetime.date.today().isoformat(), "machine": machine_info(),
                                   "config": vars(args), "rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
