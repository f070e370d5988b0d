"""Sequence-parallel grad reduction on 2 gloo ranks, against per-tensor torch collectives."""

import torch
import torch.distributed as dist

from rlhf.dist.reductions import reduce_sequence_parallel_grads
from rlhf.errors import CollectiveMismatchError
from rlhf.testing.distributed import run_distributed


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for param in model[1].parameters():
        param.sequence_parallel = True
    model(torch.randn(3, 4)).square().sum().backward()
    return model


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def _sequence_parallel_grads() -> dict:
    rank = dist.get_rank()
    model = _model(rank)
    model[1].bias.main_grad = torch.full((4,), float(rank + 1))  # megatron DDP keeps grads in main_grad
    before = {name: _grad(p).clone() for name, p in model.named_parameters()}
    want = {name: grad.clone() for name, grad in before.items()}
    for name in ("1.weight", "1.bias"):
        dist.all_reduce(want[name])
    out = {"num_reduced": reduce_sequence_parallel_grads(model.named_parameters(), None, verify=True)}
    out["equal"] = {name: torch.equal(_grad(p), want[name]) for name, p in model.named_parameters()}
    out["bias_main_grad"] = _grad(model[1].bias).tolist()
    if rank == 1:
        model[1].weight.grad = None  # this rank's norm weight got no grad: the ranks disagree
    try:
        reduce_sequence_parallel_grads(model.named_parameters(), None, verify=True)
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


def test_sequence_parallel_grads_summed_over_the_group_others_untouched():
    for out in run_distributed(_sequence_parallel_grads, 2, timeout_s=60):
        assert out["num_reduced"] == 2
        assert out["equal"] == {"0.weight": True, "0.bias": True, "1.weight": True, "1.bias": True}
        assert out["bias_main_grad"] == [3.0] * 4
        assert out["mismatch"].endswith("ranks [1]: 1 tensors instead of 2; first missing tensor is #1 '1.weight' "
                                        "shape (4,) float32"), out["mismatch"]
