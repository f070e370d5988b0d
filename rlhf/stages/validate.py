"""Validation on held-out prompts: mean@1 (greedy by default), and mean@n / pass@n when `sampling.val_n > 1`, over
all prompts and per data source (`val/<data_source>/score/mean@n`); the first prompts' generations as text."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhf.agents.rollout import MultiTurnRollout
from rlhf.data.loader import TokenizedPrompts
from rlhf.parallel.wire import all_gather_json
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch, Rollouts
from rlhf.stages.exchange import is_contributor
from rlhf.stages.scoring import Scorer


@dataclass
class Validation:
    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)  # the first prompts: prompt, response, score, ...


def _my_rows(num: int, dp_rank: int, dp_size: int) -> range:
    per = -(-num // dp_size)
    return range(dp_rank * per, min(num, (dp_rank + 1) * per))


def _sample(prompts: TokenizedPrompts, index: int, rollouts: Rollouts, row: int, scorer: Scorer,
            scores: list[float]) -> dict:
    """The first generation of prompt `index` (row `row` of the chunk) as text."""
    record = prompts.records[index]
    first = int((rollouts.prompt_index_r == row).nonzero()[0])
    return {"index": record.index, "data_source": record.data_source, "ground_truth": record.ground_truth,
            "prompt": scorer.tokenizer.decode(prompts.token_ids[index], skip_special_tokens=False),
            "response": scorer.tokenizer.decode(rollouts.response(first), skip_special_tokens=True),
            "score": scores[0]}


@dataclass
class _Chunk:
    scores: list[list[float]]
    samples: list[dict]


def _multiturn_chunk(multiturn: MultiTurnRollout, engine: RolloutEngine, prompts: TokenizedPrompts, index: list[int],
                     scorer: Scorer, params: SamplingParams, pad_token_id: int, num_samples: int) -> _Chunk:
    """Trajectories of the prompts `index`, scored on their last turn (or by their environment); a dropped
    group scores 0."""
    records = [prompts.records[i] for i in index]
    result = multiturn.collect(engine, records, params, pad_token_id)
    if result is None:  # a TP rank that followed its leader's engine calls
        return _Chunk([], [])
    texts = multiturn.final_texts(result)
    rule = iter(scorer.score_texts([r for r, _ in texts], [t for _, t in texts]).tolist() if texts else [])
    chunk = _Chunk([], [])
    for i, group in zip(index, result.groups):
        scores = [(t.reward, next(rule)) for t in group.trajectories]  # the rule score of every kept trajectory
        scores = [own if own is not None else rule_score for own, rule_score in scores]
        chunk.scores.append(scores if group.dropped is None else [0.0] * params.n)
        if i < num_samples:
            first = group.trajectories[0] if group.trajectories else None
            record = prompts.records[i]
            chunk.samples.append({
                "index": record.index, "data_source": record.data_source, "ground_truth": record.ground_truth,
                "prompt": scorer.tokenizer.decode(prompts.token_ids[i], skip_special_tokens=False),
                "response": (scorer.tokenizer.decode(list(first.rows[-1].response), skip_special_tokens=False)
                             if first else f"[group dropped: {group.dropped}]"),
                "score": chunk.scores[-1][0], "termination": first.termination.value if first else "env_error"})
    return chunk


def score_metrics(scores_pn: torch.Tensor, prefix: str = "val") -> dict[str, float]:
    """mean@1 over each prompt's first sample; with n > 1 samples, mean@n and pass@n (a score >= 1 solves)."""
    metrics = {f"{prefix}/score/mean@1": float(scores_pn[:, 0].mean())}
    if scores_pn.shape[1] > 1:
        n = scores_pn.shape[1]
        metrics[f"{prefix}/score/mean@{n}"] = float(scores_pn.mean())
        metrics[f"{prefix}/score/pass@{n}"] = float((scores_pn.max(dim=1).values >= 1.0).double().mean())
    return metrics


def run_validation(engine: RolloutEngine | None, layout, prompts: TokenizedPrompts, scorer: Scorer,
                   params: SamplingParams, chunk_prompts: int, pad_token_id: int, num_samples: int = 0,
                   multiturn: MultiTurnRollout | None = None) -> Validation:
    """Collective over the world: each rollout replica scores its share of the prompts; every rank gets the
    metrics and the first `num_samples` prompts' generations (multi-turn: the whole conversation)."""
    rank = dist.get_rank()
    local: list[list[float]] = []
    samples: list[dict] = []
    if engine is not None:
        rows = _my_rows(len(prompts.records), engine.layout.dp_rank, engine.layout.dp)
        for start in range(rows.start, rows.stop, chunk_prompts):
            index = list(range(start, min(rows.stop, start + chunk_prompts)))
            if multiturn is not None:
                chunk = _multiturn_chunk(multiturn, engine, prompts, index, scorer, params, pad_token_id,
                                         num_samples)
                if is_contributor(layout, rank):
                    local += chunk.scores
                    samples += chunk.samples
                continue
            batch = PromptBatch.from_token_lists([prompts.token_ids[i] for i in index], pad_token_id=pad_token_id)
            rollouts = engine.generate(batch, params)
            if is_contributor(layout, rank):
                scores = scorer.score([prompts.records[i] for i in index], rollouts)
                for row, i in enumerate(index):
                    local.append(scores[rollouts.prompt_index_r == row].tolist())
                    if i < num_samples:
                        samples.append(_sample(prompts, i, rollouts, row, scorer, local[-1]))
    everyone = all_gather_json({"scores": local, "samples": samples} if is_contributor(layout, rank) else None)
    per_prompt = [scores for part in everyone if part is not None for scores in part["scores"]]
    assert len(per_prompt) == len(prompts.records), (len(per_prompt), len(prompts.records))
    scores_pn = torch.tensor(per_prompt, dtype=torch.float64)
    metrics = score_metrics(scores_pn)
    sources = [record.data_source for record in prompts.records]
    for source in sorted(set(sources)):
        rows_p = torch.tensor([s == source for s in sources])
        metrics.update(score_metrics(scores_pn[rows_p], prefix=f"val/{source}"))
    all_samples = [sample for part in everyone if part is not None for sample in part["samples"]]
    return Validation(metrics=metrics, samples=all_samples)
