"""GDPO in the RL step, on 2 ranks in one launched world: the rule reward's dict components reach the training
side as `reward_components_bk` (equal to the user function applied to each decoded response), the advantages are
the GDPO estimator of those components (not GRPO of their sum), two steps train; a key the scorer does not return
is one RewardError line at the first step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import make_tiny_setup, run_trainer  # noqa: E402

from rlhf.testing.distributed import run_distributed  # noqa: E402

REWARD = '''
def components(data_source, solution_str, ground_truth, extra_info):
    parity, three = float(len(solution_str) % 2), float(len(solution_str) % 3 == 0)
    return {"score": parity + three, "parity": parity, "three": three}
'''
COMMON = ["trainer.val_before_train=false", "reward.by_source={}", "algo.advantage.kind=gdpo", "dist.seed=7",
          "actor.optim.lr=0.05"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdpo")
    (root / "components.py").write_text(REWARD)
    return make_tiny_setup(root, num_train=16, num_val=4) | {"reward": f"reward.function={root}/components.py:components"}


def _gdpo_world(paths: dict, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from rlhf.algo.advantages import AdvantageInputs, compute_advantages
    from rlhf.algo.config import AdvantageConfig
    from rlhf.algo.groups import Groups
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.errors import RewardError

    scored, out = {}, {}
    keys = ["algo.advantage.gdpo_reward_keys=[three, parity]", "algo.advantage.gdpo_reward_weights=[1.0, 0.5]"]
    history = run_trainer(paths, root, COMMON + [paths["reward"], "run.name=gdpo", "trainer.total_steps=2"] + keys,
                          on_scored=lambda batch, step: scored.__setitem__(step, batch))
    out["steps"] = len(history)
    out["pg_loss_finite"] = all(torch.isfinite(torch.tensor(row["actor/pg_loss"])) for row in history)
    try:
        run_trainer(paths, root, COMMON + [paths["reward"], "run.name=missing", "trainer.total_steps=1",
                                           "algo.advantage.gdpo_reward_keys=[parity, length]"])
    except RewardError as error:
        out["missing_key_error"] = str(error)
    if dist.get_rank() == 0:
        tokenizer = build_char_tokenizer()
        batch = scored[1]
        texts = [tokenizer.decode(batch.tokens_bs[row, batch.prompt_lengths_b[row]:][:batch.response_lengths_b[row]],
                                  skip_special_tokens=True) for row in range(batch.size)]
        hand_bk = torch.tensor([[float(len(t) % 3 == 0), float(len(t) % 2)] for t in texts])
        out["components_equal"] = torch.equal(batch.reward_components_bk, hand_bk)
        out["scores_are_totals"] = torch.equal(batch.scores_b, hand_bk.sum(-1))
        out["components_vary"] = bool(hand_bk.std(0).min() > 0)
        config = AdvantageConfig(kind="gdpo", gdpo_reward_keys=["three", "parity"], gdpo_reward_weights=[1.0, 0.5])
        inputs = AdvantageInputs(token_rewards_bt=batch.token_rewards_bt, response_mask_bt=batch.response_mask_bt,
                                 groups=Groups.from_index(batch.group_index_b), reward_components_bk=hand_bk)
        out["advantage_diff"] = float((compute_advantages(config, inputs).advantages_bt
                                       - batch.advantages_bt).abs().max())
        grpo = compute_advantages(AdvantageConfig(kind="grpo"), inputs).advantages_bt
        out["differs_from_grpo_of_sum"] = float((grpo - batch.advantages_bt).abs().max())
    return out


def test_gdpo_world(setup, tmp_path):
    out = run_distributed(_gdpo_world, 2, setup, str(tmp_path), timeout_s=600)[0]
    assert out["steps"] == 2 and out["pg_loss_finite"], out
    assert out["components_equal"] and out["scores_are_totals"] and out["components_vary"], out
    assert out["advantage_diff"] < 1e-6 and out["differs_from_grpo_of_sum"] > 1e-3, out
    assert out["missing_key_error"].startswith("reward for sample 0 (index "), out
    assert out["missing_key_error"].endswith(
        "has no component 'length' (algo.advantage.gdpo_reward_keys): the scorer returned ['parity', 'score', "
        "'three']; return a dict with every gdpo_reward_keys entry, or list only the keys it returns"), out
