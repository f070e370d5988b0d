"""Making reasoning-gym datasets: content matches the task, formats, held-out de-duplication, bad options."""

import json
from fractions import Fraction

import pytest
import reasoning_gym

from rlhf.data.make import (UNOFFERED_TASKS, MakeConfig, decode_metadata, encode_metadata, make_dataset, make_records,
                            offered_tasks, parse_task_options, question_key)
from rlhf.data.records import read_records
from rlhf.errors import ConfigError, DataError
from rlhf.rewards.registry import RewardConfig, RuleReward

DEMO_OPTIONS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def test_records_match_the_task_items(tmp_path):
    config = MakeConfig(task="chain_sum", num_samples=5, seed=7, task_config=DEMO_OPTIONS)
    records = make_dataset(config, tmp_path / "train.parquet")
    task = reasoning_gym.create_dataset("chain_sum", seed=7, size=5, **DEMO_OPTIONS)
    assert read_records(tmp_path / "train.parquet") == records
    for position, record in enumerate(records):
        item = task[position]
        assert record.prompt == [{"role": "user", "content": item["question"]}]
        assert record.data_source == "reasoning_gym/chain_sum" and record.ground_truth == item["answer"]
        assert record.index == record.extra_info["index"] == position
        assert decode_metadata(record.extra_info["metadata"]) == item["metadata"]
        assert json.loads(record.extra_info["task_config"]) == DEMO_OPTIONS


@pytest.mark.parametrize("task", ["countdown", "basic_arithmetic", "gsm_symbolic", "products"])
def test_made_dataset_scores_its_own_answers(tmp_path, task):
    """The round trip the trainer relies on: made → written → read → scored by the dispatched reward."""
    make_dataset(MakeConfig(task=task, num_samples=3, seed=1), tmp_path / "c.jsonl")
    records = read_records(tmp_path / "c.jsonl")
    reward = RuleReward(RewardConfig())
    assert reward.score(records, [r.ground_truth for r in records]).tolist() == [1.0, 1.0, 1.0]
    assert reward.score(records, [f"<answer>{r.ground_truth}</answer>" for r in records]).tolist() == [1.0] * 3
    assert reward.score(records, ["1+1"] * 3).max().item() < 1.0


def test_prompt_formats():
    text = make_records(MakeConfig(task="chain_sum", num_samples=2, seed=3, prompt_format="text"))
    expr = make_records(MakeConfig(task="chain_sum", num_samples=2, seed=3, prompt_format="expression"))
    for t, e in zip(text, expr):
        expression = json.loads(t.extra_info["metadata"])["expression"]
        assert t.prompt == t.extra_info["question"] and expression in t.prompt
        assert e.prompt == expression.replace(" ", "") + "=" and " " not in e.prompt
    with pytest.raises(ConfigError, match="prompt format 'expression' needs items with metadata\\['expression'\\]"):
        make_records(MakeConfig(task="gcd", num_samples=1, prompt_format="expression"))


def test_held_out_set_excludes_training_questions_and_repeats(tmp_path):
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 distinct problems
    train = make_dataset(MakeConfig(task="chain_sum", num_samples=300, seed=0, task_config=options),
                         tmp_path / "train.jsonl")
    train_keys = {question_key(r) for r in train}
    assert len(train_keys) < 200  # small spaces repeat: what the exclusion guards a held-out set against
    left = 200 - len(train_keys)
    held_out = make_records(MakeConfig(task="chain_sum", num_samples=left // 2, seed=10_000_000,
                                       task_config=options, exclude=[str(tmp_path / "train.jsonl")]))
    held_keys = [question_key(r) for r in held_out]
    assert len(set(held_keys)) == len(held_keys) and not set(held_keys) & train_keys
    assert [r.index for r in held_out] == list(range(len(held_out)))
    with pytest.raises(DataError, match=rf"only \d+ of {left + 1} 'chain_sum' prompts are distinct and absent from"):
        make_records(MakeConfig(task="chain_sum", num_samples=left + 1, seed=5, task_config=options,
                                exclude=[str(tmp_path / "train.jsonl")]))


@pytest.mark.parametrize("kwargs, message", [
    ({"task": "chain_summ"}, "unknown reasoning-gym task 'chain_summ'; did you mean chain_sum"),
    ({"task": "chain_sum", "task_config": {"max_termz": 3}}, "bad options {'max_termz': 3} for task 'chain_sum': TypeError"),
    ({"task": "chain_sum", "task_config": {"min_terms": 0}}, "bad options .* AssertionError: min_terms must be positive"),
    ({"task": "chain_sum", "task_config": {"seed": 3}}, "task option\\(s\\) seed are set by --seed and --n"),
    ({"task": "chain_sum", "num_samples": 0}, "--num-prompts 0: the number of prompts must be >= 1"),
    ({"task": "rush_hour"}, "reasoning-gym task 'rush_hour' is not offered \\(no reference answers\\)"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_records(MakeConfig(**({"num_samples": 2} | kwargs)))


def test_task_options_parse_json_values():
    assert parse_task_options(["max_terms=3", "allow_negation=true", "name=abc", "xs=[1,2]"]) == \
        {"max_terms": 3, "allow_negation": True, "name": "abc", "xs": [1, 2]}
    with pytest.raises(ConfigError, match="task option 'max_terms' must be written key=value"):
        parse_task_options(["max_terms"])


def test_every_offered_task_round_trips_through_its_file_and_scorer(tmp_path):
    """Each task `rlhf data tasks` lists: written, read back, and its true answer scored 1.0 by the dispatched
    reward (gsm_symbolic's Fraction metadata and rearc's tuple grids come back as they were)."""
    reward = RuleReward(RewardConfig())
    tasks = offered_tasks()
    assert len(tasks) == 100 and "gsm_symbolic" in tasks and not set(UNOFFERED_TASKS) & set(tasks)
    for task in tasks:
        num = 20 if task == "gsm_symbolic" else 4  # the quickstart's task crashed past ~5 items
        make_dataset(MakeConfig(task=task, num_samples=num, seed=1), tmp_path / f"{task}.jsonl")
        records = read_records(tmp_path / f"{task}.jsonl")
        assert reward.score(records, [r.ground_truth for r in records]).tolist() == [1.0] * num, task


def test_metadata_codec_keeps_tuples_and_fractions():
    metadata = {"grid": ((1, 2), (3, 4)), "x": Fraction(3, 4), "tags": {"b", "a"}, "plain": [1, "s", None]}
    assert decode_metadata(encode_metadata(metadata)) == {"grid": ((1, 2), (3, 4)), "x": Fraction(3, 4),
                                                          "tags": ["a", "b"], "plain": [1, "s", None]}
    assert decode_metadata('{"a": [1, 2]}') == {"a": [1, 2]}


@pytest.mark.parametrize("task", sorted(UNOFFERED_TASKS))
def test_unoffered_task_names_why(task):
    with pytest.raises(ConfigError, match=f"reasoning-gym task '{task}' is not offered"):
        make_records(MakeConfig(task=task, num_samples=1))
