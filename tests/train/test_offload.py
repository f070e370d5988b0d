"""Frozen-model offload (reference policy, reward model): parameters leave the device and come back bit-exact."""

import torch

from rlhf.train.offload import offload_frozen, reload_frozen


def test_frozen_offload_frees_every_parameter_and_reload_restores_them_in_place():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).requires_grad_(False)
    tied = torch.nn.Linear(8, 2)
    tied.weight = model[1].weight  # a shared storage is parked once
    before = {name: param.clone() for name, param in model.named_parameters()}
    views = [param for param in model.parameters()]
    parked = offload_frozen(torch.nn.ModuleList([model, tied]))
    assert len(parked.storages) == 5  # 4 distinct params + tied.bias; the tied weight is not copied twice
    assert all(param.untyped_storage().nbytes() == 0 for param in model.parameters())
    reload_frozen(parked)
    assert all(param is view for param, view in zip(model.parameters(), views))
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert torch.equal(model(torch.ones(1, 4)), torch.nn.functional.linear(
        torch.nn.functional.linear(torch.ones(1, 4), before["0.weight"], before["0.bias"]),
        before["1.weight"], before["1.bias"]))
