"""Dispatch on data_source, user functions by path, and the per-sample RewardError for raise/NaN/inf."""

import pytest
import torch

from rlhf.config.loader import from_dict
from rlhf.data.records import PromptRecord
from rlhf.errors import ConfigError, RewardError
from rlhf.rewards.registry import RewardConfig, RewardInputs, RuleReward
from rlhf.rewards.config import RemoteRewardConfig

USER_FILE = '''
import math
CALLS = []

def length_score(data_source, solution_str, ground_truth, extra_info):
    CALLS.append(solution_str)
    if solution_str == "boom":
        raise ValueError("no such key\\nsecond line")
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return {"score": -math.inf}
    if solution_str == "text":
        return "high"
    if solution_str == "bad component":
        return {"score": 1.0, "extra": "yes"}
    return {"score": len(solution_str), "extra": 1} if solution_str.startswith("d") else len(solution_str)
'''


def rec(data_source, truth="5", index=0, extra=None):
    return PromptRecord(prompt="p", data_source=data_source, ground_truth=truth, extra_info=extra or {}, index=index)


@pytest.fixture()
def user_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return f"{path}:length_score"


def test_builtin_dispatch_on_data_source():
    reward = RuleReward(RewardConfig())
    records = [rec("openai/gsm8k"), rec("lighteval/MATH"), rec("reasoning_gym/chain_sum"), rec("gsm8k", "7")]
    rewards_b = reward.score(records, ["#### 5", r"\boxed{5}", "15", "#### 6"])
    assert rewards_b.dtype == torch.float32
    assert rewards_b.tolist() == [1.0, 1.0, 0.5, 0.0]


def test_by_source_patterns_select_exact_match_and_user_functions(user_fn):
    config = RewardConfig(by_source={"reasoning_gym/*": "reasoning_gym_exact", "mine": user_fn})
    reward = RuleReward(config)
    inputs = RewardInputs(data_sources=["reasoning_gym/chain_sum", "mine", "openai/gsm8k"],
                          ground_truths=["5", None, "5"], extra_infos=[{}, {}, {}], indices=[3, 4, 5])
    assert reward.score(inputs, ["15", "abcd", "#### 5"]).tolist() == [0.0, 4.0, 1.0]
    assert reward.scorer_name("reasoning_gym/countdown") == "reasoning_gym_exact"


def test_user_function_for_every_source_runs_once_per_sample(user_fn):
    reward = RuleReward(RewardConfig(function=user_fn))
    calls = reward._load(user_fn).__globals__["CALLS"]
    responses = ["a", "bb", "dddd", "a"]
    rewards_b = reward.score([rec("anything", index=i) for i in range(4)], responses)
    assert rewards_b.tolist() == [1.0, 2.0, 4.0, 1.0]
    assert calls == responses


def test_components_are_the_dict_entries_and_a_float_is_the_component_score(user_fn):
    """GDPO's contract: the scorer's dict holds the total under "score" and the named components beside it."""
    reward = RuleReward(RewardConfig(function=user_fn))
    records = [rec("src", index=i) for i in range(3)]
    rewards_b, components_bk = reward.score_components(records, ["dd", "ddd", "dddd"], ["extra", "score"])
    assert rewards_b.tolist() == [2.0, 3.0, 4.0]
    assert components_bk.dtype == torch.float32 and components_bk.tolist() == [[1.0, 2.0], [1.0, 3.0], [1.0, 4.0]]
    rewards_b, components_bk = reward.score_components(records[:2], ["a", "bb"], ["score"])
    assert components_bk.tolist() == [[1.0], [2.0]] and rewards_b.tolist() == [1.0, 2.0]
    assert reward.score_components(records[:1], ["a"], [])[1].shape == (1, 0)
    with pytest.raises(RewardError) as info:
        reward.score_components(records[:2], ["dd", "a"], ["extra"])
    assert str(info.value) == ("reward for sample 1 (index 1, data_source 'src') has no component 'extra' "
                               "(algo.advantage.gdpo_reward_keys): the scorer returned ['score']; return a dict with "
                               "every gdpo_reward_keys entry, or list only the keys it returns")
    with pytest.raises(RewardError) as info:
        reward.score_components(records[:1], ["bad component"], ["extra"])
    assert str(info.value) == ("reward for sample 0 (index 0, data_source 'src') returned component 'extra' = 'yes', "
                               "not a finite number")


@pytest.mark.parametrize("response, cause", [
    ("boom", "raised ValueError: no such key second line"),
    ("nan", "returned nan"),
    ("inf", "returned -inf"),
    ("text", "returned 'high' (str), not a number"),
])
def test_bad_reward_names_the_sample(user_fn, response, cause):
    reward = RuleReward(RewardConfig(function=user_fn))
    records = [rec("src", index=10), rec("src", index=11), rec("src", index=12)]
    with pytest.raises(RewardError) as info:
        reward.score(records, ["ok", response, "ok"])
    assert str(info.value) == f"reward for sample 1 (index 11, data_source 'src') {cause}"


def test_builtin_scorer_error_is_named():
    reward = RuleReward(RewardConfig())
    with pytest.raises(RewardError, match=r"reward for sample 0 \(index 0, data_source 'gsm8k'\) raised ValueError: "
                                          r"gsm8k scoring needs reward_model.ground_truth"):
        reward.score([rec("gsm8k", truth=None)], ["#### 1"])


def test_unknown_source_fails_up_front():
    reward = RuleReward(RewardConfig())
    with pytest.raises(ConfigError, match=r"no reward function for data_source 'my/data'; map it in reward.by_source"):
        reward.check_sources(["openai/gsm8k", "my/data"])
    reward.check_sources(["openai/gsm8k", "reasoning_gym/countdown"])


def test_mismatched_lengths():
    with pytest.raises(RewardError, match="got 1 responses for 2 samples"):
        RuleReward(RewardConfig()).score([rec("gsm8k"), rec("gsm8k")], ["#### 5"])


def test_bad_config(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.by_source\['x'\]='nope' is neither a built-in reward"):
        RewardConfig(by_source={"x": "nope"})
    with pytest.raises(ConfigError, match="reward.function='f.py' is neither a built-in reward"):
        RewardConfig(function="f.py")
    with pytest.raises(ConfigError, match="reward function 'f.py:1x' must be written 'path/to/file.py:function_name'"):
        RuleReward(RewardConfig(function="f.py:1x"))
    with pytest.raises(ConfigError, match="reward function file '/no/such.py' not found"):
        RuleReward(RewardConfig(function="/no/such.py:f"))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_here\n")
    with pytest.raises(ConfigError, match="importing reward function file .*broken.py' failed: ModuleNotFoundError"):
        RuleReward(RewardConfig(function=f"{broken}:f"))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="has no function 'x'"):
        RuleReward(RewardConfig(function=f"{empty}:x"))


def test_loads_from_a_mapping():
    config = from_dict(RewardConfig, {"by_source": {"reasoning_gym/*": "reasoning_gym_exact"}}, "reward")
    assert RuleReward(config).scorer_name("reasoning_gym/chain_sum") == "reasoning_gym_exact"
    remote = from_dict(RewardConfig, {"remote": {"url": "http://127.0.0.1:9/score", "batch_size": 16}}, "reward")
    assert remote.remote == RemoteRewardConfig(url="http://127.0.0.1:9/score", batch_size=16)
    with pytest.raises(ConfigError, match="unknown config key 'reward.remote.timeout'; did you mean 'timeout_s'"):
        from_dict(RewardConfig, {"remote": {"url": "http://127.0.0.1:9/", "timeout": 3}}, "reward")
