"""`rlhf profile` and `rlhf bench` on a tiny GRPO config, 2 gloo ranks in one launched world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlhf.testing.distributed import run_distributed
from tests.orchestration.fixtures import make_tiny_setup


def _config_file(paths: dict[str, str], root: Path, kl_coef: float, split_async: bool = False) -> str:
    data = {
        "dist": {"backend": "gloo", "timeout_s": 60},
        "run": {"output_dir": str(root / "runs"), "name": "p"},
        "model": {"path": paths["model"]},
        "data": {"train_files": [paths["train"]], "prompts_per_step": 4, "max_prompt_length": 16},
        "sampling": {"n": 4, "max_new_tokens": 6, "ignore_eos": True},
        "algo": {"advantage": {"kind": "grpo"}, "kl": {"coef": kl_coef}},
        "reward": {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}},
        "actor": {"optim": {"lr": 1e-3}, "micro_batch_size": 4},
        "rollout": {"native": {"max_batch_size": 16, "max_seq_len": 32}},
        "trainer": {"total_steps": 100, "tensorboard": False},
    }
    if split_async:  # rank 0 trains, rank 1 generates one step ahead
        data["mesh"] = {"placement": "split", "actor": {"ranks": [0, 1]}, "rollout": {"ranks": [1, 2]}}
        data["trainer"]["async_mode"] = "one_step_off"
        data["run"]["name"] = "a"
    path = root / f"cfg_{kl_coef}{'_async' if split_async else ''}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _run_all(profile_cfg: str, bench_cfg: str, async_cfg: str) -> int:
    from rlhf.cli.main import main

    # Both are given the training run's config (run.name=p): they write to p-profile and p-bench, never to p.
    assert main(["profile", "--config", profile_cfg, "--steps", "2", "--warmup", "1", "--trace"]) == 0
    assert main(["profile", "--config", async_cfg, "--steps", "2", "--warmup", "1"]) == 0
    assert main(["profile", "--config", bench_cfg, "--steps", "1", "--warmup", "0", "--ops", "run.name=o"]) == 0
    return main(["bench", "--config", bench_cfg, "--steps", "2", "--warmup", "0"])


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    paths = make_tiny_setup(root)
    codes = run_distributed(_run_all, 2, _config_file(paths, root, 0.1), _config_file(paths, root, 0.0),
                            _config_file(paths, root, 0.0, split_async=True), timeout_s=300)
    assert codes == [0, 0]
    assert sorted(p.name for p in (root / "runs").iterdir()) == ["a-profile", "o-profile", "p-bench", "p-profile"]
    assert not list((root / "runs").rglob("checkpoints"))  # diagnostics neither resume nor save
    return root / "runs"


def test_profile_phases_account_for_the_step(outputs, capsys):
    report = json.loads((outputs / "p-profile" / "profile.json").read_text())
    assert report["world_size"] == 2 and report["timed_steps"] == 2 and len(report["steps"]) == 2
    # Strictly on-policy (one epoch, one mini-batch, KL as a loss): no separate old-logprob forward (auto).
    assert set(report["phases_s"]) == {"gen", "gather", "ref", "adv", "update_actor", "update_weights"}
    # How much of the step the phases cover is a timing ratio (it drops when the machine is loaded), so it is
    # reported, not bounded here; the per-rank accounting below is exact.
    assert report["coverage"] > 0
    # On one rank the phases run one after another inside the step's timer, so they never add up to more
    # than that rank's step time (the reduced `steps` take each phase's slowest rank, which may differ).
    assert len(report["per_rank_timings"]) == 2
    for rank_steps in report["per_rank_timings"]:
        assert len(rank_steps) == 2
        for step in rank_steps:
            phases = sum(v for k, v in step.items() if k != "timing_s/step")
            assert 0 < phases <= step["timing_s/step"]
    assert all(report["peak_memory_bytes"][name] > 0 for name in report["phases_s"])


def test_profile_overlap_needs_ranks_apart(outputs):
    # Colocated: both ranks generate and train, so there is no other side to overlap with.
    assert json.loads((outputs / "p-profile" / "profile.json").read_text())["overlap"] is None


def test_profile_shows_the_async_overlap_per_phase(outputs):
    report = json.loads((outputs / "a-profile" / "profile.json").read_text())
    overlap = report["overlap"]
    rows = {(row["side"], row["phase"]): row for row in overlap["phases"]}
    # rank 1 (rollout) generates the next batch while rank 0 (actor) updates on this one
    assert {("rollout", "gen"), ("train", "update_actor"), ("rollout", "gather"), ("train", "gather")} <= set(rows)
    assert ("rollout", "update_actor") not in rows and ("train", "gen") not in rows
    # measured times: only their presence is asserted here (the arithmetic is tested on fixed timelines in
    # test_overlap.py), nothing that depends on how fast this machine ran the phases
    assert all(set(row) == {"side", "phase", "seconds", "overlapped_s"} for row in rows.values())
    assert isinstance(overlap["both_busy_s"], float)


def test_profile_counts_the_gradient_all_reduce(outputs):
    report = json.loads((outputs / "p-profile" / "profile.json").read_text())
    rows = {(r["phase"], r["op"]): r for r in report["collectives_per_step"]}
    # The batch exchange runs once per step on each rank; actor DP=2 all-reduces gradients in update_actor.
    update_ops = {op for phase, op in rows if phase == "update_actor"}
    assert update_ops & {"all_reduce", "reduce_scatter_tensor"}, rows.keys()
    grads = sum(r["bytes"] for (phase, op), r in rows.items()
                if phase == "update_actor" and op in ("all_reduce", "reduce_scatter_tensor"))
    assert grads > 0
    assert all(r["calls"] > 0 and r["seconds_max_rank"] >= 0 for r in rows.values())


def test_profile_writes_a_trace_per_rank(outputs):
    for rank in (0, 1):
        trace = json.loads((outputs / "p-profile" / f"trace_rank{rank}.json").read_text())
        assert trace["traceEvents"]


def test_profile_ops_tables_of_update_and_generation(outputs):
    from transformers import AutoConfig

    from rlhf.models.spec import ModelSpec
    from rlhf.profiling.ops import GROUPS, decode_flops

    report = json.loads((outputs / "o-profile" / "profile.json").read_text())
    ops = report["ops"]
    assert set(ops["phases"]) == {"gen", "update_actor"} and ops["peak_gflops"] > 0
    for table in ops["phases"].values():
        assert list(table["groups"]) == list(GROUPS) and 0 < len(table["top"]) <= 15
        assert sum(g["s"] for g in table["groups"].values()) == pytest.approx(table["wall_s"])
        assert table["achieved_gflops"] == pytest.approx(table["flops"] / table["wall_s"] / 1e9)
    assert ops["phases"]["update_actor"]["groups"]["gemm"]["s"] > 0
    assert any(row["group"] == "optimizer" for row in ops["phases"]["update_actor"]["top"]) or \
        ops["phases"]["update_actor"]["groups"]["optimizer"]["s"] > 0
    # 16 rollouts x 6 generated tokens (EOS ignored) over their mean context, plus the prompts' prefill
    config = yaml.safe_load((outputs / "o-profile" / "config.yaml").read_text())
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(config["model"]["path"]))
    prompt = report["steps"][0]["prompt_length/mean"]
    assert ops["phases"]["gen"]["flops"] == pytest.approx(decode_flops(spec, 96, prompt + 3)
                                                          + decode_flops(spec, round(16 * prompt), prompt / 2))


def test_bench_reports_both_throughputs(outputs):
    result = json.loads((outputs / "p-bench" / "bench.json").read_text())
    # 4 prompts x 4 samples x 6 tokens with EOS ignored: every response is full length.
    assert result["generated_tokens_per_step"] == 96
    assert result["rollout_tok_s"] == pytest.approx(96 / result["gen_s"], rel=0.5)
    assert result["train_tok_s"] > 0 and result["world_size"] == 2
    assert result["advice"].split(":")[0] in ("rollout-bound", "training-bound", "balanced")
