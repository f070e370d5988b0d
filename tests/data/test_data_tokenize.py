"""Prompt tokenization: chat template vs text, every truncation policy, and left padding."""

import pytest
import torch

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.config import DataConfig
from rlhf.data.records import PromptRecord
from rlhf.data.tokenize import encode_prompt, left_pad, tokenize_records
from rlhf.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def record(prompt, index=0):
    return PromptRecord(prompt=prompt, data_source="reasoning_gym/chain_sum", ground_truth="1", index=index)


def test_chat_prompt_goes_through_the_chat_template(tokenizer):
    chat = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3="}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert encode_prompt(chat, tokenizer) == tokenizer.encode(text, add_special_tokens=False)
    assert encode_prompt(chat, tokenizer) == tokenizer.encode("12+3=")


def test_chat_prompt_without_template_is_a_config_error(tokenizer):
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        encode_prompt([{"role": "user", "content": "1"}], bare)


@pytest.mark.parametrize("truncation, kept, ids1", [
    ("left", [0, 1, 2], [4 + 3, 4 + 4, 4 + 5]),   # keeps the end "345"
    ("right", [0, 1, 2], [4 + 1, 4 + 2, 4 + 3]),  # keeps the start "123"
    ("filter", [0, 2], None),
])
def test_length_policies(tokenizer, truncation, kept, ids1):
    records = [record("12", 0), record("12345", 1), record("123", 2)]
    out = tokenize_records(records, tokenizer, DataConfig(max_prompt_length=3, truncation=truncation))
    assert [r.index for r in out.records] == kept
    assert out.lengths == [len(ids) for ids in out.token_ids] and max(out.lengths) <= 3
    assert out.num_filtered == (truncation == "filter") and out.num_truncated == (truncation != "filter")
    if ids1 is not None:
        assert out.token_ids[1] == ids1


def test_over_long_prompt_with_error_policy_names_it(tokenizer):
    records = [record("12", 0), record("12345", 1)]
    with pytest.raises(DataError) as info:
        tokenize_records(records, tokenizer, DataConfig(max_prompt_length=4))
    assert str(info.value) == (
        "prompt index 1 (data_source='reasoning_gym/chain_sum') has 5 tokens > data.max_prompt_length=4; "
        "raise the limit or set data.truncation to filter, left or right")


def test_everything_filtered_or_empty_is_an_error(tokenizer):
    config = DataConfig(max_prompt_length=1, truncation="filter")
    with pytest.raises(DataError, match="all 1 prompts are longer than data.max_prompt_length=1"):
        tokenize_records([record("12")], tokenizer, config)
    with pytest.raises(DataError, match="prompt index 0 .* encodes to 0 tokens"):
        tokenize_records([record("")], tokenizer, config)


def test_left_pad_right_aligns():
    tokens_bt, lengths_b = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert torch.equal(tokens_bt, torch.tensor([[5, 6, 7], [0, 0, 8]]))
    assert torch.equal(lengths_b, torch.tensor([3, 1]))
    assert tokens_bt.dtype == torch.int64
