"""`rlhf generate`: rollouts for a prompt dataset with an HF model folder, written as JSONL (rank 0).

Runs under torchrun in the rollout layout (`--tp`; dp = world / tp): each DP replica generates its share
of the prompts and rank 0 writes every row in dataset order. Without torchrun it runs as a world of one.
Rank 0 reports progress (a bar on a terminal, else a line every `--progress-every` batches); when every prompt's
data_source has a rule reward and a ground truth, each row gets its `score` and the summary their mean.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from rlhf.parallel.wire import all_gather_json
from rlhf.errors import ConfigError
from rlhf.rollout.native.engine import NativeEngineConfig
from rlhf.rollout.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="generate responses for a prompt dataset -> JSONL")
    parser.add_argument("--model", required=True, help="HF model folder (use `rlhf export` for a checkpoint)")
    parser.add_argument("--data", required=True, help="prompts: .jsonl or .parquet in verl's schema")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--engine", choices=("native", "hf", "vllm"), default="native")
    parser.add_argument("--tp", type=int, default=1, help="rollout tensor parallelism (dp = world / tp)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generate call per replica")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="KV-cache positions per sequence")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress-every", type=int, default=10, metavar="N",
                        help="outside a terminal: a progress line every N batches (default 10)")
    return parser


def _rule_reward(rows):
    """The built-in rule reward when it can score every row (each has a ground truth and a known source)."""
    from rlhf.rewards.registry import RewardConfig, RuleReward

    if not rows or any(row.ground_truth is None for row in rows):
        return None
    reward = RuleReward(RewardConfig())
    try:
        reward.check_sources(row.data_source for row in rows)
    except ConfigError:
        return None
    return reward


def _init_world() -> None:
    if dist.is_initialized():
        return
    from rlhf.platform import resolve_backend
    from rlhf.testing.distributed import free_port

    if "RANK" not in os.environ:  # a plain `rlhf generate`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    dist.init_process_group(resolve_backend("auto"))


def run(args: argparse.Namespace) -> int:
    if not Path(args.model, "config.json").exists():
        raise ConfigError(f"--model {args.model} is not an HF folder (no config.json); for an rlhf checkpoint "
                          "run `rlhf export` first")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, n=args.samples, seed=args.seed)
    _init_world()
    from transformers import AutoTokenizer

    from rlhf.parallel.groups import build_layout_groups
    from rlhf.parallel.layout import ParallelLayout
    from rlhf.rollout.factory import RolloutConfig, build_engine, close_engine
    from rlhf.data.records import read_records

    layout = ParallelLayout.for_world(dist.get_world_size(), tp=args.tp, what="rollout layout (--tp)")
    pg_collection = build_layout_groups(layout)
    config = RolloutConfig(engine=args.engine,
                           native=NativeEngineConfig(max_batch_size=args.batch_size * args.samples,
                                                     max_seq_len=args.max_seq_len))
    engine = build_engine(config, args.model, pg_collection)
    if args.engine == "vllm":  # built with dummy weights: it generates only after a push
        from rlhf.rollout.vllm_weights import checkpoint_weights

        engine.load_weights(checkpoint_weights(args.model))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = read_records(args.data, require_ground_truth=False)[:args.limit]
    mine = rows[engine.layout.dp_rank::engine.layout.dp]
    records = _generate_all(engine, tokenizer, mine, params, args.batch_size, _rule_reward(rows),
                            args.progress_every)
    gathered = all_gather_json(records if engine.layout.tp_rank == 0 else [])
    if dist.get_rank() == 0:
        merged = sorted((r for part in gathered for r in part), key=lambda r: (r["index"], r["sample"]))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(record) + "\n" for record in merged))
        summary = {"prompts": len(rows), "rollouts": len(merged), "out": args.out}
        if merged and "score" in merged[0]:
            summary["score/mean"] = sum(record["score"] for record in merged) / len(merged)
        print(json.dumps(summary))
    close_engine(engine)
    dist.destroy_process_group()
    return 0


def _generate_all(engine, tokenizer, rows, params: SamplingParams, batch_size: int, reward=None,
                  progress_every: int = 10) -> list[dict]:
    from rlhf.data.tokenize import encode_prompt
    from rlhf.rollout.types import PromptBatch
    from rlhf.run_dir import progress

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    records = []
    starts = range(0, len(rows), batch_size)
    for start in progress(starts, desc=f"generate (batches of {batch_size} prompts)", total=len(starts),
                          every_steps=progress_every):
        chunk = rows[start:start + batch_size]
        token_lists = [encode_prompt(row.prompt, tokenizer) for row in chunk]
        out = engine.generate(PromptBatch.from_token_lists(token_lists, pad_token_id=pad), params)
        for r in range(out.num_rollouts):
            row = chunk[int(out.prompt_index_r[r])]
            response = out.response(r)
            uid = str(row.extra_info.get("uid", row.extra_info.get("index", row.index)))
            records.append(dict(index=row.index, sample=r % params.n, uid=uid, data_source=row.data_source,
                                ground_truth=row.ground_truth, prompt=row.prompt,
                                response=tokenizer.decode(response, skip_special_tokens=True),
                                prompt_tokens=token_lists[int(out.prompt_index_r[r])], tokens=response,
                                logprobs=out.response_logprobs_rt[r, :len(response)].tolist(),
                                finish_reason=out.finish_reasons[r].value, policy_version=out.policy_version))
        if reward is not None:
            mine = records[-out.num_rollouts:]
            scores = reward.score([chunk[int(out.prompt_index_r[r])] for r in range(out.num_rollouts)],
                                  [record["response"] for record in mine])
            for record, score in zip(mine, scores.tolist()):
                record["score"] = score
    return records
