"""Validation on held-out prompts: mean@1 (greedy by default), and mean@n / pass@n when `sampling.val_n > 1`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.data.loader import TokenizedPrompts
from rlhf.parallel.wire import all_gather_json
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sampling_params import SamplingParams
from rlhf.rollout.types import PromptBatch
from rlhf.trainer.exchange import is_contributor
from rlhf.trainer.scoring import Scorer


def _my_rows(num: int, dp_rank: int, dp_size: int) -> range:
    per = -(-num // dp_size)
    return range(dp_rank * per, min(num, (dp_rank + 1) * per))


def validate(engine: RolloutEngine | None, layout, prompts: TokenizedPrompts, scorer: Scorer,
             params: SamplingParams, chunk_prompts: int, pad_token_id: int) -> dict[str, float]:
    """Collective over the world: each rollout replica scores its share of the prompts; every rank gets the
    metrics. A score of at least 1.0 counts as solved for pass@n."""
    rank = dist.get_rank()
    local: list[list[float]] = []
    if engine is not None:
        rows = _my_rows(len(prompts.records), engine.layout.dp_rank, engine.layout.dp)
        for start in range(rows.start, rows.stop, chunk_prompts):
            index = list(range(start, min(rows.stop, start + chunk_prompts)))
            batch = PromptBatch.from_token_lists([prompts.token_ids[i] for i in index], pad_token_id=pad_token_id)
            rollouts = engine.generate(batch, params)
            if is_contributor(layout, rank):
                scores = scorer.score([prompts.records[i] for i in index], rollouts)
                for row in range(len(index)):
                    local.append(scores[rollouts.prompt_index_r == row].tolist())
    everyone = all_gather_json(local if is_contributor(layout, rank) else None)
    per_prompt = [scores for part in everyone if part is not None for scores in part]
    assert len(per_prompt) == len(prompts.records), (len(per_prompt), len(prompts.records))
    scores_pn = torch.tensor(per_prompt, dtype=torch.float64)
    metrics = {"val/score/mean@1": float(scores_pn[:, 0].mean())}
    if scores_pn.shape[1] > 1:
        n = scores_pn.shape[1]
        metrics[f"val/score/mean@{n}"] = float(scores_pn.mean())
        metrics[f"val/score/pass@{n}"] = float((scores_pn.max(dim=1).values >= 1.0).double().mean())
    return metrics
