"""The pure alert detectors on crafted sequences: each fires exactly where the sequence says it should."""

import math

import pytest

from rlhf.ops.detectors import DropDetector, FlatDetector, SpikeDetector, non_finite, robust_z


def _fired(detector, values):
    return [i for i, v in enumerate(values) if detector.update(v) not in (None, False)]


def test_robust_z_uses_median_and_mad():
    history = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, MAD 1: the outlier in the history does not widen it
    assert robust_z(5.0, history) == pytest.approx(0.6745 * 2)
    assert robust_z(3.0, [3.0] * 4) == robust_z(3.5, [3.0] * 4) == 0.0, "no spread, no scale to judge by"


def test_first_nonzero_loss_after_all_zero_steps_is_no_spike():
    detector = SpikeDetector(window=20, min_history=5, z_threshold=8.0, upward_only=True)
    assert _fired(detector, [0.0] * 6 + [0.3, 0.25, 0.0, 0.31]) == []


def test_spike_detector_fires_on_the_spikes_only():
    losses = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 9.0, 1.0, 0.98, 9.5]
    assert _fired(SpikeDetector(window=20, min_history=5, z_threshold=8.0), losses) == [6, 9]
    # before min_history values nothing fires, however large
    assert _fired(SpikeDetector(window=20, min_history=5, z_threshold=8.0), [1.0, 1.1, 50.0]) == []
    # two-sided for losses, upward only for gradient norms
    drops = [1.0, 1.1, 0.9, 1.05, 0.95, -8.0]
    assert _fired(SpikeDetector(window=20, min_history=5, z_threshold=8.0), drops) == [5]
    assert _fired(SpikeDetector(window=20, min_history=5, z_threshold=8.0, upward_only=True), drops) == []
    assert _fired(SpikeDetector(window=20, min_history=1, z_threshold=8.0), [1.0, math.nan, math.inf, 1.0]) == []


def test_spike_detector_takes_a_lasting_level_shift_as_the_new_normal():
    detector = SpikeDetector(window=5, min_history=5, z_threshold=8.0)
    shifted = [10.0, 10.1, 9.9, 10.05, 9.95, 1.0, 1.1, 0.9, 1.05, 0.95]
    assert _fired(detector, shifted) == [5, 6, 7], "fires until the window's median has moved to the new level"
    assert list(detector.history) == [1.0, 1.1, 0.9, 1.05, 0.95]


def test_drop_detector_compares_with_the_window_median():
    detector = DropDetector(window=10, min_history=3, ratio=0.5)
    assert _fired(detector, [100.0, 110.0, 90.0, 60.0, 40.0, 100.0]) == [4]
    assert DropDetector(window=10, min_history=3, ratio=0.5).update(1.0) is None
    detector = DropDetector(window=10, min_history=2, ratio=0.5)
    detector.update(8.0)
    detector.update(12.0)
    assert detector.update(3.0) == 10.0, "returns the median it compared against"


def test_flat_detector_fires_once_per_flat_stretch():
    detector = FlatDetector(steps=3, tolerance=1e-6)
    assert _fired(detector, [0.5, 0.2, 0.2, 0.2, 0.2, 0.3, 0.3, 0.3]) == [3, 7]


def test_non_finite_names_the_values():
    values = {"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "critic/vf_loss": 1.0}
    assert non_finite(values, ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "missing")) == [
        "actor/pg_loss=nan", "actor/grad_norm=inf"]
