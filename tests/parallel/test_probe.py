"""The doctor probe reports PASS, MISMATCH (layout differs on one rank) and HANG (a rank never joins)."""

from datetime import timedelta

import torch.distributed as dist

from rlhf.parallel.probe import run_probe
from rlhf.platform.compat import torch as torch_compat
from rlhf.testing.distributed import run_distributed


def _pass_then_mismatch() -> list[dict]:
    results = [run_probe(num_tensors=300, timeout_s=30).to_dict()]
    num_tensors = 301 if dist.get_rank() == 1 else 300
    results.append(run_probe(num_tensors=num_tensors, timeout_s=30).to_dict())
    return results


def _one_rank_absent() -> tuple[str, str]:
    store = torch_compat.default_store()
    if dist.get_rank() == 1:
        # Stands in for a rank stuck elsewhere: it waits until rank 0's probe has given up on its own.
        store.wait(["probe_returned"], timedelta(seconds=600))
        return "absent", ""
    result = run_probe(num_tensors=50, timeout_s=2)
    store.set("probe_returned", "1")  # only now may the absent rank go on: the probe gave up without it
    return result.status, result.detail


def test_probe_passes_then_detects_a_layout_mismatch():
    for rank, (passed, mismatch) in enumerate(run_distributed(_pass_then_mismatch, 2, timeout_s=120)):
        assert passed["status"] == "PASS", passed
        assert set(passed["timings_s"]) == {"plain", "bucket", "rs_ag"}
        assert passed["detail"].startswith("300 tensors on 2 ranks: plain ")
        assert mismatch["status"] == "MISMATCH"
        assert "ranks [1]: 301 tensors instead of 300; first extra tensor is #300" in mismatch["detail"], mismatch


def test_probe_reports_hang_within_its_timeout():
    (status, detail), absent = run_distributed(_one_rank_absent, 2, timeout_s=60)
    assert absent[0] == "absent"
    assert status == "HANG"
    # the probe gave up on its own timeout while rank 1 was still absent (no wall-clock measurement here)
    assert detail.startswith("fingerprint exchange for all_reduce(op=sum, strategy=plain) did not complete within")
    assert detail.endswith("(a peer rank never joined?) (probe timeout 2s)"), detail
