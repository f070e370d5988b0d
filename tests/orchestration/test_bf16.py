"""model.dtype=bfloat16: every role holds bf16 weights, megatron keeps fp32 master weights, GRPO (+ reference)
runs at DP2 with finite metrics close to the fp32 run's; bad dtypes fail with one line."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer, trainer_config  # noqa: E402

from rlhf.errors import ConfigError  # noqa: E402
from rlhf.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"), num_train=16, num_val=4)


def _runs(paths, root):
    from rlhf.run_dir import close_run, setup_run
    from rlhf.orchestration.loop import Trainer

    # A dense reward (share of digits), so the random tiny policy gets non-zero advantages and gradients.
    reward = Path(root) / "digits.py"
    if torch.distributed.get_rank() == 0:
        reward.write_text("def digits(data_source, solution_str, ground_truth, extra_info):\n"
                          "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n")
    torch.distributed.barrier()
    overrides = ["algo.kl.coef=0.01", f'reward.by_source={{"reasoning_gym/*": "{reward}:digits"}}']
    histories = {dtype: run_trainer(paths, f"{root}/{dtype}", [f"model.dtype={dtype}", f"run.name={dtype}",
                                                                *overrides])
                 for dtype in ("float32", "bfloat16")}
    cfg = trainer_config(paths, root, ["model.dtype=bfloat16", "algo.kl.coef=0.01", "run.name=inspect"])
    trainer = Trainer(cfg, setup_run(cfg.run, cfg))
    close_run()
    train = trainer.train_side
    dtypes = {name: {p.dtype for p in role.model.parameters()} for name, role in (("actor", train.actor),
                                                                                    ("ref", train.ref))}
    optimizer = train.actor.engine.optimizer
    masters = {p.dtype for group in optimizer.param_groups for p in group["params"]}
    return histories, dtypes, masters


def test_bf16_grpo_runs_close_to_fp32(tiny, tmp_path):
    histories, dtypes, masters = run_distributed(_runs, 2, tiny, str(tmp_path), timeout_s=400)[0]
    assert dtypes == {"actor": {torch.bfloat16}, "ref": {torch.bfloat16}}
    assert masters == {torch.float32}, "the optimizer steps fp32 master weights"
    fp32, bf16 = histories["float32"], histories["bfloat16"]
    assert [row["step"] for row in bf16] == [row["step"] for row in fp32] == [0, 1, 2]
    for row in bf16[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/score/mean"):
            assert math.isfinite(row[key]), (key, row)
    # Same prompts and seeds: step 1's rollouts come from the same initial policy up to bf16 rounding.
    assert bf16[1]["actor/entropy"] == pytest.approx(fp32[1]["actor/entropy"], rel=0.05)
    assert bf16[1]["actor/grad_norm"] > 0


def test_bad_dtype_is_one_line(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"^model.dtype='fp8' is not one of float32, bfloat16$"):
        trainer_config(tiny, str(tmp_path), ["model.dtype=fp8"])
