import pytest

from rlhf.data.char_tokenizer import build_chat_char_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_char_tokenizer()


@pytest.fixture(scope="session")
def rewriting_tokenizer():
    """A template that drops `<think>` blocks of earlier assistant turns (as Qwen3's does)."""
    return build_chat_char_tokenizer(strip_think=True)
