"""The doctor probe reports PASS, MISMATCH (layout differs on one rank) and HANG (a rank never joins)."""

import time

import torch.distributed as dist

from rlhf.dist.probe import run_probe
from rlhf.testing.distributed import run_distributed


def _pass_then_mismatch() -> list[dict]:
    results = [run_probe(num_tensors=300, timeout_s=30).to_dict()]
    num_tensors = 301 if dist.get_rank() == 1 else 300
    results.append(run_probe(num_tensors=num_tensors, timeout_s=30).to_dict())
    return results


def _one_rank_absent() -> tuple[str, str, float]:
    if dist.get_rank() == 1:
        time.sleep(8)  # stands in for a rank stuck elsewhere; it returns only after the probe gave up
        return "absent", "", 0.0
    started = time.monotonic()
    result = run_probe(num_tensors=50, timeout_s=2)
    return result.status, result.detail, time.monotonic() - started


def test_probe_passes_then_detects_a_layout_mismatch():
    for rank, (passed, mismatch) in enumerate(run_distributed(_pass_then_mismatch, 2, timeout_s=120)):
        assert passed["status"] == "PASS", passed
        assert set(passed["timings_s"]) == {"plain", "bucket", "rs_ag"}
        assert passed["detail"].startswith("300 tensors on 2 ranks: plain ")
        assert mismatch["status"] == "MISMATCH"
        assert "ranks [1]: 301 tensors instead of 300; first extra tensor is #300" in mismatch["detail"], mismatch


def test_probe_reports_hang_within_its_timeout():
    (status, detail, elapsed_s), absent = run_distributed(_one_rank_absent, 2, timeout_s=60)
    assert absent[0] == "absent"
    assert status == "HANG"
    assert detail.startswith("fingerprint exchange for all_reduce(op=sum, strategy=plain) did not complete within")
    assert 1.9 < elapsed_s < 8.0, elapsed_s  # gave up at its 2 s timeout, before the absent rank came back
