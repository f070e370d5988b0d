"""The char-level tokenizer: one id per character, chat template, and a save_pretrained round trip."""

import pytest
from transformers import AutoTokenizer

from rlhf.data.char_tokenizer import ARITHMETIC_ALPHABET, build_char_tokenizer
from rlhf.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_one_token_per_character(tokenizer):
    text = "98+93-77="
    ids = tokenizer.encode(text)
    assert ids == [4 + ARITHMETIC_ALPHABET.index(char) for char in text]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 4 + len(ARITHMETIC_ALPHABET)
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2, 3)


def test_unknown_characters_and_special_tokens(tokenizer):
    assert tokenizer.encode("1\n2") == [5, 1, 6]
    assert tokenizer.decode([5, 6, 3]) == "12<eos>"
    assert tokenizer.decode([5, 6, 3], skip_special_tokens=True) == "12"


def test_chat_template_ends_assistant_turns_with_eos(tokenizer):
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "1+2=3<eos>"
    assert tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == "1+2="


def test_save_pretrained_round_trip_needs_no_rlhf_code(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["1+2=", "12+34-5="]
    assert loaded(texts, padding=True)["input_ids"] == tokenizer(texts, padding=True)["input_ids"]
    assert loaded(texts, padding=True)["input_ids"][0][:4] == [0, 0, 0, 0]  # pads on the left
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.eos_token_id == 3 and loaded.decode(loaded.encode("7-8=")) == "7-8="


@pytest.mark.parametrize("alphabet, message", [("", "alphabet is empty"), ("0120", "alphabet repeats '0'")])
def test_bad_alphabet(alphabet, message):
    with pytest.raises(ConfigError, match=message):
        build_char_tokenizer(alphabet)
