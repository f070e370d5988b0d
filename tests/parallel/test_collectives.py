"""Bucketed collectives on 2 and 4 gloo ranks: bitwise equal to per-tensor collectives, loud on mismatch.

gloo's ring sums each element in an order that depends on its position in the buffer, so on 4 ranks a
bucketed float sum can differ from a per-tensor one in the last bit. The 4-rank sum/avg data are therefore
small integers times a power of two (every summation order is exact); 2-rank data are arbitrary floats
(a + b is commutative) and max is order-free everywhere.
"""

import torch
import torch.distributed as dist

from rlhf.parallel.collectives import all_gather, all_reduce, broadcast
from rlhf.errors import CollectiveMismatchError, ConfigError
from rlhf.testing.distributed import run_distributed

SHAPES_DTYPES = [((), torch.float32), ((0,), torch.float32), ((3,), torch.bfloat16), ((5, 7), torch.float32),
                 ((), torch.bfloat16), ((4, 6), torch.float32), ((0, 3), torch.bfloat16), ((33,), torch.bfloat16),
                 ((300_000,), torch.float32), ((2, 3, 4), torch.float32), ((17,), torch.int64)]
# (strategy, min_bucket_mb): one big bucket per dtype, several small ones, every tensor alone.
REDUCE_COMBOS = [("bucket", 1.0), ("bucket", 0.0001), ("bucket", 0.0), ("rs_ag", 1.0), ("rs_ag", 0.0001),
                 ("plain", 1.0)]
GATHER_COMBOS = [("bucket", 1.0), ("bucket", 0.0001), ("bucket", 0.0), ("rs_ag", 0.0001), ("plain", 1.0)]


def _make_tensors(rank: int, exact: bool) -> list[torch.Tensor]:
    """One rank's inputs; index 5 is a non-contiguous view (a transpose) to check in-place writes."""
    gen = torch.Generator().manual_seed(1000 + rank)
    tensors = []
    for index, (shape, dtype) in enumerate(SHAPES_DTYPES):
        if dtype == torch.int64 or exact:
            values = torch.randint(-8, 9, shape, generator=gen).to(dtype)
            if dtype.is_floating_point:
                values = values * 2.0 ** (index % 5 - 2)
        else:
            values = torch.randn(shape, generator=gen).to(dtype)
        tensors.append(values)
    tensors[5] = tensors[5].t().contiguous().t()
    return tensors


def _reference_all_reduce(tensors, op):
    out = [t.clone() for t in tensors]
    for t in out:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "avg":
            t.div_(dist.get_world_size())
    return out


def _failures_all_reduce(rank: int, exact_sums: bool) -> list[str]:
    failures = []
    for op in ("sum", "avg", "max"):
        inputs = _make_tensors(rank, exact=exact_sums and op != "max")
        if op == "avg":
            inputs = [t for t in inputs if t.dtype != torch.int64]
        want = _reference_all_reduce(inputs, op)
        for strategy, size_mb in REDUCE_COMBOS:
            got = [t.clone() for t in inputs]
            got[5] = inputs[5].clone().t().contiguous().t()  # keep it non-contiguous
            result = all_reduce(got, op=op, strategy=strategy, min_bucket_mb=size_mb, verify=True)
            assert result is got
            failures += [f"all_reduce {op} {strategy} {size_mb}MB tensor #{i}"
                         for i, (g, w) in enumerate(zip(got, want)) if not (torch.equal(g, w) and g.dtype == w.dtype)]
        named = {f"p{i}": t.clone() for i, t in enumerate(inputs)}
        all_reduce(named, op=op, min_bucket_mb=0.0001)
        failures += [f"all_reduce dict {op} {k}" for k, w in zip(named, want) if not torch.equal(named[k], w)]
    return failures


def _failures_gather_broadcast(rank: int) -> list[str]:
    failures = []
    inputs = _make_tensors(rank, exact=False)
    want_gather = []
    for t in inputs:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        want_gather.append(parts)
    src = dist.get_world_size() - 1
    want_bcast = [t.clone() for t in inputs]
    for t in want_bcast:
        dist.broadcast(t, src=src)
    for strategy, size_mb in GATHER_COMBOS:
        got = all_gather(inputs, strategy=strategy, min_bucket_mb=size_mb, verify=True)
        failures += [f"all_gather {strategy} {size_mb}MB tensor #{i} rank {r}"
                     for i, (g, w) in enumerate(zip(got, want_gather))
                     for r in range(len(w)) if not torch.equal(g[r], w[r])]
        received = [t.clone() for t in inputs]
        broadcast(received, src=src, strategy=strategy, min_bucket_mb=size_mb, verify=True)
        failures += [f"broadcast {strategy} {size_mb}MB tensor #{i}"
                     for i, (g, w) in enumerate(zip(received, want_bcast)) if not torch.equal(g, w)]
    params = [torch.nn.Parameter(torch.full((3,), float(rank))), torch.nn.Parameter(torch.full((), float(rank)))]
    broadcast(params, src=src)  # leaves that require grad (weight sync) are written in place too
    if not all(torch.equal(p, torch.full_like(p, float(src))) and p.requires_grad for p in params):
        failures.append("broadcast parameters")
    named = all_gather({"b": inputs[2], "a": inputs[0]})
    if not (torch.equal(named["b"][0], want_gather[2][0]) and torch.equal(named["a"][-1], want_gather[0][-1])):
        failures.append("all_gather dict")
    return failures


def _mismatch_messages(rank: int) -> list[str]:
    """Several disagreements in one world; each must raise on every rank and leave the group usable."""
    messages = []
    base = [torch.zeros(3), torch.zeros(2, 2), torch.zeros((), dtype=torch.bfloat16)]
    variants = {
        "extra tensor": base + [torch.zeros(5)] if rank == 1 else base,
        "shape": [torch.zeros(3), torch.zeros(2, 3) if rank == 2 else torch.zeros(2, 2), base[2]],
        "dtype": base[:2] + [torch.zeros((), dtype=torch.float32 if rank == 0 else torch.bfloat16)],
    }
    for label, tensors in variants.items():
        try:
            all_reduce(tensors, verify=True, name=label)
            messages.append(f"{label}: no error")
        except CollectiveMismatchError as exc:
            messages.append(f"{label}: {exc}")
    try:
        all_reduce(base, op="max" if rank == 1 else "sum", verify=True)
        messages.append("op: no error")
    except CollectiveMismatchError as exc:
        messages.append(f"op: {exc}")
    try:
        names = {"w": torch.ones(1), ("bias" if rank == 0 else "beta"): torch.ones(1)}
        broadcast(names, src=0, verify=True)
        messages.append("name: no error")
    except CollectiveMismatchError as exc:
        messages.append(f"name: {exc}")
    try:
        all_gather([torch.zeros(4 if rank == 2 else 3)], verify=True)
        messages.append("gather: no error")
    except CollectiveMismatchError as exc:
        messages.append(f"gather: {exc}")
    try:
        all_reduce(base, strategy="plain" if rank == 3 else "bucket", min_bucket_mb=0.5, verify=True)
        messages.append("strategy: no error")
    except CollectiveMismatchError as exc:
        messages.append(f"strategy: {exc}")
    check = torch.ones(1)
    dist.all_reduce(check)  # the group still works after the errors
    messages.append(f"after: {check.item()}")
    return messages


def _bad_arguments() -> list[str]:
    errors = []
    for kwargs in ({"strategy": "ring"}, {"op": "mean"}, {"min_bucket_mb": -1}):
        try:
            all_reduce([torch.ones(1)], **kwargs)
        except ConfigError as exc:
            errors.append(str(exc))
    try:
        all_reduce([torch.ones(1, dtype=torch.int64)], op="avg")
    except ConfigError as exc:
        errors.append(str(exc))
    try:
        broadcast([torch.ones(1)], src=5)
    except ConfigError as exc:
        errors.append(str(exc))
    return errors


def _two_rank_world() -> dict:
    rank = dist.get_rank()
    return {"reduce": _failures_all_reduce(rank, exact_sums=False),
            "gather": _failures_gather_broadcast(rank),
            "bad_arguments": _bad_arguments()}


def _four_rank_world() -> dict:
    rank = dist.get_rank()
    return {"reduce": _failures_all_reduce(rank, exact_sums=True),
            "gather": _failures_gather_broadcast(rank),
            "mismatch": _mismatch_messages(rank)}


def test_two_ranks_bitwise_equal_to_per_tensor_collectives_and_bad_arguments_are_config_errors():
    for result in run_distributed(_two_rank_world, 2, timeout_s=120):
        assert result["reduce"] == [] and result["gather"] == []
        assert result["bad_arguments"] == [
            "comm.strategy='ring' is not one of bucket, rs_ag, plain",
            "all_reduce op='mean' is not one of sum, avg, max, min, product",
            "comm.min_bucket_mb=-1 must be a finite number >= 0 (default 1.0)",
            "all_reduce op='avg' needs floating tensors; got '[0]' shape (1,) int64; use op='sum'",
            "broadcast src=5 is not a rank of the group (ranks [0, 1])",
        ]


def test_four_ranks_bitwise_equal_and_mismatches_raise_on_every_rank():
    results = run_distributed(_four_rank_world, 4, timeout_s=120)
    for result in results:
        assert result["reduce"] == [] and result["gather"] == []
    for rank, result in enumerate(results):
        extra, shape, dtype, op, name, gather, strategy, after = result["mismatch"]
        assert extra == ("extra tensor: collective layouts differ across 4 ranks (ranks [0, 2, 3] agree on "
                         "all_reduce(op=sum, strategy=bucket, min_bucket_mb=1) with 3 tensors):\n"
                         "  ranks [1]: 4 tensors instead of 3; first extra tensor is #3 '[3]' shape (5,) float32"), \
            (rank, extra)
        assert shape.endswith("ranks [2]: tensor #1 is '[1]' shape (2, 3) float32, expected '[1]' shape (2, 2) "
                              "float32"), (rank, shape)
        assert dtype.endswith("ranks [0]: tensor #2 is '[2]' shape () float32, expected '[2]' shape () bfloat16")
        assert op.endswith("ranks [1]: call all_reduce(op=max, strategy=bucket, min_bucket_mb=1) instead of "
                           "all_reduce(op=sum, strategy=bucket, min_bucket_mb=1)")
        assert "ranks [1, 2, 3] agree on broadcast(src=0, strategy=bucket, min_bucket_mb=1)" in name
        assert name.endswith("ranks [0]: tensor #0 is 'bias' shape (1,) float32, expected 'beta' shape (1,) float32")
        assert gather.endswith("ranks [2]: tensor #0 is '[0]' shape (4,) float32, expected '[0]' shape (3,) "
                               "float32"), (rank, gather)
        assert strategy.endswith("ranks [3]: call all_reduce(op=sum, strategy=plain) instead of "
                                 "all_reduce(op=sum, strategy=bucket, min_bucket_mb=0.5)"), (rank, strategy)
        assert after == "after: 4.0"

