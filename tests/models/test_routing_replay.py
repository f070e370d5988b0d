"""The router hook of routing replay on its own: given experts replace the router's where known, scores are
gathered at them (differentiably), the agreement counts, and the record is what the forward used."""

import torch

from rlhf.models.routing_replay import UNKNOWN, RouterHook


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_hook_replays_known_rows_and_routes_the_rest_itself():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 5.0, 1.0, 6.0]], requires_grad=True)
    target = torch.tensor([[2, 0], [UNKNOWN, UNKNOWN], [3, 1]])  # row 0 replayed, row 1 free, row 2 = own set
    hook = RouterHook(target_nk=target, record=True)
    values, chosen = hook.get_replay_topk(scores, 2, None, None, _topk)
    assert chosen.tolist() == [[2, 0], [3, 2], [3, 1]]
    assert values.tolist() == [[2.0, 4.0], [4.0, 3.0], [6.0, 5.0]]
    values.sum().backward()
    assert scores.grad.tolist() == [[1, 0, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    assert hook.known[0].tolist() == [True, False, True]
    assert hook.agreed[0].tolist() == [False, False, True]
    assert hook.recorded[0].tolist() == chosen.tolist() and hook.recorded[0].dtype == torch.int16


def test_hook_without_target_is_the_router_itself():
    scores = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    hook = RouterHook()
    values, chosen = hook.get_replay_topk(scores, 3, None, None, _topk)
    own = torch.topk(scores, k=3, dim=1)
    assert torch.equal(values, own.values) and torch.equal(chosen, own.indices)
    assert hook.known == [] and hook.recorded == []
