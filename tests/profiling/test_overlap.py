"""The overlap arithmetic of `rlhf profile` on hand-made timelines, and the timeline observer itself."""

from __future__ import annotations

import pytest

from rlhf.metrics import TIMER_OBSERVERS, StepMetrics
from rlhf.profiling.overlap import PhaseTimeline, covered, overlap_report, side_of, union


def test_union_and_cover():
    assert union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert covered((1.5, 3.5), [(0.0, 2.0), (3.0, 4.0)]) == pytest.approx(1.0)


def test_side_of():
    assert [side_of(True, True), side_of(True, False), side_of(False, True)] == ["both", "rollout", "train"]


def test_sync_split_phases_do_not_overlap():
    rollout = [[["gen", 0.0, 1.0], ["gather", 1.0, 1.2], ["update_weights", 1.2, 4.0]]]
    train = [[["gather", 0.0, 1.2], ["update_actor", 1.2, 3.9], ["update_weights", 3.9, 4.0]]]
    report = overlap_report([train, rollout], ["train", "rollout"])
    rows = {(row["side"], row["phase"]): row["overlapped_s"] for row in report["phases"]}
    assert report["both_busy_s"] == 0.0 and rows[("rollout", "gen")] == rows[("train", "update_actor")] == 0.0
    # the rollout rank's weight push waits out the whole update: overlapped, but by waiting
    assert rows[("rollout", "update_weights")] == pytest.approx(2.7)


def test_async_split_overlap_per_phase_median_over_steps():
    # step 1: generation (0..1) runs inside the update (0..3); step 2: generation 0..2 against update 0.5..3
    rollout = [[["gen", 0.0, 1.0], ["gather", 1.0, 3.1]], [["gen", 0.0, 2.0], ["gather", 2.0, 3.1]]]
    train = [[["update_actor", 0.0, 3.0], ["gather", 3.0, 3.1]], [["adv", 0.0, 0.5], ["update_actor", 0.5, 3.0],
                                                                  ["gather", 3.0, 3.1]]]
    report = overlap_report([train, rollout], ["train", "rollout"])
    rows = {(row["side"], row["phase"]): row for row in report["phases"]}
    assert rows[("rollout", "gen")]["seconds"] == pytest.approx(1.5)  # median of 1 and 2
    assert rows[("rollout", "gen")]["overlapped_s"] == pytest.approx(1.5)  # all of it: 1 and 2 (adv counts)
    assert rows[("train", "update_actor")]["overlapped_s"] == pytest.approx(1.25)  # 1 and 1.5
    assert rows[("rollout", "gather")]["overlapped_s"] == pytest.approx(1.5)  # waiting out the update: 2 and 1
    assert rows[("train", "gather")]["overlapped_s"] == 0.0
    assert report["both_busy_s"] == pytest.approx(1.5)
    assert [key[0] for key in rows][0] == "rollout"


def test_colocated_has_no_overlap_report():
    assert overlap_report([[[["gen", 0.0, 1.0]]]] * 2, ["both", "both"]) is None


def test_timeline_records_phases_from_the_step_start():
    timeline = PhaseTimeline()
    TIMER_OBSERVERS.append(timeline)
    try:
        metrics = StepMetrics()
        with metrics.timer("step"):
            with metrics.timer("gen"):
                pass
            with metrics.timer("update_actor"):
                with metrics.timer("inner"):
                    pass
        with metrics.timer("validation"):  # between steps: no step's phase
            pass
    finally:
        TIMER_OBSERVERS.remove(timeline)
    (step,) = timeline.steps
    assert [name for name, _, _ in step] == ["gen", "inner", "update_actor"]
    gen, inner, update = step
    assert 0 <= gen[1] <= gen[2] <= update[1] <= inner[1] <= inner[2] <= update[2]
