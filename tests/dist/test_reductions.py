"""Metric and sequence-parallel grad reductions on 2 gloo ranks, against per-value torch collectives."""

import pytest
import torch
import torch.distributed as dist

from rlhf.dist.reductions import reduce_metrics, reduce_sequence_parallel_grads
from rlhf.errors import CollectiveMismatchError, ConfigError
from rlhf.testing.distributed import run_distributed


def _metrics_and_grads() -> dict:
    rank = dist.get_rank()
    out = {}
    values = {"actor/pg_loss": 0.1 * (rank + 1), "response_length/max": torch.tensor(10.0 + rank),
              "response_length/min": 3.0 - rank, "perf/tokens": torch.tensor([100 * (rank + 1)]),
              "actor/entropy": torch.tensor(0.25 * rank, dtype=torch.float32)}
    reduce = {"actor/pg_loss": "mean", "response_length/max": "max", "response_length/min": "min",
              "perf/tokens": "sum", "actor/entropy": "mean"}
    out["metrics"] = reduce_metrics(values, reduce, verify=True)
    out["metric_order"] = list(out["metrics"])
    extra = {"x": 1.0, "y": 2.0} if rank == 0 else {"x": 1.0}
    try:
        reduce_metrics(extra, verify=True)
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for param in model[1].parameters():
        param.sequence_parallel = True
    model(torch.randn(3, 4)).square().sum().backward()
    model[1].bias.main_grad = torch.full((4,), float(rank + 1))
    before = {name: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
              for name, p in model.named_parameters()}
    want = {}
    for name, grad in before.items():
        want[name] = grad.clone()
        if name.startswith("1."):
            dist.all_reduce(want[name])
    out["num_reduced"] = reduce_sequence_parallel_grads(model.named_parameters(), None, verify=True)
    after = {name: (p.main_grad if hasattr(p, "main_grad") else p.grad) for name, p in model.named_parameters()}
    out["grad_ok"] = {name: torch.equal(after[name], want[name]) for name in want}
    out["linear_untouched"] = torch.equal(after["0.weight"], before["0.weight"])
    out["bias_main_grad"] = after["1.bias"].tolist()
    return out


def test_metrics_and_sequence_parallel_grads_match_per_value_collectives():
    for rank, out in enumerate(run_distributed(_metrics_and_grads, 2, timeout_s=60)):
        assert out["metrics"] == {"actor/pg_loss": (0.1 + 0.2) / 2, "response_length/max": 11.0,
                                  "response_length/min": 2.0, "perf/tokens": 300.0, "actor/entropy": 0.125}
        assert out["metric_order"] == ["actor/pg_loss", "response_length/max", "response_length/min",
                                       "perf/tokens", "actor/entropy"]
        assert "ranks [1]: 1 tensors instead of 2; first missing tensor is #1 'y' shape () float64" \
            in out["mismatch"], out
        assert out["num_reduced"] == 2
        assert out["grad_ok"] == {"0.weight": True, "0.bias": True, "1.weight": True, "1.bias": True}
        assert out["linear_untouched"] and out["bias_main_grad"] == [3.0] * 4


def test_unknown_metric_reduction_is_a_config_error_before_any_collective():
    with pytest.raises(ConfigError, match=r"^metric 'a' reduce='median' is not one of mean, sum, max, min$"):
        reduce_metrics({"a": 1.0}, {"a": "median"})
