"""Top-K distillation (`algo.distill.estimator=topk`) end to end on 2 ranks, in one launched world: the teacher's
top-K ids and logprobs equal transformers' full log-softmax, and `distill/topk_kl` the KL computed by hand from
transformers' student and teacher; a teacher equal to the student adds zero loss and zero gradient (GRPO's update
exactly); a resumed run repeats step 2 exactly; mode alone leaves only the KL term; the default packed micro-batches and
row micro-batches give the same step. Layouts (slow): the update is the same at micro-batch 1, at dp=1 (actor
tp=2, vocab-parallel student head) and at actor cp=2 (the teacher's ids split over the cp ranks with the tokens)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import hf_response_logprobs, length_reward, make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

K = 6
COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "actor.optim.lr=0.05", "dist.seed=7",
          "algo.distill.enable=true", "algo.distill.estimator=topk", f"algo.distill.topk={K}", "algo.distill.coef=0.5"]
CLOCK_PREFIXES = ("timing_s/", "perf/throughput", "perf/time", "memory/")
LAYOUTS = {"micro1": ["actor.micro_batch_size=1"], "cp2": ["mesh.actor.cp=2", "actor.micro_batch_size=8"],
           "tp2": ["mesh.actor.tp=2", "actor.micro_batch_size=8", "algo.rollout_correction.enable=false"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    root = tmp_path_factory.mktemp("distill_topk")
    paths = make_tiny_setup(root, num_train=16, num_val=4)
    paths["teacher"] = str(init_hf_model(InitModelConfig(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                                         intermediate_size=64, max_position_embeddings=64, seed=3),
                                         build_char_tokenizer(), root / "teacher"))
    paths["reward"] = length_reward(root)
    return paths


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(CLOCK_PREFIXES)}


def _hand_kl(paths: dict, batch) -> float:
    """Token mean of KL(teacher || student) renormalised on the teacher's top-K, all from transformers."""
    import torch

    teacher_btv = hf_response_logprobs(paths["teacher"], batch)
    student_btv = hf_response_logprobs(paths["model"], batch)
    top = teacher_btv.topk(K, dim=-1)
    log_t = top.values - top.values.logsumexp(-1, keepdim=True)
    log_s = student_btv.gather(2, top.indices)
    log_s = log_s - log_s.logsumexp(-1, keepdim=True)
    kl_bt = (log_t.exp() * (log_t - log_s)).sum(-1)
    mask_bt = batch.loss_mask_bt
    return float(torch.where(mask_bt, kl_bt, 0.0).sum() / mask_bt.sum()), top


def _topk_world(paths: dict, root: str, layouts: bool) -> dict:
    import torch
    import torch.distributed as dist

    out, scored = {}, {}
    common = COMMON + [paths["reward"]]
    teacher = [f"algo.distill.teacher_path={paths['teacher']}"]
    hook = (lambda name: lambda batch, step: scored.__setitem__((name, step), batch))
    mix = common + teacher + ["run.name=mix", "trainer.total_steps=2", "checkpoint.every=1"]
    history = run_trainer(paths, root, mix, on_scored=hook("mix"))
    resumed = run_trainer(paths, root, mix + [f"checkpoint.resume={root}/mix/checkpoints/step_1"],
                          on_scored=hook("resumed"))
    out["resume_exact"] = (_comparable(resumed[0]) == _comparable(history[1]) and all(
        torch.equal(getattr(scored[("resumed", 2)], name), getattr(scored[("mix", 2)], name))
        for name in ("advantages_bt", "teacher_topk_ids_btk", "teacher_topk_logprobs_btk")))
    out["metrics"] = sorted(k for k in history[0] if k.startswith("distill/"))
    # the default packed (THD) micro-batches carry the teacher's ids: row micro-batches give the same step
    rows = run_trainer(paths, root, common + teacher + ["run.name=rows", "trainer.total_steps=1",
                                                        "actor.max_tokens_per_microbatch=0"])[0]
    out["rows_vs_packed"] = [abs(rows[key] - history[0][key])
                             for key in ("distill/topk_kl", "distill/topk_loss", "actor/grad_norm", "actor/pg_loss")]
    zero = run_trainer(paths, root, common + ["run.name=zero", "trainer.total_steps=1",
                                              f"algo.distill.teacher_path={paths['model']}"])
    plain = run_trainer(paths, root, COMMON[:4] + [paths["reward"], "run.name=plain", "trainer.total_steps=1"])
    out["zero"] = (zero[0]["distill/topk_kl"], zero[0]["actor/grad_norm"] - plain[0]["actor/grad_norm"],
                   zero[0]["actor/pg_loss"] - plain[0]["actor/pg_loss"])
    alone = run_trainer(paths, root, common + teacher + ["run.name=alone", "trainer.total_steps=1",
                                                         "algo.distill.mode=alone"], on_scored=hook("alone"))
    out["alone"] = (alone[0]["actor/pg_loss"], float(scored[("alone", 1)].advantages_bt.abs().max()),
                    alone[0]["distill/topk_loss"] - 0.5 * history[0]["distill/topk_kl"],
                    alone[0]["actor/grad_norm"] > 0)
    if layouts:
        out["layouts"] = {}
        for name, overrides in LAYOUTS.items():
            row = run_trainer(paths, root, common + teacher + overrides + [f"run.name={name}",
                                                                          "trainer.total_steps=1"])[0]
            out["layouts"][name] = [abs(row[key] - history[0][key])
                                    for key in ("distill/topk_kl", "distill/topk_loss", "actor/grad_norm")]
    if dist.get_rank() == 0:
        batch = scored[("mix", 1)]
        hand_kl, top = _hand_kl(paths, batch)
        mask_btk = batch.loss_mask_bt[..., None]
        out["teacher_ids_equal"] = torch.equal(batch.teacher_topk_ids_btk, top.indices * mask_btk)
        out["teacher_logprob_diff"] = float((batch.teacher_topk_logprobs_btk - top.values * mask_btk).abs().max())
        out["kl_diff"] = abs(history[0]["distill/topk_kl"] - hand_kl)
        out["kl"] = hand_kl
    return out


def _check(out: dict) -> None:
    assert out["teacher_ids_equal"] and out["teacher_logprob_diff"] < 1e-5, out
    assert out["kl"] > 1e-3 and out["kl_diff"] < 1e-5, out
    assert out["resume_exact"], out
    assert max(out["rows_vs_packed"]) < 1e-5, out["rows_vs_packed"]
    assert out["metrics"] == ["distill/sampled_in_topk", "distill/teacher_logprob", "distill/teacher_topk_mass",
                              "distill/topk_kl", "distill/topk_loss"]
    kl, grad_norm_diff, pg_loss_diff = out["zero"]
    assert abs(kl) < 1e-7 and abs(grad_norm_diff) < 1e-6 and pg_loss_diff == 0.0, out["zero"]
    pg_loss, advantage, loss_diff, moved = out["alone"]
    assert pg_loss == 0.0 and advantage == 0.0 and abs(loss_diff) < 1e-6 and moved, out["alone"]


def test_topk_distill_world(setup, tmp_path):
    _check(run_distributed(_topk_world, 2, setup, str(tmp_path), False, timeout_s=600)[0])


@pytest.mark.slow  # two more trainer runs: past the default suite's time budget
def test_topk_distill_layouts(setup, tmp_path):
    out = run_distributed(_topk_world, 2, setup, str(tmp_path), True, timeout_s=900)[0]
    _check(out)
    for name, diffs in out["layouts"].items():
        assert max(diffs) < 1e-5, (name, diffs)
