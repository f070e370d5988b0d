"""Supervised fine-tuning on (prompt, ground-truth answer) records, on the actor mesh, then HF export.

Used to warm-start a policy before RL (the CPU demo). The loss is token-mean NLL over answer tokens (+ EOS)
normalised by the global token count, so it is the same for any DP size and micro-batching.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from rlhf.orchestration.schema import RlhfConfig
from rlhf.data.loader import load_prompts
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenize import TokenizedPrompts
from rlhf.parallel.meshes import ModelDims, build_role_meshes
from rlhf.errors import ConfigError
from rlhf.metrics import MetricReducer, MetricsSink, StepMetrics
from rlhf.models.hf_export import export_hf
from rlhf.rollout.factory import engine_layout, eos_token_ids
from rlhf.run_dir import RunDir, get_logger, progress
from rlhf.stages.batch import SequenceBatch
from rlhf.stages.roles import PolicyRole
from rlhf.orchestration.config import SftConfig
from rlhf.stages.scoring import Scorer
from rlhf.stages.validate import validate

log = get_logger("sft")


def sft_batch(prompts: TokenizedPrompts, rows: list[int], tokenizer: Any, pad_token_id: int) -> SequenceBatch:
    """Right-padded prompt + answer + EOS sequences; the answer tokens form the 'response'."""
    answers = [list(tokenizer.encode(prompts.records[i].ground_truth, add_special_tokens=False))
               + [tokenizer.eos_token_id] for i in rows]
    seqs = [prompts.token_ids[i] + answer for i, answer in zip(rows, answers)]
    width, resp_width = max(len(s) for s in seqs), max(len(a) for a in answers)
    tokens_bs = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        tokens_bs[row, :len(seq)] = torch.tensor(seq)
    lengths_b = torch.tensor([len(a) for a in answers])
    mask_bt = torch.arange(resp_width)[None, :] < lengths_b[:, None]
    return SequenceBatch(tokens_bs=tokens_bs,
                         prompt_lengths_b=torch.tensor([len(prompts.token_ids[i]) for i in rows]),
                         response_lengths_b=lengths_b, response_mask_bt=mask_bt, pad_token_id=pad_token_id)


def run_sft(cfg: RlhfConfig, sft: SftConfig, run_dir: RunDir) -> dict[str, float]:
    """Train, validate (greedy, mean@1), export; returns the last validation metrics."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.path)
    dims = ModelDims(hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads)
    meshes = build_role_meshes(type(cfg.mesh)(roles=["actor", "rollout"], actor=cfg.mesh.actor,
                                              rollout=cfg.mesh.actor), dims, timeout_s=cfg.dist.timeout_s)
    dp, micro = meshes["actor"].layout.dp, cfg.actor.micro_batch_size
    packed = bool(cfg.actor.max_tokens_per_microbatch)  # packed micro-batches take any rows per rank
    if sft.batch_size % (dp * (1 if packed else micro)):
        split = f"dp={dp}" if packed else f"dp={dp} x actor.micro_batch_size={micro}"
        raise ConfigError(f"sft.batch_size={sft.batch_size} must be a multiple of {split}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = load_prompts(cfg.data.train_files, tokenizer, cfg.data)
    val = load_prompts(cfg.data.val_files, tokenizer, cfg.data, label="data.val_files") if cfg.data.val_files else None
    actor = PolicyRole("actor", meshes["actor"], cfg.model.path, update=cfg.actor, total_steps=sft.steps,
                       seed=cfg.dist.seed, fused_head=cfg.model.fused_head, params_dtype=cfg.model.torch_dtype)
    sampler = PromptSampler(num_samples=len(train.records), global_batch_size=sft.batch_size, dp_rank=0, dp_size=1,
                            batch_key="sft.batch_size",
                            seed=cfg.data.seed)
    scorer = Scorer(cfg.reward, tokenizer)
    engine = _engine(cfg, actor, meshes["rollout"])
    sink = MetricsSink(run_dir.path, enabled=run_dir.is_rank0, tensorboard=cfg.trainer.tensorboard)

    def val_metrics(step: int) -> dict[str, float]:
        if val is None:
            return {}
        chunk = cfg.rollout.native.max_batch_size
        return validate(engine, meshes["rollout"].layout, val, scorer, cfg.sampling.val_params(step), chunk, pad)

    last = {}
    reducer = MetricReducer(strategy=cfg.comm.strategy, min_bucket_mb=cfg.comm.min_bucket_mb, verify=cfg.comm.verify,
                            timeout_s=cfg.dist.timeout_s)
    for step in progress(range(1, sft.steps + 1), desc="sft", total=sft.steps):
        batch = sft_batch(train, sampler.next_indices(), tokenizer, pad)
        metrics = StepMetrics()
        with metrics.timer("step"):
            metrics.update_from_shards(actor.sft_update(batch))
        values = metrics.reduced(reducer)
        if (sft.val_every and step % sft.val_every == 0) or step == sft.steps:
            last = val_metrics(step)
            values.update(last)
            log.info("sft step %d: loss %.4f val %s", step, values.get("sft/loss", float("nan")), last)
        sink.write(step, values)
    sink.close()
    if sft.out_dir and actor.model is not None:
        export_hf(actor.model, sft.out_dir, tokenizer_dir=cfg.model.path)
        log.info("exported the SFT policy to %s", sft.out_dir)
    return last


def _engine(cfg: RlhfConfig, actor: PolicyRole, mesh):
    if not mesh.is_member:
        return None
    from rlhf.rollout.native.engine import NativeEngine

    return NativeEngine(actor.model, vocab_size=actor.vocab_size, config=cfg.rollout.native,
                        eos_token_ids=eos_token_ids(cfg.model.path), layout=engine_layout(mesh.pgs),
                        tp_group=mesh.pgs.tp)
