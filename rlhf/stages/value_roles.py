"""The value-head roles: critic (values and the clipped value update) and a frozen reward model."""

from __future__ import annotations

import torch

from rlhf.algo.aggregation import GlobalCounts
from rlhf.algo.value_loss import value_loss
from rlhf.stages.batch import ScoredBatch, SequenceBatch, gather_response
from rlhf.stages.config import AlgoConfig
from rlhf.stages.model_role import ModelRole


def _values(values_sx1: torch.Tensor, labels_s: torch.Tensor, wanted_s: torch.Tensor) -> torch.Tensor:
    """The value head's output as the per-token output `[s, 1]` fp32 (`forward.TokenFn`)."""
    return values_sx1.float()


class CriticRole(ModelRole):
    """Value model: per-token values of the state before each response token, and the clipped value update."""

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        def fn(values_bs1: torch.Tensor, mb: SequenceBatch) -> torch.Tensor:
            return gather_response(values_bs1.squeeze(-1), mb)

        return self._forward(batch, fn, _values)

    def update(self, batch: ScoredBatch, algo: AlgoConfig) -> dict[str, float]:
        def loss_fn(values_bs1: torch.Tensor, mb: ScoredBatch, counts: GlobalCounts) -> tuple:
            values_bt = gather_response(values_bs1.squeeze(-1), mb)
            loss, metrics = value_loss(values_bt, mb.values_bt, mb.returns_bt, mb.response_mask_bt,
                                       algo.value_loss, counts)
            return loss, {k: float(v) for k, v in metrics.as_dict("critic/").items()}

        return self._train(batch, loss_fn, "critic/", _values)


class RewardModelRole(ModelRole):
    """A frozen reward model (value head): the sequence reward is its value at the last response token."""

    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        def fn(values_bs1: torch.Tensor, mb: SequenceBatch) -> torch.Tensor:
            last_b = (mb.prompt_lengths_b + mb.response_lengths_b - 1).clamp(max=mb.tokens_bs.shape[1] - 1)
            return values_bs1.squeeze(-1).gather(1, last_b[:, None]).squeeze(1)

        return self._forward(batch, fn, _values)
