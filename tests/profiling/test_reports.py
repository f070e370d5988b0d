"""Pure parts of `rlhf profile` / `rlhf bench` / the e2e benchmark: summaries, aggregation, advice, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhf.cli.bench import advice
from rlhf.cli.profile import build_report, check_steps, format_report
from rlhf.errors import ConfigError
from rlhf.profiling.runner import phase_summary, throughput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _step(step: float, gen: float, update: float, old: float = 0.1, response_len: float = 8.0) -> dict:
    return {"timing_s/step": step, "timing_s/gen": gen, "timing_s/old_log_prob": old,
            "timing_s/update_actor": update, "response_length/mean": response_len,
            "perf/total_num_tokens": 200.0}


def test_phase_summary_medians_shares_and_coverage():
    steps = [_step(1.0, 0.5, 0.3), _step(2.0, 1.0, 0.5), _step(1.0, 0.4, 0.4)]
    summary = phase_summary(steps)
    assert summary["step_s"] == 1.0
    assert summary["phases_s"] == {"gen": 0.5, "old_log_prob": 0.1, "update_actor": 0.4}
    assert summary["share"]["gen"] == pytest.approx(0.5)
    # per-step coverage 0.9, 0.8, 0.9 -> median 0.9
    assert summary["coverage"] == pytest.approx(0.9)


def test_throughput_compares_generation_with_training():
    result = throughput([_step(1.0, 0.5, 0.3), _step(1.0, 0.25, 0.3)], rollouts_per_step=16, world_size=2)
    assert result["generated_tokens_per_step"] == 128
    assert result["rollout_tok_s"] == pytest.approx((128 / 0.5 + 128 / 0.25) / 2)
    assert result["train_tok_s"] == pytest.approx(200 / 0.4)
    assert result["gen_over_train_time"] == pytest.approx((0.5 / 0.4 + 0.25 / 0.4) / 2)
    assert result["world_size"] == 2


@pytest.mark.parametrize("ratio,verdict", [(2.0, "rollout-bound"), (0.5, "training-bound"), (1.0, "balanced")])
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_advice(ratio, verdict, placement):
    text = advice(ratio, placement)
    assert text.startswith(verdict + ":")
    # Colocated roles already span every rank: "more ranks" is split-placement advice only.
    assert ("more ranks" in text) == (placement == "split" and verdict != "balanced")


def test_bad_step_counts_name_the_flag():
    with pytest.raises(ConfigError, match=r"--steps=0 must be >= 1 and --warmup=-1 >= 0"):
        check_steps(0, -1)


def test_report_sums_calls_over_ranks_and_keeps_the_slowest_time():
    per_rank = [{"memory": {"gen": 100, "step": 300}, "comm": [
                    {"phase": "update_actor", "op": "all_reduce", "calls": 4, "bytes": 800, "seconds": 0.2}],
                 "timings": [{"timing_s/step": 0.9}], "side": "train",
                 "timeline": [[["update_actor", 0.0, 0.8], ["gather", 0.8, 0.9]]]},
                {"memory": {"gen": 200, "step": 250}, "comm": [
                    {"phase": "update_actor", "op": "all_reduce", "calls": 4, "bytes": 800, "seconds": 0.6}],
                 "timings": [{"timing_s/step": 1.0}], "side": "rollout",
                 "timeline": [[["gen", 0.0, 0.5], ["gather", 0.5, 0.9]]]}]
    report = build_report([_step(1.0, 0.5, 0.4)], per_rank, timed_steps=2)
    assert report["peak_memory_bytes"] == {"gen": 200, "step": 300}
    assert report["collectives_per_step"] == [{"phase": "update_actor", "op": "all_reduce", "calls": 4.0,
                                               "bytes": 800.0, "seconds_max_rank": 0.3}]
    assert report["per_rank_timings"] == [[{"timing_s/step": 0.9}], [{"timing_s/step": 1.0}]]
    assert report["overlap"]["both_busy_s"] == pytest.approx(0.5)
    text = format_report(report)
    assert "phases account for 100.0%" in text and "update_actor" in text
    assert "both busy 0.500 s of the 1.000 s step (50.0%)" in text
    assert "  rollout  gen                 0.500       0.500  100.0%" in text


def test_e2e_summary_keys_and_reward():
    from bench_e2e_vs_trl import exact_reward, summary_of

    rows = [{"model": "tiny", "beta": 0.0, "trl_over_rlhf": 2.0}, {"model": "tiny", "beta": 0.04, "trl_over_rlhf": 1.5},
            {"model": "smollm2", "beta": 0.0, "trl_over_rlhf": 1.2}]
    assert summary_of(rows) == {"rlhf_vs_trl_tiny_beta0": 2.0, "rlhf_vs_trl_tiny_beta": 1.5,
                                "rlhf_vs_trl_smollm2": 1.2}
    assert exact_reward(["a", "b"], [" 12", "3"], ["12", "4"]) == [1.0, 0.0]
