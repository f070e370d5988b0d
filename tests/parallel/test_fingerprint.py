"""Fingerprints and mismatch descriptions without torch.distributed."""

import torch

from rlhf.parallel.buckets import TensorSpec
from rlhf.parallel.fingerprint import CallLayout, describe_mismatch

A = TensorSpec("a", (3,), torch.float32)
B = TensorSpec("b", (2, 2), torch.bfloat16)


def test_fingerprint_changes_with_each_field_and_is_stable():
    base = CallLayout(call="all_reduce(op=sum)", specs=(A, B))
    variants = [CallLayout(call="all_reduce(op=max)", specs=(A, B)),
                CallLayout(call=base.call, specs=(A,)),
                CallLayout(call=base.call, specs=(A, TensorSpec("c", (2, 2), torch.bfloat16))),
                CallLayout(call=base.call, specs=(A, TensorSpec("b", (4,), torch.bfloat16))),
                CallLayout(call=base.call, specs=(A, TensorSpec("b", (2, 2), torch.float16))),
                CallLayout(call=base.call, specs=(B, A))]
    fingerprint = base.fingerprint()
    assert fingerprint == CallLayout(call=base.call, specs=(A, B)).fingerprint()
    assert len(fingerprint) == 5 and fingerprint[0] == 2
    assert all(v.fingerprint() != fingerprint for v in variants)
    assert all(-2**63 <= x < 2**63 for x in fingerprint)


def test_description_names_majority_and_each_dissenting_group():
    good = CallLayout(call="all_reduce(op=sum)", specs=(A, B))
    short = CallLayout(call=good.call, specs=(A,))
    other_call = CallLayout(call="broadcast(src=0)", specs=(A, B))
    text = describe_mismatch([good, short, good, other_call, short, good], ranks=[0, 1, 2, 3, 4, 5])
    assert text == ("collective layouts differ across 6 ranks (ranks [0, 2, 5] agree on all_reduce(op=sum) with 2 "
                    "tensors):\n"
                    "  ranks [1, 4]: 1 tensors instead of 2; first missing tensor is #1 'b' shape (2, 2) bfloat16\n"
                    "  ranks [3]: call broadcast(src=0) instead of all_reduce(op=sum)")


def test_tie_prefers_the_group_with_the_lowest_rank_and_uses_global_ranks():
    good = CallLayout(call="all_gather()", specs=(A,))
    bad = CallLayout(call="all_gather()", specs=(TensorSpec("a", (4,), torch.float32),))
    text = describe_mismatch([bad, good], ranks=[6, 7])
    assert text.endswith("ranks [7]: tensor #0 is 'a' shape (3,) float32, expected 'a' shape (4,) float32")
