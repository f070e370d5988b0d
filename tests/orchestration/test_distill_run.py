"""On-policy distillation end to end on 2 ranks, in one launched world: a teacher equal to the student gives a zero
signal (GRPO's advantages bit for bit); two teachers routed by data_source score each row as transformers does,
and the advantage is coef x clip(teacher - student) on the sampled tokens; a resumed run repeats step 2 exactly;
a teacher on a rank of its own (split placement) scores as transformers does."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import hf_sampled_logprobs, length_reward, make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

# a dense reward (every update moves the weights) that ignores data_source, so both sources score alike
COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "actor.optim.lr=0.05", "dist.seed=7"]
CLOCK_PREFIXES = ("timing_s/", "perf/throughput", "perf/time", "memory/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.models.init import InitModelConfig, init_hf_model

    root = tmp_path_factory.mktemp("distill")
    paths = make_tiny_setup(root, num_train=16, num_val=4)
    rows = [json.loads(line) for line in Path(paths["train"]).read_text().splitlines()]
    for row in rows[1::2]:  # every other prompt from a second source, routed to the second teacher
        row["data_source"] = "other_source"
    Path(paths["train"]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, hidden, seed in (("teacher_a", 48, 3), ("teacher_b", 32, 5)):
        paths[name] = str(init_hf_model(InitModelConfig(hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2,
                                                        intermediate_size=64, max_position_embeddings=64, seed=seed),
                                        build_char_tokenizer(), root / name))
    paths["reward"] = length_reward(root)
    return paths


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(CLOCK_PREFIXES)}


def _distill_world(paths: dict, root: str) -> dict:
    import torch
    import torch.distributed as dist

    out, scored = {}, {}
    common = COMMON + [paths["reward"], "algo.distill.enable=true"]
    zero = run_trainer(paths, root, common + ["run.name=zero", "trainer.total_steps=1",
                                              f"algo.distill.teacher_path={paths['model']}"],
                       on_scored=lambda batch, step: scored.__setitem__(("zero", step), batch))
    batch = scored[("zero", 1)]
    out["zero_reverse_kl"] = zero[0]["distill/reverse_kl"]
    out["zero_teacher_equals_student"] = torch.equal(batch.teacher_logprobs_bt, batch.old_logprobs_bt)
    plain = run_trainer(paths, root, COMMON + [paths["reward"], "run.name=plain", "trainer.total_steps=1"],
                        on_scored=lambda batch, step: scored.__setitem__(("plain", step), batch))
    out["zero_equals_grpo"] = (torch.equal(batch.advantages_bt, scored[("plain", 1)].advantages_bt)
                               and plain[0]["actor/pg_loss"] == zero[0]["actor/pg_loss"])
    multi = common + ["run.name=multi", "trainer.total_steps=2", "checkpoint.every=1", "algo.distill.mode=alone",
                      "algo.distill.coef=0.5", "algo.distill.clip=1.0",
                      f"algo.distill.teacher_path={paths['teacher_a']}",
                      f"algo.distill.routes={{other_source: {paths['teacher_b']}}}", "algo.distill.micro_batch_size=3"]
    history = run_trainer(paths, root, multi, on_scored=lambda batch, step: scored.__setitem__(("multi", step), batch))
    resumed = run_trainer(paths, root, multi + [f"checkpoint.resume={root}/multi/checkpoints/step_1"],
                          on_scored=lambda batch, step: scored.__setitem__(("resumed", step), batch))
    out["resume_exact"] = (_comparable(resumed[0]) == _comparable(history[1]) and torch.equal(
        scored[("resumed", 2)].advantages_bt, scored[("multi", 2)].advantages_bt))
    split = ["mesh.placement=split", "mesh.actor={ranks: [0, 1]}", "mesh.rollout={ranks: [0, 1]}",
             "mesh.teacher={ranks: [1, 2]}", "trainer.total_steps=1", "run.name=split"]
    run_trainer(paths, root, common + split + [f"algo.distill.teacher_path={paths['teacher_a']}"],
                on_scored=lambda batch, step: scored.__setitem__(("split", step), batch))
    out["distill_metrics"] = sorted(k for k in history[1] if k.startswith(("distill/", "timing_s/teacher")))
    if dist.get_rank() == 0:
        batch = scored[("multi", 2)]
        other_b = torch.tensor([i % 2 == 1 for i in batch.sample_index_b.tolist()])
        hf_bt = torch.where(other_b[:, None], hf_sampled_logprobs(paths["teacher_b"], batch),
                            hf_sampled_logprobs(paths["teacher_a"], batch))
        out["teacher_parity"] = float((batch.teacher_logprobs_bt - hf_bt).abs().max())
        split_batch = scored[("split", 1)]  # the teacher alone on rank 1, the actor and rollout on rank 0
        out["split_parity"] = float((split_batch.teacher_logprobs_bt
                                     - hf_sampled_logprobs(paths["teacher_a"], split_batch)).abs().max())
        out["rows_per_teacher"] = [int((~other_b).sum()), int(other_b.sum())]
        expected_bt = 0.5 * (batch.teacher_logprobs_bt - batch.old_logprobs_bt).clamp(-1.0, 1.0) * batch.loss_mask_bt
        out["advantage_hand_check"] = torch.equal(batch.advantages_bt, expected_bt)
        out["advantage_nonzero"] = bool(batch.advantages_bt.abs().sum() > 0)
        mask_bt = batch.loss_mask_bt
        hand_kl = float(((batch.old_logprobs_bt - batch.teacher_logprobs_bt) * mask_bt).sum() / mask_bt.sum())
        out["reverse_kl_error"] = abs(history[1]["distill/reverse_kl"] - hand_kl)
    return out


def test_distill_world(setup, tmp_path):
    out = run_distributed(_distill_world, 2, setup, str(tmp_path), timeout_s=600)[0]
    assert out["zero_reverse_kl"] == 0.0
    assert out["zero_teacher_equals_student"] and out["zero_equals_grpo"]
    assert out["teacher_parity"] < 1e-4 and out["split_parity"] < 1e-4, out
    assert min(out["rows_per_teacher"]) > 0, out["rows_per_teacher"]
    assert out["advantage_hand_check"] and out["advantage_nonzero"]
    assert out["reverse_kl_error"] < 1e-6
    assert out["resume_exact"]
    assert out["distill_metrics"] == ["distill/advantage_mean", "distill/clip_fraction", "distill/reverse_kl",
                                      "distill/student_logprob", "distill/teacher_logprob", "timing_s/teacher"]
