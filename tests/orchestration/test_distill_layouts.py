"""Distillation teachers in more settings, on 2 ranks in one launched world: a teacher at tp=2, at pp=2, a MoE
teacher (Qwen3-MoE, top-2 of 4 experts) at ep=1 and at ep=2 (its experts split over the two ranks) and one-step-off async (rollout on rank 1, actor and teacher on rank 0)
each score the sampled tokens as transformers does, and tp=2 / pp=2 as the tp=1 teacher does; on 4 ranks (slow)
a tp=2 teacher at dp=2, and on ranks of its own (split placement), does too."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import hf_sampled_logprobs, length_reward, make_moe_setup, make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "actor.optim.lr=0.05", "dist.seed=7",
          "algo.distill.enable=true", "trainer.total_steps=1"]
ASYNC = ["mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.teacher={ranks: [0, 1]}",
         "mesh.rollout={ranks: [1, 2]}", "trainer.async_mode=one_step_off", "trainer.total_steps=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    root = tmp_path_factory.mktemp("distill_layouts")
    paths = make_tiny_setup(root / "dense", num_train=16, num_val=4)
    paths["teacher"] = str(init_hf_model(InitModelConfig(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                                         intermediate_size=64, max_position_embeddings=64, seed=3),
                                         build_char_tokenizer(), root / "teacher"))
    paths["moe_teacher"] = make_moe_setup(root / "moe")["model"]
    paths["reward"] = length_reward(root)
    return paths


def _layouts_world(paths: dict, root: str) -> dict:
    import torch
    import torch.distributed as dist

    runs = {"tp1": [f"algo.distill.teacher_path={paths['teacher']}"],
            "tp2": [f"algo.distill.teacher_path={paths['teacher']}", "mesh.teacher.tp=2"],
            "pp2": [f"algo.distill.teacher_path={paths['teacher']}", "mesh.teacher.pp=2"],
            "moe": [f"algo.distill.teacher_path={paths['moe_teacher']}"],
            "moe_ep2": [f"algo.distill.teacher_path={paths['moe_teacher']}", "mesh.teacher.ep=2"],
            "async": [f"algo.distill.teacher_path={paths['teacher']}"] + ASYNC}
    scored, metrics = {}, {}
    for name, overrides in runs.items():
        history = run_trainer(paths, root, COMMON + [paths["reward"], f"run.name={name}"] + overrides,
                              on_scored=lambda batch, step, name=name: scored.__setitem__((name, step), batch))
        metrics[name] = history[-1].get("distill/reverse_kl")
    out = {"reverse_kl": metrics}
    if dist.get_rank() == 0:
        base = scored[("tp1", 1)]
        for name in ("tp2", "pp2"):
            out[f"{name}_same_tokens"] = torch.equal(scored[(name, 1)].tokens_bs, base.tokens_bs)
            diff_bt = scored[(name, 1)].teacher_logprobs_bt - base.teacher_logprobs_bt
            out[f"{name}_vs_tp1"] = float(diff_bt.abs().max())
        for name, step, teacher in (("tp1", 1, "teacher"), ("tp2", 1, "teacher"), ("pp2", 1, "teacher"),
                                    ("moe", 1, "moe_teacher"), ("moe_ep2", 1, "moe_teacher"),
                                    ("async", 2, "teacher")):
            batch = scored[(name, step)]
            hf_bt = hf_sampled_logprobs(paths[teacher], batch)
            out[f"{name}_vs_hf"] = float((batch.teacher_logprobs_bt - hf_bt).abs().max())
            out[f"{name}_nonzero"] = bool(batch.teacher_logprobs_bt.abs().sum() > 0)
        async_batch = scored[("async", 2)]
        out["async_stale"] = int(async_batch.policy_version_bt[async_batch.response_mask_bt].max())
    return out


def test_distill_layouts_world(setup, tmp_path):
    out = run_distributed(_layouts_world, 2, setup, str(tmp_path), timeout_s=600)[0]
    assert out["tp2_same_tokens"] and out["pp2_same_tokens"], out
    assert out["tp2_vs_tp1"] < 1e-5 and out["pp2_vs_tp1"] < 1e-5, out
    for name in ("tp1", "tp2", "pp2", "moe", "moe_ep2", "async"):
        assert out[f"{name}_vs_hf"] < 1e-4 and out[f"{name}_nonzero"], (name, out)
    assert out["async_stale"] == 0, out  # batch 2 sampled by version 0, the policy before step 1's update
    assert all(value is not None and value != 0.0 for value in out["reverse_kl"].values()), out


def _four_rank_world(paths: dict, root: str) -> dict:
    import torch.distributed as dist

    teacher = f"algo.distill.teacher_path={paths['teacher']}"
    runs = {"tp2dp2": [teacher, "mesh.teacher.tp=2", "data.prompts_per_step=8"],
            "split_tp2": [teacher, "mesh.placement=split", "mesh.actor={ranks: [0, 2]}", "mesh.rollout={ranks: [0, 2]}",
                          "mesh.teacher={ranks: [2, 4]}", "mesh.teacher.tp=2"]}
    scored, out = {}, {}
    for name, overrides in runs.items():
        run_trainer(paths, root, COMMON + [paths["reward"], f"run.name={name}"] + overrides,
                    on_scored=lambda batch, step, name=name: scored.__setitem__(name, batch))
    if dist.get_rank() == 0:
        for name, batch in scored.items():
            out[name] = float((batch.teacher_logprobs_bt - hf_sampled_logprobs(paths["teacher"], batch)).abs().max())
    return out


@pytest.mark.slow  # a 4-rank world: past the default suite's time budget
def test_teacher_tp2_on_4_ranks_colocated_and_split(setup, tmp_path):
    out = run_distributed(_four_rank_world, 4, setup, str(tmp_path), timeout_s=600)[0]
    assert set(out) == {"tp2dp2", "split_tp2"} and max(out.values()) < 1e-4, out
