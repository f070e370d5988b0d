"""The `rlhf doctor` collective probe: many small tensors, per-tensor vs bucketed, under a hard deadline.

PASS: every strategy returned the exact expected sums. MISMATCH: ranks disagreed on the layout (fingerprint)
or a result was wrong. HANG: a peer did not answer within `timeout_s`; the group is unusable afterwards.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from rlhf.parallel.collectives import all_reduce
from rlhf.parallel.wire import collective_device
from rlhf.errors import CollectiveMismatchError
from rlhf.platform import synchronize

ProbeStatus = Literal["PASS", "HANG", "MISMATCH"]
_STRATEGIES = ("plain", "bucket", "rs_ag")


@dataclass
class ProbeResult:
    status: ProbeStatus
    detail: str
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def probe_tensors(num_tensors: int, rank: int, device: torch.device) -> list[torch.Tensor]:
    """Bias/norm-like tensors (16 B to 64 KiB, fp32 and bf16); shapes shared by all ranks, values per rank.

    Values are small integers so every summation order is exact and results compare bitwise.
    """
    shapes_gen = torch.Generator().manual_seed(20261129)
    values_gen = torch.Generator().manual_seed(rank)
    tensors = []
    for _ in range(num_tensors):
        dtype = torch.bfloat16 if torch.rand((), generator=shapes_gen) < 0.5 else torch.float32
        num_bytes = 2 ** (4 + 12 * torch.rand((), generator=shapes_gen).item())
        numel = max(1, int(num_bytes) // dtype.itemsize)
        tensors.append(torch.randint(-8, 9, (numel,), generator=values_gen).to(dtype).to(device))
    return tensors


def run_probe(group: dist.ProcessGroup | None = None, num_tensors: int = 2000,
              timeout_s: float = 60.0) -> ProbeResult:
    """Sum `num_tensors` small tensors across `group` with each strategy; never blocks past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    device = collective_device(group)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    inputs = probe_tensors(num_tensors, rank, device)
    expected = [sum(parts) for parts in zip(*(probe_tensors(num_tensors, other, device)
                                               for other in range(world_size)))]
    timings_s: dict[str, float] = {}
    for strategy in _STRATEGIES:
        outputs = [t.clone() for t in inputs]
        started = time.perf_counter()
        try:
            all_reduce(outputs, group=group, strategy=strategy, verify=True, name="doctor probe",
                       timeout_s=max(deadline - time.monotonic(), 0.001))
        except CollectiveMismatchError as exc:
            return ProbeResult(status="MISMATCH", detail=str(exc), timings_s=timings_s)
        except TimeoutError as exc:
            return ProbeResult(status="HANG", detail=f"{exc} (probe timeout {timeout_s:g}s)", timings_s=timings_s)
        synchronize()
        timings_s[strategy] = time.perf_counter() - started
        wrong = next((i for i, (got, want) in enumerate(zip(outputs, expected)) if not torch.equal(got, want)), None)
        if wrong is not None:
            return ProbeResult(status="MISMATCH", timings_s=timings_s,
                               detail=f"{strategy} all_reduce returned wrong sums for tensor #{wrong} on rank {rank}")
    speedup = timings_s["plain"] / max(timings_s["bucket"], 1e-9)
    return ProbeResult(status="PASS", timings_s=timings_s,
                       detail=f"{num_tensors} tensors on {world_size} ranks: plain {timings_s['plain']:.3f}s, "
                              f"bucket {timings_s['bucket']:.3f}s ({speedup:.1f}x), rs_ag {timings_s['rs_ag']:.3f}s")
