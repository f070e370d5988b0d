"""PromptLoader: several files concatenated with global indices, length policy, resumable steps."""

import json

import pytest

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.config import DataConfig
from rlhf.data.loader import PromptLoader, read_dataset
from rlhf.errors import ConfigError, DataError


def write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "data_source": "reasoning_gym/chain_sum",
                                        "reward_model": {"ground_truth": "1"}}) + "\n" for p in prompts))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_files_concatenate_with_global_indices(tmp_path):
    first, second = write(tmp_path / "a.jsonl", ["1=", "2="]), write(tmp_path / "b.jsonl", ["3=", "4=", "5="])
    records = read_dataset([first, second])
    assert [(r.index, r.prompt) for r in records] == [(0, "1="), (1, "2="), (2, "3="), (3, "4="), (4, "5=")]
    with pytest.raises(ConfigError, match=r"data.val_files is empty; list the .jsonl/.parquet prompt files"):
        read_dataset([], label="data.val_files")


def test_steps_resume_and_filter(tmp_path, tokenizer):
    path = write(tmp_path / "a.jsonl", [f"{i}+{i}=" for i in range(12)])  # 4 tokens below 10, 6 from 10 up
    config = DataConfig(train_files=[path], max_prompt_length=4, truncation="filter", prompts_per_step=4, seed=3)
    loader = PromptLoader(config, tokenizer, dp_rank=1, dp_size=2)
    assert len(loader.prompts.records) == 10 and loader.prompts.num_filtered == 2
    steps = [loader.next_step() for _ in range(4)]
    for step in steps:
        assert len(step.records) == 2
        assert step.token_ids == [tokenizer.encode(r.prompt) for r in step.records]
    resumed = PromptLoader(config, tokenizer, dp_rank=1, dp_size=2)
    fresh = PromptLoader(config, tokenizer, dp_rank=1, dp_size=2)
    fresh.next_step()
    resumed.load_state_dict(fresh.state_dict())
    assert [resumed.next_step().records for _ in range(3)] == [s.records for s in steps[1:]]


def test_over_long_prompt_fails_at_start_up(tmp_path, tokenizer):
    path = write(tmp_path / "a.jsonl", ["1+1=", "12+12="])
    with pytest.raises(DataError, match="prompt index 1 .* has 6 tokens > data.max_prompt_length=5"):
        PromptLoader(DataConfig(train_files=[path], max_prompt_length=5, prompts_per_step=1), tokenizer,
                     dp_rank=0, dp_size=1)
